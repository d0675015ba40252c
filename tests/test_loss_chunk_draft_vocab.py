"""train.loss_chunk for EAGLE-3 / P-EAGLE (train/head_kinds.py: DraftVocabTargets.chunked): the chunked token loss
equals the unchunked one (value, gradients, top-k counts, D-PACE confidence) and never builds a [T, V] or [rows, Vd]
tensor, forward or backward."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaConfig

from eagle.head import Eagle3Head, head_config_from_target
from float_tolerance import assert_same_function
from train.head_kinds import DraftVocabTargets, Eagle3Training, PeagleTraining
from train.loss import draft_loss

pytestmark = pytest.mark.numeric

B, T, H, V, VD = 2, 23, 8, 300, 120
ROWS = torch.tensor([0, 4, 9, 15, 22])


def _setup(seed=0):
    torch.manual_seed(seed)
    tc = LlamaConfig(num_hidden_layers=4, hidden_size=H, intermediate_size=32, num_attention_heads=2, vocab_size=V)
    head = Eagle3Head(head_config_from_target(tc, kind="eagle3", aux_layers=[1, 2, 3], draft_vocab_size=VD))
    d2t = torch.sort(torch.randperm(V)[:VD]).values - torch.arange(VD)
    head.set_vocab(d2t)
    final = torch.randn(B, T, H)
    lm_head = torch.randn(V, H) * 0.5
    weights = (torch.rand(B, T) > 0.25).long()
    hiddens = [torch.randn(B, T, H, requires_grad=True), torch.randn(B, len(ROWS), H, requires_grad=True),
               torch.randn(B, len(ROWS), H, requires_grad=True)]
    return head, final, lm_head, weights, hiddens


def _run(chunk, T_=T):
    head, final, lm_head, weights, hiddens = _setup()
    targets = DraftVocabTargets.of(head, final, lm_head, len(hiddens), chunk=chunk)
    out = draft_loss(hiddens, weights, targets, [1.0, 0.8, 0.64], rows=ROWS)
    out.loss.backward()
    grads = [h.grad for h in hiddens] + [p.grad for p in head.parameters() if p.grad is not None]
    return out, grads, targets


@pytest.mark.parametrize("chunk", [1, 4, 7, 1000])
def test_chunked_draft_vocab_loss_equals_unchunked(chunk):
    ref, ref_grads, ref_t = _run(0)
    out, grads, t = _run(chunk)
    assert t.probs is None and ref_t.probs is not None  # the chunked path ran (no [B, T, Vd] distribution kept)
    assert torch.equal(t.top, ref_t.top)
    assert out.step_hits == ref.step_hits and out.topk_correct == ref.topk_correct and out.step_counts == ref.step_counts
    # log_softmax over V (target) / Vd (head) terms, the soft CE over Vd, means over <= B*T rows: a few chained sums
    assert_same_function(out.loss, ref.loss, terms=V, chained=4)
    for a, e in zip(out.step_loss, ref.step_loss):
        assert_same_function(a, e, terms=V, chained=4, dtype=torch.float32)
    assert len(grads) == len(ref_grads)
    for g, e in zip(grads, ref_grads):
        assert_same_function(g, e, terms=V, chained=5)


def test_chunked_draft_vocab_dpace_confidence_equals_unchunked():
    from train.losses import DPace
    results = []
    for chunk in (0, 5):
        head, final, lm_head, weights, hiddens = _setup()
        targets = DraftVocabTargets.of(head, final, lm_head, len(hiddens), chunk=chunk)
        out = draft_loss(hiddens, weights, targets, [1.0, 1.0, 1.0], rows=ROWS, weighting=DPace())
        out.loss.backward()
        results.append((out.loss, hiddens[1].grad))
    assert_same_function(results[1][0], results[0][0], terms=V, chained=5)
    assert_same_function(results[1][1], results[0][1], terms=V, chained=6)


class _Largest(TorchDispatchMode):
    """The largest tensor (elements) any op outputs, forward and backward."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(o, torch.Tensor):
                self.largest = max(self.largest, o.numel())
        return out


def _largest(chunk):
    head, final, lm_head, weights, hiddens = _setup()
    with _Largest() as mode:
        targets = DraftVocabTargets.of(head, final, lm_head, len(hiddens), chunk=chunk)
        draft_loss(hiddens, weights, targets, [1.0, 0.8, 0.64], rows=ROWS).loss.backward()
    return mode.largest


def test_chunked_draft_vocab_loss_never_builds_a_T_by_V_tensor():
    chunk = 4
    assert _largest(0) >= B * T * V  # the unchunked path does: the test can fail
    largest = _largest(chunk)
    assert largest <= max(chunk * V, B * T * H * 3, V * H), largest  # one chunk's logits, never [T, V] / [rows, Vd]
    assert largest < B * T * VD


def test_peagle_and_eagle3_pass_train_loss_chunk():
    assert PeagleTraining.targets is Eagle3Training.targets
