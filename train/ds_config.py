"""The DeepSpeed config, generated from the recipe's `train` section (the only place lr / batch sizes live)."""
from __future__ import annotations

import copy

import torch
from omegaconf import OmegaConf

COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}  # train.precision -> torch


def _merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def deepspeed_config(train, total_steps: int, world_size: int, on_cpu: bool) -> dict:
    """DeepSpeed JSON config for `train` (TrainSettings) and a run of `total_steps` optimizer steps."""
    t = train
    if t.precision == "fp16" and on_cpu:
        raise ValueError("train.precision=fp16: DeepSpeed does not support fp16 on CPU; use bf16 or fp32")
    warmup = min(t.warmup_steps, total_steps)
    # DeepSpeed's schedulers need warmup_num_steps >= 1: no warmup = one "warmup" step that starts at the full lr
    start = 0.0 if warmup else 1.0  # fraction of lr at step 0
    warmup = max(warmup, 1)
    if t.schedule == "linear":
        scheduler = {"type": "WarmupDecayLR", "params": {
            "warmup_min_lr": start * t.lr, "warmup_max_lr": t.lr, "warmup_num_steps": warmup,
            "total_num_steps": max(total_steps, warmup + 1), "warmup_type": "linear"}}
    elif t.schedule == "cosine":
        scheduler = {"type": "WarmupCosineLR", "params": {
            "total_num_steps": max(total_steps, warmup + 1), "warmup_num_steps": warmup,
            "warmup_min_ratio": start, "cos_min_ratio": 0.0, "warmup_type": "linear"}}
    else:
        scheduler = {"type": "WarmupLR", "params": {
            "warmup_min_lr": start * t.lr, "warmup_max_lr": t.lr, "warmup_num_steps": warmup, "warmup_type": "linear"}}
    adam = {"lr": t.lr, "betas": list(t.betas), "eps": t.eps, "weight_decay": t.weight_decay}
    if on_cpu and not t.offload_optimizer:
        adam["torch_adam"] = True  # FusedAdam is a CUDA kernel
    zero: dict = {"stage": t.zero_stage}
    if t.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": not on_cpu}
    cfg = {
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": t.grad_accum,
        "train_batch_size": t.micro_batch_size * t.grad_accum * world_size,
        "gradient_clipping": t.grad_clip,
        "optimizer": {"type": "AdamW", "params": adam},
        "scheduler": scheduler,
        "zero_optimization": zero,
        "bf16": {"enabled": t.precision == "bf16"},
        "fp16": {"enabled": t.precision == "fp16", "loss_scale": 0, "initial_scale_power": 16,
                 "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1},
        "steps_per_print": 2**31 - 1,  # the trainer logs itself
        "wall_clock_breakdown": False,
    }
    extra = OmegaConf.to_container(t.deepspeed, resolve=True) if OmegaConf.is_config(t.deepspeed) else dict(t.deepspeed)
    return _merge(cfg, extra)
