"""The one-command demo: stage order, the overrides each stage gets, and rerun/resume/--fresh behaviour.

The orchestration tests replace the stage subprocesses with recorders (the stages have their own
tests); the last test runs the real stage CLIs end to end on a test-size target (~25 s)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from data_prep import default_target as dt
from quickstart import demo


@pytest.fixture(scope="module")
def small_target(tmp_path_factory) -> Path:
    return dt.ensure_default_target(tmp_path_factory.mktemp("eagle_home"), size="test", progress=False)


class FakeStages:
    """Records stage runs; each writes a marker file into its output folders (and a report for eval)."""

    def __init__(self, fail: str | None = None, tag: str = "written"):
        self.calls: list[tuple[str, list[str]]] = []
        self.fail, self.tag = fail, tag

    def __call__(self, stage, recipe, overrides, env):
        self.calls.append((stage.name, list(overrides)))
        out = Path(dict(o.split("=", 1) for o in overrides)["output_dir"])
        for name in stage.outputs:
            (out / name).mkdir(parents=True, exist_ok=True)
            (out / name / f"{self.tag}-{len(self.calls)}").write_text("x")
        if stage.name == self.fail:
            raise demo.StageFailed(stage, 3)
        if stage.name == "eval":
            summaries = [{"method": m, "category": "overall", "tau": {"value": tau}, "tokens_per_s": {"value": 10.0},
                          "speedup": None if m == "vanilla" else {"value": 1.5}}
                         for m, tau in (("vanilla", 1.0), ("eagle1", 2.0), ("eagle2", 2.5))]
            best = {"method": "eagle2", "describe": "dynamic total_token=60 depth=5 top_k=10", "tau": 2.5,
                    "speedup": 1.5, "speedup_low": 1.2, "speedup_high": 1.8, "faster": True, "mismatches": 0,
                    "compared": 4}
            (out / "eval" / "report.json").write_text(json.dumps(
                {"summaries": summaries, "headline": best,
                 "losslessness": {"compared": 4, "lossless": True, "mismatches": []}}))

    @property
    def names(self) -> list[str]:
        return [c[0] for c in self.calls]


def run(monkeypatch, fake, out, target, *extra):
    monkeypatch.setattr(demo, "run_stage", fake)
    return demo.main(["--target", str(target), "--out", str(out), *extra])


def test_runs_every_stage_in_order_with_the_target_and_prompts(monkeypatch, tmp_path, small_target, capsys):
    fake = FakeStages()
    assert run(monkeypatch, fake, tmp_path / "run", small_target) == 0
    assert fake.names == ["data", "train", "tune", "eval"]
    overrides = dict(o.split("=", 1) for o in fake.calls[0][1])
    assert overrides["target.path"] == str(small_target)
    assert overrides["output_dir"] == str((tmp_path / "run").resolve())
    conv = json.loads(Path(overrides["data.source"]).read_text())
    assert conv and {"id", "conversations"} <= set(conv[0])
    first_question = json.loads(Path(overrides["eval.questions"]).read_text().splitlines()[0])
    assert {"question_id", "category", "turns"} <= set(first_question)
    assert all(c[1] == fake.calls[0][1] for c in fake.calls)  # every stage sees the same recipe
    out, err = capsys.readouterr()
    assert err == ""  # stderr is reserved for the one line of a failure
    assert "eagle2: tau 2.50" in out and "0 mismatches" in out and "report.md" in out
    # the last two lines: where the report is, then the headline (best method, tau, speed-up with CI, mismatches)
    last = out.strip().splitlines()[-2:]
    assert last[0].endswith("report: " + str((tmp_path / "run" / "eval" / "report.md").resolve()))
    assert last[1] == ("[quickstart] fastest: eagle2 (dynamic total_token=60 depth=5 top_k=10): tau 2.50, speedup "
                       "1.50x [1.20, 1.80] over vanilla, 0 mismatches with vanilla greedy over 4 outputs")


def test_rerun_reuses_finished_stages_and_redoes_changed_ones(monkeypatch, tmp_path, small_target):
    out = tmp_path / "run"
    run(monkeypatch, FakeStages(), out, small_target)
    again = FakeStages()
    assert run(monkeypatch, again, out, small_target) == 0
    assert again.names == []

    # an evaluation setting changed: only tuning and evaluation rerun, from clean folders
    eval_only = FakeStages()
    assert run(monkeypatch, eval_only, out, small_target, "eval.max_new_tokens=7") == 0
    assert eval_only.names == ["tune", "eval"]  # both read the eval section
    assert sorted(p.name for p in (out / "eval").iterdir()) == ["report.json", "written-2"]
    assert (out / "train" / "written-2").exists()

    # a data setting changed: everything downstream is redone
    everything = FakeStages(tag="again")
    assert run(monkeypatch, everything, out, small_target, "eval.max_new_tokens=7", "data.max_new_tokens=9") == 0
    assert everything.names == ["data", "train", "tune", "eval"]
    assert sorted(p.name for p in (out / "train").iterdir()) == ["again-2"]


def test_interrupted_stage_resumes_without_wiping_its_partial_output(monkeypatch, tmp_path, small_target, capsys):
    out = tmp_path / "run"
    assert run(monkeypatch, FakeStages(fail="train"), out, small_target) == 3
    err = capsys.readouterr().err
    assert err.startswith("error: stage train failed with exit code 3") and err.count("\n") == 1
    state = json.loads((out / demo.STATE_FILE).read_text())
    assert state["data"]["done"] and not state["train"]["done"] and "eval" not in state
    resumed = FakeStages()
    assert run(monkeypatch, resumed, out, small_target) == 0
    assert resumed.names == ["train", "tune", "eval"]
    assert (out / "train" / "written-2").exists()  # the partial checkpoint folder was kept for the trainer's resume


def test_fresh_redoes_everything(monkeypatch, tmp_path, small_target):
    out = tmp_path / "run"
    run(monkeypatch, FakeStages(), out, small_target)
    fresh = FakeStages(tag="fresh")
    assert run(monkeypatch, fresh, out, small_target, "--fresh") == 0
    assert fresh.names == ["data", "train", "tune", "eval"]
    assert sorted(p.name for p in (out / "data").iterdir()) == ["fresh-1"]


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


def test_a_stage_error_ends_the_demo_with_its_line_and_code(monkeypatch, tmp_path, small_target, capsys):
    def failing(stage, recipe, overrides, env):
        raise demo.StageFailed(stage, 2, "error: data.source /no/such.json: no such file")
    monkeypatch.setattr(demo, "run_stage", failing)
    assert demo.main(["--target", str(small_target), "--out", str(tmp_path / "run")]) == 2
    out, err = capsys.readouterr()
    assert "[quickstart] 2/5 data prep" in out
    assert err.splitlines() == ["error: stage data: data.source /no/such.json: no such file; fix it and rerun the same "
                                "command (finished stages are reused)"]


def test_bad_override_fails_before_any_stage(monkeypatch, tmp_path, small_target, capsys):
    fake = FakeStages()
    assert run(monkeypatch, fake, tmp_path / "run", small_target, "data.no_such_key=1") == 2
    assert "no_such_key" in capsys.readouterr().err
    assert run(monkeypatch, fake, tmp_path / "run", small_target, "not-an-override") == 2
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
    cmd = [sys.executable, "-m", "quickstart", "--target-size", "test", "--out", str(out), *TEST_SCALE]
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / "data" / "features" / "manifest.json").exists()
    assert {"config.json", "model.safetensors", "tree_config.json"} <= {p.name for p in (out / "head").iterdir()}
    assert (out / "tune" / "autotune" / "autotune.md").exists()
    report = json.loads((out / "eval" / "report.json").read_text())
    assert {s["method"] for s in report["summaries"]} >= {"vanilla", "eagle1", "eagle2", "tuned"}
    assert report["losslessness"]["compared"] > 0 and report["losslessness"]["mismatches"] == []
    assert report["headline"]["mismatches"] == 0
    assert list((out / "eval").glob("calibration_*.png"))
    assert "## Headline" in (out / "eval" / "report.md").read_text()
    assert proc.stderr == ""  # progress (stages' bars included) goes to stdout; stderr only carries a failure
    lines = proc.stdout.strip().splitlines()
    assert lines[-2] == f"[quickstart] report: {out / 'eval' / 'report.md'}"
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
    assert again.stdout.count("already done") == 4 and "$ " not in again.stdout
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
