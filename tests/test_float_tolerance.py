"""tests/float_tolerance.py: the rounding bound is Higham's gamma_n, it passes rounding and fails bugs."""
from __future__ import annotations

import pytest
import torch

from float_tolerance import assert_same_function, gamma, rounding_bound
from float_variants import variants


def test_gamma_and_the_bound():
    u = 2.0 ** -24  # float32
    assert gamma(10, torch.float32) == pytest.approx(10 * u / (1 - 10 * u), rel=1e-12)
    assert rounding_bound(torch.float32, 10, 3.0, chained=2) == pytest.approx(2 * 2 * gamma(10, torch.float32) * 3.0)
    # 16-bit types accumulate in float32 and round once per reduction
    assert rounding_bound(torch.bfloat16, 100, 1.0) == pytest.approx(2 * (2.0 ** -8 + gamma(100, torch.float32)))
    with pytest.raises(ValueError, match="meaningless"):
        gamma(10_000, torch.bfloat16)


def test_two_summation_orders_pass_and_a_bug_fails():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(64, 512, generator=g), torch.randn(512, 32, generator=g)
    pairwise = x @ w  # BLAS blocking
    sequential = torch.zeros(64, 32)
    for i in range(512):  # one term at a time: the worst order
        sequential += x[:, i : i + 1] * w[i]
    assert_same_function(pairwise, sequential, terms=512)
    assert_same_function(x.double() @ w.double(), sequential, terms=512)  # float32 vs float64: the coarser decides
    off_by_one_row = x[:, :-1] @ w[:-1]  # a term dropped: what a wrong mask does
    with pytest.raises(AssertionError, match="rounding bound"):
        assert_same_function(off_by_one_row, pairwise, terms=512)
    with pytest.raises(AssertionError):
        assert_same_function(pairwise.clone().fill_(float("nan")), pairwise, terms=512)


def test_elementwise_magnitude_is_a_relative_bound():
    p = torch.tensor([1e-20, 0.5])
    assert_same_function(p * (1 + 2.0 ** -24), p, terms=1, magnitude=p)
    with pytest.raises(AssertionError, match="element 0"):
        assert_same_function(p * torch.tensor([1.001, 1.0]), p, terms=1, magnitude=p)
    with pytest.raises(TypeError, match="dtype"):
        assert_same_function(1.0, 1.0, terms=1)


def test_the_variants_runner_offers_the_machine_independent_variants():
    names = set(variants())
    assert {"baseline", "threads-2", "aten-default", "mkl-sse42", "sdpa-math", "no-mkldnn"} <= names
