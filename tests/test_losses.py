"""The loss library (train/losses.py): each loss equals its formula on a hand-computed case, its gradient step
raises the expected acceptance sum_x min(p, q), the chunked path equals the unchunked one for every loss, and the
recipe's `loss` section is checked with one-line errors."""
from __future__ import annotations

import math

import pytest
import torch

from float_tolerance import assert_same_function
from recipes import RecipeError, load_config
from recipes.loss import FEATURE_LOSSES as RECIPE_FEATURE_LOSSES
from recipes.loss import TOKEN_LOSSES as RECIPE_TOKEN_LOSSES
from train.head_kinds import NextFeatureTargets
from train.loss import draft_loss
from train.losses import (FEATURE_LOSSES, POSITION_WEIGHTINGS, TOKEN_LOSSES, DPace, TokenLoss, confidence,
                          dpace_weights, expected_acceptance)
from recipes.loss import POSITION_WEIGHTINGS as RECIPE_POSITION_WEIGHTINGS

# p (the target) and q (the head) over 3 tokens, and every loss worked out by hand from them:
# min(p, q) = (0.2, 0.3, 0.2), expected acceptance sum min(p, q) = 0.7.
P, Q = (0.5, 0.3, 0.2), (0.2, 0.5, 0.3)
ACCEPT = 0.7
KL_PQ = sum(p * math.log(p / q) for p, q in zip(P, Q))
M = tuple((p + q) / 2 for p, q in zip(P, Q))
HAND = {
    "ce": -sum(p * math.log(q) for p, q in zip(P, Q)),
    "tv": 1 - ACCEPT,  # = (|0.5-0.2| + |0.3-0.5| + |0.2-0.3|) / 2 = 0.3
    "nla": -math.log(ACCEPT),
    "lk": math.exp(-3.0 * ACCEPT) * KL_PQ + (1 - math.exp(-3.0 * ACCEPT)) * (1 - ACCEPT),
    "rkl": sum(q * math.log(q / p) for p, q in zip(P, Q)),
    "jsd": 0.5 * (sum(p * math.log(p / m) for p, m in zip(P, M)) + sum(q * math.log(q / m) for q, m in zip(Q, M))),
}


def test_the_recipe_lists_every_loss_of_the_library():
    assert RECIPE_TOKEN_LOSSES == tuple(TOKEN_LOSSES) and RECIPE_FEATURE_LOSSES == tuple(FEATURE_LOSSES)
    assert RECIPE_POSITION_WEIGHTINGS == POSITION_WEIGHTINGS
    assert set(HAND) == set(TOKEN_LOSSES)  # every token loss has a hand-computed case below


@pytest.mark.parametrize("name", sorted(HAND))
def test_each_token_loss_equals_its_formula_on_a_hand_computed_case(name):
    logq = torch.tensor([Q], dtype=torch.float64).log()
    p = torch.tensor([P], dtype=torch.float64)
    got = TokenLoss(name, eta=3.0).rows(logq, p)
    assert got.shape == (1,)
    assert_same_function(got, torch.tensor([HAND[name]], dtype=torch.float64), terms=6, chained=3)
    assert float(expected_acceptance(logq, p)) == pytest.approx(ACCEPT, abs=1e-15)


def test_feature_losses_equal_their_formulas():
    pred, true = torch.tensor([[0.0, 3.0]], dtype=torch.float64), torch.tensor([[0.5, 0.0]], dtype=torch.float64)
    # smooth_l1 (beta 1): 0.5 * 0.5^2 for |d| = 0.5 < 1, |d| - 0.5 for |d| = 3: mean (0.125 + 2.5) / 2
    assert float(FEATURE_LOSSES["smooth_l1"](pred, true)) == pytest.approx(1.3125, abs=1e-15)
    assert float(FEATURE_LOSSES["mse"](pred, true)) == pytest.approx((0.25 + 9) / 2, abs=1e-15)
    assert float(FEATURE_LOSSES["l1"](pred, true)) == pytest.approx((0.5 + 3) / 2, abs=1e-15)


def _peaked_targets(n=6, V=12, seed=0):
    """n target distributions peaked on different tokens, and head logits far from them (random, small)."""
    g = torch.Generator().manual_seed(seed)
    p = (torch.randn(n, V, generator=g, dtype=torch.float64) * 3).softmax(-1)
    logits = torch.randn(n, V, generator=g, dtype=torch.float64) * 0.1
    return p, logits


@pytest.mark.parametrize("name", sorted(HAND))
def test_a_gradient_step_of_each_loss_raises_the_expected_acceptance(name):
    """Descending the loss is ascending alpha: after one small step every position's acceptance rises and the loss
    falls. At q = p the smooth losses' gradient vanishes (their minimum); tv / nla / lk have a kink there
    (min(p, q) is not differentiable at p = q), so only their step is checked."""
    loss = TokenLoss(name)
    p, logits = _peaked_targets()
    x = logits.clone().requires_grad_(True)
    before = loss.rows(x.log_softmax(-1), p)
    (g,) = torch.autograd.grad(before.sum(), x)
    stepped = logits - 0.05 * g
    with torch.no_grad():
        a0, a1 = expected_acceptance(logits.log_softmax(-1), p), expected_acceptance(stepped.log_softmax(-1), p)
        assert (a1 > a0).all(), (name, a0, a1)
        assert (loss.rows(stepped.log_softmax(-1), p) < before).all()
    if name not in ("ce", "rkl", "jsd"):
        return
    at_p = p.log().clone().requires_grad_(True)
    (g0,) = torch.autograd.grad(loss.rows(at_p.log_softmax(-1), p).sum(), at_p)
    assert g0.abs().max() < 1e-12, (name, g0.abs().max())


@pytest.mark.parametrize("name", sorted(HAND))
def test_logit_grad_of_the_chunked_path_is_the_autograd_gradient(name):
    loss = TokenLoss(name)
    p, logits = _peaked_targets(seed=1)
    x = logits.clone().requires_grad_(True)
    total = loss.rows(x.log_softmax(-1), p).sum()
    (g,) = torch.autograd.grad(total, x)
    value, g2, conf = loss.logit_grad(logits.clone(), p)
    assert value.shape == (logits.shape[0],)
    assert_same_function(value.sum(), total.detach(), terms=12, chained=3)
    assert_same_function(g2, g, terms=12, chained=3)
    assert torch.equal(conf, confidence(logits.log_softmax(-1), p))


@pytest.mark.numeric
@pytest.mark.parametrize("name", ["tv", "nla", "lk", "jsd"])
def test_chunked_token_loss_equals_unchunked_for_every_loss(name):
    """EAGLE-2's chunked token loss (train.loss_chunk) with a non-default loss: same value and gradient."""
    g = torch.Generator().manual_seed(2)
    pred = torch.randn(2, 21, 16, generator=g).requires_grad_(True)
    final = torch.randn(2, 21, 16, generator=g)
    weights = (torch.rand(2, 21, generator=g) > 0.3).long()
    lm_head = torch.randn(300, 16, generator=g) * 0.5
    outs = []
    for chunk in (0, 5):
        out = draft_loss([pred], weights, NextFeatureTargets(final, lm_head, chunk, token_loss=TokenLoss(name)), [1.0],
                         0.0)
        outs.append((out, torch.autograd.grad(out.loss * 3.0, pred)[0]))
    (ref, g_ref), (got, g_got) = outs
    assert got.positions > 5  # really chunked
    assert_same_function(got.loss, ref.loss, terms=300, chained=4)
    assert_same_function(g_got, g_ref, terms=300, chained=4)
    assert got.topk_correct == ref.topk_correct and g_got.abs().sum() > 0


def test_old_recipes_resolve_to_the_soft_ce_and_smooth_l1():
    cfg = load_config("tiny", [])
    assert (cfg.loss.token, cfg.loss.feature, cfg.loss.position_weighting) == ("ce", "smooth_l1", "fixed")


@pytest.mark.parametrize("overrides,needle", [
    (["loss.token=kl"], "loss.token='kl': expected one of ('ce', 'tv', 'nla', 'lk', 'rkl', 'jsd')"),
    (["loss.feature=huber"], "loss.feature='huber': expected one of"),
    (["loss.lk_eta=2.0"], "loss.lk_eta=2.0: only used by loss.token=lk"),
    (["loss.token=lk", "loss.lk_eta=-1"], "loss.lk_eta=-1.0: expected a finite number >= 0"),
    (["loss.position_weighting=chain"], "loss.position_weighting='chain': expected one of ('fixed', 'dpace')"),
    (["loss.dpace_alpha=0.3"], "loss.dpace_alpha=0.3: only used by loss.position_weighting=dpace"),
    (["loss.position_weighting=dpace", "head.align_steps=3", "loss.dpace_alpha=0"],
     "loss.dpace_alpha=0.0: expected a number in (0, 1]"),
    (["loss.position_weighting=dpace"], "loss.position_weighting='dpace': D-PACE weights the unrolled steps of a "
                                        "chain; head.kind=eagle2 with head.align_steps=1 trains one step"),
    (["loss.position_weighting=dpace", "head.align_steps=2", "head.align_step_weights=[1,0.5]"],
     "head.align_step_weights=[1.0, 0.5]: loss.position_weighting=dpace derives the step weights; leave it empty"),
])
def test_bad_loss_keys_are_one_line_errors(overrides, needle):
    with pytest.raises(RecipeError) as e:
        load_config("tiny", overrides)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_feature_loss_on_a_kind_without_one_is_refused():
    with pytest.raises(RecipeError, match=r"^loss.feature='mse': head.kind=eagle3 has no feature loss"):
        load_config("tiny-eagle3", ["loss.feature=mse"])
    assert load_config("tiny-eagle3", ["loss.token=nla"]).loss.token == "nla"


# ----------------------------------------------------------------------------- D-PACE (loss.position_weighting=dpace)
def test_dpace_weights_equal_their_formula_on_a_hand_computed_case():
    """Confidences (0.8, 0.5, 0.2) of one chain's 3 steps, a = 0.5: q~ = 0.5 c + 0.5 = (0.9, 0.75, 0.6);
    C = cumulative products (0.9, 0.675, 0.405); w_j = sum_{m>=j} C_m = (1.98, 1.08, 0.405).
    The same chain with step 2 masked: q~ = (0.9, 1, 0.6) -> C = (0.9, -, 0.54) -> w = (1.44, 0, 0.54).
    Model-Optimizer's own hand case (its tests' conf (0.8, 0.5), a = 0.5 -> w = (1.575, 0.675)) holds too."""
    conf = torch.tensor([[0.8, 0.5, 0.2], [0.8, 0.5, 0.2]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True], [True, False, True]])
    w = dpace_weights(conf, mask, 0.5)
    assert torch.allclose(w, torch.tensor([[1.98, 1.08, 0.405], [1.44, 0.0, 0.54]], dtype=torch.float32), atol=1e-6)
    assert torch.allclose(dpace_weights(torch.tensor([[0.8, 0.5]]), torch.ones(1, 2, dtype=torch.bool), 0.5),
                          torch.tensor([[1.575, 0.675]]), atol=1e-6)
    # a = 1 flattens to the fixed-length credit (k - j + 1); the confidence is q(argmax p) = exp(-CE to argmax p)
    assert dpace_weights(conf[:1], mask[:1], 1.0)[0].tolist() == pytest.approx([3.0, 2.0, 1.0])
    logq, p = torch.tensor([Q]).log(), torch.tensor([P])
    assert float(confidence(logq, p)) == pytest.approx(0.2)  # argmax p = token 0, q(0) = 0.2


def test_dpace_weights_carry_no_gradient():
    """The paper's Eq. 9 (and all three peers): the weights are detached, only the weighted losses train."""
    conf = torch.tensor([[0.3, 0.6, 0.9]], requires_grad=True)
    assert not dpace_weights(conf, torch.ones(1, 3, dtype=torch.bool)).requires_grad
    logq = torch.tensor([Q]).log().requires_grad_(True)
    assert not confidence(logq, torch.tensor([P])).requires_grad


class _ChainTargets:
    """StepTargets for a tiny chain: step j at index t is scored (soft CE over V tokens) against probs[:, t + j - 1]."""

    def __init__(self, probs):
        self.probs_ext = torch.nn.functional.pad(probs, (0, 0, 0, 4))

    def score(self, h, j, rows, sel):
        from train.loss import StepScore
        logq = h.log_softmax(-1)
        p = self.probs_ext[:, rows + j - 1][sel]
        return StepScore(TokenLoss("ce").rows(logq, p), [0, 0, 0], confidence=confidence(logq, p))


def _chain(T=5, k=3, V=4, seed=0, rows=None):
    g = torch.Generator().manual_seed(seed)
    probs = (torch.randn(1, T, V, generator=g) * 2).softmax(-1)
    R = T if rows is None else len(rows)
    logits = [torch.randn(1, T if j == 0 else R, V, generator=g).requires_grad_(True) for j in range(k)]
    return probs, logits


def test_draft_loss_with_dpace_weights_each_row_by_its_chains_formula():
    """draft_loss under D-PACE = sum_j mean over step j's rows of w_{t,j} CE_{t,j}, with w from each chain's own
    confidences (index t's steps 1..k; steps running off the 4 loss positions are masked no-ops)."""
    probs, logits = _chain()
    weights = torch.tensor([[1, 1, 1, 1, 0]])
    out = draft_loss(logits, weights, _ChainTargets(probs), [1.0] * 3, weighting=DPace(0.5))
    T, k = 5, 3
    want = 0.0
    for j in range(k):
        terms = []
        for t in range(T):
            if t + j >= T or not weights[0, t + j]:
                continue
            confs, mask = [], []
            for i in range(k):
                ok = t + i < T and bool(weights[0, t + i])
                lq = logits[i][0, t].log_softmax(-1)
                confs.append(float(lq[probs[0, t + i].argmax()].exp().detach()) if ok else 0.0)
                mask.append(ok)
            w = 0.0
            for m in range(j, k):  # w_j = sum_{m >= j} prod_{i <= m} q~_i over valid steps
                if mask[m]:
                    w += math.prod(0.5 * confs[i] + 0.5 for i in range(m + 1) if mask[i])
            ce_tj = -float((probs[0, t + j] * logits[j][0, t].log_softmax(-1)).sum().detach())
            terms.append(w * ce_tj)
        want += sum(terms) / len(terms)
    assert float(out.loss.detach()) == pytest.approx(want, rel=1e-5)
    fixed = draft_loss(logits, weights, _ChainTargets(probs), [1.0] * 3)
    assert out.step_loss == fixed.step_loss  # the reported losses stay the unweighted means


def test_dpace_with_a_row_stride_gives_the_other_step_1_rows_the_mean_continuation_value():
    """Steps >= 2 at indices (0, 2) only: chains 0 and 2 are complete; step 1 at 1, 3 weighs q~_1 x the mean of
    w_1 / q~_1 over chains 0 and 2."""
    from train.loss import dpace_row_weights
    rows = torch.tensor([0, 2])
    probs, logits = _chain(T=4, rows=rows)
    weights = torch.ones(1, 4, dtype=torch.long)
    targets, d = _ChainTargets(probs), DPace(0.5)
    w_ext = torch.nn.functional.pad(weights, (0, 2))
    sels = [w_ext[:, torch.arange(4)].bool()] + [w_ext[:, rows + j].bool() for j in (1, 2)]
    scores = [targets.score(h[s], j, torch.arange(4) if j == 1 else rows, s)
              for j, (h, s) in enumerate(zip(logits, sels), start=1)]
    w = dpace_row_weights(d, sels, scores, rows)
    c1, c2 = scores[0].confidence, scores[1].confidence
    c3 = torch.cat([scores[2].confidence, torch.zeros(1)])  # chain 2's step 3 would score index 4: off the end, masked
    chain = [d.weights(torch.stack([c1[t], c2[i], c3[i]])[None], torch.tensor([[True, True, t == 0]]))[0]
             for i, t in enumerate((0, 2))]
    assert torch.allclose(w[1], torch.stack([chain[0][1], chain[1][1]]))
    value = sum(float(c[0] / d.smooth(c1[t])) for c, t in zip(chain, (0, 2))) / 2
    assert w[0].tolist() == pytest.approx([float(chain[0][0]), float(d.smooth(c1[1])) * value, float(chain[1][0]),
                                           float(d.smooth(c1[3])) * value], rel=1e-6)


def test_a_dpace_step_moves_the_most_weighted_position_most():
    """The gradient through D-PACE's detached weights: step 1 (weighted by the whole chain's credit) gains more
    confidence than the last step (weighted by its own cumulative product only) for an equal start, and every
    step's confidence rises."""
    V, k = 6, 4
    probs = torch.full((1, k, V), 0.02).index_fill_(2, torch.tensor([0]), 0.9)  # every step wants token 0
    start = torch.zeros(V)
    logits = [start.clone()[None, None].expand(1, k, V).clone().requires_grad_(True) for _ in range(k)]
    weights = torch.tensor([[1, 1, 1, 1]])
    out = draft_loss(logits, weights, _ChainTargets(probs), [1.0] * k, weighting=DPace(0.5))
    grads = torch.autograd.grad(out.loss, logits)
    # chain at index 0 holds all k steps: its step j's logits at row 0
    gains = [float((start - 0.5 * g[0, 0]).softmax(-1)[0] - start.softmax(-1)[0]) for g in grads]
    assert all(x > 0 for x in gains) and gains == sorted(gains, reverse=True) and gains[0] > 2 * gains[-1]


@pytest.mark.numeric
@pytest.mark.parametrize("name", ["ce", "tv"])
def test_chunked_dpace_equals_unchunked(name):
    """EAGLE-2 multi-step alignment under D-PACE: the chunked path's per-row losses, confidences and gradients
    (train.loss_chunk) give the unchunked value and gradient."""
    g = torch.Generator().manual_seed(3)
    preds = [torch.randn(2, 13, 16, generator=g).requires_grad_(True) for _ in range(3)]
    final = torch.randn(2, 13, 16, generator=g)
    weights = (torch.rand(2, 13, generator=g) > 0.3).long()
    lm_head = torch.randn(200, 16, generator=g) * 0.5
    outs = []
    for chunk in (0, 4):
        targets = NextFeatureTargets(final, lm_head, chunk, steps=3, token_loss=TokenLoss(name))
        out = draft_loss(preds, weights, targets, [1.0] * 3, [0.5] * 3, weighting=DPace(0.5))
        outs.append((out, torch.autograd.grad(out.loss * 3.0, preds)))
    (ref, g_ref), (got, g_got) = outs
    assert_same_function(got.loss, ref.loss, terms=200, chained=4)
    for a, b in zip(g_got, g_ref):
        assert_same_function(a, b, terms=200, chained=4)
