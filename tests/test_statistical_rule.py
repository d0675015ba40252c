"""tests/statistical_rule.py: the sequential rule decides as its docstring says, its arithmetic keeps the family's
false-alarm probability at FAMILY_FALSE_ALARM, and the family is no larger than the budget was computed for."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import statistical_rule
from statistical_rule import (ALPHA_FIRST, ALPHA_RERUN, APPROXIMATION_MARGIN, BUDGET_TESTS, FAMILY_FALSE_ALARM,
                              RERUN_FACTOR, assert_same_law, bonferroni, rerun_seed, sequential_verdict)

TESTS = Path(__file__).resolve().parent


def recording(pvalues):
    calls = []

    def run(draws, seed):
        calls.append((draws, seed))
        return pvalues[len(calls) - 1], "note"
    return run, calls


def test_the_arithmetic_keeps_the_family_under_its_false_alarm_budget():
    assert BUDGET_TESTS * ALPHA_FIRST * ALPHA_RERUN * APPROXIMATION_MARGIN <= FAMILY_FALSE_ALARM * (1 + 1e-12)
    assert FAMILY_FALSE_ALARM <= 1e-4 and ALPHA_RERUN < ALPHA_FIRST and RERUN_FACTOR >= 4


@pytest.fixture
def outside_a_test(monkeypatch):
    """The rule's logic on fake runs, which are no part of the family (the marker check is off)."""
    monkeypatch.setattr(statistical_rule, "current_test", None)


@pytest.mark.usefixtures("outside_a_test")
def test_a_first_stage_pass_draws_no_more():
    run, calls = recording([0.3])
    verdict = assert_same_law(run, draws=100, seed=7, what="x")
    assert calls == [(100, 7)] and verdict.passed and verdict.p_rerun is None


@pytest.mark.usefixtures("outside_a_test")
def test_a_first_stage_failure_reruns_with_four_times_the_draws_and_another_seed():
    run, calls = recording([ALPHA_FIRST / 2, ALPHA_RERUN * 2])
    verdict = assert_same_law(run, draws=100, seed=7, what="x")
    assert calls == [(100, 7), (RERUN_FACTOR * 100, rerun_seed(7))] and rerun_seed(7) != 7 and verdict.passed
    run, calls = recording([ALPHA_FIRST / 2, ALPHA_RERUN / 2])
    with pytest.raises(AssertionError, match=r"x: not the exact law: p=5.00e-03 at 100 draws \(seed 7, note\) < 0.01, "
                                             r"rerun: p=.* at 400 draws \(seed 1000010, note\) vs " + f"{ALPHA_RERUN:.1e}"):
        assert_same_law(run, draws=100, seed=7, what="x")
    assert not sequential_verdict(recording([0.0, 0.0])[0], 10, 1).passed


def test_the_rule_refuses_a_test_without_the_marker():
    with pytest.raises(RuntimeError, match=r"test_the_rule_refuses_a_test_without_the_marker uses "
                                           r"tests/statistical_rule.py without @pytest.mark.statistical"):
        assert_same_law(recording([0.5])[0], draws=10, seed=0, what="x")


def test_bonferroni_is_a_valid_combination():
    assert bonferroni(0.2, 0.004) == pytest.approx(0.008) and bonferroni(0.9, 0.8) == 1.0
    with pytest.raises(ValueError, match=r"a p-value must lie in \[0, 1\], the run gave 1.5"):
        sequential_verdict(lambda d, s: 1.5, 10, 0)


def test_the_default_tier_holds_no_more_statistical_tests_than_the_budget():
    """Collect the default tier: the tests marked `statistical` are the family the arithmetic is for."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                           "-m", f"{statistical_rule.MARKER} and not slow", str(TESTS)],
                          cwd=TESTS.parent, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    family = [ln for ln in proc.stdout.splitlines() if "::" in ln]
    assert family, proc.stdout[-3000:]
    assert len(family) <= BUDGET_TESTS, (
        f"{len(family)} default-tier tests are marked statistical, the false-alarm budget of tests/statistical_rule.py "
        f"was computed for BUDGET_TESTS = {BUDGET_TESTS}: raise it (ALPHA_RERUN follows) and re-measure the power "
        f"table (docs/results/statistical_tests.md):\n" + "\n".join(family))


def test_no_test_compares_a_p_value_with_its_own_alpha():
    """A p-value accepted against a constant bypasses the rule (and the budget): only rejections of a deliberately
    wrong sampler (p < tiny) may stand outside it."""
    accept = re.compile(r"\b(pvalue|p_value)\b[\])]*\s*>=?|\bALPHA\s*=")
    found = [f"{path.name}:{i}: {line.strip()}" for path in sorted(TESTS.glob("test_*.py"))
             for i, line in enumerate(path.read_text().splitlines(), 1) if accept.search(line)]
    assert not found, "p-values accepted outside tests/statistical_rule.py:\n" + "\n".join(found)
