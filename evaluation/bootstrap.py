"""Paired percentile bootstrap over prompts (scipy.stats.bootstrap).

Every statistic here is a ratio of SUMS over prompts (tokens / seconds, committed tokens / rounds),
so the resampling unit is the prompt (a question with all its turns) and the same resampled
prompts are used for every column: the comparison is paired.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


@dataclass
class Estimate:
    value: float
    low: float | None  # None when there are fewer than 2 prompts (no interval can be estimated)
    high: float | None
    n: int  # prompts

    def to_dict(self) -> dict:
        return {"value": self.value, "ci_low": self.low, "ci_high": self.high, "n": self.n}


def paired_bootstrap(columns: list[np.ndarray], statistic: Callable[..., np.ndarray], *, n_resamples: int = 5000,
                     confidence_level: float = 0.95, seed: int = 0) -> Estimate:
    """Point estimate and percentile CI of `statistic(*column_sums)`.

    columns: per-prompt values, each [n]. statistic receives each column SUMMED over the
    (resampled) prompts along `axis` and returns the statistic (vectorised over resamples)."""
    cols = [np.asarray(c, dtype=np.float64) for c in columns]
    n = len(cols[0])
    if any(len(c) != n for c in cols):
        raise ValueError(f"paired columns differ in length: {[len(c) for c in cols]}")
    if n == 0:
        raise ValueError("no prompts to bootstrap over")

    def on_sums(*resampled, axis=-1):
        return statistic(*(r.sum(axis=axis) for r in resampled))

    value = float(on_sums(*cols))
    if n < 2:
        return Estimate(value, None, None, n)
    # lazy: scipy.stats costs over a second at import; only the statistics need it, not a command's --help
    from scipy import stats as sps

    res = sps.bootstrap(tuple(cols), on_sums, n_resamples=n_resamples, paired=True, vectorized=True,
                        confidence_level=confidence_level, method="percentile", rng=np.random.default_rng(seed))
    return Estimate(value, float(res.confidence_interval.low), float(res.confidence_interval.high), n)


def ratio_ci(num: np.ndarray, den: np.ndarray, **kw) -> Estimate:
    """sum(num) / sum(den), e.g. tau = committed tokens / rounds."""
    return paired_bootstrap([num, den], lambda a, b: a / b, **kw)


def ratio_of_ratios_ci(num_a, den_a, num_b, den_b, **kw) -> Estimate:
    """(sum(num_a)/sum(den_a)) / (sum(num_b)/sum(den_b)), e.g. speedup = tok/s of A over tok/s of B."""
    return paired_bootstrap([num_a, den_a, num_b, den_b], lambda a, b, c, d: (a / b) / (c / d), **kw)


def ratio_difference_ci(num_a, den_a, num_b, den_b, **kw) -> Estimate:
    """sum(num_a)/sum(den_a) - sum(num_b)/sum(den_b), e.g. the tau difference of two heads or settings."""
    return paired_bootstrap([num_a, den_a, num_b, den_b], lambda a, b, c, d: a / b - c / d, **kw)
