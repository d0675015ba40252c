"""The plan of every shipped 7-8B / 8x7B recipe on 8 x 24 GB GPUs (RTX 3090) as one markdown table
(docs/results/real_shapes.md).

    python -m benchmarks.plan_table [--gpus 8] [--gpu-mem-gb 24]
"""
from __future__ import annotations

import argparse
import sys

from recipes import load_config
from train.plan import GB, Hardware, build_plan

RECIPES = [("llama3-8b", []), ("llama2-chat-7b", []), ("vicuna-7b", []), ("qwen2-7b", []), ("mixtral-8x7b", []),
           ("mixtral-8x7b", ["train.mode=online"]), ("llama3-8b", ["train.loss_chunk=0"]),
           ("llama3-8b-eagle3", []), ("llama2-chat-7b-eagle3", []), ("vicuna-7b-eagle3", []), ("qwen2-7b-eagle3", []),
           ("mixtral-8x7b-eagle3", [])]
COLUMNS = {  # column -> item-name prefixes summed into it
    "states": ("head params", "head grads", "fp32 master", "AdamW", "optimizer step"),
    "frozen": ("frozen", "target forward"),
    "activations": ("head activations", "backward transients", "micro-batch"),
    "loss": ("token-loss",),
    "DS buckets": ("DeepSpeed",),
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.plan_table", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=8)
    p.add_argument("--gpu-mem-gb", type=float, default=24.0)
    args = p.parse_args(argv)

    print("| recipe | head params | " + " | ".join(COLUMNS) + " | peak GB (phase) | fits? | cache GB (bf16) | prep h | "
          "train h |")
    print("|---" * (len(COLUMNS) + 7) + "|")
    for recipe, over in RECIPES:
        cfg = load_config(recipe, over)
        plan = build_plan(cfg, Hardware(gpus=args.gpus, gpu_mem_gb=args.gpu_mem_gb))
        mem = [i for i in plan.memory if i.name != "allocator reserve"]
        cols = [sum(i.bytes for i in mem if i.name.startswith(pre)) / GB for pre in COLUMNS.values()]
        hours = {i.name: i.bytes / 3600 for i in plan.time}
        prep = hours["data prep: regenerate replies"] + hours["data prep: cache features (prefill)"]
        peak = plan.total - sum(i.bytes for i in plan.memory if i.name == "allocator reserve")
        verdict = "fits" if plan.fits else "no: " + (plan.knobs[0] if plan.knobs else "more memory")
        print(f"| {recipe}{' ' + ' '.join(over) if over else ''} | {plan.shape.head_trainable / 1e6:.0f}M | "
              + " | ".join(f"{c:.2f}" for c in cols)
              + f" | {peak / GB:.1f} ({plan.peak_phase}) | {verdict} | {plan.disk[0].bytes / GB:.0f} | {prep:.1f} | "
              f"{hours['training']:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
