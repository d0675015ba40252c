"""What computes the stream producer's features (train/stream_producer.py), one object per train.stream_producer:

- `hf` (HFCapture): the recipe's target under transformers in the producer process, one forward per record
  (data_prep/cache_features.py `final_hidden_states`): the offline cache's features, bit for bit.
- `vllm` (VLLMCapture): a vLLM server the producer starts at its start and stops at its end (`vllm serve` with the
  capture arguments data prep's shared server uses, engine/vllm_server.py `capture_args`, under data.engine_python or
  $EAGLE_VLLM_PYTHON), each shard's records sent to it as capture requests (data_prep/vllm_features.py
  `server_capture`, data.gen_batch_size in flight) and turned into the cache's features as data.feature_source=vllm
  does (`features_of`: token ids checked, the final norm applied): the offline-from-vLLM cache's features. The capture
  files of the shard being captured sit in STREAM_DIR/vllm/files (float32, deleted as each record is read: at most
  one shard's worth beside the window), the server's log in STREAM_DIR/vllm/server.log.

Each has `what` (for the heartbeat), `open()` -> the features' meta (as the offline cache's), `states(ids, token_ids)`
-> one [T, W] float tensor per record, and `close()`.
"""
from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

from safetensors.torch import load_file

from data_prep.cache_features import final_hidden_states
from data_prep.feature_layers import feature_layers
from data_prep.target import (load_target_config, load_target_model, quantization_meta, resolve_target_path,
                              served_target_folder, target_config_hash)
from data_prep.vllm_features import EngineCaptureError, FinalNorm, capture_layer_ids, features_of, server_capture
from eagle.device import pick_device
from eagle.head_kinds import text_config
from eagle.state_files import StateFile, read_json_state, register, write_json_state
from engine.engine_process import resolve_engine_python
from engine.vllm_server import VLLMServer, capture_args, serve_args

SERVER_STATE = register(StateFile(
    "server.json", "STREAM_DIR/vllm", writer="train/stream_capture.py", schema={"pid": int},
    rebuild="delete it (a vLLM server of a killed producer may then outlive it: end that pid's process group)",
    when_missing="no vLLM producer has started a server here", example={"pid": 1}))


def features_meta(cfg, target_path: str, config) -> tuple[dict, list[int] | None]:
    """(the offline cache's meta for this target, as data prep's cache stage writes it, without the tokenized file's
    hash; the head kind's feature layers or None)."""
    text = text_config(config)
    meta = {"target": target_path, "config_hash": target_config_hash(config), "hidden_size": int(text.hidden_size),
            "vocab_size": int(text.vocab_size), "target_dtype": cfg.target.dtype}
    meta.update(quantization_meta(cfg.target))  # a quantized target's states (none: the legacy meta), as data prep's
    layers = feature_layers(cfg.head, config)
    if layers is not None:
        meta["feature_layers"] = layers
    return meta, layers


class HFCapture:
    what = "the target under transformers"

    def __init__(self, cfg, sdir: Path, index: int = 0):
        self.cfg = cfg

    def open(self) -> dict:
        target_path = resolve_target_path(self.cfg.target)
        self.model = load_target_model(self.cfg.target, pick_device(self.cfg.data.device), target_path)
        meta, self.layers = features_meta(self.cfg, target_path, self.model.config)
        return meta

    def states(self, ids: list[str], token_ids: list[list[int]]) -> list:
        return [final_hidden_states(self.model, t, self.layers) for t in token_ids]

    def close(self) -> None:
        pass


class VLLMCapture:
    what = "a vLLM capture server"

    def __init__(self, cfg, sdir: Path, index: int = 0):  # producer `index` (train.stream_producers): its own server
        self.cfg, self.work = cfg, Path(sdir) / ("vllm" if index == 0 else f"vllm-{index}")
        self.server: VLLMServer | None = None

    def open(self) -> dict:
        cfg = self.cfg
        target_path = resolve_target_path(cfg.target)
        config = load_target_config(target_path, cfg.target.revision)
        meta, layers = features_meta(cfg, target_path, config)
        self.num_layers = int(text_config(config).num_hidden_layers)
        self.layer_ids = capture_layer_ids(layers, self.num_layers)
        self.norm = FinalNorm(target_path, config)
        engine_python = resolve_engine_python(cfg.data.engine_python)
        shutil.rmtree(self.work / "files", ignore_errors=True)  # a killed run's capture files
        self.work.mkdir(parents=True, exist_ok=True)
        model = served_target_folder(cfg.target, target_path, config, self.work / "models")
        limit = int(getattr(text_config(config), "max_position_embeddings", 0) or 0)
        context = cfg.data.max_length + 1  # the prompt and the one token generated
        args = (serve_args(cfg.target.dtype, cfg.seed, min(context, limit) if limit else context, None, self.work)
                + capture_args(self.layer_ids, self.work / "unrequested") + [str(a) for a in cfg.data.serve_args])
        self.stop_orphan()
        self.server = VLLMServer(engine_python, model, self.work / "server.log", served_model_name="target",
                                 args=args).start()
        write_json_state(self.work / "server.json", {"pid": self.server.proc.pid}, SERVER_STATE)
        try:
            self.server.wait_ready()  # a failed start is one EngineError line (and the server stopped)
        except BaseException:
            self.server.stop()
            raise
        return meta

    def stop_orphan(self) -> None:
        """The server of a producer killed with -9 (its own process group, so it outlived it): ended before a new
        one starts."""
        old = read_json_state(self.work / "server.json", SERVER_STATE)
        if old is None:
            return
        try:
            os.killpg(old["pid"], signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        (self.work / "server.json").unlink(missing_ok=True)

    def states(self, ids: list[str], token_ids: list[list[int]]) -> list:
        named = [{"name": f"r{k:08d}", "input_ids": t} for k, t in enumerate(token_ids)]
        result = server_capture(self.server, named, self.work / "files", int(self.cfg.data.gen_batch_size),
                                float(self.cfg.data.api_timeout_s))
        errors = result.get("errors") or {}
        if errors:
            name, why = next(iter(errors.items()))
            raise EngineCaptureError(f"the vLLM capture server could not capture record {ids[int(name[1:])]} "
                                     f"({len(errors)} of {len(ids)} in this shard failed): {why}; rerun the same "
                                     "command (nothing consumed is lost; this shard is captured again)")
        out = []
        for k, (rid, t) in enumerate(zip(ids, token_ids)):
            path = Path(result["files"][f"r{k:08d}"])
            out.append(features_of(load_file(str(path)), t, self.layer_ids, self.num_layers, self.norm,
                                   f"{path} (record {rid})"))
            path.unlink(missing_ok=True)
            Path(f"{path}.lock").unlink(missing_ok=True)
        return out

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None
            (self.work / "server.json").unlink(missing_ok=True)


CAPTURES = {"hf": HFCapture, "vllm": VLLMCapture}  # train.stream_producer -> its capture (recipes/train.py names them)


def capture_for(cfg, sdir: Path, index: int = 0):
    return CAPTURES[cfg.train.stream_producer](cfg, sdir, index)


__all__ = ["SERVER_STATE", "CAPTURES", "HFCapture", "VLLMCapture", "capture_for", "features_meta"]
