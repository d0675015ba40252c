"""Fault tier, cache and heads classes (+ no code execution from any file the project loads): damaged or mismatched
feature caches, head folders and training checkpoints are one-line errors naming the file; a crafted pickle never
runs (its marker file is never created) on any load path; the run folder is unchanged by every failing command."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from fault_helpers import (assert_one_line_error, assert_unchanged, proves_code_execution, run_cli, snapshot, world,  # noqa: F401
                           write_malicious)
from test_train_helpers import overrides, save_target, write_cache


@pytest.fixture(scope="module")
def toy(tmp_path_factory, world):  # noqa: F811
    """Target, feature cache, a random head folder and a stopped run with checkpoints (its good state)."""
    from eagle.head import EagleHead, head_config_from_target
    from transformers import AutoConfig
    from train.main import main

    root = tmp_path_factory.mktemp("files")
    target = save_target(root / "target")
    cache = write_cache(root / "cache", target, n=24)
    head_dir = root / "head"
    EagleHead(head_config_from_target(AutoConfig.from_pretrained(target))).save_pretrained(head_dir)
    run = root / "run"
    assert main(["--recipe", "tiny", *overrides(target, run, f"train.cache_dir={cache}", "train.stop_after=2",
                                                "train.precision=fp32", "train.zero_stage=2", steps=4)]) == 0
    return {"root": root, "target": target, "cache": cache, "head": head_dir, "run": run}


def copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def train_cli(toy, run, cache, capsys, *extra):
    from train.main import main

    return run_cli(main, ["--recipe", "tiny", *overrides(toy["target"], run, f"train.cache_dir={cache}",
                                                         "train.precision=fp32", "train.zero_stage=2", *extra, steps=4)],
                   capsys)


def part_file(cache):
    return next((cache / "parts").glob("*.json"))


def edit_part(cache, fn):
    p = part_file(cache)
    part = json.loads(p.read_text())
    fn(part)
    p.write_text(json.dumps(part))


def shard_file(cache):
    return next((cache / "shards").glob("*.safetensors"))


def swap_lengths(part):
    s = part["shards"][0]
    i = next(k for k in range(len(s["lengths"]) - 1) if s["lengths"][k] != s["lengths"][k + 1])
    s["lengths"][i], s["lengths"][i + 1] = s["lengths"][i + 1], s["lengths"][i]


def flip_byte(path, where=-100):
    b = bytearray(path.read_bytes())
    b[where] ^= 0xFF
    path.write_bytes(bytes(b))


CACHE_FAULTS = [  # (id, damage(cache), extra overrides, needles)
    ("missing-dir", lambda c: shutil.rmtree(c), [], ["does not exist"]),
    ("truncated-shard", lambda c: shard_file(c).write_bytes(shard_file(c).read_bytes()[:-10]), [], ["truncated"]),
    ("bit-flip", lambda c: flip_byte(shard_file(c)), [], ["corrupt: sha256"]),
    ("missing-shard", lambda c: shard_file(c).unlink(), [], ["is missing"]),
    ("lengths", lambda c: edit_part(c, swap_lengths), [], ["does not match its manifest", "per-record lengths"]),
    ("ids", lambda c: edit_part(c, lambda p: p["shards"][0]["ids"].reverse()), [], ["record ids differ"]),
    ("missing-key", lambda c: edit_part(c, lambda p: p["shards"][0].pop("lengths")), [], ["inconsistent", "lengths"]),
    ("escape", lambda c: edit_part(c, lambda p: p["shards"][0].update(file="../../x.safetensors")), [], ["outside"]),
    ("num-records", lambda c: edit_part(c, lambda p: p["shards"][0].update(num_records=3)), [], ["num_records=3"]),
    ("part-json", lambda c: part_file(c).write_text("{"), [], ["parts", "not valid JSON", "rerun data_prep"]),
    ("header-size-only", lambda c: flip_byte(shard_file(c), 12), ["train.verify_cache=size"], ["cannot read"]),
    ("duplicate-part", lambda c: shutil.copy(part_file(c), c / "parts" / "zz.json"), [], ["duplicated record ids"]),
]


@pytest.mark.parametrize("name,damage,extra,needles", CACHE_FAULTS, ids=[c[0] for c in CACHE_FAULTS])
def test_damaged_cache_is_named_and_nothing_is_trained(toy, tmp_path, capsys, name, damage, extra, needles):
    cache = copy(toy["cache"], tmp_path / "cache")
    run = copy(toy["run"], tmp_path / "run")
    damage(cache)
    before = snapshot(run)
    code, _, err = train_cli(toy, run, cache, capsys, *extra)
    line = assert_one_line_error(code, err, *needles)
    assert "cache" in line
    assert_unchanged(before, run)


def test_cache_of_another_target_is_named(toy, tmp_path, capsys):
    other = save_target(tmp_path / "other-target", hidden_size=32, num_heads=2, num_kv_heads=1)
    vocab = write_cache(tmp_path / "vocab-cache", toy["target"], n=4, meta_override={"vocab_size": 999})
    run = copy(toy["run"], tmp_path / "run")
    before = snapshot(run)
    from train.main import main

    code, _, err = run_cli(main, ["--recipe", "tiny", *overrides(other, run, f"train.cache_dir={toy['cache']}", steps=4)],
                           capsys)
    assert_one_line_error(code, err, "does not match the recipe's target", "hidden_size 64 (cache) != 32 (target)")
    code, _, err = train_cli(toy, run, vocab, capsys)
    assert_one_line_error(code, err, "vocab_size 999")
    assert_unchanged(before, run)


# ----------------------------------------------------------------------------- heads
def head_json(d):
    return json.loads((d / "config.json").read_text())


def set_config(d, **kw):
    cfg = head_json(d)
    cfg.update(kw)
    (d / "config.json").write_text(json.dumps(cfg))


def drop_tensor(d):
    sd = load_file(d / "model.safetensors")
    sd.pop("fc.weight")
    save_file(sd, d / "model.safetensors")


def legacy_only(d, sd=None):
    sd = load_file(d / "model.safetensors") if sd is None else sd
    (d / "model.safetensors").unlink()
    torch.save(sd, d / "pytorch_model.bin")


HEAD_FAULTS = [  # (id, damage(head dir), needles)
    ("no-config", lambda d: (d / "config.json").unlink(), ["has no config.json"]),
    ("config-json", lambda d: (d / "config.json").write_text("{"), ["config.json", "not valid JSON"]),
    ("config-utf8", lambda d: (d / "config.json").write_bytes(b'{"hidden_size": "\xff"}'), ["config.json", "UTF-8"]),
    ("config-type", lambda d: set_config(d, hidden_size="64"), ["config.json", 'hidden_size is a string ("64"), expected an integer']),
    ("config-layers", lambda d: set_config(d, num_hidden_layers=2), ["config.json", "num_hidden_layers=2"]),
    ("config-list", lambda d: (d / "config.json").write_text("[1]"), ["config.json", "JSON object"]),
    ("config-keys", lambda d: (d / "config.json").write_text('{"hidden_size": 64}'), ["config.json", "lacks required"]),
    ("config-act", lambda d: set_config(d, hidden_act="gelu"), ["config.json", "silu"]),
    ("config-heads", lambda d: set_config(d, num_attention_heads=3, head_dim=None), ["config.json"]),
    ("truncated", lambda d: (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:-64]),
     ["model.safetensors", "truncated or corrupt"]),
    ("garbage", lambda d: (d / "model.safetensors").write_bytes(b"\x00" * 64), ["model.safetensors"]),
    ("missing-tensor", drop_tensor, ["missing keys ['fc.weight']"]),
    ("shape", lambda d: set_config(d, intermediate_size=head_json(d)["intermediate_size"] * 2), ["shape"]),
    ("vocab", lambda d: set_config(d, vocab_size=head_json(d)["vocab_size"] + 1), ["embed_tokens.weight"]),
    ("no-weights", lambda d: (d / "model.safetensors").unlink(), ["neither model.safetensors nor pytorch_model.bin"]),
    ("bin-garbage", lambda d: legacy_only(d) or (d / "pytorch_model.bin").write_bytes(b"not a zip"),
     ["pytorch_model.bin"]),
    ("bin-not-dict", lambda d: legacy_only(d, sd=[torch.zeros(1)]), ["pytorch_model.bin", "mapping"]),
]


@pytest.mark.parametrize("name,damage,needles", HEAD_FAULTS, ids=[h[0] for h in HEAD_FAULTS])
def test_bad_head_folder_is_named(toy, tmp_path, capsys, name, damage, needles):
    from train.eval_head import main

    head = copy(toy["head"], tmp_path / "head")
    damage(head)
    run = copy(toy["run"], tmp_path / "run")
    before = snapshot(run, toy["cache"])
    code, _, err = run_cli(main, ["--recipe", "tiny", "--head", head, *overrides(toy["target"], run,
                                  f"train.cache_dir={toy['cache']}", "train.precision=fp32")], capsys)
    assert_one_line_error(code, err, *needles)
    assert_unchanged(before, run, toy["cache"])


def test_head_that_does_not_fit_the_target(toy, tmp_path, capsys):
    from eagle.head import EagleHead, head_config_from_target
    from transformers import AutoConfig
    from train.eval_head import main

    other = save_target(tmp_path / "other", hidden_size=32, num_heads=2, num_kv_heads=1)
    EagleHead(head_config_from_target(AutoConfig.from_pretrained(other))).save_pretrained(tmp_path / "head")
    code, _, err = run_cli(main, ["--recipe", "tiny", "--head", tmp_path / "head", *overrides(
        toy["target"], tmp_path / "run", f"train.cache_dir={toy['cache']}", "train.precision=fp32")], capsys)
    assert_one_line_error(code, err, "does not fit the target's lm_head")


def test_evaluation_cli_names_a_truncated_head(toy, tmp_path, capsys):
    from evaluation.main import main

    head = copy(toy["head"], tmp_path / "head")
    (head / "model.safetensors").write_bytes((head / "model.safetensors").read_bytes()[:100])
    q = tmp_path / "q.txt"
    q.write_text("1 2 3\n")
    code, _, err = run_cli(main, ["--recipe", "tiny", "--base", toy["target"], "--head", head, "--questions", q,
                                  "--out", tmp_path / "eval", "target.dtype=float32"], capsys)
    assert_one_line_error(code, err, "model.safetensors", "truncated or corrupt")
    assert not (tmp_path / "eval").exists()


# ----------------------------------------------------------------------------- no code execution from files
def test_malicious_legacy_head_bin_never_runs(toy, tmp_path, capsys):
    from eagle.head import EagleHead
    from train.eval_head import main

    marker = tmp_path / "PWNED"
    head = copy(toy["head"], tmp_path / "head")
    write_malicious(head / "pytorch_model.bin", marker, load_file(head / "model.safetensors"))
    (head / "model.safetensors").unlink()
    assert proves_code_execution(head / "pytorch_model.bin", marker)
    code, _, err = run_cli(main, ["--recipe", "tiny", "--head", head, *overrides(
        toy["target"], tmp_path / "run", f"train.cache_dir={toy['cache']}", "train.precision=fp32")], capsys)
    assert_one_line_error(code, err, "pytorch_model.bin", "weights-only")
    with pytest.raises(ValueError, match="weights-only"):
        EagleHead.from_pretrained(head)
    assert not marker.exists()


def test_malicious_init_from_head_never_runs(toy, tmp_path, capsys):
    marker = tmp_path / "PWNED"
    head = copy(toy["head"], tmp_path / "head")
    write_malicious(head / "pytorch_model.bin", marker, load_file(head / "model.safetensors"))
    (head / "model.safetensors").unlink()
    run = tmp_path / "run"
    code, _, err = train_cli(toy, run, toy["cache"], capsys, f"head.init_from={head}")
    assert_one_line_error(code, err, "pytorch_model.bin")
    assert not marker.exists() and not (run / "head").exists()


CHECKPOINT_FILES = ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt", "rng_rank00000.pt"]


@pytest.mark.parametrize("name", CHECKPOINT_FILES, ids=["model-states", "optim-states", "rng"])
def test_malicious_checkpoint_never_runs_on_resume(toy, tmp_path, capsys, name):
    run = copy(toy["run"], tmp_path / "run")
    ckpt = run / "train" / "checkpoints" / "step-00000002"
    marker = tmp_path / "PWNED"
    real = torch.load(ckpt / name, weights_only=False)  # our own file, to keep every real key
    write_malicious(ckpt / name, marker, real)
    assert proves_code_execution(ckpt / name, marker)
    before = snapshot(run)
    code, _, err = train_cli(toy, run, toy["cache"], capsys)
    assert_one_line_error(code, err, name, "weights-only loader refuses")
    assert not marker.exists()
    assert_unchanged(before, run)


def test_malicious_target_bin_never_runs(toy, tmp_path, capsys):
    """The target's own weights (offline training reads its embedding/lm_head; evaluation loads the model)."""
    from eagle.head import load_target_embedding_and_lm_head

    target = copy(toy["target"], tmp_path / "target")
    marker = tmp_path / "PWNED"
    sd = load_file(target / "model.safetensors")
    (target / "model.safetensors").unlink()
    write_malicious(target / "pytorch_model.bin", marker, sd)
    with pytest.raises(Exception, match="(?i)weights.only|unpickl"):
        load_target_embedding_and_lm_head(target)
    from transformers import AutoModelForCausalLM

    with pytest.raises(Exception):
        AutoModelForCausalLM.from_pretrained(target)
    assert not marker.exists()


def test_damaged_checkpoint_and_latest_are_named(toy, tmp_path, capsys):
    run = copy(toy["run"], tmp_path / "run")
    root = run / "train" / "checkpoints"
    (root / "latest").write_text("../../../etc")
    before = snapshot(run)
    code, _, err = train_cli(toy, run, toy["cache"], capsys)
    assert_one_line_error(code, err, "latest", "expected a checkpoint tag step-NNNNNNNN")
    (root / "latest").write_text("step-00000002")
    f = root / "step-00000002" / "mp_rank_00_model_states.pt"
    f.write_bytes(f.read_bytes()[:200])
    before = snapshot(run)
    code, _, err = train_cli(toy, run, toy["cache"], capsys)
    assert_one_line_error(code, err, "mp_rank_00_model_states.pt", "unreadable")
    assert_unchanged(before, run)


def test_resume_through_the_safe_loader(toy, tmp_path, capsys):
    """ZeRO 0 here (ZeRO 2 is every resume above); ZeRO-3 bf16 in a subprocess below (it patches torch globally)."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    from train.checkpoint import weights_only_load
    from train.main import main

    run = tmp_path / "z0"
    for extra in (["train.stop_after=2"], []):
        code, out, err = run_cli(main, ["--recipe", "tiny", *overrides(
            toy["target"], run, f"train.cache_dir={toy['cache']}", "train.precision=fp32", "train.zero_stage=0",
            *extra, steps=4)], capsys)
        assert code == 0, err
    assert "resumed from" in out and (run / "head" / "model.safetensors").exists()
    # every allow-listed class round-trips through the weights-only loader
    obj = {"a": fragment_address(numel=4, start=2), "b": ZeroStageEnum.weights, "c": LossScaler(1.0)}
    torch.save(obj, tmp_path / "allowed.pt")
    back = weights_only_load(tmp_path / "allowed.pt")
    assert back["a"] == obj["a"] and back["b"] is ZeroStageEnum.weights and back["c"].cur_scale == 1.0


def test_incomplete_checkpoint_is_one_line_before_deepspeed_reads_it(toy, tmp_path, capsys):
    """A checkpoint folder with its optimizer partition removed (a copy cut short, a cleanup gone wrong) stops the
    resume with one line naming the checkpoint, the missing file, how it was written and what to do, before
    DeepSpeed reads it (on several ranks a rank that stopped inside DeepSpeed's loader would leave the others waiting
    in a collective)."""
    run = copy(toy["run"], tmp_path / "run")
    ckpt = run / "train" / "checkpoints" / "step-00000002"
    (ckpt / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    before = snapshot(run)
    code, _, err = train_cli(toy, run, toy["cache"], capsys)
    assert_one_line_error(code, err, f"checkpoint {ckpt} is incomplete", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
                          "written by 1 rank under train.zero_stage=2", "train.resume=false")
    assert_unchanged(before, run)


def test_deepspeed_failure_inside_resume_is_one_line(toy, tmp_path, capsys):
    """An optimizer partition that loads but holds something else: DeepSpeed's loader fails (a KeyError deep in its
    engine); the resume stops with one line naming the checkpoint, DeepSpeed's error, how the checkpoint was
    written, and the way back to the previous checkpoint (the exact commands) or a fresh start."""
    run = copy(toy["run"], tmp_path / "run")
    root = run / "train" / "checkpoints"
    shutil.copytree(root / "step-00000002", root / "step-00000001")  # an older checkpoint to go back to
    torch.save({"not": "an optimizer partition"}, root / "step-00000002" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    before = snapshot(run)
    code, _, err = train_cli(toy, run, toy["cache"], capsys)
    line = assert_one_line_error(code, err, f"could not resume checkpoint {root / 'step-00000002'}",
                                 "DeepSpeed's load_checkpoint failed", "KeyError",
                                 "written by 1 rank under train.zero_stage=2",
                                 f"rm -r {root / 'step-00000002'} && echo step-00000001 > {root / 'latest'}")
    assert "train.resume=false" in line
    assert_unchanged(before, run)


@pytest.mark.parametrize("damage", ["partition-missing", "partitions-mixed-up"])
def test_conversion_for_another_number_of_ranks_fails_in_one_line(toy, tmp_path, capsys, damage):
    """The ZeRO-2 checkpoint as if 2 ranks had written it (its ranks.json says so), resumed on 1 rank: converted by
    DeepSpeed's ds_to_universal first. Rank 1's partition missing: one line naming it before the converter runs;
    rank 0's partition copied as rank 1's (files mixed up between runs): the converter's own failure (a RuntimeError
    from a reshape deep inside it) as one line naming the checkpoint and what to do; no universal copy is left."""
    run = copy(toy["run"], tmp_path / "run")
    ckpt = run / "train" / "checkpoints" / "step-00000002"
    (ckpt / "ranks.json").write_text(json.dumps({"world_size": 2, "zero_stage": 2}) + "\n")
    if damage == "partitions-mixed-up":
        shutil.copy(ckpt / "zero_pp_rank_0_mp_rank_00_optim_states.pt", ckpt / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
        needles = ["could not resume checkpoint", "DeepSpeed's ds_to_universal could not convert it",
                   "written by 2 ranks under train.zero_stage=2, this run has 1 rank",
                   "rerun with that many ranks and that stage"]
    else:
        needles = [f"checkpoint {ckpt} is incomplete: zero_pp_rank_1_mp_rank_00_optim_states.pt missing",
                   "written by 2 ranks under train.zero_stage=2"]
    before = snapshot(run)
    code, _, err = train_cli(toy, run, toy["cache"], capsys)
    assert_one_line_error(code, err, *needles, "train.resume=false")
    assert_unchanged(before, run)
    assert not list((run / "train" / "checkpoints").glob("universal/step-*"))


def test_a_checkpoint_saved_again_drops_the_universal_copy_of_the_earlier_one(toy, tmp_path, capsys):
    """A step saved again (a rerun after going back to an earlier checkpoint) must not be resumed on another number
    of ranks from the universal copy made of the step's earlier checkpoint: saving drops it."""
    run = copy(toy["run"], tmp_path / "run")
    stale = run / "train" / "checkpoints" / "universal" / "step-00000004"
    stale.mkdir(parents=True)
    (stale / "complete").write_text("step-00000004")
    code, _, err = train_cli(toy, run, toy["cache"], capsys)
    assert code == 0, err[-2000:]
    assert (run / "train" / "checkpoints" / "step-00000004").is_dir() and not stale.exists()


def test_the_stage_of_a_checkpoint_written_before_ranks_json_held_it(tmp_path):
    """Older checkpoints' ranks.json holds only the world size: their ZeRO stage comes from DeepSpeed's file names
    (no optimizer partitions: 0; optimizer partitions: 1-2, the same files; model partitions: 3)."""
    from train.checkpoint import needs_universal, saved_zero_stage

    layouts = {0: ["mp_rank_00_model_states.pt"],
               1: ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"],
               3: ["zero_pp_rank_0_mp_rank_00_model_states.pt", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"]}
    for stage, names in layouts.items():
        folder = tmp_path / f"z{stage}"
        folder.mkdir()
        (folder / "ranks.json").write_text('{"world_size": 2}\n')
        for n in names:
            (folder / n).write_bytes(b"")
        assert saved_zero_stage(folder) == stage
        assert needs_universal(stage, 2, 1) == (stage > 0) and not needs_universal(stage, 2, 2)


@pytest.mark.parametrize("stage", [0, 3])
def test_resume_across_zero_stage_0_or_3_is_refused_in_one_line(toy, tmp_path, capsys, stage):
    """Stage 0 keeps the optimizer state whole in one file, stage 3 partitions the weights too; DeepSpeed moves
    optimizer state only between stages 1 and 2 (its universal loader fails with a bare AssertionError between 2 and
    3), so the ZeRO-2 checkpoint under stage 0 or 3 is refused before anything loads, naming both stages and the one
    to use."""
    run = copy(toy["run"], tmp_path / "run")
    before = snapshot(run)
    code, _, err = train_cli(toy, run, toy["cache"], capsys, f"train.zero_stage={stage}")
    assert_one_line_error(code, err, f"written under train.zero_stage=2, this run has train.zero_stage={stage}",
                          "only between ZeRO stages 1 and 2", "resume with train.zero_stage=2")
    assert_unchanged(before, run)


def test_zero2_checkpoint_resumes_under_zero1(toy, tmp_path, capsys):
    """Stages 1 and 2 write the same files: the ZeRO-2 checkpoint resumes under ZeRO-1 and ends with the head of an
    uninterrupted ZeRO-2 run, bit for bit."""
    run = copy(toy["run"], tmp_path / "run")
    code, out, err = train_cli(toy, run, toy["cache"], capsys, "train.zero_stage=1")
    assert code == 0 and "resumed from" in out, err[-2000:]
    code, _, err = train_cli(toy, tmp_path / "straight", toy["cache"], capsys)
    assert code == 0, err[-2000:]
    a, b = load_file(run / "head" / "model.safetensors"), load_file(tmp_path / "straight" / "head" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_zero3_bf16_resume_through_the_safe_loader(toy, tmp_path):
    import subprocess
    import sys

    from test_train_helpers import REPO, subprocess_env

    run = tmp_path / "z3"
    for extra in (["train.stop_after=2"], []):
        proc = subprocess.run([sys.executable, str(REPO / "train" / "main.py"), "--recipe", "tiny", *overrides(
            toy["target"], run, f"train.cache_dir={toy['cache']}", "train.precision=bf16", "train.zero_stage=3",
            *extra, steps=4)], env=subprocess_env(), capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resumed from" in proc.stdout and (run / "head" / "model.safetensors").exists()


def damage_then(action, extra):
    def setup(d):
        action(d)
        return extra
    return setup


HUB_FAULTS = [  # (id, setup(head dir) -> extra argv, needles)
    ("not-a-head", damage_then(lambda d: (d / "config.json").unlink(), ["--dry-run"]), ["is not an exported head"]),
    ("damaged-summary", damage_then(lambda d: (d / "train_summary.json").write_text("{"), ["--dry-run"]),
     ["train_summary.json", "not valid JSON"]),
    ("no-repo", damage_then(lambda d: None, ["export.repo_id=''", "--dry-run"]), ["export.repo_id is empty"]),
    ("no-token", damage_then(lambda d: None, ["export.token_env=EAGLE_TEST_NO_SUCH_TOKEN"]),
     ["no Hub token", "EAGLE_TEST_NO_SUCH_TOKEN"]),
]


@pytest.mark.parametrize("name,setup,needles", HUB_FAULTS, ids=[h[0] for h in HUB_FAULTS])
def test_hub_push_faults_are_one_line(toy, tmp_path, capsys, name, setup, needles):
    from export.hub import main

    head = copy(toy["head"], tmp_path / "head")
    extra = setup(head)
    before = snapshot(head)
    code, _, err = run_cli(main, ["--recipe", "tiny", f"output_dir={tmp_path / 'run'}", "export.repo_id=someone/head",
                                  *extra, "--head", head], capsys)
    assert_one_line_error(code, err, *needles)
    assert_unchanged(before, head)


@pytest.mark.parametrize("name,damage,needles", [
    ("invalid json", lambda p: p.write_text('{"model_type": "llama",'), ["not a valid JSON file"]),
    ("unknown model_type", lambda p: p.write_text('{"model_type": "no-such-arch"}'), ["no-such-arch"]),
])
def test_damaged_target_config_is_named(toy, tmp_path, capsys, name, damage, needles):
    """A target folder whose config.json is broken: training, data prep and evaluation each name the folder in one
    line (transformers' own error is kept in it), before any work and without touching the run folder."""
    from data_prep.main import main as data_main
    from evaluation.main import main as eval_main

    target = copy(toy["target"], tmp_path / "target")
    damage(target / "config.json")
    run = copy(toy["run"], tmp_path / "run")
    before = snapshot(run)
    common = ["--recipe", "tiny", f"target.path={target}", f"output_dir={run}"]
    code, _, err = train_cli({**toy, "target": target}, run, toy["cache"], capsys)
    assert_one_line_error(code, err, f"target config of {target}", *needles)
    from data_prep.tokenized import write_tokenized

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\n")
    prep = tmp_path / "prep"  # data prep's cache stage, its tokenized input present
    write_tokenized(prep / "data" / "tokenized.jsonl", [{"id": "r0", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}])
    for main, argv in ((data_main, ["--recipe", "tiny", f"target.path={target}", f"output_dir={prep}", "cache"]),
                       (eval_main, [*common, "--head", str(toy["head"]), "eval.max_length=64",
                                    f"eval.questions={prompts}"])):
        code, _, err = run_cli(main, argv, capsys)
        assert_one_line_error(code, err, str(target), *needles)
    assert_unchanged(before, run)


@pytest.mark.parametrize("path", ["../no_such_target", "./models/none", "/no/such/target/folder"])
def test_missing_local_target_is_named_not_a_hub_error(toy, tmp_path, capsys, monkeypatch, path):
    """A relative target path read from another directory: the path and the directory it was read from, not
    transformers' "Repo id must be in the form 'repo_name' or 'namespace/repo_name'"."""
    from train.main import main

    monkeypatch.chdir(tmp_path)
    code, _, err = run_cli(main, ["--recipe", "tiny", f"target.path={path}", f"output_dir={tmp_path / 'run'}",
                                  f"train.cache_dir={toy['cache']}"], capsys)
    line = assert_one_line_error(code, err, f"target.path {path} does not exist", str(tmp_path))
    assert "Repo id" not in line


# ----------------------------------------------------------------------------- issue 28: what a newcomer passes
@pytest.mark.parametrize("cli", ["evaluation", "eval_head"])
@pytest.mark.parametrize("path", ["/nonexistent/head", "./runs/none/head", "runs/none/head"])
def test_missing_local_head_is_named_not_a_hub_error(toy, tmp_path, capsys, monkeypatch, cli, path):
    """Item 8: a --head that looks local and does not exist: the path and the directory it was read from, before any
    target is resolved (the default target is never built for it)."""
    from evaluation.main import main as eval_main
    from train.eval_head import main as eval_head_main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("EAGLE_HOME", str(tmp_path / "home"))
    (tmp_path / "q.txt").write_text("1 2 3\n")
    main, extra = (eval_main, ["--questions", tmp_path / "q.txt"]) if cli == "evaluation" else (eval_head_main, [])
    code, _, err = run_cli(main, ["--recipe", "tiny", "--head", path, *extra, f"output_dir={tmp_path / 'run'}"], capsys)
    line = assert_one_line_error(code, err, f"head {path} does not exist", str(tmp_path))
    assert "Repo id" not in line and "Hub" not in line
    assert [p.name for p in tmp_path.iterdir()] == ["q.txt"]  # no default target build, no run folder


def _engine_folders(toy, root):
    """The toy head in every engine format (EAGLE-2 vLLM and SGLang; an EAGLE-3 head in vLLM's speculators layout)."""
    from test_engine_formats import eagle3_folder
    from transformers import AutoConfig

    from export.engine_formats import convert_eagle3_folder
    from export.head_kinds import write_engine_head

    config = AutoConfig.from_pretrained(toy["target"])
    write_engine_head(toy["head"], root / "vllm", "vllm", config)
    write_engine_head(toy["head"], root / "sglang", "sglang", config)
    eagle3_folder(root / "e3")
    convert_eagle3_folder(root / "e3", root / "vllm3", "vllm", verifier="org/target",
                          verifier_architectures=["LlamaForCausalLM"])
    return {"vllm": ("vLLM", root / "vllm"), "sglang": ("SGLang", root / "sglang"), "vllm3": ("vLLM", root / "vllm3")}


@pytest.mark.parametrize("fmt", ["vllm", "sglang", "vllm3"])
def test_engine_export_given_as_head_says_what_to_pass(toy, tmp_path, capsys, fmt):
    """Item 9: a vLLM / SGLang folder is named as an engine export with what to pass instead (not "missing keys")."""
    from evaluation.main import main as eval_main
    from train.eval_head import main as eval_head_main

    from eagle.head import load_head

    engine, folder = _engine_folders(toy, tmp_path)[fmt]
    run = tmp_path / "run"
    for main, extra in ((eval_head_main, [f"train.cache_dir={toy['cache']}"]), (eval_main, ["--questions", tmp_path / "q.txt"])):
        (tmp_path / "q.txt").write_text("1 2 3\n")
        before = snapshot(tmp_path)
        code, _, err = run_cli(main, ["--recipe", "tiny", "--head", folder, f"target.path={toy['target']}",
                                      f"output_dir={run}", *extra], capsys)
        assert_one_line_error(code, err, f"head {folder} is a {engine} engine export", "{output_dir}/head")
    with pytest.raises(Exception, match="engine export"):
        load_head(folder)
    assert_unchanged(before, tmp_path)
    load_head(toy["head"])  # the official folder still loads


@pytest.mark.parametrize("recipe_keys, needles", [
    ([], ["no data.source", "python -m train.corpus_cache --recipe tiny --text FILE"]),
    (["data.source=chats.json"], ["python data_prep/main.py --recipe tiny"]),
])
def test_missing_cache_names_the_command_that_builds_it(toy, tmp_path, capsys, recipe_keys, needles):
    """Item 10: a recipe without data.source (stories260k) builds its cache with train.corpus_cache; one with a source
    with data prep; training and eval_head say which."""
    from train.eval_head import main as eval_head_main
    from train.main import main as train_main

    run = tmp_path / "run"
    args = ["--recipe", "tiny", *overrides(toy["target"], run, *recipe_keys)]
    for main, extra in ((train_main, []), (eval_head_main, ["--head", toy["head"]])):
        code, _, err = run_cli(main, [*args, *extra], capsys)
        assert_one_line_error(code, err, f"feature cache {run / 'data' / 'features'} does not exist", *needles)
