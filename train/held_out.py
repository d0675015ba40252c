"""Held-out metrics, one evaluation loop for every head kind: loss parts, top-1/2/3 agreement with the target's
argmax, and self-fed chains giving per-step accuracy and a simulated acceptance length (each head kind computes its
micro-batch's loss and chains: train/head_kinds.py; EAGLE-2 rolls its chains out as below).

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
def evaluate(head, subset, target, part, device, dtype, seed: int, rank: int = 0, world_size: int = 1) -> dict:
    """Metrics of `head` on the eval `subset`, summed over ranks (every rank gets the same dict). part: the head
    kind's train-stage part (train/head_kinds.py), which computes each micro-batch's loss and self-fed chains.

    eval/{positions, feature_loss, token_loss, top1..3, loss} of the training loss, eval/chains and
    eval/sim_accept_len of the chains from every (sampled) start, eval/step{j}_acc (j = 1..rollout_steps), and the
    kind's extra per-step accuracy eval/{part.extra_eval}_step{j}_acc."""
    s = part.t
    k, e = s.rollout_steps, part.extra_steps
    # positions, feature*n, token*n, loss*n, top1, top2, top3, chains, accepted, chain step hits [k], extra hits [e],
    # extra counts [e]
    sums = torch.zeros(9 + k + 2 * e, dtype=torch.float64)
    was_training = head.training
    head.eval()
    for idx in eval_batches(subset.lengths, s.micro_batch_size, s.eval_max_records, rank, world_size):
        records = [subset[i] for i in idx]
        batch = collate(records).to(device)
        ev = part.eval_batch(head, target.features(batch).to(dtype), batch, target.lm_head, k)
        out = ev.out
        sums[0] += out.positions
        sums[1] += float(out.feature) * out.positions
        sums[2] += float(out.token) * out.positions
        sums[3] += float(out.loss) * out.positions
        sums[4:7] += torch.tensor(out.topk_correct, dtype=torch.float64)
        sums[9 + k : 9 + k + e] += ev.extra_hits
        sums[9 + k + e :] += ev.extra_counts
        for b, rec in enumerate(records):  # the self-fed chains from every (sampled) start
            n = rec["input_ids"].shape[0]
            starts = rollout_starts(n, ev.weights[b], k, s.rollout_starts, seed, rec["id"])
            if not starts:
                continue
            correct = ev.chains(b, n, starts)  # [n_starts, k]
            sums[7] += correct.shape[0]
            sums[8] += float(correct.long().cumprod(-1).sum())  # accepted draft tokens of greedy chain decoding
            sums[9 : 9 + k] += correct.double().sum(0)
    head.train(was_training)
    sums = torch.tensor(all_reduce_sum(sums.tolist()), dtype=torch.float64)
    n, chains = max(sums[0].item(), 1.0), max(sums[7].item(), 1.0)
    metrics = {
        "eval/positions": int(sums[0]),
        "eval/feature_loss": sums[1].item() / n,
        "eval/token_loss": sums[2].item() / n,
        "eval/top1": sums[4].item() / n,
        "eval/top2": sums[5].item() / n,
        "eval/top3": sums[6].item() / n,
        "eval/chains": int(sums[7]),
        "eval/sim_accept_len": 1.0 + sums[8].item() / chains,
    }
    metrics["eval/loss"] = part.eval_loss(metrics, sums[3].item() / n)
    for j in range(k):
        metrics[f"eval/step{j + 1}_acc"] = sums[9 + j].item() / chains
    for j in range(e):
        metrics[f"eval/{part.extra_eval}_step{j + 1}_acc"] = sums[9 + k + j].item() / max(sums[9 + k + e + j].item(), 1.0)
    return metrics
