"""Feature caching with the target + the recipe-driven CLI end to end (load -> regenerate -> tokenize -> cache)."""
import json

import pytest
import torch

from data_prep import cache_features
from data_prep.cache_features import DiskSpaceError, check_disk, final_hidden_states
from data_prep.feature_cache import FeatureCacheReader
from data_prep.main import main
from data_prep.tokenized import load_tokenized
from float_tolerance import LAYER_REDUCTIONS, assert_same_function
from test_data_prep_helpers import build_model, one_torch_thread, save_target, write_sharegpt  # noqa: F401

pytestmark = pytest.mark.numeric  # float comparisons: tests/float_variants.py runs them under every variant

# build_model: 2 layers + final norm, the MLP's 64 terms the longest reduction
MODEL_REDUCTIONS, MODEL_TERMS = 2 * LAYER_REDUCTIONS + 1, 64


def test_cached_feature_is_the_lm_head_input():
    model = build_model(100)
    ids = [1, 5, 7, 9, 11]
    h = final_hidden_states(model, ids)  # [T, H]
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
        logits = model.lm_head(h.clone())
    assert_same_function(h, out.hidden_states[-1][0], terms=MODEL_TERMS, chained=MODEL_REDUCTIONS)
    assert_same_function(logits, out.logits[0], terms=MODEL_TERMS, chained=MODEL_REDUCTIONS + 1)  # + lm_head


def test_disk_estimate_and_refusal(tmp_path, monkeypatch, capsys):
    info = check_disk(tmp_path / "not" / "yet", num_tokens=1000, hidden_size=64, dtype="bfloat16", headroom_gb=0)
    assert info["estimated_bytes"] == 1000 * (64 * 2 + 5)
    assert "estimated disk use: 1,000 tokens" in capsys.readouterr().out
    monkeypatch.setattr(cache_features, "free_bytes", lambda path: 10_000)
    with pytest.raises(DiskSpaceError, match="not enough disk.*cache_dtype=int8"):
        check_disk(tmp_path, num_tokens=1000, hidden_size=64, dtype="bfloat16", headroom_gb=0)


def write_recipe(tmp_path, **data):
    target = save_target(tmp_path / "target", chat_template=None)  # tokenizer without a template: recipe picks one
    source = write_sharegpt(tmp_path / "convs.json", 6)
    d = {"source": str(source), "max_new_tokens": 5, "gen_batch_size": 3, "max_length": 64, "disk_headroom_gb": 0.0,
         "device": "cpu", **data}
    recipe = {"name": "t", "output_dir": str(tmp_path / "run"),
              "target": {"path": str(target), "dtype": "float32", "chat_template": "chatml"}, "data": d}
    path = tmp_path / "t.yaml"
    path.write_text(json.dumps(recipe))  # JSON is YAML
    return path


def test_cli_end_to_end_resume_and_inspect(tmp_path, capsys):
    recipe = write_recipe(tmp_path)
    # bad record at the end: must be rejected and counted
    src = json.loads((tmp_path / "convs.json").read_text()) + [{"id": "bad", "conversations": [{"from": "robot", "value": "x"}]}]
    (tmp_path / "convs.json").write_text(json.dumps(src))
    main(["--recipe", str(recipe), "--no-progress"])
    data = tmp_path / "run" / "data"
    out = capsys.readouterr().out
    assert "kept 6 + rejected 1 = input 7" in out
    report = json.loads((data / "report.json").read_text())
    assert report["load"]["rejected"] == 1 and report["tokenize"]["kept"] == 6
    assert json.loads((data / "rejects.jsonl").read_text())["reason"].startswith("unknown role")

    reader = FeatureCacheReader(data / "features")
    tokenized = list(load_tokenized(data))
    assert len(reader) == 6 and sorted(reader.ids) == sorted(r["id"] for r in tokenized)
    assert reader.manifest["dtype"] == "bfloat16" and reader.manifest["hidden_size"] == 32
    # features match a fresh forward of the saved target
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "target", dtype=torch.float32)
    by_id = {r["id"]: r for r in tokenized}
    sample = reader[0]
    assert sample["input_ids"].tolist() == by_id[sample["id"]]["input_ids"]
    ref = final_hidden_states(model, by_id[sample["id"]]["input_ids"])
    # stored in bf16 (read back as float32): bf16's rounding on top of a forward's
    assert_same_function(sample["hidden_states"], ref, terms=MODEL_TERMS, chained=MODEL_REDUCTIONS + 1,
                         dtype=torch.bfloat16)

    # rerun: every stage resumes, nothing is recomputed, the cache is unchanged
    manifest_before = (data / "features" / "manifest.json").read_text()
    main(["--recipe", str(recipe), "--no-progress"])
    out = capsys.readouterr().out
    assert "0 generated, 6 already done" in out and "0 samples cached, 6 already cached" in out
    assert (data / "features" / "manifest.json").read_text() == manifest_before

    main(["--recipe", str(recipe), "inspect", "--inspect", "2"])
    out = capsys.readouterr().out
    assert out.count("=== ") == 2 and "⟦" in out and "<|im_end|>⟧" in out


def test_cli_shards_and_int8_without_regeneration(tmp_path, capsys):
    recipe = write_recipe(tmp_path, regenerate=False, cache_dtype="int8")
    main(["--recipe", str(recipe), "--no-progress", "load"])
    main(["--recipe", str(recipe), "--no-progress", "tokenize"])
    main(["--recipe", str(recipe), "--no-progress", "--shard", "0/2", "cache"])
    assert "other shards still pending" in capsys.readouterr().out
    main(["--recipe", str(recipe), "--no-progress", "--shard", "1/2", "cache"])
    reader = FeatureCacheReader(tmp_path / "run" / "data" / "features")
    assert len(reader) == 6 and reader.manifest["parts"] == ["shard00000-of-00002", "shard00001-of-00002"]
    assert 0 < reader.manifest["quantization"]["relative_rmse"] < 0.01
    tokenized = {r["id"]: r for r in load_tokenized(tmp_path / "run" / "data")}
    # original replies were kept (no regeneration): the mask covers the dataset's own answers
    assert all(sum(r["loss_mask"]) > 0 for r in tokenized.values())


def test_cli_rejects_unknown_keys_and_stages(tmp_path, capsys):
    recipe = write_recipe(tmp_path)
    assert main(["--recipe", str(recipe), "data.nope=1"]) == 2
    assert "data.nope" in capsys.readouterr().err
    assert main(["--recipe", str(recipe), "train"]) == 2
    assert "at most one stage" in capsys.readouterr().err
