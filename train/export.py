"""The trainer's export: the trained head in the official EAGLE format, config.json + model.safetensors (+
pytorch_model.bin), loadable by `eagle.head.load_head`, `EaModel.from_pretrained(ea_model_path=...)` and the reference
code. (What is made from such a folder, engine formats, drift checks, the model card and the Hub push, is the export
stage, export/, one layer above the trainer: with `export.push_to_hub` the trainer runs its Hub push as the next
command, and `python -m train.export` runs its command, export/cli.py, under the name it was published with.)
EAGLE-1/2 heads: the released yuhuili/EAGLE-* layout (byte-identical to earlier exports: tests/test_export_pin.py).
EAGLE-3 heads: the released yuhuili/EAGLE3-* / SpecForge layout (`Eagle3Head.save_pretrained`: config.json with
architectures ["LlamaForCausalLMEagle3"], draft_vocab_size, eagle_config.eagle_aux_hidden_state_layer_ids; weights
midlayer.* / fc / norm / lm_head in the export dtype, d2t int64, t2d bool, no embed_tokens), which the EAGLE-3
reference code, vLLM (method "eagle3") and SGLang (EAGLE3) load.
The folder also carries `recipe.yaml` and `train_summary.json` (read by the model card)."""
from __future__ import annotations

import os
import runpy
import subprocess
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf

from eagle.atomic_folder import write_folder
from eagle.cli_errors import UserError
from eagle.head_checks import check_head_weights
from eagle.head_files import RECIPE_FILE, STORED_RECIPE, SUMMARY_FILE, TRAIN_SUMMARY, head_class
from eagle.head_module import HeadModule
from eagle.state_files import write_json_state, write_yaml_state
from train.distributed import import_deepspeed
from train.divergence import DivergenceError

MAX_ABS_WEIGHT = 1e4  # a head weight beyond this has exploded (trained heads stay within ~10)
EXPORT_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def _cpu_copy(v: torch.Tensor) -> torch.Tensor:
    """float32 for floating tensors; integer / bool buffers (EAGLE-3's d2t, t2d) keep their dtype."""
    return (v.detach().float() if v.is_floating_point() else v.detach()).cpu().clone()


def full_state_dict(module, zero_stage: int) -> dict[str, torch.Tensor]:
    """CPU copy of the module's weights (floating ones in float32); under ZeRO-3 the partitions are gathered
    (collective)."""
    if zero_stage == 3:
        deepspeed = import_deepspeed()  # lazy (inside): a second at import; only ZeRO-3 needs it

        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            return {k: _cpu_copy(v) for k, v in module.state_dict().items()}
    return {k: _cpu_copy(v) for k, v in module.state_dict().items()}


def standalone_head(module, zero_stage: int, device, dtype) -> HeadModule:
    """A plain head (the module of its kind) with the engine's current weights (no ZeRO hooks): for evaluation and
    export."""
    if zero_stage < 3:
        return module  # full parameters live on every rank already
    head = head_class(module.config)(module.config)
    head.load_state_dict(full_state_dict(module, zero_stage), strict=True)
    return head.to(device=device, dtype=dtype).eval()


def check_exportable(state_dict: dict[str, torch.Tensor], dtype: str, out_dir: Path) -> None:
    """Refuse weights that are non-finite, exploded, or overflow the export dtype (the old export stays)."""
    for name, w in state_dict.items():
        if not w.is_floating_point():  # integer/bool buffers (EAGLE-3 d2t, t2d) are not weights
            continue
        cast = w.to(EXPORT_DTYPES[dtype])
        if not bool(torch.isfinite(cast).all()):
            raise DivergenceError(f"not exporting to {out_dir}: {name} holds NaN/inf in {dtype} "
                                  f"(max |w| {float(w.abs().max()):.3g}); the previous export, if any, is unchanged")
        peak = float(w.abs().max()) if w.numel() else 0.0
        if peak > MAX_ABS_WEIGHT:
            raise DivergenceError(f"not exporting to {out_dir}: {name} has exploded (max |w| {peak:.3g} > {MAX_ABS_WEIGHT:g}); "
                                  "the previous export, if any, is unchanged")


def export_head(state_dict: dict[str, torch.Tensor], config, out_dir: Path, dtype: str, legacy_bin: bool,
                recipe=None, summary: dict | None = None) -> Path:
    """Write the head folder atomically (eagle/atomic_folder.py: a temporary sibling moved into place, the run's old
    export replaced whole); `config` decides the layout. Checked first (nothing written otherwise): finite, not
    exploded, fits the export dtype, and the checks every export shares (eagle/head_checks.py)."""
    out_dir = Path(out_dir)
    check_exportable(state_dict, dtype, out_dir)
    check_head_weights(config, state_dict, f"not exporting to {out_dir}")
    head = head_class(config)(config)
    head.load_state_dict(state_dict, strict=True)

    def fill(tmp: Path) -> None:
        head.save_pretrained(tmp, legacy_bin=legacy_bin, dtype=EXPORT_DTYPES[dtype])
        if recipe is not None:
            write_yaml_state(tmp / RECIPE_FILE, OmegaConf.to_container(recipe, resolve=True), STORED_RECIPE,
                             text=OmegaConf.to_yaml(recipe, resolve=True))
        if summary is not None:
            write_json_state(tmp / SUMMARY_FILE, summary, TRAIN_SUMMARY, indent=2)

    return write_folder(out_dir, fill, overwrite=True)  # the run's own head folder: a rerun replaces it


LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def push_exported_head(head_dir: Path) -> None:
    """export.push_to_hub: push the head just exported (rank 0) with the export stage's own command, `python -m
    export.hub --recipe {head}/recipe.yaml --head {head}`, in a process of its own: the export stage sits above the
    trainer (docs/design.md, "Layout and ownership"), so the trainer runs it as the pipeline's next command rather
    than importing it. Its output passes through; its one-line error (no token, no network...) becomes this run's,
    naming the exported head, which stays."""
    cmd = [sys.executable, "-m", "export.hub", "--recipe", str(Path(head_dir) / RECIPE_FILE), "--head", str(head_dir)]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}  # not a rank of this run's launch
    proc = subprocess.run(cmd, stderr=subprocess.PIPE, text=True, env=env)
    lines = proc.stderr.splitlines(keepends=True)
    sys.stderr.write("".join(lines if proc.returncode == 0 else lines[:-1]))
    if proc.returncode != 0:
        last = lines[-1].strip() if lines else f"exit code {proc.returncode}"
        raise UserError(f"the head is exported to {head_dir} but the Hub push failed: {last.removeprefix('error: ')}")


if __name__ == "__main__":  # `python -m train.export`: the export stage's command (export/cli.py), under its published
    # name; run, not imported: export/ sits above train/
    runpy.run_module("export.cli", run_name="__main__", alter_sys=True)
