"""One writer per run directory: an advisory `flock` on a lock file inside it.

The kernel drops an flock when the last process holding the open file exits (or is killed with -9), so a
dead run never blocks the next one; processes forked by the holder (DataLoader workers) keep it while they
live, so a second launch cannot write next to them. The file records the holder's pid and command for the error
message.

The lock file is removed on release, while still held (unlocking would release forked holders too, so this
takes nothing from them), and so are the folders the lock itself created when nothing else was written in them:
a command that fails before doing any work (a config error found in setup, a missing cache) leaves no run folder
and no lock file behind. A process that opened the lock file before it was removed notices (the path no longer
names the inode it locked) and takes the lock again on a fresh file.
"""
from __future__ import annotations

import errno
import fcntl
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from eagle.cli_errors import RunDirBusyError, UserError


@contextmanager
def run_lock(directory: str | Path, name: str, what: str) -> Iterator[Path]:
    """Hold `{directory}/.{name}.lock` for the body; RunDirBusyError (one line) when another process holds it."""
    directory = Path(directory)
    path = directory / f".{name}.lock"
    created = [p for p in (directory, *directory.parents) if not p.exists()]  # deepest first
    while True:
        directory.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except FileNotFoundError:  # the folder was removed by a holder that wrote nothing: make it again
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 512, 0).decode("utf-8", "replace").strip() or "unknown"
            os.close(fd)
            raise RunDirBusyError(f"{directory} is in use by another {what} ({holder}; lock {path}): wait for it to end "
                                  "or stop it (and any orphaned workers), or use another output_dir") from None
        if _same_file(path, fd):
            break
        os.close(fd)  # locked a file its holder removed on the way out: take the one at the path now
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()}: {' '.join(sys.argv)[:200]}".encode(), 0)
        yield path
    except OSError as e:  # a full disk anywhere in the run: name the run directory (write() errors name no file)
        if e.errno not in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
            raise
        where = e.filename or directory
        raise UserError(f"disk full while writing {where} ({os.strerror(e.errno)}): free space or choose another "
                        "output_dir, then rerun the same command (finished work is kept)") from None
    finally:
        path.unlink(missing_ok=True)  # still held: an opener of the old file sees the path changed and retries
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
        for folder in created:  # only the folders this lock made, deepest first, and only while empty
            try:
                folder.rmdir()
            except OSError:
                break


def _same_file(path: Path, fd: int) -> bool:
    """True when `path` still names the open file `fd` (it was not removed and re-created meanwhile)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    fst = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (fst.st_dev, fst.st_ino)
