"""Shared pieces of the fault tier (tests/test_faults_*.py; no tests here).

Every fault case asserts three things: the exit code (2 for an expected error), that stderr is ONE line
naming the problem, and that the good state written before the fault (files under the run folder, the
exported head, `latest`) did not change: `snapshot` hashes every file, `assert_unchanged` compares.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch



def reattach_log_streams() -> None:
    """Point library log handlers whose stream an earlier test's capture closed (DeepSpeed binds sys.stdout at
    import) at the current stdout: otherwise `logging` prints a "Logging error" traceback on stderr."""
    import logging
    import sys

    for logger in [logging.getLogger()] + [logging.getLogger(n) for n in list(logging.root.manager.loggerDict)]:
        for h in getattr(logger, "handlers", []):
            if isinstance(h, logging.StreamHandler) and getattr(h.stream, "closed", False):
                h.stream = sys.stdout  # not setStream: it flushes the closed stream first


def run_cli(main, argv: list[str], capsys) -> tuple[int, str, str]:
    """Run a CLI's main(argv) in-process: (exit code, stdout, stderr). argparse's SystemExit counts as a code."""
    reattach_log_streams()
    capsys.readouterr()
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code: int, err: str, *needles: str) -> str:
    """Exit code 2, exactly one non-empty stderr line starting with `error:`, containing every needle."""
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2, f"exit code {code}, stderr:\n{err[-3000:]}"
    assert len(lines) == 1, f"stderr is {len(lines)} lines:\n{err[-3000:]}"
    assert lines[0].startswith("error:"), lines[0]
    assert "Traceback" not in err
    for n in needles:
        assert str(n) in lines[0], f"{n!r} not in {lines[0]!r}"
    return lines[0]


def snapshot(*roots: Path) -> dict[str, str]:
    """sha256 of every file under `roots` (lock files excluded: they hold the holder's pid)."""
    out = {}
    for root in roots:
        root = Path(root)
        if root.is_file():
            out[str(root)] = hashlib.sha256(root.read_bytes()).hexdigest()
            continue
        for p in sorted(root.rglob("*")) if root.exists() else []:
            if p.is_file() and not p.name.endswith(".lock"):
                out[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def assert_unchanged(before: dict[str, str], *roots: Path, allow_new: bool = False) -> None:
    after = snapshot(*roots)
    changed = [k for k in before if after.get(k) != before[k]]
    assert not changed, f"good state changed: {changed[:5]}"
    if not allow_new:
        new = sorted(set(after) - set(before))
        assert not new, f"new files appeared: {new[:5]}"


class Evil:
    """Pickles to `os.system("touch MARKER")`: any loader that unpickles it with full pickle runs the command."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def write_malicious(path: Path, marker: Path, tensors: dict | None = None) -> Path:
    """A torch.save file holding real tensors plus an Evil object (as a crafted checkpoint would)."""
    obj = dict(tensors or {"w": torch.zeros(2)})
    obj["__payload__"] = Evil(marker)
    torch.save(obj, path)
    return path


def proves_code_execution(path: Path, marker: Path) -> bool:
    """Sanity check that the crafted file is real: full unpickling creates the marker (then it is removed)."""
    assert not marker.exists()
    torch.load(path, weights_only=False)
    made = marker.exists()
    marker.unlink(missing_ok=True)
    return made


@pytest.fixture(scope="module")
def world():
    """One in-process gloo world for the train CLI calls of a module, with the CLI's own teardown disabled so every
    call of the module runs in it (gloo_world destroys it at the end)."""
    import train.distributed as td
    from test_train_helpers import gloo_world

    with gloo_world() as ctx, pytest.MonkeyPatch.context() as mp:
        mp.setattr(td, "shutdown_distributed", lambda: None)
        mp.setattr(td, "destroy_process_groups", lambda: None)
        yield ctx


__all__ = ["run_cli", "assert_one_line_error", "snapshot", "assert_unchanged", "Evil", "write_malicious",
           "proves_code_execution", "world"]
