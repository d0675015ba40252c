"""The recipe schema. Each section's dataclass lives next to the code that consumes it, so
every default has exactly one home; this file only composes them and loads YAML."""
from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError

from data_prep.settings import DataSettings
from eagle.decoding_config import DecodingConfig
from evaluation.settings import EvalSettings
from train.settings import ExportSettings, HeadSettings, LoggingSettings, TrainSettings

RECIPE_DIR = Path(__file__).resolve().parent


class RecipeError(ValueError):
    """A recipe names an unknown key or has a bad value; the message lists what is valid."""


@dataclass
class TargetSettings:
    """The frozen target LLM."""

    path: str = ""  # HF hub id or local folder; "" = the embedded quickstart default model
    dtype: str = "bfloat16"  # float32 | bfloat16 | float16
    attn_implementation: str = "sdpa"  # tree masks are only correct with sdpa (or additive masks)
    chat_template: str | None = None  # shipped template name (llama-2-chat, llama-3, vicuna, chatml) if tokenizer lacks one
    revision: str | None = None


@dataclass
class Recipe:
    name: str = "unnamed"
    output_dir: str = "runs/${name}"
    seed: int = 0
    target: TargetSettings = field(default_factory=TargetSettings)
    data: DataSettings = field(default_factory=DataSettings)
    head: HeadSettings = field(default_factory=HeadSettings)
    train: TrainSettings = field(default_factory=TrainSettings)
    logging: LoggingSettings = field(default_factory=LoggingSettings)
    export: ExportSettings = field(default_factory=ExportSettings)
    decoding: DecodingConfig = field(default_factory=DecodingConfig)
    eval: EvalSettings = field(default_factory=EvalSettings)


def list_recipes() -> list[str]:
    """Names of the recipes shipped in recipes/."""
    return sorted(p.stem for p in RECIPE_DIR.glob("*.yaml"))


def recipe_path(name_or_path: str) -> Path:
    """recipes/NAME.yaml for a bare name, else the given path."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") and p.exists():
        return p
    cand = RECIPE_DIR / (p.name if p.suffix in (".yaml", ".yml") else f"{name_or_path}.yaml")
    if cand.exists():
        return cand
    raise FileNotFoundError(f"recipe {name_or_path!r} not found (as a path or in {RECIPE_DIR}); shipped: {list_recipes()}")


def _valid_keys(cls, prefix: str = "") -> list[str]:
    out = []
    for f in fields(cls):
        t = f.default_factory() if f.default_factory is not None and callable(f.default_factory) else None  # type: ignore[misc]
        if is_dataclass(t):
            out += _valid_keys(type(t), f"{prefix}{f.name}.")
        else:
            out.append(prefix + f.name)
    return out


def load_recipe(name_or_path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """Schema defaults <- YAML file <- `key=value` overrides. Unknown keys raise, naming the valid ones."""
    schema = OmegaConf.structured(Recipe)
    layers = [schema]
    try:
        if name_or_path is not None:
            path = recipe_path(name_or_path)
            layers.append(OmegaConf.load(path))
        if overrides:
            for o in overrides:
                if "=" not in o:
                    raise ValueError(f"override {o!r} is not of the form key=value")
            layers.append(OmegaConf.from_dotlist(list(overrides)))
        cfg = OmegaConf.merge(*layers)
    except (ConfigAttributeError, ConfigKeyError) as e:
        key = getattr(e, "full_key", None) or str(e)
        raise RecipeError(
            f"unknown recipe key {key!r} in {name_or_path}: valid keys are:\n  " + "\n  ".join(_valid_keys(Recipe))
        ) from None
    OmegaConf.set_readonly(cfg, False)
    return cfg
