"""Experiment tracking on rank 0: TensorBoard, Weights & Biases, or nothing; metrics.jsonl always.

wandb never blocks a run: WANDB_MODE (offline / disabled / online) is respected; without WANDB_MODE and
without credentials it runs offline (sync later with `wandb sync`), and init has a timeout.
"""
from __future__ import annotations

import json
import math
import netrc
import os
import sys
import time
import uuid
from pathlib import Path

from omegaconf import OmegaConf


def _wandb_mode() -> str:
    mode = os.environ.get("WANDB_MODE")
    if mode:
        return mode
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    try:
        auth = netrc.netrc().authenticators("api.wandb.ai")
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        auth = None
    if auth:
        return "online"
    print("[train] wandb: no WANDB_MODE and no credentials, logging offline (`wandb sync` later)", file=sys.stderr)
    return "offline"


class Tracker:
    """log(metrics, step) to the configured backends; close() at the end. A no-op on ranks > 0."""

    def __init__(self, cfg, log_dir: Path, enabled: bool, resumed_step: int = 0):
        self.enabled = enabled
        self.backends = [b.strip() for b in cfg.logging.backend.split(",") if b.strip() and b.strip() != "none"]
        self._tb = self._wandb = None
        self._jsonl = None
        if not enabled:
            return
        log_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(log_dir / "metrics.jsonl", "a")
        config = OmegaConf.to_container(cfg, resolve=True)
        if "tensorboard" in self.backends:
            # lazy: tensorboard costs seconds at import; only runs that log to it need it
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(log_dir / "tensorboard"), purge_step=resumed_step or None)
            self._tb.add_text("recipe", "```\n" + OmegaConf.to_yaml(cfg, resolve=True) + "\n```", 0)
        if "wandb" in self.backends:
            # lazy: wandb costs seconds at import (and may reach the network); only runs that log to it need it
            import wandb

            mode = _wandb_mode()
            self._wandb = wandb.init(
                project=cfg.logging.project, name=cfg.logging.run_name, config=config, dir=str(log_dir),
                mode=mode, resume="allow", id=_run_id(log_dir, cfg.logging.run_name),
                settings=wandb.Settings(init_timeout=60, silent=True),
            )

    def log(self, metrics: dict, step: int) -> None:
        if not self.enabled:
            return
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and math.isfinite(float(v))}
        self._jsonl.write(json.dumps({"step": step, "time": time.time(), **clean}) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for k, v in clean.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(clean, step=step)

    def close(self) -> None:
        if not self.enabled:
            return
        self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _run_id(log_dir: Path, name: str) -> str:
    """A wandb run id stored next to the logs, so a resumed training continues the same wandb run."""
    f = log_dir / "wandb_run_id"
    if f.exists():
        return f.read_text().strip()
    rid = f"{name}-{uuid.uuid4().hex[:8]}".replace("/", "-")
    f.write_text(rid)
    return rid
