"""Attention kernels for decoding on CPU: which one is faster depends on the shape, not on the model.

`sdpa_attention` runs a single query row (a vanilla decode step) with the g query heads that share a kv head
folded into one head of g rows: the CPU flash kernel then reads each K/V block once per kv head instead of
once per query head (`enable_gqa` re-reads it g times). In the stories260K / tiny-Llama decode step: 0.587 ->
0.583 ms at 480 cached positions, 0.91 -> 0.83 ms at 2048. With several masked rows (tree levels and
verification) the fold needs the mask repeated per head and was slower in the same measurement (an 8-node
verification 0.74 -> 0.87 ms, 20/7/2 drafting 1.09 -> 1.25 ms), so those keep `enable_gqa`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

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


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """sdpa for q [1, h, n, D], k, v [1, kv, L, D] (query head i reads kv head i // g, as HF's repeat_kv),
    mask None or broadcastable to [1, h, n, L] (bool or additive). Returns [n, h D], the o_proj input."""
    _, h, n, d = q.shape
    kv = k.shape[1]
    if n == 1:  # fold: [1, kv, g, D] queries, each K/V block read once per kv head; a [.., 1, L] mask broadcasts
        out = F.scaled_dot_product_attention(q.reshape(1, kv, h // kv, d), k, v, attn_mask=mask)  # [1, kv, g, D]
        return out.reshape(1, h * d)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=kv != h)  # [1, h, n, D]
    return out[0].transpose(0, 1).reshape(n, h * d)
