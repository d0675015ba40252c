"""How an engine-side script starts and ends (serve-check's generate.py, feature capture's capture.py).

    python -m vllm_side.NAME REQUEST.json RESULT.json      (started by engine/engine_process.py run_engine_script)

`run(main)` reads the REQUEST, sets the CPU engine's settings, calls `main(request) -> result` and writes the RESULT
whole (a temporary sibling renamed into place, so the caller never reads half a file), then exits 0. A
configuration vLLM refuses is not a crash: the script puts `refusal(e)` in its RESULT and the caller names it; a
crash leaves no RESULT and the caller shows the end of the log. Standard library only.
"""
import json
import os
import sys

PACKAGE = __package__.rpartition(".")[2]  # this package's name in the engine process: vllm_side (PYTHONPATH=engine/)
# the vLLM CPU settings of every engine process (engine_env gives them to servers and scripts; `run` sets them too,
# for a script started by hand)
CPU_ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache: ample for the CPU models used here
                  "VLLM_CPU_OMP_THREADS_BIND": "nobind"}  # the box is shared: do not pin cores


def refusal(exc: BaseException) -> str:
    """vLLM's refusal of a configuration as one line, "Type: message" (at most 1,500 characters of message)."""
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:1500]}"


def run(main) -> None:
    """The script's whole life: REQUEST (argv[1]) -> `main` -> RESULT (argv[2]), exit 0."""
    request_path, result_path = sys.argv[1], sys.argv[2]
    with open(request_path) as f:
        request = json.load(f)
    for key, value in CPU_ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process: one import of vllm
    result = main(request)
    with open(result_path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(result_path + ".tmp", result_path)
    sys.exit(0)
