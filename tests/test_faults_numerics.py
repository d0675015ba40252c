"""Fault tier, numerics class: divergence (an exploding loss against the run's best level, runs of non-finite
losses, weights that stop being finite) stops training with one line; nothing after it is checkpointed or
exported, `latest` keeps naming the last good checkpoint, a good export is never replaced by a bad one, and the
same command with a lower train.lr resumes from the last good checkpoint."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from fault_helpers import assert_one_line_error, assert_unchanged, run_cli, snapshot, world  # noqa: F401
from test_train_helpers import overrides, save_target, write_cache

BASE = ("train.precision=fp32", "train.zero_stage=0", "train.warmup_steps=0", "train.micro_batch_size=2",
        "train.checkpoint_every=2", "logging.log_every=1")


@pytest.fixture(scope="module")
def toy(tmp_path_factory, world):  # noqa: F811
    root = tmp_path_factory.mktemp("numerics")
    target = save_target(root / "target")
    return {"target": target, "cache": write_cache(root / "cache", target, n=24), "root": root}


def train_cli(toy, run, capsys, *extra, steps=6, cache=None):
    from train.main import main

    return run_cli(main, ["--recipe", "tiny", *overrides(toy["target"], run, f"train.cache_dir={cache or toy['cache']}",
                                                         *BASE, *extra, steps=steps)], capsys)


def latest(run):
    p = run / "train" / "checkpoints" / "latest"
    return p.read_text().strip() if p.exists() else None


def test_exploding_lr_from_the_start_stops_before_any_checkpoint(toy, tmp_path, capsys):
    run = tmp_path / "run"
    code, _, err = train_cli(toy, run, capsys, "train.lr=3")
    assert_one_line_error(code, err, "training diverged at step", "train.max_loss_ratio=10", "lower train.lr",
                          "no checkpoint yet")
    assert latest(run) is None and not (run / "head").exists()
    code, out, err = train_cli(toy, run, capsys, "train.lr=1e-3")  # the same command, lower lr: trains from scratch
    assert code == 0, err
    assert (run / "head" / "model.safetensors").exists()


def test_divergence_after_a_good_checkpoint_keeps_it_and_a_lower_lr_resumes_from_it(toy, tmp_path, capsys):
    run = tmp_path / "run"
    code, _, err = train_cli(toy, run, capsys, "train.lr=1e-3", "train.stop_after=2")
    assert code == 0, err
    good = snapshot(run / "train" / "checkpoints")
    code, _, err = train_cli(toy, run, capsys, "train.lr=30")
    assert_one_line_error(code, err, "training diverged at step 3", "last good checkpoint",
                          str(run / "train" / "checkpoints" / "step-00000002"))
    assert latest(run) == "step-00000002" and not (run / "head").exists()
    assert_unchanged(good, run / "train" / "checkpoints")
    code, out, err = train_cli(toy, run, capsys, "train.lr=5e-4")
    assert code == 0, err
    assert "step-00000002 at step 2" in out and "learning rate 0.001 in the checkpoint -> 0.0005" in out
    head = load_file(run / "head" / "model.safetensors")
    assert all(torch.isfinite(v.float()).all() for v in head.values())


def test_a_checkpoint_saved_just_before_the_divergence_is_never_named_by_latest(toy, tmp_path, capsys):
    """checkpoint_every=1: the step-3 checkpoint holds the weights of the exploding update; the next loss exposes
    it, so `latest` never moved to it and the folder is removed."""
    run = tmp_path / "run"
    code, _, err = train_cli(toy, run, capsys, "train.lr=1e-3", "train.stop_after=2", "train.checkpoint_every=1")
    assert code == 0, err
    good = snapshot(run / "train" / "checkpoints" / "step-00000002")
    code, _, err = train_cli(toy, run, capsys, "train.lr=30", "train.checkpoint_every=1")
    assert_one_line_error(code, err, "training diverged at step 3", "step-00000002")
    assert latest(run) == "step-00000002"
    assert sorted(p.name for p in (run / "train" / "checkpoints").glob("step-*")) == ["step-00000001", "step-00000002"]
    assert_unchanged(good, run / "train" / "checkpoints" / "step-00000002")


def test_a_good_export_is_never_replaced_by_a_diverged_run(toy, tmp_path, capsys):
    run = tmp_path / "run"
    code, _, err = train_cli(toy, run, capsys, "train.lr=1e-3", steps=4)
    assert code == 0, err
    before = snapshot(run / "head", run / "train" / "checkpoints")
    code, _, err = train_cli(toy, run, capsys, "train.lr=30", steps=8)  # resumes at 4, then explodes
    assert_one_line_error(code, err, "training diverged at step 5")
    assert_unchanged(before, run / "head", run / "train" / "checkpoints")
    assert latest(run) == "step-00000004"


def test_an_exploding_record_stops_the_run(toy, tmp_path, capsys):
    """Finite but huge features in one record: the loss explodes against the run so far."""
    from data_prep.feature_cache import FeatureCacheReader, FeatureCacheWriter

    src = FeatureCacheReader(toy["cache"])
    w = FeatureCacheWriter(tmp_path / "cache", {k: src.manifest[k] for k in ("target", "config_hash", "hidden_size",
                                                                           "vocab_size")}, dtype="float32")
    for i in range(len(src)):
        r = src[i]
        w.add(r["id"], r["input_ids"], r["hidden_states"] * (1e4 if i >= 16 else 1.0), r["loss_mask"])
    w.close()
    run = tmp_path / "run"
    code, _, err = train_cli(toy, run, capsys, "train.lr=1e-3", "train.batching=padded", "train.eval_fraction=0",
                             cache=tmp_path / "cache", steps=12)
    assert_one_line_error(code, err, "training diverged", "best level so far")
    assert not (run / "head").exists()
    code, _, err = train_cli(toy, tmp_path / "off", capsys, "train.lr=1e-3", "train.batching=padded",
                             "train.eval_fraction=0", "train.max_loss_ratio=0", cache=tmp_path / "cache", steps=2)
    assert code == 0, err  # max_loss_ratio=0 (allowed by the schema) turns the check off


def test_non_finite_losses_in_a_row_stop_with_nothing_written(toy, tmp_path, capsys):
    cache = write_cache(tmp_path / "nan", toy["target"], n=8, nan_ids=tuple(f"r{i:04d}" for i in range(8)))
    run = tmp_path / "run"
    code, _, err = train_cli(toy, run, capsys, "train.max_bad_steps=3", "train.micro_batch_size=1", cache=cache)
    assert_one_line_error(code, err, "3 non-finite losses in a row", "train.max_bad_steps=3")
    assert latest(run) is None and not (run / "head").exists()


def test_non_finite_weights_are_never_checkpointed(toy, tmp_path, capsys, monkeypatch):
    """Weights poisoned by an optimizer step (as an inf gradient would): caught before the checkpoint."""
    import deepspeed

    run = tmp_path / "run"
    code, _, err = train_cli(toy, run, capsys, "train.lr=1e-3", "train.stop_after=2")
    assert code == 0, err
    good = snapshot(run / "train" / "checkpoints")
    real_step = deepspeed.DeepSpeedEngine.step

    def poisoned_step(self, *a, **k):
        out = real_step(self, *a, **k)
        with torch.no_grad():
            self.module.fc.weight[0, 0] = float("nan")
        return out

    monkeypatch.setattr(deepspeed.DeepSpeedEngine, "step", poisoned_step)
    code, _, err = train_cli(toy, run, capsys, "train.lr=1e-3")
    assert_one_line_error(code, err, "fc.weight", "no longer finite", "step-00000002")
    assert_unchanged(good, run / "train" / "checkpoints")
    assert latest(run) == "step-00000002" and not (run / "head").exists()


EXPORT_FAULTS = [  # (id, poison(state dict), export dtype, needle)
    ("nan", lambda sd: sd["fc.weight"].view(-1)[0].fill_(float("nan")), "float32", "NaN/inf"),
    ("inf", lambda sd: sd["layers.0.mlp.down_proj.weight"].view(-1)[3].fill_(float("inf")), "float32", "NaN/inf"),
    ("fp16-overflow", lambda sd: sd["fc.weight"].view(-1)[0].fill_(7e4), "float16", "NaN/inf in float16"),
    ("exploded", lambda sd: sd["fc.weight"].view(-1)[0].fill_(3e4), "float32", "exploded"),
]


@pytest.mark.parametrize("name,poison,dtype,needle", EXPORT_FAULTS, ids=[e[0] for e in EXPORT_FAULTS])
def test_export_refuses_bad_weights_and_keeps_the_good_export(toy, tmp_path, name, poison, dtype, needle):
    from eagle.head import EagleHead, head_config_from_target
    from train.divergence import DivergenceError
    from train.export import export_head
    from transformers import AutoConfig

    head = EagleHead(head_config_from_target(AutoConfig.from_pretrained(toy["target"])))
    sd = {k: v.detach().clone() for k, v in head.state_dict().items()}
    out = export_head(sd, head.config, tmp_path / "head", dtype, legacy_bin=False)
    before = snapshot(out)
    poison(sd)
    with pytest.raises(DivergenceError, match=needle) as e:
        export_head(sd, head.config, tmp_path / "head", dtype, legacy_bin=False)
    assert "\n" not in str(e.value)
    assert_unchanged(before, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["head"]  # no temporary folder left


@pytest.mark.parametrize("schedule", ["linear", "cosine", "constant"])
def test_zero_warmup_is_allowed_and_starts_at_the_full_lr(toy, tmp_path, capsys, schedule):
    run = tmp_path / "run"
    code, _, err = train_cli(toy, run, capsys, "train.lr=1e-3", f"train.schedule={schedule}", steps=3)
    assert code == 0, err
    lrs = [json.loads(x)["train/lr"] for x in (run / "train" / "metrics.jsonl").read_text().splitlines()
           if "train/lr" in x]
    assert lrs[0] == pytest.approx(1e-3, rel=0.35) and lrs[0] > 0
