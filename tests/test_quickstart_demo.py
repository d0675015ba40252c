"""The one-command demo: stage order, the overrides each stage gets, and rerun/resume/--fresh behaviour.

The orchestration tests replace the stage subprocesses with recorders (the stages have their own
tests); the last test runs the real stage CLIs of both heads end to end on a test-size target."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from data_prep import default_target as dt
from quickstart import demo
from recipes import load_config


@pytest.fixture(scope="module")
def small_target(tmp_path_factory) -> Path:
    return dt.ensure_default_target(tmp_path_factory.mktemp("eagle_home"), size="test", progress=False)


EAGLE3_STAGES = ["eagle3-data", "eagle3-train", "eagle3-tune"]
BOTH = ["data", "train", "tune", *EAGLE3_STAGES, "eval"]
FIT = ["--eagle3-override", "head.aux_layers=[0,1,2]"]  # the 3-layer test target's aux layers (tiny-eagle3: 2, 8, 13)


class FakeStages:
    """Records stage runs; each writes a marker file into its output folders (data also regenerated answers, eval a
    report of both heads)."""

    def __init__(self, fail: str | None = None, tag: str = "written"):
        self.calls: list[tuple[str, list[str]]] = []
        self.recipes: list[str] = []
        self.fail, self.tag = fail, tag

    def __call__(self, stage, recipe, overrides, env):
        self.calls.append((stage.name, list(overrides)))
        self.recipes.append(recipe)
        given = dict(o.split("=", 1) for o in overrides)
        out = Path(given["output_dir"])
        root = out.parent if out.name == "eagle3" else out  # stage outputs are named from the run folder
        for name in stage.outputs:
            (root / name).mkdir(parents=True, exist_ok=True)
            (root / name / f"{self.tag}-{len(self.calls)}").write_text("x")
        if stage.name == self.fail:
            raise demo.StageFailed(stage, 3)
        if stage.name == "data":
            (out / "data" / "regenerated").mkdir(exist_ok=True)
            (out / "data" / "regenerated" / "part-00000.jsonl").write_text(self.tag)
        if stage.name == "eval":
            methods = ["vanilla", "eagle1", "eagle2"] + (["eagle2@B"] if "eval.compare_head" in given else [])
            summaries = [{"method": m, "category": "overall", "questions": 4, "tau": {"value": tau},
                          "tokens_per_s": {"value": 10.0}, "speedup": None if m == "vanilla" else {"value": 1.5}}
                         for m, tau in zip(methods, (1.0, 2.0, 2.5, 2.0))]
            ratio = {"value": 1.25, "ci_low": 1.0, "ci_high": 1.6}  # eagle2 / eagle2@B
            comparisons = [{"a": "eagle2", "b": "eagle2@B", "category": "overall", "tau_ratio": ratio,
                            "speed_ratio": ratio}] if "eagle2@B" in methods else []
            best = {"method": "eagle2", "describe": "dynamic total_token=60 depth=5 top_k=10", "tau": 2.5,
                    "speedup": 1.5, "speedup_low": 1.2, "speedup_high": 1.8, "faster": True, "mismatches": 0,
                    "compared": 4}
            (root / "eval" / "report.json").write_text(json.dumps(
                {"summaries": summaries, "headline": best, "comparisons": comparisons,
                 "losslessness": {"compared": 4, "lossless": True, "mismatches": []}}))

    @property
    def names(self) -> list[str]:
        return [c[0] for c in self.calls]

    def overrides(self, name: str) -> dict[str, str]:
        return dict(o.split("=", 1) for o in next(c[1] for c in self.calls if c[0] == name))


def run(monkeypatch, fake, out, target, *extra, jobs: int = 1):
    """The demo with fake stages; one at a time by default (a fixed order), `jobs=2` side by side."""
    monkeypatch.setattr(demo, "run_stage", fake)
    return demo.main(["--target", str(target), "--out", str(out), "--jobs", str(jobs), *FIT, *extra])


class SideBySide(FakeStages):
    """Fake stages that record when each starts and ends; `meet` stages wait (up to 10 s) until all of them are
    running at once, so a schedule that runs them one after the other fails with BrokenBarrierError."""

    def __init__(self, meet: tuple[str, ...] = (), **kw):
        super().__init__(**kw)
        self.events: list[tuple[str, str]] = []
        self.meet = set(meet)
        self.barrier = threading.Barrier(len(meet), timeout=10) if meet else None
        self.failed = threading.Event()  # set when the failing stage has raised

    def __call__(self, stage, recipe, overrides, env):
        self.events.append(("start", stage.name))
        if stage.name in self.meet:
            self.barrier.wait()
        try:
            super().__call__(stage, recipe, overrides, env)
        except demo.StageFailed:
            self.failed.set()
            raise
        finally:
            self.events.append(("end", stage.name))
        if stage.name in self.meet and self.fail in self.meet:  # end after the failing stage beside it
            self.failed.wait(timeout=10)
        return 1.5  # CPU seconds


def test_eagle3_chain_runs_beside_the_eagle2_chain(monkeypatch, tmp_path, small_target, capsys):
    fake = SideBySide(meet=("train", "eagle3-data"))
    assert run(monkeypatch, fake, tmp_path / "run", small_target, jobs=2) == 0
    assert sorted(fake.names) == sorted(BOTH)
    order = [name for what, name in fake.events if what == "start"]
    ended = lambda name: fake.events.index(("end", name))  # noqa: E731
    started = lambda name: fake.events.index(("start", name))  # noqa: E731
    for stage in demo.plan("both"):  # no stage starts before the stages it reads are done
        assert all(ended(a) < started(stage.name) for a in stage.after), (stage.name, fake.events)
    assert order[0] == "data" and order[-1] == "eval"
    out = capsys.readouterr().out
    assert "(beside train)" in out or "(beside eagle3-data)" in out
    assert "eagle3-data 1.5" not in out and "/1.5" in out  # each stage's own CPU seconds in the summary line
    # the answers were copied before the EAGLE-3 data prep ran, the evaluation saw both heads
    assert (tmp_path / "run" / "eagle3" / "data" / "regenerated" / "part-00000.jsonl").read_text() == "written"
    assert "eval.compare_head" in fake.overrides("eval")
    # a rerun reuses everything, side by side or not
    again = SideBySide()
    assert run(monkeypatch, again, tmp_path / "run", small_target, jobs=2) == 0 and again.names == []


def test_a_failure_beside_another_stage_stops_the_schedule_with_one_line(monkeypatch, tmp_path, small_target, capsys):
    out = tmp_path / "run"
    fake = SideBySide(meet=("train", "eagle3-data"), fail="train")
    assert run(monkeypatch, fake, out, small_target, jobs=2) == 3
    err = capsys.readouterr().err
    assert err.startswith("error: stage train failed with exit code 3") and err.count("\n") == 1
    # the stage running beside it finished and is kept; nothing that reads the failed stage started (eagle3-train may
    # have started when eagle3-data ended before the failure was seen: it does not read train's output)
    assert {"data", "train", "eagle3-data"} <= set(fake.names) <= {"data", "train", "eagle3-data", "eagle3-train"}
    state = json.loads((out / demo.STATE_FILE).read_text())
    assert state["eagle3-data"]["done"] and not state["train"]["done"] and "tune" not in state and "eval" not in state
    resumed = SideBySide()
    assert run(monkeypatch, resumed, out, small_target, jobs=2) == 0
    assert {"train", "tune", "eagle3-tune", "eval"} <= set(resumed.names) and "data" not in resumed.names


def test_jobs_below_one_is_refused(monkeypatch, tmp_path, small_target, capsys):
    fake = FakeStages()
    assert run(monkeypatch, fake, tmp_path / "run", small_target, jobs=0) == 2
    assert "--jobs 0: expected at least 1" in capsys.readouterr().err and fake.names == []


def test_runs_every_stage_in_order_with_the_target_and_prompts(monkeypatch, tmp_path, small_target, capsys):
    fake = FakeStages()
    assert run(monkeypatch, fake, tmp_path / "run", small_target) == 0
    assert fake.names == BOTH
    overrides = dict(o.split("=", 1) for o in fake.calls[0][1])
    assert overrides["target.path"] == str(small_target)
    assert overrides["output_dir"] == str((tmp_path / "run").resolve())
    conv = json.loads(Path(overrides["data.source"]).read_text())
    assert conv and {"id", "conversations"} <= set(conv[0])
    first_question = json.loads(Path(overrides["eval.questions"]).read_text().splitlines()[0])
    assert {"question_id", "category", "turns"} <= set(first_question)
    assert all(c[1] == fake.calls[0][1] for c in fake.calls[:3])  # the EAGLE-2 stages see the same recipe
    out, err = capsys.readouterr()
    assert err == ""  # stderr is reserved for the one line of a failure
    assert "eagle2: tau 2.50" in out and "0 mismatches" in out and "report.md" in out
    # head B beside head A, B / A = 1 / (A / B) with the interval inverted
    assert "eagle2 vs eagle2@B: tau 2.50 vs 2.00, B / A 0.80 [0.62, 1.00]; speed-up 1.50x vs 1.50x, tokens/s B / A " \
           "0.80 [0.62, 1.00]" in out
    # the last two lines: where the report is, then the headline (best method, tau, speed-up with CI, mismatches)
    last = out.strip().splitlines()[-2:]
    assert last[0].endswith("report: " + str((tmp_path / "run" / "eval" / "report.md").resolve()))
    assert last[1] == ("[quickstart] fastest: eagle2 (dynamic total_token=60 depth=5 top_k=10): tau 2.50, speedup "
                       "1.50x [1.20, 1.80] over vanilla, 0 mismatches with vanilla greedy over 4 outputs")


def test_each_head_kind_runs_its_chain_with_its_recipe_and_folders(monkeypatch, tmp_path, small_target):
    run_dir = (tmp_path / "run").resolve()
    both = FakeStages()
    assert run(monkeypatch, both, tmp_path / "run", small_target, "--eagle3-override", "train.epochs=1") == 0
    assert both.recipes == ["tiny"] * 3 + ["tiny-eagle3"] * 3 + ["tiny"]
    e3 = both.overrides("eagle3-train")
    assert e3["output_dir"] == str(run_dir / "eagle3") and e3["train.epochs"] == "1"
    assert e3["head.aux_layers"] == "[0,1,2]"
    assert "train.epochs" not in both.overrides("train")  # --eagle3-override reaches the EAGLE-3 stages only
    ev = both.overrides("eval")  # one evaluation: head A's methods, then head B's 60/5/10 and tuned trees
    assert ev["output_dir"] == str(run_dir) and ev["eval.compare_head"] == str(run_dir / "eagle3" / "head")
    assert json.loads(ev["eval.methods"]) == [*load_config("tiny").eval.methods, "eagle2@B", "tuned@B"]
    # the EAGLE-3 data prep starts from the EAGLE-2 run's regenerated answers (a copy: no second regeneration)
    assert (run_dir / "eagle3" / "data" / "regenerated" / "part-00000.jsonl").read_text() == "written"

    alone = FakeStages()
    assert run(monkeypatch, alone, tmp_path / "e2", small_target, "--head-kind", "eagle2") == 0
    assert alone.names == ["data", "train", "tune", "eval"] and alone.recipes == ["tiny"] * 4
    assert "eval.compare_head" not in alone.overrides("eval") and not (tmp_path / "e2" / "eagle3").exists()

    e3_only = FakeStages()
    assert run(monkeypatch, e3_only, tmp_path / "e3", small_target, "--head-kind", "eagle3") == 0
    assert e3_only.names == [*EAGLE3_STAGES, "eval"] and e3_only.recipes == ["tiny-eagle3"] * 4
    ev = e3_only.overrides("eval")  # head A is the EAGLE-3 head; the report is still {out}/eval
    assert ev["output_dir"] == str((tmp_path / "e3").resolve() / "eagle3")
    assert ev["eval.output_dir"] == str((tmp_path / "e3").resolve() / "eval")
    assert not (tmp_path / "e3" / "data").exists()  # it regenerates its own answers in eagle3/data
    assert (tmp_path / "e3" / "eval" / "report.json").exists()


def test_eagle3_chain_regenerates_when_its_data_settings_differ(monkeypatch, tmp_path, small_target, capsys):
    fake = FakeStages()
    assert run(monkeypatch, fake, tmp_path / "run", small_target, "--eagle3-override", "data.max_new_tokens=9") == 0
    assert fake.names == BOTH
    assert not (tmp_path / "run" / "eagle3" / "data" / "regenerated").exists()
    assert "data prep regenerates its own answers" in capsys.readouterr().out


def test_wrong_head_kinds_and_unfit_aux_layers_fail_before_any_stage(monkeypatch, tmp_path, small_target, capsys):
    fake = FakeStages()
    monkeypatch.setattr(demo, "run_stage", fake)
    out = str(tmp_path / "run")
    assert demo.main(["--target", str(small_target), "--out", out, "--recipe", "tiny-eagle3"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: --recipe tiny-eagle3 trains a head.kind=eagle3 head, but the EAGLE-2 head's recipe must have "
        "head.kind=eagle2; pass it as --recipe-eagle3 (and --head-kind eagle3 to train it alone)"]
    assert demo.main(["--target", str(small_target), "--out", out, "--head-kind", "eagle3", "--recipe-eagle3",
                      "tiny"]) == 2
    assert "--recipe-eagle3 tiny trains a head.kind=eagle2 head" in capsys.readouterr().err
    # tiny-eagle3's aux layers (2, 8, 13) are not layers of the 3-layer test target: one line, before the stages
    assert demo.main(["--target", str(small_target), "--out", out]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: head.aux_layers=[2, 8, 13]: ") and "3-layer target" in err and err.count("\n") == 1
    assert err.rstrip().endswith("--eagle3-override head.aux_layers=[i,j,k], or --head-kind eagle2")
    assert fake.names == []
    assert demo.main(["--target", str(small_target), "--out", out, "--head-kind", "eagle2"]) == 0  # A alone fits


def test_rerun_reuses_finished_stages_and_redoes_changed_ones(monkeypatch, tmp_path, small_target):
    out = tmp_path / "run"
    run(monkeypatch, FakeStages(), out, small_target)
    again = FakeStages()
    assert run(monkeypatch, again, out, small_target) == 0
    assert again.names == []

    # an evaluation setting changed: only the two tunings and the evaluation rerun, from clean folders
    eval_only = FakeStages()
    assert run(monkeypatch, eval_only, out, small_target, "eval.max_new_tokens=7") == 0
    assert eval_only.names == ["tune", "eagle3-tune", "eval"]  # all three read the eval section
    assert sorted(p.name for p in (out / "eval").iterdir()) == ["report.json", "written-3"]
    assert (out / "train" / "written-2").exists() and (out / "eagle3" / "train" / "written-5").exists()

    # an EAGLE-3 setting changed: its training and what reads the head are redone, the EAGLE-2 chain is kept
    e3 = FakeStages(tag="e3")
    assert run(monkeypatch, e3, out, small_target, "eval.max_new_tokens=7", "--eagle3-override", "train.epochs=1") == 0
    assert e3.names == ["eagle3-train", "eagle3-tune", "eval"]
    assert sorted(p.name for p in (out / "eagle3" / "head").iterdir()) == ["e3-1"]
    assert (out / "eagle3" / "data" / "written-4").exists() and (out / "tune" / "written-1").exists()

    # a data setting changed: everything downstream is redone, the EAGLE-3 chain too (it reads data's answers)
    everything = FakeStages(tag="again")
    assert run(monkeypatch, everything, out, small_target, "eval.max_new_tokens=7", "data.max_new_tokens=9",
               "--eagle3-override", "train.epochs=1") == 0
    assert everything.names == BOTH
    assert sorted(p.name for p in (out / "train").iterdir()) == ["again-2"]
    assert sorted(p.name for p in (out / "eagle3" / "train").iterdir()) == ["again-5"]
    assert (out / "eagle3" / "data" / "regenerated" / "part-00000.jsonl").read_text() == "again"  # copied anew

    # another head kind: its evaluation differs (no head B), every finished stage of its chain is reused
    a_only = FakeStages()
    assert run(monkeypatch, a_only, out, small_target, "eval.max_new_tokens=7", "data.max_new_tokens=9",
               "--head-kind", "eagle2") == 0
    assert a_only.names == ["eval"]


def test_interrupted_stage_resumes_without_wiping_its_partial_output(monkeypatch, tmp_path, small_target, capsys):
    out = tmp_path / "run"
    assert run(monkeypatch, FakeStages(fail="train"), out, small_target) == 3
    err = capsys.readouterr().err
    assert err.startswith("error: stage train failed with exit code 3") and err.count("\n") == 1
    state = json.loads((out / demo.STATE_FILE).read_text())
    assert state["data"]["done"] and not state["train"]["done"] and "eval" not in state
    resumed = FakeStages()
    assert run(monkeypatch, resumed, out, small_target) == 0
    assert resumed.names == ["train", "tune", *EAGLE3_STAGES, "eval"]
    assert (out / "train" / "written-2").exists()  # the partial checkpoint folder was kept for the trainer's resume


def test_interrupted_eagle3_stage_resumes_its_chain(monkeypatch, tmp_path, small_target, capsys):
    out = tmp_path / "run"
    assert run(monkeypatch, FakeStages(fail="eagle3-train"), out, small_target) == 3
    assert capsys.readouterr().err.startswith("error: stage eagle3-train failed with exit code 3")
    state = json.loads((out / demo.STATE_FILE).read_text())
    assert state["tune"]["done"] and state["eagle3-data"]["done"] and not state["eagle3-train"]["done"]
    resumed = FakeStages()
    assert run(monkeypatch, resumed, out, small_target) == 0
    assert resumed.names == ["eagle3-train", "eagle3-tune", "eval"]
    assert (out / "eagle3" / "train" / "written-5").exists()  # its partial checkpoints were kept for the resume


def test_fresh_redoes_everything(monkeypatch, tmp_path, small_target):
    out = tmp_path / "run"
    run(monkeypatch, FakeStages(), out, small_target)
    fresh = FakeStages(tag="fresh")
    assert run(monkeypatch, fresh, out, small_target, "--fresh") == 0
    assert fresh.names == BOTH
    assert sorted(p.name for p in (out / "data").iterdir()) == ["fresh-1", "regenerated"]
    assert sorted(p.name for p in (out / "eagle3" / "data").iterdir()) == ["fresh-4", "regenerated"]
    # --fresh with one head kind also removes the other chain's folders (their state is gone with the state file)
    assert run(monkeypatch, FakeStages(), out, small_target, "--fresh", "--head-kind", "eagle2") == 0
    assert not (out / "eagle3" / "train").exists()


STAGE_SCRIPT = """
import sys
print("stage progress on stdout")
print("loading 50%\\rloading 100%", file=sys.stderr)
if "--crash" in sys.argv:
    raise RuntimeError("a bug in the stage")
print("error: data.source /no/such.json: no such file", file=sys.stderr)
sys.exit(2)
"""


@pytest.mark.parametrize("crash", [False, True])
def test_a_failing_stage_is_one_stderr_line(tmp_path, capfd, crash):
    """A stage's own output (stdout and stderr) is relayed to stdout; its last stderr line names the failure."""
    import os
    import sys

    (tmp_path / "fake_stage.py").write_text(STAGE_SCRIPT)
    stage = demo.Stage("data", "fake_stage", (), (), "a fake stage", ("--crash",) if crash else ())
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    with pytest.raises(demo.StageFailed) as e:
        demo.run_stage(stage, "tiny", ["output_dir=x"], env)
    out, err = capfd.readouterr()
    assert err == "" and "stage progress on stdout" in out and "loading 100%" in out
    if crash:
        assert e.value.code == 1 and e.value.detail == "RuntimeError: a bug in the stage" and "Traceback" in out
    else:
        assert e.value.code == 2 and e.value.detail == "data.source /no/such.json: no such file"


@pytest.mark.parametrize("name, step", [("data", "2/8 data prep"), ("eagle3-train", "6/8 training the EAGLE-3")])
def test_a_stage_error_ends_the_demo_with_its_line_and_code(monkeypatch, tmp_path, small_target, capsys, name, step):
    fake = FakeStages()

    def failing(stage, recipe, overrides, env):
        if stage.name == name:
            raise demo.StageFailed(stage, 2, "error: data.source /no/such.json: no such file")
        fake(stage, recipe, overrides, env)
    monkeypatch.setattr(demo, "run_stage", failing)
    assert demo.main(["--target", str(small_target), "--out", str(tmp_path / "run"), *FIT]) == 2
    out, err = capsys.readouterr()
    assert f"[quickstart] {step}" in out
    assert err.splitlines() == [f"error: stage {name}: data.source /no/such.json: no such file; fix it and rerun the "
                                "same command (finished stages are reused)"]


def test_bad_override_fails_before_any_stage(monkeypatch, tmp_path, small_target, capsys):
    fake = FakeStages()
    assert run(monkeypatch, fake, tmp_path / "run", small_target, "data.no_such_key=1") == 2
    assert "no_such_key" in capsys.readouterr().err
    assert run(monkeypatch, fake, tmp_path / "run", small_target, "not-an-override") == 2
    assert run(monkeypatch, fake, tmp_path / "run", small_target, "--eagle3-override", "train.no_such_key=1") == 2
    assert "no_such_key" in capsys.readouterr().err
    assert fake.names == []


TEST_SCALE = ["target.dtype=float32", "data.max_records=8", "data.max_new_tokens=16", "data.gen_batch_size=4",
              "data.max_length=256", "train.precision=fp32", "train.zero_stage=0", "train.max_steps=4",
              "train.micro_batch_size=2", "train.grad_accum=1", "train.warmup_steps=1", "logging.backend=none",
              "eval.num_questions=2", "eval.max_new_tokens=16", "eval.methods=[vanilla,eagle1,eagle2,tuned]",
              "eval.bootstrap_samples=200", "eval.warmup=0", "eval.tune_total_tokens=[4]", "eval.tune_depths=[2,3]",
              "eval.tune_top_ks=[2]", "eval.tune_prompts=1", "eval.tune_max_new_tokens=8", "eval.tune_finalists=1",
              "eval.tune_repeats=1"]
# every stage shows a tqdm bar with an ETA ("elapsed<remaining")
PROGRESS_BARS = ("default target: training", "regenerate 0/1", "cache 0/1", "train:", "autotune:", "eval:")


def _files(root: Path) -> set[Path]:
    return {p for p in root.rglob("*")} if root.exists() else set()


def test_whole_pipeline_end_to_end_and_rerun(tmp_path):
    """`python -m quickstart` as a user runs it (test-size default target): every stage with a progress bar,
    the report and headline last, and nothing written outside the run folder and $EAGLE_HOME."""
    import os
    import re
    import subprocess
    import sys

    repo = Path(demo.__file__).resolve().parent.parent
    home, eagle_home, tmp, cwd, out = (tmp_path / d for d in ("home", "eagle_home", "tmp", "cwd", "run"))
    for d in (home, tmp, cwd):
        d.mkdir()
    env = {**os.environ, "HOME": str(home), "EAGLE_HOME": str(eagle_home), "TMPDIR": str(tmp),
           "PYTHONPATH": str(repo), "XDG_CACHE_HOME": str(home / ".cache"), "XDG_CONFIG_HOME": str(home / ".config")}
    for key in ("MPLCONFIGDIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "HF_HOME"):
        env.pop(key, None)
    git_before = subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True).stdout
    cmd = [sys.executable, "-m", "quickstart", "--target-size", "test", "--out", str(out), *FIT, *TEST_SCALE]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "data" / "features" / "manifest.json").exists()
    assert {"config.json", "model.safetensors", "tree_config.json"} <= {p.name for p in (out / "head").iterdir()}
    assert (out / "tune" / "autotune" / "autotune.md").exists()
    # the EAGLE-3 chain: its own cache (aux layers) on the same regenerated answers, head and tuned tree
    assert json.loads((out / "eagle3" / "data" / "features" / "manifest.json").read_text())["feature_layers"][:3] == [0, 1, 2]
    assert (out / "eagle3" / "data" / "regenerated").is_dir()
    assert json.loads((out / "eagle3" / "head" / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]
    assert (out / "eagle3" / "head" / "tree_config.json").exists()
    assert (out / "eagle3" / "tune" / "autotune" / "autotune.md").exists()
    report = json.loads((out / "eval" / "report.json").read_text())
    assert {s["method"] for s in report["summaries"]} >= {"vanilla", "eagle1", "eagle2", "tuned", "eagle2@B", "tuned@B"}
    assert {(c["a"], c["b"]) for c in report["comparisons"]} >= {("eagle2", "eagle2@B"), ("tuned", "tuned@B")}
    assert report["losslessness"]["compared"] > 0 and report["losslessness"]["mismatches"] == []
    assert {r["method"] for r in report["turns"]} >= {"eagle2@B", "tuned@B"}  # both heads were checked
    assert report["headline"]["mismatches"] == 0
    assert list((out / "eval").glob("calibration_*.png"))
    assert "## Headline" in (out / "eval" / "report.md").read_text()
    assert proc.stderr == ""  # progress (stages' bars included) goes to stdout; stderr only carries a failure
    lines = proc.stdout.strip().splitlines()
    assert lines[-2] == f"[quickstart] report: {out / 'eval' / 'report.md'}"
    assert re.search(r"\[quickstart\] +tuned vs tuned@B: tau \d+\.\d\d vs \d+\.\d\d, B / A \d+\.\d\d \[", proc.stdout)
    assert re.fullmatch(r"\[quickstart\] fastest: \S+ \(.+\): tau \d+\.\d\d, speedup \d+\.\d\dx \[\d+\.\d\d, "
                        r"\d+\.\d\d\] over vanilla, 0 mismatches with vanilla greedy over \d+ outputs", lines[-1])
    for bar in PROGRESS_BARS:
        assert re.search(re.escape(bar) + r".*\[\d\d:\d\d<\d\d:\d\d", proc.stdout), f"no progress bar with ETA: {bar}"
    # nothing outside the run folder and the cache folder: not in HOME, TMPDIR, the working directory or the repo
    assert _files(home) == set() and _files(tmp) == set() and _files(cwd) == set()
    assert (eagle_home / "default-target-test" / "config.json").exists()
    git_after = subprocess.run(["git", "status", "--porcelain"], cwd=repo, capture_output=True, text=True).stdout
    assert git_after == git_before
    # a rerun reuses every finished stage
    again = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.count("already done") == len(BOTH) and "$ " not in again.stdout
    assert again.stdout.strip().splitlines()[-1] == lines[-1]


def test_a_second_run_on_the_same_folder_is_refused(monkeypatch, tmp_path, small_target, capsys):
    from filelock import FileLock

    out = tmp_path / "run"
    out.mkdir()
    fake = FakeStages()
    with FileLock(str(out / ".quickstart.lock")):
        assert run(monkeypatch, fake, out, small_target) == 2
        assert "another `python -m quickstart` is running" in capsys.readouterr().err
    assert fake.names == []
    assert run(monkeypatch, fake, out, small_target) == 0  # free again once the other run ends


@pytest.mark.parametrize("recipe", ["tiny", "tiny-eagle3"])
def test_the_command_training_suggests_for_a_missing_cache_is_one_the_demo_accepts(recipe):
    """train's hint for a missing default-target cache names the demo run that builds it, for either head kind."""
    import shlex

    from train.data import cache_builder

    hint = cache_builder(load_config(recipe))  # no data.source, no target.path: the default target
    argv = shlex.split(hint.split("`")[1])[3:]  # after `python -m quickstart`
    args = demo.build_parser().parse_args(argv)
    chosen = args.recipe_eagle3 if args.head_kind == "eagle3" else args.recipe
    assert chosen == recipe and args.head_kind == load_config(recipe).head.kind


def test_head_pair_lines_match_trees_by_name_and_orient_the_ratio_b_over_a(tmp_path):
    def summary(m, tau):
        return {"method": m, "category": "overall", "questions": 3, "tau": {"value": tau},
                "tokens_per_s": {"value": 10.0 * tau}, "speedup": {"value": tau / 2}}

    def comparison(a, b, value, low, high):
        ci = {"value": value, "ci_low": low, "ci_high": high}
        return {"a": a, "b": b, "category": "overall", "tau_ratio": ci, "speed_ratio": ci}

    methods = [("eagle2:depth=8", 4.0), ("eagle2@B:depth=8", 2.0), ("tuned@B", 3.0), ("tuned", 6.0), ("eagle1", 5.0)]
    (tmp_path / "report.json").write_text(json.dumps({
        "summaries": [summary(m, t) for m, t in methods],
        "comparisons": [comparison("eagle2:depth=8", "eagle2@B:depth=8", 2.0, 1.6, 2.5),  # A / B: inverted
                        comparison("tuned@B", "tuned", 0.5, 0.4, 0.625)]}))  # already B / A
    lines = demo.head_pair_lines(tmp_path)
    assert lines[0].startswith("EAGLE-3 (head B) vs EAGLE-2 (head A), paired over the same 3 questions")
    assert lines[1].strip() == ("eagle2:depth=8 vs eagle2@B:depth=8: tau 4.00 vs 2.00, B / A 0.50 [0.40, 0.62]; "
                                "speed-up 2.00x vs 1.00x, tokens/s B / A 0.50 [0.40, 0.62]")
    assert lines[2].strip() == ("tuned vs tuned@B: tau 6.00 vs 3.00, B / A 0.50 [0.40, 0.62]; speed-up 3.00x vs 1.50x, "
                                "tokens/s B / A 0.50 [0.40, 0.62]")
    assert len(lines) == 3  # eagle1 has no head-B counterpart


def test_a_changed_setting_that_fails_keeps_the_previous_outputs_until_fixed(monkeypatch, tmp_path, small_target,
                                                                           capsys):
    """A rerun with a changed data setting (a typo) whose data prep fails: the previous data is set aside, not
    deleted, and every later stage's outputs stay in place (none of them started); the same command with the
    setting fixed puts the data back and reuses every stage; with the new setting again, the failed stage resumes
    its partial output. The set-aside outputs go once a run has finished every stage."""
    out = tmp_path / "run"
    assert run(monkeypatch, FakeStages(), out, small_target) == 0
    before = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file() and p.name != demo.STATE_FILE}
    typo = FakeStages(fail="data", tag="typo")
    assert run(monkeypatch, typo, out, small_target, "data.max_new_tokens=9") == 3
    assert typo.names == ["data"]
    assert (out / demo.SUPERSEDED_DIR / "data" / "written-1").exists()  # the previous data, set aside
    assert (out / "train" / "written-2").exists() and (out / "eval" / "report.json").exists()  # never started
    fixed = FakeStages()
    assert run(monkeypatch, fixed, out, small_target) == 0
    assert fixed.names == [] and "putting back its outputs" in capsys.readouterr().out
    after = {p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file() and p.name != demo.STATE_FILE}
    assert after == before and not (out / demo.SUPERSEDED_DIR).exists()

    assert run(monkeypatch, FakeStages(fail="data", tag="typo"), out, small_target, "data.max_new_tokens=9") == 3
    again = FakeStages(tag="new")
    assert run(monkeypatch, again, out, small_target, "data.max_new_tokens=9") == 0
    assert again.names == BOTH and (out / "data" / "typo-1").exists()  # the interrupted data prep resumed its output
    assert not (out / "data" / "written-1").exists() and not (out / demo.SUPERSEDED_DIR).exists()
