"""Recipe sections `train`, `logging`, `export` (read by train/ and export/). The one home of these defaults.

Defaults are the published EAGLE-1/2 DeepSpeed settings (../shared/docs/eagle-reference.md §2):
AdamW lr 5e-5 (the paper's non-DeepSpeed script uses 3e-5), betas (0.9, 0.95), no weight decay,
2000 warmup steps then linear decay, clipping 0.5, ZeRO-2, fp16 with dynamic loss scaling,
micro-batch 2 x grad-accum 2, 20 epochs, 95/5 train/eval split, loss 1.0 * SmoothL1 + 0.1 * soft CE,
uniform input-feature noise 0.2. `validate_train_sections` checks every value before a run starts.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from recipes.check import check

MODES = ("offline", "online", "stream")
STREAM_PRODUCERS = ("hf", "vllm")
STREAM_EPOCHS = ("recapture", "keep")
BATCHING = ("grouped", "padded")
LONG_RECORDS = ("keep", "truncate", "drop", "error")
PRECISIONS = ("bf16", "fp16", "fp32")
SCHEDULES = ("linear", "cosine", "constant")
NOISES = ("uniform", "gaussian", "none")
LOG_BACKENDS = ("tensorboard", "wandb", "none")
EXPORT_DTYPES = ("float16", "bfloat16", "float32")


@dataclass
class TrainSettings:
    # --- data
    mode: str = "offline"  # offline = features from the data_prep cache; online = the frozen target computes them in the loop; stream = a producer process captures them as training consumes them (train/stream.py), the disk holding at most the window (train.stream_window_steps)
    cache_dir: str = ""  # offline feature cache; "" = {output_dir}/data/features
    verify_cache: str = "sha256"  # sha256 = hash every cache shard at start | size = check sizes only (huge caches)
    tokenized: str = ""  # online mode: tokenised conversations (jsonl); "" = {output_dir}/data/tokenized.jsonl
    eval_fraction: float = 0.05  # records held out for evaluation (stable per record id)
    eval_max_records: int = 0  # evaluate on at most this many held-out records; 0 = all
    long_records: str = "keep"  # records longer than the head's max_position_embeddings: keep (train at those positions; RoPE has no table limit) | truncate | drop | error
    batching: str = "grouped"  # grouped = length-bucketed micro-batches (little padding); padded = random order, pad to the longest
    group_size: int = 32  # micro-batches per length-sorted bucket (larger = less padding, coarser shuffling)
    num_workers: int = 2  # DataLoader processes reading + collating ahead of the GPU; 0 = in the training process
    # --- stream mode (train/stream.py, train/stream_producer.py)
    stream_window_steps: int = 8  # the window: the streamed features on disk (held-out shard included) at most this many optimizer steps' worth (the mean step: world_size x grad_accum x micro_batch_size records); the producer waits when it is full. It scales with the run: look-ahead to hide the engine's jitter, never the cache (8 steps of a 70B EAGLE-3 run on 8 ranks x 2 x 2 records of 2k tokens are ~25 GB; of the default target, 1 rank, ~1.7 MB)
    stream_window_mb: float = 0.0  # optional cap on that window (MiB); 0 = no cap
    stream_producer: str = "hf"  # hf = the recipe's target under transformers, in a process rank 0 starts; vllm = that process starts a vLLM capture server (data.engine_python) and captures as data.feature_source=vllm (train/stream_capture.py)
    stream_producers: int = 1  # producer processes rank 0 starts (each its own target copy / vLLM server, on data.device): shard k of the order is producer k mod N's, written in the order's sequence, so the head is the same bit for bit; scale it when the producer is the bottleneck
    stream_epochs: str = "recapture"  # recapture = every epoch is captured again (the window stays bounded) | keep = epoch 1 is kept and re-read (a whole cache on disk)
    stream_timeout_s: float = 120.0  # a producer silent this long (no heartbeat) is dead: one error line
    stream_dir: str = ""  # where the window lives; "" = {output_dir}/train/stream (a filesystem every rank sees)
    # --- schedule
    epochs: float = 20.0
    max_steps: int = 0  # optimizer steps; 0 = derived from epochs
    micro_batch_size: int = 2  # sequences per rank per forward
    grad_accum: int = 2
    sequence_parallel_size: int = 1  # n > 1: each record split over n ranks (DeepSpeed Ulysses, train/sequence_parallel.py): micro_batch_size 1, EAGLE-3 / P-EAGLE, heads and world size divisible by n; 1 = off
    # --- optimiser (AdamW) and LR schedule: warmup, then decay to 0 at the last step
    lr: float = 5e-5
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.0
    warmup_steps: int = 2000  # capped at the total number of steps
    schedule: str = "linear"  # linear (WarmupDecayLR) | cosine (WarmupCosineLR) | constant (WarmupLR)
    grad_clip: float = 0.5  # 0 = off
    # --- DeepSpeed
    precision: str = "fp16"  # fp16 (dynamic loss scaling) | bf16 | fp32; DeepSpeed on CPU supports bf16 and fp32 only
    zero_stage: int = 2  # 0..3
    offload_optimizer: bool = False  # ZeRO optimizer state on CPU (DeepSpeedCPUAdam)
    deepspeed: dict[str, Any] = field(default_factory=dict)  # extra DeepSpeed config keys (not batch/lr/optimizer/precision)
    # --- loss
    feature_weight: float = 1.0  # SmoothL1 between predicted and true next feature
    token_weight: float = 0.1  # soft CE: target distribution vs head distribution through the frozen lm_head
    noise: str = "uniform"  # input-feature noise: uniform U(-std/2, std/2) | gaussian N(0, std^2) | none
    noise_std: float = 0.2
    loss_chunk: int = 256  # token loss over this many loss positions at a time ([chunk, V] logits instead of [N, V]; same value and gradient); 0 = all at once
    # --- evaluation (every eval_every steps and at the end)
    eval_every: int = 0  # optimizer steps; 0 = at the end of every epoch
    rollout_steps: int = 5  # self-fed draft steps simulated per start position
    rollout_starts: int = 16  # chain starts sampled per eval record; 0 = every position (cost ~ starts x length x steps)
    # live tau: at every eval, rank 0 decodes this many eval records' prompts with the recipe's `decoding` tree and
    # logs eval/live_tau (+ live_alpha_d); offline mode then loads the full target once
    live_tau_prompts: int = 0  # >0: real EAGLE decoding of this many held-out prompts at every eval (eval/live_tau)
    live_tau_max_new_tokens: int = 64  # new tokens per live-tau prompt
    # --- checkpoints and robustness
    checkpoint_every: int = 1000  # optimizer steps; a checkpoint is also written at the end
    keep_last: int = 3  # checkpoints kept (older ones are deleted)
    resume: bool = True  # continue from the latest checkpoint in {output_dir}/train/checkpoints when there is one
    max_bad_steps: int = 10  # abort after this many non-finite losses in a row (each one is skipped with a warning)
    max_loss_ratio: float = 10.0  # divergence: stop when a loss exceeds this x the median of the recent ones; 0 = off
    stop_after: int = 0  # stop after this optimizer step as if interrupted (time-boxed jobs); 0 = run to the end
    device: str = "auto"  # auto = cuda:LOCAL_RANK when available, else cpu
    check_memory: bool = True  # refuse to start a run the plan (train/plan.py) says does not fit in memory at the data's longest records; false = start anyway
    # --- more than one node
    collective_timeout_s: float = 1800.0  # a collective waiting longer than this for a peer (a lost or hung node) fails the run with one line naming the lost ranks
    shared_filesystem: bool = True  # output_dir is one filesystem seen by every node (global rank 0 writes run files); false = per-node local disks: each node's local rank 0 writes its own copy of the checkpoints' shared files and `latest`


@dataclass
class LoggingSettings:
    backend: str = "tensorboard"  # tensorboard | wandb | none; several with commas ("tensorboard,wandb")
    project: str = "eagle2-heads"  # wandb project
    run_name: str = "${name}"
    log_every: int = 10  # optimizer steps between training-metric logs
    progress: bool = True  # tqdm progress bar on rank 0


@dataclass
class ExportSettings:
    dir: str = ""  # exported head folder; "" = {output_dir}/head
    dtype: str = "float16"  # weights dtype of the exported head (the released heads are fp16)
    legacy_bin: bool = False  # also write pytorch_model.bin (older loaders)
    push_to_hub: bool = False  # push after training (rank 0); also: python -m train.hub --recipe ...
    repo_id: str = ""  # Hub repo, e.g. "me/EAGLE2-llama3-8b"
    private: bool = True
    token_env: str = "HF_TOKEN"  # environment variable holding the Hub token
    license: str = "apache-2.0"  # model card license tag
    commit_message: str = "Upload EAGLE-2 draft head"


def validate_train_sections(cfg) -> None:
    """Check the values of the train/logging/export sections (keys are checked by the schema)."""
    t, lg, ex = cfg.train, cfg.logging, cfg.export
    check(t.mode in MODES, "train.mode", t.mode, f"expected one of {MODES}")
    check(t.stream_window_steps >= 1, "train.stream_window_steps", t.stream_window_steps, "expected >= 1 optimizer step")
    check(math.isfinite(t.stream_window_mb) and t.stream_window_mb >= 0, "train.stream_window_mb", t.stream_window_mb,
          "expected 0 (no cap) or a cap > 0 in MiB")
    check(t.stream_producer in STREAM_PRODUCERS, "train.stream_producer", t.stream_producer, f"expected one of {STREAM_PRODUCERS}")
    check(t.stream_producers >= 1, "train.stream_producers", t.stream_producers, "expected >= 1 producer process")
    check(t.stream_epochs in STREAM_EPOCHS, "train.stream_epochs", t.stream_epochs, f"expected one of {STREAM_EPOCHS}")
    check(t.stream_timeout_s > 0, "train.stream_timeout_s", t.stream_timeout_s, "expected > 0 seconds")
    check(t.verify_cache in ("sha256", "size"), "train.verify_cache", t.verify_cache, "expected 'sha256' or 'size'")
    check(t.batching in BATCHING, "train.batching", t.batching, f"expected one of {BATCHING}")
    check(t.long_records in LONG_RECORDS, "train.long_records", t.long_records, f"expected one of {LONG_RECORDS}")
    check(t.precision in PRECISIONS, "train.precision", t.precision, f"expected one of {PRECISIONS}")
    check(t.schedule in SCHEDULES, "train.schedule", t.schedule, f"expected one of {SCHEDULES}")
    check(t.noise in NOISES, "train.noise", t.noise, f"expected one of {NOISES}")
    check(0 <= t.zero_stage <= 3, "train.zero_stage", t.zero_stage, "expected 0, 1, 2 or 3")
    check(0.0 <= t.eval_fraction < 1.0, "train.eval_fraction", t.eval_fraction, "expected 0 <= fraction < 1")
    check(t.epochs > 0 or t.max_steps > 0, "train.epochs", t.epochs, "need epochs > 0 or max_steps > 0")
    for key in ("micro_batch_size", "grad_accum", "sequence_parallel_size", "group_size", "checkpoint_every",
                "keep_last", "rollout_steps", "max_bad_steps"):
        check(t[key] >= 1, f"train.{key}", t[key], "expected >= 1")
    for key in ("max_steps", "warmup_steps", "eval_every", "rollout_starts", "eval_max_records", "stop_after", "num_workers",
                "live_tau_prompts", "loss_chunk"):
        check(t[key] >= 0, f"train.{key}", t[key], "expected >= 0")
    check(t.sequence_parallel_size == 1 or t.micro_batch_size == 1, "train.micro_batch_size", t.micro_batch_size,
          f"expected 1 with train.sequence_parallel_size={t.sequence_parallel_size} (one record split over the ranks)")
    check(t.live_tau_max_new_tokens >= 1, "train.live_tau_max_new_tokens", t.live_tau_max_new_tokens, "expected >= 1")
    check(math.isfinite(t.lr) and t.lr > 0, "train.lr", t.lr, "expected a finite number > 0")
    check(math.isfinite(t.eps) and t.eps > 0, "train.eps", t.eps, "expected a finite number > 0")
    check(math.isfinite(t.epochs) and t.epochs >= 0, "train.epochs", t.epochs, "expected a finite number >= 0")
    check(math.isfinite(t.max_loss_ratio) and (t.max_loss_ratio == 0 or t.max_loss_ratio > 1), "train.max_loss_ratio",
          t.max_loss_ratio, "expected 0 (off) or a number > 1")
    check(t.device == "auto" or t.device == "cpu" or str(t.device).startswith("cuda"), "train.device", t.device,
          "expected auto, cpu or cuda[:N]")
    check(math.isfinite(t.collective_timeout_s) and t.collective_timeout_s > 0, "train.collective_timeout_s",
          t.collective_timeout_s, "expected a number of seconds > 0")
    check(len(t.betas) == 2 and all(0 <= b < 1 for b in t.betas), "train.betas", list(t.betas), "expected [b1, b2] in [0, 1)")
    for key in ("weight_decay", "grad_clip", "feature_weight", "token_weight", "noise_std"):
        check(math.isfinite(t[key]) and t[key] >= 0, f"train.{key}", t[key], "expected a finite number >= 0")
    check(t.feature_weight + t.token_weight > 0, "train.feature_weight", t.feature_weight,
          "feature_weight and token_weight cannot both be 0")
    reserved = {"train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "optimizer",
                "scheduler", "fp16", "bf16", "gradient_clipping"}
    clash = sorted(reserved & set(t.deepspeed.keys()))
    check(not clash, "train.deepspeed", clash, "these DeepSpeed keys are generated from the train.* settings; set those instead")
    backends = [b.strip() for b in lg.backend.split(",") if b.strip()]
    check(bool(backends) and all(b in LOG_BACKENDS for b in backends), "logging.backend", lg.backend,
          f"expected one or more (comma-separated) of {LOG_BACKENDS}")
    check(lg.log_every >= 1, "logging.log_every", lg.log_every, "expected >= 1")
    check(ex.dtype in EXPORT_DTYPES, "export.dtype", ex.dtype, f"expected one of {EXPORT_DTYPES}")
    check(not ex.push_to_hub or bool(ex.repo_id), "export.repo_id", ex.repo_id, "required when export.push_to_hub is true")
