"""Load a recipe: schema defaults <- its base recipes <- the YAML file <- `key=value` overrides, every value checked
once, here.

`load_config("tiny")` finds recipes/tiny.yaml (or takes a path). A recipe may build on another: `base: llama3-8b`
(a shipped name, or a path relative to the recipe's folder) is loaded first and the recipe's own keys are merged
over it (sections key by key; a list replaces the base's list). Unknown keys fail loudly, listing the valid ones;
bad values raise RecipeError naming the key. Every command loads its recipe through this one function, and
`--print-config` prints the result (`config_yaml`).
"""
from __future__ import annotations

import difflib
from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from recipes.check import RecipeError
from recipes.schema import Recipe, valid_keys, validate_recipe

RECIPE_DIR = Path(__file__).resolve().parent


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


def load_config(name_or_path: str | None = None, overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """The recipe `name_or_path` (None = the schema defaults) with `overrides` applied, every value checked
    (RecipeError, one line naming the key)."""
    schema = OmegaConf.structured(Recipe)
    layers = [schema]
    path = name_or_path
    try:
        if name_or_path is not None:
            path = recipe_path(name_or_path)
            layers.append(read_recipe(path))
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
    except yaml.YAMLError as e:  # a malformed YAML file: name it and the line
        raise RecipeError(f"recipe {path}: invalid YAML ({' '.join(str(e).split())})") from None
    except UnicodeDecodeError as e:
        raise RecipeError(f"recipe {path}: not valid UTF-8 ({e.reason} at byte {e.start})") from None
    OmegaConf.set_readonly(cfg, False)
    validate_recipe(cfg)
    return cfg


def read_recipe(path: Path, chain: tuple[Path, ...] = ()) -> DictConfig:
    """The YAML file at `path` merged over its `base` recipe (recursively), not yet checked against the schema."""
    node = OmegaConf.load(path)
    if not isinstance(node, DictConfig):
        raise RecipeError(f"recipe {path}: expected a mapping of sections (target:, data:, train: ...), "
                          f"got a {type(node).__name__}")
    base = node.pop("base", None)
    if base is None:
        return node
    if not isinstance(base, str) or not base.strip():
        raise RecipeError(f"recipe {path}: base={base!r}: expected the name or path of the recipe it builds on")
    beside = path.parent / base
    base_path = beside if beside.suffix in (".yaml", ".yml") and beside.exists() else recipe_path(base)
    chain = (*chain, path.resolve())
    if base_path.resolve() in chain:
        raise RecipeError(f"recipe {path}: base={base!r} builds on itself ({' -> '.join(p.stem for p in chain)} -> "
                          f"{base_path.stem})")
    return OmegaConf.merge(read_recipe(base_path, chain), node)


def config_yaml(cfg: DictConfig) -> str:
    """The resolved recipe as YAML: every key, base recipes merged, overrides applied (`--print-config`)."""
    return OmegaConf.to_yaml(cfg, resolve=True)


def command_config(args, overrides: list[str] | None = None) -> DictConfig:
    """The recipe a command runs with: `args.recipe` with `overrides` (default `args.overrides`); with
    `--print-config` it is printed and the command exits."""
    cfg = load_config(args.recipe, list(args.overrides) if overrides is None else overrides)
    if args.print_config:
        print(config_yaml(cfg), end="")
        raise SystemExit(0)
    return cfg


def add_print_config(parser) -> None:
    """The `--print-config` flag of a command that loads a recipe."""
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved recipe (its base recipes merged, the overrides applied, every key) "
                             "and exit")


def _did_you_mean(key: str) -> str:
    valid = valid_keys(Recipe)
    section = key.split(".")[0] + "."
    leaves = {k.split(".")[-1]: k for k in valid if k.startswith(section)}
    close = [leaves[m] for m in difflib.get_close_matches(key.split(".")[-1], list(leaves), n=3, cutoff=0.6)]
    same_section = [k for k in valid if k.startswith(section)]
    listing = f"valid keys of {section[:-1]}: {', '.join(same_section)}" if same_section else \
        f"valid sections: {', '.join(sorted({k.split('.')[0] for k in valid}))}"
    return (f": did you mean {' or '.join(close)}? " if close else ": ") + listing
