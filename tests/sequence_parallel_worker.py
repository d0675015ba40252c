"""One rank of tests/test_sequence_parallel.py's function check (run under torchrun, gloo): the training loss of one
record and its gradients, whole on this rank and split over the world with train.sequence_parallel_size (DeepSpeed
Ulysses, train/sequence_parallel.py), in float64; the gradients averaged over the ranks as DeepSpeed averages them.
Exits 0 when both agree within tests/float_tolerance.py's bound (and the counts exactly); prints the worst ratios.

usage: torchrun --nproc_per_node 2 tests/sequence_parallel_worker.py KIND LENGTH STRIDE WINDOW KV_HEADS LOSS_CHUNK
"""
from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

from float_tolerance import LAYER_REDUCTIONS, assert_same_function
from recipes import load_config
from tiny_models import random_head, tiny_llama
from train.head_kinds import training_kind
from train.sequence_parallel import UlyssesShards, check_sequence_parallel, sequence_groups

STEPS = 3


class Engine:
    """What the training kind calls: the head (forward) and `module`, as DeepSpeed's engine offers them."""

    def __init__(self, head):
        self.module = head

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def main(kind: str, T: int, stride: int, window: int, kv_heads: int, chunk: int) -> None:
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.set_num_threads(1)
    extra = [f"head.sliding_window.size={window}"] if window else []
    cfg = load_config("tiny-eagle3", [f"head.kind={kind}", "head.aux_layers=[1,2,3]", f"head.ttt_steps={STEPS}",
                                      f"head.ttt_row_stride={stride}", "head.draft_vocab_size=100",
                                      f"train.loss_chunk={chunk}", "train.noise=uniform", "train.noise_std=0.2",
                                      "train.micro_batch_size=1", f"train.sequence_parallel_size={world}", *extra])
    target = tiny_llama(num_layers=4, num_kv_heads=kv_heads).double()
    part = training_kind(cfg, target.config)
    check_sequence_parallel(cfg.train, part, world, target.config.num_attention_heads, kv_heads)
    head = random_head(target, seed=1, kind=kind, draft_vocab_size=100).double().train()
    H = target.config.hidden_size
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, target.config.vocab_size, (1, T + 1), generator=g)
    features = torch.randn(1, T + 1, 4 * H, generator=g, dtype=torch.float64)
    loss_mask = (torch.rand(1, T + 1, generator=g) > 0.2).long()
    batch = SimpleNamespace(input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=loss_mask)
    lm_head = target.lm_head.weight.detach()
    params = [(n, p) for n, p in head.named_parameters() if p.requires_grad]
    micro = 5  # the micro-batch key: the row offset micro % stride and the noise seed

    whole = part.loss(Engine(head), features, batch, lm_head, micro, seed=3)
    whole.loss.backward()
    ref = {n: p.grad.clone() for n, p in params}
    head.zero_grad(set_to_none=True)

    shards = UlyssesShards(sequence_groups(world, world, rank), target.config.num_attention_heads, kv_heads,
                           H // target.config.num_attention_heads)
    split = part.loss(Engine(head), features, batch, lm_head, micro, seed=3, shards=shards)
    split.loss.backward()
    # ulysses' all-to-all over the heads really ran: each rank holds 1/world of the record's positions
    lo, hi = shards.span(T + (-T % (world * part.stride)))
    terms = max(T, 3 * H, 100)
    chained = STEPS * (LAYER_REDUCTIONS + 2)
    assert_same_function(split.loss, whole.loss, terms=terms, chained=chained, msg="loss")
    assert_same_function(split.token, whole.token, terms=terms, chained=chained, msg="step-1 token loss")
    assert split.step_counts == whole.step_counts and split.step_hits == whole.step_hits, \
        (split.step_counts, whole.step_counts, split.step_hits, whole.step_hits)
    assert split.topk_correct == whole.topk_correct, (split.topk_correct, whole.topk_correct)
    worst = 0.0
    for n, p in params:
        grad = p.grad.clone()
        dist.all_reduce(grad)
        grad /= world  # DeepSpeed's gradient average over the ranks
        bound = assert_same_function(grad, ref[n], terms=terms, chained=chained, msg=f"grad {n}")
        worst = max(worst, float((grad - ref[n]).abs().max()) / bound if bound else 0.0)
    if rank == 0:
        print(f"OK {kind} T={T} stride={stride} window={window} kv={kv_heads} chunk={chunk}: span {hi - lo} of "
              f"{T} positions per rank; loss {float(whole.loss.detach()):.6f}; worst gradient difference {worst:.2e} of the "
              f"bound", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    k, L, s, w, kv, c = sys.argv[1:7]
    main(k, int(L), int(s), int(w), int(kv), int(c))
