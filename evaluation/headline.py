"""A report's headline as one sentence, and the number format of the reports: light (no torch, no target code),
so commands that only print a finished report's headline (python -m quickstart) do not import the evaluation."""
from __future__ import annotations

import math


def number_text(x: float | None, digits: int = 2) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def headline_text(h: dict) -> str:
    """One sentence: 'fastest: tuned (dynamic ...): tau 3.10, speedup 1.62x [1.55, 1.70] over vanilla, 0 mismatches'."""
    low, high = h.get("speedup_low"), h.get("speedup_high")
    ci = "" if low is None else f" [{number_text(low)}, {number_text(high)}]"
    lossless = "" if h.get("mismatches") is None else \
        f", {h['mismatches']} mismatches with vanilla greedy over {h['compared']} outputs"
    return (f"fastest: {h['method']} ({h['describe']}): tau {h['tau']:.2f}, speedup {h['speedup']:.2f}x{ci} "
            f"over vanilla{lossless}")
