"""The token and feature losses a recipe chooses from (`loss.token`, `loss.feature`; recipes/loss.py): one small
function each, the formula in its docstring. Every head kind scores its steps with them (train/head_kinds.py ->
train/loss.py: StepScore); the trainer never branches on the loss.

Token losses take the head's log-probabilities logq [n, V] (float32, with grad) and the target's probabilities
p [n, V] (float32, no grad) of n loss positions and return one value per position [n]; the step's loss is their mean.
With q = exp(logq), the expected acceptance of one drafted position sampled from q and verified against p is
alpha = sum_x min(p(x), q(x)) = 1 - TV(p, q) (speculative sampling's acceptance rule):
  ce   -sum p log q                          the soft cross-entropy (EAGLE's loss; what old recipes use)
  tv   1 - sum min(p, q)  = TV(p, q)          one minus the expected acceptance (linear in alpha)
  nla  -log sum min(p, q) = -log alpha        the negative log expected acceptance (SpecForge's LK "alpha")
  lk   w KL(p||q) + (1 - w) TV(p, q), w = exp(-eta sg[alpha])   SpecForge's LK "hybrid": KL while alpha is small,
       TV as it grows (sg = no gradient through the weight; eta = loss.lk_eta)
  rkl  sum q (log q - log p)                  the reverse KL (mode seeking)
  jsd  (KL(p||m) + KL(q||m)) / 2, m = (p + q) / 2   the Jensen-Shannon divergence
Feature losses (EAGLE-2's next-feature regression) take predicted and true features [n, H] -> [n]:
  smooth_l1 (EAGLE's), mse, l1, each averaged over H.
Position weighting across a chain's unrolled steps (`loss.position_weighting`; train/loss.py draft_loss applies it):
  fixed  step j weighs head.ttt_step_weights / head.align_step_weights[j] (default 0.8^(j-1); what old recipes use)
  dpace  D-PACE (arXiv:2605.18810; SpecForge, speculators, Model-Optimizer's DFlash default): step j of the chain
         drafted at one position weighs w_j = sum_{m>=j} prod_{i<=m} q~_i, q~_i = (1 - a) c_i + a, with c_i the head's
         probability of the target's most likely token at step i (of the p its token loss sees: EAGLE-3, over the draft
         vocabulary) and a = loss.dpace_alpha; no gradient through w
         (`dpace_weights`: the expected accepted length's credit for step j, a surrogate that follows the head's
         current confidence instead of a fixed decay).
         Deviations from the peers (all three weight DFlash's block positions): the chain is EAGLE's unrolled steps
         drafted at one position; c is q(argmax p) as speculators takes it (SpecForge / Model-Optimizer: q of the data
         token); any loss.token may be weighted (speculators requires ce; Model-Optimizer also weights its soft-CE KD
         loss); a step's weighted loss is averaged over that step's positions and summed over steps like the fixed
         weights (speculators: / all positions, Model-Optimizer: / sum of weights, SpecForge: / batch size: a scale
         only); with a row stride, step 1 where no later steps run takes the batch's mean continuation value
         (train/loss.py: dpace_row_weights).
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

from recipes.head import dpace
from recipes.loss import loss_section

# log(0) guard: a target probability of exactly 0 contributes 0 * log(0) = 0 to KL / JSD; log never sees 0
_TINY = torch.finfo(torch.float32).tiny


def expected_acceptance(logq: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """alpha [n] = sum_x min(p(x), q(x)): one drafted token's acceptance probability under speculative sampling."""
    return torch.minimum(p, logq.exp()).sum(-1)


def confidence(logq: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """c [n] = q(argmax p), no gradient: the head's probability of the target's most likely token, exp(-CE against
    argmax p) (D-PACE's per-position confidence, as speculators' `dpace_loss_decay` takes it from its `ce` loss)."""
    with torch.no_grad():
        return logq.gather(-1, p.argmax(-1, keepdim=True)).squeeze(-1).exp()


def dpace_weights(conf: torch.Tensor, mask: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """D-PACE's step weights [..., k] of chains of k steps, no gradient: w_j = sum_{m>=j} C_m, C_m = prod_{i<=m} q~_i,
    q~_i = (1 - alpha) conf_i + alpha (conf [..., k] in [0, 1]). A step with mask [..., k] False is a no-op in the
    products (q~ = 1), adds nothing to the sums and gets weight 0. Followed: speculators
    `src/speculators/losses/utils.py` dpace_loss_decay = SpecForge `specforge/algorithms/common/dflash_family_model.py`
    _dpace_weight (loss_type dpace) = Model-Optimizer `modelopt/torch/speculative/plugins/hf_dflash.py`
    _dpace_position_weights (the paper's Eq. 7-8, weights detached as its Eq. 9)."""
    with torch.no_grad():
        m = mask.to(torch.float32)
        smooth = torch.where(mask.bool(), (1.0 - alpha) * conf.float() + alpha, torch.ones_like(m))
        cum = torch.cumprod(smooth, dim=-1) * m  # C_m, 0 at masked steps
        return cum.flip(-1).cumsum(-1).flip(-1) * m  # suffix sums


POSITION_WEIGHTINGS = ("fixed", "dpace")


class DPace:
    """loss.position_weighting=dpace with a = loss.dpace_alpha: `weights(conf, mask)` = dpace_weights."""

    def __init__(self, alpha: float = 0.5):
        self.alpha = float(alpha)

    def smooth(self, conf: torch.Tensor) -> torch.Tensor:
        """q~ = (1 - a) conf + a."""
        return (1.0 - self.alpha) * conf.float() + self.alpha

    def weights(self, conf: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return dpace_weights(conf, mask, self.alpha)

    def __repr__(self) -> str:
        return f"DPace(alpha={self.alpha})"


def ce(logq: torch.Tensor, p: torch.Tensor, eta: float = 0.0) -> torch.Tensor:
    """-sum_x p(x) log q(x)."""
    return -(p * logq).sum(-1)


def tv(logq: torch.Tensor, p: torch.Tensor, eta: float = 0.0) -> torch.Tensor:
    """1 - sum_x min(p(x), q(x))."""
    return 1.0 - expected_acceptance(logq, p)


def nla(logq: torch.Tensor, p: torch.Tensor, eta: float = 0.0) -> torch.Tensor:
    """-log sum_x min(p(x), q(x)) (alpha floored at float32's smallest normal: a finite loss when q misses p)."""
    return -expected_acceptance(logq, p).clamp_min(_TINY).log()


def kl(logq: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """KL(p || q) = sum_x p(x) (log p(x) - log q(x)), terms with p(x) = 0 being 0."""
    return (p * (p.clamp_min(_TINY).log() - logq)).sum(-1)


def lk(logq: torch.Tensor, p: torch.Tensor, eta: float = 3.0) -> torch.Tensor:
    """w KL(p||q) + (1 - w) (1 - alpha), w = exp(-eta alpha) with alpha = sum min(p, q) taken without gradient."""
    alpha = expected_acceptance(logq, p)
    w = torch.exp(-eta * alpha.detach())
    return w * kl(logq, p) + (1.0 - w) * (1.0 - alpha)


def rkl(logq: torch.Tensor, p: torch.Tensor, eta: float = 0.0) -> torch.Tensor:
    """KL(q || p) = sum_x q(x) (log q(x) - log p(x)) (p floored at float32's smallest normal where it is 0)."""
    return (logq.exp() * (logq - p.clamp_min(_TINY).log())).sum(-1)


def jsd(logq: torch.Tensor, p: torch.Tensor, eta: float = 0.0) -> torch.Tensor:
    """(KL(p||m) + KL(q||m)) / 2 with m = (p + q) / 2."""
    q = logq.exp()
    logm = ((p + q) / 2).clamp_min(_TINY).log()
    return 0.5 * ((p * (p.clamp_min(_TINY).log() - logm)).sum(-1) + (q * (logq - logm)).sum(-1))


TOKEN_LOSSES: dict[str, Callable[..., torch.Tensor]] = {"ce": ce, "tv": tv, "nla": nla, "lk": lk, "rkl": rkl, "jsd": jsd}


def smooth_l1(pred: torch.Tensor, true: torch.Tensor) -> torch.Tensor:
    """Huber with beta 1, averaged over the feature width."""
    return F.smooth_l1_loss(pred, true, reduction="none").mean(-1)


def mse(pred: torch.Tensor, true: torch.Tensor) -> torch.Tensor:
    """(pred - true)^2 averaged over the feature width."""
    return (pred - true).square().mean(-1)


def l1(pred: torch.Tensor, true: torch.Tensor) -> torch.Tensor:
    """|pred - true| averaged over the feature width."""
    return (pred - true).abs().mean(-1)


FEATURE_LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "smooth_l1": smooth_l1, "mse": mse, "l1": l1}


class TokenLoss:
    """The recipe's token loss: `rows(logq, p)` [n] per position; `logit_grad` the gradient of their SUM with respect
    to the head's logits [n, V] (the chunked path's backward: train/loss.py ChunkedTokenLoss). ce keeps its exact
    closed form q - p; the others go through autograd on the chunk's logits."""

    def __init__(self, name: str = "ce", eta: float = 3.0):
        if name not in TOKEN_LOSSES:
            raise ValueError(f"loss.token={name!r}: expected one of {tuple(TOKEN_LOSSES)}")
        self.name, self.eta, self.fn = name, float(eta), TOKEN_LOSSES[name]

    def rows(self, logq: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        return self.fn(logq, p, self.eta)

    def logit_grad(self, logits: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the rows' losses [n] (detached), d sum / d logits [n, V], the rows' `confidence` [n]) for logits [n, V]
        float32 (row r's gradient is that of row r's loss alone)."""
        if self.name == "ce":
            logq = logits.log_softmax(-1)
            rows, conf = -(p * logq).sum(-1), confidence(logq, p)
            return rows, logq.exp_().sub_(p), conf
        with torch.enable_grad():
            x = logits.detach().requires_grad_(True)
            logq = x.log_softmax(-1)
            rows = self.rows(logq, p)
            (g,) = torch.autograd.grad(rows.sum(), x)
        return rows.detach(), g, confidence(logq.detach(), p)

    def __repr__(self) -> str:
        return f"TokenLoss({self.name!r}" + (f", eta={self.eta})" if self.name == "lk" else ")")


def token_loss(cfg) -> TokenLoss:
    """The recipe's token loss (cfg.loss; a recipe without the section: ce, EAGLE's soft cross-entropy)."""
    section = loss_section(cfg)
    return TokenLoss(section.token, section.lk_eta)


def position_weighting(cfg) -> DPace | None:
    """The recipe's weighting across unrolled steps: None = fixed (the step weights alone; a recipe without the key),
    or DPace(loss.dpace_alpha)."""
    section = loss_section(cfg)
    if dpace(section):
        return DPace(section.dpace_alpha)
    return None


def feature_loss(cfg) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The recipe's feature loss (a recipe without the section: smooth_l1, EAGLE's)."""
    return FEATURE_LOSSES[loss_section(cfg).feature]
