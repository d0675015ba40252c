"""Acceptance by context length (recipe `eval.context_buckets`): tau and alpha_d per bucket of prompt length, with
paired bootstrap CIs, and the paired differences between methods (two heads, or one head two ways) per bucket.

A turn's context is its prompt's token count (the history and the question, as the target saw it when generation
started). Edges [e1, e2, ...] make the buckets [0, e1), [e1, e2), ..., [e_last, inf), labelled "<1k", "1k-4k",
"4k-16k", "16k+" for [1024, 4096, 16384]. Every statistic is the one `evaluation/metrics.py` computes per category,
computed with the bucket in the category's place (so the counting is identical: tau = committed tokens / rounds,
resampling unit the question, restricted to its turns in the bucket).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

from evaluation.metrics import Comparison, MethodSummary, compare, summarize
from evaluation.runner import TurnResult


def length_text(n: int) -> str:
    """1024 -> "1k", 1536 -> "1.5k", 500 -> "500"."""
    return f"{n / 1024:g}k" if n >= 1024 and (n * 10) % 1024 == 0 else str(n)


def bucket_labels(edges: list[int]) -> list[str]:
    """The labels of the len(edges) + 1 buckets, shortest first."""
    edges = [int(e) for e in edges]
    if not edges:
        return ["all"]
    inner = [f"{length_text(a)}-{length_text(b)}" for a, b in zip(edges, edges[1:])]
    return [f"<{length_text(edges[0])}", *inner, f"{length_text(edges[-1])}+"]


def bucket_of(tokens: int, edges: list[int]) -> str:
    """The label of the bucket a context of `tokens` tokens falls in."""
    labels = bucket_labels(edges)
    return labels[sum(tokens >= int(e) for e in edges)]


@dataclass
class ContextReport:
    """tau / alpha_d per (method, bucket) and the paired differences per bucket, for the report."""

    edges: list[int]
    summaries: list[MethodSummary] = field(default_factory=list)  # `category` = the bucket label
    comparisons: list[Comparison] = field(default_factory=list)  # `category` = the bucket label
    turns: dict[str, int] = field(default_factory=dict)  # bucket -> turns in it (any method)

    @property
    def labels(self) -> list[str]:
        return bucket_labels(self.edges)

    def to_dict(self) -> dict:
        return {"edges": list(self.edges), "labels": self.labels, "turns": self.turns,
                "summaries": [s.to_dict() for s in self.summaries], "comparisons": [c.to_dict() for c in self.comparisons]}


def by_context(results: list[TurnResult], edges: list[int], methods: list[str], **stat_kw) -> ContextReport:
    """The context report of `results` (every method); paired differences between every pair of `methods` (the
    speculative ones) in every bucket both have turns in."""
    placed = [replace(r, category=bucket_of(len(r.prompt_ids), edges)) for r in results]
    labels = bucket_labels(edges)
    present = [b for b in labels if any(r.category == b for r in placed)]
    summaries = [s for s in summarize(placed, **stat_kw) if s.category in labels]
    summaries.sort(key=lambda s: labels.index(s.category))
    comparisons = []
    for bucket, (a, b) in itertools.product(present, itertools.combinations(methods, 2)):
        turns = {m: {(r.question_id, r.turn) for r in placed if r.category == bucket and r.method == m} for m in (a, b)}
        if turns[a] & turns[b]:  # a later turn's context is the method's own history: it may land elsewhere
            comparisons.append(compare(placed, a, b, category=bucket, **stat_kw))
    return ContextReport(list(edges), summaries, comparisons,
                         {b: sum(r.category == b for r in placed) for b in present})
