"""The embedded default target: a real HF Llama chat folder, built at test scale in seconds."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from data_prep import default_target as dt
from data_prep.docstring_corpus import (
    clean_doc, collect_doc_entries, default_conversations, default_prompts, default_questions, split_of,
)
from float_tolerance import LAYER_REDUCTIONS, assert_same_function


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    return dt.ensure_default_target(tmp_path_factory.mktemp("eagle_home"), size="test", progress=False)


@pytest.mark.numeric
def test_folder_is_a_loadable_llama_chat_model(built):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaForCausalLM

    for name in dt.REQUIRED_FILES:
        assert (built / name).is_file(), name
    model = AutoModelForCausalLM.from_pretrained(built)
    tok = AutoTokenizer.from_pretrained(built)
    assert isinstance(model, LlamaForCausalLM)
    assert model.config.vocab_size == len(tok)
    assert "chat_template" in json.loads((built / "tokenizer_config.json").read_text())
    gen = GenerationConfig.from_pretrained(built)
    assert gen.eos_token_id == [tok.convert_tokens_to_ids(dt.EOS)]
    # the saved weights are the trained ones: the held-out loss recorded at build time reproduces
    info = dt.read_build_info(built)
    preset = dt.SIZES["test"]
    rows = dt.pack_conversations(tok, dt.heldout_conversations()[: preset.max_conversations], preset.block_size)
    # the same float32 forward and mean cross-entropy, in another process: rounding apart
    layers, vocab = model.config.num_hidden_layers, model.config.vocab_size
    assert_same_function(dt.evaluate_loss(model, rows, 8), info["eval_loss"], dtype=torch.float32,
                         terms=max(vocab, rows.numel()), chained=layers * LAYER_REDUCTIONS + 4)
    assert info["parameters"] == sum(p.numel() for p in model.parameters())
    assert info["train_loss_last"] < info["train_loss_first"]


def test_chat_template_generation_prompt_and_assistant_mask(built):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(built)
    question, answer = "What does `json.dumps` do?", "Serialize obj to a JSON formatted str."
    prompt = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False)
    assert prompt == f"{dt.BOS}{dt.USER}{question}{dt.EOS}{dt.ASSISTANT}"
    prompt_ids = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         return_dict=True)["input_ids"]
    assert tok.decode(prompt_ids) == prompt

    messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    enc = tok.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    mask = enc["assistant_masks"]
    assert len(mask) == len(enc["input_ids"]) and sum(mask) > 0
    assistant_ids = [i for i, m in zip(enc["input_ids"], mask) if m]
    # exactly what the assistant writes: its content and the end-of-turn token, not the role tag
    assert tok.decode(assistant_ids) == answer + dt.EOS
    assert enc["input_ids"][: len(prompt_ids)] == prompt_ids
    with pytest.raises(Exception, match="unknown chat role"):
        tok.apply_chat_template([{"role": "robot", "content": "x"}], tokenize=False)


def test_greedy_generation_stops_at_end_of_turn(built):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(built)
    tok = AutoTokenizer.from_pretrained(built)
    ids = tok.apply_chat_template([{"role": "user", "content": default_prompts(n=1)[0]}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)["input_ids"]
    out = model.generate(ids, max_new_tokens=8, do_sample=False)  # eos/pad come from generation_config.json
    assert out.shape[1] > ids.shape[1]
    assert torch.equal(out[0, : ids.shape[1]], ids[0])


def test_cache_is_reused_without_retraining(built, monkeypatch):
    mtime = (built / "model.safetensors").stat().st_mtime_ns

    def fail(*a, **k):
        raise AssertionError("rebuilt although a matching cache exists")

    monkeypatch.setattr(dt, "build_default_target", fail)
    assert dt.ensure_default_target(built.parent, size="test", progress=False) == built
    assert (built / "model.safetensors").stat().st_mtime_ns == mtime


def test_eagle_home_sets_the_cache_location(monkeypatch, tmp_path):
    monkeypatch.setenv("EAGLE_HOME", str(tmp_path))
    assert dt.default_target_dir() == tmp_path / "default-target"
    monkeypatch.delenv("EAGLE_HOME")
    assert dt.default_target_dir() == Path.home() / ".cache" / "eagle2-train" / "default-target"
    assert dt.default_target_dir(tmp_path, size="test") == tmp_path / "default-target-test"


def test_failed_rebuild_keeps_the_previous_target_and_leaves_no_partial_folder(built, monkeypatch):
    before = sorted(p.name for p in built.parent.iterdir() if not p.name.endswith(".lock"))

    def interrupted(*a, **k):
        raise KeyboardInterrupt  # e.g. Ctrl-C in the middle of training

    monkeypatch.setattr(dt, "train_model", interrupted)
    with pytest.raises(KeyboardInterrupt):
        dt.ensure_default_target(built.parent, size="test", rebuild=True, progress=False)
    after = sorted(p.name for p in built.parent.iterdir() if not p.name.endswith(".lock"))
    assert after == before  # no tmp folder left, the good target untouched
    assert dt.read_build_info(built)["fingerprint"]["steps"] == dt.SIZES["test"].steps


def test_incomplete_or_different_folder_is_rebuilt_atomically(tmp_path):
    target = dt.default_target_dir(tmp_path, size="test")
    target.mkdir(parents=True)
    (target / "config.json").write_text("{}")  # a half-written folder from an old, non-atomic copy
    stale_tmp = tmp_path / ".default-target-test.tmp-999-dead"  # left by a killed build
    stale_tmp.mkdir()
    out = dt.ensure_default_target(tmp_path, size="test", steps=2, progress=False)
    assert out == target and dt.read_build_info(out)["fingerprint"]["steps"] == 2
    assert not stale_tmp.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".default-target-test.lock", "default-target-test"]
    with pytest.raises(ValueError, match="size="):
        dt.ensure_default_target(tmp_path, size="huge")


def test_prompt_sets_are_deterministic_disjoint_and_well_formed(built):
    # same names, order and text in a fresh interpreter (which imported nothing else first)
    code = ("import hashlib, json; from data_prep.docstring_corpus import default_conversations as c; "
            "print(hashlib.sha256(json.dumps(c('train')).encode()).hexdigest())")
    fresh = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert fresh == hashlib.sha256(json.dumps(default_conversations("train")).encode()).hexdigest()
    train = default_conversations("train")
    questions = default_questions("eval")
    assert len(train) > 1000 and len(questions) >= 80
    names = lambda e: e.name  # noqa: E731
    train_names = {names(e) for e in collect_doc_entries() if split_of(e) == "train"}
    eval_names = {names(e) for e in collect_doc_entries() if split_of(e) == "eval"}
    assert train_names and eval_names and not train_names & eval_names
    assert len({r["id"] for r in train}) == len(train)
    for r in train[:50]:
        froms = [t["from"] for t in r["conversations"]]
        assert froms in (["human", "gpt"], ["human", "gpt", "human", "gpt"])
        assert all(isinstance(t["value"], str) and t["value"] for t in r["conversations"])
    for q in questions:
        assert set(q) >= {"question_id", "category", "turns"} and 1 <= len(q["turns"]) <= 2
    assert [q["question_id"] for q in questions] == list(range(1, len(questions) + 1))
    # no held-out question appears in the training conversations
    train_questions = {t["value"] for r in train for t in r["conversations"] if t["from"] == "human"}
    assert not train_questions & {q["turns"][0] for q in questions}
    assert default_prompts(n=3) == [q["turns"][0] for q in questions[:3]]
    # the files in the cached folder are the same sets
    saved = [json.loads(line) for line in (built / dt.QUESTIONS_FILE).read_text().splitlines()]
    assert saved == questions
    assert json.loads((built / dt.CONVERSATIONS_FILE).read_text()) == train[: dt.SIZES["test"].max_conversations]
    assert len(dt.heldout_conversations()) == len(questions)
    with pytest.raises(ValueError, match="split"):
        default_conversations("test")


def test_clean_doc_truncates_at_a_boundary():
    doc = "    First line.\n\n    Second paragraph is here. It goes on and on. " + "word " * 200
    out = clean_doc(doc, 120)
    assert len(out) <= 120 and out.startswith("First line.") and out.endswith(".")
    assert clean_doc("  short doc  ", 100) == "short doc"


def test_bad_sharegpt_record_names_the_record():
    with pytest.raises(ValueError, match="conv-7"):
        dt.sharegpt_to_messages({"id": "conv-7", "conversations": [{"from": "robot", "value": "x"}]})
