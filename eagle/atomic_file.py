"""Writing one file so that a reader never sees half of it: the single-file sibling of eagle/atomic_folder.py.

    write_file_atomic(path, text_or_bytes)

The content goes to a temporary sibling of `path` (same folder, so the move is a rename), is flushed to disk, and
only then replaces `path`; a failure (full disk, file-size limit) removes the temporary file, leaves `path` as it
was and raises one line naming `path`. State files (eagle/state_files.py) are written through it."""
from __future__ import annotations

import os
from pathlib import Path

from eagle.cli_errors import UserError


class FileWriteError(UserError):
    """A file could not be written; the one-line message names it and says the previous content is unchanged."""


def write_file_atomic(path: str | Path, content: str | bytes) -> Path:
    """Replace `path` with `content` (str: UTF-8) whole, or leave it unchanged and raise FileWriteError."""
    path = Path(path)
    data = content.encode("utf-8") if isinstance(content, str) else bytes(content)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        why = os.strerror(e.errno) if e.errno else " ".join(str(e).split())
        raise FileWriteError(f"could not write {path} ({why}); its previous content, if any, is unchanged: free "
                             "space (or fix the folder's permissions) and rerun") from None
    return path


__all__ = ["FileWriteError", "write_file_atomic"]
