"""Local paths vs Hugging Face Hub ids: every argument that takes either (target.path, --head, head.init_from) is
read as a local path when it looks like one, so a typo in a path gets "does not exist", not a Hub error about
repo-id syntax."""
from __future__ import annotations

import os
from pathlib import Path

from eagle.cli_errors import UserError


def looks_local(path: str) -> bool:
    """A filesystem path rather than a hub id (`owner/name` or `name`)."""
    return path.startswith((".", "/", "~")) or path.count("/") > 1 or os.sep != "/" and os.sep in path


def check_local_exists(path: str, what: str, expect: str) -> None:
    """UserError naming `path` when it looks local and does not exist (`what`: whose path; `expect`: what to give)."""
    if looks_local(path) and not Path(path).expanduser().exists():
        raise UserError(f"{what} {path} does not exist (relative paths are read from the current directory, "
                        f"{Path.cwd()}); give {expect} or a hub id like owner/name")
