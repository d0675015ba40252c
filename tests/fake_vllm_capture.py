"""A stand-in for `vllm serve` with this project's capture connector, for tests that start a capture server through
engine/vllm_server.py (tests/test_stream.py). `fake_engine_python(dir)` writes an "engine interpreter": it passes
check_engine's import probe and runs this file for `-m vllm_side.cli serve MODEL --port P ... --speculative-config
JSON ...`. The server answers /health and /v1/completions; a completion naming `kv_transfer_params.hidden_states_path`
gets the file the connector writes: {"hidden_states" [T, n, H], "token_ids" [T]}, vLLM's ids (j = the residual stream
after j layers, L = before the final norm), computed in float32 by transformers from MODEL."""
from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def fake_engine_python(folder: Path) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "python"
    path.write_text(f'#!/bin/sh\nif [ "$1" = "-c" ]; then exit 0; fi\nshift 2\n'
                    f'exec "{sys.executable}" "{Path(__file__).resolve()}" "$@"\n')
    path.chmod(0o755)
    return str(path)


def serve(argv: list[str]) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    model_dir = argv[1]
    port = int(argv[argv.index("--port") + 1])
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    layer_ids = spec["draft_model_config"]["hf_config"]["eagle_aux_hidden_state_layer_ids"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    num_layers = model.config.num_hidden_layers
    lock = threading.Lock()

    def states(ids: list[int]):
        seen = {}
        hook = model.model.norm.register_forward_hook(lambda m, args, out: seen.setdefault("pre", args[0]))
        try:
            with torch.no_grad():
                out = model.model(torch.tensor([ids]), output_hidden_states=True)
        finally:
            hook.remove()
        return torch.stack([seen["pre"][0] if j == num_layers else out.hidden_states[j][0] for j in layer_ids], 1)

    class Handler(BaseHTTPRequestHandler):
        def reply(self, code: int, body: bytes) -> None:
            self.send_response(code)
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self.reply(200 if self.path == "/health" else 404, b"")

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            path = (body.get("kv_transfer_params") or {}).get("hidden_states_path")
            if path:
                with lock:
                    h = states(body["prompt"]).contiguous()
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                save_file({"hidden_states": h, "token_ids": torch.tensor(body["prompt"])}, path)
            self.reply(200, b'{"choices": [{"text": "x"}]}')

        def log_message(self, *args):
            pass

    class Server(ThreadingHTTPServer):
        request_queue_size = 128  # every in-flight capture request of a shard connects at once
        daemon_threads = True

    Server(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    serve(sys.argv[1:])
