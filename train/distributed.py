"""Process-group setup for every launcher: plain `python` (one rank), `torchrun`, `deepspeed` (incl.
`--hostfile` multi-node). CPU ranks use gloo, GPU ranks nccl.

A launched worker never outlives its launcher (`die_with_launcher`), and a collective that fails because a peer
is gone (a lost node) or does not answer within `train.collective_timeout_s` ends the run with one line naming
the lost ranks (`LostRankError`, found by `lost_ranks` through the rendezvous store)."""
from __future__ import annotations

import contextlib
import ctypes
import datetime
import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from eagle.cli_errors import UserError
from eagle.device import pick_device
from eagle.rank_errors import keep_store

PR_SET_PDEATHSIG = 1  # linux/prctl.h
LAUNCHER_POLL_S = 1.0  # how often a worker of DeepSpeed's per-node launcher checks that the `deepspeed` runner lives
SURVIVOR_WAIT_S = 5.0  # after a failed collective: how long survivors wait for each other to report in


class LostRankError(UserError, RuntimeError):
    """A collective failed: some rank (a node) died or stopped answering within the collective timeout."""


@dataclass
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _parent_of(pid: int) -> int | None:
    """The parent pid of `pid` (Linux /proc), None when `pid` is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        return ""


def die_with_launcher() -> bool:
    """Make this launched worker end (SIGKILL) as soon as its launcher dies, so an orphan never keeps training and
    holding the run lock. The kernel does it for the parent (torchrun's agent, DeepSpeed's per-node launch.py):
    `prctl(PR_SET_PDEATHSIG)`, immediate and free; under DeepSpeed's per-node launcher a watchdog thread also checks
    every LAUNCHER_POLL_S that the `deepspeed` runner above it still lives (a parent-death signal covers one level
    only, and DeepSpeed's launch.py sets none for itself). SIGKILL, not SIGTERM: nobody manages the worker any more,
    and what it writes is safe to cut (a checkpoint counts only once `latest` names it). Linux only; returns False
    elsewhere (nothing is armed)."""
    parent = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            return False
    except (OSError, AttributeError):  # not Linux
        return False
    if os.getppid() != parent or parent == 1:  # the launcher died before the signal was armed
        os.kill(os.getpid(), signal.SIGKILL)
    if "deepspeed.launcher.launch" in _cmdline(parent):
        runner = _parent_of(parent)

        def watch() -> None:
            while _parent_of(parent) == runner:  # launch.py is reparented (or gone) once the runner dies
                time.sleep(LAUNCHER_POLL_S)
            os.kill(os.getpid(), signal.SIGKILL)

        threading.Thread(target=watch, name="launcher-watch", daemon=True).start()
    return True


def import_deepspeed(accelerator: str | None = None):
    """`import deepspeed` with its log lines on stderr. DeepSpeed binds its logger's handler to sys.stdout at import
    and warns there ("Setting accelerator to CPU ..."): stdout is kept for what a command prints for machines
    (`train.plan --json`, `--print-config`). Every project import of deepspeed goes through here first.
    `accelerator`: the device a run has already chosen ("cpu"), given to DeepSpeed's detection at import (as
    DS_ACCELERATOR, for the import only: the environment is left as it was) so it does not warn that it fell back to
    the CPU, a second stderr line beside a refused launch's one `error:` line. A user's DS_ACCELERATOR wins."""
    if "deepspeed" not in sys.modules:
        told = accelerator is not None and "DS_ACCELERATOR" not in os.environ
        if told:
            os.environ["DS_ACCELERATOR"] = accelerator
        try:
            with contextlib.redirect_stdout(sys.stderr):  # the handler created during the import takes sys.stderr
                # lazy: deepspeed costs a second at import; only training, checkpoints and the plan's estimators need it
                import deepspeed  # noqa: F401
        finally:
            if told:
                del os.environ["DS_ACCELERATOR"]
    ds_logger = logging.getLogger("DeepSpeed")
    for h in ds_logger.handlers:  # imported before us (by a library or a test): move it too
        if isinstance(h, logging.StreamHandler) and h.stream in (sys.stdout, sys.__stdout__):
            h.stream = sys.stderr  # not setStream: it would flush the old stream, which may be closed
    if _scheduler_start_noise not in ds_logger.filters:
        ds_logger.addFilter(_scheduler_start_noise)
    return sys.modules["deepspeed"]


def _scheduler_start_noise(record: logging.LogRecord) -> bool:
    """Drop the warning DeepSpeed's own WarmupLR/WarmupDecayLR constructors log on every run (they call get_lr() before
    their first step: deepspeed/runtime/lr_schedules.py, 0.19.8): it says nothing about the run and, now that
    DeepSpeed's lines go to stderr, it would sit beside a command's one `error:` line."""
    return "Attempting to get learning rate from scheduler before it has started" not in record.getMessage()


def init_distributed(device: str = "auto", collective_timeout_s: float = 1800.0) -> DistContext:
    """Join (or create) the process group; idempotent, so several runs can share one process (tests). A collective
    that waits longer than `collective_timeout_s` for a peer fails (recipe `train.collective_timeout_s`)."""
    if "RANK" in os.environ and "LOCAL_RANK" in os.environ:  # started by a launcher (torchrun, deepspeed)
        die_with_launcher()
    if "RANK" not in os.environ:  # plain `python train/main.py`: a world of one on a free local port
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ["RANK"] = "0"
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    dev = pick_device(device, local_rank)
    deepspeed = import_deepspeed("cpu" if dev.type == "cpu" else None)
    if dev.type == "cpu":
        # the shared-memory comm op is a ~50 s JIT compile; gloo is enough for a CPU run
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    elif dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=collective_timeout_s)
        # the groups DeepSpeed makes later (data parallel, ZeRO) call new_group without a timeout, which takes torch's
        # module default (30 min), not the world's: set that default too, so every collective has this bound
        dist.distributed_c10d.default_pg_timeout = timeout
        if getattr(dist.distributed_c10d, "default_pg_nccl_timeout", None) is not None:
            dist.distributed_c10d.default_pg_nccl_timeout = timeout
        deepspeed.init_distributed(dist_backend="gloo" if dev.type == "cpu" else "nccl", timeout=timeout)
        if dist.get_world_size() > 1:  # a user error's line is said once through it, after the group is gone
            keep_store(dist.distributed_c10d._get_default_store())
    return DistContext(dist.get_rank(), dist.get_world_size(), local_rank, dev)


def destroy_process_groups() -> None:
    """Destroy every process group and DeepSpeed's cached references to them. torch's `destroy_process_group`
    alone leaves `deepspeed.utils.groups` pointing at the destroyed groups, and a world created later in the same
    process (tests) then fails inside DeepSpeed with "Group ... is not registered"."""
    if not dist.is_initialized():
        return
    import_deepspeed()
    # lazy: deepspeed costs a second at import (import_deepspeed above keeps its log lines off stdout)
    from deepspeed import comm as ds_comm

    if ds_comm.is_initialized():
        ds_comm.destroy_process_group()  # also drops DeepSpeed's references to its groups
    else:
        dist.destroy_process_group()


def shutdown_distributed() -> None:
    """Barrier then destroy every process group (exiting with one alive aborts some gloo ranks)."""
    if dist.is_initialized():
        dist.barrier()
        destroy_process_groups()


def exit_process(code: int) -> None:
    """End a trainer process with `code`. A successful run (code 0 comes only after training, so the process has
    joined a process group) skips the interpreter's teardown (`os._exit`): DeepSpeed leaves references to its gloo
    groups (from hooks on the parameters) that `destroy_process_group` cannot drop, so the groups and their threads
    are still alive at exit, and tearing them down then aborts a rank now and then ("terminate called without an
    active exception", SIGABRT after the run finished). Everything the run writes is closed by then; only the
    standard streams need a flush. A failed run exits normally, so whatever it still holds open is flushed by the
    usual teardown."""
    if code == 0:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    sys.exit(code)


def barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def all_reduce_sum(values: list[float]) -> list[float]:
    """Sum floats over ranks (identity for one rank)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return list(values)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.cpu().tolist()


def node_of(rank: int) -> int | None:
    """The node (launcher) index of a global rank: torchrun and DeepSpeed number ranks node by node, LOCAL_WORLD_SIZE
    per node."""
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", 0) or 0)
    return rank // per_node if per_node > 0 else None


def describe_ranks(ranks: list[int]) -> str:
    """'rank 2 (node 1)', 'ranks 2, 3 (node 1)'."""
    nodes = sorted({n for n in map(node_of, ranks) if n is not None})
    where = f" (node{'s' if len(nodes) > 1 else ''} {', '.join(map(str, nodes))})" if nodes else ""
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}{where}"


def lost_ranks(wait_s: float = SURVIVOR_WAIT_S) -> list[int] | None:
    """After a failed collective: the ranks that did not report in through the rendezvous store within `wait_s`
    (each survivor reports itself). None when the store itself is gone (it lives with the first node's launcher)."""
    if not dist.is_initialized():
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
        me, world = dist.get_rank(), dist.get_world_size()
        store.set(f"eagle_alive/{me}", "1")
        deadline = time.monotonic() + wait_s
        while True:
            missing = [r for r in range(world) if not store.check([f"eagle_alive/{r}"])]
            if not missing or time.monotonic() > deadline:
                return missing
            time.sleep(0.2)
    except (RuntimeError, ValueError):  # the store's host is gone too
        return None


def collective_failed(exc: BaseException) -> bool:
    """True for the error a collective raises when a peer is gone or silent: NCCL's DistBackendError, gloo's
    RuntimeError from its transport (connection reset or closed by the peer, a timed-out receive)."""
    text = str(exc)
    return isinstance(exc, dist.DistBackendError) or "gloo/transport" in text or "Timed out waiting" in text


def lost_rank_error(exc: BaseException, step: int, resume_hint: str) -> LostRankError:
    """One line for a collective that failed: which ranks are lost (or that the rendezvous host is), the step,
    what to do."""
    lost = lost_ranks()
    detail = " ".join(str(exc).split())[:160]
    if lost is None:
        master = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        who = f"lost the rendezvous host {master} (node 0: {describe_ranks(list(range(int(os.environ.get('LOCAL_WORLD_SIZE', 1) or 1))))})"
    elif lost:
        who = f"lost {describe_ranks(lost)}"
    else:
        who = "a collective failed on every rank"
    return LostRankError(f"{who} at step {step}: the collective failed ({detail}); {resume_hint}")
