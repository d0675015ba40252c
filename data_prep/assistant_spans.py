"""The parts of an assistant reply: reasoning (``<think>...</think>``), tool calls (the template's markup,
data_prep/tool_calls.py) and the answer (the rest, end-of-turn token included).

Used three ways, from token ids alone so that every path gives the same answer:
- `split_reply`: a reply's text (generated, or a dataset's inline ``<think>``) into the message fields a template
  renders (``reasoning_content``, ``content``, ``tool_calls``);
- `label_tokens`: each trained-on token's part, so `data.train_reasoning=false` drops the reasoning from the loss
  mask and the mask inspector shows each part;
- evaluation/spans.py: which part of a generated answer a decoding round drafted (tau by span).

A run of tokens that holds ``</think>`` without its ``<think>`` started inside the reasoning (templates whose
generation prompt opens the block); a ``<think>`` never closed (generation cut by max_new_tokens) runs to the end.
"""
from __future__ import annotations

from data_prep.tool_calls import ToolCallFormat

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
REASONING, TOOL_CALL, ANSWER = "reasoning", "tool_call", "answer"
SPAN_KINDS = (REASONING, ANSWER, TOOL_CALL)


def reasoning_spans(text: str) -> list[tuple[int, int]]:
    """[start, end) of every ``<think>...</think>`` block of `text`, the markers included."""
    spans, pos = [], 0
    while True:
        open_at = text.find(THINK_OPEN, pos)
        close_at = text.find(THINK_CLOSE, pos)
        if close_at >= 0 and (open_at < 0 or close_at < open_at):  # closed without an opener in this text
            spans.append((pos, close_at + len(THINK_CLOSE)))
            pos = close_at + len(THINK_CLOSE)
            continue
        if open_at < 0:
            return spans
        close_at = text.find(THINK_CLOSE, open_at + len(THINK_OPEN))
        end = len(text) if close_at < 0 else close_at + len(THINK_CLOSE)
        spans.append((open_at, end))
        if close_at < 0:
            return spans
        pos = end


def renders_reasoning(template: str | None) -> bool:
    """Whether a chat template writes `reasoning_content` (or splits an inline ``</think>``): only then is a reply's
    reasoning stored apart from its content (else the template would drop it)."""
    return bool(template) and ("reasoning_content" in template or THINK_CLOSE in template)


def split_reply(text: str, calls: ToolCallFormat, think: bool = True) -> dict:
    """An assistant reply's text as message fields: ``content`` (always), ``reasoning_content`` (when `think` and it
    has a ``<think>`` block) and ``tool_calls`` (when it calls tools in the `calls` markup)."""
    out: dict = {}
    spans = reasoning_spans(text) if think else []
    if spans:
        start, end = spans[0]
        inner = text[start:end]
        inner = inner[len(THINK_OPEN):] if inner.startswith(THINK_OPEN) else inner
        inner = inner[: -len(THINK_CLOSE)] if inner.endswith(THINK_CLOSE) else inner
        out["reasoning_content"] = inner.strip()
        text = text[:start] + text[end:]
    content, tool_calls = calls.split(text)
    out["content"] = content
    if tool_calls:
        out["tool_calls"] = tool_calls
    return out


def _decoded_offsets(tokenizer, ids: list[int]) -> tuple[str, list[tuple[int, int]]]:
    """The concatenated per-token decodings of `ids` and each token's [start, end) in it."""
    text, offsets = "", []
    for t in ids:
        piece = tokenizer.decode([t], skip_special_tokens=False)
        offsets.append((len(text), len(text) + len(piece)))
        text += piece
    return text, offsets


def label_tokens(tokenizer, ids: list[int], mask: list[int], calls: ToolCallFormat) -> list[str | None]:
    """Per token: None outside the mask, else REASONING, TOOL_CALL or ANSWER (each masked run is one reply)."""
    labels: list[str | None] = [None] * len(ids)
    t = 0
    while t < len(ids):
        if not mask[t]:
            t += 1
            continue
        end = t
        while end < len(ids) and mask[end]:
            end += 1
        text, offsets = _decoded_offsets(tokenizer, ids[t:end])
        think = reasoning_spans(text)
        rest = text
        for s, e in think:  # calls are looked for outside the reasoning (a model may plan a call while thinking)
            rest = rest[:s] + " " * (e - s) + rest[e:]
        tool = calls.spans(rest)
        for k, (s, e) in enumerate(offsets):
            def hit(spans):
                return any(s < b and e > a for a, b in spans) or any(a <= s < b for a, b in spans if s == e)
            labels[t + k] = REASONING if hit(think) else TOOL_CALL if hit(tool) else ANSWER
        t = end
    return labels


def count_labels(labels: list[str | None]) -> dict[str, int]:
    return {kind: sum(lab == kind for lab in labels) for kind in SPAN_KINDS}
