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
               feature_weight: float, token_weight: float, chunk: int = 0) -> LossOutput:
    """pred, targets [B, T, H]; weights [B, T] (0/1); lm_head [V, H] frozen. Loss math in float32.

    chunk > 0: the token loss runs over `chunk` loss positions at a time (`ChunkedSoftCE`), so only
    [chunk, V] logits exist at once instead of [N, V] (several fp32 copies of 2048 x 128,256 per sequence at
    Llama-3 shape); the value and the gradient equal the unchunked ones up to float summation order.
    """
    sel = weights.bool()  # [B, T]
    n = int(sel.sum())
    if n == 0:  # nothing to learn here; keep the graph so every rank still runs its backward
        zero = pred.sum() * 0.0
        return LossOutput(zero, zero.detach(), zero.detach(), 0, [0, 0, 0])
    p = pred[sel]  # [N, H]
    f = targets[sel].to(p.dtype)  # [N, H]
    feature = F.smooth_l1_loss(p.float(), f.float(), reduction="none").mean(-1).mean()
    if chunk and chunk < n:
        correct = torch.zeros(3, dtype=torch.long)
        token = ChunkedSoftCE.apply(p, f, lm_head, chunk, correct)
        loss = feature_weight * feature + token_weight * token
        return LossOutput(loss, feature.detach(), token.detach(), n, [int(c) for c in correct])
    head_logits = F.linear(p.to(lm_head.dtype), lm_head).float()  # [N, V]
    with torch.no_grad():
        target_logits = F.linear(f.to(lm_head.dtype), lm_head).float()  # [N, V]
        target_p = target_logits.softmax(-1)
        target_top = greedy_ids(target_logits)  # [N]
    token = -(target_p * head_logits.log_softmax(-1)).sum(-1).mean()
    loss = feature_weight * feature + token_weight * token
    with torch.no_grad():
        correct = _topk_hits(head_logits, target_top)
    return LossOutput(loss, feature.detach(), token.detach(), n, [int(c) for c in correct])


def _topk_hits(head_logits: torch.Tensor, target_top: torch.Tensor) -> torch.Tensor:
    """[3] long: rows of head_logits [n, V] whose top-1 / top-2 / top-3 hold target_top [n]."""
    top3 = head_logits.topk(min(3, head_logits.shape[-1]), dim=-1).indices  # [n, <=3]
    hit = top3 == target_top[:, None]  # [n, <=3]
    return torch.stack([hit[:, :k].any(-1).sum() for k in (1, 2, 3)]).cpu()


class ChunkedSoftCE(torch.autograd.Function):
    """mean over rows of -sum_v softmax(f W^T)_v * log_softmax(p W^T)_v, `chunk` rows at a time.

    The forward also computes N * d loss / d p = (softmax(p W^T) - softmax(f W^T)) W per chunk (the soft CE
    gradient, since the target distribution sums to 1) and keeps only that [N, H] float32 tensor for the
    backward: no [N, V] tensor is ever held, and the logits are not recomputed. Dtypes follow the unchunked
    path: logits from a matmul in lm_head's dtype, softmax math in float32, the gradient's matmul in lm_head's
    dtype on values in [-1, 1] (the 1/N and the loss scale are applied in float32 afterwards, so fp16 does not
    underflow).
    `correct` [3] (long, CPU) receives the top-1/2/3 hit counts.
    """

    @staticmethod
    def forward(ctx, p, f, lm_head, chunk: int, correct):  # p, f [N, H]; lm_head [V, H]
        n = p.shape[0]
        total = torch.zeros((), dtype=torch.float32, device=p.device)
        grad = torch.empty(p.shape, dtype=torch.promote_types(lm_head.dtype, torch.float32), device=p.device)  # [N, H], N x the gradient
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            head_logits = F.linear(p[s:e].to(lm_head.dtype), lm_head).float()  # [c, V]
            target_logits = F.linear(f[s:e].to(lm_head.dtype), lm_head).float()  # [c, V]
            target_p = target_logits.softmax(-1)
            logp = head_logits.log_softmax(-1)
            total += -(target_p * logp).sum()
            correct += _topk_hits(head_logits, greedy_ids(target_logits))
            del head_logits, target_logits
            d_logits = logp.exp_().sub_(target_p)  # [c, V] = N x d mean / d head_logits
            grad[s:e] = d_logits.to(lm_head.dtype) @ lm_head  # [c, H]
        ctx.save_for_backward(grad)
        ctx.p_dtype, ctx.n = p.dtype, n
        return total / n

    @staticmethod
    def backward(ctx, grad_out):
        (grad,) = ctx.saved_tensors
        return (grad * (grad_out.to(grad.dtype) / ctx.n)).to(ctx.p_dtype), None, None, None, None
