"""The feature cache computed by real vLLM (`data.feature_source=vllm`, slow; skipped unless $EAGLE_VLLM_PYTHON names
a vLLM interpreter): for an EAGLE-2 and an EAGLE-3 recipe the cache stage through vLLM's extract_hidden_states
capture writes the same records as the transformers path: token ids and loss masks identical, every feature equal
within the float32 rounding bound of the target's depth (tests/float_tolerance.py). With `data.backend=openai
data.serve=true` ONE server regenerates and captures: its regenerated token ids are a plain server's, its cache the
offline engine's. Without an engine: tests/test_data_prep_vllm_features.py."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from data_prep.feature_cache import FeatureCacheReader
from data_prep.vllm_features import UNREQUESTED
from float_tolerance import LAYER_REDUCTIONS, assert_same_function
from test_data_prep_helpers import build_tokenizer, write_sharegpt
from test_vllm_regenerate import data_prep, token_ids

pytestmark = pytest.mark.slow


LAYERS = 4


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A random 4-layer Llama with a ChatML template (4 layers: EAGLE-3 aux ids 0, 1, 2 + the final state 4)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("capture")
    tok = build_tokenizer("chatml")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=512, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                         initializer_range=0.2)).eval()
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = 2, 0
    model.save_pretrained(root / "target")
    tok.save_pretrained(root / "target")
    return root, root / "target", write_sharegpt(root / "convs.json", 12)


@pytest.mark.parametrize("kind", ["eagle2", "eagle3"])
def test_the_vllm_cache_equals_the_transformers_cache(target, tmp_path, vllm_python, kind):
    root, path, convs = target
    recipe = ["--recipe", "tiny" if kind == "eagle2" else "tiny-eagle3"] + (["head.aux_layers=[0,1,2]"]
                                                                             if kind == "eagle3" else [])
    base = recipe + [f"target.path={path}", "target.chat_template=chatml", f"data.source={convs}",
                     "data.max_new_tokens=16", "data.max_length=256", "data.cache_dtype=float32"]
    code, out, err = data_prep(base + [f"output_dir={tmp_path / 'hf'}"])
    assert code == 0, err[-2000:]
    shutil.copytree(tmp_path / "hf" / "data", tmp_path / "vllm" / "data",
                    ignore=shutil.ignore_patterns("features", "report.json"))
    code, out, err = data_prep(base + [f"output_dir={tmp_path / 'vllm'}", "cache", "data.feature_source=vllm",
                                       f"data.engine_python={vllm_python}"])
    assert code == 0, err[-3000:]
    a, b = FeatureCacheReader(tmp_path / "hf" / "data" / "features"), FeatureCacheReader(tmp_path / "vllm" / "data" /
                                                                                          "features")
    assert b.manifest["feature_layers" if kind == "eagle3" else "hidden_size"] == a.manifest[
        "feature_layers" if kind == "eagle3" else "hidden_size"]
    assert sorted(a.ids) == sorted(b.ids) and len(a) == 12
    for key in ("target", "config_hash", "hidden_size", "vocab_size", "tokenized_sha256", "dtype"):
        assert a.manifest[key] == b.manifest[key], key  # the trainer's target check cannot tell them apart
    rows = {r["id"]: r for r in b}
    for r in a:
        got = rows[r["id"]]
        assert got["input_ids"].tolist() == r["input_ids"].tolist() and got["loss_mask"].tolist() == r["loss_mask"].tolist()
        # vLLM's kernels and transformers' on the 4-layer target (+ the final norm): float32 rounding of that depth
        assert_same_function(got["hidden_states"], r["hidden_states"], terms=64, chained=LAYER_REDUCTIONS * LAYERS + 1)
    report = json.loads((tmp_path / "vllm" / "data" / "report.json").read_text())
    shard = report["cache_shard0of1"]
    assert shard["feature_source"] == "vllm" and shard["records_cached"] == 12 and shard["records_per_s"] > 0
    assert not any((tmp_path / "vllm" / "data").glob("vllm_capture-*/files/*.safetensors"))  # staging emptied


def server_starts(data: Path) -> list[str]:
    """The `vllm serve` command lines data prep wrote into its server log (one per start)."""
    return [ln for ln in (data / "vllm_server_shard0of1.log").read_text(errors="replace").splitlines()
            if ln.startswith("$ ")]


def test_one_server_regenerates_and_captures(target, tmp_path, vllm_python):
    """EAGLE-3 ids [0, 1, 2, 4]: the plain server's regeneration (transformers cache), then ONE server with the
    capture config for regenerate + tokenize + cache, then the offline engine's cache of the plain run's records."""
    root, path, convs = target
    base = ["--recipe", "tiny-eagle3", "head.aux_layers=[0,1,2]", f"target.path={path}", "target.chat_template=chatml",
            f"data.source={convs}", "data.max_new_tokens=16", "data.max_length=256", "data.cache_dtype=float32",
            "data.gen_batch_size=4", f"data.engine_python={vllm_python}"]
    served = ["data.backend=openai", "data.serve=true"]
    code, out, err = data_prep(base + served + [f"output_dir={tmp_path / 'plain'}"])
    assert code == 0, err[-3000:]
    code, out, err = data_prep(base + served + [f"output_dir={tmp_path / 'shared'}", "data.feature_source=vllm"])
    assert code == 0, err[-3000:]
    plain, shared = tmp_path / "plain" / "data", tmp_path / "shared" / "data"
    starts = server_starts(shared)
    assert len(starts) == 1 and "extract_hidden_states" in starts[0], starts  # one server for both stages
    assert "extract_hidden_states" not in server_starts(plain)[0]
    # regenerated ids: the capture server's greedy replies are the plain server's, token for token
    assert token_ids(tmp_path / "shared") == token_ids(tmp_path / "plain") and len(token_ids(tmp_path / "plain")) == 12
    assert (shared / "tokenized.jsonl").read_bytes() == (plain / "tokenized.jsonl").read_bytes()
    # the offline engine's cache of the same records (a second vLLM pass, engine/vllm_side/capture.py)
    shutil.copytree(plain, tmp_path / "offline" / "data", ignore=shutil.ignore_patterns("features", "report.json"))
    code, out, err = data_prep(base + [f"output_dir={tmp_path / 'offline'}", "cache", "data.feature_source=vllm"])
    assert code == 0, err[-3000:]
    caches = {k: FeatureCacheReader(d / "features") for k, d in (("plain", plain), ("shared", shared),
                                                                 ("offline", tmp_path / "offline" / "data"))}
    for key in ("target", "config_hash", "hidden_size", "vocab_size", "tokenized_sha256", "dtype", "feature_layers"):
        assert caches["shared"].manifest[key] == caches["offline"].manifest[key] == caches["plain"].manifest[key], key
    rows = {k: {r["id"]: r for r in c} for k, c in caches.items()}
    assert sorted(rows["shared"]) == sorted(rows["offline"]) == sorted(rows["plain"]) and len(rows["shared"]) == 12
    for rid, r in rows["offline"].items():
        got = rows["shared"][rid]
        assert got["input_ids"].tolist() == r["input_ids"].tolist() and got["loss_mask"].tolist() == r["loss_mask"].tolist()
        # the same engine and kernels; only the batch each record shares a step with differs
        assert_same_function(got["hidden_states"], r["hidden_states"], terms=64, chained=LAYER_REDUCTIONS * LAYERS + 1)
        assert_same_function(got["hidden_states"], rows["plain"][rid]["hidden_states"], terms=64,
                             chained=LAYER_REDUCTIONS * LAYERS + 1)
    assert not any(shared.glob("vllm_capture-*/files/*.safetensors"))  # staging emptied
    assert (shared / "vllm_capture-00000").is_dir() and not (shared / "vllm_capture-00000" / UNREQUESTED).exists()
    # ^ the regeneration requests were never captured (they would land in the connector's default folder)
    # a rerun that finds regeneration done (and the cache gone) still starts the one server, for the cache
    shutil.rmtree(shared / "features")
    code, out, err = data_prep(base + served + [f"output_dir={tmp_path / 'shared'}", "data.feature_source=vllm"])
    assert code == 0, err[-3000:]
    assert len(server_starts(shared)) == 2 and "extract_hidden_states" in server_starts(shared)[1]
    again = {r["id"]: r for r in FeatureCacheReader(shared / "features")}
    assert sorted(again) == sorted(rows["shared"])
    for rid, r in again.items():
        assert_same_function(r["hidden_states"], rows["shared"][rid]["hidden_states"], terms=64,
                             chained=LAYER_REDUCTIONS * LAYERS + 1)
