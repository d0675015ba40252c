"""The sliding-window rule of a draft head's attention (recipe `head.sliding_window`, every head kind), and the masks
both training and decoding build from it.

THE RULE: a query at sequence position q sees the key at position p iff q - W < p <= q (W = `size`). Positions are
the positions the rotary embedding uses (a token's own place in the sequence: committed tokens 0..P-1, a draft node
at tree depth d >= 1 at P + d - 1), so tree ancestors count like any other key and depth eats into the window: the
draft node at depth d (whose output gives the depth-(d+1) distribution) sees itself, its d - 1 ancestors (those
within W positions of it) and the last W - d committed positions (none when d >= W). Training's unrolled step j at
index t sits at position t + j - 1 and sees exactly that (its own steps 2..j are its ancestors): eagle/unroll.py.
On top of the rule come the usual conditions: causality (tree: ancestors only) and padding (real keys only; a pad
row sees itself). `None` (recipe `head.sliding_window: null`) = full attention.

Memory: with a window, training never builds an [L, L] mask or score matrix: `windowed_attention` runs query blocks
of `WINDOW_QUERY_BLOCK` rows against their W + block keys, O(L (W + block)) memory (train/plan.py counts it).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

WINDOW_QUERY_BLOCK = 256  # training: query rows per block of `windowed_attention` (memory ~ rows x (W + rows))


@dataclass
class SlidingWindowOptions:
    """`head.sliding_window`: the draft layer's attention window (null = full attention)."""

    size: int = 4096  # W: a query at position q sees keys at positions q-W+1 .. q (itself and W-1 before it)

    def problems(self) -> list[tuple[str, object, str]]:
        ok = isinstance(self.size, int) and not isinstance(self.size, bool) and self.size >= 1
        return [] if ok else [("sliding_window.size", self.size, "expected an integer >= 1 (keys a query sees, "
                                                                  "itself included)")]


def window_options(value) -> SlidingWindowOptions | None:
    """A `head.sliding_window` value as options: None / a SlidingWindowOptions / a mapping with `size` (a recipe
    section, a DictConfig) / an int W (a config.json's HF-style `sliding_window`)."""
    if value is None or isinstance(value, SlidingWindowOptions):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        return SlidingWindowOptions(size=value)
    return SlidingWindowOptions(**{k: value[k] for k in ("size",) if k in value})


def window_size(options) -> int | None:
    """W of a kind's options (None = full attention)."""
    window = getattr(options, "sliding_window", None)
    return None if window is None else int(window.size)


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, size: int) -> torch.Tensor:
    """THE RULE (module docstring), broadcast: bool, True where the key at k_pos is inside the window of q_pos."""
    return (k_pos <= q_pos) & (k_pos > q_pos - size)


def windowed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, real: torch.Tensor | None,
                       size: int, block: int = WINDOW_QUERY_BLOCK) -> torch.Tensor:
    """Causal sliding-window attention of a training sequence, one query block at a time (no [T, T] tensor).

    q [B, h, T, D], k, v [B, kv, T, D] (rotated); pos [B|1, T] positions; real [B, T] bool (None = no padding; real
    tokens are contiguous, as right or left padding makes them, so index distance = position distance between them).
    Query block [lo, hi) reads keys [max(0, lo - W + 1), hi) under `visible`, index causality and real keys (a pad row
    sees itself). Returns [B, h, T, D]."""
    B, h, T, D = q.shape
    idx = torch.arange(T, device=q.device)
    outs = []
    for lo in range(0, T, block):
        hi = min(lo + block, T)
        s = max(0, lo - size + 1)
        allowed = visible(pos[:, lo:hi, None], pos[:, None, s:hi], size) & (idx[None, s:hi] <= idx[lo:hi, None])
        if real is not None:
            allowed = allowed & real[:, None, s:hi] | (idx[None, s:hi] == idx[lo:hi, None])
        outs.append(F.scaled_dot_product_attention(q[:, :, lo:hi], k[:, :, s:hi], v[:, :, s:hi],
                                                   attn_mask=allowed[:, None], enable_gqa=k.shape[1] != h))
    return torch.cat(outs, dim=2)


def restrict_mask(mask: torch.Tensor | None, q_pos: torch.Tensor, k_pos: torch.Tensor, size: int) -> torch.Tensor:
    """A decoding mask (None = attend to every key, bool True = attend, or additive float; [.., n, S]) with THE RULE
    applied for queries at q_pos [n] and cached keys at k_pos [S]: bool stays bool, additive gets -inf-like entries."""
    win = visible(q_pos[:, None], k_pos[None, :], size)  # [n, S]
    if mask is None:
        return win
    if mask.dtype == torch.bool:
        return mask & win
    return mask.masked_fill(~win, torch.finfo(mask.dtype).min)


SLIDING, FULL = "sliding_attention", "full_attention"  # HF `layer_types` entries (what vLLM's Llama reads per layer)


def window_from_config(d: dict) -> SlidingWindowOptions | None:
    """Take a head config.json's window out of `d` (popped when it is ours): HF's `sliding_window` W with the one
    layer's `layer_types` entry. A config that says the window is off (Qwen2's `use_sliding_window: false`, or
    `layer_types: ["full_attention"]`, or `sliding_window: null`) is full attention and keeps its keys unchanged."""
    size, types = d.get("sliding_window"), d.get("layer_types")
    if size is None or d.get("use_sliding_window") is False or (types is not None and list(types) != [SLIDING]):
        return None
    d.pop("sliding_window")
    d.pop("layer_types", None)
    return SlidingWindowOptions(size=size)


def window_config(options) -> dict:
    """The config.json keys of a kind's window (HF's layout for one layer); {} for full attention (older heads
    unchanged)."""
    size = window_size(options)
    return {} if size is None else {"sliding_window": size, "layer_types": [SLIDING]}
