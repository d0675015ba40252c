"""A vLLM OpenAI-compatible server started by the command that needs it: start, wait for /health, stop.

    with VLLMServer(engine_python, model_dir, log_path=..., args=["--max-model-len", "1024"]) as server:
        ... POST server.url + "/chat/completions" ...

The server is `ENGINE_PYTHON -m vllm_side.cli serve MODEL` (vLLM's own `vllm serve`, see engine/vllm_side/cli.py for
why not the installed script), started by engine/engine_process.py in its own process group on 127.0.0.1, and
`stop()` ends that group. Also here: the `vllm serve` arguments this project always passes (`serve_args`), those that
make the server capture hidden states (`capture_args`), and vLLM's own benchmark against a running server (`bench`).
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

from engine.engine_process import EngineError, ended, log_tail, run_engine, start_engine
from engine.vllm_side.capture import capture_config
from recipes.chat_templates import read_template

VLLM_CLI = "cli"  # the engine-side module that runs vLLM's CLI (engine/vllm_side/cli.py)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class VLLMServer:
    """`vllm serve MODEL` on 127.0.0.1:`port`, its output in `log_path`. Use as a context manager (started and
    waited for on enter, stopped on exit, also on error) or call start / wait_ready / stop."""

    def __init__(self, engine_python: str, model: str, log_path: str | Path, served_model_name: str | None = None,
                 args: list[str] | tuple = (), port: int | None = None, startup_timeout_s: float = 1200.0,
                 env: dict[str, str] | None = None):
        self.engine_python, self.model = engine_python, str(model)
        self.served_model_name = served_model_name or str(model)
        self.log_path = Path(log_path)
        self.args, self.port = [str(a) for a in args], port or free_port()
        self.startup_timeout_s = startup_timeout_s
        self.env = dict(env or {})  # beside engine_env's
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        """OpenAI API base, e.g. http://127.0.0.1:PORT/v1."""
        return f"http://127.0.0.1:{self.port}/v1"

    def serve_args(self) -> list[str]:
        """`vllm serve`'s arguments: the model on 127.0.0.1:port under its served name, then `args`."""
        return ["serve", self.model, "--host", "127.0.0.1", "--port", str(self.port), "--served-model-name",
                self.served_model_name, *self.args]

    def start(self) -> "VLLMServer":
        # own process group: stop() ends the API server and the engine-core process it spawns, nothing else
        self.proc = start_engine(self.engine_python, VLLM_CLI, self.serve_args(), self.log_path, self.log_path.parent,
                                 env=self.env)
        return self

    def exit_code(self) -> int | None:
        """None while the server runs; its exit code once it has ended."""
        return None if self.proc is None else self.proc.poll()

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self) -> "VLLMServer":
        """Block until /health answers 200; an exit or the startup timeout stops the server and raises."""
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.exit_code() is not None:
                raise EngineError(ended(f"the vLLM server for {self.model}", self.exit_code(), self.log_path,
                                        when="before it was ready"))
            if self.healthy():
                return self
            time.sleep(2.0)
        self.stop()
        raise EngineError(f"the vLLM server for {self.model} was not ready after {self.startup_timeout_s:.0f} s "
                          f"(log {self.log_path}): {log_tail(self.log_path)}")

    def died(self) -> str | None:
        """A one-line explanation when the server has ended on its own, else None."""
        code = self.exit_code()
        return None if code is None else ended(f"the vLLM server (pid {self.proc.pid})", code, self.log_path)

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the server's process group, SIGKILL what is left after `timeout_s`."""
        if self.proc is None or self.proc.poll() is not None and not self._group_alive():
            return
        for sig, wait in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                continue
            end = time.monotonic() + wait
            while self._group_alive() and time.monotonic() < end:  # the engine-core child exits after its parent
                time.sleep(0.2)
            if not self._group_alive():
                return

    def _group_alive(self) -> bool:
        try:
            os.killpg(self.proc.pid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def bench(self, args: list[str], log_path: Path, what: str, output: Path) -> None:
        """`vllm bench serve` (vllm/benchmarks/serve.py) against this server with `args`, run to its end under the
        server's interpreter beside its log, its output in `log_path`; a failure, or no `output` written, is one
        EngineError line, naming the server's end too when it died."""
        args = ["bench", "serve", "--base-url", f"http://127.0.0.1:{self.port}", "--model", self.served_model_name,
                *args]
        try:
            run_engine(self.engine_python, VLLM_CLI, args, log_path, self.log_path.parent, what, output=output)
        except EngineError as e:
            died = self.died()
            raise EngineError(f"{e}; {died}" if died else str(e)) from None

    def metrics_text(self) -> str:
        """The Prometheus /metrics page."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=30) as r:
            return r.read().decode()

    def __enter__(self) -> "VLLMServer":
        self.start()
        try:
            return self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_args(dtype: str, seed: int, max_model_len: int, chat_template: str | None, work: Path) -> list[str]:
    """`vllm serve` arguments this project always passes: dtype and seed, the model's generation defaults off
    (`--generation-config vllm`: a request's sampling settings are the whole story), eager mode (vLLM's CPU
    build; torch.compile would only lengthen start-up), the context, and the recipe's chat template (a shipped
    name or a .jinja path, written to `work`) when it sets one."""
    args = ["--dtype", str(dtype), "--seed", str(seed), "--generation-config", "vllm", "--enforce-eager",
            "--max-model-len", str(max_model_len)]
    if chat_template:
        path = Path(work) / "chat_template.jinja"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(read_template(str(chat_template)))
        args += ["--chat-template", str(path)]
    return args


def capture_args(layer_ids: list[int], storage: Path) -> list[str]:
    """`vllm serve` arguments that make the server capture hidden states too (data_prep/vllm_features.py
    `server_capture`): the offline capture's configuration (engine/vllm_side/capture.py `capture_config`: the
    speculative method `extract_hidden_states` with the hidden-state ids `layer_ids`, which drafts the token it sampled
    so greedy replies are a plain server's, and this project's hidden-states connector), capturing only the requests
    that name a hidden_states_path; prefix caching off, so every captured state is computed for its own request, as
    offline."""
    spec, kv = capture_config(layer_ids, str(storage), capture_only_requested=True)
    return ["--speculative-config", json.dumps(spec), "--kv-transfer-config", json.dumps(kv),
            "--no-enable-prefix-caching"]


__all__ = ["VLLM_CLI", "free_port", "VLLMServer", "serve_args", "capture_args"]
