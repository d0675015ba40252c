"""benchmarks/long_context_target.py at test scale: the default target's test size continued on long documents from
its corpus (recall turns included), cached, atomic and rebuilt only when its inputs change."""
from __future__ import annotations

import json
import math

import pytest
import torch

from benchmarks import long_context_target as lt
from data_prep import default_target as dt


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("eagle_home")


@pytest.fixture(scope="module")
def built(home):
    return lt.ensure_long_context_target(home, size="test", progress=False)


def test_folder_is_the_default_target_continued_to_long_positions(built, home):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    preset = lt.SIZES_LONG["test"]
    for name in lt.REQUIRED_FILES:
        assert (built / name).is_file(), name
    base = dt.default_target_dir(home, "test")
    cfg = AutoConfig.from_pretrained(built)
    assert cfg.max_position_embeddings == preset.max_positions > AutoConfig.from_pretrained(base).max_position_embeddings
    tok = AutoTokenizer.from_pretrained(built)
    assert tok.model_max_length == preset.max_positions
    assert tok.get_vocab() == AutoTokenizer.from_pretrained(base).get_vocab()  # the base's tokenizer and template
    assert json.loads((built / "tokenizer_config.json").read_text())["chat_template"] == dt.CHAT_TEMPLATE
    for name in (dt.CONVERSATIONS_FILE, dt.QUESTIONS_FILE):
        assert (built / name).read_bytes() == (base / name).read_bytes()
    model = AutoModelForCausalLM.from_pretrained(built)
    base_model = AutoModelForCausalLM.from_pretrained(base)
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), base_model.parameters()))  # trained further
    info = lt.read_long_build_info(built)
    assert [s["tokens"] for s in info["stages"]] == [t for t, _, _ in preset.stages]
    assert info["train_documents"] == sum(steps * rows for _, steps, rows in preset.stages)
    for key in ("eval_loss_by_position", "base_eval_loss_by_position"):
        assert list(info[key]) == ["<64", "64-128", "128+"]  # eval_edges of the test preset
        assert all(math.isfinite(v) and v > 0 for v in info[key].values())
    # the recorded held-out loss is the saved weights': recomputed from the saved documents
    eval_docs = json.loads((built / lt.EVAL_DOCS_FILE).read_text())
    rows = lt.document_rows(tok, eval_docs, preset.doc_tokens)
    again = lt.loss_by_position(model.float(), rows, preset.eval_edges)
    assert again == pytest.approx(info["eval_loss_by_position"], rel=1e-4)


def test_documents_are_long_and_hold_recall_turns(built):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built)
    docs = json.loads((built / lt.TRAIN_DOCS_FILE).read_text())
    preset = lt.SIZES_LONG["test"]
    assert {d["id"].rsplit("-", 1)[0] for d in docs} == {f"long-train-{t}" for t, _, _ in preset.stages}
    for d in docs:
        tokens = int(d["id"].split("-")[2])
        assert len(lt.document_rows(tok, [d], tokens)[0]) == tokens + 1  # long enough for its row
        turns = d["conversations"]
        assert [t["from"] for t in turns] == ["human", "gpt"] * (len(turns) // 2)
        pairs = [(turns[i]["value"], turns[i + 1]["value"]) for i in range(0, len(turns), 2)]
        repeats = [i for i, p in enumerate(pairs) if p in pairs[:i]]
        if tokens == preset.doc_tokens:  # long enough for several conversations (a short row may hold one)
            assert repeats, d["id"]  # a question asked again later, answered the same: far context predicts it
    held_out = {t["value"] for r in json.loads((built / lt.EVAL_DOCS_FILE).read_text()) for t in r["conversations"]}
    trained = {t["value"] for r in docs for t in r["conversations"] if t["from"] == "gpt"}
    assert not held_out & trained  # held-out documents are made of the eval split's names only


def test_cached_rerun_reuses_and_changed_inputs_rebuild(built, home):
    stamp = (built / lt.BUILD_INFO_FILE).stat().st_mtime_ns
    assert lt.ensure_long_context_target(home, size="test", progress=False) == built
    assert (built / lt.BUILD_INFO_FILE).stat().st_mtime_ns == stamp  # reused, not rebuilt
    info_path = built / lt.BUILD_INFO_FILE
    info_path.write_text(info_path.read_text()[:40])  # a damaged summary = an incomplete build
    assert lt.ensure_long_context_target(home, size="test", progress=False) == built
    rebuilt = lt.read_long_build_info(built)
    assert rebuilt["fingerprint"]["seed"] == 0
    assert not list(built.parent.glob(f".{built.name}.tmp-*"))  # no temporary folder left behind
    other = lt.ensure_long_context_target(home, size="test", seed=1, progress=False)
    assert lt.read_long_build_info(other)["fingerprint"]["seed"] == 1


def test_unknown_size_is_one_line():
    with pytest.raises(ValueError, match="size='huge'"):
        lt.ensure_long_context_target(size="huge")
