"""The feature cache computed by vLLM instead of transformers (`data.feature_source=vllm`): the same cache, the same
format, training cannot tell where it came from.

    python data_prep/main.py --recipe R data.feature_source=vllm data.engine_python=/work/venvs/vllm/bin/python

The cache stage hands the tokenized records to engine/vllm_side/capture.py under the engine's interpreter (vLLM's
`extract_hidden_states` method with a hidden-states connector, engine/vllm_side/capture_connector.py), which writes
each record's states to a capture folder beside the cache; this side checks each file (the engine's token ids must
be the record's), turns vLLM's hidden-state ids into the cache's (`capture_layer_ids`: vLLM's id L is the residual
stream before the final norm, the cache's final state is after it, so the target's final RMSNorm is applied here,
`FinalNorm`), writes the records with the same FeatureCacheWriter and deletes each capture file once its record is
committed. Targets whose head_dim vLLM's CPU attention lacks are served as exactly equivalent padded copies
(engine/head_dim_pad.py `servable_target`); their residual streams are the original's. A quantized target
(`target.quantization`) is served as its dequantized float copy (engine/quantized_target.py `engine_target`), whose
states are the in-memory quantized model's; the cache meta records `served_target`.

With `data.backend=openai data.serve=true` the engine is not a second one: data prep starts ONE `vllm serve`
(data_prep/main.py `shared_server`, with engine/vllm_server.py `capture_args`), which answers the regeneration requests
(greedy replies equal to a plain server's: the capture method drafts the token it sampled) and, after tokenize, the
capture requests (`server_capture`: each record's token ids as a /v1/completions prompt with max_tokens 1 and the
file to write), so the cache is the offline engine's; a rerun whose regeneration is done starts it for the cache.

Failures: an engine without the capture support (no `extract_hidden_states`, no hidden-states connector) is one
EngineCaptureError line naming the interpreter and vLLM's refusal; a capture folder that runs out of disk (or any
failed write) keeps every record that was captured (committed to the cache) and names the first failure in one
line; the rerun resumes with the rest (the writer skips committed ids).
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from data_prep.cache_features import CacheStats
from data_prep.feature_cache import FeatureCacheWriter
from data_prep.target import served_target_folder
from eagle.head_kinds import text_config
from eagle.state_files import StateFile, register
from engine.engine_process import EngineError, resolve_engine_python, run_engine_script
from engine.vllm_server import VLLMServer

ENGINE_CAPTURE = "capture"  # the engine-side script (engine/vllm_side/capture.py)
CAPTURE_DIR = "vllm_capture"  # beside the cache (in the data folder): per-record files, deleted once committed
UNREQUESTED = "unrequested"  # in a capture folder: the server connector's default path, for requests naming none
#   (never written: the shared server captures only requests that name their file; its presence means a bug)
CAPTURE_RESULT = register(StateFile(
    "result.json", "DATA_DIR/vllm_capture-SHARD", writer="engine/vllm_side/capture.py (under the engine's interpreter)",
    schema={"files": {"*": str}, "errors": {"*": str}, "error?": str, "*": object},
    rebuild="rerun the cache stage: the engine script writes it fresh (engine.log beside it says why it is incomplete)",
    example={"vllm_version": "0.32.0", "files": {"r00000000": "files/r00000000.safetensors"}, "errors": {}}))


class EngineCaptureError(EngineError):
    """vLLM could not capture the features (no support, a failed write, token ids unlike the record's)."""


def capture_layer_ids(layers: list[int] | None, num_layers: int) -> list[int]:
    """The hidden-state ids vLLM captures: the cache's own (EAGLE-3 [a, b, c, L]), or [L] (EAGLE-2's final state)."""
    return list(layers) if layers is not None else [num_layers]


class FinalNorm:
    """The target's final RMSNorm (weight and eps from its checkpoint and config): vLLM's id-L state -> the cache's
    final (normed) state, computed in float32 as transformers' LlamaRMSNorm does."""

    def __init__(self, target_path: str, config):
        text = text_config(config)
        self.eps = float(getattr(text, "rms_norm_eps", 1e-6))
        self.weight = read_tensor(Path(target_path), "model.norm.weight").float()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


def read_tensor(folder: Path, name: str) -> torch.Tensor:
    """One tensor of a safetensors checkpoint folder (single file or sharded with an index)."""
    index = folder / "model.safetensors.index.json"
    files = ([folder / json.loads(index.read_text())["weight_map"][name]] if index.exists() and
             name in json.loads(index.read_text()).get("weight_map", {}) else sorted(folder.glob("*.safetensors")))
    for f in files:
        with safe_open(str(f), framework="pt") as h:
            if name in h.keys():
                return h.get_tensor(name)
    raise EngineCaptureError(f"{folder}: no tensor {name!r} in its safetensors files (the final norm the cache's "
                             "final state needs); use data.feature_source=transformers for this target")


def features_of(data: dict, ids: list[int], layer_ids: list[int], num_layers: int, norm: FinalNorm,
                where: str) -> torch.Tensor:
    """[T, len(ids) * H] cache row from one capture file ({"hidden_states" [T, n, H], "token_ids" [T]}), checked."""
    token_ids = data["token_ids"].tolist()
    if token_ids != list(ids):
        first = next((i for i, (a, b) in enumerate(zip(token_ids, ids)) if a != b), min(len(token_ids), len(ids)))
        raise EngineCaptureError(f"{where}: the engine captured other token ids than the record's (first difference "
                                 f"at position {first}, {len(token_ids)} vs {len(ids)} tokens)")
    h = data["hidden_states"].float()  # [T, n, H]
    if h.dim() != 3 or h.shape[:2] != (len(ids), len(layer_ids)):
        raise EngineCaptureError(f"{where}: hidden_states of shape {tuple(h.shape)}, expected ({len(ids)}, "
                                 f"{len(layer_ids)}, H)")
    parts = [norm(h[:, i]) if j == num_layers else h[:, i] for i, j in enumerate(layer_ids)]
    return torch.cat(parts, dim=-1)  # [T, n * H]


def staging_bytes_per_token(hidden_size: int, layers: list[int] | None) -> int:
    """Disk the capture folder holds per token until its record is committed: the engine's states in float32."""
    return hidden_size * len(layers or [None]) * 4 + 8


def capture_work_dir(data_dir: Path, shard: int) -> Path:
    """The capture folder of one shard (beside the cache); its files/ holds the per-record states until committed."""
    return Path(data_dir) / f"{CAPTURE_DIR}-{shard:05d}"


def engine_capture(engine_python: str, model: str, dtype: str, records: list[dict], layer_ids: list[int],
                   capture_dir: Path, seed: int, max_model_len: int, log_path: Path) -> dict:
    """Run engine/vllm_side/capture.py on `records` ({"name", "input_ids"}); its RESULT (see that file). The engine
    ending badly is the engine's EngineError line; vLLM refusing the capture, an EngineCaptureError."""
    capture_dir.mkdir(parents=True, exist_ok=True)
    request = {"model": model, "dtype": dtype, "max_model_len": max_model_len, "layer_ids": layer_ids,
               "capture_dir": str(capture_dir / "files"), "seed": seed, "records": records}
    result = run_engine_script(engine_python, ENGINE_CAPTURE, request, capture_dir / "request.json",
                               capture_dir / "result.json", log_path, CAPTURE_RESULT, "the vLLM capture")
    if "error" in result:
        raise EngineCaptureError(f"vLLM at {engine_python} cannot capture hidden states (speculative method "
                                 f"extract_hidden_states + a hidden-states KV connector, vllm >= 0.32): "
                                 f"{result['error']}; use data.feature_source=transformers or that vLLM")
    return result


def server_capture(server: VLLMServer, records: list[dict], capture_dir: Path, concurrency: int,
                   timeout_s: float) -> dict:
    """The engine script's RESULT from a running capture server (engine/vllm_server.py `capture_args`): each record
    ({"name", "input_ids"}) is one /v1/completions request with its token ids as the prompt, max_tokens 1, greedy, and
    `kv_transfer_params.hidden_states_path` = capture_dir/NAME.safetensors (`concurrency` in flight, batched by
    vLLM's scheduler); the file is read once the connector releases its `.lock`."""
    capture_dir.mkdir(parents=True, exist_ok=True)
    out = {"vllm_version": "server", "files": {}, "errors": {}}

    def one(rec: dict) -> tuple[str, str, str]:
        path = capture_dir / f"{rec['name']}.safetensors"
        body = {"model": server.served_model_name, "prompt": list(rec["input_ids"]), "max_tokens": 1,
                "temperature": 0.0, "kv_transfer_params": {"hidden_states_path": str(path)}}
        req = urllib.request.Request(server.url + "/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                r.read()
        except urllib.error.HTTPError as e:
            return rec["name"], "error", f"HTTP {e.code}: {' '.join(e.read().decode(errors='replace').split())[:300]}"
        except (urllib.error.URLError, OSError) as e:
            raise EngineCaptureError(server.died() or f"the capture server at {server.url} did not answer: {e}") \
                from None
        lock, deadline = f"{path}.lock", time.monotonic() + timeout_s
        if os.path.exists(lock):  # the connector holds it exclusively until the file is written
            with open(lock) as f:
                while True:
                    try:
                        fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() > deadline:
                            return rec["name"], "error", f"the engine did not finish writing it in {timeout_s:.0f} s"
                        time.sleep(0.02)
        if path.exists():
            return rec["name"], "file", str(path)
        err = Path(f"{path}.error")
        return rec["name"], "error", err.read_text() if err.exists() else "the engine wrote no file for it"

    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        for name, kind, value in pool.map(one, records):
            out["files" if kind == "file" else "errors"][name] = value
    out["capture_s"] = time.perf_counter() - start
    return out


def cache_shard_vllm(cfg, target_path: str, config, records: list[dict], writer: FeatureCacheWriter, shard: int,
                     num_shards: int, layers: list[int] | None, data_dir: Path, server=None) -> CacheStats:
    """`cache_features.cache_shard` with vLLM computing the states (module docstring). `server`: a callable giving
    the running capture server (data prep's one server for regeneration and capture, `engine.vllm_server.capture_args`),
    called only when there is work; None = a second, offline engine (engine/vllm_side/capture.py)."""
    mine = [r for i, r in enumerate(records) if i % num_shards == shard]
    stats = CacheStats(records_total=len(mine))
    todo = [r for r in mine if r["id"] not in writer]
    stats.records_skipped_done = len(mine) - len(todo)
    if not todo:
        return stats
    num_layers = int(text_config(config).num_hidden_layers)
    layer_ids = capture_layer_ids(layers, num_layers)
    work = capture_work_dir(data_dir, shard)
    limit = int(getattr(text_config(config), "max_position_embeddings", 0) or 0)
    longest = max(len(r["input_ids"]) for r in todo) + 1  # the prompt and the one token generated
    norm = FinalNorm(target_path, config)
    names = {f"r{i:08d}": r for i, r in enumerate(todo)}  # file names free of whatever characters ids hold
    start = time.perf_counter()
    named = [{"name": n, "input_ids": list(r["input_ids"])} for n, r in names.items()]
    try:
        if server is not None:
            result = server_capture(server(), named, work / "files", int(cfg.data.gen_batch_size),
                                    float(cfg.data.api_timeout_s))
        else:
            model = served_target_folder(cfg.target, target_path, config, work / "models")
            result = engine_capture(resolve_engine_python(cfg.data.engine_python), model, str(cfg.target.dtype),
                                    named, layer_ids, work, int(cfg.seed), min(longest, limit) if limit else longest,
                                    work / "engine.log")
        for name, path in result["files"].items():
            rec = names[name]
            hidden = features_of(load_file(path), rec["input_ids"], layer_ids, num_layers, norm,
                                 f"{path} (record {rec['id']})")
            writer.add(rec["id"], torch.tensor(rec["input_ids"]), hidden, torch.tensor(rec["loss_mask"]))
            stats.records_cached += 1
            stats.tokens_cached += len(rec["input_ids"])
    finally:
        writer.flush()  # what was read is committed, whatever stopped the loop; then the capture files may go
        shutil.rmtree(work / "files", ignore_errors=True)
    stats.seconds = time.perf_counter() - start  # engine start-up included: what a user waits for
    print(f"[cache] vLLM {result.get('vllm_version')}: "
          + (f"engine start {result['load_s']:.1f} s, " if "load_s" in result else "")
          + f"capture {result.get('capture_s', 0):.1f} s for {len(result['files'])} records", flush=True)
    errors = result.get("errors") or {}
    if errors:
        name, why = next(iter(errors.items()))
        raise EngineCaptureError(
            f"the vLLM capture could not write {len(errors)} of {len(names)} records to {work / 'files'} (record "
            f"{names[name]['id']}: {why}); the {stats.records_cached} captured are committed to the cache: free disk "
            "space there and rerun, the cache stage resumes with the rest")
    return stats


__all__ = ["EngineCaptureError", "capture_layer_ids", "FinalNorm", "features_of", "engine_capture",
           "server_capture", "capture_work_dir", "cache_shard_vllm", "UNREQUESTED", "staging_bytes_per_token",
           "CAPTURE_DIR"]
