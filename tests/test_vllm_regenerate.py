"""Regeneration through a real `vllm serve` (slow; skipped unless $EAGLE_VLLM_PYTHON names a vLLM interpreter):
greedy records equal the HF backend's token for token (a chat model over /v1/chat/completions, and stories260K,
a raw-text model, over /v1/completions), a server killed mid-run loses and duplicates nothing once the command is
rerun, and a server that is down, names another model or refuses an over-long prompt gives one line (the
over-long prompt is a rejected record). Without an engine: tests/test_regenerate_server.py."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from data_prep.regenerate import read_parts
from data_prep.target import load_target_config
from engine.head_dim_pad import servable_target
from engine.vllm_server import VLLMServer
from test_data_prep_helpers import CORPUS, save_target

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


def conversations(n: int) -> list[dict]:
    """ShareGPT records; every third has a second user turn (the reply to it sees the target's own first answer)."""
    out = []
    for i in range(n):
        turns = [{"from": "human", "value": CORPUS[i % len(CORPUS)]}, {"from": "gpt", "value": "old"}]
        if i % 3 == 0:
            turns += [{"from": "human", "value": "Tell me more."}, {"from": "gpt", "value": "old"}]
        out.append({"id": f"c{i}", "conversations": turns})
    return out


def data_prep(args: list[str], cwd: Path = REPO, background: bool = False):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(REPO / "data_prep" / "main.py"), *args, "--no-progress"]
    if background:
        return subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=3600)
    return proc.returncode, proc.stdout, proc.stderr


def token_ids(run: Path) -> dict[str, list]:
    return {k: [m.get("token_ids") for m in r["messages"] if m["role"] == "assistant"]
            for k, r in read_parts(run / "data" / "regenerated").items()}


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """A random 2-layer Llama with a ChatML template, 18 conversations, and its HF-backend regeneration."""
    root = tmp_path_factory.mktemp("chat")
    target = save_target(root / "target", "chatml")
    (root / "convs.json").write_text(json.dumps(conversations(18)))
    base = ["--recipe", "tiny", f"target.path={target}", "target.chat_template=chatml", f"data.source={root / 'convs.json'}",
            "data.max_new_tokens=24", "data.max_length=256", "data.cache_features=false", "data.gen_batch_size=4"]
    code, out, err = data_prep(base + [f"output_dir={root / 'hf'}"])
    assert code == 0, err[-2000:]
    return root, base


def test_chat_model_through_vllm_equals_hf_token_for_token(chat, vllm_python):
    root, base = chat
    code, out, err = data_prep(base + [f"output_dir={root / 'vllm'}", "data.backend=openai", "data.serve=true",
                                       f"data.engine_python={vllm_python}"])
    assert code == 0, err[-3000:]
    hf, vllm = token_ids(root / "hf"), token_ids(root / "vllm")
    assert len(hf) == 18 and vllm == hf and all(ids is not None for turns in vllm.values() for ids in turns)
    assert sum(len(t) for t in vllm.values()) == 24  # second turns answered from the server's own first answers
    assert (root / "vllm" / "data" / "tokenized.jsonl").read_bytes() == (root / "hf" / "data" / "tokenized.jsonl").read_bytes()
    report = json.loads((root / "vllm" / "data" / "tokenize_report.json").read_text())
    assert report["from_token_ids"] + report["token_ids_fallback"] == 18 and report["from_token_ids"] > 0
    assert not any(p.name.startswith("vllm_server") and p.suffix == ".pid" for p in (root / "vllm" / "data").iterdir())


@pytest.mark.shared
def test_raw_text_model_through_the_completions_endpoint(shared_dir, tmp_path, vllm_python):
    base = ["--recipe", "tiny", f"target.path={shared_dir / 'models' / 'stories260K'}", "target.chat_template=plain",
            f"data.source={shared_dir / 'data' / 'conversations' / 'dummy_conversation.json'}", "data.max_records=16",
            "data.max_new_tokens=32", "data.extra_stop_ids=[1]", "data.cache_features=false"]
    code, out, err = data_prep(base + [f"output_dir={tmp_path / 'hf'}"])
    assert code == 0, err[-2000:]
    code, out, err = data_prep(base + [f"output_dir={tmp_path / 'vllm'}", "data.backend=openai", "data.serve=true",
                                       "data.api_endpoint=completions", f"data.engine_python={vllm_python}"])
    assert code == 0, err[-3000:]
    assert token_ids(tmp_path / "vllm") == token_ids(tmp_path / "hf") and len(token_ids(tmp_path / "hf")) == 16
    assert (tmp_path / "vllm" / "data" / "tokenized.jsonl").read_bytes() == (tmp_path / "hf" / "data" / "tokenized.jsonl").read_bytes()


def one_error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in err, err[-2000:]
    return lines[0]


def test_server_failures_and_a_killed_server(chat, tmp_path, vllm_python):
    """One server of ours (a 320-token context) for: another model name, an over-long prompt, a SIGKILL mid-run;
    then the same command with data.serve resumes and ends with every record exactly once, equal to the HF
    records; and against the dead server the command is one line."""
    from transformers import AutoTokenizer

    root, base = chat
    model, _ = servable_target(str(root / "target"), load_target_config(root / "target"), tmp_path / "served")
    long = conversations(2)
    long[0]["conversations"][0]["value"] = " ".join(CORPUS) * 8
    assert len(AutoTokenizer.from_pretrained(root / "target")(long[0]["conversations"][0]["value"])["input_ids"]) > 320
    (tmp_path / "long.json").write_text(json.dumps(long))
    killed = base + [f"output_dir={tmp_path / 'killed'}", "data.backend=openai", "data.api_model=served",
                     "data.gen_batch_size=1"]
    server_args = ["--max-model-len", "320", "--dtype", "float32", "--enforce-eager", "--generation-config", "vllm"]
    with VLLMServer(vllm_python, model, tmp_path / "server.log", served_model_name="served", args=server_args) as server:
        api = [f"data.api_base={server.url}", "data.api_retries=1"]
        code, out, err = data_prep(base + [f"output_dir={tmp_path / 'wrong'}", "data.backend=openai",
                                           "data.api_model=nope", *api])
        assert code == 2 and "does not serve the model 'nope'" in one_error_line(err) and "['served']" in err
        code, out, err = data_prep(base + [f"output_dir={tmp_path / 'long'}", f"data.source={tmp_path / 'long.json'}",
                                           "data.backend=openai", "data.api_model=served", "data.max_length=4096", *api])
        assert code == 0, err[-2000:]
        rejects = [json.loads(x) for x in (tmp_path / "long" / "data" / "tokenize_rejects.jsonl").read_text().splitlines()]
        assert [r["id"] for r in rejects] == ["c0"] and "maximum context length is 320" in rejects[0]["reason"]
        proc = data_prep(killed + api, background=True)
        part = tmp_path / "killed" / "data" / "regenerated" / "part-00000-of-00001.jsonl"
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and (not part.exists() or len(part.read_text().splitlines()) < 4):
            time.sleep(0.5)
        os.killpg(server.proc.pid, signal.SIGKILL)  # the server crashes mid-run
        _, err = proc.communicate(timeout=600)
        dead = server.url
    assert proc.returncode == 2 and "failed after 2 attempts" in one_error_line(err)
    done = len(part.read_text().splitlines())
    assert 4 <= done < 18
    code, out, err = data_prep(killed + ["data.serve=true", f"data.engine_python={vllm_python}"])  # the same, served
    assert code == 0, err[-3000:]
    assert f"{18 - done} generated, {done} already done" in out
    ids = [json.loads(x)["id"] for x in part.read_text().splitlines()]
    assert len(ids) == len(set(ids)) == 18
    assert token_ids(tmp_path / "killed") == token_ids(root / "hf")
    code, out, err = data_prep(base + [f"output_dir={tmp_path / 'down'}", "data.backend=openai", f"data.api_base={dead}",
                                       "data.api_model=served", "data.api_retries=0"])
    assert code == 2 and "failed after 1 attempts" in one_error_line(err)


def test_tool_conversation_history_renders_in_vllm_as_here(tmp_path, vllm_python):
    """A history with tools, an assistant tool call with reasoning and a tool result, sent as the OpenAI API writes
    it: vLLM's rendering (its own template code) gives this project's prompt ids (the backend stops with an error
    otherwise), and the reply's generated ids equal the HF backend's."""
    from data_prep.chat_template import stop_token_ids
    from data_prep.regenerate import GenerationSettings, HFBackend, OpenAIBackend, Rejected
    from test_data_prep_helpers import build_model, build_reasoning_tokenizer

    tok = build_reasoning_tokenizer("qwen3")
    model_hf = build_model(len(tok))
    model_hf.config.max_position_embeddings = 1024  # the qwen3 tool preamble alone is ~500 tokens of this tokenizer
    model_hf.save_pretrained(tmp_path / "target")
    tok.save_pretrained(tmp_path / "target")
    model, _ = servable_target(str(tmp_path / "target"), load_target_config(tmp_path / "target"), tmp_path / "served")
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    hist = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "reasoning_content": "Use the tool.",
             "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": "sunny"}]
    settings = GenerationSettings(max_new_tokens=8, do_sample=False, temperature=1.0, top_p=1.0, seed=0)
    stops = stop_token_ids(tok, model_hf.generation_config, "qwen3")
    server_args = ["--max-model-len", "1024", "--dtype", "float32", "--enforce-eager", "--generation-config", "vllm"]
    with VLLMServer(vllm_python, model, tmp_path / "server.log", served_model_name="served", args=server_args) as server:
        backend = OpenAIBackend(server.url, "served", settings, retries=1, tokenizer=tok, stop_ids=stops,
                                max_prompt_tokens=1000)
        (reply,) = backend.generate_turn([hist], [tools])
    (want,) = HFBackend(model_hf, tok, settings, stops, max_prompt_tokens=1000).generate_turn([hist], [tools])
    assert not isinstance(want, Rejected) and not isinstance(reply, Rejected), (want, reply)  # the prompt fits
    assert reply.token_ids == want.token_ids and reply.text == want.text
