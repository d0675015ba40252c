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
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

# log(0) guard: a target probability of exactly 0 contributes 0 * log(0) = 0 to KL / JSD; log never sees 0
_TINY = torch.finfo(torch.float32).tiny


def expected_acceptance(logq: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """alpha [n] = sum_x min(p(x), q(x)): one drafted token's acceptance probability under speculative sampling."""
    return torch.minimum(p, logq.exp()).sum(-1)


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

    def logit_grad(self, logits: torch.Tensor, p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of the rows' losses (detached), d sum / d logits [n, V]) for logits [n, V] float32."""
        if self.name == "ce":
            logq = logits.log_softmax(-1)
            return -(p * logq).sum(), logq.exp_().sub_(p)
        with torch.enable_grad():
            x = logits.detach().requires_grad_(True)
            total = self.rows(x.log_softmax(-1), p).sum()
            (g,) = torch.autograd.grad(total, x)
        return total.detach(), g

    def __repr__(self) -> str:
        return f"TokenLoss({self.name!r}" + (f", eta={self.eta})" if self.name == "lk" else ")")


def token_loss(cfg) -> TokenLoss:
    """The recipe's token loss (cfg.loss; a recipe without the section: ce, EAGLE's soft cross-entropy)."""
    section = cfg.get("loss") if hasattr(cfg, "get") else getattr(cfg, "loss", None)
    if section is None:
        return TokenLoss()
    return TokenLoss(section.token, section.lk_eta)


def feature_loss(cfg) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The recipe's feature loss (a recipe without the section: smooth_l1, EAGLE's)."""
    section = cfg.get("loss") if hasattr(cfg, "get") else getattr(cfg, "loss", None)
    return FEATURE_LOSSES[section.feature if section is not None else "smooth_l1"]
