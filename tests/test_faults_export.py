"""Fault tier, exports (issue 29): an export never destroys a good head, and every head kind and format gets the same
checks. Each case asserts the exit code, ONE stderr line naming the problem, and the good files hashed unchanged.

1. every export is written beside its destination and moved in whole (a mid-write failure: a monkeypatched weight
   writer raising after config.json, or RLIMIT_FSIZE in a subprocess); the source, a folder inside it, a folder that
   holds no head and (without --overwrite) a folder holding another head are refused; --overwrite replaces whole.
2. one set of checks before anything is written (non-finite weights, config vs weights, d2t / t2d, aux ids vs the
   target), the loader's own.
3. evaluation and serve-check warn in one line for a NaN head and for acceptance exactly 1.0, naming the head.
4. rerunning a run folder with another head kind / other shapes: one line naming both and the way out.
5. Hub staging ships recipe + training summary in every format; the card's recipe and kind are the head's."""
from __future__ import annotations

import errno
import json
import logging
import resource
import shutil
import signal
import subprocess
import sys

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import load_file, save_file

from recipes import load_config

from fault_helpers import assert_one_line_error, assert_unchanged, run_cli, snapshot, world  # noqa: F401
from test_train_helpers import overrides, save_target, subprocess_env, write_cache
from tiny_models import random_head, single_thread, tiny_target  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")
FORMATS = ("eagle", "vllm", "sglang")
KINDS = ("eagle2", "eagle3")


@pytest.fixture(scope="module")
def heads(tmp_path_factory):
    """A 4-layer tiny target and two heads of each kind (A, B: different weights), each folder with a recipe, a
    training summary and (A) a tree_config.json as the trainer's export leaves them."""
    root = tmp_path_factory.mktemp("export")
    target = tiny_target("llama", num_layers=4)
    target.save_pretrained(root / "target")
    out = {"root": root, "target": root / "target"}
    for kind in KINDS:
        for seed, name in ((0, "A"), (1, "B")):
            kw = dict(kind=kind, draft_vocab_size=48) if kind == "eagle3" else dict(bias=True)
            head = random_head(target, seed=seed, **kw)
            if kind == "eagle3":  # a real draft vocabulary: 48 scattered target ids
                g = torch.Generator().manual_seed(seed)
                ids = torch.randperm(head.config.vocab_size, generator=g)[:48].sort().values
                head.set_vocab(ids - torch.arange(48))
            d = root / f"{kind}-{name}"
            head.save_pretrained(d)
            kind_keys = ["head.kind=eagle3", "head.aux_layers=[1,2,3]", "head.draft_vocab_size=48"] if kind == "eagle3" else []
            recipe = load_config("tiny", [*kind_keys, f"name=tiny-{kind}-{name}"])  # as the trainer's export stores it
            (d / "recipe.yaml").write_text(OmegaConf.to_yaml(recipe, resolve=True))
            (d / "train_summary.json").write_text(json.dumps({"steps": 3 + seed, "head_kind": kind}) + "\n")
            if name == "A":
                (d / "tree_config.json").write_text('{"total_token": 12}\n')
            out[kind, name] = d
    return out


def export(heads, kind, name, fmt, out, *extra, flag="--head"):
    from export.cli import main

    return ["--format", fmt, flag, heads[kind, name], "--base", heads["target"], "--out", out, *extra], main


def export_cli(capsys, heads, kind, name, fmt, out, *extra, flag="--head"):
    argv, main = export(heads, kind, name, fmt, out, *extra, flag=flag)
    return run_cli(main, argv, capsys)


def beside(out) -> list[str]:
    """Names in the destination's parent folder (no temporary folder may stay behind)."""
    return sorted(p.name for p in out.parent.iterdir())


# ----------------------------------------------------------------------------- 1. atomic writes
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", KINDS)
def test_a_failure_mid_write_leaves_the_previous_export_byte_identical(heads, tmp_path, capsys, monkeypatch, kind, fmt):
    import export.engine_formats as ef

    out = tmp_path / "out"
    code, _, err = export_cli(capsys, heads, kind, "A", fmt, out)
    assert code == 0, err
    good = snapshot(out)

    def failing_save_file(tensors, filename, metadata=None):  # config.json is written; the weights half-way
        with open(filename, "wb") as f:
            f.write(b"\0" * 100)
        raise OSError(errno.EFBIG, "File too large", filename)

    monkeypatch.setattr(ef, "save_file", failing_save_file)
    code, _, err = export_cli(capsys, heads, kind, "B", fmt, out, "--overwrite")
    assert_one_line_error(code, err, f"could not export the head to {out}", "File too large", "unchanged")
    assert_unchanged(good, out)
    assert beside(out) == ["out"]


@pytest.mark.parametrize("kind,fmt", [("eagle2", "vllm"), ("eagle3", "sglang")])
def test_file_size_limit_in_a_subprocess_leaves_the_previous_export(heads, tmp_path, kind, fmt):
    """A real write failure: RLIMIT_FSIZE below the weights' size (config.json fits), SIGXFSZ ignored so the write
    fails with EFBIG instead of killing the process."""
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "train.export", "--head", str(heads[kind, "A"]), "--base", str(heads["target"]),
            "--format", fmt, "--out", str(out)]
    proc = subprocess.run(argv, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    good = snapshot(out)
    limit = 8 * 1024
    assert (out / "model.safetensors").stat().st_size > 4 * limit and (out / "config.json").stat().st_size < limit

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    argv[argv.index(str(heads[kind, "A"]))] = str(heads[kind, "B"])
    proc = subprocess.run(argv + ["--overwrite"], env=subprocess_env(), capture_output=True, text=True, timeout=300,
                          preexec_fn=small_files)
    assert_one_line_error(proc.returncode, proc.stderr, f"could not export the head to {out}", "File too large")
    assert_unchanged(good, out)
    assert beside(out) == ["out"]


def test_the_trainer_export_is_atomic_for_eagle3_too(heads, tmp_path, monkeypatch):
    import eagle.head_module as hm
    from eagle.atomic_folder import ExportError
    from eagle.head import load_head
    from train.export import export_head

    head = load_head(heads["eagle3", "A"])
    sd = {k: v.detach().clone() for k, v in head.state_dict().items()}
    out = export_head(sd, head.config, tmp_path / "head", "float32", legacy_bin=False)
    good = snapshot(out)

    def failing(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(hm, "save_file", failing)
    with pytest.raises(ExportError, match=f"could not export the head to {out} .*No space left") as e:
        export_head(sd, head.config, out, "float32", legacy_bin=False)
    assert "\n" not in str(e.value)
    assert_unchanged(good, out)
    assert beside(out) == ["head"]


REFUSED = [  # (id, --out from (head folder, tmp_path), needles)
    ("is-the-source", lambda h, t: h, ["is the source head"]),
    ("inside-the-source", lambda h, t: h / "vllm", ["inside the source head"]),
    ("holds-the-source", lambda h, t: h.parent, ["holds the source head"]),
    ("a-file", lambda h, t: t / "a-file", ["is a file"]),
]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("case,where,needles", REFUSED, ids=[r[0] for r in REFUSED])
def test_an_output_that_is_or_holds_the_source_is_refused(heads, tmp_path, capsys, case, where, needles, kind, fmt):
    src = shutil.copytree(heads[kind, "A"], tmp_path / "src" / "head")
    (tmp_path / "a-file").write_text("not a folder\n")
    good = snapshot(tmp_path)
    code, _, err = export_cli(capsys, {**heads, (kind, "A"): src}, kind, "A", fmt, where(src, tmp_path), "--overwrite")
    assert_one_line_error(code, err, "not writing to", *needles)
    assert_unchanged(good, tmp_path)


@pytest.mark.parametrize("fmt", FORMATS)
def test_another_head_is_refused_without_overwrite_and_replaced_whole_with_it(heads, tmp_path, capsys, fmt):
    out = tmp_path / "out"
    code, _, err = export_cli(capsys, heads, "eagle2", "A", fmt, out)
    assert code == 0, err
    assert (out / "tree_config.json").exists()  # head A's tree and recipe travel with it
    good = snapshot(out)
    code, _, err = export_cli(capsys, heads, "eagle2", "A", fmt, out)  # the same export again: nothing to refuse
    assert code == 0, err
    assert_unchanged(good, out)
    for kind in KINDS:  # another head (another kind too) is refused
        code, _, err = export_cli(capsys, heads, kind, "B", fmt, out)
        assert_one_line_error(code, err, f"not writing to {out}", "different head", "--overwrite")
        assert_unchanged(good, out)
    code, _, err = export_cli(capsys, heads, "eagle3", "B", fmt, out, "--overwrite")
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "recipe.yaml",
                                                      "train_summary.json"]  # nothing of head A (its tree) remains
    assert "kind: eagle3" in (out / "recipe.yaml").read_text()
    assert beside(out) == ["out"]


def test_a_folder_that_holds_no_head_is_never_replaced(heads, tmp_path, capsys):
    out = tmp_path / "notes"
    out.mkdir()
    (out / "todo.txt").write_text("keep me\n")
    good = snapshot(out)
    code, _, err = export_cli(capsys, heads, "eagle2", "A", "vllm", out, "--overwrite")
    assert_one_line_error(code, err, f"not writing to {out}", "holds no head")
    assert_unchanged(good, out)


# ----------------------------------------------------------------------------- 2. one set of checks
def poison_weight(d, kind):
    sd = load_file(str(d / "model.safetensors"))
    sd["fc.weight"].view(-1)[5] = float("nan")
    save_file(sd, str(d / "model.safetensors"))


def d2t_outside(d, kind):
    sd = load_file(str(d / "model.safetensors"))
    sd["d2t"][-1] = 10_000
    save_file(sd, str(d / "model.safetensors"))


def t2d_inconsistent(d, kind):
    sd = load_file(str(d / "model.safetensors"))
    sd["t2d"] = ~sd["t2d"]
    save_file(sd, str(d / "model.safetensors"))


def aux_past_the_target(d, kind):
    cfg = json.loads((d / "config.json").read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 2, 9]
    (d / "config.json").write_text(json.dumps(cfg))


def config_unlike_weights(d, kind):
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = cfg["intermediate_size"] * 2
    (d / "config.json").write_text(json.dumps(cfg))


BAD_HEADS = [  # (id, kinds, damage, needles, loader refuses it too)
    ("nan-weights", KINDS, poison_weight, ["non-finite", "fc.weight"], False),
    ("config-vs-weights", KINDS, config_unlike_weights, ["mlp"], True),
    ("d2t-outside-vocab", ("eagle3",), d2t_outside, ["d2t maps", "outside the target vocabulary"], True),
    ("t2d-inconsistent", ("eagle3",), t2d_inconsistent, ["t2d does not mark"], True),
    ("aux-past-target", ("eagle3",), aux_past_the_target, ["aux layer id(s) [9] out of range for a 4-layer target"],
     True),
]
CASES = [(c, k, f, flag) for c in BAD_HEADS for k in c[1] for f in FORMATS
         for flag in (("--head", "--eagle3") if k == "eagle3" else ("--head",))]


@pytest.mark.parametrize("case,kind,fmt,flag", CASES, ids=[f"{c[0]}-{k}-{f}{flag.replace('--', '-')}"
                                                             for c, k, f, flag in CASES])
def test_every_kind_and_format_gets_the_same_checks_before_anything_is_written(heads, tmp_path, capsys, case, kind,
                                                                                fmt, flag):
    from eagle import EaModel
    from eagle.head import load_head

    _, _, damage, needles, loader_refuses = case
    out = tmp_path / "out"
    code, _, err = export_cli(capsys, heads, kind, "A", fmt, out)  # a good export already there
    assert code == 0, err
    bad = shutil.copytree(heads[kind, "B"], tmp_path / "bad")
    damage(bad, kind)
    good = snapshot(out, bad)
    code, _, err = export_cli(capsys, {**heads, (kind, "B"): bad}, kind, "B", fmt, out, "--overwrite", flag=flag)
    line = assert_one_line_error(code, err, *needles)
    assert str(bad) in line or str(out) in line
    assert_unchanged(good, out, bad)
    assert beside(out) == ["bad", "out"]
    if loader_refuses:  # the loader applies the same checks (the target decides the aux ids' fit)
        with pytest.raises(ValueError, match=needles[-1].replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")
                           .replace("]", r"\]")):
            if case[0] == "aux-past-target":
                EaModel.from_pretrained(str(heads["target"]), str(bad), torch_dtype=torch.float32)
            else:
                load_head(bad)
    else:  # a NaN head still loads: evaluation warns about it (test below)
        load_head(bad)


# ----------------------------------------------------------------------------- 3. evaluation warnings
@pytest.fixture(scope="module")
def nan_eval(tmp_path_factory):
    """A target with a tokenizer, a NaN EAGLE-2 head and a 2-question prompt file."""
    from test_evaluation_questions import char_tokenizer
    from tiny_models import tiny_llama

    root = tmp_path_factory.mktemp("nan_eval")
    target = tiny_llama(vocab_size=258, eos_token_id=1)
    target.save_pretrained(root / "target")
    char_tokenizer(with_template=False).save_pretrained(root / "target")
    head = random_head(target)
    head.save_pretrained(root / "good_head")
    with torch.no_grad():
        head.fc.weight.fill_(float("nan"))
    head.save_pretrained(root / "head")
    (root / "q.jsonl").write_text("".join(json.dumps({"question_id": i, "category": "c", "turns": [t]}) + "\n"
                                          for i, t in enumerate(["Once upon a time", "The dog ran"])))
    return root


def eval_argv(root, *extra, head="head"):
    return ["--base", root / "target", "--head", root / head, "--questions", root / "q.jsonl", "target.dtype=float32",
            "eval.max_new_tokens=8", "eval.bootstrap_samples=50", "eval.threads=1", "eval.warmup=0",
            "decoding.total_token=8", "decoding.depth=3", "decoding.top_k=3", *extra]


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "head" in r.getMessage()]


def test_evaluation_warns_for_a_nan_head_and_acceptance_exactly_one(nan_eval, tmp_path, capsys, caplog):
    from evaluation.main import main

    good = snapshot(nan_eval / "head")
    with caplog.at_level(logging.WARNING):
        code, _, err = run_cli(main, eval_argv(nan_eval, "--out", tmp_path / "eval", "eval.methods=[vanilla,eagle2]"),
                               capsys)
    assert code == 0, err  # decoding stays lossless: the numbers are reported, the head is flagged
    found = warnings_of(caplog)
    assert len(found) == 2, found
    assert all("\n" not in w and str(nan_eval / "head") in w for w in found)
    assert "non-finite weights" in found[0] and "fc.weight" in found[0]
    assert "method eagle2" in found[1] and "acceptance exactly 1.0" in found[1]
    assert json.loads((tmp_path / "eval" / "report.json").read_text())  # the report is still written
    assert_unchanged(good, nan_eval / "head")


def test_serve_check_warns_when_the_engine_never_accepts(nan_eval, tmp_path, capsys, caplog, monkeypatch):
    """The engine's side replaced by its RESULT (vLLM's counters with nothing accepted), as engine/vllm_side/generate.py reports it."""
    import evaluation.engine_runs as engine_runs
    from evaluation.main import main

    fake_python = tmp_path / "python-with-vllm"
    fake_python.write_text("#!/bin/sh\nexit 0\n")  # `find_spec('vllm')` answered yes
    fake_python.chmod(0o755)

    def engine_run(engine, engine_python, request, work, timeout=3600):
        (work / f"{engine}.log").write_text("fake engine\n")
        outs = [[5, 6, 7] for _ in request["prompts"]]
        metrics = {"num_drafts": 12, "num_accepted_tokens": 0, "accepted_per_pos": [0] * 4}
        return {"vllm_version": "fake", "runs": {
            "plain": {"outputs": outs, "load_s": 0.0, "generate_s": 0.0},
            "speculative": {"outputs": outs, "metrics": metrics,
                            "per_request": [{"num_drafts": 12 if i == 0 else 0, "accepted_per_pos": [0] * 4}
                                            for i in range(len(outs))], "load_s": 0.0, "generate_s": 0.0}}}

    monkeypatch.setattr(engine_runs, "engine_run", engine_run)
    with caplog.at_level(logging.WARNING):
        code, _, err = run_cli(main, ["serve-check", "--engine", "vllm", "--engine-python", fake_python,
                                      *eval_argv(nan_eval, "--out", tmp_path / "eval", head="good_head")], capsys)
    assert code in (0, 1), err  # the fake engine's outputs are not ours: the check itself may fail
    found = warnings_of(caplog)
    engine = [w for w in found if w.startswith("serve-check (vllm)")]
    assert len(engine) == 1 and "acceptance exactly 1.0 over 12 rounds" in engine[0], found
    assert str(nan_eval / "good_head") in engine[0] and "\n" not in engine[0]
    assert json.loads((tmp_path / "eval" / "serve_check" / "report.json").read_text())["engine_acceptance"][
        "mean_length"] == 1.0
    # a NaN head never reaches the engine: its export is refused, naming the head
    good = snapshot(nan_eval)
    code, _, err = run_cli(main, ["serve-check", "--engine", "vllm", "--engine-python", fake_python,
                                  *eval_argv(nan_eval, "--out", tmp_path / "eval2")], capsys)
    errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "non-finite" in errors[0] and "fc.weight" in errors[0]
    assert "Traceback" not in err
    assert_unchanged(good, nan_eval)


# ----------------------------------------------------------------------------- 4. resume of another head
@pytest.fixture(scope="module")
def run4(tmp_path_factory, world):  # noqa: F811
    """A 4-layer target, an EAGLE-2 and an EAGLE-3 feature cache of it, and a stopped EAGLE-2 run."""
    from train.main import main

    root = tmp_path_factory.mktemp("resume")
    target = save_target(root / "target", num_layers=4)
    caches = {"eagle2": write_cache(root / "c2", target, n=24), "eagle3": write_cache(root / "c3", target, n=24,
                                                                                   layers=[1, 2, 3, 4])}
    run = root / "run"
    assert main(["--recipe", "tiny", *overrides(target, run, f"train.cache_dir={caches['eagle2']}", "train.stop_after=2",
                                                "train.precision=fp32", steps=4)]) == 0
    return {"target": target, "caches": caches, "run": run}


EAGLE3 = ["head.kind=eagle3", "head.aux_layers=[1,2,3]", "head.ttt_steps=2"]


def test_resuming_another_head_kinds_checkpoint_is_one_line(run4, tmp_path, capsys):
    from train.main import main

    run = shutil.copytree(run4["run"], tmp_path / "run")
    good = snapshot(run / "train" / "checkpoints")
    code, _, err = run_cli(main, ["--recipe", "tiny", *overrides(run4["target"], run, f"train.cache_dir="
                                                                 f"{run4['caches']['eagle3']}", "train.precision=fp32",
                                                                 *EAGLE3, steps=4)], capsys)
    assert_one_line_error(code, err, str(run / "train" / "checkpoints" / "step-00000002"), "EAGLE-2 head",
                          "EAGLE-3 head", "new output_dir", "delete")
    assert_unchanged(good, run / "train" / "checkpoints")
    (run / "train" / "checkpoints" / "step-00000002" / "head.json").unlink()  # a checkpoint from before head.json
    good = snapshot(run / "train" / "checkpoints")
    code, _, err = run_cli(main, ["--recipe", "tiny", *overrides(run4["target"], run, f"train.cache_dir="
                                                                 f"{run4['caches']['eagle3']}", "train.precision=fp32",
                                                                 *EAGLE3, steps=4)], capsys)
    assert_one_line_error(code, err, str(run / "train" / "checkpoints" / "step-00000002"), "another head",
                          "new output_dir", "delete")
    assert_unchanged(good, run / "train" / "checkpoints")


def test_resuming_another_recipes_shapes_is_one_line(run4, tmp_path, capsys):
    from train.main import main

    run = tmp_path / "run"
    args = [*overrides(run4["target"], run, f"train.cache_dir={run4['caches']['eagle3']}", "train.precision=fp32",
                       *EAGLE3, steps=4)]
    assert run_cli(main, ["--recipe", "tiny", *args, "head.draft_vocab_size=100", "train.stop_after=2"], capsys)[0] == 0
    good = snapshot(run / "train" / "checkpoints", run / "head")
    code, _, err = run_cli(main, ["--recipe", "tiny", *args, "head.draft_vocab_size=64"], capsys)
    assert_one_line_error(code, err, "step-00000002", "EAGLE-3 head", "other shapes", "lm_head.weight [100, ",
                          "new output_dir")
    assert_unchanged(good, run / "train" / "checkpoints", run / "head")


# ----------------------------------------------------------------------------- 5. Hub staging
@pytest.mark.parametrize("fmt", FORMATS)
def test_hub_staging_ships_the_recipe_and_summary_the_card_cites_in_every_format(heads, tmp_path, fmt):
    from export.hub import push_to_hub
    from recipes import load_config

    cfg = load_config("tiny", [f"target.path={heads['target']}", f"output_dir={tmp_path / 'run'}",
                               "export.repo_id=someone/e3"])  # this command's recipe trains EAGLE-2 heads
    result = push_to_hub(cfg, heads["eagle3", "A"], dry_run=True, fmt=fmt)
    assert {"recipe.yaml", "train_summary.json", "tree_config.json", "README.md", "config.json",
            "model.safetensors"} <= set(result["files"])
    staging = tmp_path / "run" / ("hub_upload" if fmt == "eagle" else f"hub_upload-{fmt}")
    assert result["staging"] == str(staging)
    card = (staging / "README.md").read_text()
    assert "# EAGLE-3 draft head" in card and "`tiny-eagle3-A`" in card  # the head's own recipe and kind
    assert (staging / "recipe.yaml").read_bytes() == (heads["eagle3", "A"] / "recipe.yaml").read_bytes()


def test_hub_staging_refuses_a_recipe_of_another_kind_than_the_head(heads, tmp_path, capsys):
    from export.hub import main

    head = shutil.copytree(heads["eagle3", "A"], tmp_path / "head")
    run = tmp_path / "run"
    argv = ["--recipe", "tiny", f"target.path={heads['target']}", f"output_dir={run}", "export.repo_id=someone/e3",
            "--head", head, "--dry-run", "--format", "vllm"]
    code, _, err = run_cli(main, argv, capsys)
    assert code == 0, err
    good = snapshot(run)
    (head / "recipe.yaml").unlink()  # no recipe of its own: this command's (tiny: EAGLE-2) would describe it
    code, _, err = run_cli(main, argv, capsys)
    assert_one_line_error(code, err, str(head), "EAGLE-3 head", "'tiny'", "head.kind=eagle2", "--recipe")
    assert_unchanged(good, run)
    from recipes import config_yaml, load_config
    (head / "recipe.yaml").write_text(config_yaml(load_config("tiny")))  # a stale recipe of another kind (eagle2)
    code, _, err = run_cli(main, argv, capsys)
    assert_one_line_error(code, err, str(head / "recipe.yaml"), "EAGLE-3 head", "head.kind=eagle2")
    assert_unchanged(good, run)
    (head / "recipe.yaml").unlink()  # the way out: the recipe the head was trained with
    code, _, err = run_cli(main, [*argv[:5], "head.kind=eagle3", "head.aux_layers=[1,2,3]", *argv[5:]], capsys)
    assert code == 0, err
    assert "kind: eagle3" in (run / "hub_upload-vllm" / "recipe.yaml").read_text()


@pytest.mark.parametrize("fmt", FORMATS)
def test_hub_staging_checks_the_head_in_every_format(heads, tmp_path, capsys, fmt):
    from export.hub import main

    bad = shutil.copytree(heads["eagle3", "A"], tmp_path / "head")
    aux_past_the_target(bad, "eagle3")
    run = tmp_path / "run"
    argv = ["--recipe", "tiny", f"target.path={heads['target']}", f"output_dir={run}", "export.repo_id=someone/e3",
            "--head", bad, "--dry-run", "--format", fmt]
    good = snapshot(bad)
    code, _, err = run_cli(main, argv, capsys)
    assert_one_line_error(code, err, str(bad), "aux layer id(s) [9] out of range for a 4-layer target")
    assert_unchanged(good, bad)
    assert not run.exists() or not any(run.iterdir())
