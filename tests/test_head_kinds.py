"""A head kind is one object (eagle/head_kinds.py) that every stage asks: each kind has its module and its part in
every stage's per-kind mapping, and no module compares kind names or checks a head's class."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from eagle.head_kinds import HEAD_KINDS, head_kind, kind_of_config
from eagle.head_module import HeadModule
from export.head_kinds import EXPORT
from train.head_kinds import TRAINING

REPO = Path(__file__).resolve().parent.parent
STAGES = ("eagle", "recipes", "data_prep", "train", "export", "evaluation", "quickstart", "benchmarks")


@pytest.mark.parametrize("name", sorted(HEAD_KINDS))
def test_every_kind_has_its_module_and_its_part_in_every_stage(name):
    kind = head_kind(name)
    assert issubclass(kind.module, HeadModule) and kind.module.kind is kind
    assert TRAINING[kind].kind is kind and EXPORT[kind].kind is kind


def test_a_config_names_its_kind():
    assert kind_of_config({"hidden_size": 8}) is HEAD_KINDS["eagle2"]  # the released EAGLE-1/2 heads carry no marker
    assert kind_of_config({"draft_vocab_size": 8}) is HEAD_KINDS["eagle3"]
    assert kind_of_config({"architectures": ["LlamaForCausalLMEagle3"]}) is HEAD_KINDS["eagle3"]
    with pytest.raises(ValueError, match="head kind='eagle9': expected one of \\('eagle2', 'eagle3'\\)"):
        kind_of_config({"kind": "eagle9"})


def kind_decisions(path: Path) -> list[str]:
    """`x == "eagle3"`-style comparisons with a kind name, and isinstance / `is` checks against a head class."""
    tree = ast.parse(path.read_text())
    heads = {cls.__name__ for cls in (k.module for k in HEAD_KINDS.values())}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            if any(isinstance(o, ast.Constant) and o.value in HEAD_KINDS for o in operands) or \
                    any(isinstance(o, ast.Name) and o.id in heads for o in operands):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("isinstance", "issubclass"):
            classes = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
            if any(isinstance(c, ast.Name) and c.id in heads for c in classes):
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    return found


def test_no_module_decides_by_kind_name_or_head_class():
    """Outside the registry itself."""
    registry = REPO / "eagle" / "head_kinds.py"
    found = [hit for stage in STAGES for path in sorted((REPO / stage).rglob("*.py")) if path != registry
             for hit in kind_decisions(path)]
    assert not found, f"ask the kind object (eagle/head_kinds.py) instead: {found}"
