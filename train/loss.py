"""The EAGLE training objective: w_feat * SmoothL1(predicted, true next feature) + w_tok * soft CE between the
target's next-token distribution and the head's, both through the target's frozen lm_head, averaged over
loss-masked positions; plus the input-feature noise augmentation."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from eagle.sampling import greedy_ids


def add_input_noise(features: torch.Tensor, kind: str, std: float) -> torch.Tensor:
    """Noise on the head's INPUT features only (targets stay clean).

    uniform: U(-std/2, +std/2) (the reference code's amplitude at sequence length 512; it also scales by
    512/T, which we do not); gaussian: N(0, std^2); none.
    """
    if kind == "none" or std == 0:
        return features
    if kind == "uniform":
        return features + (torch.rand_like(features) - 0.5) * std
    if kind == "gaussian":
        return features + torch.randn_like(features) * std
    raise ValueError(f"unknown noise kind {kind!r}")


def shift_for_head(hidden: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor):
    """Align a padded batch for the head: input (f_t, x_{t+1}) predicts f_{t+1}.

    Returns features [B, T-1, H], next_ids [B, T-1], head attention mask [B, T-1], targets [B, T-1, H] and the
    loss weights [B, T-1]: position t counts when token x_{t+1} is a loss token (and real). That includes the
    first draft step of every assistant turn (input = last prompt feature + first assistant token).
    """
    features = hidden[:, :-1]  # [B, T-1, H]
    next_ids = input_ids[:, 1:]  # [B, T-1]
    attn = attention_mask[:, :-1]  # [B, T-1]
    targets = hidden[:, 1:]  # [B, T-1, H]
    weights = loss_mask[:, 1:] * attention_mask[:, 1:]  # [B, T-1]
    return features, next_ids, attn, targets, weights


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar to backpropagate
    feature: torch.Tensor  # scalar, mean SmoothL1 over positions (detached)
    token: torch.Tensor  # scalar, mean soft CE over positions (detached)
    positions: int  # loss positions in the batch
    topk_correct: list[int]  # [top1, top2, top3]: positions where the target's argmax is in the head's top-k


def eagle_loss(pred: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor, lm_head: torch.Tensor,
               feature_weight: float, token_weight: float) -> LossOutput:
    """pred, targets [B, T, H]; weights [B, T] (0/1); lm_head [V, H] frozen. Loss math in float32."""
    sel = weights.bool()  # [B, T]
    n = int(sel.sum())
    if n == 0:  # nothing to learn here; keep the graph so every rank still runs its backward
        zero = pred.sum() * 0.0
        return LossOutput(zero, zero.detach(), zero.detach(), 0, [0, 0, 0])
    p = pred[sel]  # [N, H]
    f = targets[sel].to(p.dtype)  # [N, H]
    feature = F.smooth_l1_loss(p.float(), f.float(), reduction="none").mean(-1).mean()
    head_logits = F.linear(p.to(lm_head.dtype), lm_head).float()  # [N, V]
    with torch.no_grad():
        target_logits = F.linear(f.to(lm_head.dtype), lm_head).float()  # [N, V]
        target_p = target_logits.softmax(-1)
        target_top = greedy_ids(target_logits)  # [N]
    token = -(target_p * head_logits.log_softmax(-1)).sum(-1).mean()
    loss = feature_weight * feature + token_weight * token
    with torch.no_grad():
        top3 = head_logits.topk(min(3, head_logits.shape[-1]), dim=-1).indices  # [N, 3]
        hit = top3 == target_top[:, None]  # [N, 3]
        correct = [int(hit[:, :k].any(-1).sum()) for k in (1, 2, 3)]
    return LossOutput(loss, feature.detach(), token.detach(), n, correct)
