"""vLLM's view of a quantized target (engine/quantized_target.py): the dequantized float copy computes exactly what
this project's in-memory quantized target computes, is written once (atomically) and reused, and every place that
starts vLLM for the recipe's target (data.serve regeneration, the vLLM feature capture, serve-check / serve-sweep)
points it at that copy (padded when vLLM's CPU attention needs it). The engine run itself: slow, skipped unless
$EAGLE_VLLM_PYTHON names a vLLM interpreter."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from test_data_prep_helpers import build_model, build_tokenizer
from tiny_models import hf_greedy, random_head, single_thread  # noqa: F401

from data_prep.target import load_target_model
from eagle.quantization import quant_method, quantize_target
from engine import quantized_target as qt
from engine.quantized_target import COPY_META, dequantized_copy, engine_target, served_label
from recipes import load_config

pytestmark = pytest.mark.usefixtures("single_thread")


def save_target(path: Path, hidden_size: int = 32) -> Path:
    """A 2-layer random Llama with a tokenizer (head_dim 8 at hidden 32: vLLM's CPU attention needs a padded copy;
    32 at hidden 128: served as it is)."""
    tok = build_tokenizer("chatml")
    build_model(len(tok), hidden_size=hidden_size).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def recipe(target: Path, quantization: str, *extra: str):
    return load_config("tiny", [f"target.path={target}", "target.dtype=float32", f"target.quantization={quantization}",
                                *extra])


def load(path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("name", ["int8", "int4", "int4-g16"])
def test_the_copys_forward_is_the_in_memory_quantized_models(tmp_path, name):
    """The copy, loaded as a plain float model, has the quantized weights bit for bit, so its logits and every
    hidden state equal the in-memory quantized target's exactly; the tokenizer and generation config come along."""
    target = save_target(tmp_path / "target")
    copy = dequantized_copy(str(target), name, "float32", tmp_path / "cache")
    assert copy.parent == tmp_path / "cache" / qt.CACHE_SUBDIR and copy.name.startswith(f"target-{name}-float32-")
    assert {"tokenizer.json", "generation_config.json", "model.safetensors", COPY_META} <= {p.name for p in copy.iterdir()}
    assert json.loads((copy / COPY_META).read_text())["served"] == f"quantization={name} (dequantized float copy)"
    ours = load_target_model(recipe(target, name).target, torch.device("cpu"))
    served = load(copy)
    for (k, a), b in zip(ours.state_dict().items(), served.state_dict().values()):
        assert torch.equal(a, b), k
    full = load(target)
    assert not torch.equal(full.model.layers[0].mlp.up_proj.weight, served.model.layers[0].mlp.up_proj.weight)
    ids = torch.randint(3, 60, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a, b = ours(ids, output_hidden_states=True), served(ids, output_hidden_states=True)
    assert torch.equal(a.logits, b.logits)
    assert all(torch.equal(x, y) for x, y in zip(a.hidden_states, b.hidden_states))


def test_the_copy_is_reused_and_written_atomically(tmp_path, monkeypatch):
    """A second call reuses the copy (no model load); a write that fails leaves no folder (nor its temporary one),
    so the next call writes it whole; another method, dtype or a rewritten target is another copy."""
    target = save_target(tmp_path / "target")
    cache = tmp_path / "cache"
    real = qt.write_dequantized

    def half_written(src, dst, quantization, dtype):
        (dst / "model.safetensors").write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(qt, "write_dequantized", half_written)
    with pytest.raises(OSError, match="disk full"):
        dequantized_copy(str(target), "int4", "float32", cache)
    assert not (cache / qt.CACHE_SUBDIR).exists() or not any((cache / qt.CACHE_SUBDIR).iterdir())
    calls = []
    monkeypatch.setattr(qt, "write_dequantized", lambda *a: (calls.append(a), real(*a)))
    copy = dequantized_copy(str(target), "int4", "float32", cache)
    stamp = (copy / "model.safetensors").stat().st_mtime_ns
    assert dequantized_copy(str(target), "int4", "float32", cache) == copy and len(calls) == 1
    assert (copy / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in copy.parent.iterdir()] == [copy.name]  # no temporary folder left
    assert dequantized_copy(str(target), "int8", "float32", cache) != copy
    assert dequantized_copy(str(target), "int4", "bfloat16", cache) != copy
    later = (target / "model.safetensors").stat().st_mtime_ns + 10**9
    os.utime(target / "model.safetensors", ns=(later, later))  # the target was rewritten
    assert dequantized_copy(str(target), "int4", "float32", cache) != copy and len(calls) == 4
    with pytest.raises(ValueError, match="none needs no copy"):
        dequantized_copy(str(target), "none", "float32", cache)


def quantized_up_proj(target: Path, name: str) -> torch.Tensor:
    return quant_method(name).quantize_weight(load(target).model.layers[0].mlp.up_proj.weight)


def test_every_vllm_start_serves_the_dequantized_copy(tmp_path, monkeypatch):
    """data.serve's server, the offline vLLM capture and serve-check / serve-sweep's models all name the copy
    (padded to head_dim 32 for vLLM's CPU attention: its MLP weights are the quantized ones); a full-precision
    target is served as before; the recipe no longer refuses the vLLM paths."""
    import data_prep.main as dp
    import data_prep.vllm_features as vf
    from evaluation.serve_check import prepare_engine_models

    monkeypatch.setenv("EAGLE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(dp, "resolve_engine_python", lambda value: "engine-python")
    monkeypatch.setattr(vf, "resolve_engine_python", lambda value: "engine-python")
    target = save_target(tmp_path / "target")
    copies = tmp_path / "home" / qt.CACHE_SUBDIR
    cfg = recipe(target, "int4-g16", "data.backend=openai", "data.serve=true", "data.feature_source=vllm")

    def check_served(folder: str) -> None:
        assert Path(folder).name.endswith("-head_dim32") and Path(folder).name.startswith("target-int4-g16-float32-")
        assert torch.equal(load(folder).model.layers[0].mlp.up_proj.weight, quantized_up_proj(target, "int4-g16"))

    server = dp.recipe_server(cfg, str(target), "t", tmp_path / "work", tmp_path / "server.log")
    check_served(server.model)
    [copy] = copies.iterdir()
    assert json.loads((copy / COPY_META).read_text())["quantization"] == "int4-g16"

    seen = {}

    def fake_capture(python, model, dtype, named, layer_ids, work, seed, max_len, log):
        seen["model"] = model
        return {"files": {}, "vllm_version": "fake"}

    class Writer:
        def __contains__(self, key):
            return False

        def flush(self):
            pass

    monkeypatch.setattr(vf, "engine_capture", fake_capture)
    records = [{"id": "r0", "input_ids": [1, 5, 6, 7], "loss_mask": [0, 1, 1, 1]}]
    vf.cache_shard_vllm(cfg, str(target), load(target).config, records, Writer(), 0, 1, None, tmp_path / "data")
    check_served(seen["model"])

    model = load(target)
    random_head(model).save_pretrained(tmp_path / "head")
    served, draft, padded = prepare_engine_models(str(target), str(tmp_path / "head"), "vllm", "vllm", tmp_path / "sc",
                                                  4, "int4-g16", "float32")
    check_served(served)
    assert padded == 32 and json.loads((Path(draft) / "config.json").read_text())
    assert len(list(copies.iterdir())) == 1  # the one copy, reused by every start

    import train.stream_capture as sc  # train.stream_producer=vllm: its capture server serves the copy too

    class Started(Exception):
        pass

    def fake_server(python, model, log, **kwargs):
        seen["stream"] = model
        raise Started

    monkeypatch.setattr(sc, "resolve_engine_python", lambda value: "engine-python")
    monkeypatch.setattr(sc, "VLLMServer", fake_server)
    with pytest.raises(Started):
        sc.VLLMCapture(cfg, tmp_path / "stream").open()
    check_served(seen["stream"])

    plain = dp.recipe_server(recipe(target, "none", "data.backend=openai", "data.serve=true"), str(target), "t",
                             tmp_path / "work", tmp_path / "server.log")
    assert plain.model == str(tmp_path / "work" / "target-head_dim32")


def test_a_servable_quantized_target_needs_no_padding_and_outputs_name_the_copy(tmp_path):
    """head_dim 32: vLLM serves the copy itself; the label outputs record and the serve-check report's line."""
    from evaluation.serve_check import with_served_target

    target = save_target(tmp_path / "target", hidden_size=128)
    folder, padded = engine_target(str(target), load(target).config, tmp_path / "work", "int8", "float32",
                                   tmp_path / "cache")
    assert padded is None and Path(folder).parent == tmp_path / "cache" / qt.CACHE_SUBDIR
    assert engine_target(str(target), load(target).config, tmp_path / "work") == (str(target), None)
    assert served_label("none") is None and served_label("int4") == "quantization=int4 (dequantized float copy)"
    md = with_served_target("# serve-check\n\nhead on target\n", {"served_target": served_label("int4")})
    assert md.split("\n\n")[1].startswith("Target served by the engine: `quantization=int4 (dequantized float copy)`")
    assert with_served_target("# x\n\ny\n", {}) == "# x\n\ny\n"


@pytest.mark.slow
def test_vllm_decodes_the_copy_as_the_quantized_target_does(tmp_path, vllm_python):
    """vLLM's greedy decoding of the (padded) dequantized copy equals transformers' greedy generate of the in-memory
    quantized target, token for token."""
    from evaluation.engine_runs import engine_run

    target = save_target(tmp_path / "target")
    folder, _ = engine_target(str(target), load(target).config, tmp_path / "work", "int4", "float32", tmp_path / "cache")
    ours = quantize_target(load(target), "int4")
    prompts = [[1, 12, 30, 41, 7], [1, 50, 9, 22]]
    res = engine_run("vllm", vllm_python, {"model": folder, "dtype": "float32", "max_model_len": 256,
                                           "prompts": prompts, "max_tokens": 24, "stop_token_ids": [], "seed": 0,
                                           "runs": [{"name": "plain", "speculative_config": None}]}, tmp_path)
    refs = [hf_greedy(ours, torch.tensor([p]), 24)[0, len(p):].tolist() for p in prompts]
    assert res["runs"]["plain"]["outputs"] == refs


def test_the_vllm_capture_of_a_quantized_target_is_its_transformers_cache(tmp_path, monkeypatch, capsys):
    """data prep end to end with data.feature_source=vllm and target.quantization=int4: the engine is handed the
    padded dequantized copy (the fake engine computes its states from that folder, as vLLM would), the cache meta
    records `served_target`, and the states equal the transformers cache of the in-memory quantized target up to
    the padded copy's summation order."""
    import data_prep.vllm_features as vf
    from data_prep.feature_cache import FeatureCacheReader
    from data_prep.main import main
    from float_tolerance import LAYER_REDUCTIONS, assert_same_function
    from test_data_prep_helpers import write_sharegpt
    from test_data_prep_vllm_features import LAYERS, engine_states

    monkeypatch.setenv("EAGLE_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(vf, "resolve_engine_python", lambda value: "python")
    target = save_target(tmp_path / "target")
    source = write_sharegpt(tmp_path / "convs.json", 4)
    served = []

    def fake_capture(python, model, dtype, named, layer_ids, work, seed, max_len, log):
        served.append(model)
        engine = load(model)
        files = {}
        (work / "files").mkdir(parents=True, exist_ok=True)
        for r in named:
            from safetensors.torch import save_file

            p = work / "files" / f"{r['name']}.safetensors"
            save_file({"hidden_states": engine_states(engine, r["input_ids"], layer_ids).contiguous(),
                       "token_ids": torch.tensor(r["input_ids"])}, str(p))
            files[r["name"]] = str(p)
        return {"vllm_version": "fake", "files": files, "errors": {}}

    monkeypatch.setattr(vf, "engine_capture", fake_capture)
    base = ["--recipe", "tiny", f"target.path={target}", "target.dtype=float32", "target.chat_template=chatml",
            "target.quantization=int4", f"data.source={source}", "data.regenerate=false", "data.cache_dtype=float32",
            "data.disk_headroom_gb=0"]
    assert main([*base, f"output_dir={tmp_path / 'vllm'}", "data.feature_source=vllm", "--no-progress"]) in (0, None)
    assert main([*base, f"output_dir={tmp_path / 'hf'}", "--no-progress"]) in (0, None)
    capsys.readouterr()
    assert len(served) == 1 and Path(served[0]).name.startswith("target-int4-float32-")
    [vllm_dir] = (tmp_path / "vllm").rglob("features")
    [hf_dir] = (tmp_path / "hf").rglob("features")
    meta = json.loads((vllm_dir / "manifest.json").read_text())
    assert meta["served_target"] == "quantization=int4 (dequantized float copy)" and meta["target_quantization"] == "int4"
    assert "served_target" not in json.loads((hf_dir / "manifest.json").read_text())
    rows = {r["id"]: r for r in FeatureCacheReader(vllm_dir)}
    hf_rows = list(FeatureCacheReader(hf_dir))
    assert sorted(rows) == sorted(r["id"] for r in hf_rows) and hf_rows
    for r in hf_rows:
        assert_same_function(rows[r["id"]]["hidden_states"], r["hidden_states"], terms=64,
                             chained=LAYER_REDUCTIONS * LAYERS + 1)
