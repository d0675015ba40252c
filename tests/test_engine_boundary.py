"""The serving engine stage's boundary (engine/, docs/design.md "engine/"): no module outside engine/ starts a vLLM
process (a subprocess, exec or spawn naming an engine interpreter, vLLM's CLI or engine/'s environment) or imports
vllm, and the engine-side code (engine/vllm_side/) imports only the standard library, vllm (with the torch and
safetensors it brings) and itself, never edits sys.path, and is found by the engine process through the
environment engine_env gives it."""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from engine.engine_process import ENGINE_DIR, engine_env

REPO = Path(__file__).resolve().parent.parent
OUTSIDE = ("eagle", "recipes", "data_prep", "train", "export", "evaluation", "quickstart", "benchmarks", "eagle_train")
SIDE = REPO / "engine" / "vllm_side"
# what starts a process: subprocess.X, os.X, asyncio.create_subprocess_X (also imported by name: from subprocess import
# Popen)
PROCESS_STARTS = {"subprocess": {"run", "Popen", "call", "check_call", "check_output", "getoutput", "getstatusoutput"},
                  "os": {"system", "popen", "execv", "execve", "execvp", "execvpe", "execl", "execle", "execlp",
                         "execlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe", "spawnl", "spawnle", "posix_spawn",
                         "posix_spawnp"},
                  "asyncio": {"create_subprocess_exec", "create_subprocess_shell"}}
ENGINE_MARKERS = ("vllm", "engine_python", "engine_env", "engine_command", "engine_python_env")


def process_starts(tree: ast.AST, module: ast.Module) -> list[ast.Call]:
    """The calls in `tree` (a part of `module`) that start a process (PROCESS_STARTS)."""
    by_name = {alias.asname or alias.name for node in ast.walk(module) if isinstance(node, ast.ImportFrom)
               for alias in node.names if node.module in PROCESS_STARTS and alias.name in PROCESS_STARTS[node.module]}
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        module = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else None
        if module in PROCESS_STARTS and f.attr in PROCESS_STARTS[module]:
            found.append(node)
        elif isinstance(f, ast.Name) and f.id in by_name:
            found.append(node)
    return found


def names_the_engine(node: ast.AST) -> bool:
    """`node` mentions an engine interpreter, vLLM (its CLI, its module) or the engine's environment: an identifier,
    an attribute, an argument or a string."""
    for n in ast.walk(node):
        words = [getattr(n, a) for a in ("id", "attr", "arg", "name") if isinstance(getattr(n, a, None), str)]
        if isinstance(n, ast.Constant) and isinstance(n.value, str):
            words.append(n.value)
        if any(m in w.lower() for w in words for m in ENGINE_MARKERS):
            return True
    return False


def engine_starts(source: str, where: str) -> list[str]:
    """`where:line` of every process start whose top-level statement (the function or class around it, or the
    statement itself) names the engine."""
    tree = ast.parse(source)
    return [f"{where}:{call.lineno}" for top in tree.body if names_the_engine(top)
            for call in process_starts(top, tree)]


def vllm_imports(source: str, where: str) -> list[str]:
    """`where:line` of every import of vllm (at the top or inside a function)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
        found += [f"{where}:{node.lineno}" for name in names if name.split(".")[0] == "vllm"]
    return found


def project_sources() -> dict[str, str]:
    return {str(p.relative_to(REPO)): p.read_text() for pkg in (*OUTSIDE, "engine")
            for p in sorted((REPO / pkg).rglob("*.py"))}


def test_nothing_outside_engine_starts_a_vllm_process():
    """One module starts engine processes (servers, vLLM commands, engine-side scripts): engine/engine_process.py;
    only the engine-side code imports vllm."""
    starts = {hit for where, text in project_sources().items() for hit in engine_starts(text, where)}
    assert {hit.split(":")[0] for hit in starts} == {"engine/engine_process.py"}, (
        f"start engine processes through engine/engine_process.py (or engine/vllm_server.py's VLLMServer): {starts}")
    imports = [hit for where, text in project_sources().items() for hit in vllm_imports(text, where)]
    assert imports and all(hit.startswith("engine/vllm_side/") for hit in imports), (
        f"only the engine-side code (engine/vllm_side/, run under the engine's interpreter) imports vllm: {imports}")


@pytest.mark.parametrize("code", [
    # serve-sweep's `vllm bench serve` before it went through engine/
    "def run_point(k):\n    cmd = bench_command(engine_python, server)\n"
    "    proc = subprocess.run(cmd, env=engine_env(engine_python), cwd=out)\n",
    # a server class starting its command
    "class VLLMServer:\n    def start(self):\n        self.proc = subprocess.Popen(self.command(), env=self.env)\n",
    "from subprocess import Popen as P\ndef go(py):\n    P([py, '-m', 'vllm.entrypoints.cli.main', 'serve'])\n",
    "import os\ndef go(engine_python):\n    os.execv(engine_python, [engine_python, 'x.py'])\n",
])
def test_the_scan_catches_every_form_of_starting_the_engine(code):
    assert engine_starts(code, "m.py"), code


@pytest.mark.parametrize("code", ["def load():\n    import vllm\n    return vllm.LLM\n", "from vllm import LLM\n",
                                  "import vllm.entrypoints as e\n"])
def test_the_scan_catches_every_import_of_vllm(code):
    assert vllm_imports(code, "m.py") and not vllm_imports("from .vllm import x\nimport vllm_side\n", "m.py")


def test_the_scan_leaves_other_processes_alone():
    code = ("import subprocess, sys\ndef git():\n    return subprocess.run(['git', 'status'])\n"
            "def stage(cmd):\n    return subprocess.Popen([sys.executable, '-m', 'export.hub', *cmd])\n")
    assert engine_starts(code, "m.py") == []


def side_imports(path: Path) -> list[str]:
    """The top-level names `path` imports absolutely (relative imports are the package's own)."""
    tree = ast.parse(path.read_text())
    return sorted({a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
                  | {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level})


def test_engine_side_code_imports_only_the_standard_library_vllm_and_itself_and_keeps_sys_path():
    allowed = set(sys.stdlib_module_names) | {"__future__", "vllm", "torch", "safetensors"}
    files = sorted(SIDE.glob("*.py"))
    assert {"cli.py", "capture.py", "capture_connector.py", "generate.py", "script.py"} <= {p.name for p in files}
    for path in files:
        assert set(side_imports(path)) <= allowed, (path.name, set(side_imports(path)) - allowed)
        tree = ast.parse(path.read_text())
        edits = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "path"
                 and isinstance(n.value, ast.Name) and n.value.id == "sys"]
        assert not edits, f"{path.name}:{edits}: sys.path (the engine finds vllm_side/ through PYTHONPATH, engine_env)"


def test_the_engine_process_finds_the_engine_side_package_and_nothing_of_the_project(tmp_path):
    """Under engine_env, a bare interpreter (-S: no site-packages, so no vllm, torch or project install) imports the
    scripts' modules from PYTHONPATH alone, and cannot import this project's packages."""
    probe = ("import importlib.util, sys\n"
             "import vllm_side.script, vllm_side.capture, vllm_side.generate\n"
             "assert vllm_side.capture.CONNECTOR_MODULE == 'vllm_side.capture_connector'\n"
             "assert importlib.util.find_spec(vllm_side.capture.CONNECTOR_MODULE) is not None\n"
             "print([m for m in ('eagle', 'engine', 'data_prep', 'evaluation') if importlib.util.find_spec(m)])\n")
    env = engine_env(sys.executable)
    assert env["PYTHONPATH"] == str(ENGINE_DIR)
    proc = subprocess.run([sys.executable, "-S", "-c", probe], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
