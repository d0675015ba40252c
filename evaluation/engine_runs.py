"""serve-check's runs in the engine: the REQUEST serve-check writes, the RESULT the engine script
(engine/vllm_side/generate.py, under the engine's own interpreter; both described in that file) writes back.
"""
from __future__ import annotations

from pathlib import Path

from eagle.state_files import StateFile, register
from engine.engine_process import EngineError, run_engine_script

ENGINES = ("vllm",)
ENGINE_RESULT = register(StateFile(
    "ENGINE_result.json", "SERVE_CHECK_WORK_DIR", writer="engine/vllm_side/generate.py (under the engine's interpreter)",
    schema={"runs": {"*": dict}, "*": object},
    rebuild="rerun the serve-check: the engine script writes it fresh (its log beside it says why it is incomplete)",
    example={"runs": {"spec": {"outputs": [[1, 2]]}}}))
ENGINE_SCRIPTS = {"vllm": "generate"}  # engine -> its engine-side script (engine/vllm_side/generate.py)


class ServeCheckError(EngineError):
    """serve-check cannot run this engine, or the engine refused one of its runs."""


def engine_run(engine: str, engine_python: str, request: dict, work: Path, timeout: float = 3600) -> dict:
    """Run the engine script under `engine_python` in `work`; its RESULT (see engine/vllm_side/generate.py). The
    engine ending badly is one EngineError line (engine/engine_process.py)."""
    return run_engine_script(engine_python, ENGINE_SCRIPTS[engine], request, work / f"{engine}_request.json",
                             work / f"{engine}_result.json", work / f"{engine}.log", ENGINE_RESULT,
                             f"serve-check's {engine} run", timeout=timeout)


def engine_runs(engine: str, engine_python: str, request: dict, work: Path) -> dict:
    """engine_run, with a run vLLM refused (its "error") raised as one line naming the run."""
    result = engine_run(engine, engine_python, request, work)
    for name, run in result["runs"].items():
        if "error" in run:
            raise ServeCheckError(f"{engine} refused the {name!r} run: {run['error']}")
    return result
