"""The `--format vllm` folders of EAGLE-3.1 and P-EAGLE heads against the layout vLLM 0.32 reads, without vLLM: a
folder written by hand from vLLM's own reader (config keys and weight names, each named below with its file) and our
export of the same head must name the same keys (same values) and the same tensors (same shapes); our side reads the
hand-written folder as that kind (served_kind, check_vllm_method with the kind's speculative config, engine_export).
Against real vLLM: tests/test_vllm_engine.py (slow; EAGLE-3.1 served end to end).

What vLLM 0.32 reads (site-packages/vllm/...):
- transformers_utils/configs/speculators/base.py `SpeculatorsConfig`: `speculators_model_type` (the algorithm),
  `transformer_layer_config` (a dict: the start of the draft's HF config), `speculators_config.proposal_methods[0]
  .speculative_tokens`, `speculators_config.verifier.name_or_path`; "peagle" becomes {"method": "eagle3",
  "parallel_drafting": true} (`build_vllm_speculative_config`).
- transformers_utils/configs/speculators/algos.py `update_eagle3`: top-level `draft_vocab_size`, `target_hidden_size`,
  `norm_before_residual` (default true), `norm_before_fc`, `fc_norm`, `norm_output` (default false),
  `eagle_aux_hidden_state_layer_ids`; `update_peagle`: the same (norm_before_residual default false) plus
  `mask_token_id` (required, -> pard_token), but no `fc_norm` / `norm_output`: a P-EAGLE head with either is refused by
  the vllm export (vLLM 0.32 would drop the keys; its fc_norm weights then have no module to load into).
- model_executor/models/llama_eagle3.py `Eagle3LlamaForCausalLM.load_weights`: `d2t` (renamed
  draft_id_to_target_id, only for a smaller draft vocabulary), `t2d` (skipped), `mask_hidden` ([1, fc_input_size]
  buffer, parallel drafting), `lm_head.weight`, everything else under `model.`: `fc.weight` [H, 3H],
  `input_norm.weight` [3H] (norm_before_fc), `fc_norm.{0,1,2}.weight` [H] (fc_norm), `norm.weight`, and the one
  layer `layers.0.` (`midlayer.` is mapped there) with `hidden_norm` beside Llama's layer weights.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from eagle.eagle3 import Eagle3Head
from eagle.head_config import head_config_from_target, read_head_json
from eagle.head_files import engine_export
from eagle.head_kinds import EAGLE3, PEAGLE
from eagle.peagle import PeagleHead
from export.engine_formats import EngineFormatError
from export.head_kinds import EXPORT, check_vllm_method, served_kind, write_engine_head
from tiny_models import single_thread, tiny_target  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")

AUX, VD = [0, 1, 3], 48
LAYER = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
         "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight", "input_layernorm.weight",
         "hidden_norm.weight", "post_attention_layernorm.weight")


def vllm_layout(c, algorithm: str, norms: dict, mask_token_id: int | None, verifier: str, k: int):
    """(config.json, {weight name: shape}) as vLLM 0.32 reads them (module docstring), from the head's dimensions."""
    H, nh, kv, hd, inter = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.intermediate_size
    config = {"speculators_model_type": algorithm,
              "transformer_layer_config": {"model_type": "llama", "num_hidden_layers": 1, "hidden_size": H,
                                           "intermediate_size": inter, "num_attention_heads": nh,
                                           "num_key_value_heads": kv, "head_dim": hd, "vocab_size": c.vocab_size,
                                           "rms_norm_eps": c.rms_norm_eps},
              "draft_vocab_size": VD, "target_hidden_size": H, "norm_before_residual": False,
              "eagle_aux_hidden_state_layer_ids": AUX,
              "speculators_config": {"proposal_methods": [{"speculative_tokens": k}],
                                     "verifier": {"name_or_path": verifier}},
              **norms}
    shapes = {"fc.weight": (H, 3 * H), "norm.weight": (H,), "lm_head.weight": (VD, H), "d2t": (VD,),
              "t2d": (c.vocab_size,), "layers.0.self_attn.q_proj.weight": (nh * hd, 2 * H),
              "layers.0.self_attn.k_proj.weight": (kv * hd, 2 * H), "layers.0.self_attn.v_proj.weight": (kv * hd, 2 * H),
              "layers.0.self_attn.o_proj.weight": (H, nh * hd), "layers.0.mlp.gate_proj.weight": (inter, H),
              "layers.0.mlp.up_proj.weight": (inter, H), "layers.0.mlp.down_proj.weight": (H, inter),
              "layers.0.input_layernorm.weight": (H,), "layers.0.hidden_norm.weight": (H,),
              "layers.0.post_attention_layernorm.weight": (H,)}
    if norms.get("norm_before_fc"):
        shapes["input_norm.weight"] = (3 * H,)
    if norms.get("fc_norm"):
        shapes.update({f"fc_norm.{i}.weight": (H,) for i in range(3)})
    if mask_token_id is not None:
        config["mask_token_id"] = mask_token_id
        shapes["mask_hidden"] = (1, 3 * H)
    return config, shapes


def flat(d: dict, prefix: str = "") -> dict:
    """{"a.b": value} for nested dicts; a list of dicts by index ("proposal_methods.0.speculative_tokens")."""
    out = {}
    for key, v in d.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{key}."))
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            for i, x in enumerate(v):
                out.update(flat(x, f"{prefix}{key}.{i}."))
        else:
            out[prefix + key] = v
    return out


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", num_layers=4)


def make_head(target, kind, norms: dict):
    torch.manual_seed(0)
    cls = PeagleHead if kind is PEAGLE else Eagle3Head
    config = head_config_from_target(target.config, kind=kind.name, aux_layers=AUX, draft_vocab_size=VD, **norms)
    if kind is PEAGLE:
        kind.with_mask_token(config, 9)
    head = cls(config).bind_target(target)
    head.set_vocab(torch.randperm(config.vocab_size)[:VD].sort().values - torch.arange(VD))
    return head


CASES = {"eagle3.1": (EAGLE3, {"norm_before_fc": True, "fc_norm": True, "norm_output": True}),
         "peagle": (PEAGLE, {}),
         "peagle+norm_before_fc": (PEAGLE, {"norm_before_fc": True})}  # the one EAGLE-3.1 key update_peagle reads


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_vllm_export_is_the_layout_vllm_reads(case, target, tmp_path):
    kind, norms = CASES[case]
    head = make_head(target, kind, norms)
    head.save_pretrained(tmp_path / "head")
    target.save_pretrained(tmp_path / "target")
    out = write_engine_head(tmp_path / "head", tmp_path / "vllm", "vllm", target.config,
                            verifier=str(tmp_path / "target"), num_speculative_tokens=4)
    ours, our_sd = json.loads((out / "config.json").read_text()), load_file(str(out / "model.safetensors"))
    algorithm = EXPORT[kind].speculators_type or EXPORT[kind].vllm_method
    want, shapes = vllm_layout(head.config, algorithm, norms, 9 if kind is PEAGLE else None, str(tmp_path / "target"), 4)

    got = flat(ours)
    assert {key: got.get(key) for key in flat(want)} == flat(want)
    assert {name: tuple(t.shape) for name, t in our_sd.items()} == shapes
    # vLLM's method for the folder (base.py build_vllm_speculative_config) is the kind's speculative config
    assert ({"method": "eagle3", "parallel_drafting": True} if algorithm == "peagle" else {"method": algorithm}) == \
        EXPORT[kind].vllm_spec()

    # the hand-written folder, read by our side as that kind's vLLM export
    hand = tmp_path / "hand"
    hand.mkdir()
    (hand / "config.json").write_text(json.dumps(want))
    g = torch.Generator().manual_seed(1)
    save_file({name: (torch.zeros(s, dtype=torch.long) if name == "d2t" else torch.zeros(s, dtype=torch.bool)
                      if name == "t2d" else torch.randn(s, generator=g)) for name, s in shapes.items()},
              str(hand / "model.safetensors"))
    config = read_head_json(hand)
    assert served_kind(config) is kind
    check_vllm_method(EXPORT[kind].vllm_spec()["method"], config, str(hand), kind is PEAGLE)
    assert engine_export(str(hand / "config.json"), str(hand / "model.safetensors")) == "vLLM"


@pytest.mark.parametrize("norm", ["fc_norm", "norm_output"])
def test_a_peagle_head_with_a_norm_vllm_drops_is_refused(norm, target, tmp_path):
    """update_peagle keeps norm_before_fc only: a P-EAGLE folder with fc_norm / norm_output would be served as another
    function (fc_norm's weights have no module), so the vllm export refuses it in one line naming the key."""
    make_head(target, PEAGLE, {norm: True}).save_pretrained(tmp_path / "head")
    target.save_pretrained(tmp_path / "target")
    with pytest.raises(EngineFormatError, match=rf"EAGLE-3.1's {norm}, which vLLM's speculators `peagle` config drops"):
        write_engine_head(tmp_path / "head", tmp_path / "vllm", "vllm", target.config, verifier=str(tmp_path / "target"))
    assert not (tmp_path / "vllm").exists()
