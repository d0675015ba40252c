"""Attention kernels for decoding on CPU: which one is faster depends on the shape, not on the model.

For tiny heads (head_dim <= 8) and a few rows or more, three batched matmuls beat sdpa's CPU flash kernel,
whose per-head blocking costs more than the arithmetic at these sizes. `FusedDecoder` asks
`use_bmm_attention` per forward (tree verification). The draft head keeps sdpa: its levels carry a
per-call mask that bmm would first have to repeat per kv group, and measured in the drafting loop that
made 60/5/10 drafting slower (1.32 vs 1.25 ms), whatever the kernel alone gains.
"""
from __future__ import annotations

import torch

# Tree verification on tiny heads: with head_dim <= 8, bmm attention beats sdpa's CPU flash kernel from about
# 12 query rows. Kernel alone (benchmarks/attention_paths.py; 8 heads / 4 kv, 220 keys): 8 rows 36 vs 44 us,
# 16 rows 54 vs 79, 60 rows x 260 keys 183 vs 271. In the whole stories260K verification forward (5 layers,
# 200 cached positions) the crossover is later: 8 rows 0.85 vs 0.82 ms, 12 rows 0.94 vs 0.95, 16 rows 1.02
# vs 1.10, 60 rows 2.09 vs 2.50. At head_dim 16 and above sdpa wins (4 heads, 16 rows: 42 vs 36 us).
# float32 only: sdpa accumulates bf16 in float32.
BMM_ATTENTION_MAX_HEAD_DIM = 8
BMM_ATTENTION_MIN_ROWS = 12


def use_bmm_attention(rows: int, head_dim: int, dtype: torch.dtype) -> bool:
    """True when `bmm_attention` is the faster kernel for `rows` query rows (float32 only: sdpa accumulates
    half precision in float32, bmm would not)."""
    return rows >= BMM_ATTENTION_MIN_ROWS and head_dim <= BMM_ATTENTION_MAX_HEAD_DIM and dtype == torch.float32


def bmm_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(D) + mask) v for q [1, h, n, D], k, v [1, kv, L, D], bias [g n, L] additive
    (g = h / kv: query head i g + a reads kv head i, as HF's repeat_kv). Returns [n, h D], the o_proj input.

    Three batched matmuls over the kv groups; P V is computed as (V^T P^T)^T because MKL is several times
    slower on an output only D = 8 wide than on one n wide."""
    _, h, n, d = q.shape
    kv = k.shape[1]
    scores = torch.baddbmm(bias, q[0].reshape(kv, h // kv * n, d), k[0].transpose(1, 2), alpha=d ** -0.5)  # [kv, g n, L]
    probs = torch.softmax(scores, dim=-1)
    out = torch.bmm(v[0].transpose(1, 2), probs.transpose(1, 2))  # [kv, D, g n]
    return out.view(kv, d, h // kv, n).permute(3, 0, 2, 1).reshape(n, h * d)  # [n, (kv g) D] in one copy
