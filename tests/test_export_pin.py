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
