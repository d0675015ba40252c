"""The one rule every statistical test of the default tier goes through: a sequential test whose family of tests
keeps the chance of a false alarm (a red CI run with nothing wrong) at most 1e-4 per CI run, on any machine.

Why a rule at all. A seeded draw sequence depends on the last bits of the CPU's arithmetic (vector width, kernel,
summation order: tests/float_variants.py), because `torch.multinomial` turns probabilities into tokens. On another
machine a seeded test therefore sees other draws: its p-value is a fresh, uniformly distributed number under the
null hypothesis (the sampler is exact), and a test at alpha = 0.01 fails on one new machine in a hundred for
nothing. With m such tests a CI run is red with probability ~ m * alpha.

The rule (sequential, two stages). A test states `draws` (N) and a `seed`.
  1. Draw N with `seed`. p1 >= ALPHA_FIRST (0.01): pass.
  2. Otherwise draw RERUN_FACTOR * N = 4N afresh with `rerun_seed(seed)`, a DIFFERENT seed, and fail only if
     p2 < ALPHA_RERUN there. The rerun's draws are independent of the first stage's only because the seed differs:
     with the same seed (on the same machine) the rerun would replay the first N draws and the two stages would
     be correlated. The first stage's draws are discarded, not pooled, for the same reason.

The arithmetic. Under the null hypothesis a valid p-value satisfies P(p < a) <= a; the two stages are independent,
so one test fails with probability
    P(p1 < ALPHA_FIRST) * P(p2 < ALPHA_RERUN) <= ALPHA_FIRST * ALPHA_RERUN.
Pearson's chi-square p-value (cells with expected count >= 5, the rest pooled) is approximate: its far tail can
sit above nominal, so the budget keeps a factor APPROXIMATION_MARGIN = 3 for it (measured on eagenerate's law with
counts drawn from the exact law, tests/test_statistical_power.py, 40000 simulations a stage: P(p < 0.01) = 0.0121
at 2000 draws, P(p < 2.6e-4) = 2.75e-4 at 8000 draws, 1.3x the nominal product). Over the family of
BUDGET_TESTS = m tests (union bound: no independence between tests is assumed),
    P(any false alarm in a CI run) <= m * ALPHA_FIRST * ALPHA_RERUN * APPROXIMATION_MARGIN = FAMILY_FALSE_ALARM
    ALPHA_RERUN = FAMILY_FALSE_ALARM / (m * ALPHA_FIRST * APPROXIMATION_MARGIN)
                = 1e-4 / (13 * 0.01 * 3) = 2.6e-4.
m counts test items (each parametrisation is one test) of the default tier marked `statistical`; the rule refuses
to run in a test without the marker, and tests/test_statistical_rule.py collects the default tier and fails when
more than BUDGET_TESTS tests use the rule: a new statistical test cannot silently spend the budget; whoever adds
one raises BUDGET_TESTS (which lowers ALPHA_RERUN) and re-measures the power table. A test that looks at several
statistics of the same draws (a chi-square and a binomial count) combines them into one p-value by Bonferroni
(`bonferroni`), still a valid p-value.

Power (a wrong sampler fails the rule): P(p1 < ALPHA_FIRST at N) * P(p2 < ALPHA_RERUN at 4N); both factors must be
near 1, so N is chosen for power at alpha 0.01 and the rerun's 4N buys the smaller alpha. Measured per test, with a
deliberately wrong sampler, in tests/test_statistical_power.py (slow tier); the table is in
docs/results/statistical_tests.md. Cost under the null: N draws, plus 4N with probability ALPHA_FIRST.

`EAGLE_STATISTICS_LOG=FILE` appends one JSON line per stage (test, stage, draws, seed, p): tests/float_variants.py
reads it to report every statistical test's p-values under every arithmetic variant.
"""
from __future__ import annotations

import dataclasses
import json
import os
from typing import Callable

FAMILY_FALSE_ALARM = 1e-4  # P(a CI run is red with every sampler exact), any machine
BUDGET_TESTS = 13  # m: default-tier tests marked `statistical` (tests/test_statistical_rule.py counts them)
ALPHA_FIRST = 0.01
APPROXIMATION_MARGIN = 3.0  # the chi-square approximation's tail, see above
ALPHA_RERUN = FAMILY_FALSE_ALARM / (BUDGET_TESTS * ALPHA_FIRST * APPROXIMATION_MARGIN)
RERUN_FACTOR = 4
RERUN_SEED_STEP = 1_000_003  # rerun_seed(s) = s + this: never a seed a first stage uses (those are small)
MARKER = "statistical"

# (pytest node id, whether it carries the `statistical` marker) of the running test; set by tests/conftest.py
current_test: tuple[str, bool] | None = None

Run = Callable[[int, int], "float | tuple[float, str]"]  # (draws, seed) -> p-value, or (p-value, a note)


@dataclasses.dataclass
class Verdict:
    draws: int
    seed: int
    p_first: float
    note_first: str = ""
    p_rerun: float | None = None
    note_rerun: str = ""

    @property
    def rerun_draws(self) -> int:
        return RERUN_FACTOR * self.draws

    @property
    def rerun_seed(self) -> int:
        return rerun_seed(self.seed)

    @property
    def passed(self) -> bool:
        return self.p_first >= ALPHA_FIRST or (self.p_rerun is not None and self.p_rerun >= ALPHA_RERUN)

    def describe(self) -> str:
        def stage(p, draws, seed, note):
            return f"p={p:.2e} at {draws} draws (seed {seed}{', ' + note if note else ''})"
        text = stage(self.p_first, self.draws, self.seed, self.note_first)
        if self.p_rerun is not None:
            rerun = stage(self.p_rerun, self.rerun_draws, self.rerun_seed, self.note_rerun)
            text += f" < {ALPHA_FIRST}, rerun: {rerun} vs {ALPHA_RERUN:.1e}"
        return text


def rerun_seed(seed: int) -> int:
    return seed + RERUN_SEED_STEP


def bonferroni(*pvalues: float) -> float:
    """One valid p-value for several tests of the same null hypothesis: min(1, k * min p)."""
    return min(1.0, len(pvalues) * min(pvalues))


def binomial_pvalue(successes: int, trials: int, p: float, alternative: str = "two-sided") -> float:
    """Exact binomial test of `successes` in `trials` against probability `p`."""
    from scipy.stats import binomtest  # scipy.stats costs a second at import: only the tests that need it pay

    return float(binomtest(successes, trials, p, alternative=alternative).pvalue)


def _call(run: Run, draws: int, seed: int, stage: str) -> tuple[float, str]:
    out = run(draws, seed)
    p, note = (out, "") if isinstance(out, float | int) else out
    p = float(p)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"a p-value must lie in [0, 1], the run gave {p} ({note})")
    log = os.environ.get("EAGLE_STATISTICS_LOG")
    if log:
        test = current_test[0] if current_test else os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0]
        with open(log, "a") as f:
            f.write(json.dumps({"test": test, "stage": stage, "draws": draws, "seed": seed, "p": p}) + "\n")
    return p, note


def sequential_verdict(run: Run, draws: int, seed: int) -> Verdict:
    """The rule's verdict, without asserting (the power measurement counts verdicts)."""
    p1, note1 = _call(run, draws, seed, "first")
    verdict = Verdict(draws, seed, p1, note1)
    if p1 < ALPHA_FIRST:
        verdict.p_rerun, verdict.note_rerun = _call(run, RERUN_FACTOR * draws, rerun_seed(seed), "rerun")
    return verdict


def assert_same_law(run: Run, draws: int, seed: int, what: str) -> Verdict:
    """The default tier's statistical assertion: `run(draws, seed)` gives the p-value of draws from the code under
    test against the law they must follow; fails by the sequential rule above, naming both stages."""
    if current_test is not None and not current_test[1]:
        raise RuntimeError(f"{current_test[0]} uses tests/statistical_rule.py without @pytest.mark.{MARKER}: mark it, "
                           f"so the false-alarm budget (BUDGET_TESTS = {BUDGET_TESTS}) counts it")
    verdict = sequential_verdict(run, draws, seed)
    assert verdict.passed, f"{what}: not the exact law: {verdict.describe()}"
    return verdict
