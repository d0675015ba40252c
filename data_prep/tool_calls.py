"""How a chat template writes an assistant's tool calls, read back from the text the target generated.

A regenerated reply is text (the target's tokens decoded); when the target calls a tool, the call is in the
template's own markup. Each `ToolCallFormat` finds those calls in a reply and turns them into OpenAI `tool_calls`
(``{"type": "function", "function": {"name", "arguments": {...}}}``), so that the reply is stored as a message the
template renders back to the same text (tests/test_reasoning_templates.py checks the round trip):

- ``hermes``: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`` blocks (Qwen2.5/Qwen3, Hermes;
  vLLM's ``hermes`` tool parser);
- ``llama3_json``: the whole reply is one JSON object ``{"name": ..., "parameters": {...}}``, optionally after
  ``<|python_tag|>`` (Llama 3.1/3.2 JSON tool calling; vLLM's ``llama3_json`` parser);
- ``none``: the template has no tool-call markup; replies are answers only.

`detect_format` picks one from the template text (``data.tool_call_format: auto``).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Callable

from recipes.data import TOOL_CALL_FORMATS

Span = tuple[int, int]


@dataclass(frozen=True)
class ToolCallFormat:
    name: str
    # (text) -> [(start, end, call)]: every tool call in the text, its character span and the call's
    # {"name", "arguments"}; an unparsable call markup gives no call (the text stays an answer)
    find: Callable[[str], list[tuple[int, int, dict]]]

    def split(self, text: str) -> tuple[str, list[dict]]:
        """(the reply's text outside its calls, stripped; its calls as OpenAI tool_calls)."""
        found = self.find(text)
        rest, last = [], 0
        for start, end, _ in found:
            rest.append(text[last:start])
            last = end
        rest.append(text[last:])
        calls = [{"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}} for _, _, c in found]
        return "".join(rest).strip(), calls

    def spans(self, text: str) -> list[Span]:
        return [(start, end) for start, end, _ in self.find(text)]


def _call(obj, args_key: str) -> dict | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    return {"name": obj["name"], "arguments": args} if isinstance(args, dict) else None


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def _find_hermes(text: str) -> list[tuple[int, int, dict]]:
    out = []
    for m in _HERMES.finditer(text):
        try:
            call = _call(json.loads(m.group(1)), "arguments")
        except json.JSONDecodeError:
            call = None
        if call is not None:
            out.append((m.start(), m.end(), call))
    return out


_SPECIAL_TAIL = re.compile(r"\s*(<\|[a-z_]+\|>\s*)*")  # the end-of-turn token after a call (a masked reply has it)


def _find_llama3_json(text: str) -> list[tuple[int, int, dict]]:
    start = text.find("<|python_tag|>")
    body_start = start + len("<|python_tag|>") if start >= 0 else 0
    body = text[body_start:]
    lead = len(body) - len(body.lstrip())
    try:
        obj, used = json.JSONDecoder().raw_decode(body.lstrip())
    except json.JSONDecodeError:
        return []
    if not _SPECIAL_TAIL.fullmatch(body.lstrip()[used:]):  # text after it: an answer that happens to start with JSON
        return []
    call = _call(obj, "parameters")
    if call is None:
        return []
    return [(start if start >= 0 else body_start + lead, body_start + lead + used, call)]


def _find_none(text: str) -> list[tuple[int, int, dict]]:
    return []


FORMATS = {f.name: f for f in (ToolCallFormat("hermes", _find_hermes), ToolCallFormat("llama3_json", _find_llama3_json),
                                ToolCallFormat("none", _find_none))}
if set(FORMATS) | {"auto"} != set(TOOL_CALL_FORMATS):
    raise AssertionError(f"recipes/data.py TOOL_CALL_FORMATS {TOOL_CALL_FORMATS} and the parsers {sorted(FORMATS)} differ")


def detect_format(template: str | None) -> ToolCallFormat:
    """The format a chat template writes tool calls in: its markup decides (``<tool_call>``: hermes; a
    ``"parameters"`` JSON object: llama3_json), else none."""
    text = template or ""
    if "<tool_call>" in text:
        return FORMATS["hermes"]
    if '"parameters"' in text or "<|python_tag|>" in text:
        return FORMATS["llama3_json"]
    return FORMATS["none"]


def tool_call_format(name: str, template: str | None) -> ToolCallFormat:
    """The format named by `data.tool_call_format` (auto: from the template)."""
    if name == "auto":
        return detect_format(template)
    if name not in FORMATS:
        raise ValueError(f"data.tool_call_format {name!r}: expected one of {TOOL_CALL_FORMATS}")
    return FORMATS[name]
