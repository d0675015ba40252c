"""The recipe's chat template on the target's tokenizer, and the tokens that end an assistant turn (the shipped
templates themselves: recipes/chat_templates.py)."""
from __future__ import annotations

from recipes.chat_templates import read_template, shipped_templates

# the token that closes an assistant turn, when it is not the tokenizer's eos token
END_OF_TURN = {"llama-3": "<|eot_id|>", "llama-3.1": "<|eot_id|>", "chatml": "<|im_end|>", "qwen3": "<|im_end|>"}


def setup_chat_template(tokenizer, name_or_path: str | None, where: str = "the tokenizer") -> str:
    """Install the recipe's template (if given) on `tokenizer`; error if it ends up with none.

    Returns a short description of the template in use, for reports.
    """
    if name_or_path:
        tokenizer.chat_template = read_template(name_or_path)
        return str(name_or_path)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(
            f"{where} has no chat template: set target.chat_template to one of {shipped_templates()} "
            "(or a path to a .jinja file)"
        )
    return "tokenizer"


def stop_token_ids(tokenizer, generation_config=None, template_name: str | None = None) -> list[int]:
    """Token ids that end an assistant turn: generation_config eos ids + tokenizer eos + template end-of-turn."""
    ids: list[int] = []
    eos = getattr(generation_config, "eos_token_id", None) if generation_config is not None else None
    for value in (eos if isinstance(eos, (list, tuple)) else [eos]):
        if value is not None:
            ids.append(int(value))
    if tokenizer.eos_token_id is not None:
        ids.append(int(tokenizer.eos_token_id))
    eot = END_OF_TURN.get(template_name or "")
    if eot is not None:
        tid = tokenizer.convert_tokens_to_ids(eot)
        if tid is not None and tid != tokenizer.unk_token_id:
            ids.append(int(tid))
    if not ids:
        raise ValueError("no stop token: the tokenizer has no eos_token and the generation config no eos_token_id")
    return sorted(set(ids))
