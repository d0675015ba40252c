"""Peak memory per rank and tokens/s of ONE training step (the EAGLE-3 training kind's loss, forward + backward) over
one long record, on 1 rank vs split over N ranks with train.sequence_parallel_size (DeepSpeed Ulysses,
train/sequence_parallel.py), against the plan (train/plan.py host mode, fp32: the step's items, per rank).

    python -m benchmarks.sequence_parallel_memory --lengths 4096 16384 32768 --ranks 1 2

Each (length, ranks) runs in fresh processes (1 rank: python; N: torchrun --nproc_per_node N, gloo). The head is
benchmarks/window_memory.py's small EAGLE-3 shape (H 64, 4 heads / 2 kv, vocabulary 256, 3 training-time-test
steps, window --window, token loss chunked by 256); the record's features are random and resident before the step
(every rank holds the whole record as loaded, as DeepSpeed's UlyssesSPDataLoaderAdapter does). Prints one JSON line
per run: each rank's measured growth of peak RSS over the step (MB), the plan's per-rank step (`planned_step_mb`:
head activations, backward transients, token-loss logits and checkpoints, the span copy), the step's seconds and
tokens/s (the record's tokens over the step's wall time). --tensors: also the step's tensors, per rank: what
autograd saves for backward (saved_tensors_hooks, unique storages: `saved_mb`) and the peak of live op outputs
(a TorchDispatchMode counting each new storage until it is freed: `live_peak_mb`); slower, its seconds are not
the step's.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
import weakref
from contextlib import ExitStack
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from transformers import LlamaConfig

from eagle.eagle3 import Eagle3Head
from eagle.head_config import head_config_from_target
from eagle.sliding_window import SlidingWindowOptions
from recipes import load_config
from train.head_kinds import training_kind
from train.plan import Hardware, memory_items, phase_bytes, plan_shape
from train.sequence_parallel import UlyssesShards, sequence_groups

STEP_ITEMS = ("head activations", "backward transients", "token-loss logits", "token-loss checkpoints",
              "sequence-parallel span")
TARGET = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=65536)


def recipe(length: int, window: int, ranks: int):
    over = ["head.kind=eagle3", "head.ttt_steps=3", "head.draft_vocab_size=256", "head.aux_layers=[1,2,3]",
            f"data.max_length={length}", "train.micro_batch_size=1", "train.precision=fp32", "train.loss_chunk=256",
            "train.noise=none", f"train.sequence_parallel_size={ranks}"]
    return load_config(None, over + ([f"head.sliding_window.size={window}"] if window else []))


def planned_step(cfg, target: LlamaConfig) -> float:
    """MB the plan (host mode, fp32) counts per rank for one forward + backward of the head and its token loss."""
    items = [i for i in memory_items(cfg, Hardware(host=True), plan_shape(cfg, target)) if i.name in STEP_ITEMS]
    return max(phase_bytes(items).values()) / 2**20


class TensorCounter(TorchDispatchMode):
    """Bytes of the storages ops create, live until freed (`peak`), and the storages autograd saves (`saved`)."""

    def __init__(self):
        super().__init__()
        self.live, self.peak, self.seen, self.saved = 0, 0, set(), {}

    def _freed(self, key: int, n: int) -> None:
        self.live -= n
        self.seen.discard(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self.seen:
                    self.seen.add(key)
                    self.live += storage.nbytes()
                    weakref.finalize(storage, self._freed, key, storage.nbytes())
                    self.peak = max(self.peak, self.live)
        return out

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        self.saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


class Engine:
    """What the training kind calls: the head (forward) and `module`, as DeepSpeed's engine offers them."""

    def __init__(self, head):
        self.module = head

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def one_run(length: int, window: int, tensors: bool = False) -> dict | None:
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    shards = None
    if ranks > 1:
        dist.init_process_group("gloo")
    target = LlamaConfig(**TARGET)
    cfg = recipe(length, window, ranks)
    part = training_kind(cfg, target)
    config = head_config_from_target(target, kind=Eagle3Head.kind.name, aux_layers=[1, 2, 3],
                                     sliding_window=SlidingWindowOptions(window) if window else None)
    head = Eagle3Head(config)
    if ranks > 1:
        shards = UlyssesShards(sequence_groups(ranks, ranks, dist.get_rank()), 4, 2, 16)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (1, length + 1), generator=g)
    features = torch.randn(1, length + 1, 4 * 64, generator=g)
    lm_head = torch.randn(256, 64, generator=g) * 0.1
    batch = SimpleNamespace(input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=torch.ones_like(ids))
    if ranks > 1:
        dist.barrier()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    start = time.perf_counter()
    counter = TensorCounter() if tensors else None
    with ExitStack() as stack:
        if counter is not None:
            stack.enter_context(counter.hooks())
            stack.enter_context(counter)
        part.loss(Engine(head), features, batch, lm_head, 0, 0, shards).loss.backward()
    if ranks > 1:
        dist.barrier()
    seconds = time.perf_counter() - start
    growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base
    mine = {"growth_mb": round(growth, 1), "rss_before_mb": round(base, 1)}
    if counter is not None:
        mine.update(saved_mb=round(sum(counter.saved.values()) / 2**20, 1), live_peak_mb=round(counter.peak / 2**20, 1))
    every = [mine]
    if ranks > 1:
        every = [None] * ranks
        dist.all_gather_object(every, mine)
        if dist.get_rank():
            dist.destroy_process_group()
            return None
        dist.destroy_process_group()
    plan = planned_step(cfg, target)
    worst = max(r["growth_mb"] for r in every)
    return {"length": length, "ranks": ranks, "window": window, "planned_step_mb": round(plan, 1),
            "measured_growth_mb": [r["growth_mb"] for r in every], "rss_before_mb": [r["rss_before_mb"] for r in every],
            "plan_error": round(plan / worst - 1, 4), "seconds": round(seconds, 2),
            "tokens_per_s": round(length / seconds), "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
            **({"saved_mb": [r["saved_mb"] for r in every], "live_peak_mb": [r["live_peak_mb"] for r in every]}
               if tensors else {})}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.sequence_parallel_memory", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 32768])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--window", type=int, default=256, help="head.sliding_window.size (0 = full attention)")
    p.add_argument("--tensors", action="store_true", help="also count the step's saved and live tensors (slower)")
    p.add_argument("--one", type=int, nargs=2, metavar=("LENGTH", "WINDOW"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        out = one_run(*args.one, tensors=args.tensors)
        if out is not None:
            print(json.dumps(out), flush=True)
        return 0
    for length in args.lengths:
        for ranks in args.ranks:
            launcher = [sys.executable] if ranks == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                            "--nproc_per_node", str(ranks)]
            proc = subprocess.run([*launcher, "-m", "benchmarks.sequence_parallel_memory", "--one", str(length),
                                   str(args.window)] + (["--tensors"] if args.tensors else []),
                                  capture_output=True, text=True)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
            print(lines[-1] if lines else json.dumps({"length": length, "ranks": ranks,
                                                      "error": proc.stderr.strip().splitlines()[-1:]}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
