"""What the export checks (eagle/head_checks.py) and the atomic writer (eagle/atomic_folder.py) cost next to writing
the folder, on an EAGLE-2 head of a 1024-wide, 32000-token target (46M parameters, float32), and the finite-weights
test two ways (`is_finite`: aminmax, vs isfinite().all()) on its [32000, 1024] embedding.

    python -m benchmarks.export_checks [--hidden 1024 --vocab 32000 --repeats 3]

Measure with one thread (OMP_NUM_THREADS=1) and say the machine load (`uptime`) next to the numbers."""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from eagle.head import EagleHead, HeadConfig
from eagle.head_checks import check_head_weights, is_finite
from export.engine_formats import write_engine_folder


def best_ms(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * min(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.export_checks", description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    cfg = HeadConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                     num_attention_heads=max(1, args.hidden // 64), num_key_value_heads=max(1, args.hidden // 256),
                     vocab_size=args.vocab)
    sd = {k: v.detach() for k, v in EagleHead(cfg).state_dict().items()}
    emb = sd["embed_tokens.weight"]
    root = Path(tempfile.mkdtemp(prefix="export_checks_"))
    try:
        (root / "head").mkdir()

        def write():
            write_engine_folder(root / "head", root / "out", cfg.to_dict(), sd, overwrite=True)
            shutil.rmtree(root / "out")

        rows = {"isfinite().all() on the embedding": best_ms(lambda: bool(torch.isfinite(emb).all()), args.repeats),
                "is_finite (aminmax) on the embedding": best_ms(lambda: is_finite(emb), args.repeats),
                "check_head_weights (every check)": best_ms(lambda: check_head_weights(cfg, sd, "bench"), args.repeats),
                "write_engine_folder (atomic write)": best_ms(write, args.repeats)}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{sum(v.numel() for v in sd.values()) / 1e6:.1f}M parameters, {torch.get_num_threads()} thread; best of "
          f"{args.repeats}:")
    for name, ms in rows.items():
        print(f"  {name:40s} {ms:8.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
