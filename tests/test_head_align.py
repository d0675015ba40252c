"""EAGLE-2 multi-step alignment (HASS-style, head.align_steps): the unrolled training forward equals what decoding
computes for a drafted chain; align_steps=1 is the plain training; the recipe keys; the trainer and its exact resume
(tests/test_train.py's any_toy runs the resume test with alignment on)."""
from __future__ import annotations

import copy
import json

import pytest
import torch
from safetensors.torch import load_file

from eagle.head import EagleHead
from float_tolerance import LAYER_REDUCTIONS, assert_same_function, float64
from recipes import RecipeError, load_config
from test_train_helpers import gloo_world, overrides, save_target, write_cache
from tiny_models import assert_unroll_ignores_padding, enlarge_weights, random_head, single_thread, tiny_target  # noqa: F401

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.filterwarnings("ignore::UserWarning")]
# one head step: fc over [embed; feature] (2H = 128 terms), then a decoder layer
STEP_REDUCTIONS, STEP_TERMS = 1 + LAYER_REDUCTIONS, 2 * 64


def big_head(target, seed: int = 0, std: float = 0.2) -> EagleHead:
    """A random EAGLE-2 head with weights large enough that every unrolled step's output differs visibly."""
    return enlarge_weights(random_head(target, seed=seed), std)


@pytest.fixture(scope="module")
def setup():
    target = tiny_target("llama", seed=2)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (3, 14), generator=g)
    feats = torch.randn(3, 14, 64, generator=g)
    return target, big_head(target), ids, feats


def test_one_step_is_the_plain_forward_bit_for_bit(setup):
    target, head, ids, feats = setup
    am = torch.ones(3, 14, dtype=torch.long)
    am[1, 10:] = 0
    with torch.no_grad():
        for mask in (None, am):
            (h1,) = head.unroll(feats, ids, mask, steps=1)
            assert torch.equal(h1, head(feats, ids, mask))
            # the multi-step path computes step 1 with its own ops: the same function
            assert_same_function(head.unroll(feats, ids, mask, steps=3)[0], h1, terms=STEP_TERMS,
                                 chained=STEP_REDUCTIONS)
    hs = head(feats, ids, steps=3, rows=torch.tensor([0, 5, 13]))  # forward(steps=) = unroll, for DeepSpeed's hooks
    assert len(hs) == 3 and hs[0].shape == (3, 14, 64) and hs[1].shape == hs[2].shape == (3, 3, 64)
    with pytest.raises(ValueError, match="steps"):
        head.unroll(feats, ids, steps=0)


@pytest.mark.parametrize("fast", [False, True])
@pytest.mark.parametrize("kwargs", [{}, {"num_heads": 8, "num_kv_heads": 4}])
def test_step_j_is_what_decoding_computes_for_a_drafted_chain(fast, kwargs):
    """Commit positions 0..t through the head's decoder, then draft a chain fed its own outputs (what EaModel does):
    the drafted node j equals unrolled step j + 1 at t, also when only some rows run (rows=)."""
    target = tiny_target("llama", seed=2, **kwargs)
    head = big_head(target)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 256, (1, 30), generator=g)
    feats = torch.randn(1, 30, 64, generator=g)
    steps, rows = 5, torch.tensor([2, 7, 19, 21])
    with torch.no_grad():
        hs = head.unroll(feats, ids, steps=steps)
        sub = head.unroll(feats, ids, steps=steps, rows=rows)
        dec = head.decoder(64, fast=fast)
        for t in (0, 7, 21):
            dec.truncate(0)
            committed = dec.forward(feats[0, : t + 1], ids[0, : t + 1], range(t + 1))  # [t + 1, H]
            assert_same_function(committed, hs[0][0, : t + 1], terms=STEP_TERMS, chained=STEP_REDUCTIONS)
            h = committed[-1:]
            for j in range(2, steps + 1):
                h = dec.forward(h, ids[0, t + j - 1 : t + j], t + j - 1)  # one drafted node, fed its own feature
                mag = float(hs[j - 1].abs().max())
                assert_same_function(h[0], hs[j - 1][0, t], terms=STEP_TERMS, chained=j * STEP_REDUCTIONS,
                                     magnitude=mag, msg=f"t={t} step {j}")
                if t in rows.tolist():
                    assert_same_function(sub[j - 1][0, rows.tolist().index(t)], hs[j - 1][0, t], terms=STEP_TERMS,
                                         chained=j * STEP_REDUCTIONS, magnitude=mag)
    assert (hs[1][:, :20] - hs[0][:, :20]).abs().max() > 1e-2  # the steps really differ


@pytest.mark.parametrize("side", ["right", "left"])
def test_unroll_with_padding_equals_the_unpadded_sequence(setup, side):
    target, head, ids, feats = setup
    head, feats = float64(copy.deepcopy(head), feats)
    assert_unroll_ignores_padding(head, ids, feats, side, STEP_TERMS, STEP_REDUCTIONS)


def test_backward_of_later_steps_reaches_every_trained_parameter(setup):
    target, head, ids, feats = setup
    head = big_head(target).train()
    hs = head.unroll(feats, ids, steps=3)
    hs[2].square().mean().backward()  # only the third step's output: it must depend on every weight (fc, attention, MLP)
    for name, p in head.named_parameters():
        if name.startswith("embed_tokens"):
            assert p.grad is None
        else:
            assert p.grad is not None and p.grad.abs().sum() > 0, name


# ----------------------------------------------------------------------------- recipe keys
@pytest.mark.parametrize("extra,key", [
    (["head.align_steps=0"], "head.align_steps"),
    (["head.align_steps=2", "head.align_step_weights=[1.0]"], "head.align_step_weights"),
    (["head.align_steps=2", "head.align_step_weights=[0.0,1.0]"], "head.align_step_weights"),
    (["head.align_row_stride=0"], "head.align_row_stride"),
    (["head.kind=eagle3", "head.align_steps=3"], "head.align_steps"),
    (["head.ttt_steps=3"], "head.ttt_steps"),
])
def test_bad_align_keys_are_recipe_errors(extra, key):
    with pytest.raises(RecipeError, match=key):
        load_config("tiny", extra)


def test_align_defaults_are_the_plain_training():
    h = load_config("tiny", []).head
    assert (h.align_steps, list(h.align_step_weights), h.align_row_stride) == (1, [], 1)


# ----------------------------------------------------------------------------- the trainer
@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    root = tmp_path_factory.mktemp("toy_align")
    target = save_target(root / "target")
    return {"target": target, "cache": write_cache(root / "cache", target)}


@pytest.fixture(scope="module")
def dist_ctx():
    with gloo_world() as ctx:
        yield ctx


def run_train(toy, out, *extra, steps=6, ctx=None):
    from train.main import train

    return train(load_config("tiny", overrides(toy["target"], out, f"train.cache_dir={toy['cache']}", *extra,
                                               steps=steps)), ctx)


@pytest.mark.parametrize("chunk", [0, 7])
def test_aligned_training_logs_every_step_and_exports_the_official_eagle2_layout(toy, tmp_path, dist_ctx, chunk):
    common = ("train.lr=3e-3", "train.eval_every=3", f"train.loss_chunk={chunk}")
    plain = run_train(toy, tmp_path / "plain", *common, ctx=dist_ctx)
    aligned = run_train(toy, tmp_path / "aligned", *common, "head.align_steps=3", "head.align_row_stride=2",
                        ctx=dist_ctx)
    assert "align_steps" not in plain and aligned["align_steps"] == 3 and aligned["align_row_stride"] == 2
    logs = [json.loads(x) for x in (tmp_path / "aligned" / "train" / "metrics.jsonl").read_text().splitlines()]
    acc = [r for r in logs if "train/step3_acc" in r]
    assert acc and all(0.0 <= r["train/step3_acc"] <= 1.0 for r in acc)
    a, b = (load_file(tmp_path / d / "head" / "model.safetensors") for d in ("plain", "aligned"))
    assert a.keys() == b.keys() and all(a[k].shape == b[k].shape for k in a)  # the official EAGLE-2 keys
    assert not torch.equal(a["fc.weight"], b["fc.weight"])  # the later steps' losses changed the training
    ca, cb = (json.loads((tmp_path / d / "head" / "config.json").read_text()) for d in ("plain", "aligned"))
    assert ca == cb
    EagleHead.from_pretrained(tmp_path / "aligned" / "head")  # loads strictly as an EAGLE-2 head


def test_plan_counts_the_aligned_steps():
    """The memory plan (train/plan.py) grows with the unrolled steps; align_steps=1 plans exactly the plain head."""
    from train.plan import Hardware, memory_items, plan_shape

    def items(*extra):
        cfg = load_config("llama3-8b", list(extra))
        return {i.name: i.bytes for i in memory_items(cfg, Hardware(), plan_shape(cfg))}

    plain, one = items(), items("head.align_steps=1")
    assert plain == one
    three = items("head.align_steps=3")
    strided = items("head.align_steps=3", "head.align_row_stride=4")
    for name in ("head activations", "token-loss gradient"):
        assert plain[name] < strided[name] < three[name], name


def test_model_card_states_the_alignment():
    """The Hub card's loss row names the alignment of an aligned head (a plain head's card is pinned in
    tests/test_export_pin.py)."""
    from export.head_kinds import EXPORT
    from eagle.head_kinds import EAGLE2

    plain = EXPORT[EAGLE2].card_loss(load_config("tiny", []))
    aligned = EXPORT[EAGLE2].card_loss(load_config("tiny", ["head.align_steps=3"]))
    assert "alignment" not in plain
    assert aligned.startswith(plain[:-2]) and "3 unrolled steps" in aligned and "1.00, 0.80, 0.64" in aligned


def test_model_card_states_dpace():
    """Under loss.position_weighting=dpace the card's loss row names D-PACE, not the fixed decay it no longer uses."""
    from export.head_kinds import EXPORT
    from eagle.head_kinds import EAGLE2, EAGLE3

    e2 = EXPORT[EAGLE2].card_loss(load_config("tiny", ["head.align_steps=3", "loss.position_weighting=dpace"]))
    e3 = EXPORT[EAGLE3].card_loss(load_config("tiny-eagle3", ["loss.position_weighting=dpace", "loss.dpace_alpha=0.25"]))
    assert "step weights D-PACE" in e2 and "alpha 0.5" in e2 and "0.80" not in e2
    assert "step weights D-PACE" in e3 and "alpha 0.25" in e3 and "0.8^" not in e3
    assert "0.8^(j-1)" in EXPORT[EAGLE3].card_loss(load_config("tiny-eagle3", []))
