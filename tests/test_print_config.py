"""`--print-config` on every command that has it (found by scanning the source for `add_print_config(`), with and
without `--recipe`: it prints the resolved recipe (the overrides applied) and exits 0 without any of the run's other
required options, or is refused with one line naming what it needs; never a traceback, never ignored."""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from fault_helpers import run_cli
from recipes import config_yaml, load_config

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("eagle", "recipes", "engine", "data_prep", "train", "export", "evaluation", "quickstart", "benchmarks")


def commands_with_print_config() -> set[str]:
    return {".".join(p.relative_to(ROOT).with_suffix("").parts) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
            if "add_print_config(" in p.read_text() and p.relative_to(ROOT).as_posix() != "recipes/load.py"}


def _evaluation_commands() -> list[str]:
    from evaluation.main import COMMANDS
    return list(COMMANDS)


# module -> (argv prefixes: one per sub-command, without a recipe: "defaults" prints the schema defaults the command
# then runs with | "refused" one line naming --recipe)
COMMANDS = {
    "data_prep.main": ([[]], "refused"),
    "train.main": ([[]], "refused"),
    "train.plan": ([[]], "refused"),
    "train.eval_head": ([[]], "refused"),
    "train.stream_producer": ([[]], "refused"),
    "data_prep.corpus_cache": ([[]], "refused"),
    "export.cli": ([[]], "refused"),
    "export.hub": ([[]], "refused"),
    "evaluation.main": ([[], *[[c] for c in _evaluation_commands()]], "defaults"),
}
CASES = [pytest.param(mod, pre, id=f"{mod}-{'-'.join(pre) or 'default'}") for mod, (pres, _) in COMMANDS.items()
         for pre in pres]


def test_every_command_with_print_config_is_looped_over():
    assert commands_with_print_config() == set(COMMANDS)


@pytest.mark.parametrize("mod,pre", CASES)
def test_print_config_with_a_recipe_prints_it_and_needs_nothing_else(mod, pre, capsys):
    main = importlib.import_module(mod).main
    code, out, err = run_cli(main, [*pre, "--print-config", "--recipe", "tiny", "train.max_steps=7"], capsys)
    assert code == 0, err
    assert out == config_yaml(load_config("tiny", ["train.max_steps=7"]))
    assert yaml.safe_load(out)["train"]["max_steps"] == 7


@pytest.mark.parametrize("mod,pre", CASES)
def test_print_config_without_a_recipe_prints_the_defaults_or_is_one_line(mod, pre, capsys):
    main = importlib.import_module(mod).main
    code, out, err = run_cli(main, [*pre, "--print-config"], capsys)
    if COMMANDS[mod][1] == "defaults":
        assert code == 0 and OmegaConf.create(yaml.safe_load(out)) == load_config(None), err
    else:
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert code == 2 and out == "" and len(lines) == 1 and lines[0].startswith("error:"), err
        assert "--recipe" in lines[0] and "Traceback" not in err


def test_print_config_with_a_bad_recipe_is_one_line(capsys):
    from train.main import main
    code, out, err = run_cli(main, ["--print-config", "--recipe", "no-such-recipe"], capsys)
    assert code == 2 and out == "" and err.startswith("error: recipe 'no-such-recipe' not found") and err.count("\n") == 1
