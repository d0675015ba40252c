"""An EAGLE-2 export is byte-identical to the one main's code produced before EAGLE-3 existed.

The sha256 values below were computed by `train.export.export_head` at commit 468af37 (before the EAGLE-3
head kind was added), for fixed heads whose weights are a closed-form function (no RNG), so they pin the
exported bytes themselves: config.json key order / values and the safetensors header and data.
"""
from __future__ import annotations

import hashlib

import pytest
import torch

from eagle.head import EagleHead, HeadConfig
from train.export import export_head

PINNED = {  # (bias, qkv_bias, dtype) -> (config.json sha256, model.safetensors sha256)
    (False, False, "float32"): ("24086a46078e57422d53a67683f9bc9eaad79218b48207f287f1de644387e2be",
                                "28b67d3ce6be0c9e937f9ae99a2d180ba5b233da1b2efa9b52386f75fd3705a3"),
    (False, False, "bfloat16"): ("a6679304780c120b21e067a32dc414c4539b7232d0fbad8343f2d9a76da9026f",
                                 "5d748f1fe6eec0ea475454694fcb7a518f6aff308261c1320646845875bf2f76"),
    (True, True, "float16"): ("4d6ecaa0ab1caa8baa06bf60c1c9e9f1807190fdce8d0bcae0959d3bac4b4055",
                              "c7298919e11ff08bfd262bb411705338878e47cf76414235cb9aebd6400746a3"),
}


def fixed_head(bias: bool, qkv_bias: bool) -> tuple[dict, HeadConfig]:
    cfg = HeadConfig(hidden_size=16, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2, vocab_size=40,
                     rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=2048, bias=bias,
                     qkv_bias=qkv_bias, eos_token_id=[1, 2])
    head = EagleHead(cfg)
    sd = {k: torch.sin(torch.arange(v.numel(), dtype=torch.float64) * 0.37 + i).reshape(v.shape).float()
          for i, (k, v) in enumerate(sorted(head.state_dict().items()))}
    return sd, cfg


@pytest.mark.parametrize("key", list(PINNED), ids=lambda k: f"bias{int(k[0])}-qkv{int(k[1])}-{k[2]}")
def test_eagle2_export_is_byte_identical_to_mains(tmp_path, key):
    bias, qkv_bias, dtype = key
    sd, cfg = fixed_head(bias, qkv_bias)
    out = export_head(sd, cfg, tmp_path / "head", dtype, legacy_bin=False)
    got = tuple(hashlib.sha256((out / name).read_bytes()).hexdigest() for name in ("config.json", "model.safetensors"))
    assert got == PINNED[key]


# ----------------------------------------------------------------------------- model card
def card_inputs():
    from omegaconf import OmegaConf

    cfg = OmegaConf.create({"name": "pin", "target": {"path": "user/base"}, "data": {"source": "sharegpt"},
                            "head": {"ttt_steps": 7, "ttt_step_weights": []},
                            "train": {"mode": "offline", "lr": 3e-5, "betas": [0.9, 0.95], "weight_decay": 0.0,
                                      "schedule": "linear", "warmup_steps": 2000, "grad_clip": 0.5, "micro_batch_size": 2,
                                      "grad_accum": 2, "feature_weight": 1.0, "token_weight": 0.1, "noise": "uniform",
                                      "noise_std": 0.2, "precision": "bf16", "zero_stage": 2}})
    summary = {"target": "user/base", "steps": 10, "epochs": 1.0, "train_records": 5, "eval_records": 1,
               "train_tokens_per_s": 100.0, "eval": {"eval/top1": 0.5, "eval/step1_acc": 0.5, "eval/sim_accept_len": 1.5}}
    manifest = {"num_records": 3, "num_tokens": 30, "num_loss_tokens": 20, "source": "x"}
    report = {"summaries": [{"category": "overall", "method": "eagle2", "tau": 2.0, "tokens_per_s": 10.0, "speedup": 1.5}],
              "meta": {}}
    return cfg, summary, manifest, report


def test_eagle2_model_card_is_unchanged():
    """sha256 of the card main's model_card (468af37) wrote for these inputs (the `head` section is new and unread)."""
    from export.model_card import model_card

    cfg, summary, manifest, report = card_inputs()
    sd, config = fixed_head(False, False)
    card = model_card(cfg, "me/head", "apache-2.0", summary, manifest, report, ["eval/a.png"],
                      head_config=config.to_dict())
    # the "## Serving" section (engine commands, issue 17) is new; everything else is byte-identical
    start = card.index("## Serving\n")
    card = card[:start] + card[card.index("## ", start + 3):]
    assert hashlib.sha256(card.encode()).hexdigest() == "8aa77f29a06d93c3e4db33c0548fd101c8a5b5568264febc4579ce67bf41b5fd"


# ----------------------------------------------------------------------------- EAGLE-3
def test_eagle3_export_is_the_released_layout_and_loads_back(tmp_path):
    import json

    from safetensors import safe_open

    from eagle import EaModel
    from eagle.head import Eagle3Head, load_head
    from tiny_models import hf_greedy, random_prompts, tiny_target
    from train.export import full_state_dict
    from export.model_card import model_card

    target = tiny_target("llama", num_layers=4, seed=1)
    torch.manual_seed(0)
    trained = Eagle3Head.from_target(target, aux_layers=[1, 2, 3], draft_vocab_size=100)
    trained.set_vocab(torch.arange(0, 200, 2) - torch.arange(100))  # the even ids
    sd = full_state_dict(trained, zero_stage=0)  # what train/main.py hands to export_head
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool
    out = export_head(sd, trained.config, tmp_path / "head", "bfloat16", legacy_bin=False)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["num_hidden_layers"] == 1
    assert cfg["draft_vocab_size"] == 100 and cfg["vocab_size"] == 256 and cfg["torch_dtype"] == "bfloat16"
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 2, 3], "use_aux_hidden_state": True}
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        dtypes = {k: f.get_tensor(k).dtype for k in f.keys()}
    assert "embed_tokens.weight" not in dtypes and dtypes.pop("d2t") == torch.int64 and dtypes.pop("t2d") == torch.bool
    assert set(dtypes) == {"fc.weight", "norm.weight", "lm_head.weight", *(f"midlayer.{m}" for m in (
        "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
        "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
        "hidden_norm.weight", "post_attention_layernorm.weight"))}
    assert set(dtypes.values()) == {torch.bfloat16}
    head = load_head(out, dtype=torch.float32).bind_target(target)
    for k, v in trained.state_dict().items():
        expect = v.to(torch.bfloat16).to(v.dtype) if v.is_floating_point() and k != "embed_tokens.weight" else v
        assert torch.equal(head.state_dict()[k], expect), k
    model = EaModel(target, head)
    for prompt in random_prompts(3, seed=2):
        assert torch.equal(model.eagenerate(prompt, max_new_tokens=10), hf_greedy(target, prompt, 10))
    # the card states the aux layers (and their convention) and the draft vocabulary size
    card_cfg, summary, manifest, report = card_inputs()
    card = model_card(card_cfg, "me/head3", "apache-2.0", summary, manifest, report, [], head_config=cfg)
    assert "# EAGLE-3 draft head for `user/base`" in card and "eagle-3" in card
    assert "| aux layers | `[1, 2, 3]`: HF `output_hidden_states` indices (0 = the embeddings" in card
    assert "| draft vocabulary | 100 of the base model's 256 tokens" in card
    assert '"method": "eagle3"' in card and "no feature loss" in card
