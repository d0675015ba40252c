"""Is the speculative output still exactly the target's?

T = 0: every method's generated ids must equal vanilla's token for token, turn by turn
(`check_greedy`); each mismatch names the question, turn, method and the first diverging
position (0-based index into the generated tokens). `explain_mismatches` then looks at the
target's logits there: in bf16/fp16 a batched tree forward and a one-token forward round
differently, so when the two candidate tokens' logits are within a few units in the last place
(ulp) of the logit scale, both are "the argmax" up to rounding (a precision near-tie). Anything
else is a real divergence: a bug.
T > 0: outputs are random, so the test is on distributions (`distribution_test`): sample many
continuations of one prompt with vanilla and with a method, histogram the token at fixed
generated positions, and run a chi-squared test of homogeneity per position (scipy.stats).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from evaluation.methods import Method
from evaluation.runner import GenerationArgs, TurnResult, generate

STOPPED = -1  # histogram cell for "generation ended before this position"


@dataclass
class Mismatch:
    question_id: str
    turn: int
    method: str
    position: int  # first generated position where the method differs from vanilla
    expected: int | None  # vanilla's token there (None: vanilla had already stopped)
    got: int | None  # the method's token there (None: the method had already stopped)
    vanilla_tokens: int
    method_tokens: int
    logit_gap: float | None = None  # target logit(expected) - logit(got) at the divergence (explain_mismatches)
    gap_ulps: float | None = None  # the same in units in the last place of the logit scale, in the target's dtype
    near_tie: bool | None = None  # |gap| <= tie_ulps ulps: a rounding near-tie, not a decoding bug


@dataclass
class GreedyCheck:
    compared: int  # (method, question, turn) outputs compared with vanilla
    mismatches: list[Mismatch] = field(default_factory=list)
    tie_ulps: float | None = None  # set by explain_mismatches

    @property
    def lossless(self) -> bool:
        """Bit-exact: every output equals vanilla's."""
        return not self.mismatches

    @property
    def divergences(self) -> list[Mismatch]:
        """Mismatches NOT explained as precision near-ties (all of them when unexplained)."""
        return [m for m in self.mismatches if not m.near_tie]

    def to_dict(self) -> dict:
        return {"compared": self.compared, "lossless": self.lossless, "divergences": len(self.divergences),
                "near_ties": len(self.mismatches) - len(self.divergences), "tie_ulps": self.tie_ulps,
                "mismatches": [m.__dict__ for m in self.mismatches]}


def first_divergence(expected: list[int], got: list[int]) -> int | None:
    """Index of the first differing token, len(shorter) if one is a strict prefix, None if equal."""
    for i, (e, g) in enumerate(zip(expected, got)):
        if e != g:
            return i
    return None if len(expected) == len(got) else min(len(expected), len(got))


def check_greedy(results: list[TurnResult], baseline: str = "vanilla") -> GreedyCheck:
    """Compare every method's output with the baseline's on the same (question, turn).
    A turn after a mismatching turn sees a different history, so only a method's FIRST
    mismatching turn per question is reported."""
    ref = {(r.question_id, r.turn): r.output_ids for r in results if r.method == baseline}
    check = GreedyCheck(0)
    diverged: set[tuple[str, str]] = set()
    for r in sorted((r for r in results if r.method != baseline), key=lambda r: (r.method, r.question_id, r.turn)):
        key = (r.question_id, r.turn)
        if key not in ref or (r.method, r.question_id) in diverged:
            continue
        check.compared += 1
        pos = first_divergence(ref[key], r.output_ids)
        if pos is None:
            continue
        exp, got = ref[key], r.output_ids
        check.mismatches.append(Mismatch(r.question_id, r.turn, r.method, pos, exp[pos] if pos < len(exp) else None,
                                         got[pos] if pos < len(got) else None, len(exp), len(got)))
        diverged.add((r.method, r.question_id))
    return check


@torch.no_grad()
def explain_mismatches(base_model, results: list[TurnResult], check: GreedyCheck, tie_ulps: float = 4.0,
                       baseline: str = "vanilla") -> GreedyCheck:
    """Fill logit_gap / gap_ulps / near_tie of every mismatch from one target forward over the
    baseline's prefix up to the divergence (a length mismatch is never a near-tie)."""
    ref = {(r.question_id, r.turn): r for r in results if r.method == baseline}
    device = next(base_model.parameters()).device
    check.tie_ulps = tie_ulps
    for m in check.mismatches:
        if m.expected is None or m.got is None:
            m.near_tie = False
            continue
        r = ref[(m.question_id, m.turn)]
        ids = torch.tensor([r.prompt_ids + r.output_ids[: m.position]], device=device)  # [1, T]
        logits = base_model(ids).logits[0, -1]  # [V] in the target's dtype
        scale = float(logits.float().abs().max())
        ulp = torch.finfo(logits.dtype).eps * 2.0 ** math.floor(math.log2(scale)) if scale > 0 else torch.finfo(logits.dtype).tiny
        m.logit_gap = float(logits[m.expected].float() - logits[m.got].float())
        m.gap_ulps = m.logit_gap / ulp
        m.near_tie = abs(m.gap_ulps) <= tie_ulps
    return check


@dataclass
class PositionTest:
    position: int
    statistic: float
    dof: int
    p_value: float
    cells: int  # histogram cells after pooling rare tokens


@dataclass
class DistributionTest:
    method: str
    samples: int
    temperature: float
    alpha: float  # family-wise; each position is tested at alpha / positions (Bonferroni)
    positions: list[PositionTest] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(p.p_value >= self.alpha / len(self.positions) for p in self.positions)

    def to_dict(self) -> dict:
        return {"method": self.method, "samples": self.samples, "temperature": self.temperature, "alpha": self.alpha,
                "passed": self.passed, "positions": [p.__dict__ for p in self.positions]}


def chi2_homogeneity(a: np.ndarray, b: np.ndarray, min_expected: float = 5.0) -> tuple[float, int, float, int]:
    """Chi-squared test that two samples of token ids come from one distribution.

    Tokens whose expected count is below `min_expected` in either sample are pooled into one
    cell (the chi2 approximation needs it). Returns (statistic, dof, p_value, cells);
    p = 1 when everything falls in one cell (both samples constant and equal)."""
    tokens, inv = np.unique(np.concatenate([a, b]), return_inverse=True)
    table = np.zeros((2, len(tokens)), dtype=np.float64)  # [2, K]
    np.add.at(table[0], inv[: len(a)], 1)
    np.add.at(table[1], inv[len(a):], 1)
    expected = table.sum(0, keepdims=True) * table.sum(1, keepdims=True) / table.sum()  # [2, K]
    rare = (expected < min_expected).any(0)  # [K]
    if rare.any():
        table = np.concatenate([table[:, ~rare], table[:, rare].sum(1, keepdims=True)], axis=1)
        table = table[:, table.sum(0) > 0]
    if table.shape[1] < 2:
        return 0.0, 0, 1.0, table.shape[1]
    # lazy: scipy.stats costs over a second at import; only the statistics need it, not a command's --help
    from scipy import stats as sps

    stat, p, dof, _ = sps.chi2_contingency(table, correction=False)
    return float(stat), int(dof), float(p), table.shape[1]


def sample_positions(model, method: Method, prompt_ids: list[int], positions: list[int], samples: int,
                     gen: GenerationArgs, seed: int) -> np.ndarray:
    """[samples, len(positions)] token ids at the given generated positions (STOPPED after a stop)."""
    out = np.full((samples, len(positions)), STOPPED, dtype=np.int64)
    g = torch.Generator(device="cpu")
    for s in range(samples):
        g.manual_seed(seed * 7_919 + s)
        ids, _, _ = generate(model, method, prompt_ids, gen, g)
        for j, p in enumerate(positions):
            if p < len(ids):
                out[s, j] = ids[p]
    return out


def distribution_test(model, vanilla: Method, method: Method, prompt_ids: list[int], *, positions: list[int],
                      samples: int, temperature: float, max_length: int, top_p: float = 0.0, top_k: int = 0,
                      eos_token_id=None, alpha: float = 0.01, min_expected: float = 5.0,
                      seed: int = 0) -> DistributionTest:
    """Sample `samples` continuations with each method and chi2-test the token histograms per position."""
    if temperature <= 0:
        raise ValueError("the distribution test needs temperature > 0 (use the greedy check at T = 0)")
    if not positions or min(positions) < 0:
        raise ValueError(f"positions must be non-negative generated-token indices, got {positions}")
    if len(prompt_ids) + max(positions) + 1 > max_length:
        raise ValueError(f"prompt of {len(prompt_ids)} tokens + {max(positions) + 1} positions > max_length {max_length}")
    gen = GenerationArgs(max_new_tokens=max(positions) + 1, max_length=max_length,
                         temperature=temperature, top_p=top_p, top_k=top_k, eos_token_id=eos_token_id)
    ref = sample_positions(model, vanilla, prompt_ids, positions, samples, gen, seed)
    # a different seed stream: identical streams could make a lossy method look identical
    got = sample_positions(model, method, prompt_ids, positions, samples, gen, seed + 1)
    test = DistributionTest(method.label, samples, temperature, alpha)
    for j, p in enumerate(positions):
        stat, dof, pv, cells = chi2_homogeneity(ref[:, j], got[:, j], min_expected)
        test.positions.append(PositionTest(p, stat, dof, pv, cells))
    return test
