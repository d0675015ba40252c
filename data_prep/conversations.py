"""Load conversations (ShareGPT, OpenAI messages, Alpaca; local files or HF datasets), validate every
record, and normalise it to ``{"id": str, "messages": [{"role": system|user|assistant|tool, "content": str, ...}]}``
(+ ``"tools"``: the record's tool definitions, when it has some).

Tool-calling and reasoning conversations: OpenAI messages (``tools``, assistant ``tool_calls`` with ``content: null``,
``tool`` results) and ShareGPT-with-tools as LLaMA-Factory / SpecForge load it (``function_call`` and ``observation``
turns, or role/content turns with ``tool_calls``; ``tools`` a list or a JSON string). An assistant turn keeps
``reasoning_content`` (also read from ``reasoning`` / ``thinking``, or split off an inline ``<think>...</think>``) and
``tool_calls`` (arguments parsed to objects); a tool turn keeps ``tool_call_id`` / ``name``.

Invalid records are never dropped silently: each goes to the rejects file with a one-line reason and
the report states ``kept + rejected = input``.
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from data_prep.assistant_spans import THINK_CLOSE, split_reply
from data_prep.tool_calls import FORMATS as CALL_FORMATS
from eagle.atomic_file import atomic_output

FORMATS = ("auto", "sharegpt", "openai", "alpaca")
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
                  "system": "system", "function_call": "assistant", "observation": "tool", "tool": "tool"}
OPENAI_ROLES = {"system": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
REASONING_KEYS = ("reasoning_content", "reasoning", "thinking")  # the names datasets and servers give it


class RecordError(ValueError):
    """One input record is invalid; str(e) is the one-line reject reason."""


@dataclass
class LoadResult:
    kept: list[dict] = field(default_factory=list)
    rejects: list[dict] = field(default_factory=list)  # {"index", "id", "reason", "record"}
    num_input: int = 0

    def report(self, source: str) -> dict:
        reasons = Counter(r["reason"].split(":")[0] for r in self.rejects)
        return {"source": source, "input": self.num_input, "kept": len(self.kept), "rejected": len(self.rejects),
                "reject_reasons": dict(reasons.most_common())}


# --------------------------------------------------------------------------- reading raw records
def iter_raw_records(source: str, hf_subset: str | None = None, hf_split: str = "train") -> Iterator[tuple[Any, str | None]]:
    """Yield (record, parse_error) per input record. JSONL lines that do not parse give (line text, reason)."""
    path = Path(source)
    if path.is_file() and path.suffix == ".jsonl":
        with open(path, "rb") as f:  # decoded per line: one undecodable line is one rejected record
            for lineno, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    yield raw.rstrip(b"\n")[:200].decode("utf-8", "replace"), \
                        f"bad UTF-8 line {lineno}: {e.reason} at byte {e.start}"
                    continue
                if not line.strip():
                    continue
                try:
                    yield json.loads(line), None
                except json.JSONDecodeError as e:
                    yield line.rstrip("\n")[:200], f"bad JSON line {lineno}: {e.msg}"
    elif path.is_file() and path.suffix == ".json":
        try:
            data = json.loads(path.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as e:
            raise ValueError(f"{path} is not valid UTF-8 ({e.reason} at byte {e.start}); fix the file or convert it "
                             "to .jsonl so that only the bad records are rejected") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON ({e}); for one record per line use a .jsonl file") from None
        if isinstance(data, dict):  # {"data": [...]} / {"train": [...]}: take the single list value
            lists = [v for v in data.values() if isinstance(v, list)]
            if len(lists) != 1:
                raise ValueError(f"{path}: expected a JSON list of records (or an object with one list), got keys {sorted(data)}")
            data = lists[0]
        if not isinstance(data, list):
            raise ValueError(f"{path}: expected a JSON list of records, got {type(data).__name__}")
        for rec in data:
            yield rec, None
    else:
        if not path.exists() and (path.suffix in (".json", ".jsonl", ".parquet", ".csv", ".arrow")
                                  or source.startswith((".", "/", "~"))):
            raise ValueError(f"data.source {source!r} does not exist")
        # lazy: datasets costs over a second at import; only parquet/csv/arrow files and hub datasets need it
        import datasets

        if path.exists():
            kind = {".parquet": "parquet", ".csv": "csv", ".arrow": "arrow", ".json": "json"}.get(path.suffix)
            if kind is None:
                raise ValueError(f"data.source {source!r}: unsupported file type {path.suffix!r} (json, jsonl, parquet, csv, arrow)")
            ds = datasets.load_dataset(kind, data_files=str(path), split="train")
        else:
            try:
                ds = datasets.load_dataset(source, name=hf_subset, split=hf_split)
            except Exception as e:
                raise ValueError(f"data.source {source!r} is neither a local file nor a loadable HF dataset: {e}") from e
        for rec in ds:
            yield rec, None


# --------------------------------------------------------------------------- validation
def _content(turn: dict, key: str, i: int) -> str:
    value = turn.get(key)
    if not isinstance(value, str):
        raise RecordError(f"non-string content: turn {i} {key!r} is {type(value).__name__}")
    if not value.strip():
        raise RecordError(f"empty content: turn {i}")
    return value


def _json_value(value, what: str):
    """`value`, or the JSON it holds when it is a string (datasets store tools and tool calls either way)."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise RecordError(f"bad JSON: {what} is a string that is not JSON ({e.msg} at char {e.pos})") from None


def _tool_call(call, i: int, k: int) -> dict:
    """One OpenAI tool call ({"type": "function", "function": {"name", "arguments"}}, or the flat {"name",
    "arguments"} of ShareGPT function_call turns) as {"type", "function": {"name", "arguments": object}}[, "id"]."""
    where = f"turn {i} tool call {k}"
    if not isinstance(call, dict):
        raise RecordError(f"bad tool call: {where} is {type(call).__name__}, not an object")
    fn = call.get("function", call)
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"].strip():
        raise RecordError(f"bad tool call: {where} has no function name")
    args = _json_value(fn.get("arguments", fn.get("parameters", {})), f"{where} arguments")
    if not isinstance(args, dict):
        raise RecordError(f"bad tool call: {where} arguments are {type(args).__name__}, expected a JSON object")
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if isinstance(call.get("id"), str) and call["id"]:
        out["id"] = call["id"]
    return out


def _tool_calls(value, i: int) -> list[dict]:
    calls = _json_value(value, f"turn {i} tool_calls")
    if isinstance(calls, dict):
        calls = [calls]
    if not isinstance(calls, list) or not calls:
        raise RecordError(f"bad tool call: turn {i} tool_calls is {type(calls).__name__}, expected a non-empty list")
    return [_tool_call(c, i, k) for k, c in enumerate(calls)]


def _tools(rec: dict) -> list[dict] | None:
    """The record's tool definitions (a list, or a JSON string of one) as OpenAI {"type": "function", "function":
    {...}} entries; None when it has none."""
    tools = _json_value(rec.get("tools"), "tools")
    if tools is None or tools == [] or tools == "":
        return None
    if not isinstance(tools, list):
        raise RecordError(f"bad tools: expected a list of tool definitions, got {type(tools).__name__}")
    out = []
    for k, tool in enumerate(tools):
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"].strip():
            raise RecordError(f"bad tools: tool {k} has no function name")
        out.append({"type": "function", "function": fn})
    return out


def _message(turn: dict, role: str, content_key: str, i: int) -> dict:
    """One validated turn: role, content, and the tool / reasoning fields its role may carry."""
    if role == "tool":
        value = turn.get(content_key)
        if isinstance(value, (dict, list)):  # a structured tool result: the template gets its JSON text
            turn = {**turn, content_key: json.dumps(value, ensure_ascii=False)}
        msg = {"role": "tool", "content": _content(turn, content_key, i)}
        for key in ("tool_call_id", "name"):
            if isinstance(turn.get(key), str) and turn[key]:
                msg[key] = turn[key]
        return msg
    if role != "assistant":
        return {"role": role, "content": _content(turn, content_key, i)}
    calls = _tool_calls(turn["tool_calls"], i) if turn.get("tool_calls") not in (None, [], "") else None
    value = turn.get(content_key)
    if calls is not None and (value is None or (isinstance(value, str) and not value.strip())):
        content = ""  # OpenAI format: content null beside tool_calls
    elif value is None:
        raise RecordError(f"empty content: turn {i} assistant {content_key!r} is null and the turn has no tool_calls")
    else:
        content = _content(turn, content_key, i)
    reasoning = next((turn[k] for k in REASONING_KEYS if turn.get(k) is not None), None)
    if reasoning is not None and not isinstance(reasoning, str):
        raise RecordError(f"non-string content: turn {i} reasoning is {type(reasoning).__name__}")
    if THINK_CLOSE in content:  # inline <think>...</think>: the same fields as reasoning_content
        if reasoning is not None:
            raise RecordError(f"double reasoning: turn {i} has both a reasoning field and an inline </think>")
        fields = split_reply(content, CALL_FORMATS["none"])
        reasoning, content = fields["reasoning_content"], fields["content"]
        if not content.strip() and calls is None:
            raise RecordError(f"empty content: turn {i} has reasoning but no answer after </think>")
    msg = {"role": "assistant", "content": content}
    if reasoning is not None and reasoning.strip():
        msg["reasoning_content"] = reasoning
    if calls is not None:
        msg["tool_calls"] = calls
    return msg


def _from_sharegpt(rec: dict) -> list[dict]:
    turns = rec["conversations"]
    if not isinstance(turns, list):
        raise RecordError(f"bad conversations: expected a list, got {type(turns).__name__}")
    messages = []
    if isinstance(rec.get("system"), str) and rec["system"].strip():
        messages.append({"role": "system", "content": rec["system"]})
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise RecordError(f"bad turn: turn {i} is {type(turn).__name__}, not an object")
        role_key, content_key = ("from", "value") if "from" in turn else ("role", "content")
        role = turn.get(role_key)
        if role not in SHAREGPT_ROLES:
            raise RecordError(f"unknown role: {role!r} in turn {i} (known: {sorted(SHAREGPT_ROLES)})")
        if role == "function_call":  # LLaMA-Factory / glaive: the value is the call's JSON, the turn is the assistant's
            turn = {"tool_calls": turn.get(content_key), content_key: None}
        messages.append(_message(turn, SHAREGPT_ROLES[role], content_key, i))
    return messages


def _from_openai(rec: dict) -> list[dict]:
    turns = rec["messages"]
    if not isinstance(turns, list):
        raise RecordError(f"bad messages: expected a list, got {type(turns).__name__}")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise RecordError(f"bad turn: turn {i} is {type(turn).__name__}, not an object")
        role = turn.get("role")
        if role not in OPENAI_ROLES:
            raise RecordError(f"unknown role: {role!r} in turn {i} (known: {sorted(OPENAI_ROLES)})")
        messages.append(_message(turn, OPENAI_ROLES[role], "content", i))
    return messages


def _from_alpaca(rec: dict) -> list[dict]:
    instruction = _content(rec, "instruction", 0)
    extra = rec.get("input") or ""
    if not isinstance(extra, str):
        raise RecordError(f"non-string content: 'input' is {type(extra).__name__}")
    user = instruction if not extra.strip() else f"{instruction}\n\n{extra}"
    messages = []
    if isinstance(rec.get("system"), str) and rec["system"].strip():
        messages.append({"role": "system", "content": rec["system"]})
    messages.append({"role": "user", "content": user})
    output = rec.get("output")
    if output is not None and not (isinstance(output, str) and not output.strip()):
        messages.append({"role": "assistant", "content": _content(rec, "output", 1)})
    return messages


def detect_format(rec: dict) -> str:
    if "conversations" in rec:
        return "sharegpt"
    if "messages" in rec:
        return "openai"
    if "instruction" in rec:
        return "alpaca"
    raise RecordError(f"unknown record format: keys {sorted(rec)[:8]} (need conversations, messages or instruction)")


# which roles may follow each turn: a tool result answers an assistant's tool call, the assistant answers a user
# turn or tool results (None: the first turn after the optional system turn)
FOLLOWS = {None: ("user",), "user": ("assistant",), "assistant": ("user",), "assistant+calls": ("tool",),
           "tool": ("tool", "assistant")}


def check_turn_order(messages: list[dict]) -> None:
    """Optional leading system turn, then user; an assistant turn answers a user turn or tool results, and a tool
    turn answers an assistant's tool calls (or follows another tool result)."""
    if not messages:
        raise RecordError("empty conversation: no turns")
    body = messages[1:] if messages[0]["role"] == "system" else messages
    if not any(m["role"] == "user" for m in body):
        raise RecordError("no user turn")
    offset = len(messages) - len(body)
    prev = None
    for i, m in enumerate(body):
        allowed = FOLLOWS[prev]
        if m["role"] not in allowed:
            where = ("system turn not first" if m["role"] == "system" else
                     f"expected {' or '.join(allowed)}, got {m['role']}"
                     + (" (a tool result must follow an assistant turn with tool_calls)" if m["role"] == "tool" else ""))
            raise RecordError(f"bad turn order: turn {i + offset}: {where}")
        prev = "assistant+calls" if m.get("tool_calls") else m["role"]


def normalize_record(rec: Any, fmt: str = "auto", system_prompt: str | None = None) -> list[dict]:
    """Validate one raw record and return its messages; raises RecordError with the reject reason."""
    if not isinstance(rec, dict):
        raise RecordError(f"not an object: record is {type(rec).__name__}")
    if fmt not in FORMATS:
        raise ValueError(f"data.format must be one of {FORMATS}, got {fmt!r}")
    kind = detect_format(rec) if fmt == "auto" else fmt
    required = {"sharegpt": "conversations", "openai": "messages", "alpaca": "instruction"}[kind]
    if required not in rec:
        raise RecordError(f"missing key: {required!r} (format {kind})")
    messages = {"sharegpt": _from_sharegpt, "openai": _from_openai, "alpaca": _from_alpaca}[kind](rec)
    check_turn_order(messages)
    if system_prompt and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def record_tools(rec: Any) -> list[dict] | None:
    """The tool definitions of a raw record (validated), None without any."""
    return _tools(rec) if isinstance(rec, dict) else None


def record_id(rec: Any, index: int, prefix: str) -> str:
    if isinstance(rec, dict):
        for key in ("id", "conversation_id", "question_id"):
            if rec.get(key) is not None and str(rec[key]).strip():
                return str(rec[key])
    return f"{prefix}-{index}"


def load_conversations(
    source: str,
    fmt: str = "auto",
    max_records: int | None = None,
    system_prompt: str | None = None,
    hf_subset: str | None = None,
    hf_split: str = "train",
) -> LoadResult:
    """Read + validate every record of `source`; kept + rejected == input, in input order."""
    if not source:
        raise ValueError("data.source is empty: set it to a .json/.jsonl file or a HF dataset id (data.source=...)")
    prefix = Path(source).stem if Path(source).exists() else source.replace("/", "_")
    result = LoadResult()
    seen: set[str] = set()
    for index, (rec, parse_error) in enumerate(iter_raw_records(source, hf_subset, hf_split)):
        if max_records is not None and index >= max_records:
            break
        result.num_input += 1
        rid = record_id(rec, index, prefix)
        try:
            if parse_error:
                raise RecordError(parse_error)
            if rid in seen:
                raise RecordError(f"duplicate id: {rid!r} already used by an earlier record")
            messages = normalize_record(rec, fmt, system_prompt)
            tools = record_tools(rec)
        except RecordError as e:
            result.rejects.append({"index": index, "id": rid, "reason": str(e), "record": rec})
            continue
        seen.add(rid)
        result.kept.append({"id": rid, "messages": messages, **({"tools": tools} if tools else {})})
    return result


def write_jsonl(path: Path, records) -> None:
    """One JSON record per line, written whole or not at all (eagle/atomic_file.py: a full disk leaves no partial
    file, and several ranks may write the same file)."""
    with atomic_output(path) as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False, default=str) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    """Every record of a JSON-lines file this pipeline wrote; a damaged line raises naming the file and line."""
    out = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
                if line.strip():
                    out.append(json.loads(line))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f"{path}:{lineno}: damaged line ({e}); delete the file and rerun the stage that "
                                 "writes it") from None
    return out
