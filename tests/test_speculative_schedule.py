"""The draft-length schedule (vLLM's num_speculative_tokens_per_batch_size) without an engine: serve-sweep's fit from
its measurements, the rules vLLM validates, the k vLLM runs per batch size, the speculative_config.json file, the
sweep's schedule point in its report, and the schedule in the model card and the Hub upload. Against real vLLM:
tests/test_vllm_engine.py (slow)."""
from __future__ import annotations

import ast
import json
import math

import pytest

from eagle.cli_errors import UserError, is_expected
from eagle.head_kinds import EAGLE2, EAGLE3, PEAGLE
from evaluation.serve_sweep import best_k, markdown, plot, schedule_comparison
from export.head_kinds import EXPORT
from export.hub import push_to_hub
from export.model_card import serving_commands
from export.speculative_schedule import (SCHEDULE_KEY, ScheduleError, check_speculative_config, fit_schedule,
                                         interpolated_throughput, k_at, read_speculative_config, schedule_text,
                                         speculative_config, validate_schedule, vllm_speculative_config,
                                         write_speculative_config)
from recipes import load_config
from test_engine_formats import perturbed_head
from test_head_kinds import REPO, STAGES
from test_serve_engine_logic import bench_json


def points_of(tps: dict) -> list[dict]:
    return [{"k": k, "concurrency": c, "output_tokens_per_s": v} for (k, c), v in tps.items()]


def test_the_fit_switches_where_the_interpolated_curves_cross():
    # k = 2 leads at batch 1 (150 vs 100), k = 1 at 16 (900 vs 700); in log B between 1 and 16 the lines
    # 150 + 550 t and 100 + 800 t (t = log B / log 16) cross at t = 0.2, B = 16 ** 0.2 = 1.74: batch 2 already
    # drafts one token. (A geometric midpoint would have kept k = 2 up to batch 4.) k = 4 never leads.
    tps = {(1, 1): 100, (2, 1): 150, (4, 1): 140, (1, 16): 900, (2, 16): 700, (4, 16): 500}
    assert 16 ** 0.2 == pytest.approx(1.741, abs=1e-3)
    assert fit_schedule(points_of(tps), 16) == [[1, 1, 2], [2, 16, 1]]
    assert fit_schedule(points_of(tps), 40) == [[1, 1, 2], [2, 40, 1]]  # beyond the last level: its best k stands


def test_no_speculation_wins_only_everywhere():
    # no speculation fastest at 16 but not at 1: inside a schedule k = 0 still runs the drafter, so the ks >= 1
    # compete (k = 2, then k = 1 from the crossing of 150 + 550 t and 120 + 740 t, t = 30 / 190, B = 1.55)
    tps = {(0, 1): 100, (1, 1): 120, (2, 1): 150, (0, 16): 2000, (1, 16): 860, (2, 16): 700}
    assert fit_schedule(points_of(tps), 16) == [[1, 1, 2], [2, 16, 1]]
    # fastest at every batch size: one range of k = 0, and no config (serve without --speculative-config)
    tps = {(0, 1): 200, (2, 1): 150, (0, 16): 2000, (2, 16): 700}
    assert fit_schedule(points_of(tps), 16) == [[1, 16, 0]]
    assert speculative_config({"method": "eagle"}, "H", fit_schedule(points_of(tps), 16)) is None
    t = math.log(2) / math.log(16)
    assert interpolated_throughput([1, 16], [150, 700], 2) == pytest.approx(150 + 550 * t)
    assert interpolated_throughput([4, 16], [150, 700], 2) == 150  # below the first level: the first measurement


def test_the_fit_reproduces_every_level_best_and_prefers_the_shorter_chain_on_a_tie():
    tps = {(1, 1): 100, (3, 1): 200, (5, 1): 200, (1, 4): 300, (3, 4): 500, (5, 4): 450,
           (1, 16): 1000, (3, 16): 900, (5, 16): 800}
    schedule = fit_schedule(points_of(tps), 16)
    # at every measured level its best k (k = 3 and 5 tie at batch 1: the shorter chain)
    assert [k_at(schedule, c, 5) for c in (1, 4, 16)] == [3, 3, 1] == [b["best_k"] for b in best_k(points_of(tps))]
    # between 4 and 16: 500 + 400 t against 300 + 700 t, t = log(B / 4) / log 4: they cross at t = 2/3, B = 10.08
    assert schedule == [[1, 10, 3], [11, 16, 1]]
    # a k missing at one level cannot be interpolated: it does not compete
    tps2 = {**{key: v for key, v in tps.items() if key != (5, 16)}, (5, 1): 400}
    assert {k for _, _, k in fit_schedule(points_of(tps2), 16)} <= {1, 3}
    with pytest.raises(ScheduleError, match="no draft length was measured at every concurrency level"):
        fit_schedule(points_of({(1, 1): 100, (3, 4): 300}), 4)


def test_k_at_follows_vllms_dense_lookup():
    # vllm/v1/spec_decode/dynamic/utils.py build_dynamic_sd_schedule_lookup: ranges, gaps carry the previous k
    # forward, the tail carries the last k, every k clamped to num_speculative_tokens
    schedule = [[1, 16, 3], [32, 128, 2]]
    assert [k_at(schedule, b, 4) for b in (1, 16, 17, 31, 32, 128, 500)] == [3, 3, 3, 3, 2, 2, 2]
    assert k_at([[1, 4, 6], [5, 8, 0]], 2, 4) == 4 and k_at([[1, 4, 6], [5, 8, 0]], 7, 4) == 0


@pytest.mark.parametrize("schedule, why", [
    ([], "non-empty list"),
    ([[2, 8, 3]], "must start at batch size 1"),
    ([[1, 8, 3], [8, 16, 2]], r"ranges \[1, 8, 3\] and \[8, 16, 2\] overlap"),
    ([[1, 0, 3]], "1 <= start <= end"),
    ([[1, 4, -1]], "must be >= 0"),
    ([[1, 4, 2.5]], "three integers"),
    ([[1, 4]], "three integers"),
    ([[1, 4, 9]], "k = 9 is above num_speculative_tokens = 5"),
])
def test_a_schedule_vllm_would_refuse_is_one_line(schedule, why):
    with pytest.raises(ScheduleError, match=why) as e:
        validate_schedule(schedule, "f.json", 5)
    assert is_expected(e.value) and "\n" not in str(e.value) and str(e.value).startswith("f.json: ")


def test_the_config_file(tmp_path):
    schedule = [[1, 2, 4], [3, 24, 2], [25, 64, 0]]
    config = speculative_config({"method": "eagle3"}, "H-vllm", schedule)
    assert config == {"method": "eagle3", "model": "H-vllm", "num_speculative_tokens": 4, SCHEDULE_KEY: schedule}
    assert speculative_config({"method": "eagle"}, "H", [[1, 64, 0]]) is None  # never speculates: serve without the flag
    two = [[1, 24, 4], [25, 64, 0]]  # a P-EAGLE head's: one k and no speculation (vLLM 0.32 serves nothing between)
    parallel = speculative_config(EXPORT[PEAGLE].vllm_spec(), "P-vllm", two)
    assert parallel == {**config, "model": "P-vllm", "parallel_drafting": True, SCHEDULE_KEY: two}
    assert read_speculative_config(write_speculative_config(tmp_path / "p.json", parallel)) == parallel
    path = write_speculative_config(tmp_path / "speculative_config.json", config)
    assert json.loads(path.read_text()) == config and read_speculative_config(path) == config
    assert schedule_text(schedule) == "batch 1-2: k = 4; batch 3-24: k = 2; batch 25-64: no speculation"
    for text, why in (("{", "not valid JSON"), (json.dumps({**config, "num_speculative_tokens": 0}), "integer >= 1"),
                      (json.dumps({k: v for k, v in config.items() if k != SCHEDULE_KEY}), "one fixed k"),
                      (json.dumps({**config, "method": ""}), "'method' must be a non-empty string")):
        path.write_text(text)
        with pytest.raises(UserError, match=why) as e:
            read_speculative_config(path)
        assert is_expected(e.value) and str(path) in str(e.value)
    with pytest.raises(UserError, match="missing.json: .*rerun `python -m evaluation serve-sweep`") as e:
        read_speculative_config(tmp_path / "missing.json")
    assert is_expected(e.value)
    with pytest.raises(ScheduleError, match="JSON object"):
        check_speculative_config([1], "x")


def test_a_parallel_drafting_schedule_with_a_shorter_k_is_refused(tmp_path):
    """vLLM 0.32 crashes its worker when a per-batch-size k below num_speculative_tokens meets parallel_drafting
    (llm_base_proposer.py `propose` reshapes all the parallel slots as k columns; measured with a P-EAGLE head): the
    schedule is refused in one line, when fitted and when read; the sequential kinds keep it."""
    schedule = [[1, 2, 3], [3, 8, 2], [9, 64, 4]]
    with pytest.raises(ScheduleError, match=r"shorter k \(2, 3\) than num_speculative_tokens = 4 with parallel_drafting") as e:
        speculative_config(EXPORT[PEAGLE].vllm_spec(), "P-vllm", schedule)
    assert is_expected(e.value) and "\n" not in str(e.value)
    assert speculative_config(EXPORT[EAGLE3].vllm_spec(), "E-vllm", schedule)[SCHEDULE_KEY] == schedule
    path = tmp_path / "speculative_config.json"
    path.write_text(json.dumps({**EXPORT[PEAGLE].vllm_spec(), "model": "P", "num_speculative_tokens": 4,
                                SCHEDULE_KEY: schedule}))
    with pytest.raises(UserError, match=f"{path}: vLLM 0.32 cannot run a shorter k"):
        read_speculative_config(path)
    report = {"title": "h on t", "engine_version": "0.32.0", "method": "eagle3", "prompts_available": 100,
              "requests_per_level": {"1": 16}, "max_new_tokens": 32, "load_average": [1, 1, 1],
              "points": sweep_points(tmp_path, {(0, 1): 100, (4, 1): 150}), "best": {},
              "schedule": {"rule": "R", "fitted": schedule, "points": [], "comparison": None,
                           "speculative_config": None, "refused": str(e.value)}}
    assert f"Not written nor served: {e.value}." in markdown(report)


def sweep_points(tmp_path, tps: dict) -> list[dict]:
    return [bench_json(tmp_path / f"{k}_{c}.json", k, c, v, 100.0 * k + c) for (k, c), v in tps.items()]


def test_the_schedule_point_is_compared_per_level_and_summed(tmp_path):
    tps = {(0, 1): 100, (2, 1): 150, (0, 16): 900, (2, 16): 700}
    points = sweep_points(tmp_path, tps)
    sched = [dict(p, schedule=True) for p in sweep_points(tmp_path, {(2, 1): 140, (2, 16): 950})]
    assert fit_schedule(points, 16) == [[1, 16, 2]]  # no speculation wins at 16 only: k = 2 throughout
    cmp = schedule_comparison(points, sched)
    assert [(x["concurrency"], x["best_k"], round(x["ratio"], 3)) for x in cmp["per_level"]] == [
        (1, 2, round(140 / 150, 3)), (16, 0, round(950 / 900, 3))]
    assert cmp["fixed_k_sums"] == {"0": 1000, "2": 850} and cmp["schedule_sum"] == 1090
    assert cmp["above_every_fixed_k_sum"] and cmp["within_noise_at_every_level"]
    slow = schedule_comparison(points, [dict(sched[0], output_tokens_per_s=100.0), sched[1]])
    assert not slow["within_noise_at_every_level"]  # 100 / 150 < 0.8
    assert schedule_comparison(points, []) is None
    schedule = fit_schedule(points, 16)
    report = {"title": "h on t", "engine_version": "0.32.0", "method": "eagle", "prompts_available": 100,
              "requests_per_level": {"1": 16, "16": 64}, "max_new_tokens": 32, "load_average": [1, 1, 1],
              "points": points, "best": best_k(points),
              "schedule": {"rule": "R", "fitted": schedule, "points": sched, "comparison": cmp,
                           "speculative_config": speculative_config({"method": "eagle"}, "H-vllm", schedule)}}
    md = markdown(report)
    assert "| schedule | 140 (0.20 / 0.30; 2.00) | 950 (0.22 / 0.32; 2.00) |" in md
    assert "Draft length per batch size (fitted by R): batch 1-16: k = 2." in md
    assert f'"{SCHEDULE_KEY}": [[1, 16, 2]]' in md
    assert "Summed over the levels: schedule 1090 tokens/s; fixed k: 0: 1000, 2: 850 (best fixed: k = 0)" in md
    assert plot(points + sched, tmp_path / "p.png", "t").stat().st_size > 1000


def test_the_schedule_reaches_the_model_card_and_the_hub_upload(tmp_path):
    head, target = perturbed_head("llama", True)
    target.save_pretrained(tmp_path / "target")
    head.save_pretrained(tmp_path / "run" / "head")
    cfg = load_config("tiny", [f"target.path={tmp_path / 'target'}", f"output_dir={tmp_path / 'run'}",
                               "export.repo_id=someone/head-x"])
    points = sweep_points(tmp_path, {(0, 1): 100, (3, 1): 180, (0, 64): 900, (3, 64): 600})
    schedule = fit_schedule(points, 64)
    shipped = speculative_config({"method": "eagle"}, str(tmp_path / "run" / "head-vllm"), schedule)
    sweep_dir = tmp_path / "run" / "eval" / "serve_sweep"
    sweep_dir.mkdir(parents=True)
    (sweep_dir / "sweep.json").write_text(json.dumps({
        "engine_version": "0.32.0", "max_new_tokens": 128, "load_average": [2.0, 2.0, 2.0], "best": best_k(points),
        "points": points, "schedule": {"fitted": schedule, "speculative_config": shipped, "points": [],
                                       "comparison": None}}))
    write_speculative_config(sweep_dir / "speculative_config.json", shipped)
    for fmt, model in (("eagle", "head-x-vllm"), ("vllm", "someone/head-x")):
        result = push_to_hub(cfg, dry_run=True, fmt=fmt)
        staged = tmp_path / "run" / ("hub_upload" if fmt == "eagle" else "hub_upload-vllm")
        assert {"speculative_config.json", "eval/serve_sweep/speculative_config.json"} <= set(result["files"])
        top = json.loads((staged / "speculative_config.json").read_text())
        assert top == {**shipped, "model": model}  # the folder this upload's card serves
        card = (staged / "README.md").read_text()
        assert f"--speculative-config '{json.dumps(top)}'" in card
        assert schedule_text(schedule) in card
    # no schedule in the sweep: no file, no command
    (sweep_dir / "speculative_config.json").unlink()
    data = json.loads((sweep_dir / "sweep.json").read_text())
    data["schedule"]["speculative_config"] = None
    (sweep_dir / "sweep.json").write_text(json.dumps(data))
    result = push_to_hub(cfg, dry_run=True)
    assert "speculative_config.json" not in result["files"]
    assert SCHEDULE_KEY not in (tmp_path / "run" / "hub_upload" / "README.md").read_text()


# Each head kind's vLLM --speculative-config, as the bytes vLLM is given (the model card's command, serve-sweep's
# speculative_config.json, serve-check's runs): the kind's keys come from export/head_kinds.py `vllm_spec` alone, the
# draft folder, k and schedule from export/speculative_schedule.py alone; a divergence fails here.
KIND_SPECS = {EAGLE2: '{"method": "eagle"}', EAGLE3: '{"method": "eagle3"}',
              PEAGLE: '{"method": "eagle3", "parallel_drafting": true}'}


@pytest.mark.parametrize("kind", sorted(KIND_SPECS, key=lambda k: k.name), ids=lambda k: k.name)
def test_each_kinds_speculative_config_is_pinned(kind, tmp_path):
    spec = EXPORT[kind].vllm_spec()
    assert json.dumps(spec) == KIND_SPECS[kind]
    one_k = json.dumps(vllm_speculative_config(spec, "H-vllm", 3))
    assert one_k == KIND_SPECS[kind][:-1] + ', "model": "H-vllm", "num_speculative_tokens": 3}'
    command = serving_commands("BASE", "H-vllm", "vllm", EXPORT[kind], num_speculative_tokens=3)["vllm"]
    assert command == f"vllm serve BASE --speculative-config '{one_k}'"
    # a parallel-drafting kind's schedule holds one k and 0 (test_a_parallel_drafting_schedule_with_a_shorter_k_is_refused)
    text = "[[1, 2, 4], [3, 24, 4], [25, 64, 0]]" if spec.get("parallel_drafting") else "[[1, 2, 4], [3, 24, 2], [25, 64, 0]]"
    path = write_speculative_config(tmp_path / "speculative_config.json",
                                    speculative_config(spec, "H-vllm", json.loads(text)))
    assert path.read_text() == (KIND_SPECS[kind][:-1] + ', "model": "H-vllm", "num_speculative_tokens": 4, '
                                f'"{SCHEDULE_KEY}": {text}}}\n')
    assert speculative_config(spec, "H-vllm", [[1, 64, 0]]) is None


def test_serve_checks_deliberate_override():
    """serve-check's --engine-method / --parallel-drafting: the kind's keys with one changed (None keeps the kind's),
    still in the kind's key order."""
    assert EXPORT[PEAGLE].vllm_spec(method=None, parallel_drafting=None) == EXPORT[PEAGLE].vllm_spec()
    assert json.dumps(EXPORT[PEAGLE].vllm_spec(parallel_drafting=False)) == KIND_SPECS[EAGLE3]  # the sequential trap
    assert json.dumps(EXPORT[EAGLE3].vllm_spec(parallel_drafting=True)) == KIND_SPECS[PEAGLE]
    assert json.dumps(EXPORT[EAGLE3].vllm_spec(method="eagle")) == KIND_SPECS[EAGLE2]
    assert json.dumps(vllm_speculative_config(EXPORT[EAGLE2].vllm_spec(parallel_drafting=True), "H", 2)) == (
        '{"method": "eagle", "parallel_drafting": true, "model": "H", "num_speculative_tokens": 2}')


def hand_built_speculative_configs(source: str, where: str) -> list[str]:
    """Dict displays that build a head's --speculative-config (keys "model" and "num_speculative_tokens") or its
    `"parallel_drafting": True`, as `where:line`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Dict):
            keys = {k.value: v for k, v in zip(node.keys, node.values) if isinstance(k, ast.Constant)}
            parallel = keys.get("parallel_drafting")
            if {"model", "num_speculative_tokens"} <= set(keys) or (
                    isinstance(parallel, ast.Constant) and parallel.value is True):
                found.append(f"{where}:{node.lineno}")
    return found


def test_the_speculative_config_is_built_in_one_place():
    """data_prep's `extract_hidden_states` configs (no draft model, no head kind; data_prep cannot import export)
    are not a head's and do not match."""
    # vllm_spec; vllm_speculative_config and the speculative_config.json state file's schema and example
    homes = {"export/head_kinds.py": 1, "export/speculative_schedule.py": 3}
    found = {}
    for stage in STAGES:
        for path in sorted((REPO / stage).rglob("*.py")):
            where = str(path.relative_to(REPO))
            hits = hand_built_speculative_configs(path.read_text(), where)
            if hits:
                found[where] = hits
    assert {w: len(h) for w, h in found.items()} == homes, found
    assert hand_built_speculative_configs('x = {"method": m, "parallel_drafting": True}\n'
                                          'y = {**s, "model": d, "num_speculative_tokens": k}\n', "m.py") == [
        "m.py:1", "m.py:2"]
