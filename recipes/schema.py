"""The recipe schema. Each section's dataclass lives next to the code that consumes it, so
every default has exactly one home; this file only composes them and loads YAML."""
from __future__ import annotations

from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

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
    attn_implementation: str = "sdpa"  # sdpa | eager: tree masks are only correct with additive masks
    chat_template: str | None = None  # shipped template name (llama-2-chat, llama-3, vicuna, chatml) if tokenizer lacks one
    revision: str | None = None


TARGET_DTYPES = ("float32", "bfloat16", "float16")
ATTN_IMPLEMENTATIONS = ("sdpa", "eager")


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


def load_recipe(name_or_path: str | None = None, overrides: list[str] | tuple[str, ...] = (),
                validate: bool = True) -> DictConfig:
    """Schema defaults <- YAML file <- `key=value` overrides. Unknown keys and bad values raise RecipeError
    (one line naming the key); `validate=False` skips the value checks (`validate_recipe`)."""
    schema = OmegaConf.structured(Recipe)
    layers = [schema]
    path = name_or_path
    try:
        if name_or_path is not None:
            path = recipe_path(name_or_path)
            layers.append(OmegaConf.load(path))
        if len(layers) > 1 and not isinstance(layers[-1], DictConfig):
            raise RecipeError(f"recipe {path}: expected a mapping of sections (target:, data:, train: ...), "
                              f"got a {type(layers[-1]).__name__}")
        if overrides:
            for o in overrides:
                if "=" not in o or not o.split("=", 1)[0].strip():
                    raise RecipeError(f"override {o!r} is not of the form key=value")
            layers.append(OmegaConf.from_dotlist(list(overrides)))
        cfg = OmegaConf.merge(*layers)
    except (ConfigAttributeError, ConfigKeyError) as e:
        key = getattr(e, "full_key", None) or str(e)
        raise RecipeError(f"unknown recipe key {key!r} in {name_or_path}{_did_you_mean(str(key))}; "
                          "`python train/main.py --help` lists every key") from None
    except ValidationError as e:  # a value of the wrong type: name the key
        raise RecipeError(f"recipe {name_or_path}: {' '.join(e.msg.split())} (key {e.full_key})") from None
    except OmegaConfBaseException as e:  # a syntax error in an override, a bad interpolation...
        raise RecipeError(f"recipe {name_or_path}: {' '.join(str(e).split())}") from None
    except Exception as e:
        import yaml

        if isinstance(e, yaml.YAMLError):  # a malformed YAML file: name it and the line
            raise RecipeError(f"recipe {path}: invalid YAML ({' '.join(str(e).split())})") from None
        if isinstance(e, UnicodeDecodeError):
            raise RecipeError(f"recipe {path}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
        raise
    OmegaConf.set_readonly(cfg, False)
    if validate:
        validate_recipe(cfg)
    return cfg


def _did_you_mean(key: str) -> str:
    import difflib

    valid = _valid_keys(Recipe)
    section = key.split(".")[0] + "."
    leaves = {k.split(".")[-1]: k for k in valid if k.startswith(section)}
    close = [leaves[m] for m in difflib.get_close_matches(key.split(".")[-1], list(leaves), n=3, cutoff=0.6)]
    same_section = [k for k in valid if k.startswith(section)]
    listing = f"valid keys of {section[:-1]}: {', '.join(same_section)}" if same_section else \
        f"valid sections: {', '.join(sorted({k.split('.')[0] for k in valid}))}"
    return (f": did you mean {' or '.join(close)}? " if close else ": ") + listing


def _check(cond: bool, key: str, value, expect: str) -> None:
    if not cond:
        raise RecipeError(f"{key}={value!r}: {expect}")


def validate_recipe(cfg: DictConfig) -> None:
    """Check every value of the recipe (types are checked by the schema; here ranges, enums, interpolations)
    before any expensive stage starts. Each section's checks live next to its dataclass."""
    from data_prep.settings import validate_data_section
    from evaluation.settings import validate_eval_section
    from train.settings import validate_train_sections

    try:
        OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as e:
        raise RecipeError(f"recipe {cfg.get('name', '?')}: {' '.join(str(e).split())}") from None
    _check(bool(str(cfg.name).strip()), "name", cfg.name, "expected a non-empty name")
    _check(bool(str(cfg.output_dir).strip()), "output_dir", cfg.output_dir, "expected a folder")
    _check(cfg.seed >= 0, "seed", cfg.seed, "expected >= 0")
    t = cfg.target
    _check(t.dtype in TARGET_DTYPES, "target.dtype", t.dtype, f"expected one of {TARGET_DTYPES}")
    _check(t.attn_implementation in ATTN_IMPLEMENTATIONS, "target.attn_implementation", t.attn_implementation,
           f"expected one of {ATTN_IMPLEMENTATIONS} (draft trees need an additive attention mask)")
    if t.chat_template:
        from data_prep.chat_template import shipped_templates

        _check(t.chat_template in shipped_templates() or Path(t.chat_template).is_file(), "target.chat_template",
               t.chat_template, f"expected a shipped template {shipped_templates()} or a Jinja file")
    from eagle.static_trees import STATIC_TREES

    decoding = DecodingConfig.from_section(cfg.decoding)
    try:
        decoding.validate()
    except ValueError as e:
        raise RecipeError(str(e) if str(e).startswith("decoding.") else f"decoding: {e}") from None
    _check(decoding.static_choices in STATIC_TREES, "decoding.static_choices", decoding.static_choices,
           f"expected one of {sorted(STATIC_TREES)}")
    validate_data_section(cfg.data, _check)
    validate_train_sections(cfg)
    validate_eval_section(cfg.eval, _check)
