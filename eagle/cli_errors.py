"""Expected errors and the one-line CLI wrapper every command-line entry point uses.

An *expected* error is a problem the user can fix (a bad recipe key or value, a missing or malformed file, a
cache/head/target mismatch, an unsupported option, a full disk, a run directory in use, a diverged run). A CLI
reports it as ONE line on stderr, ``error: <what to fix>``, and exits with code 2, without a traceback (ONE line per
launch of several ranks too, and code 2 on every rank that fails: eagle/rank_errors.py).
``--debug`` on the command line (or ``EAGLE_DEBUG=1`` in the environment) re-raises instead, traceback and all.
Anything else is a bug: it propagates with its traceback (exit code 1).

    @one_line_errors
    def main(argv: list[str] | None = None) -> int: ...

Library errors that do not say which file they come from (JSON, UTF-8, YAML, safetensors, unpickling) are
translated where the file is opened, with `file_error(path, exc)`; this module only decides how they print.
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import functools
import math
import os
import pickle
import sys
import traceback
from pathlib import Path

import yaml
from omegaconf.errors import OmegaConfBaseException
from safetensors import SafetensorError

from eagle.rank_errors import say_once

EXIT_USER_ERROR = 2
DEBUG_FLAG = "--debug"
DEBUG_ENV = "EAGLE_DEBUG"


class UserError(Exception):
    """A problem in the user's input or environment; the message names the thing to fix."""


class FileFormatError(UserError, ValueError):
    """A file is malformed (bad JSON/UTF-8/safetensors/pickle, wrong structure); the message names it."""


class RunDirBusyError(UserError):
    """Another process holds the run directory's lock."""


# Library errors that are a user's to fix: a bad recipe override (omegaconf), a damaged weights file (safetensors),
# malformed YAML. KeyError etc. are bugs.
EXPECTED = (UserError, ValueError, OSError, pickle.UnpicklingError, OmegaConfBaseException, SafetensorError, yaml.YAMLError)


def is_expected(exc: BaseException) -> bool:
    """True for errors a user can fix from the message alone."""
    return isinstance(exc, EXPECTED)


def one_line(exc: BaseException) -> str:
    """The error as one line: its message with newlines folded; OSErrors name their file and say what to do.

    A ValueError (or other expected type) that a library raised rather than this project says where it came from:
    ValueError is how this project reports bad values, but also what a library raises for a bug in our use of it,
    so the line keeps the exception type and the raising module, and points at --debug for the traceback."""
    if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT) and not str(exc).startswith("disk"):
        where = f" writing {exc.filename}" if exc.filename else ""
        msg = f"disk full{where} ({os.strerror(exc.errno)}): free space (or point output_dir elsewhere) and rerun"
    else:
        msg = str(exc) or type(exc).__name__
        origin = None if isinstance(exc, (UserError, OSError)) else library_origin(exc)
        if origin is not None:
            msg += f" [{type(exc).__name__} raised in {origin}; {DEBUG_FLAG} shows the traceback]"
    return " ".join(msg.split())


_REPO = Path(__file__).resolve().parent.parent
_OWN_PACKAGES = {"eagle", "eagle_train", "train", "engine", "data_prep", "export", "evaluation", "quickstart", "recipes", "benchmarks", "tests"}


def library_origin(exc: BaseException) -> str | None:
    """The file (relative to site-packages) of the innermost Python frame that raised `exc`, if it is not ours."""
    tb, last = exc.__traceback__, None
    while tb is not None:
        last, tb = tb, tb.tb_next
    if last is None:
        return None
    path = Path(last.tb_frame.f_code.co_filename)
    try:
        if path.resolve().relative_to(_REPO).parts[0] in _OWN_PACKAGES:
            return None
    except (ValueError, IndexError, OSError):
        pass
    parts = path.parts
    for marker in ("site-packages", "dist-packages"):
        if marker in parts:
            return "/".join(parts[parts.index(marker) + 1:])
    return path.name


def file_error(path: str | Path, exc: BaseException, what: str = "") -> FileFormatError:
    """A UserError naming `path` for a library error raised while reading it (JSON, UTF-8, YAML, safetensors...)."""
    kind = {"JSONDecodeError": "not valid JSON", "UnicodeDecodeError": "not valid UTF-8",
            "SafetensorError": "not a readable safetensors file (truncated or corrupt)",
            "UnpicklingError": "refused by the weights-only unpickler"}.get(type(exc).__name__, type(exc).__name__)
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    if isinstance(exc, pickle.UnpicklingError):  # torch's message is a page long: keep the line naming the global
        lines = [next((ln for ln in lines if "GLOBAL" in ln or "Unsupported" in ln), lines[0] if lines else "")]
    detail = " ".join(" ".join(lines).split())[:300]
    return FileFormatError(f"{what + ' ' if what else ''}{path}: {kind} ({detail})")


_debug_depth = 0  # > 0 while a CLI runs with --debug / EAGLE_DEBUG=1


def _split_debug(argv: list[str]) -> tuple[list[str], bool]:
    debug = DEBUG_FLAG in argv or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    return [a for a in argv if a != DEBUG_FLAG], debug


def debug_enabled() -> bool:
    """True inside a CLI run with --debug or EAGLE_DEBUG=1 (commands that start others pass it on: EAGLE_DEBUG=1)."""
    return _debug_depth > 0 or os.environ.get(DEBUG_ENV, "") not in ("", "0")


def one_line_errors(main):
    """Decorate a CLI `main(argv) -> int`: expected errors become one stderr line and exit code 2."""

    @functools.wraps(main)
    def wrapper(argv: list[str] | None = None) -> int:
        global _debug_depth
        args, debug = _split_debug(list(sys.argv[1:] if argv is None else argv))
        _debug_depth += debug
        try:
            code = main(args)
        except SystemExit as e:  # `raise SystemExit("message")` is an expected error too
            if isinstance(e.code, str):
                if debug:  # SystemExit prints only its message: the traceback first
                    traceback.print_exc(file=sys.stderr)
                    raise
                say_once(f"error: {' '.join(e.code.split())}", EXIT_USER_ERROR)
                return EXIT_USER_ERROR
            raise  # --help, argparse usage errors: their own exit code
        except BaseException as e:
            if debug or not is_expected(e):
                raise
            say_once(f"error: {one_line(e)}", EXIT_USER_ERROR)  # once per launch of several ranks
            return EXIT_USER_ERROR
        finally:
            _debug_depth -= debug
        return 0 if code is None else int(code)

    return wrapper


_command_names: list[tuple[str, str]] = []  # (documented name, name it runs under), innermost last


@contextlib.contextmanager
def command_name(documented: str, current: str):
    """Within the block, a parser whose prog starts with `documented` (e.g. "python -m train.export") shows `current`
    instead (e.g. "eagle-train export"): a command started through the `eagle-train` dispatcher names itself as
    typed, in its usage line and its one-line usage errors. Its options and its output do not change."""
    _command_names.append((documented, current))
    try:
        yield
    finally:
        _command_names.pop()


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line usage errors (exit 2) and the `--debug` flag documented in --help."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for documented, current in reversed(_command_names):
            if self.prog.startswith(documented):
                self.prog = current + self.prog[len(documented):]
                break
        self.add_argument(DEBUG_FLAG, action="store_true",
                          help=f"show the full traceback of an error (also: {DEBUG_ENV}=1)")

    def error(self, message: str):
        if debug_enabled():  # a usage error has no exception: show where the parse was called from
            traceback.print_stack(file=sys.stderr)
        say_once(f"error: {self.prog}: {' '.join(message.split())} (see --help)", EXIT_USER_ERROR)
        self.exit(EXIT_USER_ERROR)


def bounded(kind: type = int, *, at_least: float | None = None, above: float | None = None,
            at_most: float | None = None, below: float | None = None):
    """An argparse `type=` that parses `kind` (int, or a finite float) and checks its range, so a bad number is a
    one-line usage error before any work (`--first -3` would otherwise count from the end)."""
    bounds = [(at_least, ">=", lambda v, b: v >= b), (above, ">", lambda v, b: v > b),
              (at_most, "<=", lambda v, b: v <= b), (below, "<", lambda v, b: v < b)]
    wanted = " and ".join(f"{op} {b:g}" for b, op, _ in bounds if b is not None)
    noun = "an integer" if kind is int else "a finite number"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected {noun}{' ' + wanted if wanted else ''}") from None
        if kind is float and not math.isfinite(value) or not all(b is None or ok(value, b) for b, _, ok in bounds):
            raise argparse.ArgumentTypeError(f"{text}: expected {noun} {wanted}".rstrip())
        return value

    parse.__name__ = kind.__name__
    return parse
