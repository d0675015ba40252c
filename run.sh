#!/usr/bin/env bash
# One entry point for a fresh, offline CPU machine.
#   bash run.sh demo   -> whole pipeline (data prep, training, export, evaluation) on the embedded default target
#   bash run.sh test   -> the test suite (CPU only)
# The venv then also has the project's command, .venv/bin/eagle-train (eagle-train --help).
# Both create .venv on first use: torch==2.13.0 FIRST (the local CPU wheel; an unpinned torch
# would pull a multi-GB CUDA build), then the project pinned to that torch.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
VENV=${EAGLE_VENV:-.venv}
TORCH_PIN="torch==2.13.0"

# (a venv installed before the `eagle-train` command existed lacks its script: installing again adds it)
if [ ! -x "$VENV/bin/python" ] || [ ! -x "$VENV/bin/eagle-train" ] ||
   ! "$VENV/bin/python" -c "import eagle, torch, transformers, deepspeed, importlinter" 2>/dev/null; then
    echo "[run.sh] creating $VENV and installing dependencies (offline-capable, CPU torch)" >&2
    "$PY" -m venv "$VENV"
    "$VENV/bin/pip" install -q --disable-pip-version-check "$TORCH_PIN"
    "$VENV/bin/pip" install -q --disable-pip-version-check "$TORCH_PIN" -e ".[dev]"
fi
export WANDB_MODE=${WANDB_MODE:-disabled}
cmd=${1:-demo}; shift || true
case "$cmd" in
    demo) exec "$VENV/bin/python" -m quickstart "$@" ;;
    test) exec "$VENV/bin/python" -m pytest -q "$@" ;;
    *) echo "usage: bash run.sh {demo|test} [args...]" >&2; exit 2 ;;
esac
