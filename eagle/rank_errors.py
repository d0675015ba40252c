"""A user error in a launch of several ranks (torchrun, deepspeed): its `error:` line is printed ONCE, by the first
rank to reach it, and every rank that fails ends with the same exit code. eagle/cli_errors.py prints every error
line through `say_once`.

Without it, every rank that meets the same problem (a damaged checkpoint all of them read, a bad recipe value)
prints the same line, and a launcher that stops the other ranks as soon as one exits (torchrun sends them SIGTERM)
gives them another exit code than the one that failed first. The ranks meet in the launch's rendezvous store, the
TCP store at MASTER_ADDR:MASTER_PORT (torchrun's agent hosts it, otherwise rank 0, from its process group on):

- the line: each failing rank claims it there; the first claim prints it, the others do not. A line naming
  something else (another rank's file) is another claim, printed once too. When the store cannot be reached (rank 0
  gone, or not started yet) the rank prints: a line twice is better than none.
- the exit: a failing rank records that it ended and waits, at most ALL_RANKS_WAIT_S, until every rank of the launch
  has, so that they exit together; from the moment its error is decided it ignores SIGTERM, so a launcher stopping
  it while it ends does not change its exit code (a rank that hangs still gets the launcher's SIGKILL). A rank that
  did not fail (still working, or waiting in a collective for the failed ones) is stopped by the launcher as before.
`keep_store(store)`: train/distributed.py hands over its process group's store when it makes the group, so rank 0's
store server outlives the group (destroyed before the error line prints) until the process exits.

Outside a launch of several ranks (WORLD_SIZE unset or 1) the line is printed and nothing waits."""
from __future__ import annotations

import datetime
import hashlib
import os
import signal
import sys
import threading
import time

ALL_RANKS_WAIT_S = 10.0  # how long a failed rank waits for the others to end (ranks meeting one problem: seconds apart)
CONNECT_TIMEOUT_S = 2.0  # reaching the rendezvous store (it may not be up yet, or gone with rank 0)
STORE_ERRORS = (RuntimeError, OSError, ValueError)  # torch's DistStoreError is a RuntimeError
_kept: list = []  # the process group's store, kept alive for the error path (`keep_store`)
_connection: list = []  # this process's own client of the rendezvous store: [store] or [None] (unreachable)


def launch_world_size() -> int:
    """The number of ranks of the launch this process is one of (1 when it was not started by a launcher)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def keep_store(store) -> None:
    """Hold the process group's store until the process exits (module docstring)."""
    _kept.append(store)


def _store():
    """This process's client of the launch's rendezvous store; None outside a multi-rank launch or when it cannot be
    reached within CONNECT_TIMEOUT_S."""
    if launch_world_size() <= 1 or not os.environ.get("MASTER_ADDR") or not os.environ.get("MASTER_PORT"):
        return None
    if not _connection:
        # lazy: only a rank of a multi-rank launch gets here, and its process has imported torch already
        from torch.distributed import TCPStore

        try:
            _connection.append(TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                                        timeout=datetime.timedelta(seconds=CONNECT_TIMEOUT_S)))
        except STORE_ERRORS:  # not reachable: every rank prints its own line (the caller says so)
            _connection.append(None)
    return _connection[0]


def _key(*parts: str) -> str:
    """A key of this launch (torchrun restarts its workers under the same store: the restart count tells them apart)."""
    launch = f"{os.environ.get('TORCHELASTIC_RUN_ID', '')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    return "/".join(("eagle_error", launch, *parts))


def _ignore_sigterm() -> None:
    """From now on a SIGTERM (a launcher stopping the ranks left) does not end this process: it is ending anyway, with
    its error's exit code. Ignored rather than handled: the interpreter resets handlers, not SIG_IGN, before its
    teardown, and a launcher sends SIGTERM while a rank tears down."""
    if threading.current_thread() is threading.main_thread():  # only the main thread may change it
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def say_once(line: str, code: int, stream=None) -> bool:
    """Print `line` on `stream` (stderr) for an error that ends this process with `code`: once per multi-rank launch,
    then wait for the other ranks to end (module docstring). Returns whether this process printed it."""
    stream = sys.stderr if stream is None else stream
    world = launch_world_size()
    if world <= 1:
        print(line, file=stream, flush=True)
        return True
    _ignore_sigterm()
    store = _store()
    first = True
    if store is not None:
        try:
            first = store.add(_key("line", hashlib.sha256(line.encode()).hexdigest()[:24]), 1) == 1
        except STORE_ERRORS:  # the store went away: print it here (twice is better than never)
            store = None
    if first:
        print(line, file=stream, flush=True)
    if store is not None:
        try:
            store.set(_key("ended", os.environ.get("RANK", "?")), str(code))
            ended = [_key("ended", str(r)) for r in range(world)]
            deadline = time.monotonic() + ALL_RANKS_WAIT_S
            while not store.check(ended) and time.monotonic() < deadline:
                time.sleep(0.05)
        except STORE_ERRORS:  # the store went away with its host: nobody is left to wait for
            pass
    return first


__all__ = ["ALL_RANKS_WAIT_S", "keep_store", "launch_world_size", "say_once"]
