"""Regenerate assistant turns with the target (on-policy data), turn by turn, resumable, sharded.

Every user turn is answered by the target given the conversation so far, where the earlier
assistant turns are the TARGET's own earlier answers. Conversations of one shard are sorted by
prompt length and cut into fixed chunks of `batch_size`; a chunk is generated as one batch per turn
and appended to the shard's part file when all its turns are done. A rerun skips finished ids, and
because chunks are fixed (and sampling is seeded per chunk) it reproduces an uninterrupted run.

Backends: `HFBackend` (transformers `generate`, batched, left padding) and `OpenAIBackend` (an
OpenAI-compatible server such as vLLM or SGLang: `/v1/chat/completions`, or `/v1/completions` fed the prompt ids
this project renders, for raw-text models). Both keep the generated token ids on every reply (`token_ids`, see
data_prep/token_ids.py); a prompt too long for the target (or the server) is a rejected record, not an error.
"""
from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from data_prep.assistant_spans import split_reply
from data_prep.token_ids import chat_messages, prompt_ids
from data_prep.tool_calls import FORMATS as CALL_FORMATS
from data_prep.tool_calls import ToolCallFormat
from eagle.state_files import StateFile, read_json_state, register, write_json_state
from engine.engine_process import EngineError


@dataclass
class GenerationSettings:
    max_new_tokens: int
    do_sample: bool
    temperature: float
    top_p: float
    seed: int


@dataclass
class Reply:
    text: str
    num_tokens: int  # generated tokens, stop token included (server-reported for the openai backend)
    hit_length_limit: bool  # generation stopped at max_new_tokens, not at a stop token
    token_ids: list[int] | None = None  # the generated ids, stop token included (None: the server gave none)


@dataclass
class Rejected:
    """No reply: the prompt is too long for the target or the server (the record is rejected, not the run)."""

    reason: str


def too_long(n: int, max_length: int) -> str:
    return f"the prompt alone does not fit max_length {max_length} ({n} tokens)"


class ServerError(EngineError):
    """An OpenAI-compatible server failed in a way retrying will not fix (the message says what to change)."""


class HFBackend:
    """Batched transformers `generate` with left padding; stops at the template's end-of-turn ids."""

    def __init__(self, model, tokenizer, settings: GenerationSettings, stop_ids: list[int], max_prompt_tokens: int):
        self.model, self.tokenizer, self.settings = model, tokenizer, settings
        self.stop_ids = stop_ids
        self.max_prompt_tokens = max_prompt_tokens
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]

    def prompt_ids(self, history: list[dict], tools: list[dict] | None = None) -> list[int]:
        return prompt_ids(self.tokenizer, history, tools)

    @torch.inference_mode()
    def generate_turn(self, histories: list[list[dict]], tools: list | None = None) -> list[Reply | Rejected]:
        """One reply per history (which ends with a user or tool turn; `tools[i]`: history i's tool definitions);
        Rejected = prompt not shorter than max_prompt_tokens."""
        # lazy: transformers costs over a second at import; only the hf backend's generation needs it
        from transformers import GenerationConfig

        tools = tools or [None] * len(histories)
        prompts = [self.prompt_ids(h, t) for h, t in zip(histories, tools)]
        results: list[Reply | Rejected] = [
            Rejected(too_long(len(p), self.max_prompt_tokens)) for p in prompts]
        todo = [i for i, p in enumerate(prompts) if len(p) < self.max_prompt_tokens]
        if not todo:
            return results
        width = max(len(prompts[i]) for i in todo)
        input_ids = torch.full((len(todo), width), self.pad_id, dtype=torch.long)  # [B, W] left padded
        attention_mask = torch.zeros((len(todo), width), dtype=torch.long)
        for row, i in enumerate(todo):
            n = len(prompts[i])
            input_ids[row, width - n:] = torch.tensor(prompts[i])
            attention_mask[row, width - n:] = 1
        s = self.settings
        config = GenerationConfig(
            max_new_tokens=s.max_new_tokens, do_sample=s.do_sample, temperature=s.temperature if s.do_sample else None,
            top_p=s.top_p if s.do_sample else None, top_k=0 if s.do_sample else None,
            eos_token_id=self.stop_ids, pad_token_id=self.pad_id,
        )
        device = self.model.device
        out = self.model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device),
                                  generation_config=config)
        new = out[:, width:].cpu().tolist()  # [B, <= max_new_tokens]
        stops = set(self.stop_ids)
        for row, i in enumerate(todo):
            toks = new[row]
            end = next((k for k, t in enumerate(toks) if t in stops), None)
            hit = end is None and len(toks) >= s.max_new_tokens
            generated = toks if end is None else toks[: end + 1]  # what the target produced, its stop token included
            toks = toks if end is None else toks[:end]
            text = self.tokenizer.decode(toks, skip_special_tokens=True).strip()
            results[i] = Reply(text, len(generated), hit, generated)
        return results


class MalformedReply(ValueError):
    """An HTTP 200 answer whose JSON is not an OpenAI completion; the message names the field and what came back."""


def _shown(value) -> str:
    text = json.dumps(value, ensure_ascii=False) if not isinstance(value, bytes) else repr(value)
    return f"{type(value).__name__} {text[:80]}{'...' if len(text) > 80 else ''}"


def _ids(value, field: str) -> list[int] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
        raise MalformedReply(f"{field} is {_shown(value)}, expected a list of token ids")
    return value


def parse_reply(payload, endpoint: str) -> tuple[str, dict, dict, list[int] | None, list[int] | None]:
    """(text, choice, usage, generated ids, prompt ids) of an OpenAI-compatible completion, each field checked:
    MalformedReply names the first field of the wrong shape and what came back."""
    if not isinstance(payload, dict):
        raise MalformedReply(f"the answer is {_shown(payload)}, expected an object with choices")
    choices = payload.get("choices")
    if not isinstance(choices, list) or not choices:
        raise MalformedReply(f"choices is {_shown(choices) if 'choices' in payload else 'missing'}, expected a "
                             "non-empty list")
    choice = choices[0]
    if not isinstance(choice, dict):
        raise MalformedReply(f"choices[0] is {_shown(choice)}, expected an object")
    if endpoint == "chat":
        message = choice.get("message")
        if not isinstance(message, dict):
            raise MalformedReply(f"choices[0].message is {_shown(message) if 'message' in choice else 'missing'}, "
                                 "expected an object with content")
        text, field = message.get("content"), "choices[0].message.content"
    else:
        text, field = choice.get("text"), "choices[0].text"
    if text is not None and not isinstance(text, str):
        raise MalformedReply(f"{field} is {_shown(text)}, expected text")
    usage = payload.get("usage") or {}
    if not isinstance(usage, dict):
        raise MalformedReply(f"usage is {_shown(usage)}, expected an object")
    count = usage.get("completion_tokens")
    if count is not None and (not isinstance(count, int) or isinstance(count, bool) or count < 0):
        raise MalformedReply(f"usage.completion_tokens is {_shown(count)}, expected a count")
    if choice.get("finish_reason") is not None and not isinstance(choice["finish_reason"], str):
        raise MalformedReply(f"choices[0].finish_reason is {_shown(choice['finish_reason'])}, expected a string")
    generated = _ids(choice.get("token_ids"), "choices[0].token_ids")
    where = "prompt_token_ids" if endpoint == "chat" else "choices[0].prompt_token_ids"
    served_prompt = _ids(payload.get("prompt_token_ids") if endpoint == "chat" else choice.get("prompt_token_ids"), where)
    return text or "", choice, usage, generated, served_prompt


ENDPOINTS = ("chat", "completions")
# how vLLM, SGLang and OpenAI word a prompt that does not fit the model's context (HTTP 400)
CONTEXT_LENGTH_ERRORS = ("maximum context length", "context length", "context_length_exceeded", "too long")


class OpenAIBackend:
    """Calls an OpenAI-compatible server; one thread per conversation of a chunk.

    endpoint "chat": /chat/completions with the messages (the server applies its chat template); with a
    `tokenizer`, the prompt ids the server reports (vLLM `return_token_ids`) must equal this project's rendering,
    else the server's template is not the recipe's and the data would be off-policy: an error.
    endpoint "completions": /completions fed this project's prompt ids (needs `tokenizer`; raw-text models).
    token_ids: ask for vLLM's extensions `return_token_ids` and `stop_token_ids` (false for servers refusing them).
    A prompt of max_prompt_tokens or more ids is not sent (as the HF backend), and one the server refuses as too
    long for its context is a `Rejected` reply; other client errors stop the run with one line."""

    def __init__(self, api_base: str, model: str, settings: GenerationSettings, api_key: str | None = None,
                 timeout_s: float = 600.0, retries: int = 3, concurrency: int = 8, endpoint: str = "chat",
                 tokenizer=None, stop_ids: list[int] | None = None, max_prompt_tokens: int | None = None,
                 token_ids: bool = True):
        if endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint {endpoint!r}: expected one of {ENDPOINTS}")
        if endpoint == "completions" and tokenizer is None:
            raise ValueError("the completions endpoint is fed this project's prompt ids: it needs the tokenizer")
        self.api_base, self.endpoint = api_base.rstrip("/"), endpoint
        self.url = f"{self.api_base}/{'chat/completions' if endpoint == 'chat' else 'completions'}"
        self.model, self.settings, self.api_key = model, settings, api_key
        self.timeout_s, self.retries, self.concurrency = timeout_s, retries, max(1, concurrency)
        self.tokenizer, self.stop_ids, self.max_prompt_tokens = tokenizer, list(stop_ids or []), max_prompt_tokens
        self.token_ids = token_ids

    def _body(self, history: list[dict], ids: list[int] | None, tools: list[dict] | None = None) -> dict:
        s = self.settings
        body = {"model": self.model, "max_tokens": s.max_new_tokens,
                "temperature": s.temperature if s.do_sample else 0.0, "top_p": s.top_p if s.do_sample else 1.0,
                "seed": s.seed, "n": 1}
        if self.endpoint == "chat":
            body["messages"] = api_messages(history)
            if tools:  # rendered by the server's template; "none": the reply comes back as text, calls parsed here
                body["tools"], body["tool_choice"] = tools, "none"  # (vLLM refuses "auto" without a tool parser)
        else:
            body["prompt"] = ids
        if self.token_ids:
            body["return_token_ids"] = True
            if self.stop_ids:
                body["stop_token_ids"] = self.stop_ids
        return body

    def _post(self, body: dict) -> dict | Rejected:
        """The server's JSON answer (retrying 5xx, 429 and connection errors), or Rejected for a too-long prompt."""
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        last_error = None
        for attempt in range(self.retries + 1):
            req = urllib.request.Request(self.url, data=json.dumps(body).encode(), headers=headers, method="POST")
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    raw = resp.read()
            except urllib.error.HTTPError as e:
                detail = " ".join(e.read()[:400].decode(errors="replace").split())
                if e.code == 400 and any(m in detail.lower() for m in CONTEXT_LENGTH_ERRORS):
                    return Rejected(f"the server refused the prompt as too long: {detail}")
                if e.code == 404 and "model" in detail.lower():
                    models = served_models(self.api_base)
                    raise ServerError(f"{self.url} does not serve the model {self.model!r} (HTTP 404: {detail}); "
                                      f"it serves {models}: set data.api_model to one of them") from None
                if e.code < 500 and e.code != 429:  # a client error will not fix itself
                    raise ServerError(f"{self.url} answered HTTP {e.code}: {detail}") from None
                last_error = f"HTTP {e.code}: {detail}"
            except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
                last_error = str(getattr(e, "reason", None) or e)
            else:
                try:
                    return json.loads(raw.decode("utf-8"))
                except (UnicodeDecodeError, json.JSONDecodeError) as e:  # the caller retries it as a wrong shape
                    raise MalformedReply(f"the answer is not JSON ({type(e).__name__}: {e}; it begins "
                                         f"{raw[:60]!r})") from None
            if attempt < self.retries:
                time.sleep(min(2.0**attempt, 30.0))
        raise ServerError(f"{self.url} failed after {self.retries + 1} attempts: {last_error}")

    def _request(self, history: list[dict], tools: list[dict] | None = None) -> Reply | Rejected:
        """One reply. An answer of the wrong shape (HTTP 200, but a number where text belongs, a string where an
        object belongs, no choices...) is retried like a 5xx, `retries` times; then the run stops with one line
        naming the server, the field and what came back (records already appended stay; a rerun resumes)."""
        ours = prompt_ids(self.tokenizer, history, tools) if self.tokenizer is not None else None
        if ours is not None and self.max_prompt_tokens and len(ours) >= self.max_prompt_tokens:
            return Rejected(too_long(len(ours), self.max_prompt_tokens))
        for attempt in range(self.retries + 1):
            try:
                payload = self._post(self._body(history, ours, tools))
                if isinstance(payload, Rejected):
                    return payload
                reply = parse_reply(payload, self.endpoint)
                break
            except MalformedReply as e:
                if attempt == self.retries:
                    raise ServerError(f"{self.url} answered HTTP 200 with a malformed {self.endpoint} completion "
                                      f"({self.retries + 1} attempts): {e}; is data.api_base an OpenAI-compatible "
                                      "server (vLLM, SGLang)?") from None
                time.sleep(min(2.0**attempt, 30.0))
        text, choice, usage, generated, served_prompt = reply
        if ours is not None and served_prompt is not None and list(served_prompt) != ours:
            at = next((i for i, (a, b) in enumerate(zip(served_prompt, ours)) if a != b), min(len(ours), len(served_prompt)))
            raise ServerError(
                f"the server's prompt ids differ from this project's rendering of the same conversation at token {at} "
                f"(server {list(served_prompt[at:at + 5])}, ours {ours[at:at + 5]}; {len(served_prompt)} vs {len(ours)} "
                "ids): its chat template is not target.chat_template, so the replies would be off-policy; serve the "
                "recipe's template (data.serve does) or use data.api_endpoint=completions")
        num = usage.get("completion_tokens") or (len(generated) if generated is not None else 0)
        if generated is not None and self.tokenizer is not None:
            # the text as the HF backend decodes the same ids: vLLM's incremental detokenizer holds back a trailing
            # incomplete UTF-8 character, and the next turn's prompt is rendered from this text
            reply_ids = generated[:-1] if generated and generated[-1] in self.stop_ids else generated
            text = self.tokenizer.decode(reply_ids, skip_special_tokens=True)
        return Reply(text.strip(), num, choice.get("finish_reason") == "length", generated)

    def generate_turn(self, histories: list[list[dict]], tools: list | None = None) -> list[Reply | Rejected]:
        with ThreadPoolExecutor(self.concurrency) as pool:
            return list(pool.map(self._request, histories, tools or [None] * len(histories)))


def api_messages(history: list[dict]) -> list[dict]:
    """`history` as an OpenAI chat request carries it: tool-call arguments as JSON strings (the server parses them
    back for its template, vLLM's `_postprocess_messages`), reasoning under `reasoning` (what vLLM reads), and every
    call with an `id` and every tool result with its `tool_call_id`, which the API requires (a call without one gets
    `call-{turn}-{k}`; the k-th result after it answers the k-th call). The templates render none of these ids."""
    out, ids, k = [], [], 0
    for turn, m in enumerate(chat_messages(history)):
        if "tool_calls" in m:
            ids = [c.get("id") or f"call-{turn}-{j}" for j, c in enumerate(m["tool_calls"])]
            m["tool_calls"] = [{**c, "id": i, "function": {**c["function"], "arguments": json.dumps(
                c["function"]["arguments"], ensure_ascii=False)}} for c, i in zip(m["tool_calls"], ids)]
            k = 0
        if m["role"] == "tool":
            if "tool_call_id" not in m and k < len(ids):
                m["tool_call_id"] = ids[k]
            k += 1
        if "reasoning_content" in m:
            m["reasoning"] = m.pop("reasoning_content")
        out.append(m)
    return out


def served_models(api_base: str, timeout_s: float = 10.0) -> list[str] | None:
    """Model ids an OpenAI-compatible server lists at /models (None when it does not answer)."""
    try:
        with urllib.request.urlopen(api_base.rstrip("/") + "/models", timeout=timeout_s) as r:
            return [m.get("id") for m in json.loads(r.read()).get("data", [])]
    except (urllib.error.URLError, OSError, ValueError, AttributeError):
        return None


# --------------------------------------------------------------------------- resumable driver
def part_path(out_dir: Path, shard: int, num_shards: int) -> Path:
    return Path(out_dir) / f"part-{shard:05d}-of-{num_shards:05d}.jsonl"


def read_parts(out_dir: Path, own: Path | None = None) -> dict[str, dict]:
    """All finished records in `out_dir` (any shard layout). A partial last line (a crash mid-write) is
    ignored, and cut off in `own`, the part file this process appends to."""
    done: dict[str, dict] = {}
    if not Path(out_dir).is_dir():
        return done
    for path in sorted(Path(out_dir).glob("part-*.jsonl")):
        data = path.read_bytes()
        complete = data[: data.rfind(b"\n") + 1]
        if own is not None and path == own and len(complete) != len(data):
            with open(path, "r+b") as f:
                f.truncate(len(complete))
        for lineno, raw in enumerate(complete.splitlines(), 1):
            try:
                line = raw.decode("utf-8")
                rec = json.loads(line) if line.strip() else None
                if rec is not None:
                    done.setdefault(rec["id"], rec)
            except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: damaged regenerated record ({type(e).__name__}: {e}); delete that "
                                 "line (or the file) and rerun: the missing records are regenerated") from None
    return done


REGEN_SETTINGS = register(StateFile(
    "settings.json", "REGENERATED_DIR", writer="data_prep/regenerate.py", schema={"target": str, "chat_template": (str, type(None)), "backend": str, "max_length": int,
            "extra_stop_ids": [int], "max_new_tokens": int, "do_sample": bool, "temperature": float, "top_p": float,
            "seed": int, "*": object},
    rebuild="it guards the regenerated records beside it: restore it, or delete that folder (or set another "
            "output_dir) and rerun data_prep to regenerate them",
    when_missing="a new regeneration: the settings are written",
    example={"target": "models/t", "chat_template": "llama3", "backend": "hf", "max_length": 512, "extra_stop_ids": [],
             "max_new_tokens": 64, "do_sample": False, "temperature": 0.0, "top_p": 1.0, "seed": 0}))


def check_settings(out_dir: Path, settings: dict) -> None:
    """Refuse to resume a regeneration made with other settings (it would mix two datasets)."""
    path = Path(out_dir) / REGEN_SETTINGS.name
    old = read_json_state(path, REGEN_SETTINGS)
    if old is not None:
        if old != settings:
            diff = {k: (old.get(k), settings.get(k)) for k in set(old) | set(settings) if old.get(k) != settings.get(k)}
            raise ValueError(f"{out_dir} was regenerated with other settings {diff} (old, new); "
                             "delete it or use another output_dir")
    else:
        write_json_state(path, dict(sorted(settings.items())), REGEN_SETTINGS)


def make_chunks(records: list[dict], batch_size: int) -> list[list[dict]]:
    """Fixed chunks: records sorted (stably) by first-user-turn length, so a batch pads little."""
    def first_user_len(rec):
        return next((len(m["content"]) for m in rec["messages"] if m["role"] == "user"), 0)

    ordered = sorted(records, key=first_user_len)
    return [ordered[i: i + batch_size] for i in range(0, len(ordered), batch_size)]


def conversation_inputs(messages: list[dict]) -> list[dict]:
    """The turns the target answers, in order: {"turns": [a user turn] | [the tool results of one exchange],
    "calls": the function names the dataset's assistant called for those results (tool steps only)}. The dataset's
    own assistant turns are not inputs: the target writes its own."""
    steps, last_calls, prev_role = [], [], None
    for m in messages:
        if m["role"] == "user":
            steps.append({"turns": [m], "calls": None})
        elif m["role"] == "assistant":
            last_calls = [c["function"]["name"] for c in m.get("tool_calls") or []]
        elif m["role"] == "tool" and prev_role == "tool":  # the next result of the same exchange
            steps[-1]["turns"].append(m)
        elif m["role"] == "tool":
            steps.append({"turns": [m], "calls": last_calls})
        prev_role = m["role"]
    return steps


def regenerate_chunk(chunk: list[dict], backend, calls: ToolCallFormat = CALL_FORMATS["none"],
                     think: bool = False) -> list[dict]:
    """Answer every user turn (and every tool-result turn) of every conversation in `chunk`, turn by turn, in one
    batch per turn; the replies are the target's, the user turns and tool results the dataset's.

    A reply is stored as the template's message fields (data_prep/assistant_spans.py `split_reply`: reasoning when
    `think`, the template renders it; tool calls in the `calls` markup). Tool results stay the dataset's while the
    target calls the same functions, in order, as the dataset's assistant did (arguments may differ: the result is
    the dataset's). When it answers without the dataset's calls, those results and the rest of that exchange are
    dropped and the conversation goes on at the next user turn; when it calls functions the dataset has no result
    for, the conversation ends at that reply, its call kept and trained on (`tool_exchanges_diverged` counts both,
    `ended_at_unanswered_call` the second)."""
    states = []
    for rec in chunk:
        msgs = rec["messages"]
        prefix = [m for m in msgs[:1] if m["role"] == "system"]
        states.append({"id": rec["id"], "tools": rec.get("tools"), "history": list(prefix),
                       "steps": conversation_inputs(msgs[len(prefix):]), "next": 0, "length_limited": False,
                       "stopped_at_max_length": False, "generated_tokens": 0, "reject_reason": None,
                       "tool_results_kept": 0, "tool_exchanges_diverged": 0, "ended_at_unanswered_call": False})

    def made_calls(s) -> list[str]:
        last = s["history"][-1] if s["history"] else {}
        return [c["function"]["name"] for c in last.get("tool_calls") or []] if last.get("role") == "assistant" else []

    def advance(s) -> bool:
        """Skip the tool steps the target's last reply does not match; False when the conversation is done."""
        while s["next"] < len(s["steps"]):
            step = s["steps"][s["next"]]
            made = made_calls(s)
            if step["calls"] is None:  # a user turn: the target's last reply must not wait for a tool result
                break
            if made == step["calls"]:
                return True
            s["tool_exchanges_diverged"] += 1
            if made:  # the dataset's results answer other calls: none for this one
                break
            s["next"] += 1  # an answer instead of the dataset's calls: its results and the rest of the exchange go
            while s["next"] < len(s["steps"]) and s["steps"][s["next"]]["calls"] is not None:
                s["next"] += 1
        if made_calls(s):
            s["ended_at_unanswered_call"] = True
            return False
        return s["next"] < len(s["steps"])

    while True:
        active = [s for s in states if not s["stopped_at_max_length"] and not s["ended_at_unanswered_call"]
                  and advance(s)]
        if not active:
            break
        histories = [s["history"] + s["steps"][s["next"]]["turns"] for s in active]
        results = backend.generate_turn(histories, [s["tools"] for s in active])
        for s, hist, res in zip(active, histories, results):
            if isinstance(res, Rejected):  # prompt already at max length: later turns would be truncated away anyway
                s["stopped_at_max_length"] = True
                s["reject_reason"] = f"turn {s['next'] + 1}: {res.reason}"
                continue
            if s["steps"][s["next"]]["calls"] is not None:
                s["tool_results_kept"] += len(s["steps"][s["next"]]["turns"])
            reply = {"role": "assistant", **split_reply(res.text, calls, think)}
            if res.token_ids is not None:
                reply["token_ids"] = res.token_ids
            s["history"] = hist + [reply]
            s["next"] += 1
            s["generated_tokens"] += res.num_tokens
            s["length_limited"] |= res.hit_length_limit
    out = []
    for s in states:
        rec = {"id": s["id"], "messages": s["history"], "length_limited": s["length_limited"],
               "stopped_at_max_length": s["stopped_at_max_length"], "generated_tokens": s["generated_tokens"]}
        if s["tools"]:
            rec["tools"] = s["tools"]
        for key in ("tool_results_kept", "tool_exchanges_diverged", "ended_at_unanswered_call"):
            if s[key]:
                rec[key] = s[key]
        if s["reject_reason"]:
            rec["reject_reason"] = s["reject_reason"]
        out.append(rec)
    return out


@dataclass
class RegenerateStats:
    records_total: int = 0
    records_skipped_done: int = 0
    records_generated: int = 0
    generated_tokens: int = 0
    length_limited: int = 0
    stopped_at_max_length: int = 0
    tool_results_kept: int = 0  # dataset tool results kept after a regenerated reply made the same calls
    tool_exchanges_diverged: int = 0  # the regenerated reply called other functions (or none): results dropped
    ended_at_unanswered_call: int = 0  # conversations ending at a regenerated call the dataset has no result for
    seconds: float = 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["records_per_s"] = self.records_generated / self.seconds if self.seconds else 0.0
        d["tokens_per_s"] = self.generated_tokens / self.seconds if self.seconds else 0.0
        return d


def regenerate_shard(records: list[dict], backend, out_dir: Path, shard: int, num_shards: int, batch_size: int,
                     seed: int, progress: bool = True, calls: ToolCallFormat = CALL_FORMATS["none"],
                     think: bool = False) -> RegenerateStats:
    """Regenerate this shard's records (index % num_shards == shard), appending to its part file."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    own = part_path(out_dir, shard, num_shards)
    done = read_parts(out_dir, own=own)
    mine = [r for i, r in enumerate(records) if i % num_shards == shard]
    stats = RegenerateStats(records_total=len(mine))
    stats.records_skipped_done = sum(r["id"] in done for r in mine)
    start = time.perf_counter()
    bar = tqdm(total=len(mine), initial=stats.records_skipped_done, desc=f"regenerate {shard}/{num_shards}",
               disable=not progress, unit="conv")
    with open(own, "a", encoding="utf-8") as f:
        for k, chunk in enumerate(make_chunks(mine, batch_size)):
            todo = [r for r in chunk if r["id"] not in done]
            if not todo:
                continue
            torch.manual_seed(seed * 1_000_003 + shard * 10_007 + k)  # sampling reproducible per chunk
            for rec in regenerate_chunk(todo, backend, calls, think):
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
                stats.records_generated += 1
                stats.generated_tokens += rec["generated_tokens"]
                stats.length_limited += rec["length_limited"]
                stats.stopped_at_max_length += rec["stopped_at_max_length"]
                stats.tool_results_kept += rec.get("tool_results_kept", 0)
                stats.tool_exchanges_diverged += rec.get("tool_exchanges_diverged", 0)
                stats.ended_at_unanswered_call += bool(rec.get("ended_at_unanswered_call"))
            f.flush()
            os.fsync(f.fileno())
            bar.update(len(todo))
    bar.close()
    stats.seconds = time.perf_counter() - start
    return stats
