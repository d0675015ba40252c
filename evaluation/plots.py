"""PNG figures of an evaluation run (matplotlib, Agg backend: no display needed)."""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from evaluation.autotune import TuneResult
from evaluation.calibration import Calibration
from evaluation.metrics import OVERALL, MethodSummary


def pyplot():
    """matplotlib's pyplot on the Agg backend (no display needed)."""
    # lazy: matplotlib costs about a second at import; only drawing a report's figures needs it (not --help)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def finish(fig, ax, path: Path) -> Path:
    """Grid, legend, tight layout, saved at 120 dpi, closed: every line plot here ends so."""
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
    return path


def safe_name(label: str) -> str:
    """A method label as a file-name fragment."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", label).strip("_")


def _grouped_bars(summaries: list[MethodSummary], metric: str, title: str, ylabel: str, path: Path,
                  reference: float | None = None) -> Path:
    methods = list(dict.fromkeys(s.method for s in summaries))
    categories = [c for c in dict.fromkeys(s.category for s in summaries) if c != OVERALL] + [OVERALL]
    by = {(s.method, s.category): getattr(s, metric) for s in summaries}
    width = 0.8 / len(methods)
    x = np.arange(len(categories))
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(categories) * max(1, len(methods)) / 2 + 2), 4.2))
    for i, m in enumerate(methods):
        vals, lo, hi = [], [], []
        for c in categories:
            est = by.get((m, c))
            v = est.value if est is not None else np.nan
            vals.append(v)
            lo.append(v - est.low if est is not None and est.low is not None else 0.0)
            hi.append(est.high - v if est is not None and est.high is not None else 0.0)
        ax.bar(x + (i - (len(methods) - 1) / 2) * width, vals, width, yerr=[lo, hi], capsize=2, label=m)
    if reference is not None:
        ax.axhline(reference, color="k", lw=0.8, ls="--")
    ax.set_xticks(x, categories, rotation=30, ha="right")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_tau(summaries: list[MethodSummary], path: Path) -> Path:
    return _grouped_bars(summaries, "tau", "Acceptance length tau per category (95% CI)",
                         "tokens per target forward", path, reference=1.0)


def plot_speedup(summaries: list[MethodSummary], path: Path) -> Path:
    usable = [s for s in summaries if s.speedup is not None]
    return _grouped_bars(usable, "speedup", "Speedup vs vanilla per category (95% CI)", "x vanilla tokens/s", path,
                         reference=1.0)


def plot_depth_acceptance(summaries: list[MethodSummary], path: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for s in summaries:
        if s.category != OVERALL or not s.depth_acceptance:
            continue
        d = [a.depth for a in s.depth_acceptance]
        line, = ax.plot(d, [a.rate for a in s.depth_acceptance], marker="o", label=s.method)
        for a in s.depth_acceptance:  # how many rounds reached this depth: deep points rest on few rounds
            if a.reached:
                ax.annotate(str(a.reached), (a.depth, a.rate), fontsize=6, color=line.get_color(), xytext=(4, 3),
                            textcoords="offset points")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("draft depth d (labels: rounds that reached d)")
    ax.set_ylabel("P(accept depth d | depths < d accepted)")
    ax.set_ylim(0, 1.02)
    ax.set_title("Per-depth acceptance rate")
    return finish(fig, ax, path)


def plot_calibration(calibrations: dict[str, Calibration], title: str, path: Path) -> Path:
    """Reliability diagram (top) and node counts per bin (bottom): one panel for path values, one for node values,
    each with the draft's raw probabilities (before calibration) and, when the tree was ranked by a fitted map,
    its calibrated scores (after)."""
    panels = [(kind, [(q, calibrations[q]) for q in (f"{kind}_prob", f"{kind}_score") if q in calibrations])
              for kind in ("path", "node")]
    panels = [(kind, cals) for kind, cals in panels if cals]
    plt = pyplot()
    fig, axes = plt.subplots(2, len(panels), figsize=(5.5 * len(panels), 6), height_ratios=[3, 1], squeeze=False)
    for j, (kind, cals) in enumerate(panels):
        top, bottom = axes[0, j], axes[1, j]
        top.plot([0, 1], [0, 1], color="grey", lw=0.8, ls="--", label="perfect calibration")
        titles = []
        for i, (q, cal) in enumerate(cals):
            label = "raw draft probability (before)" if q.endswith("_prob") else "calibrated score (after)"
            full = [b for b in cal.bins if b.count]
            line, = top.plot([b.mean_confidence for b in full], [b.acceptance_rate for b in full], marker="o",
                             label=f"{label}: ECE {cal.ece:.3f}, bins {cal.ece_bins:.3f}")
            for b in full:
                top.annotate(str(b.count), (b.mean_confidence, b.acceptance_rate), fontsize=6, color=line.get_color(),
                             xytext=(3, -9), textcoords="offset points")
            width = (cal.bins[0].high - cal.bins[0].low) / (len(cals) + 0.5)
            bottom.bar([b.low + (i + 0.75) * width for b in cal.bins], [b.count for b in cal.bins], width=width,
                       color=line.get_color())
            titles.append(f"r {cal.pearson_r:.2f}")
        top.set_xlim(0, 1)
        top.set_ylim(0, 1.02)
        top.set_ylabel("observed acceptance rate")
        top.set_title(f"{kind} value ({'given an accepted parent' if kind == 'node' else 'root to node'}): "
                      + ", ".join(titles), fontsize=9)
        top.legend(fontsize=7, loc="upper left")
        top.grid(alpha=0.3)
        bottom.set_yscale("log")
        bottom.set_xlim(0, 1)
        bottom.set_xlabel(f"confidence ({kind} value)")
        bottom.set_ylabel("nodes")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_autotune(result: TuneResult, path: Path) -> Path:
    """Predicted speedup (tau / the pooled round-time model's seconds, over vanilla's final tokens/s) over (depth,
    total_token), one panel per top_k; the picked point is starred. (Predicted, not one pass's timing: single
    timings on a shared machine vary by +-20%.)"""
    top_ks = sorted({p.top_k for p in result.points})
    depths = sorted({p.depth for p in result.points})
    totals = sorted({p.total_token for p in result.points})
    plt = pyplot()
    fig, axes = plt.subplots(1, len(top_ks), figsize=(3.6 * len(top_ks) + 1, 3.6), squeeze=False)
    speedup = {id(p): p.predicted_tokens_per_s / result.vanilla_tokens_per_s for p in result.points}
    vmax, vmin = max(speedup.values()), min(speedup.values())
    im = None
    for j, k in enumerate(top_ks):
        ax = axes[0, j]
        grid = np.full((len(depths), len(totals)), np.nan)  # [D, T]
        for p in result.points:
            if p.top_k == k:
                grid[depths.index(p.depth), totals.index(p.total_token)] = speedup[id(p)]
        im = ax.imshow(grid, origin="lower", aspect="auto", vmin=vmin, vmax=vmax, cmap="viridis")
        ax.set_xticks(range(len(totals)), totals)
        ax.set_yticks(range(len(depths)), depths)
        ax.set_xlabel("total_token")
        ax.set_ylabel("depth")
        ax.set_title(f"top_k = {k}")
        b = result.best
        if b is not None and b.top_k == k:
            ax.plot(totals.index(b.total_token), depths.index(b.depth), marker="*", color="red", ms=14)
    fig.colorbar(im, ax=axes[0, :].tolist(), label="predicted speedup vs vanilla")
    fig.suptitle("EAGLE-2 tree auto-tuning surface")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_tau_by_context(context, path: Path) -> Path:
    """tau per prompt-length bucket, one line per method with its 95% CI (evaluation/context_buckets.py)."""
    labels = [b for b in context.labels if any(s.category == b for s in context.summaries)]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for m in dict.fromkeys(s.method for s in context.summaries):
        by = {s.category: s.tau for s in context.summaries if s.method == m}
        xs = [i for i, b in enumerate(labels) if b in by]
        ests = [by[labels[i]] for i in xs]
        err = [[e.value - e.low if e.low is not None else 0.0 for e in ests],
               [e.high - e.value if e.high is not None else 0.0 for e in ests]]
        ax.errorbar(xs, [e.value for e in ests], yerr=err, marker="o", capsize=3, label=m)
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_xticks(range(len(labels)), labels)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("tokens per target forward")
    ax.set_title("Acceptance length tau by context length (95% CI)")
    return finish(fig, ax, path)
