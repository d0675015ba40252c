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
STAGES = ("eagle", "recipes", "engine", "data_prep", "train", "export", "evaluation", "quickstart", "benchmarks",
          "eagle_train")


@pytest.mark.parametrize("name", sorted(HEAD_KINDS))
def test_every_kind_has_its_module_and_its_part_in_every_stage(name):
    kind = head_kind(name)
    assert issubclass(kind.module, HeadModule) and kind.module.kind is kind
    assert TRAINING[kind].kind is kind and EXPORT[kind].kind is kind


def test_a_config_names_its_kind():
    assert kind_of_config({"hidden_size": 8}) is HEAD_KINDS["eagle2"]  # the released EAGLE-1/2 heads carry no marker
    assert kind_of_config({"draft_vocab_size": 8}) is HEAD_KINDS["eagle3"]
    assert kind_of_config({"architectures": ["LlamaForCausalLMEagle3"]}) is HEAD_KINDS["eagle3"]
    # a P-EAGLE config is also an EAGLE-3 one: the most specific kind that recognises it wins
    assert kind_of_config({"draft_vocab_size": 8, "mask_token_id": 3}) is HEAD_KINDS["peagle"]
    assert kind_of_config({"architectures": ["PeagleLlamaForCausalLM"], "draft_vocab_size": 8}) is HEAD_KINDS["peagle"]
    # a DFlash config keeps its keys under `dflash` (a top-level mask_token_id would read as P-EAGLE's)
    assert kind_of_config({"dflash": {"block_size": 4}}) is HEAD_KINDS["dflash"]
    assert kind_of_config({"architectures": ["DFlashDraftModel"]}) is HEAD_KINDS["dflash"]
    with pytest.raises(ValueError, match="head kind='eagle9': expected one of \\('eagle2', 'eagle3', 'peagle', 'dflash'\\)"):
        kind_of_config({"kind": "eagle9"})


KIND_OBJECTS = {name.upper() for name in HEAD_KINDS}  # eagle/head_kinds.py's EAGLE2, EAGLE3, PEAGLE


def names_a_kind(node: ast.AST, heads: set[str]) -> bool:
    """A kind's name ("eagle3"), its object (EAGLE3), the object's name (EAGLE3.name) or a head class (Eagle3Head)."""
    if isinstance(node, ast.Constant):
        return node.value in HEAD_KINDS
    if isinstance(node, ast.Name):
        return node.id in heads or node.id in KIND_OBJECTS
    if isinstance(node, ast.Attribute):
        return node.attr == "name" and isinstance(node.value, ast.Name) and node.value.id in KIND_OBJECTS
    return False


def kind_decisions(source: str, where: str) -> list[str]:
    """Comparisons with a kind (`x == "eagle3"`, `kind is EAGLE3`, `name == EAGLE2.name`, `x is not Eagle3Head`),
    and isinstance / issubclass checks against a head class, as `where:line`."""
    heads = {cls.__name__ for cls in (k.module for k in HEAD_KINDS.values())}
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            if any(names_a_kind(o, heads) for o in [node.left, *node.comparators]):
                found.append(f"{where}:{node.lineno}")
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("isinstance", "issubclass"):
            classes = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
            if any(isinstance(c, ast.Name) and c.id in heads for c in classes):
                found.append(f"{where}:{node.lineno}")
    return found


def test_no_module_decides_by_kind_name_or_head_class():
    """Outside the registry itself."""
    registry = REPO / "eagle" / "head_kinds.py"
    found = [hit for stage in STAGES for path in sorted((REPO / stage).rglob("*.py")) if path != registry
             for hit in kind_decisions(path.read_text(), str(path.relative_to(REPO)))]
    assert not found, f"ask the kind object (eagle/head_kinds.py) instead: {found}"


# Strings that spell a kind's name but name something else, per file: a decoding method (EAGLE-2's dynamic tree is
# the method "eagle2", EAGLE-1's static tree "eagle1") or an engine's own name (vLLM's method "eagle3", its
# speculators algorithms "eagle3" / "peagle").
NOT_A_KIND = {"evaluation/methods.py": {"eagle2"}, "recipes/eval.py": {"eagle2"}, "export/eval_outputs.py": {"eagle2"},
              "export/engine_formats.py": {"eagle3"}, "export/head_kinds.py": {"eagle3", "peagle", "dflash"}}  # dflash: vLLM's method name


def kind_literals(source: str) -> list[tuple[int, str]]:
    """(line, value) of the string constants that are a kind's name, docstrings aside."""
    tree = ast.parse(source)
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [(n.lineno, n.value) for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and id(n) not in docs and n.value in HEAD_KINDS]


def test_no_kind_name_is_written_outside_the_registry():
    """A kind is named by its object (`EAGLE3.name`, `DEFAULT_KIND.name`), so a renamed or added kind changes one file;
    the recipes' YAML names kinds as users do."""
    registry = REPO / "eagle" / "head_kinds.py"
    found = [f"{rel}:{line} {value!r}" for stage in STAGES for path in sorted((REPO / stage).rglob("*.py"))
             if path != registry for rel in [str(path.relative_to(REPO))]
             for line, value in kind_literals(path.read_text()) if value not in NOT_A_KIND.get(rel, ())]
    assert not found, f"name the kind by its object (eagle/head_kinds.py): {found}"


def test_the_literal_check_catches_a_kind_name():
    source = '"""eagle2"""\nx = "eagle3"\ndef f(k="peagle"):\n    "eagle2"\n'  # docstrings are not names
    assert kind_literals(source) == [(2, "eagle3"), (3, "peagle")]


@pytest.mark.parametrize("code", ["kind is EAGLE3", "kind is not EAGLE2", "name == EAGLE2.name", "k == 'eagle3'",
                                  "'eagle2' != k", "isinstance(h, Eagle3Head)", "type(h) is EagleHead"])
def test_the_check_catches_every_form_of_a_kind_decision(code):
    assert kind_decisions(f"x = 1\nif {code}:\n    pass\n", "m.py") == ["m.py:2"]
