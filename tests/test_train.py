"""Trainer on CPU with a tiny random Llama: plain-python CLI run, learning on a toy, exact resume, cache/target
mismatch and non-finite errors, online mode, export in the official format, batching and rollout metrics."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from float_tolerance import LAYER_REDUCTIONS, assert_same_function
from test_train_helpers import REPO, VOCAB, gloo_world, overrides, save_target, subprocess_env, write_cache

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """A tiny target + a feature cache from it (shared by the module's tests; each test has its own run dir)."""
    root = tmp_path_factory.mktemp("toy")
    target = save_target(root / "target")
    cache = write_cache(root / "cache", target)
    return {"root": root, "target": target, "cache": cache}


EAGLE3 = ("head.kind=eagle3", "head.aux_layers=[1,2,3]", "head.draft_vocab_size=100", "head.ttt_steps=3",
          "head.ttt_row_stride=2")  # a 4-layer toy target; steps 2-3 at every other position


@pytest.fixture(scope="module")
def toy3(tmp_path_factory):
    """A 4-layer tiny target + an EAGLE-3 feature cache (aux layers 1, 2, 3 + the final state, 4H per token)."""
    root = tmp_path_factory.mktemp("toy3")
    target = save_target(root / "target", num_layers=4)
    cache = write_cache(root / "cache", target, layers=[1, 2, 3, 4])
    return {"root": root, "target": target, "cache": cache, "extra": EAGLE3}


PEAGLE = ("head.kind=peagle", *EAGLE3[1:])  # P-EAGLE: the EAGLE-3 toy's settings, 3 positions from one forward


@pytest.fixture(params=["eagle2", "eagle3", "eagle2-align", "peagle"])
def any_toy(request, toy, toy3):
    """The EAGLE-2 toy, the EAGLE-3 toy, the EAGLE-2 toy with multi-step alignment (3 steps, steps 2-3 at every
    other position), or the EAGLE-3 toy with a P-EAGLE head: trainer tests that must hold for every head kind and
    training mode."""
    if request.param == "eagle2-align":
        return {**toy, "extra": ("head.align_steps=3", "head.align_row_stride=2")}
    if request.param == "peagle":
        return {**toy3, "extra": PEAGLE}
    return toy if request.param == "eagle2" else toy3


@pytest.fixture(scope="module")
def dist_ctx():
    """One in-process gloo world of size 1 for the in-process trainings."""
    with gloo_world() as ctx:
        yield ctx


def run_train(toy, out, *extra, steps=6, ctx=None):
    from recipes import load_config
    from train.main import train

    cfg = load_config("tiny", overrides(toy["target"], out, f"train.cache_dir={toy['cache']}", *toy.get("extra", ()),
                                        *extra, steps=steps))
    return train(cfg, ctx)


# ----------------------------------------------------------------------------- CLI, plain python
def test_tiny_recipe_trains_under_plain_python(toy, tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, str(REPO / "train" / "main.py"), "--recipe", "tiny",
           *overrides(toy["target"], out, f"train.cache_dir={toy['cache']}", "logging.backend=tensorboard", steps=4)]
    proc = subprocess.run(cmd, env=subprocess_env(), capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "train" / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["world_size"] == 1 and summary["train_tokens"] > 0
    assert 0.0 <= summary["eval"]["eval/top1"] <= 1.0 and summary["eval"]["eval/sim_accept_len"] >= 1.0
    assert (out / "head" / "config.json").exists() and (out / "head" / "model.safetensors").exists()
    assert list((out / "train" / "tensorboard").glob("events.out.tfevents.*"))
    assert json.loads((out / "train" / "deepspeed_config.json").read_text())["optimizer"]["params"]["lr"] == 1e-2
    assert (out / "train" / "checkpoints" / "latest").read_text().strip() == "step-00000004"


def test_help_lists_recipes_and_keys(capsys):
    from train.main import main

    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for needle in ("llama3-8b", "tiny", "train.lr = 5e-05", "train.zero_stage", "export.repo_id", "data.max_length"):
        assert needle in out, needle


def test_bad_recipe_key_is_a_clear_cli_error(capsys):
    from train.main import main

    assert main(["--recipe", "tiny", "train.learning_rate=1"]) == 2
    err = capsys.readouterr().err
    assert "unknown recipe key 'train.learning_rate'" in err and "train.lr" in err


# ----------------------------------------------------------------------------- learning
def test_loss_decreases_on_learnable_toy(toy, tmp_path, dist_ctx):
    out = tmp_path / "run"
    summary = run_train(toy, out, "train.lr=3e-3", "train.token_weight=1.0", "logging.log_every=10",
                        "train.eval_every=20", steps=160, ctx=dist_ctx)
    logs = [json.loads(line) for line in (out / "train" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in logs if "train/loss" in r]
    top1 = [r["train/top1"] for r in logs if "train/top1" in r]
    assert len(losses) == 16 and len([r for r in logs if "eval/top1" in r]) == 8
    assert losses[-1] < 0.6 * losses[0], losses
    assert top1[0] < 0.05 and top1[-1] > 0.35, top1
    ev = summary["eval"]
    assert ev["eval/top1"] > 0.1, ev  # held-out records (other starts/strides): 25x chance (1/256)
    assert ev["eval/top1"] <= ev["eval/top2"] <= ev["eval/top3"]
    assert ev["eval/step1_acc"] >= ev["eval/step5_acc"] - 0.05


def test_resume_is_exact(any_toy, tmp_path, dist_ctx):
    """2N steps straight == N steps, stop, resume, N more: bit-identical weights (both head kinds; EAGLE-3 with input
    noise on and a row stride, so the noise RNG and the cycling row offset must both be restored)."""
    n = 5
    toy = any_toy
    common = ("train.lr=3e-3", "train.checkpoint_every=3", "train.eval_every=4", "train.noise=uniform")
    straight = run_train(toy, tmp_path / "straight", *common, steps=2 * n, ctx=dist_ctx)
    first = run_train(toy, tmp_path / "resumed", *common, f"train.stop_after={n}", steps=2 * n, ctx=dist_ctx)
    assert first["stopped_early"] and first["steps"] == n
    assert not (tmp_path / "resumed" / "head").exists()
    second = run_train(toy, tmp_path / "resumed", *common, steps=2 * n, ctx=dist_ctx)
    assert second["steps"] == 2 * n and not second["stopped_early"]
    a = load_file(tmp_path / "straight" / "head" / "model.safetensors")
    b = load_file(tmp_path / "resumed" / "head" / "model.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert straight["eval"] == second["eval"]
    ckpts = sorted(p.name for p in (tmp_path / "resumed" / "train" / "checkpoints").glob("step-*"))
    assert ckpts == ["step-00000009", "step-00000010"]  # keep_last=2


def test_acceptance_losses_train_and_resume_exactly(any_toy, tmp_path, dist_ctx):
    """A non-default token loss (EAGLE-2 nla with the mse feature loss, EAGLE-3 lk with EAGLE-3.1's three norms, aligned
    EAGLE-2 tv) trains through the same path: the summary names it, the training loss falls, a stop + resume is
    bit-identical, and the EAGLE-3.1 head is exported with its options."""
    toy = any_toy
    kind = "eagle3" if "head.kind=eagle3" in toy.get("extra", ()) else "align" if toy.get("extra") else "eagle2"
    loss = {"eagle2": ("loss.token=nla", "loss.feature=mse"),
            "eagle3": ("loss.token=lk", "head.norm_before_fc=true", "head.fc_norm=true", "head.norm_output=true"),
            "align": ("loss.token=tv",)}[kind]
    common = (*loss, "train.lr=3e-3", "train.checkpoint_every=3", "train.eval_every=4", "logging.log_every=1")
    straight = run_train(toy, tmp_path / "straight", *common, steps=8, ctx=dist_ctx)
    run_train(toy, tmp_path / "resumed", *common, "train.stop_after=4", steps=8, ctx=dist_ctx)
    second = run_train(toy, tmp_path / "resumed", *common, steps=8, ctx=dist_ctx)
    assert straight["token_loss"] == second["token_loss"] == loss[0].split("=")[1]
    a = load_file(tmp_path / "straight" / "head" / "model.safetensors")
    b = load_file(tmp_path / "resumed" / "head" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    logs = [json.loads(line) for line in (tmp_path / "straight" / "train" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in logs if "train/loss" in r]
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    if kind == "eagle3":
        config = json.loads((tmp_path / "resumed" / "head" / "config.json").read_text())
        assert config["norm_before_fc"] and config["fc_norm"] and config["norm_output"] and second["fc_norm"]
        assert "fc_norm.2.weight" in a and "input_norm.weight" in a


def test_dpace_position_weighting_trains_and_resumes_exactly(any_toy, tmp_path, dist_ctx):
    """loss.position_weighting=dpace (D-PACE, train/losses.py) on every multi-step kind (EAGLE-3 and P-EAGLE with a row
    stride, aligned EAGLE-2): the training loss falls, a stop + resume is bit-identical, and the run's summary and
    exported recipe name it; a single-step EAGLE-2 head refuses it with one line."""
    toy = any_toy
    common = ("loss.position_weighting=dpace", "loss.dpace_alpha=0.4", "train.lr=3e-3", "train.checkpoint_every=3",
              "train.eval_every=4", "logging.log_every=1", "train.noise=uniform")
    if not toy.get("extra"):  # plain EAGLE-2: one step, nothing to weight
        from recipes import RecipeError
        with pytest.raises(RecipeError, match=r"^loss.position_weighting='dpace': D-PACE weights the unrolled steps"):
            run_train(toy, tmp_path / "straight", *common, steps=8, ctx=dist_ctx)
        return
    straight = run_train(toy, tmp_path / "straight", *common, steps=8, ctx=dist_ctx)
    run_train(toy, tmp_path / "resumed", *common, "train.stop_after=4", steps=8, ctx=dist_ctx)
    second = run_train(toy, tmp_path / "resumed", *common, steps=8, ctx=dist_ctx)
    assert straight["position_weighting"] == second["position_weighting"] == "dpace"
    assert straight["dpace_alpha"] == 0.4
    a = load_file(tmp_path / "straight" / "head" / "model.safetensors")
    b = load_file(tmp_path / "resumed" / "head" / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert straight["eval"] == second["eval"]
    logs = [json.loads(line) for line in (tmp_path / "straight" / "train" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in logs if "train/loss" in r]
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    recipe = (tmp_path / "resumed" / "head" / "recipe.yaml").read_text()
    assert "position_weighting: dpace" in recipe and "dpace_alpha: 0.4" in recipe


def test_dataloader_workers_do_not_change_the_run(toy, tmp_path, dist_ctx):
    a = run_train(toy, tmp_path / "a", "train.num_workers=0", steps=5, ctx=dist_ctx)
    b = run_train(toy, tmp_path / "b", "train.num_workers=2", steps=5, ctx=dist_ctx)
    wa = load_file(tmp_path / "a" / "head" / "model.safetensors")
    wb = load_file(tmp_path / "b" / "head" / "model.safetensors")
    assert all(torch.equal(wa[k], wb[k]) for k in wa) and a["train_tokens"] == b["train_tokens"]


def test_resume_rejects_changed_data(toy, tmp_path, dist_ctx):
    out = tmp_path / "run"
    run_train(toy, out, "train.stop_after=2", steps=4, ctx=dist_ctx)
    with pytest.raises(RuntimeError, match="exact resume needs the same"):
        run_train(toy, out, "train.micro_batch_size=2", steps=4, ctx=dist_ctx)


@pytest.mark.parametrize("kind", ["eagle2-align", "eagle3"])
def test_unrolled_steps_beyond_the_records_are_refused_before_training(kind, toy, toy3, tmp_path, dist_ctx):
    """Issue 35: an alignment / TTT step count beyond what the records can hold (step j at position t predicts token
    t + j: a record of L tokens holds L - 1 steps) is refused before anything is allocated, naming the key and the
    bound; the bound itself trains."""
    import re

    from recipes import RecipeError

    t, key = ({**toy, "extra": ()}, "head.align_steps") if kind == "eagle2-align" else (toy3, "head.ttt_steps")
    with pytest.raises(RecipeError) as e:
        run_train(t, tmp_path / "over", f"{key}=500", steps=1, ctx=dist_ctx)
    longest, bound = map(int, re.search(r"records has (\d+) tokens .* at most (\d+) unrolled", str(e.value)).groups())
    assert str(e.value).startswith(f"{key}=500 is more than the training records hold") and bound == longest - 1
    assert f"set {key} <= {bound}" in str(e.value) and longest <= 40  # toy records: 8-40 tokens
    assert not (tmp_path / "over" / "train" / "checkpoints").exists()
    with pytest.raises(RecipeError, match=f"{key}={bound + 1} is more"):
        run_train(t, tmp_path / "over1", f"{key}={bound + 1}", steps=1, ctx=dist_ctx)
    assert run_train(t, tmp_path / "bound", f"{key}={bound}", steps=1, ctx=dist_ctx)["steps"] == 1


def test_unrolled_steps_that_do_not_fit_in_memory_are_refused_before_training(toy, tmp_path, dist_ctx, monkeypatch):
    """Issue 35: on a machine whose memory holds the plan's peak for 2 aligned steps but not for 8 (at this data's
    longest micro-batch: data.max_length 16 cuts every record here), head.align_steps=8 is refused before training
    with one line naming the key and the largest count that fits; that count trains."""
    from dataclasses import replace

    from transformers import AutoConfig

    import train.plan as plan
    from recipes import load_config

    extra = ("data.max_length=16",)
    cfg = load_config("tiny", overrides(toy["target"], tmp_path / "x", f"train.cache_dir={toy['cache']}", *extra,
                                        "head.align_steps=8"))
    shape = plan.plan_shape(cfg, AutoConfig.from_pretrained(toy["target"]))
    c, host = plan.data_bound_cfg(cfg, 16), plan.Hardware(gpus=1, host=True)

    def need(steps):
        return plan.peak_bytes(plan.memory_items(c, host, replace(shape, ttt_steps=steps)))[0]

    budget_gb = (need(2) + need(3)) / 2 / plan.GB  # 2 steps fit, 3 do not
    monkeypatch.setattr(plan, "hardware_for_run", lambda ctx: plan.Hardware(gpus=1, host=True, gpu_mem_gb=budget_gb))
    with pytest.raises(plan.PlanError) as e:
        run_train(toy, tmp_path / "big", *extra, "head.align_steps=8", steps=1, ctx=dist_ctx)
    msg = str(e.value)
    assert msg.startswith("head.align_steps=8 does not fit in memory: the plan (train/plan.py) needs ")
    assert "per process at micro-batch 4 x 16 tokens (the longest training record)" in msg
    assert "at most head.align_steps=2 fits" in msg and "head.align_row_stride" in msg
    assert not (tmp_path / "big" / "train" / "checkpoints").exists()
    assert run_train(toy, tmp_path / "two", *extra, "head.align_steps=2", steps=1, ctx=dist_ctx)["steps"] == 1


def test_eagle3_learns_every_unrolled_step(toy3, tmp_path, dist_ctx):
    """EAGLE-3 on the learnable toy: loss falls, every unrolled step's accuracy is logged and rises, the eval reports
    per-step chain accuracy, simulated acceptance and the training-time-test accuracies; the draft vocabulary is
    the 100 most frequent loss tokens and is saved with the head."""
    out = tmp_path / "run"
    summary = run_train(toy3, out, "train.lr=3e-3", "logging.log_every=10", "train.eval_every=40", steps=120,
                        ctx=dist_ctx)
    logs = [json.loads(line) for line in (out / "train" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in logs if "train/loss" in r]
    assert losses[-1] < 0.7 * losses[0], losses
    for j in (1, 2, 3):
        acc = [r[f"train/step{j}_acc"] for r in logs if f"train/step{j}_acc" in r]
        assert len(acc) == 12 and acc[-1] > acc[0] + 0.1, (j, acc)
    ev = summary["eval"]
    assert {f"eval/step{j}_acc" for j in range(1, 6)} | {f"eval/ttt_step{j}_acc" for j in (1, 2, 3)} <= set(ev)
    assert ev["eval/top1"] > 0.03 and 1.0 < ev["eval/sim_accept_len"] <= 6.0, ev  # 8x chance; 100 of 256 tokens draftable
    assert ev["eval/feature_loss"] == 0.0
    assert summary["head_kind"] == "eagle3" and summary["draft_vocab_size"] == 100 and summary["aux_layers"] == [1, 2, 3]
    assert summary["distinct_loss_tokens"] == 256 and 0.3 < summary["draft_vocab_coverage"] < 1.0
    from data_prep.feature_cache import FeatureCacheReader
    from eagle.head import load_head
    from train.data import split_train_eval
    from train.draft_vocab import build_draft_vocab, count_loss_tokens

    reader = FeatureCacheReader(toy3["cache"])
    train_idx, _ = split_train_eval(reader.ids, 0.1, 0)
    d2t, t2d = build_draft_vocab(count_loss_tokens(reader, train_idx, 256), 100)
    head = load_head(out / "head")
    assert torch.equal(head.d2t.cpu(), d2t) and torch.equal(head.t2d.cpu(), t2d)


def test_peagle_learns_every_parallel_position(toy3, tmp_path, dist_ctx):
    """P-EAGLE on the EAGLE-3 toy cache (the same cache serves it): loss falls, each of the 3 positions of the one
    forward learns, the eval reports them; head.mask_token_id=-1 picks the rarest training loss token (every id occurs
    in this toy), saved in the head's config with the learned mask_hidden."""
    out = tmp_path / "run"
    summary = run_train({**toy3, "extra": PEAGLE}, out, "train.lr=3e-3", "logging.log_every=10",
                        "train.eval_every=40", steps=120, ctx=dist_ctx)
    logs = [json.loads(line) for line in (out / "train" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["train/loss"] for r in logs if "train/loss" in r]
    assert losses[-1] < 0.7 * losses[0], losses
    for j in (1, 2, 3):
        acc = [r[f"train/step{j}_acc"] for r in logs if f"train/step{j}_acc" in r]
        # position 1 is EAGLE-3's step 1; positions 2-3 predict 2-3 tokens ahead from the mask inputs only (seen at
        # every other index): on this toy they rise from chance (1/256) to several times it
        gain = 0.05 if j == 1 else 0.03
        assert len(acc) == 12 and acc[-1] > acc[0] + gain, (j, acc)
    ev = summary["eval"]
    assert {f"eval/parallel_step{j}_acc" for j in (1, 2, 3)} <= set(ev)
    from data_prep.feature_cache import FeatureCacheReader
    from eagle.head import load_head
    from eagle.peagle import PeagleHead
    from train.data import split_train_eval
    from train.draft_vocab import count_loss_tokens

    reader = FeatureCacheReader(toy3["cache"])
    train_idx, _ = split_train_eval(reader.ids, 0.1, 0)
    rarest = int(count_loss_tokens(reader, train_idx, 256).argmin())
    head = load_head(out / "head")
    assert type(head) is PeagleHead and head.mask_token_id == rarest == summary["mask_token_id"]
    assert summary["head_kind"] == "peagle" and head.mask_hidden.shape == (1, 3 * head.config.hidden_size)
    config = json.loads((out / "head" / "config.json").read_text())
    assert config["mask_token_id"] == rarest and config["architectures"] == ["PeagleLlamaForCausalLM"]
    explicit = run_train({**toy3, "extra": PEAGLE}, tmp_path / "explicit", "head.mask_token_id=7", steps=2, ctx=dist_ctx)
    assert explicit["mask_token_id"] == 7 and load_head(tmp_path / "explicit" / "head").mask_token_id == 7


@pytest.mark.numeric
def test_eagle3_online_mode_computes_the_aux_layers_in_the_loop(toy3, tmp_path, dist_ctx):
    """Online EAGLE-3: the target's aux-layer + final states computed in the loop equal the cached ones, so the run
    trains exactly like offline on the same records."""
    from data_prep.feature_cache import FeatureCacheReader
    from data_prep.tokenized import write_tokenized
    from train.data import collate
    from train.frozen_target import load_frozen_target
    from recipes import load_config

    reader = FeatureCacheReader(toy3["cache"])
    recs = [{"id": r["id"], "input_ids": r["input_ids"].tolist(), "loss_mask": r["loss_mask"].tolist()} for r in reader]
    write_tokenized(tmp_path / "tok.jsonl", recs)
    cfg = load_config("tiny", [f"target.path={toy3['target']}", "target.dtype=float32"])
    frozen, _ = load_frozen_target("online", cfg.target, str(toy3["target"]), torch.device("cpu"), torch.float32,
                                   [1, 2, 3, 4])
    batch = collate([reader[0], reader[1]])
    online = frozen.features(batch)  # [2, T, 4H]
    real = batch.attention_mask.bool()
    assert online.shape == batch.hidden.shape
    # the cache holds the same forward of the 4-layer target (float32): rounding apart
    assert_same_function(online[real], batch.hidden[real], terms=128, chained=4 * LAYER_REDUCTIONS + 1)
    summary = run_train(toy3, tmp_path / "run", "train.mode=online", f"train.tokenized={tmp_path / 'tok.jsonl'}",
                        "target.dtype=float32", steps=3, ctx=dist_ctx)
    assert summary["mode"] == "online" and summary["eval"]["eval/positions"] > 0


def test_eagle2_cache_is_rejected_by_an_eagle3_recipe(toy, toy3, tmp_path, dist_ctx):
    from train.frozen_target import CacheMismatchError

    cache = write_cache(tmp_path / "cache", toy3["target"], n=8)  # final states only
    with pytest.raises(CacheMismatchError, match=r"hidden-state layers final only \(EAGLE-2\) \(cache\) != \[1, 2, 3, 4\]"):
        run_train(toy3, tmp_path / "run", f"train.cache_dir={cache}", ctx=dist_ctx)
    with pytest.raises(CacheMismatchError, match=r"\[1, 2, 3, 4\] \(cache\) != final only"):  # and the other way round
        run_train(toy, tmp_path / "run2", f"target.path={toy3['target']}", f"train.cache_dir={toy3['cache']}", ctx=dist_ctx)


# ----------------------------------------------------------------------------- errors before training
def test_cache_from_another_target_is_rejected(toy, tmp_path, dist_ctx):
    from train.frozen_target import CacheMismatchError

    other = save_target(tmp_path / "other-target", hidden_size=32, num_heads=2, num_kv_heads=1)
    with pytest.raises(CacheMismatchError) as e:
        run_train(toy, tmp_path / "run", f"target.path={other}", ctx=dist_ctx)
    msg = str(e.value)
    assert "hidden_size 64 (cache) != 32 (target)" in msg and "other-target" in msg and "config_hash" in msg
    assert not (tmp_path / "run" / "train" / "checkpoints").exists()


def test_cache_with_other_vocab_is_rejected(toy, tmp_path, dist_ctx):
    from train.frozen_target import CacheMismatchError

    cache = write_cache(tmp_path / "cache", toy["target"], n=8, meta_override={"vocab_size": 999})
    with pytest.raises(CacheMismatchError, match="vocab_size 999"):
        run_train(toy, tmp_path / "run", f"train.cache_dir={cache}", ctx=dist_ctx)


def test_non_finite_loss_is_skipped_then_aborts(toy, tmp_path, dist_ctx):
    from train.main import NonFiniteLossError

    cache = write_cache(tmp_path / "nan1", toy["target"], n=24, nan_ids=("r0003",))
    with pytest.warns(RuntimeWarning, match=r"non-finite loss .*'r0003'"):
        summary = run_train(toy, tmp_path / "a", f"train.cache_dir={cache}", "train.eval_fraction=0",
                            "train.micro_batch_size=1", steps=24, ctx=dist_ctx)
    assert summary["skipped_micro_batches"] == 1
    all_nan = write_cache(tmp_path / "nan_all", toy["target"], n=8, nan_ids=tuple(f"r{i:04d}" for i in range(8)))
    with pytest.raises(NonFiniteLossError, match="3 non-finite losses in a row"):
        run_train(toy, tmp_path / "b", f"train.cache_dir={all_nan}", "train.max_bad_steps=3", "train.micro_batch_size=1",
                  ctx=dist_ctx)


def test_fp16_on_cpu_is_a_clear_error(toy, tmp_path, dist_ctx):
    with pytest.raises(ValueError, match="fp16 on CPU"):
        run_train(toy, tmp_path / "run", "train.precision=fp16", ctx=dist_ctx)


# ----------------------------------------------------------------------------- online mode, bf16, zero-3
def test_online_mode_runs_the_target_in_the_loop(toy, tmp_path, dist_ctx):
    from data_prep.tokenized import write_tokenized
    from test_train_helpers import toy_sequences

    recs = [{"id": f"t{i}", "input_ids": s.tolist(), "loss_mask": [0, 0] + [1] * (len(s) - 2)}
            for i, s in enumerate(toy_sequences(40, seed=1))]
    write_tokenized(tmp_path / "tok.jsonl", recs)
    summary = run_train(toy, tmp_path / "run", "train.mode=online", f"train.tokenized={tmp_path / 'tok.jsonl'}",
                        "target.dtype=float32", "train.live_tau_prompts=2", "train.live_tau_max_new_tokens=6",
                        steps=4, ctx=dist_ctx)
    assert summary["mode"] == "online" and summary["steps"] == 4 and summary["eval"]["eval/positions"] > 0
    assert summary["eval"]["eval/live_prompts"] == 2 and summary["eval"]["eval/live_tau"] >= 1.0  # reuses the loop's target


def test_bf16_zero3_trains_and_exports(toy, tmp_path, dist_ctx):
    summary = run_train(toy, tmp_path / "run", "train.precision=bf16", "train.zero_stage=3", "export.dtype=bfloat16",
                        steps=4, ctx=dist_ctx)
    assert summary["steps"] == 4
    sd = load_file(tmp_path / "run" / "head" / "model.safetensors")
    assert all(v.dtype == torch.bfloat16 for v in sd.values()) and sd["fc.weight"].abs().sum() > 0


def test_offline_mode_never_loads_the_whole_target(toy, tmp_path, dist_ctx, monkeypatch):
    import transformers

    def refuse(*a, **k):
        raise AssertionError("offline training must read only the embedding and lm_head tensors")

    for cls in (transformers.AutoModelForCausalLM, transformers.AutoModel, transformers.LlamaForCausalLM):
        monkeypatch.setattr(cls, "from_pretrained", refuse)
    assert run_train(toy, tmp_path / "run", steps=2, ctx=dist_ctx)["steps"] == 2


def test_live_tau_logs_real_tree_decoding_during_training(toy, tmp_path, dist_ctx):
    """train.live_tau_prompts: the trainer decodes held-out prompts with the real EAGLE-2 tree at each eval."""
    summary = run_train(toy, tmp_path / "run", "train.live_tau_prompts=3", "train.live_tau_max_new_tokens=8",
                        "train.eval_every=2", "decoding.total_token=8", "decoding.depth=3", "decoding.top_k=2",
                        "target.dtype=float32", steps=4, ctx=dist_ctx)
    ev = summary["eval"]
    assert ev["eval/live_prompts"] == 3 and ev["eval/live_new_tokens"] > 0
    assert 1.0 <= ev["eval/live_tau"] <= 4.0  # accepted (<= depth 3) + bonus per round
    assert ev["eval/live_rounds"] >= ev["eval/live_new_tokens"] / 4.0
    assert 0.0 <= ev["eval/live_alpha_1"] <= 1.0
    # measuring must not perturb training (RNG stream, weights, dtype): same head as a run without it
    run_train(toy, tmp_path / "plain", "train.eval_every=2", "target.dtype=float32", steps=4, ctx=dist_ctx)
    a, b = load_file(tmp_path / "run" / "head" / "model.safetensors"), load_file(tmp_path / "plain" / "head" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_live_tau_prompts_are_the_turns_before_the_trained_tokens():
    from train.live_tau import RAW_TEXT_PROMPT_TOKENS, live_prompts

    def rec(ids, mask):
        return {"input_ids": torch.tensor(ids), "loss_mask": torch.tensor(mask)}

    records = [rec([5, 6, 7, 8], [0, 0, 1, 1]),  # conversation: the user turn is the prompt
               rec([1, 2, 3], [0, 0, 0]),  # nothing trained on: skipped
               rec(list(range(40)), [1] * 40),  # raw text: its first tokens are the prompt
               rec([9, 9], [0, 1])]
    assert live_prompts(records, 5) == [[5, 6], list(range(RAW_TEXT_PROMPT_TOKENS)), [9]]
    assert live_prompts(records, 1) == [[5, 6]]


@pytest.mark.numeric
def test_eval_head_reproduces_the_trainers_final_eval(any_toy, tmp_path, dist_ctx):
    from train.eval_head import evaluate_head
    from recipes import load_config

    toy = any_toy
    summary = run_train(toy, tmp_path / "run", "export.dtype=float32", steps=4, ctx=dist_ctx)
    cfg = load_config("tiny", overrides(toy["target"], tmp_path / "run", f"train.cache_dir={toy['cache']}",
                                        *toy.get("extra", ()), steps=4))
    got = evaluate_head(cfg, str(tmp_path / "run" / "head"))
    assert got["eval_records"] > 0
    n = got["eval/positions"]
    for key, value in summary["eval"].items():
        if isinstance(value, int):  # counts
            assert got[key] == value, key
            continue
        # the same evaluation twice: a head forward + lm_head (float32), then sums over n positions
        assert_same_function(float(got[key]), float(value), terms=max(n, 128), chained=LAYER_REDUCTIONS + 3,
                             magnitude=abs(value), dtype=torch.float32, msg=key)


# ----------------------------------------------------------------------------- export
def test_export_is_official_format_and_loads(toy, tmp_path, dist_ctx):
    from eagle import EaModel, EagleHead
    from eagle.head import load_target_embedding_and_lm_head

    out = tmp_path / "run"
    run_train(toy, out, "export.legacy_bin=true", "head.bias=false", steps=3, ctx=dist_ctx)
    head_dir = out / "head"
    sd = load_file(head_dir / "model.safetensors")
    expected = {"embed_tokens.weight", "fc.weight", "layers.0.post_attention_layernorm.weight",
                *(f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"),
                *(f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down"))}
    assert set(sd) == expected  # head.bias=false: no fc.bias, like the released Llama-3 heads
    cfg = json.loads((head_dir / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 1 and cfg["bias"] is False and cfg["architectures"] == ["LlamaForCausalLM"]
    legacy = torch.load(head_dir / "pytorch_model.bin", weights_only=True)
    assert legacy.keys() == sd.keys()
    emb, _ = load_target_embedding_and_lm_head(toy["target"])
    assert torch.equal(sd["embed_tokens.weight"], emb.float())  # the frozen target embedding, unchanged
    head = EagleHead.from_pretrained(head_dir)
    assert torch.equal(head.fc.weight, sd["fc.weight"])
    model = EaModel.from_pretrained(base_model_path=str(toy["target"]), ea_model_path=str(head_dir),
                                    total_token=8, depth=3, top_k=2, torch_dtype=torch.float32)
    prompt = torch.tensor([[5, 8, 11, 14]])
    ids = model.eagenerate(prompt, temperature=0.0, max_new_tokens=8)
    assert torch.equal(ids, model.naivegenerate(prompt, temperature=0.0, max_new_tokens=8))


# ----------------------------------------------------------------------------- batching
def test_grouped_batches_pad_less_and_replay_exactly():
    from train.batching import MicroBatchPlan

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(5, 500, (1000,), generator=g).tolist()
    grouped = MicroBatchPlan(lengths, 4, seed=1, strategy="grouped", group_size=32)
    padded = MicroBatchPlan(lengths, 4, seed=1, strategy="padded")
    assert grouped.padding_fraction() < 0.05 < 0.3 < padded.padding_fraction()
    assert grouped.epoch(3) == MicroBatchPlan(lengths, 4, seed=1, strategy="grouped", group_size=32).epoch(3)
    assert grouped.epoch(0) != grouped.epoch(1)
    seen = sorted(i for b in grouped.epoch(0) for i in b)
    assert seen == list(range(1000))  # every record once per epoch
    ranks = [MicroBatchPlan(lengths, 4, seed=1, world_size=2, rank=r) for r in range(2)]
    assert ranks[0].per_epoch == ranks[1].per_epoch
    r0 = {i for b in ranks[0].epoch(0) for i in b}
    r1 = {i for b in ranks[1].epoch(0) for i in b}
    assert not r0 & r1 and len(r0 | r1) == 1000



def test_global_order_does_not_depend_on_how_the_global_batch_splits():
    """2 ranks x grad_accum 1 and 1 rank x grad_accum 2 (and 4 x 1 vs 2 x 2) train on the same micro-batches at every
    optimizer step: the order depends on the global batch only, so a checkpoint resumes on another number of ranks."""
    from train.batching import MicroBatchPlan

    lengths = torch.randint(5, 500, (301,), generator=torch.Generator().manual_seed(0)).tolist()

    def steps(world, accum, epoch=0):  # per optimizer step: the set of micro-batches over all ranks
        plans = [MicroBatchPlan(lengths, 4, seed=1, world_size=world, rank=r, grad_accum=accum) for r in range(world)]
        per_rank = [p.epoch(epoch) for p in plans]
        return [sorted(map(tuple, sum((b[s * accum:(s + 1) * accum] for b in per_rank), [])))
                for s in range(len(per_rank[0]) // accum)]

    assert steps(2, 1) == steps(1, 2) and steps(4, 1) == steps(2, 2) == steps(1, 4)
    assert steps(2, 1, epoch=1) == steps(1, 2, epoch=1) != steps(2, 1)
    assert steps(2, 1) != steps(4, 1)


@pytest.mark.parametrize("before,after", [((2, 1), (1, 1)), ((1, 2), (4, 1)), ((3, 1), (2, 2))])
def test_resumed_epoch_sees_every_record_once_whatever_the_new_global_batch(before, after):
    """A run stops inside an epoch (any step); the rest of that epoch on another world size / grad_accum trains every
    remaining micro-batch once (only the < new-global-batch tail is dropped, as at any epoch end)."""
    from train.batching import MicroBatchPlan

    lengths = torch.randint(5, 500, (203,), generator=torch.Generator().manual_seed(1)).tolist()
    (w0, a0), (w1, a1) = before, after
    old = [MicroBatchPlan(lengths, 2, seed=3, world_size=w0, rank=r, grad_accum=a0) for r in range(w0)]
    new = [MicroBatchPlan(lengths, 2, seed=3, world_size=w1, rank=r, grad_accum=a1) for r in range(w1)]
    done = 7 * a0  # every rank trained 7 optimizer steps
    first = [b for p in old for _, b in p.segment(0)[:done]]
    start = old[0].consumed(0, done)
    assert start == 7 * w0 * a0 and all(p.consumed(0, done) == start for p in old)
    rest = [b for p in new for _, b in p.segment(0, start, old[0].step_size)]
    seen = [i for b in first + rest for i in b]
    assert len(seen) == len(set(seen))  # nothing twice
    order = old[0].global_epoch(0)
    dropped = (len(order) - start) % new[0].step_size
    assert len(seen) == sum(len(b) for b in order[:len(order) - dropped])  # nothing lost but the short tail


def test_split_is_stable_per_record_id():
    from train.data import split_train_eval

    ids = [f"rec{i}" for i in range(2000)]
    tr, ev = split_train_eval(ids, 0.05, seed=0)
    assert 60 < len(ev) < 140 and not set(tr) & set(ev) and len(tr) + len(ev) == 2000
    tr2, ev2 = split_train_eval(ids + [f"new{i}" for i in range(500)], 0.05, seed=0)
    assert set(ev) <= set(ev2)  # adding data never moves an old record across the split
    assert split_train_eval(ids[:3], 0.01, seed=0)[1]  # at least one eval record


# ----------------------------------------------------------------------------- metrics
@pytest.mark.numeric
def test_chain_rollout_matches_step_by_step_drafting():
    """The KV-cached rollout (all chains of a record at once) drafts exactly what feeding each chain to the
    head one step at a time with a growing prefix drafts."""
    from eagle.head import EagleHead, HeadConfig
    from train.held_out import chain_rollout

    torch.manual_seed(0)
    cfg = HeadConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1, vocab_size=11)
    head = EagleHead(cfg).eval()
    lm = torch.randn(11, 16)
    T, k = 12, 3
    hidden, ids = torch.randn(T, 16), torch.randint(0, 11, (T,))
    starts = [0, 5, 3, 8]
    drafts = {}
    for s in starts:  # reference: one chain at a time, plain causal forward over prefix + own predictions
        feats = hidden[: s + 1].clone()
        for j in range(1, k + 1):
            out = head(feats[None], ids[1 : s + j + 1][None])[0, -1]  # predicts f_{s+j}
            drafts[s, j] = int((out @ lm.T).argmax())
            feats = torch.cat([feats, out[None]])
    for s in starts:  # a target that agrees with chain s everywhere -> all steps correct
        top = torch.full((T,), -1)
        for j in range(1, k + 1):
            top[s + j] = drafts[s, j]
        assert chain_rollout(head, hidden, ids, top, [s], k, lm).all(), s
    top = (hidden @ lm.T).argmax(-1)
    together = chain_rollout(head, hidden, ids, top, starts, k, lm)  # [4, k]: chains must not see each other
    expected = torch.tensor([[drafts[s, j] == int(top[s + j]) for j in range(1, k + 1)] for s in starts])
    assert torch.equal(together, expected)


@pytest.mark.numeric
def test_all_fed_rollout_matches_the_shared_test_helper():
    """The every-position self-fed accuracy equals tests/tiny_models.self_fed_accuracy on the same data."""
    from tiny_models import _greedy_batch, fit_good_head, random_prompts, self_fed_accuracy, tiny_llama
    from train.held_out import all_fed_rollout

    target = tiny_llama()
    prompts = random_prompts(3)
    head = fit_good_head(target, prompts, new_tokens=12, curriculum=((20, 1, 1e-2), (5, 2, 5e-3)))  # partly fitted
    ids, mask, feats, greedy = _greedy_batch(target, prompts, 12)
    hits, counts = all_fed_rollout(head, feats, ids, mask, mask[:, 1:], greedy, 3, target.lm_head.weight)
    ref = self_fed_accuracy(head, target, prompts, new_tokens=12, depth=3)
    # the same counts; the helper divides in float32: one rounding apart
    assert_same_function(hits / counts, torch.tensor(ref, dtype=torch.float64), terms=1, dtype=torch.float32)
    assert ref[0] > 0.3 and min(ref) < 1.0


def test_noise_kinds():
    from train.loss import add_input_noise

    x = torch.zeros(4000, 8)
    u = add_input_noise(x, "uniform", 0.2)
    assert u.abs().max() <= 0.1 and u.std() > 0.05
    n = add_input_noise(x, "gaussian", 0.2)
    assert abs(float(n.std()) - 0.2) < 0.01
    assert add_input_noise(x, "none", 0.2) is x


# ----------------------------------------------------------------------------- tracking
def test_wandb_without_mode_or_credentials_logs_offline(tmp_path, monkeypatch):
    from recipes import load_config
    from train.tracking import Tracker

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc credentials
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    cfg = load_config("tiny", ["logging.backend=wandb,tensorboard"])
    tracker = Tracker(cfg, tmp_path / "logs", enabled=True)
    assert tracker._wandb is not None and tracker._wandb.settings.mode == "offline"
    tracker.log({"train/loss": 1.5, "bad": float("nan")}, step=3)
    tracker.close()
    rec = json.loads((tmp_path / "logs" / "metrics.jsonl").read_text())
    assert rec["step"] == 3 and rec["train/loss"] == 1.5 and "bad" not in rec
    assert list((tmp_path / "logs" / "wandb").glob("offline-run-*"))


# ----------------------------------------------------------------------------- Hub
def test_push_dry_run_stages_exactly_the_upload(toy, tmp_path, dist_ctx, monkeypatch):
    import huggingface_hub.constants

    from export.hub import HubPushError, push_to_hub
    from recipes import load_config

    out = tmp_path / "run"
    run_train(toy, out, "train.lr=3e-3", steps=3, ctx=dist_ctx)
    (out / "eval").mkdir()  # what the evaluation writes
    (out / "eval" / "report.json").write_text(json.dumps({"meta": {"questions": "q.jsonl"}, "summaries": [
        {"method": "eagle2", "category": "overall", "tau": {"value": 2.5}, "tokens_per_s": {"value": 90.0},
         "speedup": {"value": 1.8}}]}))
    (out / "eval" / "report.md").write_text("# Evaluation\n")
    (out / "eval" / "tau_by_category.png").write_bytes(b"\x89PNG fake")
    cfg = load_config("tiny", [f"target.path={toy['target']}", f"output_dir={out}", f"train.cache_dir={toy['cache']}",
                               "export.repo_id=someone/eagle2-tiny"])
    result = push_to_hub(cfg, dry_run=True)
    assert result["files"] == ["README.md", "config.json", "eval/report.json", "eval/report.md",
                               "eval/tau_by_category.png", "model.safetensors", "recipe.yaml", "train_summary.json"]
    card = (out / "hub_upload" / "README.md").read_text()
    assert f'base_model_path="{toy["target"]}"' in card and 'ea_model_path="someone/eagle2-tiny"' in card
    assert "| eagle2 | 2.50 | 90.0 | 1.80 |" in card and "![tau_by_category](eval/tau_by_category.png)" in card
    assert "lr 0.003" in card  # the recipe the head was trained with, not this command's
    assert "simulated acceptance length" in card
    # the CLI, under its documented name: --dry-run lists the staged files
    proc = subprocess.run([sys.executable, "-m", "train.hub", "--recipe", "tiny", f"output_dir={out}",
                           "export.repo_id=someone/eagle2-tiny", "--dry-run"], env=subprocess_env(), cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "would upload to someone/eagle2-tiny (private)" in proc.stdout and "  model.safetensors  (" in proc.stdout
    # no token / no network: clear errors, the staged upload stays
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with pytest.raises(HubPushError, match="set the environment variable HF_TOKEN"):
        push_to_hub(cfg)
    monkeypatch.setenv("HF_TOKEN", "hf_not_a_real_token")
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    with pytest.raises(HubPushError, match="could not push to the Hub repo 'someone/eagle2-tiny'") as e:
        push_to_hub(cfg)
    assert str(out / "hub_upload") in str(e.value) and (out / "hub_upload" / "model.safetensors").exists()


def test_push_after_training_runs_the_hub_command_and_reports_its_error(toy, tmp_path, dist_ctx):
    """export.push_to_hub: after the export, rank 0 runs the export stage's Hub push on the exported folder (its
    recipe.yaml); its one-line error (here: no token) becomes the run's, and the exported head stays."""
    from eagle.cli_errors import UserError

    out = tmp_path / "run"
    with pytest.raises(UserError, match="the Hub push failed: no Hub token: set the environment variable "
                                        "EAGLE_TEST_NO_SUCH_TOKEN") as e:
        run_train(toy, out, "export.push_to_hub=true", "export.repo_id=someone/eagle2-tiny",
                  "export.token_env=EAGLE_TEST_NO_SUCH_TOKEN", steps=2, ctx=dist_ctx)
    assert f"the head is exported to {out / 'head'}" in str(e.value)
    assert (out / "head" / "model.safetensors").exists() and (out / "hub_upload" / "README.md").exists()


# ----------------------------------------------------------------------------- real pretrained target (../shared)
@pytest.mark.shared
def test_stories260k_recipe_on_a_corpus_cache(shared_dir, tmp_path, dist_ctx):
    """train.corpus_cache + the stories260k recipe on a few TinyStories paragraphs with the real stories260K."""
    from data_prep.corpus_cache import build_corpus_cache
    from recipes import load_config
    from train.main import train

    target = shared_dir / "models" / "stories260K"
    cfg = load_config("stories260k", [f"target.path={target}", f"output_dir={tmp_path}", "train.max_steps=4",
                                      "train.eval_max_records=4", "logging.backend=none", "logging.progress=false"])
    manifest = build_corpus_cache(cfg, shared_dir / "data" / "corpora" / "tinystories_val_a.txt", first=40, progress=False)
    assert manifest["num_records"] == 40 and manifest["num_tokens"] == manifest["num_loss_tokens"]
    again = build_corpus_cache(cfg, shared_dir / "data" / "corpora" / "tinystories_val_a.txt", first=40, progress=False)
    assert again["num_records"] == 40  # resumable: nothing added twice
    summary = train(cfg, dist_ctx)
    assert summary["steps"] == 4 and 0 < summary["eval"]["eval/top1"] <= 1


@pytest.mark.shared
def test_on_policy_corpus_cache_holds_the_targets_greedy_continuations(shared_dir, tmp_path):
    """--continue-with-target: opening sentence (no loss) + the target's own greedy continuation (loss)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from data_prep.feature_cache import FeatureCacheReader
    from data_prep.corpus_cache import build_corpus_cache, opening_sentence, read_paragraphs
    from recipes import load_config

    target = shared_dir / "models" / "stories260K"
    text = shared_dir / "data" / "corpora" / "tinystories_val_a.txt"
    cfg = load_config("stories260k", [f"target.path={target}", f"output_dir={tmp_path}"])
    manifest = build_corpus_cache(cfg, text, first=5, batch_size=4, progress=False, continue_tokens=24)
    assert manifest["num_records"] == 5 and 0 < manifest["num_loss_tokens"] < manifest["num_tokens"]
    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    reader = FeatureCacheReader(tmp_path / "data" / "features")
    for i, para in enumerate(read_paragraphs(text, 5)):
        rec = reader[reader.ids.index(f"p{i:06d}")]
        prompt = tok(opening_sentence(para), return_tensors="pt").input_ids
        n = prompt.shape[1]
        assert rec["input_ids"][:n].tolist() == prompt[0].tolist() and rec["loss_mask"][:n].sum() == 0
        greedy = model.generate(prompt, max_new_tokens=24, do_sample=False, eos_token_id=[1, 2], pad_token_id=0)[0, n:]
        cont = rec["input_ids"][n:].tolist()
        assert cont == greedy[: len(cont)].tolist() and rec["loss_mask"][n:].all()


@pytest.mark.numeric
def test_eagle3_loss_scores_step_j_at_index_t_against_t_plus_j_minus_1():
    """The per-step soft CE over the draft vocabulary, position by position: step j >= 2 only at `rows`, masked when
    t + j - 1 runs off the sequence or is no loss position; a hit needs the mapped draft token = the full argmax."""
    from transformers import LlamaConfig

    from eagle.head import Eagle3Head, head_config_from_target
    from train.head_kinds import DraftVocabTargets
    from train.loss import draft_loss

    torch.manual_seed(0)
    tc = LlamaConfig(num_hidden_layers=4, hidden_size=16, intermediate_size=32, num_attention_heads=2, vocab_size=32)
    head = Eagle3Head(head_config_from_target(tc, kind="eagle3", aux_layers=[1, 2, 3], draft_vocab_size=8))
    head.set_vocab(torch.tensor([3, 3, 5, 5, 9, 9, 9, 20]))  # target ids 3, 4, 7, 8, 13, 14, 15, 27
    B, T, H, Vd = 2, 9, 16, 8
    rows = torch.tensor([0, 3, 6, 8])
    hiddens = [torch.randn(B, T, H), torch.randn(B, 4, H), torch.randn(B, 4, H)]
    probs = torch.randn(B, T, Vd).softmax(-1)
    draft_top = torch.stack([head.draft_logits(h).argmax(-1) for h in hiddens[:1]])[0]  # [B, T]
    top = head.map_to_target(draft_top)  # step 1's argmax is right everywhere...
    top[0, 2] = 0  # ...but at one position, where the target's argmax is outside the draft vocabulary
    weights = torch.ones(B, T, dtype=torch.long)
    weights[1, 5] = 0
    w = [1.0, 0.5, 0.25]
    out = draft_loss(hiddens, weights, DraftVocabTargets(head, probs, top, len(hiddens)), w, rows=rows)
    expect, counts, hits = 0.0, [], []
    for j, h in enumerate(hiddens, start=1):
        idx = list(range(T)) if j == 1 else rows.tolist()
        terms, hit = [], 0
        for b in range(B):
            for r, t in enumerate(idx):
                u = t + j - 1
                if u >= T or not weights[b, u]:
                    continue
                logp = head.draft_logits(h[b, r]).float().log_softmax(-1)
                terms.append(-(probs[b, u] * logp).sum())
                hit += int(head.map_to_target(logp.argmax()) == top[b, u])
        expect += w[j - 1] * torch.stack(terms).mean()
        counts.append(len(terms))
        hits.append(hit)
    assert out.step_counts == counts == [17, 6, 5]
    assert out.step_hits == hits and out.step_hits[0] == 16  # the out-of-vocabulary argmax is a miss
    assert out.topk_correct[0] == 16 and out.positions == 17
    # the same loss summed in another order: log_softmax over the vocabulary, the soft CE, means and the step weights
    assert_same_function(out.loss, expect, terms=VOCAB, chained=5)
    out.loss.backward()
    assert head.lm_head.weight.grad is not None and head.fc.weight.grad is None  # fc is not in these hiddens' graph
