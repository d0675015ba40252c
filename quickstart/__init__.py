"""The fresh-machine quickstart: an embedded default target and the one-command demo (`python -m quickstart`).

`ensure_default_target()` builds (once) and returns a small Llama chat model trained on stdlib-docstring
conversations; `default_conversations` / `default_questions` / `default_prompts` are its prompt sets.
"""
from quickstart.docstring_corpus import default_conversations, default_prompts, default_questions
from quickstart.default_target import default_target_dir, ensure_default_target, read_build_info

__all__ = ["default_conversations", "default_prompts", "default_questions", "default_target_dir",
           "ensure_default_target", "read_build_info"]
