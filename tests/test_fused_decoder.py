"""The fused target forward (eagle/fused_decoder.py) computes what the HF layers compute.

Greedy losslessness of the whole decoder on top of it is pinned by test_lossless_greedy.py (small
targets take the fused path by default); here the forward itself is compared with the HF layer path
on prefill, tree verification (tree mask + position ids) and after KV compaction.
"""
from __future__ import annotations

import pytest
import torch

from eagle.fused_decoder import FUSED_MAX_BYTES, fused_unsupported_reason
from eagle.target import Target
from float_tolerance import LAYER_REDUCTIONS, assert_same_function
from tiny_models import single_thread, tiny_target  # noqa: F401

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.numeric]  # numeric: tests/float_variants.py
# a tiny target's forward: 2 decoder layers + the final norm; the longest reduction is the MLP's 128 terms
TARGET_REDUCTIONS, TARGET_TERMS = 2 * LAYER_REDUCTIONS + 1, 128
ATTENTION_REDUCTIONS = 3  # q.k scores, the softmax sum, weights x V


def same_target_output(actual, expected):
    assert_same_function(actual, expected, terms=TARGET_TERMS, chained=TARGET_REDUCTIONS)


def _tree():
    # root 0; children 1, 2 of the root; 3 under 1; 4 under 3; 5 under 2
    parents = torch.tensor([-1, 0, 0, 1, 3, 2])
    depth = torch.tensor([0, 1, 1, 2, 3, 2])
    mask = torch.eye(6, dtype=torch.bool)
    for i in range(6):
        j = int(parents[i])
        while j >= 0:
            mask[i, j] = True
            j = int(parents[j])
    return depth, mask


@pytest.mark.parametrize("family,kwargs", [
    ("llama", {}),
    ("qwen2", {}),  # q/k/v bias
    ("mistral", {"sliding_window": 5}),  # sliding-window mask on every step
    ("llama", {"num_kv_heads": 4}),  # no GQA
])
def test_fused_matches_hf_layers_on_prefill_tree_and_after_keep(family, kwargs):
    model = tiny_target(family, **kwargs)
    fused, ref = Target(model, capacity=64, fused=True), Target(model, capacity=64, fused=False)
    assert fused.fused is not None and ref.fused is None
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, 256, (1, 9), generator=gen)
    depth, tree_mask = _tree()
    tokens = torch.randint(0, 256, (1, 6), generator=gen)
    outs = []
    for t in (fused, ref):
        t.reset(64)
        a = t.forward(prompt)  # [1, 9, H]
        b = t.forward(tokens, depth + t.length, tree_mask)  # [1, 6, H]
        t.keep(9, torch.tensor([0, 1, 3]))
        c = t.forward(tokens[:, :1])  # one token after the compacted path
        outs.append((a, b, c, t.length))
    for x, y in zip(outs[0][:3], outs[1][:3]):
        same_target_output(x, y)
    assert outs[0][3] == outs[1][3] == 13


def test_fused_is_chosen_for_small_dense_targets_only():
    assert fused_unsupported_reason(tiny_target("llama")) is None
    assert Target(tiny_target("llama"), capacity=8).fused is not None
    mixtral = tiny_target("mixtral")
    assert "MixtralDecoderLayer" in fused_unsupported_reason(mixtral)
    assert Target(mixtral, capacity=8).fused is None
    with pytest.raises(ValueError, match="FusedDecoder cannot run this target"):
        Target(mixtral, capacity=8, fused=True)
    assert FUSED_MAX_BYTES >= 64 * 2**20  # a stories/tiny-scale target always qualifies


def test_fused_refuses_sequence_length_dependent_rope():
    model = tiny_target("llama")
    model.config.rope_parameters = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    assert "dynamic" in fused_unsupported_reason(model)


def test_fused_copy_follows_in_place_weight_updates():
    model = tiny_target("llama")
    target = Target(model, capacity=16)
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(1))
    target.reset(16)
    before = target.forward(ids)
    with torch.no_grad():  # e.g. load_state_dict or an optimiser step
        model.model.layers[0].mlp.up_proj.weight.mul_(1.5)
    target.reset(16)
    after = target.forward(ids)
    assert not torch.allclose(before, after)
    ref = Target(model, capacity=16, fused=False)
    ref.reset(16)
    same_target_output(after, ref.forward(ids))


def test_fused_bf16_target_matches_hf_layers_and_decodes_losslessly_up_to_near_ties():
    """bf16 targets (fast on CPUs with avx512_bf16) take the fused path too. In bf16 a multi-token verification
    forward rounds differently from a one-token step (on any path, HF layers included), so greedy outputs may
    part only where the two best logits are within a few ulps; anything larger would be a real bug."""
    from eagle import EaModel
    from tiny_models import random_head

    model = tiny_target("qwen2").to(torch.bfloat16)
    fused, ref = Target(model, capacity=32, fused=True), Target(model, capacity=32, fused=False)
    ids = torch.randint(0, 256, (1, 7), generator=torch.Generator().manual_seed(3))
    fused.reset(32)
    ref.reset(32)
    same_target_output(fused.forward(ids), ref.forward(ids))  # bf16: its unit roundoff per reduction
    head = random_head(model).to(torch.bfloat16)
    ea = EaModel(model, head)
    assert ea.target.fused is not None
    identical = 0
    for seed in range(10):
        prompt = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(10 + seed))
        a, b = ea.eagenerate(prompt, max_new_tokens=24), ea.naivegenerate(prompt, max_new_tokens=24)
        if torch.equal(a, b):
            identical += 1
            continue
        i = int((a[0] != b[0]).nonzero()[0])  # first divergence: judge it on one full forward of the shared prefix
        with torch.no_grad():
            logits = model(b[:, :i]).logits[0, -1].float()
        ulp = 2.0 ** (torch.floor(torch.log2(logits.abs().max())) - 7)  # bf16 spacing at the top logit
        assert abs(logits[a[0, i]] - logits[b[0, i]]) <= 4 * ulp, f"prompt {seed}: divergence at {i} is not a near-tie"
    assert identical >= 7


def _random_tree(n: int, gen: torch.Generator):
    """A random tree of n nodes (parents precede children): depth [n], ancestor-or-self mask [n, n]."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    depth, mask = [0] * n, torch.eye(n, dtype=torch.bool)
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
        mask[i] |= mask[parents[i]]
    return torch.tensor(depth), mask


@pytest.mark.parametrize("family,kwargs", [("llama", {}), ("mistral", {"sliding_window": 12}),
                                           ("llama", {"num_kv_heads": 8})])
def test_bmm_attention_path_matches_hf_layers(family, kwargs):
    """Prefill and trees of >= BMM_ATTENTION_MIN_ROWS rows on a head_dim-8 target take `bmm_attention`."""
    from eagle.attention import BMM_ATTENTION_MAX_HEAD_DIM, BMM_ATTENTION_MIN_ROWS

    model = tiny_target(family, **{"num_heads": 8, "num_kv_heads": 4, **kwargs})
    assert model.config.hidden_size // model.config.num_attention_heads <= BMM_ATTENTION_MAX_HEAD_DIM
    n = BMM_ATTENTION_MIN_ROWS + 4
    fused, ref = Target(model, capacity=96, fused=True), Target(model, capacity=96, fused=False)
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, 256, (1, 30), generator=gen)
    depth, tree_mask = _random_tree(n, gen)
    tokens = torch.randint(0, 256, (1, n), generator=gen)
    path = tree_mask[-1].nonzero().flatten()  # root .. last node
    outs = []
    for t in (fused, ref):
        t.reset(96)
        a = t.forward(prompt)
        b = t.forward(tokens, depth + t.length, tree_mask)
        t.keep(30, path)
        c = t.forward(tokens[:, :1])
        outs.append((a, b, c))
    for x, y in zip(*outs):
        same_target_output(x, y)


def test_bmm_attention_equals_sdpa_with_gqa_and_a_tree_mask():
    import torch.nn.functional as F

    from eagle.attention import bmm_attention

    gen = torch.Generator().manual_seed(0)
    for h, kv in ((8, 4), (6, 6), (8, 1)):
        q, k, v = torch.randn(1, h, 20, 8, generator=gen), torch.randn(1, kv, 50, 8, generator=gen), torch.randn(1, kv, 50, 8, generator=gen)
        mask = torch.zeros(1, 1, 20, 50)
        _, tree = _random_tree(20, gen)
        mask[0, 0, :, 30:].masked_fill_(~tree, torch.finfo(torch.float32).min)
        out = bmm_attention(q, k, v, mask[0, 0].repeat(h // kv, 1))  # [n, h D]
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=h != kv)  # [1, h, n, D]
        assert_same_function(out, ref[0].transpose(0, 1).reshape(20, h * 8), terms=50, chained=ATTENTION_REDUCTIONS)


def test_kv_cache_keep_compacts_every_layer_in_one_storage():
    from eagle.kv_cache import PreallocatedKVCache

    cache = PreallocatedKVCache(num_layers=3, capacity=10)
    for i, layer in enumerate(cache.layers):  # K = 100 layer + position, V = -K
        k = (100 * i + torch.arange(7.0)).view(1, 1, 7, 1).expand(1, 2, 7, 4)
        layer.update(k, -k)
    assert cache.storage.shape == (3, 2, 1, 2, 10, 4) and cache.length == 7
    cache.keep(3, torch.tensor([0, 2, 3]))  # keep positions 3, 5, 6 at 3, 4, 5
    assert cache.length == 6
    for i, layer in enumerate(cache.layers):
        expect = 100 * i + torch.tensor([0.0, 1, 2, 3, 5, 6])
        assert torch.equal(layer.keys[0, 1, :6, 2], expect) and torch.equal(layer.values[0, 0, :6, 0], -expect)
    with pytest.raises(RuntimeError, match="overflow"):
        cache.layers[0].update(torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4))


@pytest.mark.parametrize("n,mask_kind", [(1, None), (1, "4d"), (1, "2d-bool"), (5, "2d-bool"), (5, "4d"), (5, "2d-float")])
def test_sdpa_attention_equals_sdpa_with_gqa(n, mask_kind):
    """One row: query heads of a kv group folded into one head; several rows: enable_gqa. Same result, any mask form."""
    import torch.nn.functional as F

    from eagle.attention import sdpa_attention

    gen = torch.Generator().manual_seed(n)
    for h, kv in ((8, 4), (6, 6), (8, 1)):
        q = torch.randn(1, h, n, 8, generator=gen)
        k, v = torch.randn(1, kv, 30, 8, generator=gen), torch.randn(1, kv, 30, 8, generator=gen)
        allowed = torch.rand(n, 30, generator=gen) < 0.7
        allowed[:, 0] = True
        mask = {None: None, "2d-bool": allowed, "4d": torch.zeros(1, 1, n, 30).masked_fill_(~allowed, -1e30),
                "2d-float": torch.zeros(n, 30).masked_fill_(~allowed, torch.finfo(torch.float32).min)}[mask_kind]
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=h != kv)  # [1, h, n, D]
        assert_same_function(sdpa_attention(q, k, v, mask), ref[0].transpose(0, 1).reshape(n, h * 8), terms=30,
                             chained=ATTENTION_REDUCTIONS)
