"""Training samples from the token ids the target generated (exactly on-policy), not from re-tokenised text.

Both regeneration backends keep, on every assistant message they write, `token_ids`: the ids the target produced
for that reply, ending with its stop token when it stopped on one (HF `generate`; vLLM's `return_token_ids`).
Decoding those ids to text and tokenising the text again is not always the identity (a stripped leading space,
a byte-fallback or merge that tokenises differently), so a sample built from text may hold tokens the target
never produced. `tokenize_from_token_ids` builds the sample from the ids instead: the prompt of assistant turn i
is the chat template rendered over messages[:i] with the generation prompt, tokenised exactly as the backends
tokenise it (`prompt_ids`); it must extend the ids of the turns before (their prompts, replies and stop tokens),
or the record falls back to the text path (counted by the tokenize stage).
"""
from __future__ import annotations


def prompt_ids(tokenizer, history: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The ids a backend feeds the target for `history` (ending with a user or tool turn): the chat template with
    the generation prompt and the conversation's `tools`, tokenised without adding special tokens (the template
    writes them)."""
    text = tokenizer.apply_chat_template(chat_messages(history), tools=tools or None, tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# what a chat template or an OpenAI server is given of a message (not this pipeline's token_ids)
MESSAGE_KEYS = ("role", "content", "reasoning_content", "tool_calls", "tool_call_id", "name")


def chat_messages(history: list[dict]) -> list[dict]:
    """`history` with only the fields a chat template or an OpenAI server reads."""
    return [{k: m[k] for k in MESSAGE_KEYS if k in m} for m in history]


def tokenize_from_token_ids(tokenizer, messages: list[dict],
                            tools: list[dict] | None = None) -> tuple[list[int], list[int]] | None:
    """(input_ids, loss_mask) of a regenerated conversation from its replies' `token_ids`; mask 1 on exactly the
    generated ids (stop token included). None when a reply lacks token ids or a prompt does not extend the ids
    before it (the template re-renders an earlier reply's text to other tokens)."""
    ids: list[int] = []
    mask: list[int] = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        generated = m.get("token_ids")
        if generated is None:
            return None
        prompt = prompt_ids(tokenizer, messages[:i], tools)
        if prompt[: len(ids)] != ids:
            return None
        mask += [0] * (len(prompt) - len(ids))
        ids = list(prompt) + [int(t) for t in generated]
        mask += [1] * len(generated)
    return (ids, mask) if ids else None
