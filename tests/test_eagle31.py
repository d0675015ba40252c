"""EAGLE-3.1's normalisations of the EAGLE-3 head (norm_before_fc, fc_norm, norm_output): the training unroll is the
formula written out step by step (vLLM llama_eagle3.py's order: input_norm over 3H, then one RMSNorm per aux state,
then fc; drafted nodes fed norm(h) with norm_output), the decoder (plain and fast paths) computes the same, every new
weight trains, and the options survive a save / load under the weight and config names vLLM reads."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from eagle.eagle3 import Eagle3Head
from eagle.head import load_head
from eagle.head_config import HeadConfig, head_config_from_target
from eagle.head_kinds import EAGLE31_NORMS, HeadConfigError
from float_tolerance import assert_same_function, float64
from test_head_eagle3 import AUX, STEP_REDUCTIONS, STEP_TERMS, aux_states
from tiny_models import single_thread, tiny_target  # noqa: F401

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.numeric]

VARIANTS = {"norm_before_fc": {"norm_before_fc": True}, "fc_norm": {"fc_norm": True},
            "norm_output": {"norm_output": True}, "all": {k: True for k in EAGLE31_NORMS}}


def head31(target, seed: int = 0, **norms) -> Eagle3Head:
    """A random EAGLE-3 head with the given EAGLE-3.1 options (every norm weight ~1 +- 0.1, so each one matters)."""
    torch.manual_seed(seed)
    config = head_config_from_target(target.config, kind="eagle3", aux_layers=AUX, **norms)
    head = Eagle3Head(config).bind_target(target)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if not name.startswith("embed_tokens"):
                p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    return head.eval()


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


@torch.no_grad()
def reference_chain31(head: Eagle3Head, aux: torch.Tensor, ids: torch.Tensor, t: int, steps: int) -> list[torch.Tensor]:
    """Commit positions 0..t, then draft `steps - 1` nodes, the EAGLE-3.1 way written out (module docstring).
    Returns the output hidden (pre-norm) at t and of each node: [H] each."""
    c, layer, attn = head.config, head.midlayer, head.midlayer.self_attn
    x = aux[: t + 1]
    if c.options.norm_before_fc:
        x = rms(x, head.input_norm.weight, c.rms_norm_eps)
    if c.options.fc_norm:
        x = torch.cat([rms(a, n.weight, c.rms_norm_eps) for a, n in zip(x.chunk(3, -1), head.fc_norm)], -1)
    feat = (x @ head.fc.weight.t())[None]  # [1, t+1, H]
    cos, sin = head.rotary(torch.arange(t + 1)[None], feat.dtype)
    q, K, V = attn.qkv(layer.attn_input(head.embed_tokens(ids[: t + 1])[None], feat), cos, sin)
    out = F.scaled_dot_product_attention(q, K, V, attn_mask=torch.ones(t + 1, t + 1, dtype=torch.bool).tril(),
                                         enable_gqa=True)
    h = layer.finish(feat, attn.o_proj(out.transpose(1, 2).reshape(1, t + 1, -1)))[0, t]
    outs = [h]
    for j in range(2, steps + 1):
        f = rms(h, head.norm.weight, c.rms_norm_eps) if c.options.norm_output else h  # what the node hands its child
        cos, sin = head.rotary(torch.tensor([[t + j - 1]]), feat.dtype)
        q, k, v = attn.qkv(layer.attn_input(head.embed_tokens(ids[t + j - 1 : t + j])[None], f[None, None]), cos, sin)
        K, V = torch.cat([K, k], 2), torch.cat([V, v], 2)
        out = F.scaled_dot_product_attention(q, K, V, enable_gqa=True)
        h = layer.finish(f[None, None], attn.o_proj(out.transpose(1, 2).reshape(1, 1, -1)))[0, 0]
        outs.append(h)
    return outs


@pytest.fixture(scope="module")
def target():
    return tiny_target("llama", num_layers=4, seed=2)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_unroll_is_the_eagle31_formula_and_differs_from_eagle3(target, variant):
    head = head31(target, **VARIANTS[variant])
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(1))
    aux = aux_states(target, ids).detach()
    head64, aux64 = float64(head, aux)
    steps = 4
    with torch.no_grad():
        hs = head64.unroll(aux64, ids, steps=steps)
        plain = Eagle3Head(dataclasses.replace(head.config, options=dataclasses.replace(
            head.config.options, **{k: False for k in EAGLE31_NORMS})))
        plain.load_state_dict({k: v for k, v in head64.state_dict().items() if k in plain.state_dict()})
        hs_plain = plain.double().unroll(aux64, ids, steps=steps)
    for b in range(2):
        for t in (0, 3, 6):
            ref = reference_chain31(head64, aux64[b], ids[b], t, steps)
            for j in range(steps):
                assert_same_function(hs[j][b, t], ref[j], terms=STEP_TERMS, chained=(j + 1) * STEP_REDUCTIONS + 2,
                                     msg=f"b={b} t={t} step {j + 1}")
    # the option changes the function (norm_output only from step 2 on): a test that could not fail otherwise
    first = 1 if variant == "norm_output" else 0
    assert (hs[first] - hs_plain[first]).abs().max() > 1e-3
    if variant == "norm_output":
        assert torch.equal(hs[0], hs_plain[0])


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_decoder_equals_the_unroll(target, variant, fast):
    """The decode path: committed positions through fuse (the norms, fc), drafted nodes fed the decoder's output, which
    is norm(h) with norm_output (then `logits` must not norm it again)."""
    head = head31(target, **VARIANTS[variant])
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(3))
    steps = 4
    with torch.no_grad():
        aux = aux_states(target, ids)
        hs = head.unroll(aux, ids, steps=steps)
        dec = head.decoder(64, fast=fast)
        assert dec.fast == fast
        for t in (0, 9, 17):
            dec.truncate(0)
            out = dec.forward(dec.fuse(aux[0, : t + 1]), ids[0, : t + 1], range(t + 1))
            for j in range(1, steps + 1):
                if j > 1:
                    out = dec.forward(out[-1:], ids[0, t + j - 1 : t + j], t + j - 1)
                want = head.feed(hs[j - 1][0, t])
                assert_same_function(out[-1], want, terms=STEP_TERMS, chained=j * STEP_REDUCTIONS + 2,
                                     magnitude=float(want.abs().max()), msg=f"t={t} step {j}")
                assert_same_function(dec.logits(out[-1:])[0], head.draft_logits(hs[j - 1][0, t]), terms=STEP_TERMS,
                                     chained=j * STEP_REDUCTIONS + 3,
                                     magnitude=float(head.draft_logits(hs[j - 1][0, t]).abs().max()))


def test_every_eagle31_weight_trains(target):
    head = head31(target, **VARIANTS["all"]).train()
    ids = torch.randint(0, 256, (2, 10), generator=torch.Generator().manual_seed(4))
    aux = aux_states(target, ids).detach()
    hs = head.unroll(aux, ids, steps=3)
    sum(head.draft_logits(h).logsumexp(-1).mean() for h in hs).backward()
    names = [n for n, _ in head.named_parameters()]
    assert {"input_norm.weight", "fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"} <= set(names)
    for name, p in head.named_parameters():
        if not name.startswith("embed_tokens"):
            assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_save_and_load_keep_the_options_under_vllms_names(target, tmp_path):
    head = head31(target, **VARIANTS["all"])
    head.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert all(cfg[k] is True for k in EAGLE31_NORMS)
    sd = load_file(tmp_path / "model.safetensors")
    assert sd["input_norm.weight"].shape == (192,) and sd["fc_norm.2.weight"].shape == (64,)
    loaded = load_head(tmp_path).bind_target(target)
    assert all(getattr(loaded.config.options, k) for k in EAGLE31_NORMS)
    for k, v in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    # a plain EAGLE-3 head writes none of the keys (older folders unchanged)
    plain = head31(target)
    plain.save_pretrained(tmp_path / "plain")
    assert not set(EAGLE31_NORMS) & set(json.loads((tmp_path / "plain" / "config.json").read_text()))
    # vLLM's other place for norm_before_fc: eagle_config
    moved = {**cfg, "eagle_config": {**cfg["eagle_config"], "norm_before_fc": True}}
    del moved["norm_before_fc"]
    assert HeadConfig.from_dict(moved).options.norm_before_fc


def test_a_folder_without_its_norm_weights_or_with_unknown_options_is_one_line(target, tmp_path):
    head31(target).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "fc_norm": True}))
    with pytest.raises(HeadConfigError, match=r"missing keys \['fc_norm.0.weight'"):
        load_head(tmp_path)
    with pytest.raises(HeadConfigError, match="norm_before_residual=true"):
        HeadConfig.from_dict({**cfg, "norm_before_residual": True})
    with pytest.raises(HeadConfigError, match=r"fc_norm=True: a setting of an EAGLE-3 head \(kind='eagle3'\)"):
        HeadConfig.from_dict({**head_config_from_target(target.config).to_dict(), "fc_norm": True})


def test_vllm_export_carries_the_options_and_sglang_refuses_them(target, tmp_path):
    from export.engine_formats import EngineFormatError, convert_eagle3_folder

    head = head31(target, **VARIANTS["all"])
    head.save_pretrained(tmp_path / "head")
    out = convert_eagle3_folder(tmp_path / "head", tmp_path / "vllm", "vllm", verifier=str(tmp_path / "target"))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "eagle3" and all(cfg[k] is True for k in EAGLE31_NORMS)
    sd = load_file(out / "model.safetensors")
    assert torch.equal(sd["input_norm.weight"], head.input_norm.weight.detach())
    assert torch.equal(sd["fc_norm.1.weight"], head.fc_norm[1].weight.detach()) and "layers.0.hidden_norm.weight" in sd
    with pytest.raises(EngineFormatError, match=r"^the head uses EAGLE-3.1's norm_before_fc, fc_norm, norm_output, "
                                                r"which SGLang's LlamaForCausalLMEagle3 does not build") as e:
        convert_eagle3_folder(tmp_path / "head", tmp_path / "sglang", "sglang")
    assert "\n" not in str(e.value) and not (tmp_path / "sglang").exists()
    # a plain EAGLE-3 head's vLLM config has none of the keys (vLLM's default: off)
    head31(target).save_pretrained(tmp_path / "plain")
    out = convert_eagle3_folder(tmp_path / "plain", tmp_path / "plain-vllm", "vllm", verifier="t")
    assert not set(EAGLE31_NORMS) & set(json.loads((out / "config.json").read_text()))
