"""Training checkpoints: DeepSpeed engine state (weights, optimizer, LR scheduler) + the trainer's own state
(step, data position, counters) + every rank's RNG state, under {output_dir}/train/checkpoints/step-NNNNNNNN.
Resuming from one replays the run exactly: same weights as a run that was never interrupted.

Loading never runs code from a file: DeepSpeed's own loader unpickles with `weights_only=False`, so resume
swaps in `weights_only_load` (torch's weights-only unpickler with an allow-list of the few DeepSpeed classes
its checkpoints hold, `SAFE_GLOBALS`); a checkpoint holding anything else is refused, naming the file."""
from __future__ import annotations

import json
import os
import pickle
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from eagle.cli_errors import UserError
from eagle.head_kinds import head_kind
from train.distributed import barrier

TAG_PREFIX = "step-"
TAG_PATTERN = re.compile(r"step-\d{8}")
HEAD_FILE = "head.json"  # in each checkpoint folder: the kind and tensor shapes of the head it holds


class CheckpointError(UserError, RuntimeError):
    """A training checkpoint is unreadable, incomplete, or holds something the weights-only loader refuses."""


def safe_globals() -> list:
    """The non-tensor classes DeepSpeed writes into its checkpoints (ZeRO 0-3, fp32/bf16/fp16): plain data."""
    # lazy: deepspeed costs a second at import and prints its accelerator line on stdout; only a resume needs these
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def weights_only_load(path, map_location=None):
    """torch.load with the weights-only unpickler and `safe_globals()`; errors name the file."""
    try:
        with torch.serialization.safe_globals(safe_globals()):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()
        detail = next((ln for ln in first if "GLOBAL" in ln or "Unsupported" in ln), first[0] if first else "")
        raise CheckpointError(f"checkpoint file {path} holds objects the weights-only loader refuses "
                              f"({' '.join(detail.split())[:200]}); not loading it (train.resume=false starts fresh)") from None
    except (RuntimeError, EOFError, OSError) as e:
        raise CheckpointError(f"checkpoint file {path} is unreadable ({' '.join(str(e).split())[:200]}); delete its folder "
                              "and rerun to resume from the previous checkpoint, or set train.resume=false") from None


def head_signature(module) -> dict:
    """The head a checkpoint holds, as resume compares it: its kind and every tensor's full shape (ZeRO-3 keeps a
    partitioned parameter's full shape in `ds_shape`)."""
    tensors = [*module.named_parameters(), *module.named_buffers()]
    return {"kind": module.kind.name,
            "shapes": {n: list(getattr(t, "ds_shape", None) or t.shape) for n, t in tensors}}


def describe_head(sig: dict) -> str:
    return f"an {head_kind(sig['kind']).title} head (kind {sig['kind']})"


def check_checkpoint_head(ckpt: Path, module, config_name: str) -> None:
    """CheckpointError (one line naming both heads and the way out) when checkpoint `ckpt` holds another head kind or
    other shapes than this run's `module` (a rerun of the run folder with another recipe); checkpoints written before
    the file existed are checked by the loader's own error (`load_checkpoint`)."""
    f = Path(ckpt) / HEAD_FILE
    if not f.exists():
        return
    try:
        saved = json.loads(f.read_text())
        saved_kind = saved["kind"]
        head_kind(saved_kind)
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"checkpoint {ckpt}: {f.name} is damaged ({' '.join(str(e).split())[:120]}); delete "
                              "the checkpoint folder to resume from an earlier one") from None
    mine = head_signature(module)
    if saved == mine:
        return
    way_out = (f"resume needs the same head: use a new output_dir for this recipe, or delete {Path(ckpt).parent} "
               "to start this run over")
    if saved_kind != mine["kind"]:
        raise CheckpointError(f"checkpoint {ckpt} holds {describe_head(saved)}, but this run ({config_name}) builds "
                              f"{describe_head(mine)}: {way_out}")
    a, b = saved.get("shapes", {}), mine["shapes"]
    diff = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
    shapes = ", ".join(f"{k} {a.get(k)} vs {b.get(k)}" for k in diff[:3])
    raise CheckpointError(f"checkpoint {ckpt} holds {describe_head(saved)} of other shapes than this run's "
                          f"({config_name}): {shapes} (checkpoint vs this run): {way_out}")


def tag_for(step: int) -> str:
    return f"{TAG_PREFIX}{step:08d}"


def rng_state() -> dict:
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": {"keys": torch.from_numpy(np_state[1].astype(np.int64)), "pos": int(np_state[2]),
                  "has_gauss": int(np_state[3]), "gauss": float(np_state[4])},
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state(("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def latest_tag(root: Path) -> str | None:
    """Tag of the newest complete checkpoint (DeepSpeed's `latest` file), or None."""
    latest = root / "latest"
    if not latest.exists():
        return None
    tag = latest.read_text().strip()
    if not TAG_PATTERN.fullmatch(tag):
        raise CheckpointError(f"{latest} names {tag[:80]!r}, not a checkpoint of this trainer (step-NNNNNNNN)")
    if not (root / tag).is_dir():
        raise FileNotFoundError(f"{latest} names checkpoint {tag!r}, but {root / tag} does not exist")
    return tag


def save_checkpoint(engine, root: Path, step: int, trainer_state: dict, keep_last: int, rank: int,
                    commit: bool = True) -> str:
    """Save everything needed to resume at `step`. Collective. With commit=False `latest` is not moved yet: the
    trainer commits the checkpoint (`commit_checkpoint`) once the next loss shows its weights did not diverge."""
    tag = tag_for(step)
    try:
        (root / tag).mkdir(parents=True, exist_ok=True)
        # RNG first: DeepSpeed writes `latest` last, so a checkpoint it names is always complete
        torch.save(rng_state(), root / tag / f"rng_rank{rank:05d}.pt")
        if rank == 0:
            (root / tag / HEAD_FILE).write_text(json.dumps(head_signature(engine.module)) + "\n")
        barrier()
        engine.save_checkpoint(str(root), tag=tag, client_state={"trainer_state": trainer_state}, save_latest=False)
    except (OSError, RuntimeError) as e:  # torch.save reports a full disk as a RuntimeError
        good = latest_tag(root)
        if good != tag:
            shutil.rmtree(root / tag, ignore_errors=True)  # never leave a half-written folder behind
        free = shutil.disk_usage(root).free
        raise CheckpointError(f"could not write checkpoint {root / tag} ({' '.join(str(e).split())[:160]}; "
                              f"{free:,} bytes free); `latest` still names {good}: free space and rerun to resume") from None
    barrier()
    if commit:
        commit_checkpoint(root, tag, keep_last, rank)
    return tag


def commit_checkpoint(root: Path, tag: str, keep_last: int, rank: int) -> None:
    """Point `latest` at the complete checkpoint `tag` (atomically) and keep the newest `keep_last`. Collective."""
    if rank == 0:
        tmp = root / f"latest.tmp{os.getpid()}"
        tmp.write_text(tag)
        os.replace(tmp, root / "latest")
        prune_checkpoints(root, keep_last)
    barrier()


def discard_uncommitted(root: Path, tag: str | None, rank: int) -> None:
    """Delete a checkpoint saved but never committed (the run diverged before its weights were confirmed)."""
    if tag is not None and rank == 0 and latest_tag(root) != tag:
        shutil.rmtree(root / tag, ignore_errors=True)


def prune_checkpoints(root: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` step-* folders (never the one `latest` names)."""
    tags = sorted(p for p in root.glob(f"{TAG_PREFIX}*") if p.is_dir())
    current = latest_tag(root)
    removed = []
    for p in tags[:-keep_last] if keep_last > 0 else []:
        if p.name != current:
            shutil.rmtree(p)
            removed.append(p)
    return removed


def load_checkpoint(engine, root: Path, tag: str, rank: int) -> dict:
    """Restore engine + RNG from `tag`; returns the trainer state saved with it."""
    rng_file = root / tag / f"rng_rank{rank:05d}.pt"
    if not rng_file.exists():
        raise FileNotFoundError(
            f"checkpoint {root / tag} has no {rng_file.name}: it was written by a run with fewer ranks; "
            "resume with the same number of processes"
        )
    engine.checkpoint_engine.load = weights_only_load  # DeepSpeed's own load unpickles with weights_only=False
    try:
        path, client = engine.load_checkpoint(str(root), tag=tag, load_optimizer_states=True,
                                              load_lr_scheduler_states=True)
    except RuntimeError as e:  # an older checkpoint (no head.json) of another head: torch's state-dict mismatch
        if "state_dict" not in str(e) and "size mismatch" not in str(e):
            raise
        first = next((ln.strip() for ln in str(e).splitlines() if "size mismatch" in ln or "Missing key" in ln
                      or "Unexpected key" in ln), str(e).splitlines()[0])
        raise CheckpointError(f"checkpoint {root / tag} holds another head than this run builds ({first[:200]}): "
                              f"resume needs the same head: use a new output_dir for this recipe, or delete {root} "
                              "to start this run over") from None
    if path is None or "trainer_state" not in (client or {}):
        raise CheckpointError(f"could not load checkpoint {root / tag} (DeepSpeed returned {path!r})")
    set_rng_state(weights_only_load(rng_file))
    return client["trainer_state"]
