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

WINDOW = 5  # micro-batch losses per median; the reference is the lowest such median so far
HISTORY = 64  # recent losses kept in the trainer state


class DivergenceError(UserError, RuntimeError):
    """Training diverged; nothing after the divergence was checkpointed or exported."""


def reference(watch: dict) -> float | None:
    """The run's best loss level so far: min(first loss, lowest median of WINDOW consecutive losses)."""
    return watch.get("ref")


def exploded(loss: float, watch: dict, ratio: float) -> bool:
    """True when `loss` exceeds `ratio` x the run's best level so far (ratio 0 = never). The first loss (taken
    before any update) seeds the reference, so a run that explodes from its first steps is caught too."""
    ref = reference(watch)
    return ratio > 0 and ref is not None and loss > ratio * max(ref, 1e-12)


def remember(loss: float, watch: dict) -> None:
    """Record a finite micro-batch loss in `watch` (a JSON-able dict kept in the trainer state)."""
    history = watch.setdefault("losses", [])
    history.append(float(loss))
    del history[:-HISTORY]
    ref = watch.get("ref")
    level = statistics.median(history[-WINDOW:]) if len(history) >= WINDOW else None
    candidates = [v for v in (ref, level) if v is not None] or [float(loss)]
    watch["ref"] = min(candidates)


def non_finite_weights(module: torch.nn.Module) -> list[str]:
    """Names of trainable parameters holding NaN/inf (local shards under ZeRO-3)."""
    return [n for n, p in module.named_parameters() if p.requires_grad and p.numel() and not bool(torch.isfinite(p).all())]


def describe(loss: float, watch: dict, ratio: float) -> str:
    ref = reference(watch) or math.nan
    return (f"loss {loss:.4g} is {loss / max(ref, 1e-12):.3g}x the run's best level so far {ref:.4g} "
            f"(train.max_loss_ratio={ratio:g})")
