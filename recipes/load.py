"""Load a recipe: schema defaults <- its base recipes <- the YAML file <- `key=value` overrides, every value checked
once, here.

`load_config("tiny")` finds recipes/tiny.yaml (or takes a path). A recipe may build on another: `base: llama3-8b`
(a shipped name, or a path relative to the recipe's folder) is loaded first and the recipe's own keys are merged
over it (sections key by key; a list replaces the base's list). Unknown keys fail loudly, listing the valid ones;
bad values raise RecipeError naming the key. Every command loads its recipe through this one function, and
`--print-config` prints the result (`config_yaml`).
"""
from __future__ import annotations

import argparse

import dataclasses
import difflib
import re
import typing
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
    except ValidationError as e:  # a value of the wrong type: the key, the type it takes, an example
        raise RecipeError(type_error(e, name_or_path, overrides)) from None
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


class _PrintConfig(argparse.Action):
    """--print-config: a run's other required options (--head, --text, --format...) are not needed to print its
    recipe, so they stop being required; --recipe stays required where the command needs one."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, True)
        for action in parser._actions:
            if action.required and action.dest != "recipe":
                action.required = False


def add_print_config(parser) -> None:
    """The `--print-config` flag of a command that loads a recipe (`command_config` prints and exits)."""
    parser.add_argument("--print-config", action=_PrintConfig, nargs=0, default=False,
                        help="print the resolved recipe (its base recipes merged, the overrides applied, every key) "
                             "and exit; needs only --recipe (and overrides), where the command takes one")


def _did_you_mean(key: str) -> str:
    valid = valid_keys(Recipe)
    section = key.split(".")[0] + "."
    leaves = {k.split(".")[-1]: k for k in valid if k.startswith(section)}
    close = [leaves[m] for m in difflib.get_close_matches(key.split(".")[-1], list(leaves), n=3, cutoff=0.6)]
    same_section = [k for k in valid if k.startswith(section)]
    listing = f"valid keys of {section[:-1]}: {', '.join(same_section)}" if same_section else \
        f"valid sections: {', '.join(sorted({k.split('.')[0] for k in valid}))}"
    return (f": did you mean {' or '.join(close)}? " if close else ": ") + listing


def type_error(e: ValidationError, recipe, overrides) -> str:
    """One line for a value omegaconf cannot store in its key: `key=value: expected <type>, e.g. key=<example>`."""
    key, value = e.full_key, getattr(e, "value", None)
    if not key:  # a whole section given a plain value (`target=5`): omegaconf names no key
        sections = [f.name for f in dataclasses.fields(Recipe) if dataclasses.is_dataclass(_key_type(f.name))]
        given = [o.split("=", 1)[0].strip() for o in overrides if "=" in o]
        key = next((k for k in given if k in sections), None)
        if key is None:
            return f"recipe {recipe}: {' '.join(str(e.msg or e).split())}"
        value = next(o.split("=", 1)[1] for o in overrides if o.split("=", 1)[0].strip() == key)
    base = re.sub(r"\[\d+\]$", "", key)
    tp = _key_type(base)
    if base != key:  # one element of a list
        tp = (typing.get_args(tp) or (typing.Any,))[0]
    if dataclasses.is_dataclass(tp):
        keys = [k for k in valid_keys(Recipe) if k.startswith(key + ".")]
        return f"{key}={value!r}: {key} is a section, not a value: set its keys ({', '.join(keys[:6])}, ...)"
    where = "" if any(o.split("=", 1)[0].strip() in (key, base) for o in overrides) else f" (recipe {recipe})"
    return f"{key}={value!r}{where}: expected {_describe(tp)}, e.g. {base}={_example(base, _key_type(base))}"


def _key_type(key: str):
    """The schema's type of dotted `key` (typing.Any when the schema does not say)."""
    tp = Recipe
    for part in key.split("."):
        hints = typing.get_type_hints(tp) if dataclasses.is_dataclass(tp) else {}
        if part not in hints:
            return typing.Any
        parent, tp = tp, hints[part]
        if tp is typing.Any:  # a section whose dataclass is built with the schema (`Recipe.head`): that dataclass
            made = next(f for f in dataclasses.fields(parent) if f.name == part).default_factory
            tp = typing.Any if made is dataclasses.MISSING else type(made())
            tp = tp if dataclasses.is_dataclass(tp) else typing.Any
    return tp


_NAMES = {bool: ("true or false", "true or false values"), int: ("a whole number", "whole numbers"),
          float: ("a number", "numbers"), str: ("a string", "strings")}


def _describe(tp) -> str:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if type(None) in typing.get_args(tp) and len(args) == 1:
        return f"{_describe(args[0])} or null"
    if typing.get_origin(tp) in (list, tuple):
        return f"a list of {_NAMES.get(args[0], ('', 'values'))[1] if args else 'values'}"
    return _NAMES.get(tp, ("a value of type " + getattr(tp, "__name__", str(tp)), ""))[0]


def _example(key: str, tp) -> str:
    """The schema default of `key` as an override would spell it (a made-up value when the default is empty)."""
    default = OmegaConf.select(OmegaConf.structured(Recipe), key)
    if isinstance(default, (list, tuple)) or OmegaConf.is_list(default):
        default = list(default)
        if not default:
            element = (typing.get_args(tp) or (int,))[0]
            default = {int: [1, 2, 3], float: [0.5, 0.25], str: ["a", "b"]}.get(element, [1, 2])
        return "[" + ",".join(str(x) for x in default) + "]"
    if default is None or default == "":
        return {int: "1", float: "0.5", bool: "true"}.get(typing.get_args(tp)[0] if typing.get_args(tp) else tp, "...")
    return str(default).lower() if isinstance(default, bool) else str(default)
