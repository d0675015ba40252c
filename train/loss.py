"""The training objective of every head kind: one loss over the unrolled draft steps (`draft_loss`).

For each unrolled step j the token loss (recipe `loss.token`, train/losses.py; default the soft CE) between the
target's next-token distribution and the head's, averaged over that step's loss positions, weighted by w_j and summed
over steps; for kinds whose head predicts the target's next feature, plus w_feat * the feature loss (`loss.feature`,
default SmoothL1) between predicted and true next feature. What each step is scored against comes from the head
kind (train/head_kinds.py):
  EAGLE-2: one step (w_1 = train.token_weight) with the feature loss; both distributions through the target's frozen
           lm_head over the full vocabulary (`ChunkedTokenLoss` with train.loss_chunk); with head.align_steps = k > 1
           (HASS-style alignment) k unrolled steps, step j's token and feature losses both weighted by
           head.align_step_weights[j];
  EAGLE-3: k unrolled steps (the training-time test, w_j = head.ttt_step_weights); the head's own lm_head over its
           draft vocabulary against the target's distribution restricted to it (renormalised); no feature loss.
With loss.position_weighting=dpace (train/losses.py: D-PACE) each row's step-j token (and feature) loss is further
weighted by its chain's D-PACE weight (`dpace_row_weights`; the step weights are then 1 x train.token_weight /
feature_weight): step j at index t belongs to the chain drafted at t, whose steps' confidences give the weights.
Accuracy counts a hit only when the draft token (as a target id) is the target's argmax over the FULL vocabulary.
Plus the input-feature noise augmentation. Loss math in float32."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.distributed as dist
import torch.nn.functional as F

from eagle.sampling import greedy_ids
from train.losses import DPace


def add_input_noise(features: torch.Tensor, kind: str, std: float, generator: torch.Generator | None = None) -> torch.Tensor:
    """Noise on the head's INPUT features only (targets stay clean), drawn from `generator` (None: the global RNG).

    uniform: U(-std/2, +std/2) (the reference code's amplitude at sequence length 512; it also scales by
    512/T, which we do not); gaussian: N(0, std^2); none.
    """
    if kind == "none" or std == 0:
        return features
    if kind == "uniform":
        return features + (torch.rand(features.shape, generator=generator, dtype=features.dtype,
                                      device=features.device) - 0.5) * std
    if kind == "gaussian":
        return features + torch.randn(features.shape, generator=generator, dtype=features.dtype,
                                      device=features.device) * std
    raise ValueError(f"unknown noise kind {kind!r}")


@dataclass
class Shifted:
    """A padded batch aligned for the head: index t reads (the head's input states at t, token x_{t+1})."""

    inputs: torch.Tensor  # [B, T-1, W'] what the head reads (its kind's part of the cached states)
    next_ids: torch.Tensor  # [B, T-1] the token that follows position t
    attention_mask: torch.Tensor  # [B, T-1]
    final: torch.Tensor  # [B, T-1, H] the target's final state at t + 1 (lm_head of it: the distribution of x_{t+2})
    weights: torch.Tensor  # [B, T-1] loss_mask[t + 1] of real tokens: step 1 at t is scored


def shift(inputs: torch.Tensor, final: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor,
          loss_mask: torch.Tensor) -> Shifted:
    """inputs [B, T, W'] (what the head reads of the cached states), final [B, T, H] (the target's final states) ->
    a `Shifted` batch. Position t counts when token x_{t+1} is a loss token (and real): that includes the first
    draft step of every assistant turn (input = the last prompt state + the first assistant token). Step j's target
    at index t is final[t + j - 1]."""
    return Shifted(inputs[:, :-1], input_ids[:, 1:], attention_mask[:, :-1], final[:, 1:],
                   loss_mask[:, 1:] * attention_mask[:, 1:])


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar to backpropagate
    feature: torch.Tensor  # scalar, mean feature loss over positions (detached; 0 for kinds without a feature loss)
    token: torch.Tensor  # scalar, step 1's mean token loss over positions (detached)
    positions: int  # step 1's loss positions in the batch
    topk_correct: list[int]  # [top1, top2, top3]: step 1's positions where the target's argmax is in the head's top-k
    step_hits: list[int] = field(default_factory=list)  # top-1 hits of each unrolled step j = 1..k
    step_counts: list[int] = field(default_factory=list)  # loss positions of each unrolled step
    step_loss: list[float] = field(default_factory=list)  # mean token loss of each unrolled step


@dataclass
class StepScore:
    token_rows: torch.Tensor  # [N]: the step's token loss at each of its loss positions
    topk_correct: list[int]  # [top1, top2, top3] hits
    feature_rows: torch.Tensor | None = None  # [N]: feature loss to the true next feature, for kinds that predict it
    confidence: torch.Tensor | None = None  # [N] no grad: the head's probability of the target's top token (D-PACE)

    @property
    def token(self) -> torch.Tensor:
        """scalar: the step's mean token loss over its loss positions"""
        return self.token_rows.mean()

    @property
    def feature(self) -> torch.Tensor | None:
        return None if self.feature_rows is None else self.feature_rows.mean()


class StepTargets(Protocol):
    """What a head kind's unrolled steps are scored against (train/head_kinds.py)."""

    def score(self, hidden: torch.Tensor, j: int, rows: torch.Tensor, sel: torch.Tensor) -> StepScore:
        """hidden [N, H]: step j's outputs at its loss positions sel [B, R] (over the indices `rows` [R])."""


def draft_loss(hiddens: list[torch.Tensor], weights: torch.Tensor, targets: StepTargets, step_weights: list[float],
               feature_weight: float | list[float] = 0.0, rows: torch.Tensor | None = None,
               weighting: DPace | None = None, shards=None) -> LossOutput:
    """THE training loss (module docstring). hiddens: the head's unrolled outputs, step 1 [B, T, H], steps j >= 2
    [B, R, H] at the indices `rows` [R] (None = all T); weights [B, T] (0/1) from `shift`, or [B, T + k - 1] with the
    k - 1 positions after the record's span (sequence parallelism: the next rank's). Step j at index t is
    scored at t + j - 1 (masked when that runs off the sequence or is no loss position). feature_weight: one weight,
    or one per step (EAGLE-2 with multi-step alignment); the reported feature loss is step 1's. weighting: None =
    fixed (step_weights alone), or D-PACE's per-chain weights on top of them (`dpace_row_weights`). The reported
    token / step losses are the unweighted means. shards (train/sequence_parallel.py; None = the whole record here):
    this rank holds a span of the record; each step's mean runs over the record's loss positions (the group's count),
    the returned loss is the group's sum of shares (every rank the record's loss) and the counts, hits and reported
    means are the group's."""
    T = hiddens[0].shape[1]
    k = len(hiddens)
    w_ext = F.pad(weights, (0, T + k - 1 - weights.shape[1]))  # [B, T + k - 1]
    idx_all = torch.arange(T, device=weights.device)  # [T]
    sels, scores = [], []
    for j, h in enumerate(hiddens, start=1):
        idx = idx_all if j == 1 or rows is None else rows.to(weights.device)  # [R]
        sel = w_ext[:, idx + j - 1].bool()  # [B, R]
        sels.append(sel)
        scores.append(targets.score(h[sel], j, idx, sel) if sel.any() else None)
    row_w = [None] * k
    if weighting is not None and k > 1:
        row_w = dpace_row_weights(weighting, sels, scores, None if rows is None else rows.to(weights.device))
    counts = [int(sel.sum()) for sel in sels]
    hits = [0 if sc is None else sc.topk_correct[0] for sc in scores]
    topk = [0, 0, 0] if scores[0] is None else list(scores[0].topk_correct)
    if shards is not None:  # the record's counts and hits: every span's
        summed = shards.counts(counts + hits + topk)
        counts, hits, topk = summed[:k], summed[k:2 * k], summed[2 * k:]

    def mean(rows_: torch.Tensor, w: torch.Tensor | None, j: int) -> torch.Tensor:
        """Step j's mean of rows_ [N] (times the D-PACE row weights w) over the record's loss positions."""
        x = rows_ if w is None else w * rows_
        return x.mean() if shards is None else x.sum() / counts[j - 1]

    loss = hiddens[0].new_zeros((), dtype=torch.float32)
    reported = torch.zeros(k + 2, device=weights.device)  # step token means, then step 1's feature and token mean (detached)
    for j, (h, score, rw) in enumerate(zip(hiddens, scores, row_w), start=1):
        if score is None:
            loss = loss + h.sum() * 0.0  # keep the graph: every rank runs its backward
            continue
        loss = loss + step_weights[j - 1] * mean(score.token_rows, rw, j)
        reported[j - 1] = float(mean(score.token_rows.detach(), None, j))
        if score.feature_rows is not None:
            weight = feature_weight[j - 1] if isinstance(feature_weight, list) else feature_weight
            loss = loss + weight * mean(score.feature_rows, rw, j)
            if j == 1:
                reported[k] = float(mean(score.feature_rows.detach(), None, 1))
    reported[k + 1] = reported[0]
    if shards is not None:  # every rank backpropagates the record's loss; the reported means are the record's
        loss = shards.total(loss)
        dist_sum(reported, shards.group)
    step_loss = [float(x) if n else 0.0 for x, n in zip(reported[:k].tolist(), counts)]
    return LossOutput(loss, reported[k].clone(), reported[k + 1].clone(), counts[0], topk, hits, counts, step_loss)


def dpace_row_weights(weighting: DPace, sels: list[torch.Tensor], scores: list, rows: torch.Tensor | None
                      ) -> list[torch.Tensor | None]:
    """D-PACE's weight [N_j] of each scored row of each step j (train/losses.py: dpace_weights): the chain drafted at
    index t is (step 1 at t, step 2 at t, ...), a masked step a no-op in it. With `rows` (steps >= 2 only at those
    indices) the chains at `rows` are complete; step 1 at the other indices has no later steps to read, so it takes
    w_1 = q~_1 x the mean continuation value w_1 / q~_1 of the complete chains of the batch (1 when there are none)."""
    dense = []
    for sel, score in zip(sels, scores):
        d = torch.zeros(sel.shape, dtype=torch.float32, device=sel.device)
        if score is not None:
            d[sel] = score.confidence.float()
        dense.append(d)
    first, first_mask = (dense[0], sels[0]) if rows is None else (dense[0][:, rows], sels[0][:, rows])
    conf = torch.stack([first] + dense[1:], dim=-1)  # [B, R, k]
    mask = torch.stack([first_mask] + sels[1:], dim=-1)  # [B, R, k]
    w = weighting.weights(conf, mask)  # [B, R, k]
    out = [w[..., j][sels[j]] for j in range(1, len(sels))]
    if rows is None:
        return [w[..., 0][sels[0]]] + out
    with torch.no_grad():
        complete = mask[..., 0]
        value = (w[..., 0] / weighting.smooth(conf[..., 0]))[complete]  # continuation values of the complete chains
        w1 = weighting.smooth(dense[0]) * (value.mean() if value.numel() else 1.0)  # [B, T]
        w1[:, rows] = w[..., 0]
    return [w1[sels[0]]] + out


def topk_hits(head_logits: torch.Tensor, target_top: torch.Tensor) -> torch.Tensor:
    """[3] long: rows of head_logits [n, V] whose top-1 / top-2 / top-3 hold target_top [n]."""
    top3 = head_logits.topk(min(3, head_logits.shape[-1]), dim=-1).indices  # [n, <=3]
    hit = top3 == target_top[:, None]  # [n, <=3]
    return torch.stack([hit[:, :k].any(-1).sum() for k in (1, 2, 3)]).cpu()


def dist_sum(t: torch.Tensor, group) -> None:
    """t summed in place over `group`'s ranks."""
    dist.all_reduce(t, group=group)


class ChunkedTokenLoss(torch.autograd.Function):
    """The rows' token losses [N] (the recipe's, train/losses.py: TokenLoss) between softmax(f W^T) (the target) and
    softmax(p W^T) (the head), `chunk` rows at a time.

    The forward also computes d loss_r / d p_r = (d loss_r / d logits_r) W per chunk (for ce the closed form
    softmax(p W^T) - softmax(f W^T), since the target distribution sums to 1; for the other losses autograd on the
    chunk's logits) and keeps only that [N, H] float32 tensor for the backward: no [N, V] tensor is ever held, and
    the logits are not recomputed (row r's loss depends on p_r alone, so the backward is that row's gradient times
    the row's incoming gradient: 1/N for the mean, a D-PACE weight / N). Dtypes follow the unchunked path: logits
    from a matmul in lm_head's dtype, loss math in float32, the gradient's matmul in lm_head's dtype (the incoming
    gradient, the loss scale included, applied in float32 afterwards, so fp16 does not underflow).
    `correct` [3] (long, CPU) receives the top-1/2/3 hit counts, `conf` [N] float32 the rows' confidence.
    """

    @staticmethod
    def forward(ctx, p, f, lm_head, chunk: int, correct, loss, conf):  # p, f [N, H]; lm_head [V, H]; loss: a TokenLoss
        n = p.shape[0]
        rows = torch.empty(n, dtype=torch.float32, device=p.device)
        grad = torch.empty(p.shape, dtype=torch.promote_types(lm_head.dtype, torch.float32), device=p.device)  # [N, H]
        for s in range(0, n, chunk):
            e = min(s + chunk, n)
            head_logits = F.linear(p[s:e].to(lm_head.dtype), lm_head).float()  # [c, V]
            target_logits = F.linear(f[s:e].to(lm_head.dtype), lm_head).float()  # [c, V]
            correct += topk_hits(head_logits, greedy_ids(target_logits))
            rows[s:e], d_logits, conf[s:e] = loss.logit_grad(head_logits, target_logits.softmax(-1))  # d_logits [c, V]
            del head_logits, target_logits
            grad[s:e] = d_logits.to(lm_head.dtype) @ lm_head  # [c, H]
        ctx.save_for_backward(grad)
        ctx.p_dtype = p.dtype
        return rows

    @staticmethod
    def backward(ctx, grad_out):  # grad_out [N]
        (grad,) = ctx.saved_tensors
        return (grad * grad_out.to(grad.dtype)[:, None]).to(ctx.p_dtype), None, None, None, None, None, None
