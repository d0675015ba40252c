"""`eagle-train SUBCOMMAND [options]`: every stage of the pipeline under one command, the console script a
`pip install` puts on PATH ([project.scripts] in pyproject.toml).

    eagle-train demo                                     # the whole pipeline on the embedded default target
    eagle-train plan --recipe llama3-8b --gpus 8         # memory / disk / time plan of a run
    eagle-train prep --recipe R                          # data prep: load -> regenerate -> tokenize -> cache
    eagle-train train --recipe R                         # train the head (one process; GPUs: deepspeed train/main.py)
    eagle-train eval --recipe R --head HEAD              # speed-up and losslessness (eval's commands: see below)
    eagle-train export --recipe R --format vllm          # the head in a serving engine's folder format
    eagle-train serve-check --recipe R --head HEAD --engine-python VLLM_PYTHON   # the head inside vLLM

A subcommand is the stage's own program (the module in SUBCOMMANDS), given the rest of the command line: the same
options, output and exit codes as its documented invocation, which keeps working (`python train/main.py`,
`deepspeed train/main.py`, `torchrun ... train/main.py`, `python -m train.plan`, `python -m evaluation`, ...). Only
the name in its usage line differs. Multi-process runs still start the scripts by path (`deepspeed|torchrun ...
train/main.py`, `torchrun ... data_prep/main.py`): their launchers run a file per rank.
"""
from __future__ import annotations

import difflib
import importlib
import sys
from dataclasses import dataclass

from eagle.cli_errors import EXIT_USER_ERROR, command_name

PROG = "eagle-train"


@dataclass(frozen=True)
class Subcommand:
    module: str       # the stage's module; its `main(argv) -> int` runs the subcommand
    documented: str   # the prog its parser prints when started the documented way (replaced by `eagle-train NAME`)
    summary: str      # one line for `eagle-train --help`
    prefix: tuple[str, ...] = ()  # arguments put before the user's (evaluation's own command)


_EVAL = "evaluation.main"
SUBCOMMANDS = {
    "demo": Subcommand("quickstart.demo", "python -m quickstart",
                       "the whole pipeline (data prep, training, export, tuning, evaluation) on the default target"),
    "plan": Subcommand("train.plan", "python -m train.plan",
                       "memory / disk / time plan of a recipe on given GPUs and nodes, before a long run"),
    "prep": Subcommand("data_prep.main", "data_prep/main.py",
                       "data prep: load -> regenerate with the target -> tokenize -> feature cache"),
    "corpus": Subcommand("data_prep.corpus_cache", "python -m train.corpus_cache",
                         "feature cache from a plain-text corpus (base LMs without a chat template)"),
    "train": Subcommand("train.main", "train/main.py", "train the draft head on the feature cache, then export it"),
    "eval-head": Subcommand("train.eval_head", "python -m train.eval_head",
                            "held-out loss / accuracy / simulated acceptance of any head on a recipe's cache"),
    "export": Subcommand("export.cli", "python -m train.export",
                         "write a head in the folder format a serving engine loads (eagle, vllm, sglang)"),
    "hub": Subcommand("export.hub", "python -m train.hub", "push an exported head with its model card to the Hub"),
    "eval": Subcommand(_EVAL, "python -m evaluation",
                       "evaluate a head: bench (default), autotune, chi2, serve-check, serve-sweep"),
    "autotune": Subcommand(_EVAL, "python -m evaluation autotune",
                           "the fastest EAGLE-2 tree for a head -> tree_config.json beside it", ("autotune",)),
    "chi2": Subcommand(_EVAL, "python -m evaluation chi2",
                       "losslessness at temperature > 0 (sampling distributions)", ("chi2",)),
    "serve-check": Subcommand(_EVAL, "python -m evaluation serve-check",
                              "the head inside a serving engine (vLLM) vs this project's decoder", ("serve-check",)),
    "serve-sweep": Subcommand(_EVAL, "python -m evaluation serve-sweep",
                              "the engine's best speculative k per concurrency level", ("serve-sweep",)),
}


def usage() -> str:
    rows = "\n".join(f"  {name:<12} {sub.summary}" for name, sub in SUBCOMMANDS.items())
    return (f"usage: {PROG} SUBCOMMAND [options]   ({PROG} SUBCOMMAND --help: its options)\n\n"
            f"Train, evaluate and serve EAGLE-2 / EAGLE-3 draft heads for lossless speculative decoding.\n\n"
            f"subcommands:\n{rows}\n")


def main(argv: list[str] | None = None) -> int:
    """Run `eagle-train SUBCOMMAND ...`: the subcommand's module's main with the remaining arguments."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["-h"], ["--help"]):
        print(usage(), end="")
        return 0
    if not argv:
        print(f"error: {PROG}: give a subcommand: one of {', '.join(SUBCOMMANDS)} (`{PROG} --help` says what each "
              "does)", file=sys.stderr)
        return EXIT_USER_ERROR
    name, rest = argv[0], argv[1:]
    sub = SUBCOMMANDS.get(name)
    if sub is None:
        close = difflib.get_close_matches(name, list(SUBCOMMANDS), n=1, cutoff=0.5)
        hint = f"did you mean {close[0]}? " if close else ""
        print(f"error: {PROG}: unknown subcommand {name!r}: {hint}one of {', '.join(SUBCOMMANDS)} "
              f"(`{PROG} --help` says what each does)", file=sys.stderr)
        return EXIT_USER_ERROR
    stage_main = importlib.import_module(sub.module).main  # imported on use: `eagle-train --help` loads no torch
    with command_name(sub.documented, f"{PROG} {name}"):
        return stage_main([*sub.prefix, *rest])
