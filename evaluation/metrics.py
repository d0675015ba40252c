"""Acceptance length, per-depth acceptance, tokens/s and speedup from TurnResults.

Counting is identical for every method (tau and alpha_d are counted by eagle/stats.py, as the trainer's live tau):
  tau          = sum over rounds of tokens committed in the round / number of rounds, where a
                 round is one target verification forward after prefill (vanilla: 1 token per
                 forward, tau = 1.00). The token the prefill forward produces belongs to no round.
  tokens/s     = generated tokens (output ids minus prompt ids) / wall seconds of the generate call
  speedup      = tokens/s of the method / tokens/s of vanilla on the SAME prompts and turns
  alpha_d      = P(depth-d draft token accepted | depths 1..d-1 accepted and the draft reached depth d)
Confidence intervals: paired percentile bootstrap over questions (evaluation.bootstrap).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np

from eagle.stats import DepthAcceptance, acceptance_by_depth, committed_tokens
from evaluation.bootstrap import Estimate, ratio_ci, ratio_difference_ci, ratio_of_ratios_ci
from evaluation.runner import TurnResult

OVERALL = "overall"


@dataclass
class MethodSummary:
    method: str
    category: str
    questions: int
    turns: int
    new_tokens: int
    seconds: float
    rounds: int
    tau: Estimate
    tokens_per_s: Estimate
    speedup: Estimate | None  # None when no vanilla run shares these prompts
    depth_acceptance: list[DepthAcceptance] = field(default_factory=list)
    phase_seconds: dict = field(default_factory=dict)  # draft/verify/commit/prefill wall time from the stats

    def to_dict(self) -> dict:
        return {
            "method": self.method, "category": self.category, "questions": self.questions, "turns": self.turns,
            "new_tokens": self.new_tokens, "seconds": self.seconds, "rounds": self.rounds,
            "tau": self.tau.to_dict(), "tokens_per_s": self.tokens_per_s.to_dict(),
            "speedup": self.speedup.to_dict() if self.speedup else None,
            "depth_acceptance": [d.to_dict() for d in self.depth_acceptance],
            "phase_seconds": self.phase_seconds,
        }


@dataclass
class Comparison:
    """Paired comparison of two methods (two settings, or the same setting with two heads)."""

    a: str
    b: str
    category: str
    tau_difference: Estimate  # tau(a) - tau(b)
    speed_ratio: Estimate  # tokens/s(a) / tokens/s(b)
    tau_ratio: Estimate  # tau(a) / tau(b), e.g. an EAGLE-3 head's tau over an EAGLE-2 head's on the same prompts

    def to_dict(self) -> dict:
        return {"a": self.a, "b": self.b, "category": self.category, "tau_difference": self.tau_difference.to_dict(),
                "speed_ratio": self.speed_ratio.to_dict(), "tau_ratio": self.tau_ratio.to_dict()}


def rounds_of(r: TurnResult) -> list:
    return list(r.stats.rounds) if r.stats is not None else []


def committed_in_rounds(r: TurnResult) -> int:
    return committed_tokens(rounds_of(r))


def depth_acceptance(results: list[TurnResult]) -> list[DepthAcceptance]:
    """alpha_d for d = 1..deepest drafted node over every round of `results` (empty for vanilla)."""
    return acceptance_by_depth(rd for r in results for rd in rounds_of(r))


def _per_question(results: list[TurnResult], keys: set | None = None) -> "OrderedDict[str, np.ndarray]":
    """question_id -> [tokens, seconds, committed_in_rounds, rounds] summed over the question's turns
    (restricted to (question_id, turn) in `keys` when given)."""
    out: OrderedDict[str, np.ndarray] = OrderedDict()
    for r in results:
        if keys is not None and (r.question_id, r.turn) not in keys:
            continue
        row = np.array([r.new_tokens, r.wall_s, committed_in_rounds(r), len(rounds_of(r))], dtype=np.float64)
        out[r.question_id] = out.get(r.question_id, 0) + row
    return out


def _phase_seconds(results: list[TurnResult]) -> dict:
    phases = {"prefill_s": 0.0, "draft_s": 0.0, "verify_s": 0.0, "commit_s": 0.0}
    for r in results:
        if r.stats is None:
            continue
        phases["prefill_s"] += float(getattr(r.stats, "prefill_s", 0.0))
        for rd in rounds_of(r):
            for k in ("draft_s", "verify_s", "commit_s"):
                phases[k] += float(getattr(rd, k))
    return phases


def summarize(results: list[TurnResult], *, baseline: str = "vanilla", n_resamples: int = 5000,
              confidence_level: float = 0.95, seed: int = 0) -> list[MethodSummary]:
    """One MethodSummary per (method, category) and per (method, "overall")."""
    kw = dict(n_resamples=n_resamples, confidence_level=confidence_level, seed=seed)
    methods = list(OrderedDict.fromkeys(r.method for r in results))
    categories = list(OrderedDict.fromkeys(r.category for r in results))
    out = []
    for m in methods:
        for cat in categories + [OVERALL]:
            mine = [r for r in results if r.method == m and (cat == OVERALL or r.category == cat)]
            if not mine:
                continue
            q = np.stack(list(_per_question(mine).values()))  # [Q, 4]
            tokens, secs, committed, rounds = q.T
            speedup = None
            base = [r for r in results if r.method == baseline and (cat == OVERALL or r.category == cat)]
            shared = {(r.question_id, r.turn) for r in mine} & {(r.question_id, r.turn) for r in base}
            if shared:
                qm, qb = _per_question(mine, shared), _per_question(base, shared)
                a = np.stack([qm[k] for k in qm])
                b = np.stack([qb[k] for k in qm])
                speedup = ratio_of_ratios_ci(a[:, 0], a[:, 1], b[:, 0], b[:, 1], **kw)
            out.append(MethodSummary(
                method=m, category=cat, questions=len(q), turns=len(mine), new_tokens=int(tokens.sum()),
                seconds=float(secs.sum()), rounds=int(rounds.sum()),
                tau=ratio_ci(committed, rounds, **kw), tokens_per_s=ratio_ci(tokens, secs, **kw), speedup=speedup,
                depth_acceptance=depth_acceptance(mine), phase_seconds=_phase_seconds(mine)))
    return out


def compare(results: list[TurnResult], a: str, b: str, *, category: str = OVERALL, n_resamples: int = 5000,
            confidence_level: float = 0.95, seed: int = 0) -> Comparison:
    """tau(a) - tau(b), tau(a) / tau(b) and tokens/s(a) / tokens/s(b) with paired bootstrap CIs over shared prompts."""
    kw = dict(n_resamples=n_resamples, confidence_level=confidence_level, seed=seed)
    ra = [r for r in results if r.method == a and (category == OVERALL or r.category == category)]
    rb = [r for r in results if r.method == b and (category == OVERALL or r.category == category)]
    shared = {(r.question_id, r.turn) for r in ra} & {(r.question_id, r.turn) for r in rb}
    if not shared:
        raise ValueError(f"methods {a!r} and {b!r} share no prompt in category {category!r}")
    qa, qb = _per_question(ra, shared), _per_question(rb, shared)
    x = np.stack([qa[k] for k in qa])  # [Q, 4]
    y = np.stack([qb[k] for k in qa])
    return Comparison(a, b, category,
                      tau_difference=ratio_difference_ci(x[:, 2], x[:, 3], y[:, 2], y[:, 3], **kw),
                      speed_ratio=ratio_of_ratios_ci(x[:, 0], x[:, 1], y[:, 0], y[:, 1], **kw),
                      tau_ratio=ratio_of_ratios_ci(x[:, 2], x[:, 3], y[:, 2], y[:, 3], **kw))


def compare_all_pairs(results: list[TurnResult], methods: list[str], **kw) -> list[Comparison]:
    """Every ordered pair (earlier, later) of the given methods, overall."""
    return [compare(results, a, b, **kw) for i, a in enumerate(methods) for b in methods[i + 1:]]
