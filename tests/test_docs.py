"""Doc tests: numbers and statements in README, recipe comments and --help that a test can check (issue 28 items
5, 6, 18). A number in a doc either is checked here or says where it comes from."""
from __future__ import annotations

import importlib
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


# (module, documented name) -> whether README says --recipe is required
CLIS = {"data_prep.main": ("data_prep/main.py", True), "train.main": ("train/main.py", True),
        "train.plan": ("python -m train.plan", True), "train.corpus_cache": ("train.corpus_cache", True),
        "train.eval_head": ("train.eval_head", True), "export.hub": ("train.hub", True),
        "evaluation.main": ("evaluation/main.py", False), "export.cli": ("python -m train.export", False),
        "quickstart.demo": ("python -m quickstart", False)}


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
