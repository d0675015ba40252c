"""Shipped chat templates (recipes/chat_templates/*.jinja) a recipe can name in `target.chat_template`, for
tokenizers that lack one.

Every shipped template marks assistant replies with ``{% generation %}`` so that
``apply_chat_template(..., return_assistant_tokens_mask=True)`` gives the exact loss mask.
"""
from __future__ import annotations

from pathlib import Path

TEMPLATE_DIR = Path(__file__).resolve().parent / "chat_templates"


def shipped_templates() -> list[str]:
    return sorted(p.stem for p in TEMPLATE_DIR.glob("*.jinja"))


def read_template(name_or_path: str) -> str:
    """Template text for a shipped name (llama-2-chat, llama-3, llama-3.1, vicuna, chatml, qwen3, plain) or a .jinja path."""
    path = Path(name_or_path)
    if path.suffix == ".jinja" and path.is_file():
        return path.read_text()
    shipped = TEMPLATE_DIR / f"{name_or_path}.jinja"
    if not shipped.is_file():
        raise ValueError(f"unknown chat template {name_or_path!r}: shipped ones are {shipped_templates()} (or give a .jinja path)")
    return shipped.read_text()
