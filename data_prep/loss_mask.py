"""Tokenise a conversation with its exact assistant-only loss mask, from the tokenizer's chat template.

Two ways, never hand-tuned offsets:
- the template has ``{% generation %}`` markers: transformers' ``return_assistant_tokens_mask``;
- otherwise prefix templating: for assistant turn i, the text rendered for ``messages[:i]`` with the
  generation prompt and the text rendered for ``messages[:i+1]`` are both prefixes of the full
  conversation's text; the characters between them (minus trailing template whitespace, which the
  model never generates) are the reply + end-of-turn token. Tokens overlapping that span get mask 1.

A conversation's `tools` reach the template. `train_reasoning=False` (recipe `data.train_reasoning`) then takes the
reasoning tokens (``<think>...</think>``, data_prep/assistant_spans.py) out of the mask; by default the target's own
thinking is trained, since the head drafts it at serving time.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field

from data_prep.assistant_spans import ANSWER, REASONING, TOOL_CALL, count_labels, label_tokens
from data_prep.token_ids import chat_messages, tokenize_from_token_ids
from data_prep.tool_calls import FORMATS as CALL_FORMATS
from data_prep.tool_calls import ToolCallFormat

MASK_MODES = ("auto", "generation", "prefix")


class TemplateMaskError(ValueError):
    """The chat template cannot give an exact mask for this conversation."""


def has_generation_markers(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None) or ""
    return "{% generation" in template or "{%- generation" in template


def _render(tokenizer, messages, add_generation_prompt: bool, tools: list[dict] | None = None) -> str:
    return tokenizer.apply_chat_template(chat_messages(messages), tools=tools or None, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


def assistant_char_spans(tokenizer, messages: list[dict],
                         tools: list[dict] | None = None) -> tuple[str, list[tuple[int, int]]]:
    """Full rendered text and the [start, end) character span of every assistant reply (prefix templating)."""
    full = _render(tokenizer, messages, add_generation_prompt=False, tools=tools)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], add_generation_prompt=True, tools=tools)
        through = _render(tokenizer, messages[: i + 1], add_generation_prompt=False, tools=tools)
        if not full.startswith(before) or not full.startswith(through) or len(through) < len(before):
            raise TemplateMaskError(
                f"chat template is not prefix-stable at turn {i}: rendering the first turns is not a prefix of the "
                "whole conversation; use a template with {% generation %} markers (target.chat_template=...)"
            )
        end = len(through.rstrip())
        spans.append((len(before), max(end, len(before))))
    return full, spans


def tokenize_with_mask(tokenizer, messages: list[dict], mode: str = "auto",
                       tools: list[dict] | None = None) -> tuple[list[int], list[int]]:
    """input_ids and loss_mask (1 = assistant reply or its end-of-turn token) for one conversation."""
    if mode not in MASK_MODES:
        raise ValueError(f"mask mode must be one of {MASK_MODES}, got {mode!r}")
    if mode == "generation" or (mode == "auto" and has_generation_markers(tokenizer)):
        out = tokenizer.apply_chat_template(
            chat_messages(messages), tools=tools or None, tokenize=True, return_dict=True,
            return_assistant_tokens_mask=True, add_generation_prompt=False
        )
        ids = list(out["input_ids"])
        mask = [int(x) for x in out["assistant_masks"]]
        return ids, mask
    full, spans = assistant_char_spans(tokenizer, messages, tools)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    mask = []
    for start, end in enc["offset_mapping"]:
        inside = end > start and any(start < s_end and end > s_start for s_start, s_end in spans)
        mask.append(int(inside))
    return ids, mask


@dataclass
class TokenizeStats:
    input: int = 0
    kept: int = 0
    truncated: int = 0
    dropped_overlong: int = 0
    dropped_length_limited: int = 0
    dropped_no_loss_tokens: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    reasoning_tokens: int = 0  # assistant tokens inside <think>...</think> (trained on only with data.train_reasoning)
    tool_call_tokens: int = 0  # assistant tokens of tool calls (always trained on)
    reasoning_not_rendered: int = 0  # assistant turns whose reasoning_content the template does not write
    from_token_ids: int = 0  # samples built from the generated ids (data_prep/token_ids.py)
    token_ids_fallback: int = 0  # records with generated ids whose prompts did not extend them: built from text
    rejects: list[dict] = field(default_factory=list)

    def report(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "rejects"}
        d["accounting"] = (
            f"kept {self.kept} + dropped {self.input - self.kept} "
            f"(overlong {self.dropped_overlong}, length-limited {self.dropped_length_limited}, "
            f"no loss tokens {self.dropped_no_loss_tokens}) = input {self.input}"
        )
        return d


def reasoning_not_rendered(tokenizer, messages: list[dict], tools: list[dict] | None) -> int:
    """Assistant turns whose reasoning_content is absent from the rendered conversation (a template without
    thinking, or Qwen3's rule dropping the reasoning of turns before the last user turn): counted, not an error.
    Found by text, so a lower bound: a dropped reasoning whose text another turn repeats is not counted."""
    turns = [m["reasoning_content"].strip() for m in messages if m["role"] == "assistant" and m.get("reasoning_content")]
    if not turns:
        return 0
    text = _render(tokenizer, messages, add_generation_prompt=False, tools=tools)
    return sum(r not in text for r in turns)


def tokenize_records(records, tokenizer, max_length: int, overlong: str = "truncate", drop_length_limited: bool = False,
                     mode: str = "auto", train_reasoning: bool = True, calls: ToolCallFormat = CALL_FORMATS["none"]):
    """Tokenise normalised records; returns (tokenized list, TokenizeStats). Every drop is counted.

    `train_reasoning=False` takes the reasoning tokens out of each mask (`calls`: the template's tool-call markup,
    for the span counts)."""
    if overlong not in ("truncate", "drop"):
        raise ValueError(f"data.overlong must be 'truncate' or 'drop', got {overlong!r}")
    stats, out = TokenizeStats(), []
    for rec in records:
        stats.input += 1
        if rec.get("length_limited") and drop_length_limited:
            stats.dropped_length_limited += 1
            stats.rejects.append({"id": rec["id"], "reason": "length limited: generation hit max_new_tokens"})
            continue
        if rec.get("stopped_at_max_length") and not any(m["role"] == "assistant" for m in rec["messages"]):
            stats.dropped_no_loss_tokens += 1
            why = rec.get("reject_reason") or f"the prompt alone does not fit max_length {max_length}"
            stats.rejects.append({"id": rec["id"], "reason": f"no loss tokens: nothing was generated ({why})"})
            continue
        exact = None
        tools = rec.get("tools")
        if any("token_ids" in m for m in rec["messages"]):
            exact = tokenize_from_token_ids(tokenizer, rec["messages"], tools)
            stats.from_token_ids += exact is not None
            stats.token_ids_fallback += exact is None
        try:
            ids, mask = exact or tokenize_with_mask(tokenizer, rec["messages"], mode, tools)
            stats.reasoning_not_rendered += reasoning_not_rendered(tokenizer, rec["messages"], tools)
        except TemplateMaskError as e:
            raise TemplateMaskError(f"record {rec['id']!r}: {e}") from None
        except Exception as e:  # the template itself refuses this conversation (jinja raise_exception): a bad record
            if type(e).__module__.split(".")[0] != "jinja2":
                raise
            stats.dropped_no_loss_tokens += 1
            stats.rejects.append({"id": rec["id"], "reason": f"no loss tokens: the chat template refuses it ({e})"})
            continue
        if len(ids) > max_length:
            if overlong == "drop":
                stats.dropped_overlong += 1
                stats.rejects.append({"id": rec["id"], "reason": f"overlong: {len(ids)} tokens > max_length {max_length}"})
                continue
            ids, mask = ids[:max_length], mask[:max_length]
            stats.truncated += 1
        labels = label_tokens(tokenizer, ids, mask, calls)
        parts = count_labels(labels)
        if not train_reasoning:  # data.train_reasoning=false: the <think>...</think> tokens are not trained on
            mask = [0 if lab == REASONING else m for m, lab in zip(mask, labels)]
        if sum(mask) == 0:
            stats.dropped_no_loss_tokens += 1
            stats.rejects.append({"id": rec["id"], "reason": "no loss tokens: no assistant token within max_length"})
            continue
        stats.kept += 1
        stats.reasoning_tokens += parts[REASONING]
        stats.tool_call_tokens += parts[TOOL_CALL]
        stats.tokens += len(ids)
        stats.loss_tokens += sum(mask)
        out.append({"id": rec["id"], "input_ids": ids, "loss_mask": mask})
    return out, stats


# how the inspector marks each trained-on part: (tty colour, opening bracket, closing bracket)
SPAN_STYLE = {ANSWER: ("30;42", "⟦", "⟧"), REASONING: ("30;46", "⟪", "⟫"), TOOL_CALL: ("30;43", "⦃", "⦄")}


def render_masked(tokenizer, input_ids: list[int], loss_mask: list[int], color: bool | None = None,
                  calls: ToolCallFormat = CALL_FORMATS["none"]) -> str:
    """The decoded sample with trained-on (mask 1) runs highlighted by part: answers green (else ⟦...⟧), reasoning
    cyan (⟪...⟫), tool calls yellow (⦃...⦄)."""
    if color is None:
        color = sys.stdout.isatty()
    labels = label_tokens(tokenizer, input_ids, loss_mask, calls)
    pieces, start = [], 0
    for t in range(1, len(input_ids) + 1):
        if t == len(input_ids) or labels[t] != labels[start]:
            text = tokenizer.decode(input_ids[start:t], skip_special_tokens=False)
            if labels[start] is not None:
                code, left, right = SPAN_STYLE[labels[start]]
                text = f"\x1b[{code}m{text}\x1b[0m" if color else f"{left}{text}{right}"
            pieces.append(text)
            start = t
    return "".join(pieces)
