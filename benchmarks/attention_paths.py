"""Micro-benchmark behind eagle/attention.py's kernel choice: sdpa (CPU flash kernel) vs `bmm_attention`
for tree-verification shapes (GQA, additive tree mask), one thread (--threads), median of 5 bursts.

    python -m benchmarks.attention_paths [--threads 1]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from eagle.attention import bmm_attention

SHAPES = [  # (query heads, kv heads, query rows, keys, head_dim)
    (8, 4, 4, 220, 8), (8, 4, 6, 220, 8), (8, 4, 8, 220, 8), (8, 4, 12, 220, 8), (8, 4, 16, 220, 8), (8, 4, 20, 220, 8),
    (4, 2, 4, 220, 16), (4, 2, 6, 220, 16), (4, 2, 16, 220, 16),
    (8, 4, 60, 260, 8), (8, 4, 20, 220, 32), (12, 4, 20, 500, 64), (12, 12, 60, 300, 64), (16, 8, 16, 1000, 64),
]


def bench_us(fn, calls: int = 300) -> float:
    for _ in range(20):
        fn()
    bursts = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(calls // 5):
            fn()
        bursts.append((time.perf_counter() - t) / (calls // 5) * 1e6)
    return statistics.median(bursts)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.attention_paths", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    print("heads kv rows keys head_dim | sdpa us | bmm us | max abs diff")
    for h, kv, n, L, d in SHAPES:
        q, k, v = (torch.randn(1, c, m, d, generator=g) for c, m in ((h, n), (kv, L), (kv, L)))
        mask = torch.zeros(1, 1, n, L)
        tree = torch.rand(n, n, generator=g) < 0.5
        tree.fill_diagonal_(False)
        mask[0, 0, :, L - n:].masked_fill_(tree, torch.finfo(torch.float32).min)
        bias = mask[0, 0].repeat(h // kv, 1)
        def sdpa():  # in the layout o_proj reads, as bmm_attention returns it
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=h != kv)[0].transpose(0, 1).reshape(n, h * d)

        diff = (bmm_attention(q, k, v, bias) - sdpa()).abs().max().item()
        t_sdpa = bench_us(sdpa)
        t_bmm = bench_us(lambda: bmm_attention(q, k, v, bias))
        print(f"{h:5d} {kv:2d} {n:4d} {L:4d} {d:8d} | {t_sdpa:7.1f} | {t_bmm:6.1f} | {diff:.1e}")


if __name__ == "__main__":
    main()
