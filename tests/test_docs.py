"""Doc tests: numbers and statements in README, recipe comments and --help that a test can check (issue 28 items
5, 6, 18). A number in a doc either is checked here or says where it comes from."""
from __future__ import annotations

import importlib
import itertools
import re
from pathlib import Path

import pytest
import torch

from fault_helpers import run_cli

REPO = Path(__file__).resolve().parent.parent
README = (REPO / "README.md").read_text()


def test_default_target_size_and_record_count_in_readme_and_tiny_recipe():
    from transformers import LlamaForCausalLM

    from data_prep.default_target import default_target_config
    from data_prep.docstring_corpus import default_conversations
    from recipes import load_config

    with torch.device("meta"):
        params = sum(p.numel() for p in LlamaForCausalLM(default_target_config()).parameters())
    size = f"{params / 1e6:.2f}M"
    tiny = (REPO / "recipes" / "tiny.yaml").read_text()
    assert f"{size} parameters" in README.replace("\n", " ") and f"{size}-param default target" in tiny
    n = len(default_conversations("train"))
    assert f"{n:,} stdlib-docstring conversations" in tiny and load_config("tiny").data.max_records >= n
    assert "800 records" not in tiny and "1.3M" not in tiny


def test_stories260k_comments_agree_with_the_recipe_and_readme():
    from recipes import layout, load_config

    text = (REPO / "recipes" / "stories260k.yaml").read_text()
    cfg = load_config("stories260k")
    assert f"lr {cfg.train.lr:.0e}".replace("e-0", "e-") in text  # the comment discusses the lr the recipe sets (2e-2)
    minutes = [float(m) for m in re.findall(r"(?<![~\d.])([\d.]+) CPU-min", text)]  # cache build + training, measured
    assert "~10 CPU-minutes in all" in text and round(sum(minutes)) == 10
    assert f"~{round(minutes[-1])} CPU-minutes" in README  # README quotes the training part
    doc = importlib.import_module("train.eval_head").__doc__
    assert f"--head {layout.head_dir(cfg)}" in doc  # a folder a documented command produces


# module -> (its `eagle-train` subcommand, whether README says --recipe is required)
CLIS = {"data_prep.main": ("prep", True), "train.main": ("train", True), "train.plan": ("plan", True),
        "data_prep.corpus_cache": ("corpus", True), "train.eval_head": ("eval-head", True), "export.hub": ("hub", True),
        "evaluation.main": ("eval", False), "export.cli": ("export", False), "quickstart.demo": ("demo", False)}


def test_the_recipe_table_names_each_subcommand_by_its_module():
    from eagle_train.cli import SUBCOMMANDS

    assert all(SUBCOMMANDS[name].module == module for module, (name, _) in CLIS.items())


@pytest.mark.parametrize("module", sorted(CLIS))
def test_readme_says_which_commands_require_a_recipe(module, capsys):
    name, required = CLIS[module]
    code, out, _ = run_cli(importlib.import_module(module).main, ["--help"], capsys)
    usage = " ".join(out.split("\n\n")[0].split())
    assert code == 0 and "--recipe" in usage
    assert ("[--recipe" not in usage) == required, usage
    sentence = " ".join(README.split("`--recipe` is required by")[1].split(". Without")[0].split())
    required_part, optional_part = sentence.split("it is optional for")
    assert f"`{name}`" in (required_part if required else optional_part)


def test_readme_says_what_the_first_install_downloads():
    run_sh = (REPO / "run.sh").read_text()
    pin = re.search(r'TORCH_PIN="torch==([\d.]+)"', run_sh).group(1)
    text = " ".join(README.split())
    assert f"`torch-{pin}+cpu`, 192 MB" in text and "PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu" in text
    wheels = sorted(Path("/opt/wheels").glob(f"torch-{pin}+cpu-*.whl")) if Path("/opt/wheels").is_dir() else []
    if wheels:  # where the wheel is at hand, the size README states is its size
        assert round(wheels[0].stat().st_size / 1e6) == 192


def layout_rows() -> list[str]:
    """The paths of README's "Layout" table, in order."""
    section = README.split("## Layout", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([^`]+)/` \|", section, flags=re.M)


def test_readme_layout_lists_every_package_on_disk_in_import_order():
    """The Layout table names exactly the folders of the repository (packages, tests, docs), and the stage packages
    in the order of pyproject.toml's layers contract, bottom first (README: each imports only the ones above it)."""
    import tomllib

    rows = layout_rows()
    on_disk = {p.name for p in REPO.iterdir() if p.is_dir() and not p.name.startswith(".") and p.name != "runs"
               and (any(p.glob("*.py")) or p.name == "docs")}
    assert set(rows) == on_disk and len(rows) == len(set(rows)), (sorted(rows), sorted(on_disk))
    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c["layers"] for c in contracts if c["type"] == "layers")
    order = [set(layer.replace(" ", "").split("|")) for layer in reversed(layers)]
    staged = [r for r in rows if any(r in group for group in order)]
    groups = [next(i for i, group in enumerate(order) if r in group) for r in staged]
    assert groups == sorted(groups) and set(staged) == set().union(*order), staged


def test_readme_and_docs_links_point_at_files_that_exist():
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), *sorted((REPO / "docs" / "results").glob("*.md"))]
    broken = [f"{page.relative_to(REPO)} -> {target}" for page in pages
              for target in re.findall(r"!?\[[^\]]*\]\(([^)\s#]+)[^)]*\)", page.read_text())
              if not re.match(r"[a-z]+://", target) and not (page.parent / target).exists()]
    assert not broken, broken


def test_every_results_page_is_linked_from_readme():
    """README's results paragraph links every measured page of docs/results (the tables live there)."""
    pages = {p.relative_to(REPO).as_posix() for p in (REPO / "docs" / "results").glob("*.md")}
    missing = {p for p in pages if f"]({p})" not in README}
    assert not missing, sorted(missing)


def layer_order() -> list[set[str]]:
    """pyproject.toml's layers contract, bottom first: a set of package names per layer."""
    import tomllib

    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c["layers"] for c in contracts if c["type"] == "layers")
    return [set(layer.replace(" ", "").split("|")) for layer in reversed(layers)]


def stated_chains(text: str, packages: set[str]) -> list[list[str]]:
    """The `a <- b <- c` chains of package names a text states; names joined by "," or "/" share a layer (`quickstart,
    benchmarks`). A chain runs through every segment between two arrows that holds package names only."""
    segments = [[w for w in re.split(r"[^\w]+", seg) if w] for seg in " ".join(text.split()).split(" <- ")]
    chains, chain = [], []
    for i, words in enumerate(segments):
        inner = 0 < i < len(segments) - 1 and words and set(words) <= packages
        if chain and inner:
            chain.append(words)
            continue
        if chain:  # the chain ends with the package names this segment starts with
            lead = list(itertools.takewhile(lambda w: w in packages, words))
            if lead:
                chains.append([", ".join(part) for part in (*chain, lead)])
            chain = []
        trail = list(itertools.takewhile(lambda w: w in packages, reversed(words)))[::-1]
        if trail and i < len(segments) - 1:  # a new chain starts with the names this segment ends with
            chain = [trail]
    return chains


def test_every_stated_layer_order_is_the_contracts():
    """README, docs/design.md, the package docstrings and pyproject.toml's own contract name state the stage order as
    `eagle <- recipes <- ...`: each such chain lists the packages in the contract's order, none skipped between two it
    names (issue 47: eagle/__init__.py stated one the contract does not have)."""
    order = layer_order()
    packages = set().union(*order)
    index = {p: i for i, group in enumerate(order) for p in group}
    sources = [REPO / "README.md", REPO / "docs" / "design.md", REPO / "pyproject.toml", REPO / "tests" / "test_layers.py",
               *sorted(REPO.glob("*/__init__.py"))]
    wrong, checked = [], 0
    for source in sources:
        for chain in stated_chains(source.read_text(), packages):
            levels = [{index[p] for p in re.split(r",\s*|\s+", part)} for part in chain]
            checked += 1
            if any(len(lv) != 1 for lv in levels) or [next(iter(lv)) for lv in levels] != list(
                    range(next(iter(levels[0])), next(iter(levels[0])) + len(levels))):
                wrong.append(f"{source.relative_to(REPO)}: {' <- '.join(chain)}")
    assert checked >= 4 and not wrong, wrong


def test_the_layer_order_check_catches_a_wrong_chain():
    order = layer_order()
    packages = set().union(*order)
    assert stated_chains("stages: recipes <- data_prep <- export <- train (old)", packages) == [
        ["recipes", "data_prep", "export", "train"]]
