"""The recipe schema: every section's dataclass composed into one `Recipe`, and the check of every value.

Each section has its own file (recipes/data.py, head.py, train.py, loss.py, eval.py; `decoding` is the library's
eagle/decoding_config.py), so every default has exactly one home. Stages read the sections; they never define them.
"""
from __future__ import annotations

import inspect
import re
from dataclasses import MISSING, dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from eagle.decoding_config import DecodingConfig
from eagle.quantization import NONE, QUANT_METHODS
from eagle.static_trees import STATIC_TREES
from recipes.chat_templates import shipped_templates
from recipes.check import RecipeError, check
from recipes.data import DataSettings, validate_data_section
from recipes.eval import EvalSettings, validate_eval_section
from recipes.head import head_settings, validate_head_section
from recipes.loss import LossSettings, validate_loss_section
from recipes.train import ExportSettings, LoggingSettings, TrainSettings, validate_train_sections


@dataclass
class TargetSettings:
    """The frozen target LLM."""

    path: str = ""  # HF hub id or local folder; "" = the embedded quickstart default model
    dtype: str = "bfloat16"  # float32 | bfloat16 | float16
    attn_implementation: str = "sdpa"  # sdpa | eager: tree masks are only correct with additive masks
    chat_template: str | None = None  # shipped template name (llama-2-chat, llama-3, llama-3.1, vicuna, chatml, qwen3) if tokenizer lacks one
    revision: str | None = None
    quantization: str = NONE  # the SERVED target's weight quantization (eagle/quantization.py): none | int8 | int4 | int4-g16 | int4-g32 | int4-g64 | int4-g128; data prep, training, evaluation and the card use the target quantized so


TARGET_DTYPES = ("float32", "bfloat16", "float16")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")


@dataclass
class Recipe:
    name: str = "unnamed"
    output_dir: str = "runs/${name}"
    seed: int = 0
    target: TargetSettings = field(default_factory=TargetSettings)
    data: DataSettings = field(default_factory=DataSettings)
    # the shared keys + every registered kind's options (recipes/head.py), built when a schema is made
    head: Any = field(default_factory=lambda: head_settings()())
    train: TrainSettings = field(default_factory=TrainSettings)
    loss: LossSettings = field(default_factory=LossSettings)
    logging: LoggingSettings = field(default_factory=LoggingSettings)
    export: ExportSettings = field(default_factory=ExportSettings)
    decoding: DecodingConfig = field(default_factory=DecodingConfig)
    eval: EvalSettings = field(default_factory=EvalSettings)


def valid_keys(cls=Recipe, prefix: str = "") -> list[str]:
    """Every dotted key of the schema."""
    out = []
    for f in fields(cls):
        t = f.default_factory() if f.default_factory is not None and callable(f.default_factory) else None  # type: ignore[misc]
        if is_dataclass(t):
            out += valid_keys(type(t), f"{prefix}{f.name}.")
        else:
            out.append(prefix + f.name)
    return out


def validate_recipe(cfg: DictConfig) -> None:
    """Check every value of the recipe (types are checked by the schema; here ranges, enums, interpolations)
    before any expensive stage starts. Each section's checks live next to its dataclass."""
    try:
        OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as e:
        raise RecipeError(f"recipe {cfg.get('name', '?')}: {' '.join(str(e).split())}") from None
    check(bool(str(cfg.name).strip()), "name", cfg.name, "expected a non-empty name")
    check(bool(str(cfg.output_dir).strip()), "output_dir", cfg.output_dir, "expected a folder")
    check(cfg.seed >= 0, "seed", cfg.seed, "expected >= 0")
    t = cfg.target
    check(t.dtype in TARGET_DTYPES, "target.dtype", t.dtype, f"expected one of {TARGET_DTYPES}")
    check(t.attn_implementation in ATTN_IMPLEMENTATIONS, "target.attn_implementation", t.attn_implementation,
          f"expected one of {ATTN_IMPLEMENTATIONS} (draft trees need an additive attention mask)")
    check(t.quantization in QUANT_METHODS, "target.quantization", t.quantization,
          f"expected one of {tuple(QUANT_METHODS)} (docs/quantization.md)")
    if t.chat_template:
        check(t.chat_template in shipped_templates() or Path(t.chat_template).is_file(), "target.chat_template",
              t.chat_template, f"expected a shipped template {shipped_templates()} or a Jinja file")
    decoding = DecodingConfig.from_section(cfg.decoding)
    try:
        decoding.validate()
    except ValueError as e:
        raise RecipeError(str(e) if str(e).startswith("decoding.") else f"decoding: {e}") from None
    check(decoding.static_choices in STATIC_TREES, "decoding.static_choices", decoding.static_choices,
          f"expected one of {sorted(STATIC_TREES)}")
    validate_data_section(cfg.data)
    validate_head_section(cfg.head)
    validate_train_sections(cfg)
    validate_loss_section(cfg.loss, cfg.head)
    validate_eval_section(cfg.eval)


def describe_recipe_keys() -> str:
    """Every recipe key with its default and the comment next to it in the section's dataclass (for --help)."""

    def comments(cls) -> dict[str, str]:
        out = {}
        for source in getattr(cls, "comment_sources", (cls,)):  # the head section: its shared keys + kinds' options
            for line in inspect.getsource(source).splitlines():
                m = re.match(r"\s+(\w+)\s*:[^#]*#\s*(.*)$", line)
                if m:
                    out.setdefault(m.group(1), m.group(2).strip())
        return out

    lines = []

    def walk(cls, prefix: str) -> None:
        notes = comments(cls)
        for f in fields(cls):
            default = f.default_factory() if f.default_factory is not MISSING else f.default
            if is_dataclass(default):
                lines.append(f"{prefix}{f.name}:")
                walk(type(default), prefix + f.name + ".")
                continue
            note = f"  # {notes[f.name]}" if f.name in notes else ""
            lines.append(f"  {prefix}{f.name} = {default!r}{note}")

    walk(Recipe, "")
    return "\n".join(lines)
