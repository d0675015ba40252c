"""train.loss_chunk: the chunked token loss equals the unchunked one (value, gradient, top-k counts) and
holds less memory at once."""
from __future__ import annotations

import pytest
import torch

from float_tolerance import assert_same_function
from train.head_kinds import NextFeatureTargets
from train.loss import draft_loss

pytestmark = pytest.mark.numeric  # float comparisons: tests/float_variants.py runs them under every variant

# the loss: log_softmax over V = 300 logits (max, sum), the soft CE sum, the weighted mean over <= 74 positions;
# its gradient: softmax minus target, times lm_head (V terms). Summed in another order when chunked.
LOSS_TERMS, LOSS_REDUCTIONS = 300, 4


def eagle_loss(pred, targets, weights, lm_head, feature_weight, token_weight, chunk=0):
    """EAGLE-2's loss: one step with the feature loss, scored through the target's lm_head."""
    return draft_loss([pred], weights, NextFeatureTargets(targets, lm_head, chunk), [token_weight], feature_weight)


def _inputs(dtype, B=2, T=37, H=16, V=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    pred = torch.randn(B, T, H, generator=g).to(dtype).requires_grad_(True)
    targets = torch.randn(B, T, H, generator=g).to(dtype)
    weights = (torch.rand(B, T, generator=g) > 0.3).long()
    lm_head = (torch.randn(V, H, generator=g) * 0.5).to(dtype)
    return pred, targets, weights, lm_head


@pytest.mark.parametrize("chunk", [1, 7, 16, 45])
def test_chunked_loss_equals_unchunked_with_gradients(chunk):
    """The loss math runs in float32 (as the unchunked path), so equal means equal up to float32 rounding."""
    pred, targets, weights, lm_head = _inputs(torch.float32)
    ref = eagle_loss(pred, targets, weights, lm_head, 1.0, 0.1, chunk=0)
    (g_ref,) = torch.autograd.grad(ref.loss * 3.0, pred)  # a non-unit upstream gradient (like a loss scale)
    out = eagle_loss(pred, targets, weights, lm_head, 1.0, 0.1, chunk=chunk)
    (g,) = torch.autograd.grad(out.loss * 3.0, pred)
    assert out.positions == ref.positions and out.positions > chunk  # really chunked
    assert_same_function(out.token, ref.token, terms=LOSS_TERMS, chained=LOSS_REDUCTIONS)
    assert_same_function(out.loss, ref.loss, terms=LOSS_TERMS, chained=LOSS_REDUCTIONS)
    assert_same_function(g, g_ref, terms=LOSS_TERMS, chained=LOSS_REDUCTIONS)
    assert out.topk_correct == ref.topk_correct
    assert g.abs().sum() > 0


def test_chunked_loss_other_dtypes_match_within_rounding():
    for dtype in (torch.float64, torch.bfloat16):
        pred, targets, weights, lm_head = _inputs(dtype, seed=1)
        ref = eagle_loss(pred, targets, weights, lm_head, 1.0, 0.1, chunk=0)
        (g_ref,) = torch.autograd.grad(ref.loss, pred)
        out = eagle_loss(pred, targets, weights, lm_head, 1.0, 0.1, chunk=8)
        (g,) = torch.autograd.grad(out.loss, pred)
        assert g.dtype == dtype
        # the loss math runs in float32 whatever the input dtype; a bf16 gradient is rounded to bf16 on top
        math = torch.float32 if dtype == torch.float64 else dtype
        assert_same_function(out.loss, ref.loss, terms=LOSS_TERMS, chained=LOSS_REDUCTIONS, dtype=math)
        assert_same_function(g, g_ref, terms=LOSS_TERMS, chained=LOSS_REDUCTIONS, dtype=math)


def test_chunked_loss_lowers_peak_memory():
    """Peak bytes held by autograd-visible tensors during forward+backward (CPU allocator via a tracking mode)."""
    import weakref

    from torch.utils._python_dispatch import TorchDispatchMode

    class Peak(TorchDispatchMode):
        """Bytes of the live tensor storages created inside the mode (freed when their tensor dies); keeps the peak."""

        def __enter__(self):
            self.sizes, self.now, self.peak = {}, 0, 0
            return super().__enter__()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    key = t.untyped_storage().data_ptr()
                    if key not in self.sizes:
                        self.sizes[key] = t.untyped_storage().nbytes()
                        self.now += self.sizes[key]
                        self.peak = max(self.peak, self.now)
                        weakref.finalize(t, self._free, key)
            return out

        def _free(self, key):
            self.now -= self.sizes.pop(key, 0)

    def peak(chunk):
        pred, targets, weights, lm_head = _inputs(torch.float32, B=2, T=256, H=32, V=4000, seed=2)
        with Peak() as m:
            out = eagle_loss(pred, targets, weights, lm_head, 1.0, 0.1, chunk=chunk)
            out.loss.backward()
            del out
        return m.peak

    full, chunked = peak(0), peak(64)
    n_v = 4000 * 4  # bytes of one fp32 logits row
    assert full > 5 * 300 * n_v  # several [N ~ 360, V] fp32 tensors at once
    assert chunked < full / 3, (chunked, full)
