"""Writing a head folder so that a good one is never destroyed: every export (the trainer's official folder, the
engine formats, Hub staging) goes through `write_folder`.

    write_folder(dest, fill, sources=[head_dir], overwrite=args.overwrite)

`fill(tmp)` writes the complete folder into a temporary sibling of `dest` (same file system, so the move is a
rename); only when it returned is `dest` replaced, whole: nothing of an earlier folder stays beside the new files.
A failure while writing (full disk, file-size limit, a library error) removes the temporary folder, leaves `dest`
byte-identical and raises one line naming `dest` and the cause. Refused before anything is written: `dest` is one
of `sources` or inside one (or holds one: replacing it would delete the source), `dest` is a file, or a non-empty
folder that is not a head folder (no config.json: never deleted). Refused after the new folder is complete but
before it moves: `dest` holds a different head (other files or bytes) and `overwrite` is false; an identical one
(the same export run again) is simply kept.

Results a rerun replaces are written the same way: `write_results_folder` (a report's own folder, moved in whole
by `replace_folder`; serve-sweep stages its resumable partial folder itself) and `replace_files` (a report's files in
a folder shared with others)."""
from __future__ import annotations

import filecmp
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path

from safetensors import SafetensorError

from eagle.cli_errors import UserError

HEAD_MARKER = "config.json"  # a folder holding one is a head folder (official or engine format)
WRITE_ERRORS = (OSError, RuntimeError, SafetensorError)  # a full disk reaches torch.save as a RuntimeError


class FolderWriteError(UserError, ValueError):
    """A folder could not be moved into place; the one-line message names it (the previous one is unchanged)."""


class ExportError(FolderWriteError):
    """An export that would lose a good head or could not complete; the one-line message names the destination."""


def _inside(a: Path, b: Path) -> bool:
    """a is b or lies inside b."""
    return a == b or b in a.parents


def check_destination(dest: Path, sources: Iterable[Path] = ()) -> None:
    """The refusals that need nothing written (module docstring)."""
    d = Path(dest).resolve()
    for s in sources:
        s = Path(s).resolve()
        if _inside(d, s):
            raise ExportError(f"not writing to {dest}: it is the source head {s}; choose another output folder (the default "
                              "is HEAD-FORMAT beside the head)" if d == s else
                              f"not writing to {dest}: it lies inside the source head {s}; choose an output folder "
                              "outside it (e.g. --out HEAD-FORMAT beside it)")
        if _inside(s, d):
            raise ExportError(f"not writing to {dest}: it holds the source head {s}, which replacing it would delete; "
                              "choose another output folder")
    if d.exists() and not d.is_dir():
        raise ExportError(f"not writing to {dest}: it is a file; give a folder")
    if d.is_dir() and any(d.iterdir()) and not (d / HEAD_MARKER).exists():
        raise ExportError(f"not writing to {dest}: a non-empty folder that holds no head ({HEAD_MARKER}); "
                          "choose a new or empty output folder")


def same_folder(a: Path, b: Path) -> bool:
    """The two folders hold the same file names with the same bytes."""
    def files(root: Path) -> list[str]:
        return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())

    names = files(a)
    return names == files(b) and all(filecmp.cmp(a / n, b / n, shallow=False) for n in names)


def write_folder(dest: str | Path, fill: Callable[[Path], None], sources: Iterable[str | Path] = (),
                 overwrite: bool = False, what: str = "head") -> Path:
    """Write a folder atomically (module docstring). `what` names it in messages; `overwrite`: replace a different
    head already at `dest` (the flag --overwrite, or a folder the caller owns: the trainer's export, Hub staging)."""
    dest = Path(dest)
    check_destination(dest, [Path(s) for s in sources])
    tmp = dest.with_name(f".{dest.name}.tmp{os.getpid()}")
    try:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a killed run of this pid
        tmp.mkdir(parents=True)
        fill(tmp)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, WRITE_ERRORS) and not isinstance(e, (UserError, ValueError)):
            raise ExportError(f"could not export the {what} to {dest} ({' '.join(str(e).split())[:200]}); "
                              "the previous export there, if any, is unchanged") from None
        raise
    if dest.is_dir() and any(dest.iterdir()):
        if same_folder(tmp, dest):
            shutil.rmtree(tmp)
            return dest
        if not overwrite:
            shutil.rmtree(tmp)
            raise ExportError(f"not writing to {dest}: it holds a different head; pass --overwrite to replace it "
                              "whole, or choose another output folder")
    try:
        return replace_folder(tmp, dest, what, ExportError)
    except ExportError:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def replace_folder(staged: str | Path, dest: str | Path, what: str, error: type[UserError] = FolderWriteError) -> Path:
    """Put the complete folder `staged` (a sibling of `dest`, so the moves are renames) in `dest`'s place, whole: an
    existing `dest` is renamed aside and deleted only once `staged` is in its place. A move that fails puts `dest`
    back, leaves `staged` where it is and raises `error`, one line naming `dest`. The exports (`write_folder`) and
    the reports a rerun replaces (serve-sweep, serve-check, autotune, chi2) are moved into place so."""
    staged, dest = Path(staged), Path(dest)
    old = dest.with_name(f".{dest.name}.old{os.getpid()}")
    try:
        if dest.exists():
            os.replace(dest, old)  # kept until the new folder is in place
        os.replace(staged, dest)
    except OSError as e:
        if old.exists() and not dest.exists():
            os.replace(old, dest)
        raise error(f"could not move the new {what} into {dest} ({' '.join(str(e).split())[:200]}); "
                    f"the previous {what} there, if any, is unchanged") from None
    shutil.rmtree(old, ignore_errors=True)
    return dest


def write_results_folder(dest: str | Path, fill: Callable[[Path], None], what: str) -> Path:
    """A folder of results a rerun replaces (serve-check's, autotune's and chi2's reports): `fill(tmp)` writes the
    new one whole into a temporary sibling, which replaces `dest` (`replace_folder`) only once `fill` returned; on
    any failure the temporary folder goes and `dest` stays as it was."""
    dest = Path(dest)
    tmp = dest.with_name(f".{dest.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)  # left by a killed run of this pid
    tmp.mkdir(parents=True)
    try:
        fill(tmp)
        return replace_folder(tmp, dest, what)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already once it replaced `dest`


def replace_files(folder: str | Path, fill: Callable[[Path], None], owned: Callable[[str], bool], what: str) -> list[str]:
    """The files of one result in a folder it shares with others (the evaluation report in the eval folder, beside
    serve_sweep/, serve_check/...): `fill(tmp)` writes every new file into a temporary folder inside it; only then
    does each move into `folder` (a rename), and the previous result's files (the names `owned` claims) that the new
    one lacks are removed. A failure while writing leaves the previous result whole. Returns the new file names."""
    folder = Path(folder)
    tmp = folder / f".{what.replace(' ', '_')}.tmp{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)  # left by a killed run of this pid
    tmp.mkdir(parents=True)
    try:
        fill(tmp)
        names = sorted(p.name for p in tmp.iterdir())
        for name in names:
            os.replace(tmp / name, folder / name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    for stale in [p for p in folder.iterdir() if p.is_file() and owned(p.name) and p.name not in names]:
        stale.unlink()
    return names


__all__ = ["ExportError", "FolderWriteError", "write_folder", "replace_folder", "write_results_folder", "replace_files",
           "check_destination", "same_folder"]
