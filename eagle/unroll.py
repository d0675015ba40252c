"""The training-time test's self-fed steps, shared by both head kinds (EAGLE-3's TTT, EAGLE-2's HASS-style alignment).

Step 1 runs the head over every position t of the true features (causal). Step j >= 2 at index t feeds the head its
OWN step j-1 output as the feature, with the data's token x_{t+j}, at position t + j - 1, and attends to the step-1
keys at indices <= t plus its own keys of steps 2..j (the diagonal) — exactly what decoding sees for a drafted chain.
A head kind says only how a step's attention input and residual are made from (token embedding, previous hidden)
(`prepare`) and how the layer finishes from the residual and the attention output (`finish`).
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F

from eagle.layers import Attention, Rotary, accumulation_dtype
from eagle.sliding_window import WINDOW_QUERY_BLOCK, visible, windowed_attention

UNROLL_ROW_CHUNKS = 4  # the query rows of steps >= 2 are split into this many causal chunks


def prefix_diag_attention(q, k1, v1, bias, dk, dv, diag_bias=None):
    """Attention of unrolled step j: each query row r attends to the step-1 keys (additive bias masks the ones after
    its index / padding) and to its OWN keys of steps 2..j (the diagonal; diag_bias [n] additive, None = all seen).
    q [B, h, R, D]; k1, v1 [B, kv, S, D]; bias [B|1, R, S]; dk, dv [B, kv, R, n, D] -> [B, h, R, D]."""
    B, h, R, D = q.shape
    kv, S, n = k1.shape[1], k1.shape[2], dk.shape[3]
    g = h // kv
    qg = q.reshape(B, kv, g * R, D) * (1.0 / math.sqrt(D))  # query heads of a kv group stacked: no K/V copies
    s_prefix = (qg @ k1.transpose(-1, -2)).view(B, kv, g, R, S) + bias[:, None, None]  # [B, kv, g, R, S]
    s_diag = (qg.view(B, kv, g, R, 1, D) * dk[:, :, None]).sum(-1)  # [B, kv, g, R, n]
    if diag_bias is not None:
        s_diag = s_diag + diag_bias
    s = torch.cat([s_prefix, s_diag], dim=-1)  # [B, kv, g, R, S + n]
    p = s.softmax(-1, dtype=accumulation_dtype(q.dtype)).to(q.dtype)
    o = (p[..., :S].reshape(B, kv, g * R, S) @ v1).view(B, kv, g, R, D)
    o = o + (p[..., S:, None] * dv[:, :, None]).sum(-2)  # + diagonal values
    return o.reshape(B, h, R, D)


def padded_positions(attention_mask: torch.Tensor | None, T: int, device):
    """Step 1's view of a padded batch: real [B, T] bool (None = no padding), positions [B|1, T] (real tokens counted
    from 0), and the [B, 1, T, T] bool attention mask (None = plain causal; pad rows see themselves)."""
    real = None if attention_mask is None or bool(attention_mask.all()) else attention_mask.bool()  # [B, T]
    pos = torch.arange(T, device=device)[None] if real is None else (real.long().cumsum(-1) - 1).clamp(min=0)
    mask = None
    if real is not None:
        causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()  # [T, T]
        mask = causal[None] & real[:, None, :] | torch.eye(T, dtype=torch.bool, device=device)[None]
        mask = mask.unsqueeze(1)  # [B, 1, T, T]
    return real, pos, mask


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, pos: torch.Tensor,
                     real: torch.Tensor | None, window: int | None) -> torch.Tensor:
    """Step 1's attention over a training sequence: q [B, h, T, D], k, v [B, kv, T, D]; mask the `padded_positions`
    mask (None = plain causal), pos / real its positions and padding; window W (None = full attention) runs
    `windowed_attention` (eagle/sliding_window.py: no [T, T] tensor). Returns [B, h, T, D]."""
    if window is not None:
        return windowed_attention(q, k, v, pos, real, window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                          enable_gqa=k.shape[1] != q.shape[1])


class SelfFedAttention:
    """The attention of unrolled steps >= 2 (`unroll_self_fed`): step j's queries at the indices `idx` [R] against the
    step-1 keys k1 / v1 [B, kv, T, D] they may see (positions pos [B|1, T], padding real [B, T] | None, window W | None)
    and the step's own keys of steps 2..j (the diagonal, kept here step by step). Full attention runs causal row
    chunks (chunk c reads step-1 keys [0, end_c) only, ~(1 + 1/n) / 2 of the full score matrix); a window runs blocks
    of rows, each against the step-1 keys its window can reach (no [R, T] tensor)."""

    def __init__(self, k1: torch.Tensor, v1: torch.Tensor, idx: torch.Tensor, pos: torch.Tensor,
                 real: torch.Tensor | None, window: int | None):
        dev, dt, T = k1.device, k1.dtype, k1.shape[2]
        R = idx.numel()
        self.idx, self.pos, self.real, self.window, self.dt = idx, pos, real, window, dt
        if window is None:
            bounds = [(c * R // UNROLL_ROW_CHUNKS, (c + 1) * R // UNROLL_ROW_CHUNKS) for c in range(UNROLL_ROW_CHUNKS)]
        else:
            bounds = [(lo, min(lo + WINDOW_QUERY_BLOCK, R)) for lo in range(0, R, WINDOW_QUERY_BLOCK)]
        self.bounds = [(lo, hi) for lo, hi in bounds if hi > lo]
        self.ends = (idx[torch.tensor([hi - 1 for _, hi in self.bounds], device=dev)] + 1).tolist()  # one host sync
        if window is None:
            self.starts = [0] * len(self.bounds)
            visible_keys = torch.arange(T, device=dev)[None, :] <= idx[:, None]  # [R, T] step-1 keys at indices <= t
            visible_keys = visible_keys[None] if real is None else visible_keys[None] & real[:, None, :]  # [B|1, R, T]
            self.bias = torch.zeros(visible_keys.shape, dtype=dt, device=dev).masked_fill_(~visible_keys,
                                                                                         torch.finfo(dt).min)
        else:
            self.starts = [max(0, s - window + 1)
                           for s in idx[torch.tensor([lo for lo, _ in self.bounds], device=dev)].tolist()]
        self.key_idx = torch.arange(T, device=dev)
        self.pos_r = pos[:, idx]  # [B|1, R]
        # k1/v1 are transposed views of the projections ([B, T, kv, D] underneath): with B > 1 every prefix slice
        # would be copied by matmul (per chunk and per step, and kept for backward); one copy serves them all
        self.k1, self.v1 = k1.contiguous(), v1.contiguous()  # [B, kv, T, D]
        self.diag_k, self.diag_v = [], []  # per step >= 2: [B, kv, R, D]

    def chunk_bias(self, lo: int, hi: int, start: int, end: int, j: int) -> torch.Tensor:
        """[B|1, hi - lo, end - start] additive: step j's rows lo..hi against step-1 keys start..end."""
        if self.window is None:
            return self.bias[:, lo:hi, start:end]
        seen = (self.key_idx[None, start:end] <= self.idx[lo:hi, None])[None] & visible(
            self.pos_r[:, lo:hi, None] + j - 1, self.pos[:, None, start:end], self.window)  # [B|1, rows, keys]
        if self.real is not None:
            seen = seen & self.real[:, None, start:end]
        return torch.zeros(seen.shape, dtype=self.dt, device=seen.device).masked_fill_(~seen, torch.finfo(self.dt).min)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, j: int) -> torch.Tensor:
        """Step j: q [B, h, R, D], its keys / values k, v [B, kv, R, D] -> [B, h, R, D]."""
        self.diag_k.append(k)
        self.diag_v.append(v)
        dk, dv = torch.stack(self.diag_k, dim=-2), torch.stack(self.diag_v, dim=-2)  # [B, kv, R, j - 1, D]
        diag_bias = None  # own step i (2..j) at position t + i - 1: in the window iff j - i < W
        if self.window is not None and j - self.window >= 2:
            own = torch.arange(2, j + 1, device=q.device)
            diag_bias = torch.zeros(j - 1, dtype=self.dt, device=q.device).masked_fill_(j - own >= self.window,
                                                                                       torch.finfo(self.dt).min)
        return torch.cat([prefix_diag_attention(q[:, :, lo:hi], self.k1[:, :, start:end], self.v1[:, :, start:end],
                                                self.chunk_bias(lo, hi, start, end, j), dk[:, :, lo:hi],
                                                dv[:, :, lo:hi], diag_bias)
                          for (lo, hi), start, end in zip(self.bounds, self.starts, self.ends)], dim=2)  # [B, h, R, D]


def unroll_self_fed(attn: Attention, rotary: Rotary, embed: Callable[[torch.Tensor], torch.Tensor],
                    prepare: Callable, finish: Callable, hidden: torch.Tensor, k1: torch.Tensor, v1: torch.Tensor,
                    next_ids: torch.Tensor, pos: torch.Tensor, real: torch.Tensor | None, steps: int,
                    rows: torch.Tensor | None, window: int | None = None, shards=None) -> list[torch.Tensor]:
    """Steps 2..`steps` after step 1 (module docstring).

    hidden [B, T, H]: step 1's outputs; k1, v1 [B, kv, T, D]: step 1's rotated keys and values; next_ids [B, T];
    pos [B|1, T] positions of the indices; real [B, T] bool (None = no padding); rows [R] sorted indices (None = all
    T): steps >= 2 run only there (a cost knob); window W (None = full attention): step j at position t + j - 1 sees
    the step-1 keys at positions > t + j - 1 - W and its own steps i with j - i < W (eagle/sliding_window.py's rule),
    in row blocks against their W + block keys only (no [R, T] tensor). prepare(token_emb [B, R, H], prev [B, R, H]) -> (attention input,
    residual); finish(residual, attention output [B, R, H]) -> the step's hidden [B, R, H]. Returns steps - 1
    hiddens [B, R, H]; indices where t + j - 1 runs off the sequence read a pad token and must be masked by the caller.
    shards (None = the whole record here): sequence parallelism (train/sequence_parallel.py): hidden, next_ids, pos,
    rows are this rank's span of the record; each step's attention runs on the whole record's rows for this rank's
    heads (`shards.attend`, DeepSpeed Ulysses' all-to-all), against the step-1 keys step 1 gathered (`shards.keys`).
    """
    B, T, _ = hidden.shape
    dt = hidden.dtype
    h_, D = attn.n_heads, attn.head_dim
    idx = torch.arange(T, device=hidden.device) if rows is None else rows.to(hidden.device)  # [R]
    R = idx.numel()
    if shards is None:
        att = SelfFedAttention(k1, v1, idx, pos, real, window)
        ids_ext = torch.cat([next_ids, next_ids.new_zeros(B, steps - 1)], dim=1)  # [B, T + steps - 1]

        def attend(q, k, v, j):
            return att(q, k, v, j).transpose(1, 2).reshape(B, R, h_ * D)
    else:
        k1_all, v1_all = shards.keys  # [B, kv', T * size, D]: the whole record's step-1 keys, this rank's heads
        att = SelfFedAttention(k1_all, v1_all, shards.all_rows(idx, T), shards.all_positions(T, hidden.device), None,
                               window)
        ids_ext = shards.lookahead(next_ids, steps - 1)  # [B, T + steps - 1]: the next span's first tokens

        def attend(q, k, v, j):
            return shards.attend(attn, q, k, v, lambda q_, k_, v_, pos_: att(q_, k_, v_, j))

    pos_r = pos[:, idx]  # [B|1, R]
    prev = hidden if rows is None else hidden[:, idx]  # [B, R, H]
    hiddens = []
    for j in range(2, steps + 1):
        x, residual = prepare(embed(ids_ext[:, idx + j - 1]).to(dt), prev)  # [B, R, in], [B, R, H]
        cos, sin = rotary(pos_r + j - 1, dt)
        q, k, v = attn.qkv(x, cos, sin)  # [B, h, R, D], [B, kv, R, D] x 2
        prev = finish(residual, attn.o_proj(attend(q, k, v, j)))  # [B, R, H]
        hiddens.append(prev)
    return hiddens
