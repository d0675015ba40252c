"""head.sliding_window (eagle/sliding_window.py): one rule, q - W < p <= q, shared by training and decoding.

- the rule itself, and the blocked training attention equal to a dense mask built from it (padding both sides);
- a window covering the whole sequence is full attention; a short one changes the function;
- training equals decoding for every kind: the unrolled step j at t (EAGLE-2 alignment, EAGLE-3's training-time
  test, P-EAGLE's mask rows) equals the decoder's drafted node / mask row with the window on the slots' positions,
  windows shorter than the chain included (depth eats into the window);
- greedy decoding with a windowed head of every kind is token-identical to the target's greedy generation;
- the window in the head config (saved, reloaded, one-line errors) and in the recipe.
"""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from eagle import DecodingConfig, EaModel
from eagle.head_config import HeadConfig
from eagle.head_kinds import HeadConfigError, N_AUX_LAYERS
from eagle.parallel_draft import ParallelDrafter
from eagle.sliding_window import SlidingWindowOptions, visible, window_size, windowed_attention
from float_tolerance import assert_same_function
from tiny_models import enlarge_weights, hf_greedy, random_head, random_prompts, single_thread, tiny_target  # noqa: F401

pytestmark = [pytest.mark.usefixtures("single_thread")]
STEP_TERMS, STEP_REDUCTIONS = 128, 6


def windowed(head, size: int | None):
    head.config.options.sliding_window = None if size is None else SlidingWindowOptions(size=size)
    return head


def test_the_rule():
    q, p = torch.tensor([[5]]), torch.arange(8)[None]
    assert visible(q, p, 3).tolist() == [[False, False, False, True, True, True, False, False]]
    assert visible(q, p, 1).tolist()[0] == [i == 5 for i in range(8)]


@pytest.mark.parametrize("side", [None, "right", "left"])
def test_blocked_training_attention_equals_the_dense_rule(side):
    g = torch.Generator().manual_seed(0)
    B, h, kv, T, D, W = 2, 4, 2, 70, 8, 9
    q, k, v = (torch.randn(B, n, T, D, generator=g, dtype=torch.float64) for n in (h, kv, kv))
    real = None
    if side is not None:
        real = torch.ones(B, T, dtype=torch.bool)
        real[1, 50:] = False if side == "right" else True
        if side == "left":
            real[1, :13] = False
    pos = torch.arange(T)[None] if real is None else (real.long().cumsum(-1) - 1).clamp(min=0)
    idx = torch.arange(T)
    dense = visible(pos[:, :, None], pos[:, None, :], W) & (idx[None, :] <= idx[:, None])
    if real is not None:
        dense = dense & real[:, None, :] | torch.eye(T, dtype=torch.bool)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense[:, None], enable_gqa=True)
    got = windowed_attention(q, k, v, pos, real, W, block=16)  # 5 blocks, each against W + 16 keys
    rows = slice(None) if real is None else real[:, None, :, None].expand_as(got)  # a pad row's output is unused
    assert torch.allclose(got[rows], ref[rows], atol=1e-12)


def sequence(T: int = 30, width: int = 64, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (1, T), generator=g), torch.randn(1, T, width, generator=g)


@pytest.mark.parametrize("kind", ["eagle2", "eagle3", "peagle"])
def test_a_window_covering_the_sequence_is_full_attention_and_a_short_one_is_not(kind):
    target = tiny_target("llama", num_layers=4, seed=2)
    head = enlarge_weights(random_head(target, kind=kind, aux_layers=[1, 2, 3]), 0.2)
    width = 64 if kind == "eagle2" else N_AUX_LAYERS * 64
    ids, feats = sequence(width=width)
    am = torch.ones(1, 30, dtype=torch.long)
    am[0, 25:] = 0
    with torch.no_grad():
        for mask in (None, am):
            full = head.unroll(feats, ids, mask, steps=4)
            wide = windowed(head, 30 + 4).unroll(feats, ids, mask, steps=4)
            short = windowed(head, 3).unroll(feats, ids, mask, steps=4)
            windowed(head, None)
            for a, b, c in zip(full, wide, short):
                assert_same_function(b, a, terms=STEP_TERMS, chained=4 * STEP_REDUCTIONS, magnitude=float(a.abs().max()))
                assert (c[:, 10:20] - a[:, 10:20]).abs().max() > 1e-3


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("kind", ["eagle2", "eagle3"])
@pytest.mark.parametrize("size", [1, 3, 8])
def test_training_steps_equal_the_decoders_drafted_chain(kind, size, fast):
    """Commit 0..t, draft a chain fed its own outputs: drafted node j-1 == unrolled step j at t, windows shorter than
    the chain included (then step j sees none of the committed keys: only its ancestors within W)."""
    target = tiny_target("llama", num_layers=4, seed=2, num_heads=8, num_kv_heads=4)
    head = windowed(enlarge_weights(random_head(target, kind=kind, aux_layers=[1, 2, 3]), 0.2), size)
    ids, feats = sequence(width=64 if kind == "eagle2" else N_AUX_LAYERS * 64)
    steps, rows = 5, torch.tensor([2, 7, 21])
    with torch.no_grad():
        hs = head.unroll(feats, ids, steps=steps)
        sub = head.unroll(feats, ids, steps=steps, rows=rows)
        dec = head.decoder(64, fast=fast)
        assert dec.window == size
        for t in (0, 7, 21):
            dec.truncate(0)
            committed = dec.forward(dec.fuse(feats[0, : t + 1]), ids[0, : t + 1], range(t + 1))
            assert_same_function(committed, hs[0][0, : t + 1], terms=STEP_TERMS, chained=STEP_REDUCTIONS,
                                 magnitude=float(hs[0].abs().max()))
            h = committed[-1:]
            for j in range(2, steps + 1):
                feed = head.feed(h) if kind != "eagle2" and head.config.options.norm_output else h
                h = dec.forward(feed, ids[0, t + j - 1 : t + j], t + j - 1)
                mag = float(hs[j - 1].abs().max())
                assert_same_function(h[0], hs[j - 1][0, t], terms=STEP_TERMS, chained=j * STEP_REDUCTIONS,
                                     magnitude=mag, msg=f"t={t} step {j}")
                if t in rows.tolist():
                    assert_same_function(sub[j - 1][0, rows.tolist().index(t)], hs[j - 1][0, t], terms=STEP_TERMS,
                                         chained=j * STEP_REDUCTIONS, magnitude=mag)


@pytest.mark.parametrize("size", [2, 6])
def test_peagle_mask_rows_equal_the_unroll_under_a_window(size):
    target = tiny_target("llama", num_layers=4, seed=2)
    head = windowed(enlarge_weights(random_head(target, kind="peagle", aux_layers=[1, 2, 3]), 0.2), size)
    ids, aux = sequence(T=14, width=N_AUX_LAYERS * 64)
    k = 5
    with torch.no_grad():
        hs = head.unroll(aux, ids, steps=k)
        drafter = ParallelDrafter(head, None, 64)
        drafter.reset(64)
        for t in (0, 5, 11):
            drafter.decoder.truncate(0)
            drafter.extend(aux[:, : t + 1], ids[:, : t + 1])
            out = drafter.outputs(k)
            for j in range(k):
                assert_same_function(out[j], hs[j][0, t], terms=STEP_TERMS, chained=2 * STEP_REDUCTIONS,
                                     magnitude=float(hs[j].abs().max()), msg=f"t={t} position {j + 1}")


@pytest.mark.parametrize("kind", ["eagle2", "eagle3", "peagle"])
@pytest.mark.parametrize("decoding", [DecodingConfig(mode="dynamic", total_token=24, depth=5, top_k=4),
                                      DecodingConfig(mode="chain", chain_length=5)], ids=["dyn24-5-4", "chain5"])
def test_greedy_decoding_with_a_windowed_head_is_the_targets_greedy(kind, decoding):
    target = tiny_target("llama", num_layers=4, seed=1)
    head = windowed(enlarge_weights(random_head(target, kind=kind, aux_layers=[1, 2, 3]), 0.05), 4)
    model = EaModel(target, head, decoding=decoding)
    for p in random_prompts(4, min_len=6, max_len=20, seed=5):
        out = model.eagenerate(p, max_new_tokens=20, max_length=p.shape[1] + 21)
        assert torch.equal(out, hf_greedy(target, p, 20)), f"{kind}: windowed head changed the output"


@pytest.mark.parametrize("kind", ["eagle2", "eagle3", "peagle"])
def test_the_window_is_saved_in_the_head_config(kind, tmp_path):
    target = tiny_target("llama", num_layers=4, seed=2)
    head = windowed(random_head(target, kind=kind, aux_layers=[1, 2, 3]), 16)
    d = head.config.to_dict()
    assert d["sliding_window"] == 16 and d["layer_types"] == ["sliding_attention"]
    back = HeadConfig.from_dict(json.loads(json.dumps(d)))
    assert window_size(back.options) == 16 and back.to_dict() == d
    head.save_pretrained(tmp_path / "h")
    again = type(head).from_pretrained(tmp_path / "h")
    assert window_size(again.config.options) == 16
    assert "sliding_window" not in windowed(head, None).config.to_dict()  # full attention: older heads unchanged


def test_a_config_that_turns_the_window_off_is_full_attention_and_kept():
    target = tiny_target("llama", seed=2)
    d = random_head(target).config.to_dict()
    d.update(sliding_window=4096, use_sliding_window=False)  # what a Qwen2-derived config carries
    back = HeadConfig.from_dict(d)
    assert back.options.sliding_window is None and back.to_dict()["use_sliding_window"] is False


@pytest.mark.parametrize("size", [0, -3, True])
def test_a_bad_window_is_a_one_line_error(size):
    d = random_head(tiny_target("llama", seed=2)).config.to_dict()
    d.update(sliding_window=size)
    with pytest.raises(HeadConfigError, match="sliding_window") as e:
        HeadConfig.from_dict(d)
    assert "\n" not in str(e.value)


def test_recipe_key():
    from recipes import RecipeError, load_config
    from recipes.head import head_options

    cfg = load_config("tiny", ["head.sliding_window.size=32"])
    assert window_size(head_options(cfg.head)) == 32
    assert head_options(load_config("tiny", [])).sliding_window is None
    with pytest.raises(RecipeError, match="head.sliding_window.size"):
        load_config("tiny", ["head.sliding_window.size=0"])


def test_the_plan_counts_the_window_linear_in_length():
    """train/plan.py: under a window the unrolled steps' kept scores grow linearly with data.max_length."""
    from recipes import load_config
    from train.plan import Hardware, memory_items, plan_shape

    def activations(length: int, *window: str) -> float:
        cfg = load_config("llama3-8b", ["head.kind=eagle3", "head.draft_vocab_size=32000", "train.micro_batch_size=1",
                                        f"data.max_length={length}", *window])
        return {i.name: i.bytes for i in memory_items(cfg, Hardware(), plan_shape(cfg))}["head activations"]

    win = ["head.sliding_window.size=1024"]
    assert activations(32768, *win) / activations(16384, *win) == pytest.approx(2.0, rel=1e-9)
    assert activations(32768) / activations(16384) > 2.5  # full attention: the [R, T] scores of every step
    assert activations(16384, *win) < activations(16384) / 4


@pytest.mark.parametrize("kind", ["eagle2", "eagle3"])
def test_a_tree_level_under_a_window_is_each_nodes_own_chain(kind):
    """Tree levels as `Drafter.draft_dynamic` runs them (k frontier nodes per level at one shared position, an additive
    mask: the committed prefix, then each node's ancestors and itself): every node's output equals the chain decode
    along its own path, with a window shorter than the tree's depth (the rule on positions, siblings never seen)."""
    target = tiny_target("llama", num_layers=4, seed=2)
    head = windowed(enlarge_weights(random_head(target, kind=kind, aux_layers=[1, 2, 3]), 0.2), 3)
    ids, feats = sequence(T=12, width=64 if kind == "eagle2" else N_AUX_LAYERS * 64)
    k, depth, t = 3, 4, 8
    tokens = torch.randint(0, 256, (depth, k), generator=torch.Generator().manual_seed(4))  # level d, frontier row r
    with torch.no_grad():
        dec = head.decoder(64)
        root = dec.forward(dec.fuse(feats[0, : t + 1]), ids[0, : t + 1], range(t + 1))[-1:]  # [1, H]
        committed, blocked = t + 1, torch.finfo(root.dtype).min
        mask = torch.full((k, committed + depth * k), blocked)
        mask[:, :committed] = 0.0
        front, outs = root.expand(k, -1), []
        for d in range(depth):  # frontier row r's parent is row r of the level before (a k-wide bundle of chains)
            end = committed + (d + 1) * k
            mask[:, end - k : end] = torch.full((k, k), blocked).fill_diagonal_(0.0)
            front = dec.forward(front, tokens[d], committed + d, mask[:, :end])
            outs.append(front)
        for r in range(k):
            chain = head.decoder(64)
            h = chain.forward(chain.fuse(feats[0, : t + 1]), ids[0, : t + 1], range(t + 1))[-1:]
            for d in range(depth):
                h = chain.forward(h, tokens[d, r : r + 1], committed + d)
                assert_same_function(outs[d][r], h[0], terms=STEP_TERMS, chained=(d + 2) * STEP_REDUCTIONS,
                                     magnitude=float(h.abs().max()), msg=f"row {r} depth {d + 1}")


def test_a_windowed_draft_step_reads_only_its_window():
    """The decoder's attention under a window starts at the first slot of the lowest row's window (W keys, not L)."""
    target = tiny_target("llama", seed=2)
    head = windowed(random_head(target), 4)
    ids, feats = sequence(T=30)
    with torch.no_grad():
        dec = head.decoder(64)
        dec.forward(feats[0], ids[0], range(30))
        end, mask, start = dec._append_bounds(1, None, feats.device, 30)
        assert (end, start, tuple(mask.shape)) == (31, 27, (1, 4)) and bool(mask.all())
        assert windowed(head, None).decoder(64)._append_bounds(1, None, feats.device, 0)[1:] == (None, 0)
