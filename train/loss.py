"""The training objectives.

EAGLE-2: w_feat * SmoothL1(predicted, true next feature) + w_tok * soft CE between the target's next-token
distribution and the head's, both through the target's frozen lm_head, averaged over loss-masked positions; plus
the input-feature noise augmentation.

EAGLE-3 (`eagle3_loss`): no feature loss. For each unrolled step j (training-time test) the soft CE between the
target's next-token distribution RESTRICTED to the draft vocabulary (renormalised there) and the head's own
lm_head over the draft vocabulary, averaged over that step's loss positions, weighted by the step weights and
summed over steps. Accuracy counts a hit only when the draft token (mapped to a target id) is the target's argmax
over the FULL vocabulary, so tokens outside the draft vocabulary count as misses."""
from __future__ import annotations

from dataclasses import dataclass, field

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
    step_hits: list[int] = field(default_factory=list)  # EAGLE-3: top-1 hits of each unrolled step j = 1..k
    step_counts: list[int] = field(default_factory=list)  # EAGLE-3: loss positions of each unrolled step
    step_loss: list[float] = field(default_factory=list)  # EAGLE-3: mean soft CE of each unrolled step


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


def shift_for_eagle3(features: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                     loss_mask: torch.Tensor, segments: int):
    """Align an EAGLE-3 batch: features [B, T, S*H] = (aux layers ; final state), S = segments.

    Returns aux [B, T-1, (S-1)*H], next_ids [B, T-1], head attention mask [B, T-1], final [B, T-1, H] and weights
    [B, T-1]: index t reads (aux_t, x_{t+1}); final[t] = the target's state at t + 1, whose lm_head gives the
    distribution of x_{t+2}, step 1's target; step j's target at index t is final[t + j - 1]. weights[t] =
    loss_mask[t+1] (real), as in `shift_for_head`.
    """
    H = features.shape[-1] // segments
    aux = features[:, :-1, : -H]  # [B, T-1, (S-1)*H]
    final = features[:, 1:, -H:]  # [B, T-1, H]
    return aux, input_ids[:, 1:], attention_mask[:, :-1], final, loss_mask[:, 1:] * attention_mask[:, 1:]


@torch.no_grad()
def eagle3_targets(final: torch.Tensor, lm_head: torch.Tensor, draft_ids: torch.Tensor):
    """final [B, T, H], lm_head [V, H], draft_ids [Vd] (target id of each draft id) -> (target probabilities over the
    draft vocabulary [B, T, Vd] float32 (renormalised), the target's argmax over the full vocabulary [B, T])."""
    logits = F.linear(final.to(lm_head.dtype), lm_head).float()  # [B, T, V]
    return logits[..., draft_ids].softmax(-1), greedy_ids(logits)


def eagle3_loss(head, hiddens: list[torch.Tensor], probs: torch.Tensor, top: torch.Tensor, weights: torch.Tensor,
                step_weights: list[float], rows: torch.Tensor | None = None) -> LossOutput:
    """Training-time-test loss of an unrolled EAGLE-3 head.

    hiddens: `head.unroll` output, step 1 [B, T, H], steps j >= 2 [B, R, H] at indices `rows` [R] (None = all T);
    probs [B, T, Vd], top [B, T], weights [B, T] from `eagle3_targets` / `shift_for_eagle3`. Step j at index t is
    scored against index t + j - 1 (masked when that runs off the sequence). Loss math in float32.
    """
    B, T = weights.shape
    k = len(hiddens)
    draft_ids = head.d2t.new_tensor(range(head.d2t.numel())) + head.d2t  # [Vd] target id of each draft id
    pad = k - 1
    probs_ext = F.pad(probs, (0, 0, 0, pad))  # [B, T + k - 1, Vd]
    top_ext = F.pad(top, (0, pad), value=-1)  # [B, T + k - 1]
    w_ext = F.pad(weights, (0, pad))  # [B, T + k - 1]
    idx_all = torch.arange(T, device=weights.device)  # [T]
    loss = hiddens[0].new_zeros((), dtype=torch.float32)
    step_loss, hits, counts, topk = [], [], [], [0, 0, 0]
    for j, h in enumerate(hiddens, start=1):
        idx = idx_all if j == 1 or rows is None else rows.to(weights.device)  # [R]
        sel = w_ext[:, idx + j - 1].bool()  # [B, R]
        n = int(sel.sum())
        if n == 0:
            loss = loss + h.sum() * 0.0  # keep the graph: every rank runs its backward
            step_loss.append(0.0)
            hits.append(0)
            counts.append(0)
            continue
        logits = head.draft_logits(h[sel]).float()  # [N, Vd]
        p = probs_ext[:, idx + j - 1][sel]  # [N, Vd]
        ce = -(p * logits.log_softmax(-1)).sum(-1).mean()
        loss = loss + step_weights[j - 1] * ce
        with torch.no_grad():
            want = top_ext[:, idx + j - 1][sel]  # [N] target argmax (full vocabulary)
            ranked = draft_ids[logits.topk(min(3, logits.shape[-1]), dim=-1).indices]  # [N, 3] target ids
            hit = ranked == want[:, None]  # [N, 3]
        step_loss.append(float(ce.detach()))
        hits.append(int(hit[:, 0].sum()))
        counts.append(n)
        if j == 1:
            topk = [int(hit[:, :m].any(-1).sum()) for m in (1, 2, 3)]
    zero = torch.zeros(())
    return LossOutput(loss, zero, torch.tensor(step_loss[0]), counts[0], topk, hits, counts, step_loss)
