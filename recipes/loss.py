"""Recipe section `loss`: which token and feature losses train the head (train/losses.py holds their formulas).
The one home of these defaults. Their weights stay where they were: train.token_weight / train.feature_weight, and
per unrolled step head.ttt_step_weights (EAGLE-3) / head.align_step_weights (EAGLE-2 multi-step alignment)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from recipes.check import check

TOKEN_LOSSES = ("ce", "tv", "nla", "lk", "rkl", "jsd")  # train/losses.py: TOKEN_LOSSES (tests pin the two lists equal)
FEATURE_LOSSES = ("smooth_l1", "mse", "l1")


@dataclass
class LossSettings:
    token: str = "ce"  # ce (soft cross-entropy, EAGLE's) | tv (1 - expected acceptance) | nla (-log expected acceptance) | lk (SpecForge's LK hybrid of KL and TV) | rkl (reverse KL) | jsd
    feature: str = "smooth_l1"  # EAGLE-2's next-feature regression: smooth_l1 (EAGLE's) | mse | l1 (EAGLE-3 heads have no feature loss)
    lk_eta: float = 3.0  # loss.token=lk: KL weight exp(-lk_eta * expected acceptance) (SpecForge's default 3.0)


def validate_loss_section(loss, head_kind: str, feature_loss: bool) -> None:
    """Check the loss section; `feature_loss`: the head kind trains a next-feature loss (recipes/head.py)."""
    check(loss.token in TOKEN_LOSSES, "loss.token", loss.token, f"expected one of {TOKEN_LOSSES}")
    check(loss.feature in FEATURE_LOSSES, "loss.feature", loss.feature, f"expected one of {FEATURE_LOSSES}")
    check(feature_loss or loss.feature == LossSettings.feature, "loss.feature", loss.feature,
          f"head.kind={head_kind} has no feature loss; leave it at {LossSettings.feature!r}")
    check(math.isfinite(loss.lk_eta) and loss.lk_eta >= 0, "loss.lk_eta", loss.lk_eta, "expected a finite number >= 0")
    check(loss.token == "lk" or loss.lk_eta == LossSettings.lk_eta, "loss.lk_eta", loss.lk_eta,
          "only used by loss.token=lk")
