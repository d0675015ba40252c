"""Training checkpoints: DeepSpeed engine state (weights, optimizer, LR scheduler) + the trainer's own state
(step, data position, counters) + every rank's RNG state, under {output_dir}/train/checkpoints/step-NNNNNNNN.
Resuming from one replays the run exactly: same weights as a run that was never interrupted.

Loading never runs code from a file: DeepSpeed's own loader unpickles with `weights_only=False`, so resume
swaps in `weights_only_load` (torch's weights-only unpickler with an allow-list of the few DeepSpeed classes
its checkpoints hold, `SAFE_GLOBALS`); a checkpoint holding anything else is refused, naming the file."""
from __future__ import annotations

import argparse
import contextlib
import io
import os
import pickle
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from eagle.cli_errors import UserError
from eagle.atomic_file import FileWriteError
from eagle.head_kinds import DEFAULT_KIND, HEAD_KINDS, head_kind
from eagle.state_files import (StateFile, pattern_check, read_json_state, read_text_state, register, write_json_state,
                               write_text_state)
from train.distributed import barrier, collective_failed, import_deepspeed

TAG_PREFIX = "step-"
TAG_PATTERN = re.compile(r"step-\d{8}")
_TORCH_LOAD = torch.load  # the real one: `weights_only_torch_load` swaps torch.load for `weights_only_load` for a while
HEAD_FILE = "head.json"  # in each checkpoint folder: the kind and tensor shapes of the head it holds
_EARLIER = ("delete that checkpoint folder to resume from the one before it (and point train/checkpoints/latest at "
            "it), or set train.resume=false to start over")
HEAD_STATE = register(StateFile(
    HEAD_FILE, "OUTPUT_DIR/train/checkpoints/TAG", writer="train/checkpoint.py",
    schema={"kind": str, "shapes": {"*": [int]}}, rebuild=_EARLIER,
    when_missing="a checkpoint written before the file existed: the loader's own error checks the head",
    check=lambda d: None if d["kind"] in HEAD_KINDS else f"kind {d['kind']!r} is not a head kind of this project "
                                                         f"({', '.join(HEAD_KINDS)})",
    example={"kind": DEFAULT_KIND.name, "shapes": {"fc.weight": [8, 16]}}))


class CheckpointError(UserError, RuntimeError):
    """A training checkpoint is unreadable, incomplete, or holds something the weights-only loader refuses."""


def safe_globals() -> list:
    """The non-tensor classes DeepSpeed writes into its checkpoints (ZeRO 0-3, fp32/bf16/fp16): plain data."""
    import_deepspeed()  # its log lines to stderr
    # lazy: deepspeed costs a second at import; only a resume needs these
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def weights_only_load(path, map_location=None):
    """torch.load with the weights-only unpickler and `safe_globals()`; errors name the file."""
    try:
        with torch.serialization.safe_globals(safe_globals()):
            return _TORCH_LOAD(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()
        detail = next((ln for ln in first if "GLOBAL" in ln or "Unsupported" in ln), first[0] if first else "")
        raise CheckpointError(f"checkpoint file {path} holds objects the weights-only loader refuses "
                              f"({' '.join(detail.split())[:200]}); not loading it (train.resume=false starts fresh)") from None
    except (RuntimeError, EOFError, OSError) as e:
        raise CheckpointError(f"checkpoint file {path} is unreadable ({' '.join(str(e).split())[:200]}); delete its folder "
                              "and rerun to resume from the previous checkpoint, or set train.resume=false") from None


@contextlib.contextmanager
def weights_only_torch_load():
    """Inside: every `torch.load` (DeepSpeed's universal-checkpoint converter and loader call it with
    weights_only=False) goes through `weights_only_load`."""
    torch.load = lambda f, map_location=None, **_: weights_only_load(f, map_location)
    try:
        yield
    finally:
        torch.load = _TORCH_LOAD


RANKS_FILE = "ranks.json"  # {"world_size": N, "zero_stage": S}: how a checkpoint was written (each node's copy has one)
RANKS_STATE = register(StateFile(
    RANKS_FILE, "OUTPUT_DIR/train/checkpoints/TAG", writer="train/checkpoint.py",
    schema={"world_size": int, "zero_stage?": int}, rebuild=_EARLIER,
    when_missing="a checkpoint written before the file existed: its rng_rank files are counted",
    check=lambda d: f"world_size {d['world_size']} is not >= 1" if d["world_size"] < 1 else
    f"zero_stage {d['zero_stage']} is not a ZeRO stage (0-3)" if d.get("zero_stage", 0) not in range(4) else None,
    example={"world_size": 2, "zero_stage": 1}))
LATEST_STATE = register(StateFile(
    "latest", "OUTPUT_DIR/train/checkpoints", writer="train/checkpoint.py", format="text", schema=str,
    check=pattern_check(TAG_PATTERN.pattern, "a checkpoint tag step-NNNNNNNN"),
    rebuild="write the newest complete checkpoint's tag into it (e.g. step-00000020: the folder beside it), or "
            "delete it to start training over",
    when_missing="no checkpoint committed yet: training starts fresh", example="step-00000020"))


def saved_world_size(folder: Path) -> int:
    """How many ranks wrote the checkpoint in `folder` (ranks.json; older checkpoints: their rng_rank files)."""
    saved = read_json_state(folder / RANKS_FILE, RANKS_STATE)
    return len(list(folder.glob("rng_rank*.pt"))) if saved is None else saved["world_size"]


def saved_zero_stage(folder: Path) -> int:
    """The ZeRO stage the checkpoint in `folder` was written under (ranks.json; checkpoints written before it held the
    stage: DeepSpeed's file names, which tell 0 (no optimizer partitions), 1-2 (optimizer partitions) and 3 (model
    partitions too) apart)."""
    saved = read_json_state(folder / RANKS_FILE, RANKS_STATE)
    if saved is not None and "zero_stage" in saved:
        return saved["zero_stage"]
    if any(folder.glob("zero_pp_rank_*_model_states.pt")):
        return 3
    return 1 if any(folder.glob("*zero_pp_rank_*_optim_states.pt")) else 0


def needs_universal(saved_stage: int, saved_world: int, world: int) -> bool:
    """Whether a checkpoint written by `saved_world` ranks under ZeRO `saved_stage` must go through DeepSpeed's
    universal checkpoint to load on `world` ranks (under the same stage, or 1 <-> 2: `stage_change_error`). Stage 0
    keeps the whole optimizer state in one file (mp_rank_00_model_states.pt) that loads on any number of ranks as it
    is; ZeRO 1-3 partition it per rank, so another number of ranks needs the conversion."""
    return saved_stage != 0 and saved_world != world


def stage_change_error(ckpt: Path, saved_stage: int, stage: int) -> CheckpointError | None:
    """The one-line refusal of a resume under another ZeRO stage than the checkpoint's, except between 1 and 2 (the
    same files: DeepSpeed loads either into the other, measured bit-exact). Stage 0 keeps the optimizer state whole in
    one file, which DeepSpeed's universal checkpoint neither reads nor loads into a stage-0 engine; stage 3 partitions
    the weights too, and DeepSpeed 0.19's universal loader fails (an AssertionError) between it and stages 1-2.
    None when the stages fit."""
    if saved_stage == stage or {saved_stage, stage} <= {1, 2}:
        return None
    why = ("stage 0 keeps the whole optimizer state in one file, ZeRO partitions it per rank" if 0 in (saved_stage, stage)
           else "stage 3 partitions the weights as well, and DeepSpeed's universal checkpoint does not load across it")
    return CheckpointError(f"checkpoint {ckpt} was written under train.zero_stage={saved_stage}, this run has "
                           f"train.zero_stage={stage}: DeepSpeed moves optimizer state only between ZeRO stages 1 and "
                           f"2 ({why}); resume with train.zero_stage={saved_stage} (on any number of ranks), or set "
                           "train.resume=false to start over")


def expected_files(saved_stage: int, ranks) -> list[tuple[str, ...]]:
    """The files of a checkpoint written under ZeRO `saved_stage` that the given `ranks` of it hold, each as the
    names it may have (the first is the one named when it is missing): the model (and, stage 0, the whole optimizer)
    states; ZeRO 1-3: each rank's optimizer partition (plain or bf16_ prefixed, `optim_file_names`); stage 3: each
    rank's model partition instead of one model file."""
    names = [] if saved_stage == 3 else [("mp_rank_00_model_states.pt",)]
    for r in ranks:
        if saved_stage == 3:
            names.append((f"zero_pp_rank_{r}_mp_rank_00_model_states.pt",))
        if saved_stage >= 1:
            names.append(optim_file_names(r))
    return names


def optim_file_names(rank: int) -> tuple[str, str]:
    """The names DeepSpeed gives rank `rank`'s optimizer partition (fp32/fp16 training, bf16 training)."""
    return f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt", f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def previous_tag(root: Path, tag: str) -> str | None:
    """The newest checkpoint folder older than `tag` (train.keep_last keeps some), or None."""
    older = sorted(p.name for p in root.glob(f"{TAG_PREFIX}*") if p.is_dir() and TAG_PATTERN.fullmatch(p.name)
                   and p.name < tag)
    return older[-1] if older else None


def way_back(root: Path, tag: str) -> str:
    """What to do when checkpoint `tag` cannot be resumed: go back to the previous one (by hand: `latest` names the
    folder to resume from), or start over."""
    prev = previous_tag(root, tag)
    back = (f"to resume from the previous checkpoint run `rm -r {root / tag} && echo {prev} > {root / 'latest'}`, or "
            if prev else "")
    return f"{back}set train.resume=false to start over"


def check_complete(root: Path, tag: str, saved_stage: int, ranks) -> None:
    """CheckpointError (one line: the checkpoint, the missing files, what to do) when checkpoint `tag` lacks a file
    the given `ranks` of it must hold (`expected_files`), before DeepSpeed reads it: its own loader would stop
    halfway through, or silently restore only the weights when an optimizer partition is missing."""
    folder = root / tag
    missing = [names[0] for names in expected_files(saved_stage, ranks)
               if not any((folder / n).is_file() for n in names)]
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise CheckpointError(f"checkpoint {folder} is incomplete: {shown} missing (written by "
                              f"{ranks_text(saved_world_size(folder))} under train.zero_stage={saved_stage}); "
                              + way_back(root, tag))


def ranks_text(n: int) -> str:
    return f"{n} rank{'' if n == 1 else 's'}"


def resume_failed(root: Path, tag: str, exc: BaseException, what: str, world: int, stage: int) -> CheckpointError:
    """One line for a DeepSpeed failure while resuming checkpoint `tag` on `world` ranks under ZeRO `stage`: the
    checkpoint, what failed (DeepSpeed's own sentence, shortened), how it was written, what to do (rerun as it was
    written when this run differs; else go back to the previous checkpoint or start over)."""
    detail = " ".join(str(exc).split())[:200] or type(exc).__name__
    saved_world, saved_stage = saved_world_size(root / tag), saved_zero_stage(root / tag)
    written = f"written by {ranks_text(saved_world)} under train.zero_stage={saved_stage}"
    same = "rerun with that many ranks and that stage, or " if (saved_world, saved_stage) != (world, stage) else ""
    return CheckpointError(f"could not resume checkpoint {root / tag} ({what}: {type(exc).__name__}: {detail}); it was "
                           f"{written}, this run has {ranks_text(world)} under train.zero_stage={stage}: {same}"
                           + way_back(root, tag))


def universal_dir(root: Path) -> Path:
    """Where DeepSpeed universal copies of checkpoints go (one folder per tag, pruned with their checkpoint)."""
    return root / "universal"


def make_universal(root: Path, tag: str, rank: int, world: int, stage: int) -> Path:
    """A DeepSpeed universal checkpoint of `tag` (every parameter's fp32 weights and AdamW moments whole, loadable
    on any number of ranks under any ZeRO stage 1-3), made once by rank 0 with DeepSpeed's own converter
    (`ds_to_universal`) into `universal_dir(root)/tag` for this run's `world` ranks under ZeRO `stage`; other ranks do
    nothing. Not collective: the caller makes
    the ranks agree on the outcome before any of them loads. Returns the folder to load `tag` from."""
    out = universal_dir(root) / tag
    done = out / "complete"
    if rank == 0 and not done.exists():
        # lazy: deepspeed costs a second at import; only a resume on another number of ranks converts
        from deepspeed.checkpoint import ds_to_universal

        saved_world, saved_stage = saved_world_size(root / tag), saved_zero_stage(root / tag)
        check_complete(root, tag, saved_stage, range(saved_world))  # the converter reads every rank's files
        shutil.rmtree(out, ignore_errors=True)  # an interrupted conversion starts over
        args = argparse.Namespace(input_folder=str(root / tag), output_folder=str(out), num_extract_workers=1,
                                  num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
        try:
            # its prints and progress bars (tqdm, on stderr) would sit beside a failed resume's one `error:` line
            with weights_only_torch_load(), contextlib.redirect_stdout(io.StringIO()), \
                    contextlib.redirect_stderr(io.StringIO()):
                ds_to_universal.main(args)
        except UserError:
            shutil.rmtree(out, ignore_errors=True)
            raise
        except Exception as e:  # noqa: BLE001 - any failure of DeepSpeed's converter: one line naming the checkpoint
            shutil.rmtree(out, ignore_errors=True)
            raise resume_failed(root, tag, e, "DeepSpeed's ds_to_universal could not convert it for another number "
                                "of ranks", world, stage) from e
        for name in os.listdir(root / tag):  # our per-rank RNG files ride along (ranks that have none reseed)
            if name.startswith("rng_rank"):
                shutil.copy2(root / tag / name, out / name)
        done.write_text(tag)
    return universal_dir(root)


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
    saved = read_json_state(Path(ckpt) / HEAD_FILE, HEAD_STATE)
    if saved is None:
        return
    saved_kind = saved["kind"]
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
    latest = root / LATEST_STATE.name
    tag = read_text_state(latest, LATEST_STATE)
    if tag is None:
        return None
    if not (root / tag).is_dir():
        raise FileNotFoundError(f"{latest} names checkpoint {tag!r}, but {root / tag} does not exist")
    return tag


def save_checkpoint(engine, root: Path, step: int, trainer_state: dict, keep_last: int, rank: int,
                    commit: bool = True, writer: bool | None = None, world_size: int = 1) -> str:
    """Save everything needed to resume at `step`. Collective. With commit=False `latest` is not moved yet: the
    trainer commits the checkpoint (`commit_checkpoint`) once the next loss shows its weights did not diverge.
    `writer`: this rank writes the checkpoint's shared files (default rank 0; on per-node disks each node's local
    rank 0, `train.shared_filesystem=false`)."""
    tag = tag_for(step)
    writer = rank == 0 if writer is None else writer
    try:
        (root / tag).mkdir(parents=True, exist_ok=True)
        # RNG first: DeepSpeed writes `latest` last, so a checkpoint it names is always complete
        torch.save(rng_state(), root / tag / f"rng_rank{rank:05d}.pt")
        if writer:
            # a universal copy of an earlier checkpoint of this step (a rerun after a rollback) is not this one's
            shutil.rmtree(universal_dir(root) / tag, ignore_errors=True)
            layout = {"world_size": world_size, "zero_stage": int(engine.zero_optimization_stage())}
            write_json_state(root / tag / RANKS_FILE, layout, RANKS_STATE, indent=None)
            write_json_state(root / tag / HEAD_FILE, head_signature(engine.module), HEAD_STATE, indent=None)
        barrier()
        engine.save_checkpoint(str(root), tag=tag, client_state={"trainer_state": trainer_state}, save_latest=False)
    except (OSError, RuntimeError, FileWriteError) as e:  # torch.save reports a full disk as a RuntimeError
        good = latest_tag(root)
        if good != tag:
            shutil.rmtree(root / tag, ignore_errors=True)  # never leave a half-written folder behind
        free = shutil.disk_usage(root).free
        raise CheckpointError(f"could not write checkpoint {root / tag} ({' '.join(str(e).split())[:160]}; "
                              f"{free:,} bytes free); `latest` still names {good}: free space and rerun to resume") from None
    barrier()
    if commit:
        commit_checkpoint(root, tag, keep_last, rank, writer)
    return tag


def commit_checkpoint(root: Path, tag: str, keep_last: int, rank: int, writer: bool | None = None) -> None:
    """Point `latest` at the complete checkpoint `tag` (atomically) and keep the newest `keep_last`. Collective;
    the writer(s) (`save_checkpoint`) do it."""
    if (rank == 0 if writer is None else writer):
        write_text_state(root / LATEST_STATE.name, tag, LATEST_STATE)
        prune_checkpoints(root, keep_last)
    barrier()


def discard_uncommitted(root: Path, tag: str | None, rank: int, writer: bool | None = None) -> None:
    """Delete a checkpoint saved but never committed (the run diverged before its weights were confirmed)."""
    if tag is not None and (rank == 0 if writer is None else writer) and latest_tag(root) != tag:
        shutil.rmtree(root / tag, ignore_errors=True)


def prune_checkpoints(root: Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` step-* folders (never the one `latest` names)."""
    tags = sorted(p for p in root.glob(f"{TAG_PREFIX}*") if p.is_dir())
    current = latest_tag(root)
    removed = []
    for p in tags[:-keep_last] if keep_last > 0 else []:
        if p.name != current:
            shutil.rmtree(p)
            shutil.rmtree(universal_dir(root) / p.name, ignore_errors=True)
            removed.append(p)
    return removed


def load_checkpoint(engine, root: Path, tag: str, rank: int, load_dir: Path | None = None) -> dict:
    """Restore engine + RNG from `tag` (from `load_dir`, e.g. its universal copy, when given); returns the trainer
    state saved with it. A rank the checkpoint has no RNG file for (it was written by fewer ranks) keeps its seeding:
    the trainer draws nothing from the global RNG that a resumed run must replay (input noise is keyed per micro-batch).
    Any failure inside DeepSpeed's loader is one line (`resume_failed`); a collective that fails (a lost rank) is
    left to the trainer's lost-rank report."""
    load_dir = load_dir or root
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    stage = int(engine.zero_optimization_stage())
    rng_file = load_dir / tag / f"rng_rank{rank:05d}.pt"
    engine.checkpoint_engine.load = weights_only_load  # DeepSpeed's own load unpickles with weights_only=False
    try:
        with weights_only_torch_load():  # the universal loader reads each parameter's files with torch.load
            path, client = engine.load_checkpoint(str(load_dir), tag=tag, load_optimizer_states=True,
                                                  load_lr_scheduler_states=True)
    except UserError:
        raise
    except RuntimeError as e:  # an older checkpoint (no head.json) of another head: torch's state-dict mismatch
        if collective_failed(e):
            raise
        if "state_dict" not in str(e) and "size mismatch" not in str(e):
            raise resume_failed(root, tag, e, "DeepSpeed's load_checkpoint failed", world, stage) from e
        first = next((ln.strip() for ln in str(e).splitlines() if "size mismatch" in ln or "Missing key" in ln
                      or "Unexpected key" in ln), str(e).splitlines()[0])
        raise CheckpointError(f"checkpoint {root / tag} holds another head than this run builds ({first[:200]}): "
                              f"resume needs the same head: use a new output_dir for this recipe, or delete {root} "
                              "to start this run over") from None
    except Exception as e:  # noqa: BLE001 - any other failure of DeepSpeed's loader: one line naming the checkpoint
        raise resume_failed(root, tag, e, "DeepSpeed's load_checkpoint failed", world, stage) from e
    if path is None or "trainer_state" not in (client or {}):
        raise CheckpointError(f"could not load checkpoint {load_dir / tag} (DeepSpeed returned {path!r}); "
                              + way_back(root, tag))
    if rng_file.exists():
        set_rng_state(weights_only_load(rng_file))
    return client["trainer_state"]
