"""serve-check's runs in the engine: the REQUEST serve-check writes, the RESULT the engine script
(engine/vllm_side/generate.py, under the engine's own interpreter; both described in that file) writes back.
"""
from __future__ import annotations

import json
import subprocess
from pathlib import Path

from eagle.state_files import StateFile, read_json_state, register
from engine.engine_process import EngineError, engine_env

ENGINES = ("vllm",)
ENGINE_RESULT = register(StateFile(
    "ENGINE_result.json", "SERVE_CHECK_WORK_DIR", writer="engine/vllm_side/generate.py (under the engine's interpreter)",
    schema={"runs": {"*": dict}, "*": object},
    rebuild="rerun the serve-check: the engine script writes it fresh (its log beside it says why it is incomplete)",
    example={"runs": {"spec": {"outputs": [[1, 2]]}}}))
ENGINE_SCRIPTS = {"vllm": Path(__file__).resolve().parent.parent / "engine" / "vllm_side" / "generate.py"}


class ServeCheckError(EngineError):
    """The engine could not run (the message holds the end of its log, folded into the error line)."""


def engine_run(engine: str, engine_python: str, request: dict, work: Path, timeout: float = 3600) -> dict:
    """Run the engine script under `engine_python`; returns its RESULT json (see engine/vllm_side/generate.py)."""
    req, res, logf = work / f"{engine}_request.json", work / f"{engine}_result.json", work / f"{engine}.log"
    req.write_text(json.dumps(request))
    env = engine_env(engine_python)
    with open(logf, "w") as f:
        proc = subprocess.run([engine_python, str(ENGINE_SCRIPTS[engine]), str(req), str(res)], stdout=f,
                              stderr=subprocess.STDOUT, env=env, cwd=work, timeout=timeout)
    if proc.returncode != 0 or not res.exists():
        tail = "\n".join(logf.read_text(errors="replace").splitlines()[-25:])
        raise ServeCheckError(f"{engine} exited with {proc.returncode} (log {logf}):\n{tail}")
    return read_json_state(res, ENGINE_RESULT)


def engine_runs(engine: str, engine_python: str, request: dict, work: Path) -> dict:
    """engine_run, with a run vLLM refused (its "error") raised as one line naming the run."""
    result = engine_run(engine, engine_python, request, work)
    for name, run in result["runs"].items():
        if "error" in run:
            raise ServeCheckError(f"{engine} refused the {name!r} run: {run['error']}")
    return result
