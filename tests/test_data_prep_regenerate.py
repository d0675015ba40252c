"""Regeneration: multi-turn order, batched == unbatched, resume equality, sharding, length flag, OpenAI backend."""
import contextlib
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from data_prep.chat_template import stop_token_ids
from data_prep.regenerate import (
    GenerationSettings,
    HFBackend,
    OpenAIBackend,
    part_path,
    read_parts,
    regenerate_chunk,
    regenerate_shard,
)
from test_data_prep_helpers import CORPUS, build_model, build_tokenizer, one_torch_thread  # noqa: F401


def conversations(n):
    out = []
    for i in range(n):
        msgs = [{"role": "user", "content": CORPUS[i % len(CORPUS)]}, {"role": "assistant", "content": "OLD"}]
        if i % 2 == 0:
            msgs += [{"role": "user", "content": "And then?"}, {"role": "assistant", "content": "OLD2"},
                     {"role": "user", "content": "Thanks!"}]
        out.append({"id": f"c{i}", "messages": msgs})
    return out


@pytest.fixture(scope="module")
def target():
    tok = build_tokenizer("chatml")
    model = build_model(len(tok))
    return model, tok


def hf_backend(target, max_new_tokens=6, max_prompt_tokens=512, do_sample=False):
    model, tok = target
    s = GenerationSettings(max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=1.0, top_p=1.0, seed=0)
    return HFBackend(model, tok, s, stop_token_ids(tok, model.generation_config, "chatml"), max_prompt_tokens)


class Recording:
    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def generate_turn(self, histories, tools=None):
        self.calls.append([list(h) for h in histories])
        return self.inner.generate_turn(histories, tools)


def test_multi_turn_sees_own_answers_and_matches_unbatched_generate(target):
    model, tok = target
    backend = Recording(hf_backend(target))
    out = regenerate_chunk(conversations(3), backend)
    # turn 1 for all 3 conversations in one batch, then turn 2 and 3 for the multi-turn ones
    assert [len(c) for c in backend.calls] == [3, 2, 2]
    for rec in out:
        msgs = rec["messages"]
        assert all(m["content"] not in ("OLD", "OLD2") for m in msgs)
        assert [m["role"] for m in msgs] == ["user", "assistant"] * (len(msgs) // 2)
    # the second-turn prompt holds the model's own first answer
    first_answer = out[0]["messages"][1]
    assert backend.calls[1][0][1] == first_answer and backend.calls[1][0][2]["content"] == "And then?"
    # batch of one, no padding: identical to a plain greedy generate on that history
    single = regenerate_chunk([conversations(1)[0]], hf_backend(target))[0]
    hist = single["messages"][:1]
    ids = tok.apply_chat_template(hist, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
    ref = model.generate(ids, max_new_tokens=6, do_sample=False, eos_token_id=stop_token_ids(tok, model.generation_config, "chatml"),
                         pad_token_id=0)[0, ids.shape[1]:].tolist()
    stops = set(stop_token_ids(tok, model.generation_config, "chatml"))
    ref = ref[: next((k for k, t in enumerate(ref) if t in stops), len(ref))]
    assert single["messages"][1]["content"] == tok.decode(ref, skip_special_tokens=True).strip()


def test_length_limit_is_flagged_and_long_prompts_stop(target):
    out = regenerate_chunk(conversations(2), hf_backend(target, max_new_tokens=1))
    assert all(r["length_limited"] for r in out if r["generated_tokens"] > 0)
    out = regenerate_chunk(conversations(2), hf_backend(target, max_prompt_tokens=20))
    assert out[0]["stopped_at_max_length"]  # the 2nd turn prompt is past 20 tokens


class Interrupt(Exception):
    pass


def test_resume_after_interrupt_equals_uninterrupted_byte_for_byte(target, tmp_path):
    convs = conversations(7)
    full = tmp_path / "full"
    regenerate_shard(convs, hf_backend(target), full, 0, 1, batch_size=2, seed=0, progress=False)

    resumed = tmp_path / "resumed"
    backend = hf_backend(target)
    calls = {"n": 0}
    inner = backend.generate_turn

    def flaky(histories, tools=None):
        calls["n"] += 1
        if calls["n"] == 5:  # dies in the middle of the 3rd chunk
            raise Interrupt
        return inner(histories, tools)

    backend.generate_turn = flaky
    with pytest.raises(Interrupt):
        regenerate_shard(convs, backend, resumed, 0, 1, batch_size=2, seed=0, progress=False)
    partial = read_parts(resumed)
    assert 0 < len(partial) < 7
    # a crash while writing leaves half a line: it is cut off on resume
    with open(part_path(resumed, 0, 1), "a") as f:
        f.write('{"id": "half')
    stats = regenerate_shard(convs, hf_backend(target), resumed, 0, 1, batch_size=2, seed=0, progress=False)
    assert stats.records_skipped_done == len(partial) and stats.records_generated == 7 - len(partial)
    assert part_path(resumed, 0, 1).read_bytes() == part_path(full, 0, 1).read_bytes()


def test_shards_cover_every_record_once(target, tmp_path):
    convs = conversations(5)
    for i in range(2):
        regenerate_shard(convs, hf_backend(target), tmp_path, i, 2, batch_size=2, seed=0, progress=False)
    lines = [json.loads(x) for i in range(2) for x in part_path(tmp_path, i, 2).read_text().splitlines()]
    assert sorted(r["id"] for r in lines) == sorted(c["id"] for c in convs)
    # a rerun with another shard count skips everything already done
    stats = regenerate_shard(convs, hf_backend(target), tmp_path, 0, 1, batch_size=2, seed=0, progress=False)
    assert stats.records_generated == 0 and stats.records_skipped_done == 5


# --------------------------------------------------------------------------- OpenAI-compatible backend
class ChatServer(BaseHTTPRequestHandler):
    requests = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        ChatServer.requests.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
        if body["model"] == "bad":
            self.send_response(400)
            self.end_headers()
            self.wfile.write(b'{"error": "unknown model"}')
            return
        msgs = body["messages"]
        n_user = sum(m["role"] == "user" for m in msgs)
        text = f"reply {n_user} to {msgs[-1]['content']}"
        finish = "length" if "LONG" in msgs[-1]["content"] else "stop"
        payload = {"choices": [{"message": {"role": "assistant", "content": text}, "finish_reason": finish}],
                   "usage": {"completion_tokens": 4}}
        data = json.dumps(payload).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@contextlib.contextmanager
def local_server(handler: type[BaseHTTPRequestHandler]):
    """`handler` answering on 127.0.0.1 (a free port) in a thread; yields the API base URL (.../v1)."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture()
def server():
    ChatServer.requests = []
    with local_server(ChatServer) as url:
        yield url


def test_openai_backend_round_trip(server, tmp_path):
    s = GenerationSettings(max_new_tokens=32, do_sample=False, temperature=1.0, top_p=1.0, seed=0)
    backend = OpenAIBackend(server, "tiny", s, api_key="sk-test", retries=0, concurrency=2)
    convs = conversations(3)
    convs[1]["messages"][0]["content"] = "LONG please"
    stats = regenerate_shard(convs, backend, tmp_path, 0, 1, batch_size=2, seed=0, progress=False)
    assert stats.records_generated == 3 and stats.length_limited == 1 and stats.generated_tokens == 4 * 7
    done = read_parts(tmp_path)
    assert done["c0"]["messages"] == [
        {"role": "user", "content": CORPUS[0]}, {"role": "assistant", "content": f"reply 1 to {CORPUS[0]}"},
        {"role": "user", "content": "And then?"}, {"role": "assistant", "content": "reply 2 to And then?"},
        {"role": "user", "content": "Thanks!"}, {"role": "assistant", "content": "reply 3 to Thanks!"},
    ]
    assert done["c1"]["length_limited"] and not done["c0"]["length_limited"]
    req = ChatServer.requests[0]
    assert req["path"] == "/v1/chat/completions" and req["auth"] == "Bearer sk-test"
    assert req["body"]["max_tokens"] == 32 and req["body"]["temperature"] == 0.0
    # the 2nd turn request carries the server's own first answer
    second = [r["body"]["messages"] for r in ChatServer.requests if len(r["body"]["messages"]) == 3 and
              r["body"]["messages"][0]["content"] == CORPUS[0]][0]
    assert second[1]["content"] == f"reply 1 to {CORPUS[0]}"


def test_openai_backend_errors_are_clear(server):
    s = GenerationSettings(max_new_tokens=8, do_sample=False, temperature=1.0, top_p=1.0, seed=0)
    with pytest.raises(RuntimeError, match="HTTP 400.*unknown model"):
        OpenAIBackend(server, "bad", s, retries=0).generate_turn([[{"role": "user", "content": "x"}]])
    with pytest.raises(RuntimeError, match="failed after 1 attempts"):
        OpenAIBackend("http://127.0.0.1:9/v1", "m", s, retries=0, timeout_s=2).generate_turn([[{"role": "user", "content": "x"}]])
