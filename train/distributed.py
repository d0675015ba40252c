"""Process-group setup for every launcher: plain `python` (one rank), `torchrun`, `deepspeed` (incl.
`--hostfile` multi-node). CPU ranks use gloo, GPU ranks nccl."""
from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist


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


def pick_device(device: str, local_rank: int) -> torch.device:
    if device != "auto":
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def import_deepspeed():
    """`import deepspeed` with its log lines on stderr. DeepSpeed binds its logger's handler to sys.stdout at import
    and warns there ("Setting accelerator to CPU ..."): stdout is kept for what a command prints for machines
    (`train.plan --json`, `--print-config`). Every project import of deepspeed goes through here first."""
    if "deepspeed" not in sys.modules:
        with contextlib.redirect_stdout(sys.stderr):  # the handler created during the import takes sys.stderr
            # lazy: deepspeed costs a second at import; only training, checkpoints and the plan's estimators need it
            import deepspeed  # noqa: F401
    for h in logging.getLogger("DeepSpeed").handlers:  # imported before us (by a library or a test): move it too
        if isinstance(h, logging.StreamHandler) and h.stream in (sys.stdout, sys.__stdout__):
            h.stream = sys.stderr  # not setStream: it would flush the old stream, which may be closed
    return sys.modules["deepspeed"]


def init_distributed(device: str = "auto") -> DistContext:
    """Join (or create) the process group; idempotent, so several runs can share one process (tests)."""
    deepspeed = import_deepspeed()

    if "RANK" not in os.environ:  # plain `python train/main.py`: a world of one on a free local port
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        os.environ["RANK"] = "0"
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    dev = pick_device(device, local_rank)
    if dev.type == "cpu":
        # the shared-memory comm op is a ~50 s JIT compile; gloo is enough for a CPU run
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    elif dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend="gloo" if dev.type == "cpu" else "nccl")
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
