"""engine/engine_process.py, the one way an engine process starts, without an engine: fake interpreters stand in for
the engine's (they receive `-m vllm_side.MODULE ...` under engine_env). Every way an engine process can end badly
(an exit code, a signal, no RESULT, a timeout) is ONE line of the same form for each user: feature capture,
serve-check, serve-sweep's `vllm bench serve` and the server regeneration starts. The engine-side scripts' common
start and end (engine/vllm_side/script.py) runs under a bare interpreter. Against real vLLM: tests/test_vllm_*.py."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

import data_prep.vllm_features as vf
from eagle.cli_errors import is_expected
from eagle.state_files import StateFile, StateFileError
from engine.engine_process import EngineError, engine_command, engine_env, run_engine, run_engine_script
from engine.vllm_server import VLLMServer
from evaluation.engine_runs import engine_run

RESULT = StateFile("result.json", "TEST_DIR", writer="the fake engine", schema={"answer": int, "*": object},
                   rebuild="rerun the test", example={"answer": 1})
# the one failure line: WHAT exited with code N | was killed by SIGNAL [when] (log LOG)[: the end of the log]
ENDED = re.compile(r"^(?P<what>.+) (exited with code -?\d+|was killed by SIG[A-Z]+)(?: [^(]+)? \(log [^)]+\)(: .+)?$")


def fake_python(tmp_path, body: str, name: str = "python") -> str:
    """An engine interpreter running `body` (argv: -m vllm_side.MODULE ARGS...); `-c` probes answer yes."""
    path = tmp_path / name
    path.write_text(f"#!{sys.executable}\nimport json, os, signal, sys, time\nargs = sys.argv[1:]\n"
                    f"if args[:1] == ['-c']:\n    sys.exit(0)\n{body}\n")
    path.chmod(0o755)
    return str(path)


def one_line(exc: BaseException, what: str) -> re.Match:
    assert is_expected(exc) and "\n" not in str(exc), str(exc)
    m = ENDED.match(str(exc))
    assert m and m["what"] == what, str(exc)
    return m


def script_run(tmp_path, python, timeout=None):
    return run_engine_script(python, "generate", {"q": 1}, tmp_path / "request.json", tmp_path / "result.json",
                             tmp_path / "engine.log", RESULT, "the fake script", timeout=timeout)


def test_a_script_gets_its_request_and_its_result_is_read_through_the_state_file(tmp_path):
    python = fake_python(tmp_path, "req = json.load(open(args[2]))\n"
                                   "json.dump({'answer': req['q'] + 1, 'module': args[1]}, open(args[3], 'w'))")
    assert script_run(tmp_path, python) == {"answer": 2, "module": "vllm_side.generate"}
    assert (tmp_path / "engine.log").read_text().startswith(f"$ {python} -m vllm_side.generate ")
    damaged = fake_python(tmp_path, "json.dump({'answer': 'two'}, open(args[3], 'w'))", "damaged")
    with pytest.raises(StateFileError, match=r"result.json.*answer.*rerun the test"):
        script_run(tmp_path, damaged)


@pytest.mark.parametrize("body, how", [
    ("print('Traceback ...')\nprint('RuntimeError: no KV cache')\nsys.exit(3)",
     r"exited with code 3 \(log .*engine.log\): Traceback \.\.\. \| RuntimeError: no KV cache$"),
    ("print('loading', flush=True)\nos.kill(os.getpid(), signal.SIGKILL)",
     r"was killed by SIGKILL \(log .*\): loading$"),
    ("print('done, but wrote nothing')",
     r"exited with code 0 without writing .*result.json \(log .*\): done, but wrote nothing$"),
])
def test_every_way_a_script_ends_badly_is_one_line(tmp_path, body, how):
    with pytest.raises(EngineError) as e:
        script_run(tmp_path, fake_python(tmp_path, body))
    one_line(e.value, "the fake script")
    assert re.search(how, str(e.value)), str(e.value)
    assert not (tmp_path / "result.json").exists()


def test_a_script_that_does_not_end_is_one_line(tmp_path):
    with pytest.raises(EngineError, match=r"^the fake script did not end within 1 s \(log .*\): still loading$") as e:
        script_run(tmp_path, fake_python(tmp_path, "print('still loading', flush=True)\ntime.sleep(60)"), timeout=1)
    assert is_expected(e.value)


def test_capture_serve_check_bench_and_server_fail_in_the_same_words(tmp_path):
    crash = fake_python(tmp_path, "print('engine died: out of memory')\nsys.exit(3)")
    failures = {}
    with pytest.raises(EngineError) as e:
        vf.engine_capture(crash, "m", "float32", [{"name": "a", "input_ids": [1]}], [2], tmp_path / "capture", 0, 8,
                          tmp_path / "capture.log")
    failures["the vLLM capture"] = e.value
    (tmp_path / "check").mkdir()
    with pytest.raises(EngineError) as e:
        engine_run("vllm", crash, {"prompts": []}, tmp_path / "check")
    failures["serve-check's vllm run"] = e.value
    with pytest.raises(EngineError) as e:
        VLLMServer(crash, "MODEL", tmp_path / "server.log", served_model_name="target").bench(
            ["--num-prompts", "4"], tmp_path / "bench.log", "vllm bench serve at k1, concurrency 4",
            tmp_path / "b.json")
    failures["vllm bench serve at k1, concurrency 4"] = e.value
    with pytest.raises(EngineError) as e:
        VLLMServer(crash, "MODEL", tmp_path / "serve.log", startup_timeout_s=60).__enter__()
    failures["the vLLM server for MODEL"] = e.value
    for what, exc in failures.items():
        assert one_line(exc, what) and str(exc).endswith("engine died: out of memory"), str(exc)
    bench = (tmp_path / "bench.log").read_text().splitlines()[0]
    assert "-m vllm_side.cli bench serve --base-url http://127.0.0.1:" in bench
    assert bench.endswith("--model target --num-prompts 4")


def test_a_vllm_command_runs_under_the_engine_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/somewhere/else")
    python = fake_python(tmp_path, "print(os.environ['PYTHONPATH'], os.environ['VLLM_CPU_KVCACHE_SPACE'], args)")
    run_engine(python, "cli", ["bench", "serve"], tmp_path / "cli.log", tmp_path, "vllm bench serve")
    assert (tmp_path / "cli.log").read_text().splitlines()[1] == (
        f"{engine_env(python)['PYTHONPATH']} 1 ['-m', 'vllm_side.cli', 'bench', 'serve']")
    assert engine_command(python, "cli", ["serve", 3]) == [python, "-m", "vllm_side.cli", "serve", "3"]


def test_the_engine_side_scripts_start_and_end_alike(tmp_path):
    """vllm_side/script.py under a bare interpreter (-S, engine_env only): the request in, the CPU settings set,
    the result written whole, exit 0; vLLM's refusal as one line."""
    probe = ("import os\n"
             "from vllm_side import script\n"
             "def main(req):\n"
             "    env = [os.environ[k] for k in ('VLLM_CPU_KVCACHE_SPACE', 'VLLM_ENABLE_V1_MULTIPROCESSING')]\n"
             "    refused = script.refusal(ValueError('bad\\n  method ' + 'x' * 2000))\n"
             "    return {'echo': req, 'env': env, 'refusal': refused}\n"
             "script.run(main)\n")
    (tmp_path / "request.json").write_text(json.dumps({"q": [1, 2]}))
    env = {k: v for k, v in engine_env(sys.executable).items() if k != "VLLM_CPU_KVCACHE_SPACE"}  # a run by hand
    proc = subprocess.run([sys.executable, "-S", "-c", probe, str(tmp_path / "request.json"),
                           str(tmp_path / "result.json")], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["echo"] == {"q": [1, 2]} and result["env"] == ["1", "0"]
    assert result["refusal"].startswith("ValueError: bad method xxx")
    assert len(result["refusal"]) == len("ValueError: ") + 1500
    assert sorted(p.name for p in tmp_path.iterdir()) == ["request.json", "result.json"]  # no temporary file left
