"""The EAGLE-3 head: config, training-time-test unroll (== decoding a drafted chain), draft vocabulary, errors."""
from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F

from eagle.head import (
    Eagle3Head,
    EagleHead,
    HeadConfig,
    HeadConfigError,
    check_aux_layers,
    head_config_from_target,
    load_head,
)
from eagle.head_kinds import Eagle3Options
from float_tolerance import LAYER_REDUCTIONS, assert_same_function, float64
from tiny_models import assert_unroll_ignores_padding, single_thread, tiny_target  # noqa: F401

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.numeric]  # numeric: tests/float_variants.py
AUX = [1, 2, 3]
# one head step: fc over the 3 aux states, then a decoder layer; its longest reduction is fc's 3H = 192 terms
STEP_REDUCTIONS, STEP_TERMS = 1 + LAYER_REDUCTIONS, 3 * 64


def e3_head(target, seed: int = 0, std: float = 0.2, draft_vocab_size=None, aux=AUX) -> Eagle3Head:
    """A random EAGLE-3 head with weights large enough that every step's output differs visibly."""
    torch.manual_seed(seed)
    head = Eagle3Head.from_target(target, aux_layers=aux, draft_vocab_size=draft_vocab_size)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if not name.startswith("embed_tokens"):
                p.copy_(1 + 0.1 * torch.randn_like(p) if name.endswith("norm.weight") else std * torch.randn_like(p))
    return head.eval()


def aux_states(target, ids: torch.Tensor, aux=AUX, attention_mask=None) -> torch.Tensor:
    """[B, T, 3H]: HF output_hidden_states at the aux ids, concatenated."""
    out = target(ids, attention_mask=attention_mask, output_hidden_states=True)
    return torch.cat([out.hidden_states[i] for i in aux], dim=-1)


@torch.no_grad()
def reference_chain(head: Eagle3Head, aux: torch.Tensor, ids: torch.Tensor, t: int, steps: int) -> list[torch.Tensor]:
    """Slow decoding-time reference for ONE sequence (aux [T, 3H], ids [T]): commit positions 0..t, then draft a chain
    of `steps - 1` nodes (node j reads the previous hidden and token ids[t + j - 1] at position t + j - 1, attends to
    the committed keys and the chain so far). Returns the hidden at t, then each node's hidden: [H] each."""
    layer, attn = head.midlayer, head.midlayer.self_attn
    feat = head.fc(aux[: t + 1])[None]  # [1, t+1, H]
    emb = head.embed_tokens(ids[: t + 1])[None]
    cos, sin = head.rotary(torch.arange(t + 1)[None], feat.dtype)
    q, K, V = attn.qkv(layer.attn_input(emb, feat), cos, sin)
    mask = torch.ones(t + 1, t + 1, dtype=torch.bool).tril()
    out = F.scaled_dot_product_attention(q, K, V, attn_mask=mask, enable_gqa=True)
    h = layer.finish(feat, attn.o_proj(out.transpose(1, 2).reshape(1, t + 1, -1)))[0, t]  # [H]
    outs = [h]
    for j in range(2, steps + 1):
        tok = ids[t + j - 1 : t + j]
        cos, sin = head.rotary(torch.tensor([[t + j - 1]]), feat.dtype)
        q, k, v = attn.qkv(layer.attn_input(head.embed_tokens(tok)[None], h[None, None]), cos, sin)
        K, V = torch.cat([K, k], 2), torch.cat([V, v], 2)
        out = F.scaled_dot_product_attention(q, K, V, enable_gqa=True)  # every key visible
        h = layer.finish(h[None, None], attn.o_proj(out.transpose(1, 2).reshape(1, 1, -1)))[0, 0]
        outs.append(h)
    return outs


@pytest.fixture(scope="module")
def setup():
    target = tiny_target("llama", num_layers=4, seed=2)
    head = e3_head(target)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (3, 12), generator=g)
    return target, head, ids, aux_states(target, ids)


# ----------------------------------------------------------------------------- config
def test_config_from_target_and_released_json_round_trip():
    target = tiny_target("qwen2", num_layers=8)
    c = head_config_from_target(target.config, kind="eagle3", draft_vocab_size=100)
    assert (c.kind, c.options.aux_layers, c.options.draft_vocab_size, c.bias, c.qkv_bias) == ("eagle3", [2, 4, 5], 100,
                                                                                             False, False)
    d = c.to_dict()
    assert d["architectures"] == ["LlamaForCausalLMEagle3"] and d["draft_vocab_size"] == 100
    assert d["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [2, 4, 5], "use_aux_hidden_state": True}
    assert "bias" not in d and "kind" not in d
    assert HeadConfig.from_dict(json.loads(json.dumps(d))) == c
    # an EAGLE-2 config is unchanged by the new fields
    c2 = head_config_from_target(target.config)
    assert c2.kind == "eagle2" and "draft_vocab_size" not in c2.to_dict() and "eagle_config" not in c2.to_dict()


@pytest.mark.parametrize("ids,layers,match", [
    ([1, 2], 5, "exactly 3"),
    ([1, 2, 5], 5, r"\[5\] out of range for a 5-layer target"),
    ([-1, 2, 3], 5, "out of range"),
    ([3, 2, 4], 5, "strictly increasing"),
    ([2, 2, 4], 5, "strictly increasing"),
])
def test_bad_aux_layers_are_one_line_errors(ids, layers, match):
    with pytest.raises(HeadConfigError, match=match) as e:
        check_aux_layers(ids, layers)
    assert "\n" not in str(e.value) and isinstance(e.value, ValueError)


def test_default_aux_layers_that_collapse_ask_for_explicit_ids():
    target = tiny_target("llama", num_layers=5)  # (2, 2, 2): stories260K's case
    with pytest.raises(HeadConfigError, match="set aux_layers explicitly"):
        head_config_from_target(target.config, kind="eagle3")
    assert head_config_from_target(target.config, kind="eagle3", aux_layers=[1, 2, 4]).options.aux_layers == [1, 2, 4]


def test_bad_configs():
    base = dict(hidden_size=16, intermediate_size=32, num_attention_heads=4, num_key_value_heads=2, vocab_size=40)
    with pytest.raises(HeadConfigError, match="kind"):
        HeadConfig(**base, kind="eagle4")
    with pytest.raises(HeadConfigError, match=r"kind='eagle2'\) takes Eagle2Options, not Eagle3Options"):
        HeadConfig(**base, options=Eagle3Options(aux_layers=[1, 2, 3]))
    with pytest.raises(HeadConfigError, match="draft_vocab_size=41"):
        HeadConfig(**base, kind="eagle3", options=Eagle3Options(draft_vocab_size=41))
    with pytest.raises(HeadConfigError, match="kind='eagle3'"):
        Eagle3Head(HeadConfig(**base))


def test_head_does_not_fit_target():
    target = tiny_target("llama", num_layers=4)
    head = e3_head(target)
    with pytest.raises(HeadConfigError, match=r"\[3\] out of range for a 3-layer target"):
        head.bind_target(tiny_target("llama", num_layers=3))
    with pytest.raises(HeadConfigError, match="hidden_size=64 .* hidden_size=32"):
        head.bind_target(tiny_target("llama", num_layers=4, hidden_size=32))
    with pytest.raises(HeadConfigError, match="vocab_size=256 .* vocabulary \\(300\\)"):
        head.bind_target(tiny_target("llama", num_layers=4, vocab_size=300))


# ----------------------------------------------------------------------------- unroll
def test_unroll_shapes(setup):
    target, head, ids, aux = setup
    hs = head.unroll(aux, ids, steps=4)
    assert len(hs) == 4 and all(h.shape == (3, 12, 64) for h in hs)
    assert head.draft_logits(hs[0]).shape == (3, 12, 256)
    sub = head(aux, ids, steps=3, rows=torch.tensor([0, 5, 11]))  # forward = unroll
    assert sub[0].shape == (3, 12, 64) and sub[1].shape == sub[2].shape == (3, 3, 64)
    with pytest.raises(ValueError, match="steps"):
        head.unroll(aux, ids, steps=0)


def test_unroll_step1_is_a_plain_causal_forward(setup):
    """Two code paths of one function: compared in float64, where their rounding differences are ~1e-14."""
    target, head, ids, aux = setup
    head, aux = float64(copy.deepcopy(head), aux)
    with torch.no_grad():
        (h1,) = head.unroll(aux, ids, steps=1)
        for t in (0, 5, 11):
            for b in range(3):
                ref = reference_chain(head, aux[b], ids[b], t, 1)[0]
                assert_same_function(h1[b, t], ref, terms=STEP_TERMS, chained=STEP_REDUCTIONS, msg=f"b={b} t={t}")
        # causal: changing the future does not change the past
        ids2 = ids.clone()
        ids2[:, 8:] = 0
        assert_same_function(head.unroll(aux, ids2, steps=1)[0][:, :8], h1[:, :8], terms=STEP_TERMS,
                             chained=STEP_REDUCTIONS)


def test_unroll_step_j_is_what_decoding_computes_for_a_drafted_chain(setup):
    target, head, ids, aux = setup
    head, aux = float64(copy.deepcopy(head), aux)
    steps = 5
    with torch.no_grad():
        hs = head.unroll(aux, ids, steps=steps)
        rows = torch.tensor([1, 4, 6])
        sub = head.unroll(aux, ids, steps=steps, rows=rows)
    for b in range(3):
        for t in range(12 - steps + 1):
            ref = reference_chain(head, aux[b], ids[b], t, steps)
            for j in range(steps):
                chained = (j + 1) * STEP_REDUCTIONS  # step j + 1 reads step j's output
                assert_same_function(hs[j][b, t], ref[j], terms=STEP_TERMS, chained=chained,
                                     msg=f"b={b} t={t} step {j + 1}")
                if t in rows.tolist() and j:
                    assert_same_function(sub[j][b, rows.tolist().index(t)], ref[j], terms=STEP_TERMS, chained=chained)
    # the steps really differ (a test that could not fail otherwise)
    assert (hs[1][:, :6] - hs[0][:, :6]).abs().max() > 1e-2


@pytest.mark.parametrize("side", ["right", "left"])
def test_unroll_with_padding_equals_the_unpadded_sequence(setup, side):
    target, head, ids, aux = setup
    assert_unroll_ignores_padding(head, ids, aux, side, STEP_TERMS, STEP_REDUCTIONS)


def test_unroll_backward_reaches_every_trained_parameter(setup):
    target, head, ids, aux = setup
    head = e3_head(target).train()
    hs = head.unroll(aux, ids, steps=3)
    sum(head.draft_logits(h).logsumexp(-1).mean() for h in hs).backward()
    for name, p in head.named_parameters():
        if name.startswith("embed_tokens"):
            assert p.grad is None
        else:
            assert p.grad is not None and p.grad.abs().sum() > 0, name


# ----------------------------------------------------------------------------- draft vocabulary
def test_set_vocab_and_map_to_target(setup):
    target, *_ = setup
    head = e3_head(target, draft_vocab_size=4)
    d_ids = torch.tensor([0, 1, 2, 3])
    assert head.map_to_target(d_ids).tolist() == [0, 1, 2, 3]  # the default: the first ids
    tgt = torch.tensor([7, 3, 200, 9])
    head.set_vocab(tgt - d_ids)
    assert head.map_to_target(d_ids).tolist() == [7, 3, 200, 9]
    assert head.t2d.nonzero().flatten().tolist() == [3, 7, 9, 200]
    with pytest.raises(HeadConfigError, match="d2t has 3 entries, draft_vocab_size is 4"):
        head.set_vocab(torch.zeros(3, dtype=torch.long))
    with pytest.raises(HeadConfigError, match="outside the target vocabulary"):
        head.set_vocab(torch.tensor([0, 0, 0, 300]))
    with pytest.raises(HeadConfigError, match="same target id"):
        head.set_vocab(torch.tensor([1, 0, 0, 0]))
    with pytest.raises(HeadConfigError, match="t2d has 10 entries"):
        head.set_vocab(tgt - d_ids, torch.zeros(10, dtype=torch.bool))


def test_save_and_load_round_trip_without_the_embedding(tmp_path, setup):
    target, *_ = setup
    head = e3_head(target, draft_vocab_size=50)
    head.set_vocab(torch.randperm(256, generator=torch.Generator().manual_seed(1))[:50].sort().values - torch.arange(50))
    head.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    sd = load_file(tmp_path / "model.safetensors")
    assert "embed_tokens.weight" not in sd and sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool
    loaded = load_head(tmp_path)
    assert isinstance(loaded, Eagle3Head) and loaded.config == head.config
    loaded.bind_target(target)
    for k, v in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    with pytest.raises(HeadConfigError, match="EAGLE-3 head"):
        EagleHead.from_pretrained(tmp_path)


# ----------------------------------------------------------------------------- released layout
def write_released_folder(path, target, aux=AUX, where="eagle_config", draft_vocab_size=40, seed=0,
                          d2t_len=None, with_t2d=True, fc_in=None):
    """A hand-written folder in the released EAGLE-3 layout (yuhuili/EAGLE3-*, SpecForge): LlamaConfig with
    draft_vocab_size, weights midlayer.* / fc / norm / lm_head / d2t / t2d, NO embed_tokens. Returns its tensors."""
    from safetensors.torch import save_file

    c = target.config
    H, I, nh, nkv, V = c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, c.vocab_size
    D = H // nh
    g = torch.Generator().manual_seed(seed)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.1).to(torch.float16)

    vocab = torch.randperm(V, generator=g)[:draft_vocab_size].sort().values
    d2t = (vocab - torch.arange(draft_vocab_size))[: d2t_len or draft_vocab_size]
    sd = {"fc.weight": w(H, fc_in or 3 * H), "norm.weight": 1 + w(H), "lm_head.weight": w(draft_vocab_size, H),
          "midlayer.self_attn.q_proj.weight": w(nh * D, 2 * H), "midlayer.self_attn.k_proj.weight": w(nkv * D, 2 * H),
          "midlayer.self_attn.v_proj.weight": w(nkv * D, 2 * H), "midlayer.self_attn.o_proj.weight": w(H, nh * D),
          "midlayer.mlp.gate_proj.weight": w(I, H), "midlayer.mlp.up_proj.weight": w(I, H),
          "midlayer.mlp.down_proj.weight": w(H, I), "midlayer.input_layernorm.weight": 1 + w(H),
          "midlayer.hidden_norm.weight": 1 + w(H), "midlayer.post_attention_layernorm.weight": 1 + w(H), "d2t": d2t}
    if with_t2d:
        sd["t2d"] = torch.zeros(V, dtype=torch.bool).index_fill_(0, vocab, True)
    config = {  # a released EAGLE-3 head's config.json
        "architectures": ["LlamaForCausalLMEagle3"], "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu",
        "hidden_size": H, "initializer_range": 0.02, "intermediate_size": I, "max_position_embeddings": 2048,
        "model_type": "llama", "num_attention_heads": nh, "num_hidden_layers": 1, "num_key_value_heads": nkv,
        "pad_token_id": 0, "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000.0,
        "tie_word_embeddings": False, "torch_dtype": "float16", "transformers_version": "4.28.1", "use_cache": True,
        "vocab_size": V, "draft_vocab_size": draft_vocab_size,
    }
    if where == "eagle_config":
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux), "use_aux_hidden_state": True}
    elif where == "top":
        config["eagle_aux_hidden_state_layer_ids"] = list(aux)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file(sd, str(path / "model.safetensors"))
    return sd


@pytest.mark.parametrize("where", ["eagle_config", "top", "absent"])
def test_released_layout_loads_through_eamodel_from_pretrained(tmp_path, where):
    from eagle import EaModel
    from tiny_models import hf_greedy, random_prompts

    layers = 8 if where == "absent" else 4  # absent ids: the target default (2, 4, 5) needs L >= 7
    target = tiny_target("llama", num_layers=layers, seed=4)
    target.save_pretrained(tmp_path / "target")
    sd = write_released_folder(tmp_path / "head", target, where=where)
    model = EaModel.from_pretrained(str(tmp_path / "target"), str(tmp_path / "head"), torch_dtype=torch.float32)
    head = model.ea_layer
    assert isinstance(head, Eagle3Head) and head.config.options.aux_layers == ([2, 4, 5] if where == "absent" else AUX)
    assert model.aux_layers == tuple(head.config.options.aux_layers)
    for k, v in sd.items():
        assert torch.equal(head.state_dict()[k].to(v.dtype), v), k
    assert torch.equal(head.embed_tokens.weight, target.get_input_embeddings().weight)  # the target's
    for prompt in random_prompts(3, seed=5):
        assert torch.equal(model.eagenerate(prompt, max_new_tokens=12), hf_greedy(target, prompt, 12))
    # saved back, it is the same layout (no embed_tokens) and loads to the same head
    head.save_pretrained(tmp_path / "again")
    again = load_head(tmp_path / "again").bind_target(target)
    assert json.loads((tmp_path / "again" / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    for k, v in head.state_dict().items():
        assert torch.equal(again.state_dict()[k], v), k


def test_released_layout_without_t2d_derives_it(tmp_path):
    target = tiny_target("llama", num_layers=4)
    sd = write_released_folder(tmp_path, target, with_t2d=False)
    head = load_head(tmp_path)
    assert int(head.t2d.sum()) == 40 and torch.equal(head.d2t, sd["d2t"])


def misfit_target_and_head(tmp_path, case, head_dir):
    """A 4-layer tiny target's released-layout EAGLE-3 folder at head_dir, broken as `case` says, and the target it
    must not fit saved at tmp_path/target (3 layers or hidden 32 for the target-side cases). Returns that target."""
    target = tiny_target("llama", num_layers=4, seed=4)
    head_target = target
    if case == "too_few_target_layers":
        target = tiny_target("llama", num_layers=3, seed=4)
    elif case == "hidden_size":
        target = tiny_target("llama", num_layers=4, hidden_size=32, seed=4)
    target.save_pretrained(tmp_path / "target")
    kw = {"d2t_length": dict(d2t_len=39, with_t2d=False), "aux_out_of_range": dict(aux=[1, 2, 9]),
          "fc_shape": dict(fc_in=128), "default_aux_collapses": dict(where="absent")}.get(case, {})
    write_released_folder(head_dir, head_target, **kw)
    return target


@pytest.mark.parametrize("case,match", [
    ("too_few_target_layers", r"aux layer id\(s\) \[3\] out of range for a 3-layer target"),
    ("hidden_size", r"hidden_size=64 .* target's hidden_size=32"),
    ("d2t_length", "d2t has 39 entries, draft_vocab_size is 40"),
    ("aux_out_of_range", r"aux layer id\(s\) \[9\] out of range for a 4-layer target"),
    ("fc_shape", r"fc.weight has shape \(64, 128\)"),
    ("default_aux_collapses", r"default does not fit a 4-layer target"),
])
def test_bad_released_folders_are_one_line_errors(tmp_path, case, match):
    from eagle import EaModel

    misfit_target_and_head(tmp_path, case, tmp_path / "head")
    with pytest.raises(HeadConfigError, match=match) as e:
        EaModel.from_pretrained(str(tmp_path / "target"), str(tmp_path / "head"), torch_dtype=torch.float32)
    assert "\n" not in str(e.value)


CLI_FAULTS = [
    ("hidden_size", "hidden_size=64 (fc reads 3 x 64) does not fit the target's hidden_size=32"),
    ("too_few_target_layers", "aux layer id(s) [3] out of range for a 3-layer target"),
    ("d2t_length", "shapes of ['d2t'] (file [(39,)], config [(40,)])"),
    ("aux_out_of_range", "aux layer id(s) [9] out of range for a 4-layer target"),
]


@pytest.mark.parametrize("as_compare_head", [False, True], ids=["head", "compare-head"])
@pytest.mark.parametrize("case,needle", CLI_FAULTS, ids=[c for c, _ in CLI_FAULTS])
def test_evaluation_cli_names_an_eagle3_head_that_does_not_fit(tmp_path, capsys, case, needle, as_compare_head):
    """evaluation/main.py with an EAGLE-3 head (--head, or --compare-head beside a good EAGLE-2 head) that cannot fit
    the target: exit code 2 and ONE stderr line naming the mismatch, before the target's weights load (no loading
    output) and before any report is written."""
    from eagle.head import EagleHead
    from evaluation.main import main
    from fault_helpers import assert_one_line_error, run_cli

    target = misfit_target_and_head(tmp_path, case, tmp_path / "e3")
    args = ["--base", tmp_path / "target", "--head", tmp_path / "e3"]
    if as_compare_head:
        EagleHead(head_config_from_target(target.config)).save_pretrained(tmp_path / "e2")
        args = ["--base", tmp_path / "target", "--head", tmp_path / "e2", "--compare-head", tmp_path / "e3"]
    (tmp_path / "q.txt").write_text("1 2 3\n")
    code, _, err = run_cli(main, [*args, "--questions", tmp_path / "q.txt", "--out", tmp_path / "eval",
                                  "eval.max_new_tokens=4", "target.dtype=float32"], capsys)
    assert_one_line_error(code, err, needle)
    assert not (tmp_path / "eval").exists()


# ----------------------------------------------------------------------------- decode path
@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("family,kwargs", [("llama", {}), ("llama", {"num_heads": 8, "num_kv_heads": 4})])
def test_decoder_commits_and_drafted_chains_equal_the_unroll(family, kwargs, fast):
    """The decode path (commit positions 0..t through fc, then a chain of drafted nodes fed their own hidden) equals
    `unroll`: step 1 at t is the committed hidden, step j the (j-1)-th drafted node."""
    target = tiny_target(family, num_layers=4, seed=2, **kwargs)
    head = e3_head(target)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 256, (1, 30), generator=g)
    steps = 5
    with torch.no_grad():
        aux = aux_states(target, ids)
        hs = head.unroll(aux, ids, steps=steps)
        dec = head.decoder(64, fast=fast)
        assert dec.fast == fast
        for t in (0, 7, 21):
            dec.truncate(0)
            committed = dec.forward(dec.fuse(aux[0, : t + 1]), ids[0, : t + 1], range(t + 1))  # [t + 1, H]
            assert_same_function(committed, hs[0][0, : t + 1], terms=STEP_TERMS, chained=STEP_REDUCTIONS,
                                 magnitude=float(hs[0].abs().max()))
            h = committed[-1:]
            for j in range(2, steps + 1):
                h = dec.forward(h, ids[0, t + j - 1 : t + j], t + j - 1)  # one drafted node
                assert_same_function(h[0], hs[j - 1][0, t], terms=STEP_TERMS, chained=j * STEP_REDUCTIONS,
                                     magnitude=float(hs[j - 1].abs().max()), msg=f"t={t} step {j}")
        assert_same_function(dec.logits(h), head.draft_logits(h), terms=64, chained=2)  # final norm, lm_head


def test_decoder_fast_and_plain_paths_agree_on_a_tree_level():
    target = tiny_target("qwen2", num_layers=4, seed=2)
    head = Eagle3Head(head_config_from_target(target.config, kind="eagle3", aux_layers=AUX))
    head.config.qkv_bias = True  # q/k/v bias through the token table and rolled copies
    head = Eagle3Head(head.config).eval()
    head.bind_target(target)
    with torch.no_grad():
        for p in head.parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn_like(p))
    g = torch.Generator().manual_seed(2)
    k = 6
    f, ids = torch.randn(20, 64, generator=g), torch.randint(0, 256, (20,), generator=g)
    level_f, level_ids = torch.randn(k, 64, generator=g), torch.randint(0, 256, (k,), generator=g)
    mask = torch.cat([torch.ones(k, 20, dtype=torch.bool), torch.eye(k, dtype=torch.bool)], 1)  # [k, 20 + k]
    outs = []
    with torch.no_grad():
        for fast in (False, True):
            dec = head.decoder(32, fast=fast)
            dec.forward(f, ids, range(20))
            outs.append(dec.forward(level_f, level_ids, 20, mask))
            dec.truncate(20)
            assert_same_function(dec.forward(level_f, level_ids, 20, mask), outs[-1], terms=2 * 64,
                                 chained=LAYER_REDUCTIONS)  # rolled back and redone: the same level
    assert_same_function(outs[0], outs[1], terms=2 * 64, chained=LAYER_REDUCTIONS)


def test_decoder_fast_path_in_bfloat16():
    target = tiny_target("llama", num_layers=4, seed=2)
    head = e3_head(target, std=0.05)
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        aux = aux_states(target, ids)
        ref = head.unroll(aux, ids)[0][0]
        dec = head.to(torch.bfloat16).decoder(16)
        assert dec.fast
        out = dec.forward(dec.fuse(aux[0]), ids[0], range(9))
    assert out.dtype == torch.bfloat16
    # bf16 against float32: the bound of bf16's unit roundoff (weights and activations rounded at every step)
    assert_same_function(out, ref, terms=STEP_TERMS, chained=STEP_REDUCTIONS)
