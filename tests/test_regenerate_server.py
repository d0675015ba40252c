"""Regeneration through an OpenAI-compatible server, without an engine: the backend's token ids, both endpoints,
the prompt check, the failure lines (down, 500, unknown model, over-long prompt), samples built from generated
ids, and the vLLM server launcher driven by a fake engine interpreter. The same against a real vLLM server:
tests/test_vllm_regenerate.py (slow)."""
from __future__ import annotations

import json
import signal
import sys
import textwrap
from http.server import BaseHTTPRequestHandler

import pytest

from data_prep.loss_mask import tokenize_records, tokenize_with_mask
from data_prep.regenerate import GenerationSettings, OpenAIBackend, Rejected, ServerError, regenerate_chunk
from data_prep.token_ids import prompt_ids, tokenize_from_token_ids
from eagle.cli_errors import is_expected
from engine.engine_process import EngineError, resolve_engine_python
from engine.vllm_server import VLLMServer
from test_data_prep_helpers import build_tokenizer
from test_data_prep_regenerate import local_server

SETTINGS = GenerationSettings(max_new_tokens=16, do_sample=False, temperature=1.0, top_p=1.0, seed=0)


def _dumps(value) -> bytes:
    return json.dumps(value).encode()


def _content(payload, chat, value):
    key = "message" if chat else "text"
    payload["choices"][0][key] = {"role": "assistant", "content": value} if chat else value
    return _dumps(payload)


WRONG_SHAPES = {  # name -> (good payload, chat) -> the bytes a misbehaving server answers with HTTP 200
    "number-as-text": lambda p, chat: _content(p, chat, 42),
    "object-as-text": lambda p, chat: _content(p, chat, {"text": "hi"}),
    "string-as-message": lambda p, chat: (p["choices"][0].update(message="hello") if chat else
                                          p["choices"].__setitem__(0, "hello")) or _dumps(p),
    "no-choices": lambda p, chat: _dumps({k: v for k, v in p.items() if k != "choices"}),
    "empty-choices": lambda p, chat: _dumps({**p, "choices": []}),
    "choices-string": lambda p, chat: _dumps({**p, "choices": "none"}),
    "answer-list": lambda p, chat: _dumps([p]),
    "count-as-string": lambda p, chat: _dumps({**p, "usage": {"completion_tokens": "many"}}),
    "ids-as-string": lambda p, chat: p["choices"][0].update(token_ids="1 2 3") or _dumps(p),
    "not-json": lambda p, chat: b"<html>502 Bad Gateway</html>",
}
SHAPE_NEEDLES = {  # what the one line says: the field and what came back
    "number-as-text": "message.content is int 42, expected text", "object-as-text": "is dict {\"text\": \"hi\"}",
    "string-as-message": "is str \"hello\"", "no-choices": "choices is missing, expected a non-empty list",
    "empty-choices": "choices is list [], expected a non-empty list", "choices-string": "choices is str \"none\"",
    "answer-list": "the answer is list", "count-as-string": "usage.completion_tokens is str \"many\", expected a count",
    "ids-as-string": "choices[0].token_ids is str \"1 2 3\", expected a list of token ids",
    "not-json": "the answer is not JSON",
}


class FakeServer(BaseHTTPRequestHandler):
    """vLLM-shaped answers: token_ids and prompt_token_ids when asked; `mode` picks a failure."""

    mode = "ok"
    shape = ""  # mode "shape": the WRONG_SHAPES entry answered (HTTP 200) after `good_requests` good answers
    good_requests = 0
    tokenizer = None
    reply_ids: list[int] = []  # what the fake "generated": "a reply é" + the stop id 2
    max_context = 40
    requests: list = []

    def _send(self, code: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send(200, {"data": [{"id": "served-model"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        FakeServer.requests.append({"path": self.path, "body": body})
        if self.mode == "500":
            return self._send(500, {"error": {"message": "internal engine error", "code": 500}})
        if body["model"] != "served-model":
            return self._send(404, {"error": {"message": f"The model `{body['model']}` does not exist.", "code": 404}})
        chat = self.path.endswith("/chat/completions")
        ids = (prompt_ids(self.tokenizer, served_messages(body["messages"]), body.get("tools")) if chat else body["prompt"])
        if self.mode == "other-template" and chat:
            ids = ids[1:]
        if len(ids) > self.max_context:
            return self._send(400, {"error": {"message": f"This model's maximum context length is {self.max_context} tokens. However, "
                                                         f"your prompt contains {len(ids)} input tokens.", "code": 400}})
        choice = {"index": 0, "finish_reason": "stop", "token_ids": self.reply_ids if body.get("return_token_ids") else None}
        text = " a reply "  # the detokenizer held the incomplete last character back, as vLLM's does
        choice.update({"message": {"role": "assistant", "content": text}} if chat else {"text": text})
        payload = {"choices": [choice], "usage": {"completion_tokens": len(self.reply_ids)}}
        if body.get("return_token_ids"):
            if chat:
                payload["prompt_token_ids"] = ids
            else:
                choice["prompt_token_ids"] = ids
        if self.mode == "shape" and len(FakeServer.requests) > FakeServer.good_requests:
            return self._send_raw(WRONG_SHAPES[FakeServer.shape](payload, chat))
        self._send(200, payload)

    def _send_raw(self, data: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


def served_messages(messages: list[dict]) -> list[dict]:
    """What vLLM hands its chat template (renderers/chat_utils.py): tool-call arguments parsed back from JSON strings,
    `reasoning` as `reasoning_content`."""
    out = []
    for m in messages:
        m = dict(m)
        if "tool_calls" in m:
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
        if "reasoning" in m:
            m["reasoning_content"] = m.pop("reasoning")
        out.append(m)
    return out


@pytest.fixture()
def server():
    FakeServer.mode, FakeServer.requests, FakeServer.tokenizer = "ok", [], build_tokenizer("chatml")
    FakeServer.max_context = 40
    FakeServer.shape, FakeServer.good_requests = "", 0
    ids = FakeServer.tokenizer(" a reply é", add_special_tokens=False)["input_ids"]
    FakeServer.reply_ids = ids[:-1] + [2]  # the last byte of "é" cut off by the stop token
    with local_server(FakeServer) as url:
        yield url


def backend(url, endpoint="chat", model="served-model", **kw):
    kw.setdefault("tokenizer", FakeServer.tokenizer)
    return OpenAIBackend(url, model, SETTINGS, retries=kw.pop("retries", 0), endpoint=endpoint, stop_ids=[2],
                         max_prompt_tokens=kw.pop("max_prompt_tokens", 200), **kw)


def history(text="Hi there"):
    return [{"role": "user", "content": text}]


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_replies_keep_the_generated_token_ids(server, endpoint):
    out = backend(server, endpoint).generate_turn([history()])[0]
    assert out.token_ids == FakeServer.reply_ids and out.num_tokens == len(FakeServer.reply_ids)
    # the text is decoded from the ids (stop token dropped) as the HF backend decodes them, not the server's text
    assert out.text == FakeServer.tokenizer.decode(FakeServer.reply_ids[:-1], skip_special_tokens=True).strip()
    assert out.text.startswith("a reply") and out.text != "a reply"
    body = FakeServer.requests[-1]["body"]
    assert body["return_token_ids"] is True and body["stop_token_ids"] == [2] and body["temperature"] == 0.0
    if endpoint == "completions":  # fed this project's rendering of the prompt, as ids
        assert FakeServer.requests[-1]["path"] == "/v1/completions"
        assert body["prompt"] == prompt_ids(FakeServer.tokenizer, history())
    else:
        assert body["messages"] == history()


def test_without_token_ids_the_vllm_extensions_are_not_sent(server):
    out = backend(server, token_ids=False).generate_turn([history()])[0]
    assert out.token_ids is None and out.text == "a reply"  # no ids: the server's text
    assert "return_token_ids" not in FakeServer.requests[-1]["body"]


def test_a_server_rendering_another_template_is_an_error(server):
    FakeServer.mode = "other-template"
    with pytest.raises(ServerError, match="its chat template is not target.chat_template") as e:
        backend(server).generate_turn([history()])
    assert is_expected(e.value)  # a UserError: one line at the CLI


def test_failures_give_one_clear_line(server):
    with pytest.raises(ServerError, match=r"does not serve the model 'nope'.*serves \['served-model'\]"):
        backend(server, model="nope").generate_turn([history()])
    FakeServer.mode = "500"
    with pytest.raises(ServerError, match=r"failed after 2 attempts: HTTP 500: .*internal engine error"):
        backend(server, retries=1).generate_turn([history()])
    assert len(FakeServer.requests) == 3  # the 500 was retried once
    with pytest.raises(ServerError, match=r"failed after 1 attempts: .*(refused|Errno)"):
        OpenAIBackend("http://127.0.0.1:9/v1", "m", SETTINGS, retries=0, timeout_s=2).generate_turn([history()])


@pytest.fixture()
def no_backoff(monkeypatch):
    """The retries' back-off sleeps recorded, not slept."""
    import data_prep.regenerate as regenerate
    slept = []
    monkeypatch.setattr(regenerate.time, "sleep", slept.append)
    return slept


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("shape", sorted(WRONG_SHAPES))
def test_a_200_answer_of_the_wrong_shape_is_retried_then_one_line(server, shape, endpoint, no_backoff):
    FakeServer.mode, FakeServer.shape = "shape", shape
    with pytest.raises(ServerError) as e:
        backend(server, endpoint, retries=1).generate_turn([history()])
    line = str(e.value)
    assert "\n" not in line and is_expected(e.value)
    assert line.startswith(f"{server}/{'chat/completions' if endpoint == 'chat' else 'completions'} answered HTTP 200 "
                           f"with a malformed {endpoint} completion (2 attempts): ")
    needle = SHAPE_NEEDLES[shape]
    if endpoint == "completions":
        needle = {"number-as-text": "choices[0].text is int 42, expected text",
                  "string-as-message": "choices[0] is str \"hello\", expected an object"}.get(shape, needle)
    assert needle in line, line
    assert len(FakeServer.requests) == 2 and no_backoff == [1.0]  # retried once after a back-off, as a 5xx is


def test_a_wrong_shape_once_is_retried_and_the_run_goes_on(server, no_backoff):
    FakeServer.mode, FakeServer.shape = "shape", "number-as-text"
    FakeServer.good_requests = 10**9  # answers well...
    calls = []
    real = FakeServer.do_POST

    def flaky(self):  # ...except the first request
        calls.append(1)
        FakeServer.good_requests = 0 if len(calls) == 1 else 10**9
        real(self)

    FakeServer.do_POST = flaky
    try:
        out = backend(server, retries=1).generate_turn([history()])[0]
    finally:
        FakeServer.do_POST = real
    assert out.token_ids == FakeServer.reply_ids and len(calls) == 2


def test_a_server_turning_bad_mid_run_loses_nothing_already_written(server, tmp_path, no_backoff):
    """Two chunks answered, then malformed answers: the run stops with the one line; the part file keeps the two
    chunks; a rerun against a good server regenerates only the rest, no record twice."""
    from data_prep.regenerate import read_parts, regenerate_shard
    records = [{"id": f"r{i}", "messages": history(f"Question {i}?")} for i in range(6)]
    FakeServer.mode, FakeServer.shape, FakeServer.good_requests = "shape", "no-choices", 4
    with pytest.raises(ServerError, match="choices is missing"):
        regenerate_shard(records, backend(server, concurrency=1), tmp_path, 0, 1, batch_size=2, seed=0, progress=False)
    kept = read_parts(tmp_path)
    assert len(kept) == 4  # chunks 1 and 2 (two records each), appended when complete
    FakeServer.mode = "ok"
    stats = regenerate_shard(records, backend(server), tmp_path, 0, 1, batch_size=2, seed=0, progress=False)
    assert stats.records_skipped_done == 4 and stats.records_generated == 2
    lines = (tmp_path / "part-00000-of-00001.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["id"] for line in lines) == sorted(r["id"] for r in records)
    assert all(read_parts(tmp_path)[k] == v for k, v in kept.items())  # what was written is unchanged


def test_overlong_prompts_are_rejected_records(server):
    long_text = "The quick brown fox jumps over the lazy dog. " * 6
    by_server = backend(server).generate_turn([history(long_text)])[0]  # over the fake server's 40-token context
    assert isinstance(by_server, Rejected) and "maximum context length is 40" in by_server.reason
    by_us = backend(server, max_prompt_tokens=10).generate_turn([history()])[0]  # never sent
    assert isinstance(by_us, Rejected) and "does not fit max_length 10" in by_us.reason
    recs = regenerate_chunk([{"id": "long", "messages": history(long_text)}, {"id": "ok", "messages": history()}],
                            backend(server))
    assert recs[0]["stopped_at_max_length"] and "maximum context length" in recs[0]["reject_reason"]
    assert recs[1]["messages"][1]["token_ids"] == FakeServer.reply_ids
    tokenized, stats = tokenize_records(recs, FakeServer.tokenizer, max_length=512)
    assert [r["id"] for r in tokenized] == ["ok"] and stats.from_token_ids == 1
    assert stats.rejects[0]["id"] == "long" and "maximum context length" in stats.rejects[0]["reason"]


def test_samples_are_built_from_the_generated_ids():
    tok = build_tokenizer("chatml")
    reply = tok("Hello world", add_special_tokens=False)["input_ids"]
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello world", "token_ids": reply + [eot]},
            {"role": "user", "content": "More"}, {"role": "assistant", "content": "Hello world", "token_ids": reply + [eot]}]
    ids, mask = tokenize_from_token_ids(tok, msgs)
    text_ids, text_mask = tokenize_with_mask(tok, [{k: m[k] for k in ("role", "content")} for m in msgs])
    assert ids == text_ids[: len(ids)] and mask == text_mask[: len(ids)]  # round-trip text: the same sample
    assert sum(mask) == 2 * (len(reply) + 1)
    # a reply whose ids are not what its text tokenises to: the sample holds the generated ids
    odd = [reply[0]] + reply  # e.g. a generated leading token the text strip dropped
    ids, mask = tokenize_from_token_ids(tok, msgs[:1] + [{**msgs[1], "token_ids": odd + [eot]}])
    assert ids[-len(odd) - 1:] == odd + [eot] and mask[-len(odd) - 1:] == [1] * (len(odd) + 1)
    # ... and a later turn's prompt (rendered from the text) cannot extend it: the text path is used, counted
    assert tokenize_from_token_ids(tok, msgs[:1] + [{**msgs[1], "token_ids": odd + [eot]}] + msgs[2:]) is None
    _, stats = tokenize_records([{"id": "x", "messages": msgs[:1] + [{**msgs[1], "token_ids": odd + [eot]}] + msgs[2:]}],
                                tok, max_length=512)
    assert stats.token_ids_fallback == 1 and stats.kept == 1


# --------------------------------------------------------------------------- the server launcher
FAKE_ENGINE = textwrap.dedent("""\
    #!{python}
    import sys
    from http.server import BaseHTTPRequestHandler, HTTPServer
    args = sys.argv[1:]
    if args[:2] == ["-c", args[1]] and "find_spec" in args[1]:
        sys.exit(0)  # check_engine: "vllm is importable"
    if "{mode}" == "crash":
        print("RuntimeError: the engine could not allocate its KV cache")
        sys.exit(3)
    port = int(args[args.index("--port") + 1])
    class H(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *a):
            pass
    print("fake engine serving", args[2], flush=True)
    HTTPServer(("127.0.0.1", port), H).serve_forever()
""")


def fake_engine(tmp_path, mode="ok"):
    path = tmp_path / f"python-{mode}"
    path.write_text(FAKE_ENGINE.format(python=sys.executable, mode=mode))
    path.chmod(0o755)
    return str(path)


def test_server_starts_waits_and_stops(tmp_path):
    server = VLLMServer(fake_engine(tmp_path), "MODEL", tmp_path / "server.log", startup_timeout_s=60)
    with server:
        assert server.healthy() and server.died() is None and server.url.endswith(f":{server.port}/v1")
    assert server.exit_code() is not None and not server.healthy()  # the whole process group is gone
    assert "-m vllm_side.cli serve MODEL --host 127.0.0.1" in (tmp_path / "server.log").read_text()


def test_a_server_that_dies_is_named(tmp_path):
    with pytest.raises(EngineError, match=r"exited with code 3 before it was ready .*KV cache"):
        VLLMServer(fake_engine(tmp_path, "crash"), "MODEL", tmp_path / "crash.log", startup_timeout_s=60).__enter__()
    server = VLLMServer(fake_engine(tmp_path), "MODEL", tmp_path / "kill.log", startup_timeout_s=60)
    with server:
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait()
        assert "was killed by SIGKILL" in server.died()


def test_engine_python_must_have_vllm(tmp_path, monkeypatch):
    monkeypatch.delenv("EAGLE_VLLM_PYTHON", raising=False)
    with pytest.raises(EngineError, match="EAGLE_VLLM_PYTHON"):
        resolve_engine_python("")
    with pytest.raises(EngineError, match="cannot import vllm"):
        resolve_engine_python(sys.executable)  # this venv never has vllm
    with pytest.raises(EngineError, match="No such file"):
        resolve_engine_python(str(tmp_path / "missing-python"))
    monkeypatch.setenv("EAGLE_VLLM_PYTHON", fake_engine(tmp_path))
    assert resolve_engine_python("") == fake_engine(tmp_path)


def test_the_data_prep_command_names_the_server_and_field_and_keeps_what_was_written(server, tmp_path, capsys,
                                                                                      no_backoff):
    """`data_prep/main.py` against a server that turns to HTTP 200 answers of the wrong shape after two chunks: one
    line naming the server, the field and what came back; the two chunks stay; the same command against a good
    server then regenerates only the rest, every record once."""
    from data_prep.main import main
    from data_prep.regenerate import read_parts
    from fault_helpers import assert_one_line_error, run_cli
    from test_data_prep_helpers import save_target

    target = save_target(tmp_path / "target", "chatml")
    convs = [{"id": f"c{i}", "conversations": [{"from": "human", "value": f"Question {i}?"},
                                                {"from": "gpt", "value": "old"}]} for i in range(6)]
    (tmp_path / "convs.json").write_text(json.dumps(convs))
    run = tmp_path / "run"
    argv = ["--recipe", "tiny", f"target.path={target}", "target.chat_template=chatml",
            f"data.source={tmp_path / 'convs.json'}", "data.max_new_tokens=16", "data.max_length=256",
            "data.cache_features=false", "data.gen_batch_size=2", "data.backend=openai", f"data.api_base={server}",
            "data.api_model=served-model", "data.api_retries=1", f"output_dir={run}", "--no-progress"]
    FakeServer.mode, FakeServer.shape, FakeServer.good_requests = "shape", "number-as-text", 4
    code, _, err = run_cli(main, argv, capsys)
    assert_one_line_error(code, err, f"{server}/chat/completions answered HTTP 200 with a malformed chat completion",
                          "choices[0].message.content is int 42, expected text", "finished records are kept")
    regenerated = run / "data" / "regenerated"
    kept = read_parts(regenerated)
    assert len(kept) == 4  # two chunks of two, appended when complete
    FakeServer.mode = "ok"
    code, _, err = run_cli(main, argv, capsys)
    assert code == 0, err
    lines = (regenerated / "part-00000-of-00001.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["id"] for line in lines) == [f"c{i}" for i in range(6)]
    assert {k: read_parts(regenerated)[k] for k in kept} == kept


def test_tool_conversations_reach_the_server_as_openai_requests(server):
    """The chat request carries the tools and the history's calls as the OpenAI API writes them (arguments as JSON
    strings, reasoning under `reasoning`); rendered the way vLLM does, they give this project's prompt ids (else the
    backend would stop with the template-mismatch error)."""
    from test_data_prep_helpers import build_reasoning_tokenizer

    FakeServer.tokenizer, FakeServer.max_context = build_reasoning_tokenizer("qwen3"), 4000
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}]
    hist = [{"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "", "reasoning_content": "call f",
             "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]},
            {"role": "tool", "content": "ok"}]
    out = backend(server, max_prompt_tokens=4000).generate_turn([hist], [tools])[0]
    assert out.token_ids == FakeServer.reply_ids
    body = FakeServer.requests[-1]["body"]
    assert body["tools"] == tools and body["tool_choice"] == "none"  # the calls are parsed from the text here
    assert body["messages"][1]["tool_calls"][0]["function"]["arguments"] == '{"x": 1}'
    # the API requires call ids: a call without one gets one, and the result after it answers it
    assert body["messages"][1]["tool_calls"][0]["id"] == "call-1-0" == body["messages"][2]["tool_call_id"]
    assert body["messages"][1]["reasoning"] == "call f" and "reasoning_content" not in body["messages"][1]
    assert hist[1]["tool_calls"][0]["function"]["arguments"] == {"x": 1}  # the history itself is not changed
