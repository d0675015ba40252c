"""The one-command demo: stage order, the overrides each stage gets, and rerun/resume/--fresh behaviour.

The orchestration tests replace the stage subprocesses with recorders (the stages have their own
tests); the last test runs the real stage CLIs end to end on a test-size target (~25 s)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from quickstart import default_target as dt
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
            (out / "eval" / "report.json").write_text(json.dumps(
                {"summaries": summaries, "losslessness": {"compared": 4, "lossless": True, "mismatches": []}}))

    @property
    def names(self) -> list[str]:
        return [c[0] for c in self.calls]


def run(monkeypatch, fake, out, target, *extra):
    monkeypatch.setattr(demo, "run_stage", fake)
    return demo.main(["--target", str(target), "--out", str(out), *extra])


def test_runs_every_stage_in_order_with_the_target_and_prompts(monkeypatch, tmp_path, small_target, capsys):
    fake = FakeStages()
    assert run(monkeypatch, fake, tmp_path / "run", small_target) == 0
    assert fake.names == ["data", "train", "eval"]
    overrides = dict(o.split("=", 1) for o in fake.calls[0][1])
    assert overrides["target.path"] == str(small_target)
    assert overrides["output_dir"] == str((tmp_path / "run").resolve())
    conv = json.loads(Path(overrides["data.source"]).read_text())
    assert conv and {"id", "conversations"} <= set(conv[0])
    first_question = json.loads(Path(overrides["eval.questions"]).read_text().splitlines()[0])
    assert {"question_id", "category", "turns"} <= set(first_question)
    assert all(c[1] == fake.calls[0][1] for c in fake.calls)  # every stage sees the same recipe
    err = capsys.readouterr().err
    assert "eagle2: tau 2.50" in err and "0 mismatches" in err and "report.md" in err


def test_rerun_reuses_finished_stages_and_redoes_changed_ones(monkeypatch, tmp_path, small_target):
    out = tmp_path / "run"
    run(monkeypatch, FakeStages(), out, small_target)
    again = FakeStages()
    assert run(monkeypatch, again, out, small_target) == 0
    assert again.names == []

    # an evaluation setting changed: only evaluation reruns, from a clean eval folder
    eval_only = FakeStages()
    assert run(monkeypatch, eval_only, out, small_target, "eval.max_new_tokens=7") == 0
    assert eval_only.names == ["eval"]
    assert sorted(p.name for p in (out / "eval").iterdir()) == ["report.json", "written-1"]
    assert (out / "train" / "written-2").exists()

    # a data setting changed: everything downstream is redone
    everything = FakeStages(tag="again")
    assert run(monkeypatch, everything, out, small_target, "eval.max_new_tokens=7", "data.max_new_tokens=9") == 0
    assert everything.names == ["data", "train", "eval"]
    assert sorted(p.name for p in (out / "train").iterdir()) == ["again-2"]


def test_interrupted_stage_resumes_without_wiping_its_partial_output(monkeypatch, tmp_path, small_target, capsys):
    out = tmp_path / "run"
    assert run(monkeypatch, FakeStages(fail="train"), out, small_target) == 3
    assert "stage train failed" in capsys.readouterr().err
    state = json.loads((out / demo.STATE_FILE).read_text())
    assert state["data"]["done"] and not state["train"]["done"] and "eval" not in state
    resumed = FakeStages()
    assert run(monkeypatch, resumed, out, small_target) == 0
    assert resumed.names == ["train", "eval"]
    assert (out / "train" / "written-2").exists()  # the partial checkpoint folder was kept for the trainer's resume


def test_fresh_redoes_everything(monkeypatch, tmp_path, small_target):
    out = tmp_path / "run"
    run(monkeypatch, FakeStages(), out, small_target)
    fresh = FakeStages(tag="fresh")
    assert run(monkeypatch, fresh, out, small_target, "--fresh") == 0
    assert fresh.names == ["data", "train", "eval"]
    assert sorted(p.name for p in (out / "data").iterdir()) == ["fresh-1"]


def test_bad_override_fails_before_any_stage(monkeypatch, tmp_path, small_target, capsys):
    fake = FakeStages()
    assert run(monkeypatch, fake, tmp_path / "run", small_target, "data.no_such_key=1") == 2
    assert "no_such_key" in capsys.readouterr().err
    assert run(monkeypatch, fake, tmp_path / "run", small_target, "not-an-override") == 2
    assert fake.names == []


TEST_SCALE = ["target.dtype=float32", "data.max_records=8", "data.max_new_tokens=16", "data.gen_batch_size=4",
              "data.max_length=256", "train.precision=fp32", "train.zero_stage=0", "train.max_steps=4",
              "train.micro_batch_size=2", "train.grad_accum=1", "train.warmup_steps=1", "logging.backend=none",
              "eval.num_questions=2", "eval.max_new_tokens=16", "eval.methods=[vanilla,eagle1,eagle2]",
              "eval.bootstrap_samples=200", "eval.warmup=0"]


def test_whole_pipeline_end_to_end_and_rerun(tmp_path, small_target, capsys):
    out = tmp_path / "run"
    assert demo.main(["--target", str(small_target), "--out", str(out), *TEST_SCALE]) == 0
    assert (out / "data" / "features" / "manifest.json").exists()
    assert {"config.json", "model.safetensors"} <= {p.name for p in (out / "head").iterdir()}
    report = json.loads((out / "eval" / "report.json").read_text())
    assert {s["method"] for s in report["summaries"]} >= {"vanilla", "eagle1", "eagle2"}
    assert report["losslessness"]["compared"] > 0 and report["losslessness"]["mismatches"] == []
    assert list((out / "eval").glob("calibration_*.png"))
    assert "report:" in capsys.readouterr().err
    # a rerun reuses every finished stage
    assert demo.main(["--target", str(small_target), "--out", str(out), *TEST_SCALE]) == 0
    err = capsys.readouterr().err
    assert err.count("already done") == 3 and "$ " not in err


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
