"""Held-out metrics: loss parts, top-1/2/3 agreement with the target's argmax, and a self-fed chain rollout
giving per-step accuracy and a simulated acceptance length.

Self-fed rollout, for a chain starting after position s (the target has committed x_{s+1}; the draft has the
TRUE features f_0..f_s): step 1 feeds (f_s, x_{s+1}) and predicts f^_{s+1}; step j feeds (f^_{s+j-1}, x_{s+j})
with every earlier position as in step j-1 (true prefix, then the draft's own predictions), exactly what the
draft's KV cache holds while drafting a chain. Step j is correct when argmax lm_head(f^_{s+j}) equals the
target's argmax at f_{s+j}. The simulated acceptance length is 1 + the mean number of leading correct steps
(greedy chain decoding with `rollout_steps` draft tokens). Tokens fed along the chain are the data's tokens:
exact for data regenerated greedily by the target (our data_prep default), an estimate otherwise.

`eval/allfed_step{j}_acc` is the stricter variant where step j feeds self-fed features at EVERY position
(context included), as in training-time-test style unrolls; it lower-bounds the chain numbers.
"""
from __future__ import annotations

import zlib

import torch

from eagle.sampling import greedy_ids
from train.data import collate
from train.distributed import all_reduce_sum
from train.loss import eagle_loss, shift_for_head

def eval_batches(lengths: list[int], micro_batch_size: int, max_records: int, rank: int, world_size: int) -> list[list[int]]:
    """This rank's eval micro-batches (indices into the eval subset), length-sorted to avoid padding."""
    n = min(len(lengths), max_records) if max_records else len(lengths)
    order = sorted(range(n), key=lengths.__getitem__)
    batches = [order[i : i + micro_batch_size] for i in range(0, n, micro_batch_size)]
    return batches[rank::world_size]


def rollout_starts(length: int, weights: torch.Tensor, steps: int, max_starts: int, seed: int, record_id: str) -> list[int]:
    """Chain start positions s of one record: s + steps <= length - 1 and the first drafted token is a loss
    token (weights[s] = loss_mask[s+1]). At most `max_starts`, sampled reproducibly (0 = all)."""
    cands = [s for s in range(0, length - steps) if bool(weights[s])]
    if max_starts and len(cands) > max_starts:
        g = torch.Generator().manual_seed(zlib.crc32(f"{seed}:{record_id}".encode()))
        pick = torch.randperm(len(cands), generator=g)[:max_starts].sort().values
        cands = [cands[int(i)] for i in pick]
    return cands


@torch.no_grad()
def chain_rollout(head, hidden: torch.Tensor, input_ids: torch.Tensor, target_top: torch.Tensor, starts: list[int],
                  steps: int, lm_head: torch.Tensor) -> torch.Tensor:
    """Correctness [n, steps] (bool) of the self-fed chains of ONE record starting at each s in `starts`.

    hidden [T, H] true features, input_ids [T], target_top [T] argmax of lm_head(hidden). The true prefix is
    encoded once into the head's KV cache (its outputs are the step-1 drafts of every start); each further
    step appends one node per chain that attends to the true prefix 0..s, its own chain's earlier nodes and
    itself, like the nodes of a draft tree. Cost ~ T^2 + steps * n * (T + steps * n), not n * T^2 * steps.
    """
    T, device = hidden.shape[0], hidden.device
    n = len(starts)
    s_idx = torch.tensor(starts, device=device)  # [n]
    decoder = head.decoder(capacity=T - 1 + (steps - 1) * n, fast=False)  # one record: no per-call weight copies
    prefix = decoder.forward(hidden[: T - 1], input_ids[1:], range(T - 1))  # [T-1, H]
    pred = prefix[s_idx]  # [n, H]: step 1 drafts f^_{s+1} from the true prefix 0..s
    correct = torch.zeros(n, steps, dtype=torch.bool, device=device)
    cols = torch.arange(T - 1, device=device)  # [T-1]
    own = torch.eye(n, dtype=torch.bool, device=device)  # [n, n]: a chain's node sees only its own chain's nodes
    for j in range(1, steps + 1):
        draft = greedy_ids(torch.nn.functional.linear(pred.to(lm_head.dtype), lm_head))  # [n]
        correct[:, j - 1] = draft == target_top[s_idx + j]
        if j == steps:
            break
        # node j+1 of each chain: input (f^_{s+j}, x_{s+j+1}) at position s+j
        prefix_mask = cols[None, :] <= s_idx[:, None]  # [n, T-1] true features 0..s only
        mask = torch.cat([prefix_mask, own.repeat(1, j)], dim=1)  # [n, T-1 + j*n]: + earlier nodes + self
        pred = decoder.forward(pred, input_ids[s_idx + j + 1], s_idx + j, mask)  # [n, H] = f^_{s+j+1}
    return correct


@torch.no_grad()
def all_fed_rollout(head, hidden, input_ids, attention_mask, weights, target_top, steps: int, lm_head):
    """Per-step accuracy when EVERY position is self-fed: step d feeds the step d-1 predictions as the features
    of all positions (also the context), a pessimistic bound on chain drafting (its context is true features).
    Returns (hits [steps], counts [steps]) as float64 sums over loss positions."""
    hits = torch.zeros(steps, dtype=torch.float64)
    counts = torch.zeros(steps, dtype=torch.float64)
    f_in, tok, am = hidden[:, :-1], input_ids[:, 1:], attention_mask[:, :-1]
    for d in range(steps):
        if f_in.shape[1] == 0:
            break
        pred = head(f_in, tok, am)  # [B, T-1-d, H]: position j predicts f_{j+d+1}
        valid = weights[:, d:].bool()  # loss token at j+d+1 (and real)
        draft = greedy_ids(torch.nn.functional.linear(pred.to(lm_head.dtype), lm_head))  # [B, T-1-d]
        hits[d] = float((draft == target_top[:, d + 1 :])[valid].sum())
        counts[d] = float(valid.sum())
        f_in, tok, am = pred[:, :-1], input_ids[:, d + 2 :], attention_mask[:, d + 2 :]
    return hits, counts


@torch.no_grad()
def evaluate(head, subset, target, settings, device, dtype, seed: int, rank: int = 0, world_size: int = 1) -> dict:
    """Metrics of `head` on the eval `subset`, summed over ranks (every rank gets the same dict)."""
    s = settings
    k = s.rollout_steps
    # positions, feat*n, tok*n, top1, top2, top3, chains, accepted, chain step hits [k], all-fed hits [k], all-fed counts [k]
    sums = torch.zeros(8 + 3 * k, dtype=torch.float64)
    was_training = head.training
    head.eval()
    for idx in eval_batches(subset.lengths, s.micro_batch_size, s.eval_max_records, rank, world_size):
        records = [subset[i] for i in idx]
        batch = collate(records).to(device)
        hidden = target.features(batch).to(dtype)  # [B, T, H]
        feats, next_ids, attn, targets, weights = shift_for_head(hidden, batch.input_ids, batch.attention_mask, batch.loss_mask)
        out = eagle_loss(head(feats, next_ids, attn), targets, weights, target.lm_head, s.feature_weight, s.token_weight,
                         s.loss_chunk)
        sums[0] += out.positions
        sums[1] += float(out.feature) * out.positions
        sums[2] += float(out.token) * out.positions
        sums[3:6] += torch.tensor(out.topk_correct, dtype=torch.float64)
        target_top = greedy_ids(torch.nn.functional.linear(hidden.to(target.lm_head.dtype), target.lm_head))  # [B, T]
        hits, counts = all_fed_rollout(head, hidden, batch.input_ids, batch.attention_mask, weights, target_top, k,
                                       target.lm_head)
        sums[8 + k : 8 + 2 * k] += hits
        sums[8 + 2 * k :] += counts
        for b, rec in enumerate(records):  # exact self-fed chains from every (sampled) start
            n = rec["input_ids"].shape[0]
            starts = rollout_starts(n, weights[b], k, s.rollout_starts, seed, rec["id"])
            if not starts:
                continue
            correct = chain_rollout(head, hidden[b, :n], batch.input_ids[b, :n], target_top[b, :n], starts, k,
                                    target.lm_head).cpu()  # [n_starts, k]
            leading = correct.long().cumprod(-1).sum(-1)  # [R] accepted draft tokens per chain
            sums[6] += correct.shape[0]
            sums[7] += float(leading.sum())
            sums[8 : 8 + k] += correct.double().sum(0)
    head.train(was_training)
    sums = torch.tensor(all_reduce_sum(sums.tolist()), dtype=torch.float64)
    n, chains = max(sums[0].item(), 1.0), max(sums[6].item(), 1.0)
    metrics = {
        "eval/positions": int(sums[0]),
        "eval/feature_loss": sums[1].item() / n,
        "eval/token_loss": sums[2].item() / n,
        "eval/top1": sums[3].item() / n,
        "eval/top2": sums[4].item() / n,
        "eval/top3": sums[5].item() / n,
        "eval/chains": int(sums[6]),
        "eval/sim_accept_len": 1.0 + sums[7].item() / chains,
    }
    metrics["eval/loss"] = s.feature_weight * metrics["eval/feature_loss"] + s.token_weight * metrics["eval/token_loss"]
    for j in range(k):
        metrics[f"eval/step{j + 1}_acc"] = sums[8 + j].item() / chains
    for j in range(k):
        metrics[f"eval/allfed_step{j + 1}_acc"] = sums[8 + k + j].item() / max(sums[8 + 2 * k + j].item(), 1.0)
    return metrics


@torch.no_grad()
def evaluate_eagle3(head, subset, target, settings, ttt_steps: int, step_weights: list[float], segments: int, device,
                    dtype, seed: int, rank: int = 0, world_size: int = 1) -> dict:
    """Metrics of an EAGLE-3 `head` on the eval `subset`, summed over ranks, named as `evaluate`'s.

    The unroll IS the self-fed chain: step j at index s sees the true prefix 0..s (step 1) and its own chain's
    steps 2..j only, as when decoding a chain (tokens fed = the data's). So step{j}_acc and sim_accept_len come
    from one unroll of max(rollout_steps, ttt_steps) steps at every position, scored on the same chain starts as
    EAGLE-2's rollouts (`rollout_starts`). Also eval/ttt_step{j}_acc (every loss position, j <= ttt_steps) and the
    loss of the training objective; eval/feature_loss is 0 (no feature loss).
    """
    from train.loss import eagle3_loss, eagle3_targets, shift_for_eagle3

    s = settings
    k = s.rollout_steps
    n_unroll = max(k, ttt_steps)
    # positions, tok*n, top1, top2, top3, chains, accepted, chain step hits [k], ttt hits [ttt], ttt counts [ttt], loss*n
    sums = torch.zeros(7 + k + 2 * ttt_steps + 1, dtype=torch.float64)
    was_training = head.training
    head.eval()
    draft_ids = torch.arange(head.d2t.numel(), device=head.d2t.device) + head.d2t  # [Vd]
    for idx in eval_batches(subset.lengths, s.micro_batch_size, s.eval_max_records, rank, world_size):
        records = [subset[i] for i in idx]
        batch = collate(records).to(device)
        features = target.features(batch).to(dtype)  # [B, T, 4H]
        aux, next_ids, attn, final, weights = shift_for_eagle3(features, batch.input_ids, batch.attention_mask,
                                                               batch.loss_mask, segments)
        probs, top = eagle3_targets(final, target.lm_head, draft_ids)  # [B, T-1, Vd], [B, T-1]
        hiddens = head.unroll(aux, next_ids, attn, steps=n_unroll)  # n_unroll x [B, T-1, H]
        out = eagle3_loss(head, hiddens[:ttt_steps], probs, top, weights, step_weights)
        sums[0] += out.positions
        sums[1] += float(out.token) * out.positions
        sums[2:5] += torch.tensor(out.topk_correct, dtype=torch.float64)
        sums[7 + k : 7 + k + ttt_steps] += torch.tensor(out.step_hits, dtype=torch.float64)
        sums[7 + k + ttt_steps : 7 + k + 2 * ttt_steps] += torch.tensor(out.step_counts, dtype=torch.float64)
        sums[-1] += float(out.loss) * out.positions
        # draft (as target ids) of step j at index s, compared with the target's argmax at s + j - 1 (shifted index)
        drafts = torch.stack([draft_ids[head.draft_logits(h).argmax(-1)] for h in hiddens[:k]], dim=-1)  # [B, T-1, k]
        T1 = top.shape[1]
        top_ext = torch.nn.functional.pad(top, (0, k), value=-1)  # [B, T-1+k]
        want = torch.stack([top_ext[:, j : j + T1] for j in range(k)], dim=-1)  # [B, T-1, k]
        correct = drafts == want  # [B, T-1, k]
        for b, rec in enumerate(records):
            n = rec["input_ids"].shape[0]
            starts = rollout_starts(n, weights[b], k, s.rollout_starts, seed, rec["id"])
            if not starts:
                continue
            c = correct[b, starts].cpu()  # [n_starts, k]
            sums[5] += c.shape[0]
            sums[6] += float(c.long().cumprod(-1).sum())
            sums[7 : 7 + k] += c.double().sum(0)
    head.train(was_training)
    sums = torch.tensor(all_reduce_sum(sums.tolist()), dtype=torch.float64)
    n, chains = max(sums[0].item(), 1.0), max(sums[5].item(), 1.0)
    metrics = {
        "eval/positions": int(sums[0]),
        "eval/feature_loss": 0.0,
        "eval/token_loss": sums[1].item() / n,
        "eval/top1": sums[2].item() / n,
        "eval/top2": sums[3].item() / n,
        "eval/top3": sums[4].item() / n,
        "eval/chains": int(sums[5]),
        "eval/sim_accept_len": 1.0 + sums[6].item() / chains,
        "eval/loss": sums[-1].item() / n,
    }
    for j in range(k):
        metrics[f"eval/step{j + 1}_acc"] = sums[7 + j].item() / chains
    for j in range(ttt_steps):
        metrics[f"eval/ttt_step{j + 1}_acc"] = sums[7 + k + j].item() / max(sums[7 + k + ttt_steps + j].item(), 1.0)
    return metrics
