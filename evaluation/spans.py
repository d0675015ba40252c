"""tau and acceptance by the part of the answer a decoding round drafted: reasoning (``<think>...</think>``), the
final answer, or a tool call (data_prep/assistant_spans.py labels the generated tokens).

A head that looks fine overall can fail on long reasoning traces (or the reverse): the per-span numbers show where.
Round k of a turn commits `new_tokens` tokens of the answer, right after the tokens the prefill and rounds 0..k-1
committed; the round belongs to the span of its first committed token (the position the draft started from). tau of
a span = tokens committed by its rounds / its rounds; alpha_1 = the share of its rounds whose first draft token was
accepted. Confidence intervals: the paired bootstrap over questions of evaluation/bootstrap.py, as for the
per-category tau.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import numpy as np

from data_prep.assistant_spans import SPAN_KINDS
from evaluation.bootstrap import Estimate, ratio_ci, ratio_difference_ci
from evaluation.metrics import OVERALL, rounds_of
from evaluation.runner import TurnResult

Labeler = Callable[[list[int]], list]  # generated ids -> a span kind per id


@dataclass
class SpanSummary:
    method: str
    category: str
    span: str
    questions: int
    rounds: int
    committed: int
    tau: Estimate
    alpha_1: float  # share of the span's rounds that accepted their first draft token

    def to_dict(self) -> dict:
        return {"method": self.method, "category": self.category, "span": self.span, "questions": self.questions,
                "rounds": self.rounds, "committed": self.committed, "tau": self.tau.to_dict(), "alpha_1": self.alpha_1}


@dataclass
class SpanComparison:
    a: str
    b: str
    category: str
    span: str
    questions: int
    tau_difference: Estimate  # tau(b) - tau(a) on the questions both have rounds in this span for

    def to_dict(self) -> dict:
        return {"a": self.a, "b": self.b, "category": self.category, "span": self.span, "questions": self.questions,
                "tau_difference": self.tau_difference.to_dict()}


def round_spans(r: TurnResult, labels: list) -> list[tuple[str, int, int]]:
    """(span, committed tokens, accept length) of every verification round of one turn."""
    rounds = rounds_of(r)
    pos = len(r.output_ids) - sum(int(rd.new_tokens) for rd in rounds)  # tokens the prefill committed
    out = []
    for rd in rounds:
        span = labels[pos] if pos < len(labels) else labels[-1]
        out.append((span, int(rd.new_tokens), int(rd.accept_length)))
        pos += int(rd.new_tokens)
    return out


def _per_question(results: list[TurnResult], labeler: Labeler) -> dict:
    """(method, category, span) -> question_id -> [committed, rounds, first-draft accepts], over each turn's rounds."""
    table: dict = {}
    for r in results:
        if not rounds_of(r) or not r.output_ids:
            continue
        for span, committed, accepted in round_spans(r, labeler(r.output_ids)):
            for cat in (r.category, OVERALL):
                row = table.setdefault((r.method, cat, span), OrderedDict()).setdefault(r.question_id, np.zeros(3))
                row += (committed, 1, accepted >= 1)
    return table


def summarize_spans(results: list[TurnResult], labeler: Labeler, **kw) -> list[SpanSummary]:
    """One SpanSummary per (method, category or overall, span) that has rounds (vanilla has none)."""
    table = _per_question(results, labeler)
    out = []
    for (method, cat, span), per_q in sorted(table.items(), key=lambda kv: (kv[0][0], kv[0][1] == OVERALL, kv[0][1],
                                                                          SPAN_KINDS.index(kv[0][2]))):
        q = np.stack(list(per_q.values()))  # [Q, 3]
        out.append(SpanSummary(method, cat, span, len(q), int(q[:, 1].sum()), int(q[:, 0].sum()),
                               ratio_ci(q[:, 0], q[:, 1], **kw), float(q[:, 2].sum() / q[:, 1].sum())))
    return out


def compare_spans(results: list[TurnResult], a: str, b: str, labeler: Labeler, **kw) -> list[SpanComparison]:
    """tau(b) - tau(a) per (category or overall, span), paired over the questions both have rounds there for."""
    table = _per_question(results, labeler)
    out = []
    keys = sorted({(cat, span) for m, cat, span in table if m in (a, b)},
                  key=lambda k: (k[0] == OVERALL, k[0], SPAN_KINDS.index(k[1])))
    for cat, span in keys:
        qa, qb = table.get((a, cat, span), {}), table.get((b, cat, span), {})
        shared = [k for k in qa if k in qb]
        if not shared:
            continue
        xa = np.stack([qa[k] for k in shared])
        xb = np.stack([qb[k] for k in shared])
        out.append(SpanComparison(a, b, cat, span, len(shared),
                                  ratio_difference_ci(xb[:, 0], xb[:, 1], xa[:, 0], xa[:, 1], **kw)))
    return out
