"""Divergence: an exploding loss (relative to the run so far) or weights that stopped being finite.

The trainer stops at the first sign with `DivergenceError`, BEFORE the step that would apply it, so the last
checkpoint (`latest`) and the exported head are always from before the divergence; rerunning with a lower
`train.lr` resumes from that checkpoint with the new learning rate.
"""
from __future__ import annotations

import math
import statistics

import torch

from eagle.cli_errors import UserError

HISTORY = 64  # micro-batch losses kept for the reference median
MIN_HISTORY = 8  # no explosion verdict before this many finite losses


class DivergenceError(UserError, RuntimeError):
    """Training diverged; nothing after the divergence was checkpointed or exported."""


def exploded(loss: float, history: list[float], ratio: float) -> bool:
    """True when `loss` exceeds `ratio` x the median of the recent finite losses (ratio 0 = never)."""
    if ratio <= 0 or len(history) < MIN_HISTORY:
        return False
    return loss > ratio * max(statistics.median(history), 1e-12)


def remember(loss: float, history: list[float]) -> None:
    """Append a finite micro-batch loss to the (bounded) history kept in the trainer state."""
    history.append(float(loss))
    del history[:-HISTORY]


def non_finite_weights(module: torch.nn.Module) -> list[str]:
    """Names of trainable parameters holding NaN/inf (local shards under ZeRO-3)."""
    return [n for n, p in module.named_parameters() if p.requires_grad and p.numel() and not bool(torch.isfinite(p).all())]


def describe(loss: float, history: list[float], ratio: float) -> str:
    med = statistics.median(history) if history else math.nan
    return f"loss {loss:.4g} is {loss / max(med, 1e-12):.3g}x the median {med:.4g} of the last {len(history)} (train.max_loss_ratio={ratio:g})"
