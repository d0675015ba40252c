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
from train.losses import FEATURE_LOSSES, TOKEN_LOSSES, TokenLoss, expected_acceptance

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
    value, g2 = loss.logit_grad(logits.clone(), p)
    assert_same_function(value, total.detach(), terms=12, chained=3)
    assert_same_function(g2, g, terms=12, chained=3)


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
    assert (cfg.loss.token, cfg.loss.feature) == ("ce", "smooth_l1")


@pytest.mark.parametrize("overrides,needle", [
    (["loss.token=kl"], "loss.token='kl': expected one of ('ce', 'tv', 'nla', 'lk', 'rkl', 'jsd')"),
    (["loss.feature=huber"], "loss.feature='huber': expected one of"),
    (["loss.lk_eta=2.0"], "loss.lk_eta=2.0: only used by loss.token=lk"),
    (["loss.token=lk", "loss.lk_eta=-1"], "loss.lk_eta=-1.0: expected a finite number >= 0"),
])
def test_bad_loss_keys_are_one_line_errors(overrides, needle):
    with pytest.raises(RecipeError) as e:
        load_config("tiny", overrides)
    assert needle in str(e.value) and "\n" not in str(e.value)


def test_feature_loss_on_a_kind_without_one_is_refused():
    with pytest.raises(RecipeError, match=r"^loss.feature='mse': head.kind=eagle3 has no feature loss"):
        load_config("tiny-eagle3", ["loss.feature=mse"])
    assert load_config("tiny-eagle3", ["loss.token=nla"]).loss.token == "nla"
