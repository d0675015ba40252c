"""Turn a conversation (user turns + the model's own previous answers) into prompt token ids.

With a chat template (the tokenizer's own, or one passed in) the conversation is rendered with
`tokenizer.apply_chat_template(..., add_generation_prompt=True)`. A tokenizer WITHOUT a template
(e.g. stories260K, a plain language model) gets raw text: the first turn is encoded as is (with
the tokenizer's usual special tokens, e.g. BOS), and every later turn is appended after the
previous prompt and the model's own answer tokens, joined by `turn_separator`. Which of the two
was used is recorded in every report (`chat_format`).
"""
from __future__ import annotations


class ChatFormat:
    def __init__(self, tokenizer, chat_template: str | None = None, turn_separator: str = "\n"):
        self.tokenizer = tokenizer
        self.template = chat_template or getattr(tokenizer, "chat_template", None) or None
        self.turn_separator = turn_separator

    @property
    def name(self) -> str:
        """"chat_template" or "raw_text" (no template: prompts are fed verbatim)."""
        return "chat_template" if self.template else "raw_text"

    def first_prompt(self, turn: str, tools: list[dict] | None = None) -> list[int]:
        """Token ids for the first user turn."""
        return self.next_prompt([], [], [], turn, tools)

    def next_prompt(self, prev_prompt_ids: list[int], prev_answer_ids: list[int], history: list[tuple[str, str]],
                    turn: str, tools: list[dict] | None = None) -> list[int]:
        """Token ids for `turn` after `history` ([(user, answer_text), ...]); `tools` (tool-call questions) reach
        the chat template. An earlier answer goes back as its text (a thinking template such as qwen3 splits an
        inline <think> off it and drops it from earlier turns, as when serving).

        prev_prompt_ids / prev_answer_ids: the previous turn's prompt and generated ids (raw-text
        mode continues from exactly these tokens, so the model sees its own answer unchanged)."""
        if self.template:
            messages = []
            for user, answer in history:
                messages += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
            messages.append({"role": "user", "content": turn})
            text = self.tokenizer.apply_chat_template(messages, chat_template=self.template, tools=tools or None,
                                                      tokenize=False, add_generation_prompt=True)
            # the rendered text already holds BOS etc.: do not add special tokens twice
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if tools:
            raise ValueError("a question with tools needs a chat template to show them to the model; set "
                             "target.chat_template (e.g. qwen3 or llama-3.1) or drop the tool-call questions")
        if not history:
            return self.tokenizer(turn)["input_ids"]
        follow = self.tokenizer(self.turn_separator + turn, add_special_tokens=False)["input_ids"]
        return list(prev_prompt_ids) + list(prev_answer_ids) + follow

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
