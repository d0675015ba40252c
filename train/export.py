"""Export the trained head in the official EAGLE format: config.json + model.safetensors (+ pytorch_model.bin),
loadable by `eagle.head.load_head`, `EaModel.from_pretrained(ea_model_path=...)` and the reference code.
EAGLE-1/2 heads: the released yuhuili/EAGLE-* layout (byte-identical to earlier exports: tests/test_export_pin.py).
EAGLE-3 heads: the released yuhuili/EAGLE3-* / SpecForge layout (`Eagle3Head.save_pretrained`: config.json with
architectures ["LlamaForCausalLMEagle3"], draft_vocab_size, eagle_config.eagle_aux_hidden_state_layer_ids; weights
midlayer.* / fc / norm / lm_head in the export dtype, d2t int64, t2d bool, no embed_tokens), which the EAGLE-3
reference code, vLLM (method "eagle3") and SGLang (EAGLE3) load.
The folder also carries `recipe.yaml` and `train_summary.json` (read by the model card)."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from omegaconf import OmegaConf

from eagle.head import Eagle3Head, EagleHead, head_class

EXPORT_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
RECIPE_FILE = "recipe.yaml"
SUMMARY_FILE = "train_summary.json"


def export_dir(cfg) -> Path:
    """export.dir, or {output_dir}/head."""
    return Path(cfg.export.dir or Path(cfg.output_dir) / "head")


def _cpu_copy(v: torch.Tensor) -> torch.Tensor:
    """float32 for floating tensors; integer / bool buffers (EAGLE-3's d2t, t2d) keep their dtype."""
    return (v.detach().float() if v.is_floating_point() else v.detach()).cpu().clone()


def full_state_dict(module, zero_stage: int) -> dict[str, torch.Tensor]:
    """CPU copy of the module's weights (floating ones in float32); under ZeRO-3 the partitions are gathered
    (collective)."""
    if zero_stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            return {k: _cpu_copy(v) for k, v in module.state_dict().items()}
    return {k: _cpu_copy(v) for k, v in module.state_dict().items()}


def standalone_head(module, zero_stage: int, device, dtype) -> "EagleHead | Eagle3Head":
    """A plain head (EagleHead / Eagle3Head) with the engine's current weights (no ZeRO hooks): for evaluation and
    export."""
    if zero_stage < 3:
        return module  # full parameters live on every rank already
    head = head_class(module.config)(module.config)
    head.load_state_dict(full_state_dict(module, zero_stage), strict=True)
    return head.to(device=device, dtype=dtype).eval()


def export_head(state_dict: dict[str, torch.Tensor], config, out_dir: Path, dtype: str, legacy_bin: bool,
                recipe=None, summary: dict | None = None) -> Path:
    """Write the head folder atomically (a temporary sibling renamed into place). `config` decides the layout."""
    head = head_class(config)(config)
    head.load_state_dict(state_dict, strict=True)
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    head.save_pretrained(tmp, legacy_bin=legacy_bin, dtype=EXPORT_DTYPES[dtype])
    if recipe is not None:
        (tmp / RECIPE_FILE).write_text(OmegaConf.to_yaml(recipe, resolve=True))
    if summary is not None:
        (tmp / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    if out_dir.exists():
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
    return out_dir
