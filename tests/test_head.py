"""The draft head: published equation, official checkpoint format, config from any target."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from torch import nn
from transformers import LlamaConfig, Qwen2Config
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer, Qwen2RotaryEmbedding

from eagle.head import EagleHead, HeadConfig, head_config_from_target, load_target_embedding_and_lm_head
from float_tolerance import LAYER_REDUCTIONS, assert_same_function
from tiny_models import random_head, single_thread, tiny_target  # noqa: F401

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.numeric]  # numeric: tests/float_variants.py
# a head forward: fc over [embedding, feature] (2H = 128 terms, the longest reduction), then one decoder layer
HEAD_TERMS, HEAD_REDUCTIONS = 2 * 64, 1 + LAYER_REDUCTIONS


def same_head_output(actual, expected, msg=""):
    assert_same_function(actual, expected, terms=HEAD_TERMS, chained=HEAD_REDUCTIONS, msg=msg)

LAYER_KEYS = [
    "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight", "layers.0.self_attn.v_proj.weight",
    "layers.0.self_attn.o_proj.weight", "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight",
    "layers.0.mlp.down_proj.weight", "layers.0.post_attention_layernorm.weight",
]
QKV_BIAS_KEYS = ["layers.0.self_attn.q_proj.bias", "layers.0.self_attn.k_proj.bias", "layers.0.self_attn.v_proj.bias"]


def official_keys(fc_bias: bool, qkv_bias: bool = False) -> set[str]:
    keys = {"embed_tokens.weight", "fc.weight", *LAYER_KEYS}
    if fc_bias:
        keys.add("fc.bias")
    if qkv_bias:
        keys.update(QKV_BIAS_KEYS)
    return keys


# ----------------------------------------------------------------------------- config from targets
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_head_config_from_target(family):
    target = tiny_target(family, num_heads=4, num_kv_heads=2, hidden_size=64, intermediate_size=96,
                         sliding_window=32 if family == "mistral" else None)
    c = head_config_from_target(target.config)
    t = target.config
    assert (c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, c.vocab_size) == (
        t.hidden_size, t.intermediate_size, t.num_attention_heads, t.num_key_value_heads, t.vocab_size)
    assert c.head_dim == 16
    assert c.rms_norm_eps == t.rms_norm_eps
    assert c.rope_theta == t.rope_parameters["rope_theta"]
    assert c.qkv_bias == (family == "qwen2")
    assert c.bias is True
    assert head_config_from_target(t, bias=False).bias is False
    head = EagleHead(c)
    assert set(head.state_dict()) == official_keys(True, family == "qwen2")


def test_head_config_keeps_rope_scaling_and_theta():
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=1,
                      vocab_size=100, num_hidden_layers=2, max_position_embeddings=8192, rms_norm_eps=1e-5,
                      rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 8192})
    c = head_config_from_target(cfg)
    assert c.rope_theta == 500000.0 and c.rms_norm_eps == 1e-5 and c.num_key_value_heads == 1
    assert c.rope_scaling["rope_type"] == "llama3" and c.rope_scaling["factor"] == 8.0
    assert c.max_position_embeddings == 8192
    # the scaled inverse frequencies are the target's
    head = EagleHead(c)
    ref = LlamaRotaryEmbedding(cfg)
    assert torch.allclose(head.rotary.inv_freq, ref.inv_freq.float())


def test_config_json_is_an_official_llama_config():
    target = tiny_target("llama")
    d = head_config_from_target(target.config, bias=False).to_dict()
    assert d["num_hidden_layers"] == 1 and d["bias"] is False
    assert d["architectures"] == ["LlamaForCausalLM"]
    lc = LlamaConfig.from_dict(d)  # the reference code reads the head config as a LlamaConfig
    assert (lc.hidden_size, lc.num_attention_heads, lc.num_key_value_heads, lc.vocab_size, lc.num_hidden_layers) == (
        64, 4, 2, 256, 1)
    assert HeadConfig.from_dict(d) == HeadConfig.from_dict(json.loads(json.dumps(d)))


# ----------------------------------------------------------------------------- equation
def reference_forward(head: EagleHead, features, next_ids, layer_cls, rotary_cls, config_cls):
    """Independent implementation: transformers' own decoder layer with input_layernorm removed."""
    c = head.config
    cfg = config_cls(hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                     num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                     head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, vocab_size=c.vocab_size,
                     rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
                     attn_implementation="sdpa", num_hidden_layers=1)
    layer = layer_cls(cfg, layer_idx=0)
    missing, unexpected = layer.load_state_dict(
        {k[len("layers.0."):]: v for k, v in head.state_dict().items() if k.startswith("layers.0.")}, strict=False)
    assert missing == ["input_layernorm.weight"] and not unexpected
    layer.input_layernorm = nn.Identity()
    x = torch.cat([head.embed_tokens(next_ids), features], -1) @ head.fc.weight.T  # embedding FIRST
    if head.fc.bias is not None:
        x = x + head.fc.bias
    T = x.shape[1]
    pos = torch.arange(T)[None]
    cos_sin = rotary_cls(cfg)(x, pos)
    mask = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
    out = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("family,bias", [("llama", True), ("llama", False), ("qwen2", True)])
def test_forward_is_fc_then_one_llama_layer_without_input_layernorm(family, bias):
    target = tiny_target(family)
    head = random_head(target, bias=bias)
    with torch.no_grad():
        for p in head.parameters():  # non-trivial norms and biases
            p.add_(torch.randn_like(p) * 0.05)
        features = torch.randn(2, 9, 64)
        next_ids = torch.randint(0, 256, (2, 9))
        got = head(features, next_ids)
        layer_cls, rotary_cls, cfg_cls = ((LlamaDecoderLayer, LlamaRotaryEmbedding, LlamaConfig) if family == "llama"
                                          else (Qwen2DecoderLayer, Qwen2RotaryEmbedding, Qwen2Config))
        want = reference_forward(head, features, next_ids, layer_cls, rotary_cls, cfg_cls)
    same_head_output(got, want)


def test_forward_is_causal_and_ignores_padding():
    head = random_head(tiny_target("llama"))
    g = torch.Generator().manual_seed(0)
    f = torch.randn(1, 10, 64, generator=g)
    ids = torch.randint(0, 256, (1, 10), generator=g)
    with torch.no_grad():
        full = head(f, ids)
        f2, ids2 = f.clone(), ids.clone()
        f2[:, 6:] += 1.0
        ids2[:, 6:] = (ids2[:, 6:] + 1) % 256
        same_head_output(head(f2, ids2)[:, :6], full[:, :6], "future leaks")
        # right padding
        pad_f = torch.cat([f, torch.randn(1, 4, 64)], 1)
        pad_ids = torch.cat([ids, torch.zeros(1, 4, dtype=torch.long)], 1)
        am = torch.tensor([[1] * 10 + [0] * 4])
        same_head_output(head(pad_f, pad_ids, am)[:, :10], full, "right padding")
        # left padding (positions restart at the first real token)
        lf = torch.cat([torch.randn(1, 3, 64), f], 1)
        lids = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], 1)
        lam = torch.tensor([[0] * 3 + [1] * 10])
        same_head_output(head(lf, lids, lam)[:, 3:], full, "left padding")


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("family,kwargs", [("llama", {}), ("qwen2", {}),  # qwen2: q/k/v bias (rolled copies)
                                           ("llama", {"num_heads": 8, "num_kv_heads": 4})])  # head_dim 8
def test_head_decoder_matches_the_training_forward(family, kwargs, fast):
    """What drafting computes (chunks through the head's KV cache; positions as a tensor, a range and an int;
    a prefix longer than the fast path's first scratch allocation) equals the causal training forward."""
    head = random_head(tiny_target(family, **kwargs))
    g = torch.Generator().manual_seed(1)
    T = 80
    f = torch.randn(1, T, 64, generator=g)
    ids = torch.randint(0, 256, (1, T), generator=g)
    with torch.no_grad():
        full = head(f, ids)
        dec = head.decoder(96, fast=fast)
        assert dec.fast == fast
        outs = [dec.forward(f[0, :70], ids[0, :70], torch.arange(70)),
                dec.forward(f[0, 70:71], ids[0, 70:71], 70),
                dec.forward(f[0, 71:79], ids[0, 71:79], range(71, 79)),
                dec.forward(f[0, 79:], ids[0, 79:], torch.tensor([79]))]
    same_head_output(torch.cat(outs)[None], full)


@pytest.mark.parametrize("k,kwargs", [(3, {}), (10, {"num_heads": 8, "num_kv_heads": 4})])
def test_head_decoder_fast_and_plain_paths_agree_on_a_tree_level(k, kwargs):
    """A draft-tree level: k rows at ONE shared position, each seeing the prefix and its own ancestors."""
    head = random_head(tiny_target("llama", **kwargs))
    g = torch.Generator().manual_seed(2)
    f, ids = torch.randn(20, 64, generator=g), torch.randint(0, 256, (20,), generator=g)
    level_f, level_ids = torch.randn(k, 64, generator=g), torch.randint(0, 256, (k,), generator=g)
    mask = torch.cat([torch.ones(k, 20, dtype=torch.bool), torch.eye(k, dtype=torch.bool)], 1)  # [k, 20 + k]
    outs = []
    with torch.no_grad():
        for fast in (False, True):
            dec = head.decoder(32, fast=fast)
            dec.forward(f, ids, range(20))
            outs.append(dec.forward(level_f, level_ids, 20, mask))
            assert dec.length == 20 + k
            additive = torch.zeros(k, 20 + k).masked_fill_(~mask, torch.finfo(torch.float32).min)
            dec.truncate(20)  # the same level with an additive mask (what draft_dynamic passes)
            same_head_output(dec.forward(level_f, level_ids, 20, additive), outs[-1], "additive mask")
            dec.truncate(20)  # the level is rolled back; the prefix stays
            same_head_output(dec.forward(level_f, level_ids, 20, mask), outs[-1], "rolled back")
    same_head_output(outs[0], outs[1], "fast vs plain")


def test_head_decoder_overflow_is_a_clear_error():
    head = random_head(tiny_target("llama"))
    dec = head.decoder(4)
    with torch.no_grad(), pytest.raises(RuntimeError, match="draft KV cache overflow: 5 positions > capacity 4"):
        dec.forward(torch.randn(5, 64), torch.zeros(5, dtype=torch.long), range(5))


def test_drafter_retakes_the_head_weights_every_generation():
    """Weights trained between two generations (even through `.data`, which skips version counters) are used."""
    from eagle.draft import Drafter

    target = tiny_target("llama")
    head = random_head(target)
    drafter = Drafter(head, target.get_output_embeddings(), capacity=16)
    f, ids = torch.randn(1, 6, 64), torch.randint(0, 256, (1, 6))
    with torch.no_grad():
        drafter.reset(16)
        assert drafter.decoder.fast
        before = drafter.decoder.forward(f[0], ids[0], range(6))
        head.layers[0].mlp.up_proj.weight.data.mul_(2.0)
        drafter.reset(16)
        after = drafter.decoder.forward(f[0], ids[0], range(6))
        assert not torch.allclose(before, after, atol=1e-4)
        same_head_output(after, head(f, ids)[0])


# ----------------------------------------------------------------------------- checkpoints
def assert_same_head(a: EagleHead, b: EagleHead):
    sa, sb = a.state_dict(), b.state_dict()
    assert set(sa) == set(sb)
    for k in sa:
        assert torch.equal(sa[k], sb[k].to(sa[k].dtype)), k
    da, db = a.config.to_dict(), b.config.to_dict()
    da.pop("torch_dtype"), db.pop("torch_dtype")
    assert da == db


@pytest.mark.parametrize("family,bias", [("llama", True), ("llama", False), ("qwen2", True)])
def test_safetensors_round_trip(tmp_path, family, bias):
    head = random_head(tiny_target(family), bias=bias, seed=3)
    head.save_pretrained(tmp_path)
    assert (tmp_path / "config.json").exists() and (tmp_path / "model.safetensors").exists()
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        assert set(f.keys()) == official_keys(bias, family == "qwen2")
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["bias"] is bias
    loaded = EagleHead.from_pretrained(tmp_path)
    assert_same_head(head, loaded)
    x, ids = torch.randn(1, 5, 64), torch.randint(0, 256, (1, 5))
    with torch.no_grad():
        assert torch.equal(head(x, ids), loaded(x, ids))


def test_legacy_pytorch_model_bin_round_trip(tmp_path):
    head = random_head(tiny_target("qwen2"), seed=4)
    head.save_pretrained(tmp_path, legacy_bin=True)
    (tmp_path / "model.safetensors").unlink()
    assert_same_head(head, EagleHead.from_pretrained(tmp_path))


class _Exploit:
    def __reduce__(self):
        return (exec, ("import pathlib; pathlib.Path(__import__('os').environ['EXPLOIT_MARK']).write_text('pwned')",))


def test_legacy_bin_is_loaded_with_weights_only(tmp_path, monkeypatch):
    head = random_head(tiny_target("llama"), seed=4)
    head.save_pretrained(tmp_path, legacy_bin=True)
    (tmp_path / "model.safetensors").unlink()
    mark = tmp_path / "mark"
    monkeypatch.setenv("EXPLOIT_MARK", str(mark))
    torch.save({**head.state_dict(), "extra": _Exploit()}, tmp_path / "pytorch_model.bin")
    with pytest.raises(Exception):
        EagleHead.from_pretrained(tmp_path)
    assert not mark.exists(), "unpickling executed code: load with torch.load(weights_only=True)"


def write_official_folder(path, *, bias_key, fc_bias, qkv_bias=False, dtype=torch.float16, extra_keys=None):
    """A head folder as the released yuhuili/EAGLE-* heads lay it out, written by hand."""
    H, I, V, nh, nkv = 64, 160, 300, 4, 2
    D = H // nh
    g = torch.Generator().manual_seed(7)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.05).to(dtype)

    sd = {
        "embed_tokens.weight": w(V, H),
        "fc.weight": w(H, 2 * H),
        "layers.0.self_attn.q_proj.weight": w(nh * D, H),
        "layers.0.self_attn.k_proj.weight": w(nkv * D, H),
        "layers.0.self_attn.v_proj.weight": w(nkv * D, H),
        "layers.0.self_attn.o_proj.weight": w(H, nh * D),
        "layers.0.mlp.gate_proj.weight": w(I, H),
        "layers.0.mlp.up_proj.weight": w(I, H),
        "layers.0.mlp.down_proj.weight": w(H, I),
        "layers.0.post_attention_layernorm.weight": (1 + w(H)).to(dtype),
    }
    if fc_bias:
        sd["fc.bias"] = w(H)
    if qkv_bias:
        sd.update({"layers.0.self_attn.q_proj.bias": w(nh * D), "layers.0.self_attn.k_proj.bias": w(nkv * D),
                   "layers.0.self_attn.v_proj.bias": w(nkv * D)})
    sd.update(extra_keys or {})
    config = {  # keys of a released head's config.json (LlamaConfig, transformers 4.28 era)
        "architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
        "hidden_size": H, "initializer_range": 0.02, "intermediate_size": I, "max_position_embeddings": 2048,
        "model_type": "llama", "num_attention_heads": nh, "num_hidden_layers": 1, "num_key_value_heads": nkv,
        "pad_token_id": 0, "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 500000.0,
        "tie_word_embeddings": False, "torch_dtype": "float16", "transformers_version": "4.28.1", "use_cache": True,
        "vocab_size": V,
    }
    if bias_key is not None:
        config["bias"] = bias_key
    if qkv_bias:
        config["qkv_bias"] = True
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return sd, config


@pytest.mark.parametrize("layout", ["llama3_bias_false", "vicuna_no_bias_key", "qwen2_qkv_bias"])
@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_official_layout_loads_strictly(tmp_path, layout, fmt):
    kw = {"llama3_bias_false": dict(bias_key=False, fc_bias=False),
          "vicuna_no_bias_key": dict(bias_key=None, fc_bias=True),  # no "bias" key => fc.bias present
          "qwen2_qkv_bias": dict(bias_key=None, fc_bias=True, qkv_bias=True)}[layout]
    sd, config = write_official_folder(tmp_path, **kw)
    if fmt == "safetensors":
        save_file(sd, str(tmp_path / "model.safetensors"))
    else:
        torch.save(sd, tmp_path / "pytorch_model.bin")
    head = EagleHead.from_pretrained(tmp_path)
    own = head.state_dict()
    assert set(own) == set(sd)
    for k, v in sd.items():
        assert torch.equal(own[k].to(v.dtype), v), k
    c = head.config
    assert (c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, c.vocab_size) == (
        64, 160, 4, 2, 300)
    assert c.rope_theta == 500000.0 and c.rms_norm_eps == 1e-5 and c.bias == kw["fc_bias"]
    assert c.qkv_bias == kw.get("qkv_bias", False)
    assert EagleHead.from_pretrained(tmp_path, dtype=torch.float16).dtype == torch.float16
    head32 = EagleHead.from_pretrained(tmp_path, dtype=torch.float32)
    assert head32.dtype == torch.float32 and torch.equal(head32.fc.weight, sd["fc.weight"].float())
    with torch.no_grad():
        out = head32(torch.randn(1, 4, 64), torch.randint(0, 300, (1, 4)))
    assert out.shape == (1, 4, 64) and torch.isfinite(out).all()
    # and it saves back in the same layout (our exports load in the reference code)
    head.save_pretrained(tmp_path / "again")
    again = json.loads((tmp_path / "again" / "config.json").read_text())
    assert again["bias"] == kw["fc_bias"] and again["num_hidden_layers"] == 1
    assert_same_head(head, EagleHead.from_pretrained(tmp_path / "again"))


@pytest.mark.parametrize("case,match", [
    ("bias_false_but_fc_bias", r"fc\.bias"),
    ("bias_key_missing_no_fc_bias", r"fc\.bias"),
    ("unexpected_key", r"layers\.0\.input_layernorm\.weight"),
    ("missing_key", r"layers\.0\.mlp\.up_proj\.weight"),
    ("wrong_shape", r"fc\.weight"),
])
def test_mismatched_checkpoints_fail_naming_the_key(tmp_path, case, match):
    if case == "bias_false_but_fc_bias":
        sd, _ = write_official_folder(tmp_path, bias_key=False, fc_bias=True)
    elif case == "bias_key_missing_no_fc_bias":
        sd, _ = write_official_folder(tmp_path, bias_key=None, fc_bias=False)
    elif case == "unexpected_key":
        sd, _ = write_official_folder(tmp_path, bias_key=False, fc_bias=False,
                                      extra_keys={"layers.0.input_layernorm.weight": torch.ones(64, dtype=torch.float16)})
    elif case == "missing_key":
        sd, _ = write_official_folder(tmp_path, bias_key=False, fc_bias=False)
        del sd["layers.0.mlp.up_proj.weight"]
    else:
        sd, _ = write_official_folder(tmp_path, bias_key=False, fc_bias=False)
        sd["fc.weight"] = torch.zeros(64, 100, dtype=torch.float16)
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=match):
        EagleHead.from_pretrained(tmp_path)


def test_head_config_with_more_than_one_layer_is_refused(tmp_path):
    sd, config = write_official_folder(tmp_path, bias_key=False, fc_bias=False)
    config["num_hidden_layers"] = 2
    (tmp_path / "config.json").write_text(json.dumps(config))
    save_file(sd, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="num_hidden_layers"):
        EagleHead.from_pretrained(tmp_path)


def test_missing_head_files_and_unreachable_hub_id_are_clear_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        EagleHead.from_pretrained(tmp_path / "empty")
    write_official_folder(tmp_path / "noweights", bias_key=False, fc_bias=False)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        EagleHead.from_pretrained(tmp_path / "noweights")
    with pytest.raises(OSError, match="no-such-user/EAGLE-nothing"):  # offline here: the hub path must say what it tried
        EagleHead.from_pretrained("no-such-user/EAGLE-nothing")


# ----------------------------------------------------------------------------- target tensors
@pytest.mark.parametrize("tied", [False, True])
def test_load_target_embedding_and_lm_head_reads_only_those(tmp_path, tied):
    target = tiny_target("llama", tie_word_embeddings=tied)
    target.save_pretrained(tmp_path)
    emb, lm = load_target_embedding_and_lm_head(tmp_path)
    assert torch.equal(emb, target.get_input_embeddings().weight)
    assert torch.equal(lm, target.get_output_embeddings().weight)
    if not tied:
        assert not torch.equal(emb, lm)


# ----------------------------------------------------------------------------- inference-time fast paths
def test_no_grad_forward_sees_weight_updates_made_through_data():
    """The no-grad (drafting) path must use the CURRENT weights, however they were updated. `.data.copy_`
    (EMA, checkpoint averaging, DeepSpeed flat buffers) does not bump a parameter's version counter."""
    head = random_head(tiny_target("llama"))
    f, ids = torch.randn(1, 6, 64), torch.randint(0, 256, (1, 6))
    with torch.no_grad():
        head(f, ids)  # first no-grad call (builds any inference-time cache)
    for lin in (head.layers[0].self_attn.q_proj, head.layers[0].self_attn.v_proj, head.layers[0].mlp.up_proj):
        lin.weight.data.copy_(torch.randn_like(lin.weight) * 0.3)
    with torch.no_grad():
        fast = head(f, ids)
    slow = head(f, ids).detach()  # grad-enabled path: plain per-projection matmuls
    same_head_output(fast, slow, "stale weights in the no-grad path")


def test_head_built_and_run_under_inference_mode():
    """Serving code often wraps loading AND generation in torch.inference_mode()."""
    with torch.inference_mode():
        head = random_head(tiny_target("llama"))
        out = head(torch.randn(1, 5, 64), torch.randint(0, 256, (1, 5)))
        out2 = head.decoder(16).forward(torch.randn(5, 64), torch.randint(0, 256, (5,)), torch.arange(5))
    assert out.shape == (1, 5, 64) and out2.shape == (5, 64)


def test_training_after_an_inference_mode_forward():
    """Cached tables (rotary) built under inference_mode must not poison a later training step."""
    head = random_head(tiny_target("llama")).train()
    f, ids = torch.randn(1, 7, 64), torch.randint(0, 256, (1, 7))
    with torch.inference_mode():
        head(f, ids)
    loss = head(f, ids).pow(2).mean()
    loss.backward()
    assert head.fc.weight.grad is not None and torch.isfinite(head.fc.weight.grad).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_rolled_rotary_are_bit_identical_to_hf(dtype):
    """The decode paths' fewer-op forms compute exactly what HF's LlamaRMSNorm and rotate_half compute."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from eagle.head import rms_norm, rotate_half, rotate_rolled, signed_sin

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 17, 64, generator=gen).to(dtype)
    ref = LlamaRMSNorm(64, eps=1e-5).to(dtype)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(64, generator=gen))
        assert torch.equal(rms_norm(x, ref.weight, 1e-5), ref(x))
    q = torch.randn(1, 6, 17, 8, generator=gen).to(dtype)
    cos, sin = torch.randn(17, 8, generator=gen).to(dtype), torch.randn(17, 8, generator=gen).to(dtype)
    assert torch.equal(rotate_rolled(q, cos, signed_sin(sin)), q * cos + rotate_half(q) * sin)


def test_rotary_rows_from_a_tensor_a_range_or_one_position_agree():
    head = random_head(tiny_target("llama"))
    cos, sin = head.rotary.tables(40, torch.device("cpu"), torch.float32)
    a = head.rotary.at(torch.tensor([5, 6, 7]), torch.device("cpu"), torch.float32)
    b = head.rotary.at(range(5, 8), torch.device("cpu"), torch.float32)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    c, s = head.rotary.at(9, torch.device("cpu"), torch.float32)
    assert c.shape == (1, head.config.head_dim) and torch.equal(c[0], cos[9])
    assert torch.equal(s, head.rotary.at(torch.tensor([9]), torch.device("cpu"), torch.float32)[1])
    big = head.rotary.at(range(1000, 1002), torch.device("cpu"), torch.float32)[0]  # grows the table
    assert big.shape == (2, head.config.head_dim)


def test_head_decoder_fast_path_in_bfloat16():
    """bf16 heads: the folded / rolled copies are rounded once from float32, the norm accumulates in float32."""
    head = random_head(tiny_target("llama"))
    f, ids = torch.randn(1, 9, 64), torch.randint(0, 256, (1, 9))
    with torch.no_grad():
        ref = head(f, ids)[0]
        head16 = head.to(torch.bfloat16)
        dec = head16.decoder(16)
        assert dec.fast
        out = dec.forward(f[0], ids[0], range(9))
    assert out.dtype == torch.bfloat16
    same_head_output(out, ref)  # bf16 vs float32: bf16's unit roundoff per step (float_tolerance.rounding_bound)


def test_head_decoder_follows_the_head_to_another_dtype():
    """A decoder built for a float32 head re-allocates its buffers when the head is cast between generations."""
    head = random_head(tiny_target("llama"))
    dec = head.decoder(16)
    head.to(torch.bfloat16)
    with torch.no_grad():
        dec.reset(16)
        out = dec.forward(torch.randn(3, 64), torch.randint(0, 256, (3,)), range(3))
    assert out.dtype == torch.bfloat16 and dec.capacity == 16
