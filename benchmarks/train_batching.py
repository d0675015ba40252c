"""Training throughput: length-grouped micro-batches vs the naive padded loop, on the same data.

    python -m benchmarks.train_batching --recipe stories260k [key=value ...] [--epochs 1] [--repeats 3]

Runs the real trainer (train.main.train) in this process once per strategy and repeat, alternating
grouped/padded so machine-load drifts hit both, each for the same number of epochs over the same
records (so the same real tokens), and reports the median real (non-padding) tokens per wall second and per
CPU second of the training steps, and their grouped/padded ratio. Run with OMP_NUM_THREADS=1 on a shared
machine: CPU seconds are then the fair measure.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from recipes import load_config
from recipes.layout import cache_dir
from train.distributed import init_distributed, shutdown_distributed
from train.main import train


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.train_batching", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", required=True)
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.add_argument("--epochs", type=float, default=1.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None, help="also write the results here")
    args = p.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    ctx = init_distributed("cpu")
    features = cache_dir(load_config(args.recipe, args.overrides))  # before output_dir is moved to a temp dir
    runs: dict[str, list[dict]] = {"padded": [], "grouped": []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeats):
            for strategy in ("padded", "grouped") if r % 2 == 0 else ("grouped", "padded"):
                cfg = load_config(args.recipe, [*args.overrides, f"train.batching={strategy}", f"train.epochs={args.epochs}",
                                                "train.max_steps=0", f"output_dir={tmp}/{strategy}{r}",
                                                f"train.cache_dir={features}", "train.resume=false",
                                                "train.eval_max_records=1", "train.eval_every=1000000000",
                                                "logging.backend=none", "logging.progress=false",
                                                "train.checkpoint_every=1000000000"])
                s = train(cfg, ctx)
                runs[strategy].append({"tokens": s["train_tokens"], "wall_s": s["train_time_s"], "cpu_s": s["train_cpu_s"],
                                       "padding": s["padding_fraction"], "steps": s["steps"]})
                print(f"[bench] {strategy} repeat {r}: {s['train_tokens']} tokens, {s['train_time_s']:.1f} s wall, "
                      f"{s['train_cpu_s']:.1f} s CPU, padding {s['padding_fraction']:.1%}", flush=True)
    shutdown_distributed()
    out = {}
    for strategy, rs in runs.items():
        out[strategy] = {"tokens_per_wall_s": statistics.median(x["tokens"] / x["wall_s"] for x in rs),
                         "tokens_per_cpu_s": statistics.median(x["tokens"] / x["cpu_s"] for x in rs),
                         "padding_fraction": rs[0]["padding"], "steps": rs[0]["steps"], "runs": rs}
    out["ratio_wall"] = out["grouped"]["tokens_per_wall_s"] / out["padded"]["tokens_per_wall_s"]
    out["ratio_cpu"] = out["grouped"]["tokens_per_cpu_s"] / out["padded"]["tokens_per_cpu_s"]
    print(f"padded : {out['padded']['tokens_per_wall_s']:.0f} tokens/s wall, {out['padded']['tokens_per_cpu_s']:.0f} "
          f"tokens/CPU-s (padding {out['padded']['padding_fraction']:.1%})")
    print(f"grouped: {out['grouped']['tokens_per_wall_s']:.0f} tokens/s wall, {out['grouped']['tokens_per_cpu_s']:.0f} "
          f"tokens/CPU-s (padding {out['grouped']['padding_fraction']:.1%})")
    print(f"grouped / padded: {out['ratio_wall']:.2f}x (wall), {out['ratio_cpu']:.2f}x (CPU)")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
