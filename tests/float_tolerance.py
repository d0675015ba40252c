"""Tolerances for comparing two float computations of one function, derived from the arithmetic.

Two computations of the same function that sum in different orders (a fused kernel vs a reference loop, a
batched matmul vs a per-row one, one CPU's vector width vs another's, one thread vs two) differ by rounding
only. For a sum of n terms in a precision with unit roundoff u, the computed result differs from the exact one
by at most gamma_n * sum|terms|, gamma_n = n*u / (1 - n*u) (Higham, "Accuracy and Stability of Numerical
Algorithms", 2nd ed., section 3.1), so two orders differ by at most twice that. A network applies `chained`
such reductions one after another; to first order their errors add (our tiny models' weights have norms
below ~1, so an error is not amplified on its way through a layer). Hence

    bound = 2 * chained * gamma_terms(dtype) * magnitude

where `magnitude` is the scale of the values being summed; by default the largest |expected|. (Strictly the
bound needs sum|terms|, which for terms of random sign is ~sqrt(n) times |sum|; but real rounding errors are
random too and grow like sqrt(n), not n, so the bound keeps a margin of ~sqrt(n) over what is observed.) A real
bug (a wrong mask, position or weight) moves results by O(magnitude), orders of magnitude above the bound.

Where the claim is "these two code paths are the same function", tests compare in float64 (u = 1.1e-16), so the
bound sits ~10 orders of magnitude below any bug. float32 (u = 6e-8) and bfloat16 (u = 3.9e-3) comparisons use
the same bound with their own u. Exact claims (greedy tokens, byte-identical files, bit-identical resumes on the
same ranks, "the same op sequence") stay exact and do not use this module; a resume on another number of ranks is
one function computed in other processes (tests/test_train_helpers.py: assert_same_training).

`EAGLE_TOLERANCE_LOG=FILE` appends one JSON line per comparison (test, observed max difference, bound): the
variants runner (tests/float_variants.py) reads it to report each test's headroom.
"""
from __future__ import annotations

import json
import os

import torch


# Reductions one transformer decoder layer runs one after another: input norm, q/k/v projection, q.k scores,
# softmax sum, weights x V, o_proj, post-attention norm, gate/up projection, down projection.
LAYER_REDUCTIONS = 9


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = eps / 2: the largest relative error of rounding one real number to `dtype`."""
    return torch.finfo(dtype).eps / 2


def gamma(n: int, dtype: torch.dtype) -> float:
    """gamma_n = n u / (1 - n u): the relative error bound of an n-term sum (or dot product) in `dtype`."""
    nu = n * unit_roundoff(dtype)
    if nu >= 1:
        raise ValueError(f"{n} terms in {dtype}: the rounding bound is meaningless (n*u = {nu:.2f} >= 1)")
    return nu / (1 - nu)


def rounding_bound(dtype: torch.dtype, terms: int, magnitude: float, chained: int = 1) -> float:
    """The largest difference two summation orders can make: `chained` reductions of `terms` terms at scale
    `magnitude`, both computations in `dtype` (the module docstring derives it). 16-bit types (bfloat16, float16)
    accumulate in float32 inside torch's CPU kernels and round each result once, so one of their reductions
    errs by at most u_16 + gamma_n(float32)."""
    if unit_roundoff(dtype) > unit_roundoff(torch.float32):
        per_reduction = unit_roundoff(dtype) + gamma(terms, torch.float32)
    else:
        per_reduction = gamma(terms, dtype)
    return 2 * chained * per_reduction * float(magnitude)


def _common_dtype(a: torch.Tensor, b: torch.Tensor) -> torch.dtype:
    """The LESS precise of the two: the coarser computation decides how far apart they can be."""
    return a.dtype if unit_roundoff(a.dtype) >= unit_roundoff(b.dtype) else b.dtype


def assert_same_function(actual, expected, *, terms: int, chained: int = 1,
                         magnitude: float | torch.Tensor | None = None, dtype: torch.dtype | None = None,
                         msg: str = "") -> float:
    """`actual` and `expected` are one function computed two ways: equal up to `rounding_bound`.

    terms: the longest reduction on the way (e.g. the hidden size for a linear layer, the key count for
    attention); chained: how many reductions run one after another on the longest path; magnitude: the size
    of what is summed (default: the largest |expected|, the scale the function's values live at; a tensor
    gives each element its own scale, e.g. |expected| itself for a relative bound on products and logs).
    dtype: the precision both computations ran in (default: the coarser of the two tensors' dtypes; required
    when they are Python numbers). Returns the largest bound used.
    """
    if dtype is None:
        if not (torch.is_tensor(actual) and torch.is_tensor(expected)):
            raise TypeError("assert_same_function: pass dtype= (the precision of the computations) for Python numbers")
        dtype = _common_dtype(actual, expected)
    actual, expected = torch.as_tensor(actual), torch.as_tensor(expected)
    if actual.shape != expected.shape:
        raise AssertionError(f"shapes differ: {tuple(actual.shape)} vs {tuple(expected.shape)} {msg}")
    a, e = actual.detach().double(), expected.detach().double()
    if magnitude is None:
        magnitude = e.abs().max() if e.numel() else 0.0
    scale = torch.as_tensor(magnitude).detach().double()
    bound = (rounding_bound(dtype, terms, 1.0, chained) * scale).expand_as(a)
    diff = (a - e).abs()
    if not a.numel():
        return 0.0
    ratio = torch.where(diff == 0, 0.0, diff / bound).nan_to_num(nan=float("inf"))  # NaN anywhere: fails
    worst = int(ratio.flatten().argmax())
    d, b = float(diff.flatten()[worst]), float(bound.flatten()[worst])
    _log(d, b)
    if float(ratio.flatten()[worst]) > 1:
        raise AssertionError(f"|difference| {d:.3g} > rounding bound {b:.3g} ({dtype}, {terms} terms, {chained} "
                             f"chained) at element {worst} {msg}".rstrip())
    return float(bound.max())


def float64(*objs):
    """Modules and tensors cast to float64 (modules in place), for comparing two code paths as functions."""
    out = [o.double() if isinstance(o, torch.nn.Module) or (torch.is_tensor(o) and o.is_floating_point()) else o
           for o in objs]
    return out[0] if len(out) == 1 else out


def _log(diff: float, bound: float) -> None:
    path = os.environ.get("EAGLE_TOLERANCE_LOG")
    if not path:
        return
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0]
    with open(path, "a") as f:
        f.write(json.dumps({"test": test, "diff": diff, "bound": bound}) + "\n")
