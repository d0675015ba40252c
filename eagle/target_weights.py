"""The target's frozen tensors a head needs, read without loading the target: its input embedding and lm_head."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from huggingface_hub import hf_hub_download
from safetensors import safe_open


EMBED_KEYS = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight", "transformer.wte.weight")
LM_HEAD_KEYS = ("lm_head.weight", "model.lm_head.weight")


def load_target_embedding_and_lm_head(target_path: str | Path, revision: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Read ONLY the target's input embedding and lm_head ([V, H] each) from its weight shards.

    Works on a local HF folder or a hub id (downloads the index and only the shards holding these two
    tensors). Tied embeddings (no lm_head tensor) return the embedding twice.
    """
    files = _target_weight_index(str(target_path), revision)  # {tensor name: local shard path (lazy)}
    emb_key = next((k for k in EMBED_KEYS if k in files), None)
    if emb_key is None:
        raise KeyError(f"target {target_path}: no embedding tensor among {EMBED_KEYS}")
    head_key = next((k for k in LM_HEAD_KEYS if k in files), None)
    emb = _read_tensor(files[emb_key](), emb_key)
    lm = _read_tensor(files[head_key](), head_key) if head_key else emb
    return emb, lm


def _target_weight_index(target: str, revision: str | None) -> dict:
    local = Path(target)
    if local.is_dir():
        fetch = lambda name: str(local / name)  # noqa: E731
        exists = lambda name: (local / name).exists()  # noqa: E731
    else:
        def fetch(name):
            return hf_hub_download(target, name, revision=revision)

        def exists(name):
            try:
                fetch(name)
                return True
            except Exception:  # absent file on the Hub (or no network): try the next layout
                return False

    for index_name, single in (("model.safetensors.index.json", "model.safetensors"),
                               ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        if exists(index_name):
            wm = json.loads(Path(fetch(index_name)).read_text())["weight_map"]
            return {k: (lambda f=f: fetch(f)) for k, f in wm.items()}
        if exists(single):
            path = fetch(single)
            keys = _tensor_names(path)
            return {k: (lambda p=path: p) for k in keys}
    raise FileNotFoundError(f"target {target}: no model.safetensors[.index.json] or pytorch_model.bin[.index.json] found")


def _tensor_names(path: str) -> list[str]:
    if path.endswith(".safetensors"):
        with safe_open(path, "pt") as f:
            return list(f.keys())
    return list(torch.load(path, map_location="cpu", weights_only=True, mmap=True).keys())


def _read_tensor(path: str, key: str) -> torch.Tensor:
    if path.endswith(".safetensors"):
        with safe_open(path, "pt") as f:
            return f.get_tensor(key)
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)[key].clone()

