"""The command line a user types: the one installed command (`eagle-train SUBCOMMAND`, eagle_train/cli.py) and every
documented invocation it sits beside (`python train/main.py`, `deepspeed train/main.py`, `python -m train.plan`,
`python -m evaluation`, `python -m benchmarks.NAME`...), each run with --help in a fresh process from the repository,
and every command README shows is one of them."""
from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from eagle_train import cli
from fault_helpers import assert_one_line_error, run_cli

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
BENCHMARKS = sorted(p.stem for p in (REPO / "benchmarks").glob("*.py") if p.stem != "__init__")  # every script

# invocation (as README writes it, without its arguments) -> (argv that runs it with --help, the usage line's prog)
INVOCATIONS = {
    "python train/main.py": ([sys.executable, "train/main.py"], "train/main.py"),
    "torchrun train/main.py": ([str(BIN / "torchrun"), "--nproc_per_node", "1", "train/main.py"], "train/main.py"),
    "deepspeed train/main.py": ([str(BIN / "deepspeed"), "train/main.py"], "train/main.py"),
    "python data_prep/main.py": ([sys.executable, "data_prep/main.py"], "data_prep/main.py"),
    "torchrun data_prep/main.py": ([str(BIN / "torchrun"), "--nproc_per_node", "1", "data_prep/main.py"],
                                   "data_prep/main.py"),
    "python -m train.main": ([sys.executable, "-m", "train.main"], "train/main.py"),
    "python -m data_prep.main": ([sys.executable, "-m", "data_prep.main"], "data_prep/main.py"),
    "python -m evaluation": ([sys.executable, "-m", "evaluation"], "python -m evaluation"),
    "python -m train.plan": ([sys.executable, "-m", "train.plan"], "python -m train.plan"),
    "python -m train.export": ([sys.executable, "-m", "train.export"], "python -m train.export"),
    "python -m train.hub": ([sys.executable, "-m", "train.hub"], "python -m train.hub"),
    "python -m export.hub": ([sys.executable, "-m", "export.hub"], "python -m train.hub"),  # the trainer's Hub push
    "python -m train.corpus_cache": ([sys.executable, "-m", "train.corpus_cache"], "python -m train.corpus_cache"),
    "python -m train.eval_head": ([sys.executable, "-m", "train.eval_head"], "python -m train.eval_head"),
    "python -m train.stream_producer": ([sys.executable, "-m", "train.stream_producer"],
                                        "python -m train.stream_producer"),  # started by stream mode's rank 0
    "python -m quickstart": ([sys.executable, "-m", "quickstart"], "python -m quickstart"),
    "python -m eagle_train": ([sys.executable, "-m", "eagle_train"], "eagle-train"),
    **{f"python -m benchmarks.{name}": ([sys.executable, "-m", f"benchmarks.{name}"], f"python -m benchmarks.{name}")
       for name in BENCHMARKS},  # not installed: run from the repository root
}
# a module run by path, which refuses in one line naming its real invocations (a doc may say so): checked below
REFUSED = {"python evaluation/main.py": ([sys.executable, "evaluation/main.py"], ("python -m evaluation",
                                                                                  "eagle-train eval"))}
NOT_A_CLI = {"python tests/float_variants.py"}  # runs the numeric tests under each arithmetic variant: no --help
ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=\S*$")
OWN = {"eagle", "eagle_train", "recipes", "engine", "data_prep", "train", "export", "evaluation", "quickstart",
       "benchmarks", "tests"}  # a `python -m venv` or `python -m pip` line runs no program of this project


def run(argv: list[str]) -> subprocess.CompletedProcess:
    """Run from the repository with this checkout importable (what `pip install -e .` gives a user)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


def invocation(line: str) -> str | None:
    """A shell line's invocation as INVOCATIONS names it (`OMP_NUM_THREADS=1 torchrun --nproc_per_node 8
    train/main.py --recipe R` -> "torchrun train/main.py"); None for a line that runs none of this project's programs."""
    words = line.split()
    while words and ENV_ASSIGNMENT.match(words[0]):
        words = words[1:]
    if not words or words[0] not in ("python", "python3", "torchrun", "deepspeed", "eagle-train"):
        return None
    launcher = "python" if words[0] == "python3" else words[0]
    if launcher == "eagle-train":  # a flag or a placeholder (SUBCOMMAND) after it: the command itself
        named = len(words) > 1 and re.fullmatch(r"[a-z][a-z0-9-]*", words[1])
        return f"eagle-train {words[1]}" if named else "eagle-train"
    if launcher == "python" and len(words) > 2 and words[1] == "-m":  # `python -m benchmarks.NAME`: a placeholder
        own = words[2].split(".")[0] in OWN and not words[2].split(".")[-1].isupper()
        return f"python -m {words[2]}" if own else None
    script = next((w for w in words[1:] if w.endswith(".py")), None)
    return f"{launcher} {script}" if script and script.split("/")[0] in OWN and "*" not in script else None


DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "docs" / "results").glob("*.md"))]


def readme_commands(pages: list[Path] = DOCS) -> set[str]:
    """The invocations of the shell blocks and inline code (`python -m train.plan --recipe R`) of README and the
    pages of docs/ (where its measurements moved, with the commands that made them)."""
    text = "\n".join(page.read_text() for page in pages)
    lines = []
    fence = re.compile(r"^```[\w-]*\n(.*?)^```", flags=re.S | re.M)
    for block in fence.findall(text):
        lines += block.replace("\\\n", " ").splitlines()
    lines += re.findall(r"`([^`\n]+)`", fence.sub("", text))
    found = set()
    for line in lines:
        for part in re.split(r"&&|;|\|", line.split("#")[0]):
            name = invocation(part.strip())
            if name is not None:
                found.add(name)
    return found


@pytest.mark.parametrize("name", sorted(INVOCATIONS))
def test_each_documented_invocation_answers_help(name):
    argv, prog = INVOCATIONS[name]
    proc = run([*argv, "--help"])
    assert proc.returncode == 0, f"{name} --help: exit {proc.returncode}\n{proc.stderr[-2000:]}"
    assert f"usage: {prog}" in proc.stdout, proc.stdout[:500]


def run_beside_decoys(argv: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    """Run from the repository with a decoy package of every name of this project on PYTHONPATH (which sys.path
    lists before site-packages, after the script's folder or -m's working directory), each failing when imported:
    they stand for another copy (another checkout's editable install, a stale site-packages copy)."""
    for package in OWN - {"tests"}:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text(f"raise ImportError('decoy {package} imported')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    return subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)


# the two scripts started by path, and one of each kind of module run from a checkout's root: every other `python -m`
# invocation imports the same way (the working directory first), and answers --help above
FROM_A_CHECKOUT = ("python train/main.py", "python data_prep/main.py", "python -m evaluation",
                   "python -m benchmarks.step_costs")  # step_costs also imports a sibling benchmark


@pytest.mark.parametrize("name", FROM_A_CHECKOUT)
def test_a_program_run_from_a_checkout_imports_this_checkout(name, tmp_path):
    """`python train/main.py` puts train/ first on sys.path, so without the script's guard its `import data_prep`
    would take whatever copy comes next; `python -m evaluation` and `python -m benchmarks.NAME` put the working
    directory (the checkout's root) first, with no guard at all. Beside decoys of every package, each must still
    import this checkout."""
    argv, prog = INVOCATIONS[name]
    proc = run_beside_decoys([*argv, "--help"], tmp_path)
    assert proc.returncode == 0 and f"usage: {prog}" in proc.stdout, f"{name}: {proc.stderr[-1500:]}"


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_module_run_by_path_refuses_in_one_line_before_importing_the_project(name, tmp_path):
    """By path, Python would put evaluation/ first on sys.path and take data_prep, eagle... from wherever they come
    next; the module says how it is run instead, in one line, before importing anything of the project (the decoys
    would raise) and without editing sys.path to make the run work."""
    argv, names = REFUSED[name]
    proc = run_beside_decoys([*argv, "--recipe", "tiny"], tmp_path)
    assert proc.returncode == 2 and proc.stdout == "", proc.stderr[-1500:]
    assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith("error: "), proc.stderr[-1500:]
    assert all(f"`{n}" in proc.stderr for n in names), proc.stderr


def test_every_command_readme_and_docs_show_is_one_that_is_run_here():
    shown = readme_commands()
    subcommands = {f"eagle-train {name}" for name in cli.SUBCOMMANDS} | {"eagle-train"}
    unknown = shown - set(INVOCATIONS) - set(REFUSED) - subcommands - NOT_A_CLI
    assert not unknown, f"README or docs/ show commands no test runs: {sorted(unknown)}"
    assert {"eagle-train demo", "eagle-train train", "deepspeed train/main.py"} <= readme_commands([REPO / "README.md"])


def test_the_installed_command_is_one_entry_point_to_the_dispatcher():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"eagle-train": "eagle_train.cli:main"}
    module, func = scripts["eagle-train"].split(":")
    assert getattr(importlib.import_module(module), func) is cli.main


@pytest.mark.parametrize("name", sorted(cli.SUBCOMMANDS))
def test_each_subcommand_is_its_stages_own_parser_under_the_new_name(name, capsys):
    sub = cli.SUBCOMMANDS[name]
    code, out, err = run_cli(cli.main, [name, "--help"], capsys)
    assert code == 0, err[-2000:]
    assert out.startswith(f"usage: eagle-train {name}"), out[:300]
    # the same parser as the documented invocation: the help differs only in the program's name
    code, documented, _ = run_cli(importlib.import_module(sub.module).main, [*sub.prefix, "--help"], capsys)
    assert code == 0

    def options(text: str) -> str:
        return " ".join(text.replace(sub.documented, "PROG").replace(f"eagle-train {name}", "PROG").split())

    assert options(out) == options(documented)


def test_subcommand_errors_are_one_line_and_name_the_command(capsys):
    code, _, err = run_cli(cli.main, ["trian"], capsys)
    assert_one_line_error(code, err, "unknown subcommand 'trian'", "did you mean train?")
    code, _, err = run_cli(cli.main, [], capsys)
    assert_one_line_error(code, err, "give a subcommand", "plan")
    code, _, err = run_cli(cli.main, ["export", "--format", "onnx"], capsys)
    assert_one_line_error(code, err, "eagle-train export:", "--format")
    code, out, _ = run_cli(cli.main, ["--help"], capsys)
    assert code == 0 and all(f"  {name} " in out for name in cli.SUBCOMMANDS)


def test_the_documented_invocation_keeps_its_own_name_after_the_dispatcher_ran(capsys):
    run_cli(cli.main, ["export", "--help"], capsys)
    code, out, _ = run_cli(importlib.import_module("export.cli").main, ["--help"], capsys)
    assert code == 0 and out.startswith("usage: python -m train.export")
