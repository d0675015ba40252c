"""Writing one file so that a reader never sees half of it: the single-file sibling of eagle/atomic_folder.py.

    write_file_atomic(path, text_or_bytes)
    with atomic_output(path, "w") as f:      # a file written piece by piece (JSONL records)
        f.write(...)

The content goes to a temporary sibling of `path` (same folder, so the move is a rename), is flushed to disk, and
only then replaces `path`; a failure (full disk, file-size limit) removes the temporary file and leaves `path` as it
was. `write_file_atomic` then raises one line naming `path`; `atomic_output` re-raises the failure as it came (its
caller names what it was writing). State files (eagle/state_files.py) and data prep's record files are written
through them."""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from eagle.cli_errors import UserError


class FileWriteError(UserError):
    """A file could not be written; the one-line message names it and says the previous content is unchanged."""


@contextlib.contextmanager
def atomic_output(path: str | Path, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO]:
    """A file object to write `path`'s new content into ("w" text, "wb" bytes); `path` is replaced when the block
    ends, flushed to disk first; on any failure the temporary file is removed, `path` stays as it was and the
    exception propagates. The temporary name carries the pid: several ranks may write the same file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, mode, encoding=None if "b" in mode else encoding) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_file_atomic(path: str | Path, content: str | bytes) -> Path:
    """Replace `path` with `content` (str: UTF-8) whole, or leave it unchanged and raise FileWriteError."""
    path = Path(path)
    data = content.encode("utf-8") if isinstance(content, str) else bytes(content)
    try:
        with atomic_output(path, "wb") as f:
            f.write(data)
    except OSError as e:
        why = os.strerror(e.errno) if e.errno else " ".join(str(e).split())
        raise FileWriteError(f"could not write {path} ({why}); its previous content, if any, is unchanged: free "
                             "space (or fix the folder's permissions) and rerun") from None
    return path


__all__ = ["FileWriteError", "atomic_output", "write_file_atomic"]
