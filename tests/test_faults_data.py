"""Fault tier, data class: malformed sources and damaged stage files are one-line errors naming the file (and the
line), bad records are rejected with a reason and counted (kept + rejected = input) without blocking a rerun, and
a failing command never changes the outputs of an earlier good run."""
from __future__ import annotations

import json
import shutil

import pytest

from data_prep.main import main
from fault_helpers import assert_one_line_error, assert_unchanged, run_cli, snapshot
from test_data_prep_helpers import one_torch_thread, save_target, write_sharegpt  # noqa: F401


def recipe(tmp, target, source, out, **data):
    d = {"source": str(source), "max_new_tokens": 4, "gen_batch_size": 3, "max_length": 64, "disk_headroom_gb": 0.0,
         "device": "cpu", **data}
    r = {"name": "t", "output_dir": str(out), "target": {"path": str(target), "dtype": "float32", "chat_template": "chatml"},
         "data": d}
    path = tmp / f"recipe-{len(list(tmp.glob('recipe-*')))}.yaml"
    path.write_text(json.dumps(r))
    return path


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """A target, a source and a finished data prep run (the good state every case must leave unchanged)."""
    root = tmp_path_factory.mktemp("data")
    target = save_target(root / "target", chat_template=None)
    source = write_sharegpt(root / "convs.json", 6)
    out = root / "run"
    assert main(["--recipe", str(recipe(root, target, source, out)), "--no-progress"]) == 0
    return {"root": root, "target": target, "source": source, "out": out}


@pytest.fixture
def run(good, tmp_path):
    """A copy of the good run in this test's folder."""
    out = tmp_path / "run"
    shutil.copytree(good["out"], out)
    return out


def bad_source(tmp_path, name: str, content: bytes):
    p = tmp_path / name
    p.write_bytes(content)
    return p


SOURCES = [  # (file name, content, needles)
    ("s.json", b'[{"id": "a", "conversations": [{"from": "human", "value": "caf\xe9"}]}]', ["s.json", "not valid UTF-8"]),
    ("s.json", b'[{"id": "a",', ["s.json", "not valid JSON"]),
    ("s.json", b'{"a": [], "b": []}', ["s.json", "expected a JSON list"]),
    ("s.json", b'"text"', ["s.json", "expected a JSON list"]),
    ("s.txt", b"hello\n", ["s.txt", "unsupported file type"]),
    ("s.jsonl", b'{"id": 1, "conversations": [{"from": "robot", "value": "x"}]}\n\xff\xfe\n', ["no valid conversation",
                                                                                              "rejects.jsonl"]),
]


@pytest.mark.parametrize("name,content,needles", SOURCES, ids=["utf8", "json", "two-lists", "scalar", "txt", "all-bad"])
def test_bad_source_is_one_line_and_keeps_the_good_run(good, run, tmp_path, capsys, name, content, needles):
    before = snapshot(run / "conversations.jsonl", run / "tokenized.jsonl", run / "features", run / "regenerated")
    src = bad_source(tmp_path, name, content)
    code, _, err = run_cli(main, ["--recipe", recipe(tmp_path, good["target"], src, run), "--no-progress"], capsys)
    assert_one_line_error(code, err, *needles)
    assert_unchanged(before, run / "conversations.jsonl", run / "tokenized.jsonl", run / "features", run / "regenerated")


def test_missing_or_empty_source(good, run, tmp_path, capsys):
    before = snapshot(run)
    for src, needle in ((tmp_path / "missing.json", "does not exist"), ("", "data.source is empty")):
        code, _, err = run_cli(main, ["--recipe", recipe(tmp_path, good["target"], src, run), "--no-progress"], capsys)
        assert_one_line_error(code, err, needle)
    assert_unchanged(before, run)


def test_missing_target_is_named(good, run, tmp_path, capsys):
    before = snapshot(run)
    code, _, err = run_cli(main, ["--recipe", recipe(tmp_path, tmp_path / "no-target", good["source"], run),
                                  "--no-progress", "tokenize"], capsys)
    assert_one_line_error(code, err, "no-target")
    assert_unchanged(before, run)


DAMAGED = [  # (file under data/, stage run after damaging it, damage, needles)
    ("conversations.jsonl", "tokenize", lambda b: b.replace(b"\n", b"\n{broken\n", 1), ["conversations.jsonl:2"]),
    ("conversations.jsonl", "regenerate", lambda b: b[:1] + b"\xff" + b[1:], ["conversations.jsonl:1"]),
    ("tokenized.jsonl", "cache", lambda b: b"{" + b, ["tokenized.jsonl:1"]),
    ("tokenized.jsonl", "cache", lambda b: b"\xff" + b, ["tokenized.jsonl:1"]),
    ("tokenized.jsonl", "cache", lambda b: b.replace(b'"loss_mask": [', b'"loss_mask": [1, ', 1), ["tokenized.jsonl:1",
                                                                                                    "equal length"]),
    ("regenerated/part-00000-of-00001.jsonl", "tokenize", lambda b: b"\xff" + b, ["part-00000-of-00001.jsonl:1"]),
    ("regenerated/part-00000-of-00001.jsonl", "tokenize", lambda b: b'{"no_id": 1}\n' + b, ["part-00000-of-00001.jsonl:1"]),
    ("features/parts/shard00000-of-00001.json", "cache", lambda b: b[: len(b) // 2], ["shard00000-of-00001.json",
                                                                                       "not valid JSON"]),
]


@pytest.mark.parametrize("name,stage,damage,needles", DAMAGED,
                         ids=["conv-json", "conv-utf8", "tok-json", "tok-utf8", "tok-lengths", "regen-utf8", "regen-id", "cache-part"])
def test_damaged_stage_file_names_file_and_line(good, run, tmp_path, capsys, name, stage, damage, needles):
    path = run / "data" / name if (run / "data").exists() else run / name
    path = run / "data" / name
    path.write_bytes(damage(path.read_bytes()))
    before = snapshot(run)
    code, _, err = run_cli(main, ["--recipe", recipe(tmp_path, good["target"], good["source"], run), "--no-progress",
                                  stage], capsys)
    assert_one_line_error(code, err, *needles)
    assert_unchanged(before, run)


def test_stage_order_and_changed_settings(good, run, tmp_path, capsys):
    fresh = tmp_path / "fresh"
    code, _, err = run_cli(main, ["--recipe", recipe(tmp_path, good["target"], good["source"], fresh), "tokenize"], capsys)
    assert_one_line_error(code, err, "conversations.jsonl not found", "load stage")
    before = snapshot(run)
    code, _, err = run_cli(main, ["--recipe", recipe(tmp_path, good["target"], good["source"], run, max_new_tokens=9),
                                  "--no-progress", "regenerate"], capsys)
    assert_one_line_error(code, err, "regenerated with other settings", "max_new_tokens")
    code, _, err = run_cli(main, ["--recipe", recipe(tmp_path, good["target"], good["source"], run, regenerate=False,
                                                     cache_dtype="int8"), "--no-progress", "cache"], capsys)
    assert_one_line_error(code, err, "features", "dtype")
    assert_unchanged(before, run)


def test_undecodable_and_malformed_lines_are_counted_and_rerun_works(good, tmp_path, capsys):
    lines = [json.dumps({"id": f"c{i}", "conversations": [{"from": "human", "value": "Tell me a story about a cat."},
                                                           {"from": "gpt", "value": "Once upon a time."}]}).encode()
             for i in range(4)]
    lines.insert(1, b'{"id": "bad-utf8", "conversations": "caf\xe9"}')
    lines.insert(3, b'{"id": "bad-json", ')
    src = tmp_path / "mixed.jsonl"
    src.write_bytes(b"\n".join(lines) + b"\n")
    out = tmp_path / "run"
    argv = ["--recipe", recipe(tmp_path, good["target"], src, out), "--no-progress"]
    code, stdout, err = run_cli(main, argv, capsys)
    assert code == 0, err
    assert "kept 4 + rejected 2 = input 6" in stdout
    rejects = [json.loads(x) for x in (out / "data" / "rejects.jsonl").read_text().splitlines()]
    assert [r["reason"].split(":")[0] for r in rejects] == ["bad UTF-8 line 2", "bad JSON line 4"]
    first = snapshot(out / "data" / "features", out / "data" / "tokenized.jsonl")
    code, stdout, err = run_cli(main, argv, capsys)  # the same command again: nothing blocks, nothing changes
    assert code == 0, err
    assert "kept 4 + rejected 2 = input 6" in stdout and "0 samples cached, 4 already cached" in stdout
    assert_unchanged(first, out / "data" / "features", out / "data" / "tokenized.jsonl")


def test_prompt_longer_than_the_context_is_rejected_with_its_reason(good, tmp_path, capsys):
    long_prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * 12)
    recs = [{"id": "long", "conversations": [{"from": "human", "value": long_prompt}, {"from": "gpt", "value": "Ok."}]},
            {"id": "short", "conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello."}]}]
    src = tmp_path / "s.json"
    src.write_text(json.dumps(recs))
    for regenerate, reason in ((True, "the prompt alone does not fit max_length 48"),
                               (False, "no assistant token within max_length")):
        out = tmp_path / f"run-{regenerate}"
        code, stdout, err = run_cli(main, ["--recipe", recipe(tmp_path, good["target"], src, out, max_length=48,
                                                              regenerate=regenerate), "--no-progress"], capsys)
        assert code == 0, err
        report = json.loads((out / "data" / "tokenize_report.json").read_text())
        assert report["input"] == 2 and report["kept"] == 1 and report["dropped_no_loss_tokens"] == 1
        rejects = [json.loads(x) for x in (out / "data" / "tokenize_rejects.jsonl").read_text().splitlines()]
        assert rejects == [{"id": "long", "reason": f"no loss tokens: {reason}"}] or reason in rejects[0]["reason"], rejects


def test_corpus_cache_skips_undecodable_paragraphs(good, tmp_path, capsys):
    from data_prep.feature_cache import FeatureCacheReader
    from data_prep.corpus_cache import main as corpus_main

    text = tmp_path / "corpus.txt"
    text.write_bytes(b"Hello there, how are you today?\n\nTell me a story \xff about a cat.\n\nTwo plus two is four.\n")
    argv = ["--recipe", "tiny", "--text", text, f"target.path={good['target']}", f"output_dir={tmp_path / 'run'}",
            "target.dtype=float32", "data.device=cpu"]
    code, out, err = run_cli(corpus_main, argv, capsys)
    assert code == 0, err
    assert "1 of 3 paragraphs are not valid UTF-8" in out and "p000001" in out
    assert sorted(FeatureCacheReader(tmp_path / "run" / "data" / "features").ids) == ["p000000", "p000002"]
    text.write_bytes(b"\xff\xfe\n\n\xff\n")
    code, _, err = run_cli(corpus_main, [*argv[:3], tmp_path / "other.txt", *argv[4:]], capsys)
    assert_one_line_error(code, err, "other.txt")
    code, _, err = run_cli(corpus_main, [*argv[:4], f"target.path={good['target']}", f"output_dir={tmp_path / 'r2'}",
                                         "target.dtype=float32", "data.device=cpu"], capsys)
    assert_one_line_error(code, err, "corpus.txt", "no usable paragraph")


def test_question_file_that_is_not_utf8_is_named(tmp_path, capsys):
    from evaluation.main import main as eval_main

    q = tmp_path / "questions.txt"
    q.write_bytes(b"What is \xff?\n")
    code, _, err = run_cli(eval_main, ["--recipe", "tiny", "--questions", q, "--base", tmp_path], capsys)
    assert_one_line_error(code, err, "questions.txt", "UTF-8")
    (tmp_path / "q.jsonl").write_text('{"question_id": 1, "turns": ["a"]}\n{"question_id": 2}\n')
    code, _, err = run_cli(eval_main, ["--recipe", "tiny", "--questions", tmp_path / "q.jsonl", "--base", tmp_path],
                           capsys)
    assert_one_line_error(code, err, "q.jsonl:2", "turns")


@pytest.mark.parametrize("target_kind", ["missing-folder", "not-a-model"])
def test_whole_run_is_checked_before_the_first_stage_writes(good, tmp_path, capsys, target_kind):
    """Issue 28 item 14: a bad target.path fails before the load stage writes conversations.jsonl: the run folder is
    never created (and an earlier run's files are untouched)."""
    target = tmp_path / "no-target"
    if target_kind == "not-a-model":
        target.mkdir()
        (target / "config.json").write_text("{}")
    fresh = tmp_path / "fresh"
    code, _, err = run_cli(main, ["--recipe", recipe(tmp_path, target, good["source"], fresh), "--no-progress"], capsys)
    assert_one_line_error(code, err, str(target))
    assert not fresh.exists()
