"""docs/design.md "Adding a head kind", done in code: a throwaway kind with one option of its own, registered in the
library's and each stage's registry alone (no project file edited), goes through recipe parsing, the plan, training
steps, save / load and an export refusal. If any stage still hard-codes the kinds it knows, this test fails there."""
from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
from torch import nn

from eagle.eagle2 import EagleHead
from eagle.head_files import load_head
from eagle.head_kinds import HEAD_KINDS, Eagle2Kind, Eagle2Options, HeadConfigError, head_key
from export.engine_formats import EngineFormatError
from export.head_kinds import EXPORT, Eagle2Export, write_engine_head
from recipes import RecipeError, load_config
from test_train_helpers import gloo_world, overrides, save_target, write_cache
from train.head_kinds import TRAINING, Eagle2Training

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@dataclass
class GatedOptions(Eagle2Options):
    """EAGLE-2's options plus the toy's own."""

    gate: bool = head_key(False)  # the toy's one option: a learned per-channel gate on the head's output


class GatedKind(Eagle2Kind):
    """An EAGLE-2 head whose output can be gated per channel: the toy kind."""

    name, title, module_file = "gated", "Gated", ""  # its module is the class below, registered as it is defined
    options = GatedOptions

    def recognises(self, d: dict) -> bool:
        return "gate" in d

    def parse_config(self, d: dict):
        return self.options(gate=bool(d.pop("gate", False))), {}

    def config_dict(self, c) -> dict:
        return {**super().config_dict(c), "gate": c.options.gate}


GATED = GatedKind()


class GatedHead(EagleHead, kind=GATED):
    def __init__(self, config):
        super().__init__(config)
        self.gate = nn.Parameter(torch.ones(config.hidden_size)) if config.options.gate else None

    def forward(self, features, next_ids, attention_mask=None, position_ids=None, steps=None, rows=None):
        out = super().forward(features, next_ids, attention_mask, position_ids, steps, rows)
        return out if self.gate is None or steps is not None else out * self.gate


class GatedTraining(Eagle2Training):
    kind = GATED


class GatedExport(Eagle2Export):
    kind, tag = GATED, "gated"

    def write_engine_folder(self, config, weights_file, head_dir, out_dir, fmt, *args, **kwargs):
        raise EngineFormatError(f"{head_dir}: no engine serves a {self.kind.title} head ({fmt})")


@pytest.fixture
def gated(monkeypatch):
    """The toy kind in the registries, for this test only."""
    monkeypatch.setitem(HEAD_KINDS, GATED.name, GATED)
    monkeypatch.setitem(TRAINING, GATED, GatedTraining)
    monkeypatch.setitem(EXPORT, GATED, GatedExport())
    return GATED


def test_a_kind_added_through_the_registries_alone_runs_every_stage(gated, tmp_path):
    from train.main import train
    from train.plan import plan_shape

    target = save_target(tmp_path / "target")
    cache = write_cache(tmp_path / "cache", target, n=48)
    run = overrides(target, tmp_path / "run", f"train.cache_dir={cache}", "head.kind=gated", "head.gate=true",
                    steps=3)

    # recipe parsing: its own key is a recipe key with --help text, other kinds' keys are refused with it, its own
    # key is refused with another kind
    cfg = load_config("tiny", run)
    assert cfg.head.kind == "gated" and cfg.head.gate is True
    with pytest.raises(RecipeError, match=r"^head.ttt_steps=3: only used by head.kind=eagle3$"):
        load_config("tiny", [*run, "head.ttt_steps=3"])
    with pytest.raises(RecipeError, match=r"^head.gate=True: only used by head.kind=gated$"):
        load_config("tiny", ["head.gate=true"])
    from recipes.schema import describe_recipe_keys
    assert "head.gate = False  # the toy's one option" in describe_recipe_keys()

    # the plan: the kind's module counted on the meta device (the gate adds H parameters)
    from transformers import AutoConfig
    plain = plan_shape(load_config("tiny", run[:-1] + ["head.gate=false"]), AutoConfig.from_pretrained(target))
    shape = plan_shape(cfg, AutoConfig.from_pretrained(target))
    assert shape.kind == "gated" and shape.head_trainable - plain.head_trainable == shape.hidden

    # training steps, then the trainer's export of the head folder
    with gloo_world() as ctx:
        summary = train(cfg, ctx)
    assert summary["steps"] == 3
    head_dir = tmp_path / "run" / "head"
    assert json.loads((head_dir / "config.json").read_text())["gate"] is True

    # save / load: the folder is recognised as the kind's and loads its module with the option and the trained gate
    head = load_head(head_dir)
    assert type(head) is GatedHead and head.config.options.gate is True and head.gate is not None
    assert not torch.equal(head.gate.detach(), torch.ones(shape.hidden))  # the gate trained

    # an export refusal, in one line, from the kind's own export part
    with pytest.raises(EngineFormatError, match="no engine serves a Gated head") as e:
        write_engine_head(head_dir, tmp_path / "vllm", "vllm")
    assert "\n" not in str(e.value)


def test_a_kind_whose_option_clashes_with_another_kinds_is_refused(monkeypatch):
    """Two kinds declaring one recipe key with different defaults would make the key mean two things."""

    @dataclass
    class Clashing(Eagle2Options):
        ttt_steps: int = head_key(2)  # EAGLE-3's key, another default

    class ClashKind(Eagle2Kind):
        name, title, options = "clash", "Clash", Clashing

    monkeypatch.setitem(HEAD_KINDS, "clash", ClashKind())
    with pytest.raises(TypeError, match="head.ttt_steps: kinds eagle3 and clash declare it"):
        load_config("tiny")


def test_another_kinds_options_are_refused_by_a_head_config():
    from eagle.head_config import HeadConfig

    with pytest.raises(HeadConfigError, match="takes Eagle2Options, not GatedOptions"):
        HeadConfig(hidden_size=8, intermediate_size=16, num_attention_heads=2, num_key_value_heads=2, vocab_size=32,
                   options=GatedOptions(gate=True))
