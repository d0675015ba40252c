"""The block drafter's training objective (DFlash heads, train/head_kinds.py `DFlashTraining`).

Anchors (`sample_anchors`): per record up to `n` positions p >= 1 whose next token x_{p+1} is a loss token, drawn
without replacement from a generator the caller seeds per micro-batch (so any number of ranks, and a resumed run,
draw the same anchors). The head's block at anchor p has positions p .. p + B - 1; block position i = 1..B-1 drafts
x_{p+i} and is scored (`block_loss`) against the target's distribution of x_{p+i} (its lm_head over the final state
at p + i - 1) with the recipe's token loss (train/losses.py), when x_{p+i} is a real loss token. Position i's mean
loss over its scored rows is weighted by w_i (head.block_weights, default 0.8^(i-1)); with D-PACE each block is a
chain of B - 1 steps and its rows take D-PACE's weights (train/losses.py). Accuracy: a hit when the draft's argmax is
the target's (full vocabulary). Loss math in float32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from train.loss import LossOutput, topk_hits
from train.losses import DPace, TokenLoss, confidence


def sample_anchors(attention_mask: torch.Tensor, loss_mask: torch.Tensor, n: int,
                   generator: torch.Generator) -> torch.Tensor:
    """[b, n] long anchor positions (module docstring), -1 where a record has fewer than n candidates; sorted."""
    b, T = attention_mask.shape
    cand = torch.zeros(b, T, dtype=torch.bool, device=attention_mask.device)
    if T >= 3:
        cand[:, 1:T - 1] = (loss_mask[:, 2:] * attention_mask[:, 2:] * attention_mask[:, 1:T - 1]).bool()
    score = torch.rand(b, T, generator=generator, device=attention_mask.device)
    score = torch.where(cand, score, -1.0)
    values, idx = score.topk(min(n, T), dim=1)
    anchors = torch.where(values >= 0, idx, -1)
    if anchors.shape[1] < n:
        anchors = F.pad(anchors, (0, n - anchors.shape[1]), value=-1)
    return _sorted(anchors, T)


def _sorted(anchors: torch.Tensor, T: int) -> torch.Tensor:
    """Anchors in increasing order, the -1 (none) last."""
    key = torch.where(anchors >= 0, anchors, T + 1)
    out = key.sort(1).values
    return torch.where(out > T, -1, out)


def block_loss(out: torch.Tensor, final: torch.Tensor, batch, anchors: torch.Tensor, lm_head: torch.Tensor,
               token_loss: TokenLoss, weights: list[float], weighting: DPace | None = None) -> LossOutput:
    """out [b, A, B, H] the head's block outputs at anchors [b, A]; final [b, T, H] the target's final states;
    lm_head [V, H] the target's. The module docstring's loss."""
    b, A, B, _ = out.shape
    T = final.shape[1]
    pos = anchors[..., None] + torch.arange(1, B, device=out.device)  # [b, A, B-1] the drafted token's index
    posc = pos.clamp(0, T - 1)
    scored = (batch.loss_mask * batch.attention_mask).bool()
    valid = (anchors >= 0)[..., None] & (pos < T) & scored.gather(1, posc.view(b, -1)).view_as(pos)  # [b, A, B-1]
    loss = out.new_zeros((), dtype=torch.float32)
    n_pos = B - 1
    hits, counts, step_loss, topk, token = [0] * n_pos, [0] * n_pos, [0.0] * n_pos, [0, 0, 0], torch.zeros(())
    if not bool(valid.any()):
        return LossOutput(loss + out.sum() * 0.0, torch.zeros(()), token, 0, topk, hits, counts, step_loss)
    h = out[:, :, 1:][valid]  # [N, H]
    src = (posc - 1).clamp(min=0).view(b, -1, 1).expand(-1, -1, final.shape[-1])
    with torch.no_grad():
        truth = final.gather(1, src).view(b, A, n_pos, -1)[valid]  # [N, H]
        target_logits = F.linear(truth.to(lm_head.dtype), lm_head).float()
        p = target_logits.softmax(-1)
        want = target_logits.argmax(-1)
    logits = F.linear(h.to(lm_head.dtype), lm_head).float()  # [N, V]
    logq = logits.log_softmax(-1)
    rows = token_loss.rows(logq, p)  # [N]
    step = torch.arange(n_pos, device=out.device).expand_as(pos)[valid]  # [N] block position - 1
    row_w = None
    if weighting is not None:
        conf = torch.zeros(valid.shape, dtype=torch.float32, device=out.device)
        conf[valid] = confidence(logq, p).float()
        row_w = weighting.weights(conf.view(1, b * A, n_pos), valid.view(1, b * A, n_pos)).view(b, A, n_pos)[valid]
    with torch.no_grad():
        hit = logits.argmax(-1) == want
    for j in range(n_pos):
        m = step == j
        n = int(m.sum())
        if not n:
            continue
        r = rows[m] if row_w is None else rows[m] * row_w[m]
        loss = loss + weights[j] * r.mean()
        hits[j], counts[j], step_loss[j] = int(hit[m].sum()), n, float(rows[m].detach().mean())
        if j == 0:
            topk = [int(x) for x in topk_hits(logits[m].detach(), want[m])]
            token = rows[m].detach().mean()
    return LossOutput(loss, torch.zeros(()), token, counts[0], topk, hits, counts, step_loss)
