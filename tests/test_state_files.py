"""The files a run writes and reads back (eagle/state_files.py): every registered state file (JSON, YAML, text),
damaged every way (missing, empty, truncated, binary garbage, wrong top-level type, a key missing, a key of the
wrong type), read by its real reader, is ONE line naming the file and what to do, never a KeyError, a bare decoder
message or a silent default. The registry is complete: the source is scanned for JSON and YAML reads and writes,
and each one outside the loaders is a registered state file's or listed with the reason it is not a state file."""
from __future__ import annotations

import ast
import importlib
import json
import os
import re
from pathlib import Path

import pytest

import yaml

from eagle.state_files import (REGISTRY, StateFile, StateFileError, read_state, read_text_state, write_json_state,
                               write_yaml_state)

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("eagle", "recipes", "engine", "data_prep", "train", "export", "evaluation", "quickstart", "benchmarks")
LOADER = "eagle/state_files.py"


def project_files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def modules_registering() -> list[str]:
    """The modules whose source declares a state file (`register(StateFile(`), imported so the registry is full."""
    return sorted(".".join(p.relative_to(ROOT).with_suffix("").parts) for p in project_files()
                  if "register(StateFile(" in p.read_text() and p.relative_to(ROOT).as_posix() != LOADER)


for _m in modules_registering():
    importlib.import_module(_m)

# ------------------------------------------------------------------------------------------------ inventory
# Every json.load/json.loads/json.dump/json.dumps call in the project's source outside eagle/state_files.py, by file:
# (number of calls, why none is a state-file read or write). A new JSON file written and read back must be declared
# with register(StateFile(...)) and go through read_json_state/write_json_state instead of being added here.
NOT_STATE = {
    "eagle/head_module.py": (1, "writes the head's config.json inside write_folder (atomic folder); read back via "
                                "eagle/head_config.py HEAD_CONFIG"),
    "eagle/target_weights.py": (1, "a target checkpoint's index.json: a model input from the Hub, not written here"),
    "eagle/head_files.py": (1, "engine_export sniffs a config.json's layout and returns None if unreadable; the "
                               "loader that follows (read_head_config) reports the damage"),
    "data_prep/main.py": (2, "load_report.json / tokenize_report.json: reports for people, never read back"),
    "data_prep/default_target.py": (4, "the default target's training conversations / questions (inputs written "
                                       "for people and benchmarks) and transformers' tokenizer_config.json"),
    "data_prep/docstring_corpus.py": (2, "a subprocess's stdout (not a file)"),
    "data_prep/target.py": (1, "a hash of a dict (no file)"),
    "data_prep/conversations.py": (6, "JSONL record files: user data and conversations.jsonl, checked per line "
                                      "with file:line errors; a tool call's arguments or a tools list given as a "
                                      "JSON string inside a record (one-line error naming the record)"),
    "data_prep/tool_calls.py": (2, "tool calls parsed out of a model's reply text (a reply that does not parse stays "
                                   "text, counted)"),
    "data_prep/tokenized.py": (2, "tokenized.jsonl records, checked per line with file:line errors"),
    "data_prep/regenerate.py": (7, "HTTP bodies of the OpenAI-compatible server (each field checked: parse_reply), "
                                   "tool-call arguments sent to it as the API's JSON strings, and the regenerated "
                                   "JSONL records (checked per line: read_parts)"),
    "data_prep/feature_cache.py": (3, "a meta round trip and the ids in a safetensors header (checked against the "
                                      "part manifest)"),
    "data_prep/feature_shard.py": (2, "the record ids in a shard's safetensors header, written and read with it"),
    "benchmarks/stream_vs_offline.py": (5, "the runs' summary.json (records for people) and its own result.json: "
                                           "a measurement, never read back by the project"),
    "train/stream_producer.py": (1, "the hash of a stream's order (json.dumps): an identity, no file"),
    "train/main.py": (4, "deepspeed_config.json and summary.json: records for people, never read back; log lines"),
    "train/eval_head.py": (1, "prints to stdout"),
    "train/plan.py": (2, "counts records of the user's data file; prints --json"),
    "train/tracking.py": (1, "metrics.jsonl, a log appended to"),
    "export/engine_formats.py": (1, "writes an engine folder's config.json inside write_folder (atomic folder); read "
                                    "back via HEAD_CONFIG"),
    "export/head_kinds.py": (1, "the trap message quotes the kind's vLLM speculative-config keys as JSON"),
    "export/model_card.py": (2, "command lines in the card (one with the fitted speculative config)"),
    "engine/vllm_side/script.py": (2, "runs under the engine's interpreter (no project imports): reads the request "
                                      "written just before, writes the script's RESULT (CAPTURE_RESULT, ENGINE_RESULT: "
                                      "read back through the loader)"),
    "engine/engine_process.py": (1, "writes an engine script's request, read by it at once"),
    "data_prep/vllm_features.py": (3, "the target's safetensors index (an input); the capture request body sent to "
                                      "the server"),
    "engine/vllm_server.py": (2, "vllm serve's --speculative-config / --kv-transfer-config arguments"),
    "evaluation/serve_check.py": (1, "serve-check's report.json, for people, never read back"),
    "evaluation/serve_sweep.py": (3, "the ShareGPT prompt file vllm bench reads; command-line arguments; the "
                                     "speculative config shown in sweep.md"),
    "evaluation/report.py": (5, "a JSON round trip before write_json_state; answers.jsonl, autotune.json and "
                                "chi2 report.json: reports for people, never read back"),
    "evaluation/questions.py": (1, "question JSONL records, checked per line"),
    "quickstart/demo.py": (4, "the demo's input conversations/questions, a fingerprint hash, a command-line value"),
    "benchmarks/decode_bench.py": (1, "results for people"),
    "benchmarks/paired_decode.py": (3, "reads the runs to measure (an input it never writes), prints and writes results for people"),
    "benchmarks/quantized_states.py": (1, "results for people"),
    "benchmarks/window_memory.py": (2, "one measurement per child process, printed as a JSON line for its parent"),
    "benchmarks/sequence_parallel_memory.py": (2, "one measurement per rank, printed as a JSON line for its parent"),
    "benchmarks/long_context_questions.py": (1, "writes the shipped question set (package data, never read back here)"),
    "engine/vllm_side/dflash_k_norm.py": (1, "the engine-side self-test's answer, printed for the caller"),
    "engine/quantized_target.py": (2, "a digest's input (the copy's key) and the copy's record for people: only its "
                                      "existence is read back (a complete copy)"),
    "benchmarks/train_batching.py": (1, "results for people"),
    "benchmarks/step_costs.py": (2, "reads the default target's conversations/questions (inputs)"),
    "benchmarks/rss_phases.py": (1, "a log for the benchmark"),
    "benchmarks/real_shape.py": (3, "benchmark inputs (the target's config.json, phases.jsonl) and results"),
    "benchmarks/real_shape_decode.py": (1, "results for people"),
    "benchmarks/thinking_target.py": (4, "writes the benchmark target's prompt sets and a summary for people"),
    "benchmarks/long_context_target.py": (7, "a fingerprint's JSON round trip (tuples as lists), the base target's "
                                             "tokenizer_config.json (an input) rewritten with the long max length, the "
                                             "long documents for people and data prep (inputs), a printed summary"),
}
JSON_CALLS = {"load", "loads", "dump", "dumps"}


def json_calls(path: Path) -> int:
    """Calls json.load/loads/dump/dumps in `path` (by the AST: comments and strings do not count)."""
    tree = ast.parse(path.read_text())
    return sum(1 for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
               and n.func.attr in JSON_CALLS and isinstance(n.func.value, ast.Name) and n.func.value.id == "json")


def test_every_json_file_access_is_a_registered_state_file_or_listed_with_its_reason():
    found = {p.relative_to(ROOT).as_posix(): json_calls(p) for p in project_files()}
    found = {k: v for k, v in found.items() if v and k != LOADER}
    listed = {k: n for k, (n, _) in NOT_STATE.items()}
    assert found == listed, (
        "JSON read/write calls changed: a file the project writes and reads back must be declared with "
        "register(StateFile(...)) and read with read_json_state (eagle/state_files.py); anything else is listed in "
        f"NOT_STATE with why it is not a state file. Differences (found vs listed): "
        f"{ {k: (found.get(k), listed.get(k)) for k in set(found) | set(listed) if found.get(k) != listed.get(k)} }")


YAML_READS = {"load", "safe_load", "full_load", "unsafe_load"}  # yaml.X / OmegaConf.load
YAML_LOADERS = {"recipes/load.py": "the recipe loader (user recipes, and a stored recipe.yaml given as --recipe)"}


def yaml_reads(path: Path) -> int:
    tree = ast.parse(path.read_text())
    return sum(1 for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
               and isinstance(n.func.value, ast.Name) and (n.func.value.id == "yaml" and n.func.attr in YAML_READS
                                                            or n.func.value.id == "OmegaConf" and n.func.attr == "load"))


def test_yaml_is_read_only_by_the_recipe_loader_and_the_state_loader():
    found = {p.relative_to(ROOT).as_posix() for p in project_files() if yaml_reads(p)}
    assert found - {LOADER} == set(YAML_LOADERS), "a YAML file written and read back is a state file: read it with " \
                                                  "read_yaml_state (eagle/state_files.py)"


def test_the_registry_holds_every_declared_state_file():
    declared = sum(p.read_text().count("register(StateFile(") for p in project_files()
                   if p.relative_to(ROOT).as_posix() != LOADER)
    assert len(REGISTRY) == declared >= 15
    assert {"HEAD_DIR/tree_config.json", "OUTPUT_DIR/train/checkpoints/TAG/ranks.json",
            "OUTPUT_DIR/train/checkpoints/TAG/head.json", "OUTPUT_DIR/train/checkpoints/latest",
            "QUICKSTART_OUT/quickstart_state.json", "CACHE_DIR/parts/PART.json", "CACHE_DIR/manifest.json",
            "SERVE_SWEEP_DIR/sweep.json", "SERVE_SWEEP_DIR/bench/k{K}_c{C}.json", "HEAD_DIR/recipe.yaml"} <= set(REGISTRY)


# ------------------------------------------------------------------------------------------------ readers
def _read_head_config(d: Path):
    from eagle.head_config import read_head_config
    return read_head_config(d / "config.json")


def _tree(d: Path):
    from eagle.ea_model import load_calibrations, load_tree_config
    return load_tree_config(d), load_calibrations(d)


def _head_json(d: Path):
    from train.checkpoint import check_checkpoint_head
    return check_checkpoint_head(d, None, "test")  # damage is reported before the module is looked at


def _ranks(d: Path):
    from train.checkpoint import saved_world_size
    return saved_world_size(d)


def _latest(d: Path):
    from train.checkpoint import latest_tag
    (d / "step-00000020").mkdir(exist_ok=True)
    return latest_tag(d)


def _parts(d: Path):
    from data_prep.feature_cache import _load_parts
    return _load_parts(d.parent)


def _build_info(d: Path):
    from data_prep.default_target import read_build_info
    return read_build_info(d)


def _settings(d: Path):
    from data_prep.regenerate import check_settings
    spec = REGISTRY["REGENERATED_DIR/settings.json"]
    return check_settings(d, spec.example)


def _eval_report(d: Path):
    from quickstart.demo import headline_line, summarize_report
    return summarize_report(d), headline_line(d)


def _bench(d: Path):
    from evaluation.serve_sweep import read_bench_result
    return read_bench_result(d / "k{K}_c{C}.json", 0, 1)


def _sweep_progress(d: Path):
    from evaluation.serve_sweep import resumable
    return resumable(d, REGISTRY["SERVE_SWEEP_PARTIAL/progress.json"].example["settings"])


def _quickstart(d: Path):
    from quickstart.demo import read_state
    return read_state(d)


def _spec_loader(key: str):
    spec = REGISTRY[key]
    return lambda d: read_state(d / spec.name, spec)


def _stored_recipe(d: Path):
    from export.hub import trained_recipe
    from recipes import load_config
    return trained_recipe(load_config("tiny"), d, {"hidden_size": 8})


def _speculative_config(d: Path):
    from export.speculative_schedule import read_speculative_config
    return read_speculative_config(d / "speculative_config.json")


# key -> the project's own reader of that file, called with the folder holding it. Readers that are
# read_json_state itself (the model card's inputs in export/hub.py, data_prep's report merge) use the loader.
READERS = {
    "HEAD_DIR/config.json": _read_head_config,
    "HEAD_DIR/tree_config.json": _tree,
    "OUTPUT_DIR/train/checkpoints/TAG/head.json": _head_json,
    "OUTPUT_DIR/train/checkpoints/TAG/ranks.json": _ranks,
    "OUTPUT_DIR/train/checkpoints/latest": _latest,
    "HEAD_DIR/train_summary.json": _spec_loader("HEAD_DIR/train_summary.json"),
    "HEAD_DIR/recipe.yaml": _stored_recipe,
    "CACHE_DIR/parts/PART.json": _parts,
    "CACHE_DIR/manifest.json": _spec_loader("CACHE_DIR/manifest.json"),
    "DEFAULT_TARGET_DIR/default_target.json": _build_info,
    "LONG_CONTEXT_TARGET_DIR/long_context_target.json":
        lambda d: __import__("benchmarks.long_context_target").long_context_target.read_long_build_info(d),
    "REGENERATED_DIR/settings.json": _settings,
    "OUTPUT_DIR/data/report.json": _spec_loader("OUTPUT_DIR/data/report.json"),
    "EVAL_DIR/report.json": _eval_report,
    "SERVE_SWEEP_DIR/sweep.json": _spec_loader("SERVE_SWEEP_DIR/sweep.json"),
    "SERVE_SWEEP_DIR/bench/k{K}_c{C}.json": _bench,
    "SERVE_SWEEP_PARTIAL/progress.json": _sweep_progress,
    "SERVE_CHECK_WORK_DIR/ENGINE_result.json": _spec_loader("SERVE_CHECK_WORK_DIR/ENGINE_result.json"),
    "DATA_DIR/vllm_capture-SHARD/result.json": _spec_loader("DATA_DIR/vllm_capture-SHARD/result.json"),
    "SERVE_SWEEP_DIR/speculative_config.json": _speculative_config,
    "QUICKSTART_OUT/quickstart_state.json": _quickstart,
    "STREAM_DIR/request.json": lambda d: __import__("train.stream").stream.read_request(d),
    "STREAM_DIR/stream.json": _spec_loader("STREAM_DIR/stream.json"),
    "STREAM_DIR/producer.json": _spec_loader("STREAM_DIR/producer.json"),
    "STREAM_DIR/producer-P.json": _spec_loader("STREAM_DIR/producer-P.json"),
    "STREAM_DIR/producer.error": _spec_loader("STREAM_DIR/producer.error"),
    "STREAM_DIR/consumed/RANK.json": _spec_loader("STREAM_DIR/consumed/RANK.json"),
    "STREAM_DIR/vllm/server.json": _spec_loader("STREAM_DIR/vllm/server.json"),
    "STREAM_DIR/done.json": _spec_loader("STREAM_DIR/done.json"),
}


def test_every_registered_state_file_has_its_reader_here():
    assert set(READERS) == set(REGISTRY), "add the reader of each new state file to READERS"


# ------------------------------------------------------------------------------------------------ damage
WRONG_VALUES = ("not a number", 12345, -7, 1.5, True, None, [], {}, [["x"]])


def _required_keys(schema) -> list[str]:
    return [k for k in schema if k != "*" and not k.endswith("?")] if isinstance(schema, dict) else []


def _valid(spec: StateFile, value) -> bool:
    from eagle.state_files import check_state
    try:
        check_state("x", value, spec)
    except StateFileError:
        return False
    return True


def damaged(spec: StateFile, case: str) -> bytes | None:
    """The bytes of `spec`'s file damaged by `case` (None: no file), from its valid example."""
    dump = {"text": str, "json": lambda v: json.dumps(v, indent=1), "yaml": yaml.safe_dump}[spec.format]
    good = dump(spec.example)
    if case == "empty":
        return b""
    if case == "truncated":
        return good.encode()[: max(1, len(good) // 2)] if spec.format == "json" else \
            b"step-000" if spec.format == "text" else good.encode()[: good.index(":") + 1] + b" [unclosed"
    if case == "garbage":
        return bytes(range(128, 256)) * 3 + b"\x00\xff"
    if case == "wrong_top_level":
        return b'{"tag": "step-00000020"}' if spec.format == "text" else dump(["a", "list"]).encode()
    value = dict(spec.example)
    if case == "missing_key":
        required = _required_keys(spec.schema)
        for key in required or list(value):  # no required key: an object without any of its keys
            value.pop(key, None)
        return dump(value).encode()
    if case == "wrong_key_type":
        key = (_required_keys(spec.schema) or list(value))[0]
        from eagle.state_files import check_state
        for wrong in WRONG_VALUES:
            try:
                check_state("x", {**value, key: wrong}, spec)
            except StateFileError:
                return dump({**value, key: wrong}).encode()
        raise AssertionError(f"{spec.key}: key {key} takes any value; give it a type")
    raise ValueError(case)


CASES = ("missing", "empty", "truncated", "garbage", "wrong_top_level", "missing_key", "wrong_key_type")


def _cases():
    for key, spec in sorted(REGISTRY.items()):
        for case in CASES:
            if spec.format == "text" and case in ("missing_key", "wrong_key_type"):
                continue  # one line of text has no keys
            if case == "missing_key" and not _required_keys(spec.schema) and _valid(spec, {}):
                continue  # every key optional (tree_config.json: the defaults), an empty object is valid
            yield pytest.param(key, case, id=f"{key}-{case}")


@pytest.mark.parametrize("key,case", list(_cases()))
def test_a_damaged_state_file_is_one_line_naming_it_and_what_to_do(key, case, tmp_path):
    spec = REGISTRY[key]
    folder = tmp_path / "parts" if spec.name == "PART.json" else tmp_path
    folder.mkdir(exist_ok=True)
    path = folder / spec.name
    content = None if case == "missing" else damaged(spec, case)
    if content is not None:
        path.write_bytes(content)
    before = None if content is None else path.read_bytes()
    try:
        READERS[key](folder)
    except StateFileError as e:
        msg = str(e)
        assert "\n" not in msg and str(path) in msg and spec.rebuild in msg, msg
        assert "Traceback" not in msg and "KeyError" not in msg
        if content is not None:
            assert path.read_bytes() == before  # reading never "repairs" the file
        return
    except Exception as e:  # noqa: BLE001 - the point: nothing but the one-line error
        raise AssertionError(f"{key} {case}: {type(e).__name__}: {e}") from None
    # no error: only a missing file whose absence the spec declares normal (its reader then uses none)
    assert case == "missing" and spec.when_missing is not None, f"{key} {case}: read without an error"


@pytest.mark.parametrize("key", sorted(REGISTRY))
def test_the_example_of_every_state_file_round_trips_through_the_writer_and_loader(key, tmp_path):
    spec = REGISTRY[key]
    path = tmp_path / spec.name
    if spec.format in ("json", "yaml"):
        (write_json_state if spec.format == "json" else write_yaml_state)(path, spec.example, spec)
        assert read_state(path, spec) == spec.example
    else:
        path.write_text(spec.example + "\n")
        assert read_text_state(path, spec) == spec.example
    assert not [p for p in tmp_path.iterdir() if p.name != spec.name]  # no temporary file left


def test_a_writer_that_drifts_from_the_schema_fails_at_the_writer(tmp_path):
    from train.checkpoint import RANKS_STATE
    with pytest.raises(StateFileError, match=r"ranks.json: damaged: world_size is a string"):
        write_json_state(tmp_path / "ranks.json", {"world_size": "2"}, RANKS_STATE)
    assert not (tmp_path / "ranks.json").exists()


def test_a_failed_atomic_write_keeps_the_previous_file(tmp_path, monkeypatch):
    import errno

    from eagle.atomic_file import FileWriteError, write_file_atomic
    path = write_file_atomic(tmp_path / "x.json", "old")

    def full(*_):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(FileWriteError, match=re.escape(f"could not write {path} (No space left on device)")):
        write_file_atomic(path, "new")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["x.json"]


def test_a_cli_reports_a_damaged_state_file_as_one_line(tmp_path, capsys):
    """End to end through a command: a damaged tree_config.json beside the head, read by `tuned`."""
    from evaluation.methods import load_tuned
    (tmp_path / "tree_config.json").write_text('{"total_token": 30, "depth": ')
    with pytest.raises(StateFileError) as e:
        load_tuned(tmp_path)
    assert str(e.value).startswith(f"{tmp_path / 'tree_config.json'}: damaged: not valid JSON (truncated")
    assert "python -m evaluation autotune" in str(e.value)
