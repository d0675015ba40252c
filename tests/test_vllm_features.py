"""The feature cache computed by real vLLM (`data.feature_source=vllm`, slow; skipped unless $EAGLE_VLLM_PYTHON names
a vLLM interpreter): for an EAGLE-2 and an EAGLE-3 recipe the cache stage through vLLM's extract_hidden_states
capture writes the same records as the transformers path: token ids and loss masks identical, every feature equal
within the float32 rounding bound of the target's depth (tests/float_tolerance.py). Without an engine:
tests/test_data_prep_vllm_features.py."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from data_prep.feature_cache import FeatureCacheReader
from float_tolerance import LAYER_REDUCTIONS, assert_same_function
from test_data_prep_helpers import build_tokenizer, write_sharegpt
from test_vllm_regenerate import data_prep

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
