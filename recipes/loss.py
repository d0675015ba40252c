"""Recipe section `loss`: which token and feature losses train the head (train/losses.py holds their formulas).
The one home of these defaults. Their weights stay where they were: train.token_weight / train.feature_weight, and
per unrolled step head.ttt_step_weights (EAGLE-3) / head.align_step_weights (EAGLE-2 multi-step alignment), or
D-PACE's per-chain weights instead of those (`position_weighting: dpace`)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from recipes.check import check
from recipes.head import has_feature_loss, head_options

TOKEN_LOSSES = ("ce", "tv", "nla", "lk", "rkl", "jsd")  # train/losses.py: TOKEN_LOSSES (tests pin the two lists equal)
FEATURE_LOSSES = ("smooth_l1", "mse", "l1")
POSITION_WEIGHTINGS = ("fixed", "dpace")  # train/losses.py: POSITION_WEIGHTINGS


@dataclass
class LossSettings:
    token: str = "ce"  # ce (soft cross-entropy, EAGLE's) | tv (1 - expected acceptance) | nla (-log expected acceptance) | lk (SpecForge's LK hybrid of KL and TV) | rkl (reverse KL) | jsd
    feature: str = "smooth_l1"  # EAGLE-2's next-feature regression: smooth_l1 (EAGLE's) | mse | l1 (EAGLE-3 heads have no feature loss)
    lk_eta: float = 3.0  # loss.token=lk: KL weight exp(-lk_eta * expected acceptance) (SpecForge's default 3.0)
    position_weighting: str = "fixed"  # weights of the unrolled steps: fixed (head.ttt_step_weights / align_step_weights, 0.8^(j-1)) | dpace (D-PACE: step j of a chain weighs sum_{m>=j} prod_{i<=m} smoothed confidence, detached)
    dpace_alpha: float = 0.5  # position_weighting=dpace: confidence smoothing (1 - a) c + a, in (0, 1] (the peers' default 0.5)


def loss_section(cfg) -> LossSettings:
    """The recipe's `loss` section (a DictConfig, or an object with the attribute); for a config written before the
    section existed, LossSettings' defaults above (EAGLE's losses, fixed step weights)."""
    section = cfg.get("loss") if hasattr(cfg, "get") else getattr(cfg, "loss", None)
    return LossSettings() if section is None else section


def validate_loss_section(loss, head) -> None:
    """Check the loss section against the head section (recipes/head.py)."""
    head_kind, feature_loss = head.kind, has_feature_loss(head)
    check(loss.token in TOKEN_LOSSES, "loss.token", loss.token, f"expected one of {TOKEN_LOSSES}")
    check(loss.feature in FEATURE_LOSSES, "loss.feature", loss.feature, f"expected one of {FEATURE_LOSSES}")
    check(feature_loss or loss.feature == LossSettings.feature, "loss.feature", loss.feature,
          f"head.kind={head_kind} has no feature loss; leave it at {LossSettings.feature!r}")
    check(math.isfinite(loss.lk_eta) and loss.lk_eta >= 0, "loss.lk_eta", loss.lk_eta, "expected a finite number >= 0")
    check(loss.token == "lk" or loss.lk_eta == LossSettings.lk_eta, "loss.lk_eta", loss.lk_eta,
          "only used by loss.token=lk")
    check(loss.position_weighting in POSITION_WEIGHTINGS, "loss.position_weighting", loss.position_weighting,
          f"expected one of {POSITION_WEIGHTINGS}")
    check(math.isfinite(loss.dpace_alpha) and 0 < loss.dpace_alpha <= 1, "loss.dpace_alpha", loss.dpace_alpha,
          "expected a number in (0, 1]")
    check(loss.position_weighting == "dpace" or loss.dpace_alpha == LossSettings.dpace_alpha, "loss.dpace_alpha",
          loss.dpace_alpha, "only used by loss.position_weighting=dpace")
    if loss.position_weighting == "dpace":
        options = head_options(head)
        steps_key, weights_key, steps = options.steps_key, options.weights_key, options.steps
        setting = f" with head.{steps_key}={steps}" if steps_key else ""
        check(steps >= 2, "loss.position_weighting", loss.position_weighting,
              f"D-PACE weights the unrolled steps of a chain; head.kind={head_kind}{setting} trains one step"
              + (f" (set head.{steps_key} >= 2)" if steps_key else ""))
        check(not list(getattr(head, weights_key)), f"head.{weights_key}", list(getattr(head, weights_key)),
              "loss.position_weighting=dpace derives the step weights; leave it empty")
