"""The pipeline at real 7-8B tensor shapes on CPU, checked against the plan (train/plan.py, host mode).

    python -m benchmarks.real_shape --recipe llama3-8b [--layers 1] [--records 4] [--seq 2048] [--steps 3]
    python -m benchmarks.real_shape --recipe qwen2-7b

1. Builds a target with the recipe target's REAL shapes (hidden, vocabulary, attention / MLP sizes, q/k/v bias;
   the config from train.plan.KNOWN_TARGETS) but only --layers decoder layers and random weights, saved as an
   HF folder under --work (depth only changes data-prep time; the head, the cache and the trainer only see H
   and V), and --records tokenised records of exactly --seq tokens (random ids, loss on the last
   --loss-fraction of each: real assistant-only masks train on a part of each record).
2. Data prep (`data_prep/main.py ... cache`, the recipe's cache dtype; the target computing in fp32) in a child
   process: its peak RSS, and bytes/token on disk from the cache manifest.
3. Training (`train/main.py`, the recipe's ZeRO stage and micro-batch; fp32 because DeepSpeed on CPU has no fp16
   and bf16 matmuls have no CPU kernel here; one process) for --steps optimizer steps in a child process:
   its peak RSS (VmHWM; the loop reaches it at the first optimizer step, when AdamW allocates its moments).
4. The plan in host mode for the same settings: predicted peak vs measured, and predicted bytes/token.

The GPU figure scales from the host one by swapping what differs (train/plan.py prints both): 16-bit module
weights instead of fp32 (params, frozen embedding and lm_head, activations at 2 bytes), no host copy of the
embedding as read, the DeepSpeed buckets at their full configured size, plus the CUDA context and the
allocator reserve. Results: a table on stdout and JSON in --work/real_shape_{recipe}.json.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

from data_prep.feature_cache import CACHE_MANIFEST, bytes_per_token
from data_prep.tokenized import write_tokenized
from eagle.state_files import read_json_state
from recipes import load_config
from train.plan import Hardware, KNOWN_TARGETS, build_plan, format_plan, phase_bytes, plan_shape

REPO = Path(__file__).resolve().parent.parent
GB = 1e9


def build_target(recipe_cfg, layers: int, out: Path) -> Path:
    """Random-weight HF folder with the recipe target's real shapes and `layers` decoder layers."""
    # lazy: transformers' model classes cost seconds at import; --help does not need them
    from transformers import AutoConfig, AutoModelForCausalLM

    if (out / "config.json").exists():
        return out
    known = dict(KNOWN_TARGETS[recipe_cfg.target.path])
    known["num_hidden_layers"] = layers
    config = AutoConfig.for_model(known.pop("model_type"), **known)
    torch.manual_seed(0)
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[recipe_cfg.target.dtype]
    torch.set_default_dtype(dtype)
    try:
        model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(torch.float32)
    with torch.no_grad():  # random init at the real init scale; std 0.02 everywhere keeps activations finite
        for p in model.parameters():
            if p.ndim > 1:
                p.normal_(0.0, 0.02)
    model.save_pretrained(out)
    return out


def write_records(path: Path, n: int, seq: int, vocab: int, loss_fraction: float) -> None:
    rng = random.Random(0)
    start = int(seq * (1 - loss_fraction))
    recs = [{"id": f"r{i}", "input_ids": [rng.randrange(vocab) for _ in range(seq)],
             "loss_mask": [0] * start + [1] * (seq - start)} for i in range(n)]
    write_tokenized(path, recs)


def run_measured(cmd: list[str], env: dict, log: Path) -> dict:
    """Run a child, sampling its RSS every 0.2 s; returns peak RSS (VmHWM), wall time and the RSS timeline."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, cwd=REPO)
        timeline, hwm = [], [0]

        def sample():
            status = Path(f"/proc/{proc.pid}/status")
            while proc.poll() is None:
                try:
                    fields = dict(line.split(":", 1) for line in status.read_text().splitlines() if ":" in line)
                    rss = int(fields["VmRSS"].split()[0]) * 1024
                    hwm[0] = max(hwm[0], int(fields["VmHWM"].split()[0]) * 1024)
                    timeline.append((round(time.perf_counter() - t0, 1), rss))
                except (OSError, KeyError, ValueError):
                    pass
                time.sleep(0.2)

        th = threading.Thread(target=sample, daemon=True)
        th.start()
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        th.join()
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}); see {log}")
    peak = max(hwm[0], usage.ru_maxrss * 1024)
    return {"peak_rss": peak, "wall_s": time.perf_counter() - t0, "timeline": timeline[:: max(1, len(timeline) // 200)]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.real_shape", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="llama3-8b", help="a 7-8B recipe whose target is in train.plan.KNOWN_TARGETS")
    p.add_argument("--layers", type=int, default=1, help="decoder layers of the random target")
    p.add_argument("--records", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048, help="tokens per record (= data.max_length)")
    p.add_argument("--loss-fraction", type=float, default=0.25, help="loss positions per record (speed only)")
    p.add_argument("--steps", type=int, default=3, help="optimizer steps (grad_accum 1)")
    p.add_argument("--micro-batch", type=int, default=None, help="default: the recipe's")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--work", default="/work/notes/plan/real_shape", help="target folder, data and outputs")
    p.add_argument("--skip-train", action="store_true")
    p.add_argument("--reuse-prep", action="store_true", help="keep an existing cache (no data-prep measurement)")
    p.add_argument("--phases", action="store_true",
                   help="also record the peak RSS of every phase of every micro-batch (benchmarks.rss_phases)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="extra recipe overrides for both stages")
    args = p.parse_args(argv)

    work = Path(args.work) / args.recipe
    target = work / "target"
    out_dir = work / "run"
    base = load_config(args.recipe, [])
    mb = args.micro_batch or base.train.micro_batch_size
    common = [f"target.path={target}", f"output_dir={out_dir}", f"data.max_length={args.seq}", *args.overrides]
    train_over = common + ["train.precision=fp32", f"train.micro_batch_size={mb}", "train.grad_accum=1",
                           f"train.max_steps={args.steps + 1}", f"train.stop_after={args.steps}",
                           "train.num_workers=0", "train.eval_fraction=0", "logging.backend=none",
                           "logging.progress=false", "train.verify_cache=size", "train.warmup_steps=1"]
    cfg = load_config(args.recipe, train_over)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(args.threads), "WANDB_MODE": "disabled"}
    result = {"recipe": args.recipe, "layers": args.layers, "records": args.records, "seq": args.seq,
              "micro_batch": mb, "steps": args.steps, "threads": args.threads}

    t0 = time.perf_counter()
    build_target(base, args.layers, target)
    result["build_s"] = time.perf_counter() - t0
    data = out_dir / "data"
    if not (args.reuse_prep and (data / "features" / "manifest.json").exists()):
        shutil.rmtree(data, ignore_errors=True)
        vocab = json.loads((target / "config.json").read_text())["vocab_size"]
        write_records(data / "tokenized.jsonl", args.records, args.seq, vocab, args.loss_fraction)
        # the target computes in fp32 here (bf16 matmuls have no fast CPU kernel on this box); the cache keeps the
        # recipe's dtype, and the trainer reads the embedding / lm_head in the dtype the folder stores (the recipe's)
        prep = run_measured([sys.executable, "data_prep/main.py", "--recipe", args.recipe, "--no-progress", "cache",
                             *common, "target.dtype=float32"], env, work / "prep.log")
        result["prep"] = prep
    manifest = read_json_state(data / "features" / CACHE_MANIFEST.name, CACHE_MANIFEST)
    result["cache"] = {k: manifest[k] for k in ("dtype", "num_tokens", "bytes_on_disk", "bytes_per_token")}
    files = sum(f.stat().st_size for f in (data / "features" / "shards").glob("*.safetensors"))
    result["cache"]["measured_bytes_per_token"] = files / manifest["num_tokens"]  # the shard files as they are on disk

    shape = plan_shape(cfg)
    host = build_plan(cfg, Hardware(host=True, gpu_mem_gb=24.0), shape)
    gpu = build_plan(load_config(args.recipe, common), Hardware(), shape)

    bpt_pred = bytes_per_token(shape.hidden, manifest["dtype"])
    result["plan_host"] = {i.name: i.bytes for i in host.memory}
    result["plan_host_total"] = host.total
    result["plan_host_phases"] = phase_bytes(host.memory)
    result["plan_gpu_total"] = gpu.total
    result["bytes_per_token_predicted"] = bpt_pred
    print(format_plan(cfg, host))
    if not args.skip_train:
        shutil.rmtree(out_dir / "train", ignore_errors=True)
        probe = ["-m", "benchmarks.rss_phases", str(work / "phases.jsonl")] if args.phases else []  # cwd: REPO
        tr = run_measured([sys.executable, *probe, "train/main.py", "--recipe", args.recipe, *train_over], env,
                          work / "train.log")
        if args.phases:  # the probe resets VmHWM at every phase boundary: the run's peak is the largest phase peak
            tr["phases"] = [json.loads(line) for line in (work / "phases.jsonl").read_text().splitlines()]
            tr["peak_rss"] = max([tr["peak_rss"]] + [ph["peak"] for ph in tr["phases"]])
        result["train"] = tr
        result["ratio_measured_over_predicted"] = tr["peak_rss"] / host.total
    (work / f"real_shape_{args.recipe}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"\n{args.recipe} shape, {args.layers}-layer random target, {args.records} x {args.seq} tokens, micro-batch {mb}")
    print(f"  bytes/token on disk ({manifest['dtype']}): measured {result['cache']['measured_bytes_per_token']:.2f} "
          f"(shard files incl. headers and offsets), predicted {bpt_pred}")
    if "prep" in result:
        print(f"  data prep: peak RSS {result['prep']['peak_rss'] / GB:.2f} GB, {result['prep']['wall_s']:.0f} s")
    if "train" in result:
        tr = result["train"]
        print(f"  training ({args.steps} steps): peak RSS measured {tr['peak_rss'] / GB:.2f} GB, plan (host) "
              f"{host.total / GB:.2f} GB, measured/predicted {tr['peak_rss'] / host.total:.3f}; {tr['wall_s']:.0f} s")
        planned = result["plan_host_phases"]
        for ph in tr.get("phases", []):
            plan_ph = f", plan {planned[ph['phase']] / GB:5.2f} GB" if ph["phase"] in planned else ""
            print(f"    micro-batch {ph['micro']} {ph['phase']:<9} peak {ph['peak'] / GB:6.2f} GB{plan_ph}, "
                  f"at its end {ph['rss'] / GB:6.2f} GB")
    print(f"  the same recipe on one 24 GB GPU per the plan: {gpu.verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
