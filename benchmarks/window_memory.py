"""Peak memory and tokens/s of ONE training forward + backward of a small EAGLE-3 head over one long record, full
attention vs `head.sliding_window` (eagle/sliding_window.py), each in a fresh process (peak RSS = ru_maxrss).

    python -m benchmarks.window_memory --lengths 4096 16384 32768 --windows 0 256 --ttt-steps 3

Window 0 = full attention. The head is the tiny test shape (H 64, 4 heads / 2 kv, vocabulary 256): the attention
scores, not the weights, are what grows with the length. --loss real: the training token loss (train/loss.py
draft_loss over DraftVocabTargets, chunked by --loss-chunk as train.loss_chunk) against random target states through
a random lm_head; --loss sum: a sum over the draft logits (no target logits). Prints one JSON line per run: length,
window, peak_rss_mb (the process, imports included), seconds, and (--loss real) the plan's prediction for the same
step (`planned_step`: train/plan.py host mode, fp32, the items one forward + backward of the head and its loss holds:
head activations, backward transients, token-loss logits and checkpoints, in their fullest phase) against the
measured growth peak_rss - rss_before (the head, its inputs and the imports already resident).
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch
from transformers import LlamaConfig

from eagle.eagle3 import Eagle3Head
from eagle.head_config import head_config_from_target
from eagle.sliding_window import SlidingWindowOptions
from recipes import load_config
from train.head_kinds import DraftVocabTargets
from train.loss import draft_loss
from train.plan import Hardware, memory_items, phase_bytes, plan_shape

STEP_ITEMS = ("head activations", "backward transients", "token-loss logits", "token-loss checkpoints")


def planned_step(target: LlamaConfig, length: int, window: int, steps: int, chunk: int) -> float:
    """MB the plan (host mode, fp32) counts for one forward + backward of the head and its token loss."""
    over = ["head.kind=eagle3", f"head.ttt_steps={steps}", "head.draft_vocab_size=256", "head.aux_layers=[1,2,3]",
            f"data.max_length={length}", "train.micro_batch_size=1", "train.precision=fp32",
            f"train.loss_chunk={chunk}"] + ([f"head.sliding_window.size={window}"] if window else [])
    cfg = load_config(None, over)
    items = [i for i in memory_items(cfg, Hardware(host=True), plan_shape(cfg, target)) if i.name in STEP_ITEMS]
    return max(phase_bytes(items).values()) / 2**20


def one_run(length: int, window: int, steps: int, loss: str = "sum", chunk: int = 256) -> dict:
    target = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=65536)
    config = head_config_from_target(target, kind=Eagle3Head.kind.name, aux_layers=[1, 2, 3],
                                     sliding_window=SlidingWindowOptions(window) if window else None)
    head = Eagle3Head(config)
    g = torch.Generator().manual_seed(0)
    aux = torch.randn(1, length, 3 * 64, generator=g)
    ids = torch.randint(0, 256, (1, length), generator=g)
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    start = time.perf_counter()
    if loss == "real":
        final = torch.randn(1, length, 64, generator=g)
        lm_head = torch.randn(256, 64, generator=g) * 0.1
        weights = torch.ones(1, length, dtype=torch.long)
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        start = time.perf_counter()
        hiddens = head.unroll(aux, ids, steps=steps)
        targets = DraftVocabTargets.of(head, final, lm_head, steps, chunk=chunk)
        draft_loss(hiddens, weights, targets, [0.8 ** j for j in range(steps)]).loss.backward()
    else:
        start = time.perf_counter()
        hiddens = head.unroll(aux, ids, steps=steps)
        sum(head.draft_logits(h).float().logsumexp(-1).mean() for h in hiddens).backward()
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out = {"length": length, "window": window, "ttt_steps": steps, "loss": loss, "peak_rss_mb": round(peak, 1),
           "rss_before_mb": round(base, 1), "seconds": round(seconds, 2), "tokens_per_s": round(length / seconds)}
    if loss == "real":
        plan = planned_step(target, length, window, steps, chunk)
        growth = peak - base
        out.update(loss_chunk=chunk, measured_growth_mb=round(growth, 1), planned_step_mb=round(plan, 1),
                   plan_error=round(plan / growth - 1, 4))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.window_memory", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 32768])
    p.add_argument("--windows", type=int, nargs="+", default=[0, 256])
    p.add_argument("--ttt-steps", type=int, default=3)
    p.add_argument("--loss", choices=["sum", "real"], default="sum")
    p.add_argument("--loss-chunk", type=int, default=256)
    p.add_argument("--one", type=int, nargs=2, metavar=("LENGTH", "WINDOW"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(one_run(args.one[0], args.one[1], args.ttt_steps, args.loss, args.loss_chunk)))
        return 0
    for length in args.lengths:
        for window in args.windows:
            out = subprocess.run([sys.executable, "-m", "benchmarks.window_memory", "--one", str(length), str(window),
                                  "--ttt-steps", str(args.ttt_steps), "--loss", args.loss,
                                  "--loss-chunk", str(args.loss_chunk)], capture_output=True, text=True)
            print(out.stdout.strip() or json.dumps({"length": length, "window": window,
                                                    "error": out.stderr.strip().splitlines()[-1:]}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
