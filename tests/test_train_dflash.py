"""Training a DFlash head (train/head_kinds.py DFlashTraining, train/block_loss.py) through the trainer on a tiny
target and its multi-layer feature cache: the run, its summary and export, exact resume, learning, the anchors, and
the plan's memory items for the block rows and the context K/V."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from eagle.head_files import load_head
from test_train_helpers import gloo_world, overrides, save_target, write_cache
from train.block_loss import sample_anchors

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
DFLASH = ("head.kind=dflash", "head.target_layers=[1,2,3]", "head.block_size=4", "head.draft_layers=2",
          "head.anchors=4", "train.token_weight=1.0", "train.noise=none")


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    root = tmp_path_factory.mktemp("toydf")
    target = save_target(root / "target", num_layers=4)
    return {"target": target, "cache": write_cache(root / "cache", target, layers=[1, 2, 3, 4])}


@pytest.fixture(scope="module")
def ctx():
    with gloo_world() as c:
        yield c


def run(toy, out, *extra, steps=6, ctx=None):
    from recipes import load_config
    from train.main import train

    cfg = load_config("tiny", overrides(toy["target"], out, f"train.cache_dir={toy['cache']}", *DFLASH, *extra,
                                        steps=steps))
    return train(cfg, ctx)


def test_sample_anchors_are_loss_positions_drawn_reproducibly():
    attn = torch.ones(2, 12, dtype=torch.long)
    attn[1, 7:] = 0
    loss = torch.zeros(2, 12, dtype=torch.long)
    loss[:, 4:] = 1
    a = sample_anchors(attn, loss, 5, torch.Generator().manual_seed(3))
    assert torch.equal(a, sample_anchors(attn, loss, 5, torch.Generator().manual_seed(3)))
    for b in range(2):
        got = [p for p in a[b].tolist() if p >= 0]
        assert got == sorted(got) and len(set(got)) == len(got)
        assert all(1 <= p and loss[b, p + 1] and attn[b, p + 1] for p in got)
    assert a[1].tolist()[-2:] == [-1, -1]  # record 1 has only anchors 3, 4, 5 (x_{p+1} at 4..6)


def test_a_dflash_run_trains_exports_and_loads(toy, tmp_path, ctx):
    summary = run(toy, tmp_path / "run", steps=4, ctx=ctx)
    assert summary["steps"] == 4 and summary["head_kind"] == "dflash" and summary["block_size"] == 4
    assert summary["target_layers"] == [1, 2, 3] and 0 <= summary["mask_token_id"] < 256
    assert 0.0 <= summary["eval"]["eval/top1"] <= 1.0 and "eval/block_step3_acc" in summary["eval"]
    head = load_head(tmp_path / "run" / "head")
    assert head.kind.name == "dflash" and head.config.options.draft_layers == 2 and len(head.layers) == 2
    assert json.loads((tmp_path / "run" / "head" / "config.json").read_text())["dflash"]["block_size"] == 4


def test_resume_is_exact(toy, tmp_path, ctx):
    """2N steps straight == N, stop, resume, N more: the anchors come from (seed, micro-batch), not the run's RNG."""
    n, common = 3, ("train.lr=3e-3", "train.checkpoint_every=2", "train.noise=uniform", "train.noise_std=0.1")
    run(toy, tmp_path / "straight", *common, steps=2 * n, ctx=ctx)
    first = run(toy, tmp_path / "resumed", *common, f"train.stop_after={n}", steps=2 * n, ctx=ctx)
    assert first["stopped_early"]
    run(toy, tmp_path / "resumed", *common, steps=2 * n, ctx=ctx)
    a = load_file(tmp_path / "straight" / "head" / "model.safetensors")
    b = load_file(tmp_path / "resumed" / "head" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_loss_decreases(toy, tmp_path, ctx):
    out = tmp_path / "run"
    run(toy, out, "train.lr=3e-3", "logging.log_every=10", "train.eval_every=1000", steps=60, ctx=ctx)
    logs = [json.loads(line) for line in (out / "train" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in logs if "train/loss" in r]
    assert losses[-1] < 0.8 * losses[0], losses


def test_dpace_weights_train(toy, tmp_path, ctx):
    summary = run(toy, tmp_path / "run", "loss.position_weighting=dpace", steps=3, ctx=ctx)
    assert summary["position_weighting"] == "dpace" and summary["block_weights"] == [1.0, 1.0, 1.0]


def test_plan_counts_block_rows_and_context_kv(toy):
    from transformers import AutoConfig

    from recipes import load_config
    from train.plan import plan_shape

    cfg = load_config("tiny", overrides(toy["target"], "/tmp/x", *DFLASH))
    shape = plan_shape(cfg, AutoConfig.from_pretrained(toy["target"]))
    assert (shape.kind, shape.draft_layers, shape.block_size, shape.block_rows) == ("dflash", 2, 4, 16)
    assert shape.cache_row == 4  # 3 target layers + the final state
    more = plan_shape(load_config("tiny", overrides(toy["target"], "/tmp/x", *DFLASH, "head.anchors=8")),
                      AutoConfig.from_pretrained(toy["target"]))
    assert more.block_rows == 32 and more.head_trainable == shape.head_trainable


def test_plan_training_time_counts_block_rows_not_ttt_steps(toy):
    """The plan's training time for dflash: fc + context K/V over every token, the draft layers over the block rows
    (head.anchors x head.block_size per record) only; the EAGLE-3 formula (ttt_steps full head passes per token,
    ignoring the anchors) was used before."""
    from transformers import AutoConfig

    from recipes import load_config
    from train.head_kinds import DFlashTraining, Eagle3Training
    from train.plan import Hardware, build_plan, plan_shape

    def training_s(*extra):
        cfg = load_config("tiny", overrides(toy["target"], "/tmp/x", *DFLASH, *extra))
        shape = plan_shape(cfg, AutoConfig.from_pretrained(toy["target"]))
        plan = build_plan(cfg, Hardware(), shape, tokens=1_000_000)
        return shape, next(i.bytes for i in plan.time if i.name == "training")

    shape, four = training_s("head.anchors=4")
    _, eight = training_s("head.anchors=8")
    _, one = training_s("head.anchors=1")
    assert eight > four > one > 0  # more block rows per record cost more; the context path is paid at any anchors
    P = shape.head_trainable
    assert DFlashTraining.train_flops_per_token(shape, P) < Eagle3Training.train_flops_per_token(shape, P)
