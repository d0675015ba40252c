"""evaluation/: metrics, bootstrap CIs, calibration, losslessness helpers and reports on hand-built runs."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from eagle.stats import GenerationStats, RoundStats
from evaluation.bootstrap import paired_bootstrap, ratio_ci, ratio_difference_ci, ratio_of_ratios_ci
from evaluation.calibration import calibrate, collect_nodes, reliability
from evaluation.losslessness import check_greedy, chi2_homogeneity, explain_mismatches, first_divergence
from evaluation.metrics import OVERALL, compare, depth_acceptance, summarize
from evaluation.report import EvalReport, write_report
from statistical_rule import assert_same_law
from evaluation.runner import BenchmarkRun, TurnResult


def spec_round(accept: int, tree_depth: int = 5, new_tokens: int | None = None) -> RoundStats:
    """A chain-shaped round: one node per depth 1..tree_depth, the first `accept` accepted."""
    depth = torch.arange(1, tree_depth + 1)
    prob = torch.full((tree_depth,), 0.8)
    return RoundStats(accept_length=accept, new_tokens=accept + 1 if new_tokens is None else new_tokens,
                      node_depth=depth, node_prob=prob, node_path_prob=prob.cumprod(0), node_accepted=depth <= accept,
                      draft_s=0.01, verify_s=0.02, commit_s=0.001)


def vanilla_round() -> RoundStats:
    empty = torch.zeros(0)
    return RoundStats(0, 1, empty.long(), empty, empty, empty.bool())


def turn(qid, cat, method, n_new, wall, rounds, t=0) -> TurnResult:
    stats = GenerationStats(prompt_tokens=3, new_tokens=n_new, prefill_s=0.001, total_s=wall, rounds=rounds)
    return TurnResult(qid, cat, t, method, [1, 2, 3], list(range(n_new)), wall, stats)


@pytest.fixture
def hand_run() -> list[TurnResult]:
    """q1 (cat a): vanilla 10 tokens / 2.0 s, eagle2 10 tokens / 0.5 s in rounds accepting 3 and 4.
    q2 (cat b): vanilla 6 tokens / 1.0 s, eagle2 6 tokens / 0.5 s in rounds accepting 1 and 2.
    The first token of every turn comes from the prefill and belongs to no round."""
    return [
        turn("q1", "a", "vanilla", 10, 2.0, [vanilla_round() for _ in range(9)]),
        turn("q1", "a", "eagle2", 10, 0.5, [spec_round(3), spec_round(4)]),
        turn("q2", "b", "eagle2", 6, 0.5, [spec_round(1), spec_round(2)]),
        turn("q2", "b", "vanilla", 6, 1.0, [vanilla_round() for _ in range(5)]),
    ]


def test_hand_checked_metrics(hand_run):
    by = {(s.method, s.category): s for s in summarize(hand_run, n_resamples=200)}
    assert by[("vanilla", OVERALL)].tau.value == pytest.approx(1.0)
    assert by[("vanilla", OVERALL)].speedup.value == pytest.approx(1.0)
    e = by[("eagle2", OVERALL)]
    assert e.tau.value == pytest.approx((4 + 5 + 2 + 3) / 4)  # 3.5
    assert e.tokens_per_s.value == pytest.approx(16 / 1.0)
    assert e.speedup.value == pytest.approx(16 / 1.0 / (16 / 3.0))  # 3.0
    assert by[("eagle2", "a")].tau.value == pytest.approx(4.5)
    assert by[("eagle2", "a")].speedup.value == pytest.approx((10 / 0.5) / (10 / 2.0))  # 4
    assert by[("eagle2", "b")].speedup.value == pytest.approx((6 / 0.5) / (6 / 1.0))  # 2
    assert by[("eagle2", "b")].speedup.low is None  # one question: no interval
    assert (e.questions, e.turns, e.new_tokens, e.rounds) == (2, 2, 16, 4)
    # accept lengths 3, 4, 1, 2 of 5-deep drafts: alpha_d = #(>= d) / #(>= d-1)
    assert [(a.reached, a.accepted) for a in e.depth_acceptance] == [(4, 4), (4, 3), (3, 2), (2, 1), (1, 0)]
    assert [a.rate for a in e.depth_acceptance] == pytest.approx([1.0, 0.75, 2 / 3, 0.5, 0.0])
    assert e.phase_seconds["verify_s"] == pytest.approx(4 * 0.02)
    assert by[("vanilla", OVERALL)].depth_acceptance == []


def test_depth_acceptance_only_counts_rounds_whose_draft_reached_the_depth():
    r = [turn("q", "c", "chain", 8, 1.0, [spec_round(2, tree_depth=2), spec_round(1, tree_depth=3),
                                        spec_round(3, tree_depth=3)])]
    acc = depth_acceptance(r)
    # depth 3 is reached only by rounds with a 3-deep draft AND depths 1..2 accepted: the last round
    assert [(a.depth, a.reached, a.accepted) for a in acc] == [(1, 3, 3), (2, 3, 2), (3, 1, 1)]


def test_paired_comparison_of_two_settings(hand_run):
    other = [turn("q1", "a", "eagle2:small", 10, 1.0, [spec_round(1)] * 4 + [spec_round(0)]),
             turn("q2", "b", "eagle2:small", 6, 1.0, [spec_round(0)] * 5)]
    c = compare(hand_run + other, "eagle2", "eagle2:small", n_resamples=300)
    assert c.tau_difference.value == pytest.approx(3.5 - (4 * 2 + 1 + 5 * 1) / 10)
    assert c.speed_ratio.value == pytest.approx((16 / 1.0) / (16 / 2.0))
    assert c.tau_difference.low <= c.tau_difference.value <= c.tau_difference.high


def test_bootstrap_known_cases():
    rng = np.random.default_rng(0)
    # constant ratio: the interval collapses on it
    e = ratio_ci(np.full(20, 6.0), np.full(20, 2.0))
    assert (e.value, e.low, e.high) == pytest.approx((3.0, 3.0, 3.0))
    # mean of N(10, 2^2), n = 400: percentile CI ~ mean +- 1.96 * sd / sqrt(n)
    x = rng.normal(10, 2, 400)
    e = paired_bootstrap([x, np.ones(400)], lambda a, b: a / b, n_resamples=4000)
    half = 1.96 * x.std(ddof=1) / 20
    assert e.value == pytest.approx(x.mean())
    assert e.low == pytest.approx(x.mean() - half, abs=0.03)
    assert e.high == pytest.approx(x.mean() + half, abs=0.03)
    # pairing: prompts vary 100x in length, but the method is always exactly 2x faster -> CI [2, 2]
    tokens = rng.integers(5, 500, 30).astype(float)
    vanilla_s = tokens / 10 * rng.uniform(0.5, 2.0, 30)
    e = ratio_of_ratios_ci(tokens, vanilla_s / 2, tokens, vanilla_s)
    assert (e.low, e.high) == pytest.approx((2.0, 2.0))
    # a difference that is zero by construction
    d = ratio_difference_ci(tokens, vanilla_s, tokens, vanilla_s)
    assert (d.value, d.low, d.high) == pytest.approx((0.0, 0.0, 0.0))
    # an interval that must exclude zero: A accepts 1 more token per round on every prompt
    rounds = rng.integers(5, 50, 30).astype(float)
    d = ratio_difference_ci(3 * rounds, rounds, 2 * rounds + rng.normal(0, 0.5, 30), rounds)
    assert 0 < d.low < 1.0 < d.high < 1.2
    with pytest.raises(ValueError, match="differ in length"):
        paired_bootstrap([np.ones(3), np.ones(4)], lambda a, b: a / b)


def test_calibration_on_constructed_data():
    # hand case: bins [0, .1) and [.9, 1]: |0.5 - 0.05| and |1 - 0.95|, 2 nodes each
    cal = reliability(np.array([0.05, 0.05, 0.95, 0.95]), np.array([0, 1, 1, 1]), n_bins=10)
    assert cal.ece == pytest.approx((2 * 0.45 + 2 * 0.05) / 4)
    assert [b.count for b in cal.bins] == [2, 0, 0, 0, 0, 0, 0, 0, 0, 2]
    assert cal.pearson_r == pytest.approx(np.corrcoef([0.05, 0.05, 0.95, 0.95], [0, 1, 1, 1])[0, 1])
    # confidence 1.0 lands in the last bin, 0.0 in the first
    edge = reliability(np.array([0.0, 1.0]), np.array([0, 1]), n_bins=4)
    assert [b.count for b in edge.bins] == [1, 0, 0, 1]
    # perfectly calibrated draws: small ECE, binned r ~ 1; anti-calibrated: large ECE, r < 0
    rng = np.random.default_rng(0)
    conf = rng.uniform(0, 1, 50_000)
    good = reliability(conf, rng.uniform(0, 1, conf.shape) < conf)
    assert good.ece < 0.015 and good.binned_pearson_r > 0.99 and 0.5 < good.pearson_r < 0.65
    bad = reliability(conf, rng.uniform(0, 1, conf.shape) < 1 - conf)
    assert bad.ece > 0.4 and bad.pearson_r < -0.5
    # constant outcome: r undefined, not a crash
    assert np.isnan(reliability(conf[:10], np.zeros(10)).pearson_r)


def test_calibration_node_prob_conditions_on_the_parent():
    depth = torch.tensor([1, 1, 2, 2])
    rd = RoundStats(accept_length=1, new_tokens=2, node_depth=depth, node_prob=torch.tensor([0.9, 0.1, 0.6, 0.3]),
                    node_path_prob=torch.tensor([0.9, 0.1, 0.54, 0.03]),
                    node_accepted=torch.tensor([True, False, False, False]))
    nodes = collect_nodes([rd])
    assert nodes["path_prob"][0].tolist() == pytest.approx([0.9, 0.1, 0.54, 0.03])
    assert nodes["node_prob"][0].tolist() == pytest.approx([0.9, 0.1])  # no parent info: depth 1 only
    assert "depth-1" in calibrate([rd])["node_prob"].note
    rd.node_parent = torch.tensor([-1, -1, 0, 1])  # node 2's parent (0) was accepted, node 3's (1) was not
    nodes = collect_nodes([rd])
    assert nodes["node_prob"][0].tolist() == pytest.approx([0.9, 0.1, 0.6])
    assert calibrate([rd])["node_prob"].note == ""


def test_first_divergence_and_greedy_check(hand_run):
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2, 3], [1, 2]) == 2
    assert check_greedy(hand_run).lossless
    lossy = turn("q1", "a", "eagle1", 10, 0.7, [spec_round(4)] * 2)
    lossy.output_ids[6] = 99
    later = turn("q1", "a", "eagle1", 10, 0.7, [spec_round(4)] * 2, t=1)  # after the mismatch: not reported
    later.output_ids[0] = 77
    hist = [r for r in hand_run] + [lossy, later, turn("q1", "a", "vanilla", 10, 2.0, [vanilla_round()] * 9, t=1)]
    check = check_greedy(hist)
    assert not check.lossless and check.compared == 3
    (m,) = check.mismatches
    assert (m.question_id, m.turn, m.method, m.position, m.expected, m.got) == ("q1", 0, "eagle1", 6, 6, 99)


class FixedLogits(torch.nn.Module):
    """A bf16 'target' whose next-token logits are always: token 3 -> 12.0, 4 -> 12.0 - 1 ulp, 5 -> 5.0."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1, dtype=torch.bfloat16))
        self.seen = []

    def forward(self, ids):
        self.seen.append(ids[0].tolist())
        logits = torch.zeros(1, ids.shape[1], 8, dtype=torch.bfloat16)
        logits[..., 3], logits[..., 4], logits[..., 5] = 12.0, 12.0 - 0.0625, 5.0  # bf16 ulp in [8, 16) = 2^3 * 2^-7
        return type("Out", (), {"logits": logits})()


def test_mismatches_are_explained_as_near_ties_or_divergences(hand_run):
    for r in hand_run:  # every method agrees with the fixed target: always token 3
        r.output_ids = [3] * len(r.output_ids)
    tie = turn("q1", "a", "eagle1", 10, 0.7, [spec_round(4)] * 2)
    tie.output_ids = [3] * 6 + [4] + [3] * 3  # token 4 is 1 ulp below the argmax 3: a near-tie
    bug = turn("q2", "b", "eagle1", 6, 0.7, [spec_round(4)])
    bug.output_ids = [3, 3, 5, 3, 3, 3]  # token 5 is 7.0 below: a real divergence
    results = hand_run + [tie, bug]
    target = FixedLogits()
    check = explain_mismatches(target, results, check_greedy(results), tie_ulps=4)
    by = {m.question_id: m for m in check.mismatches}
    assert by["q1"].gap_ulps == pytest.approx(1.0) and by["q1"].near_tie
    assert by["q2"].gap_ulps == pytest.approx(7.0 / 0.0625) and not by["q2"].near_tie
    assert [m.question_id for m in check.divergences] == ["q2"]
    assert target.seen[0] == [1, 2, 3] + [3] * 6  # the forward saw vanilla's prefix up to the divergence
    d = check.to_dict()
    assert (d["lossless"], d["divergences"], d["near_ties"]) == (False, 1, 1)


HOMOGENEITY_DRAWS = 8000  # power: tests/test_statistical_power.py


def homogeneity_run(p, q):
    """`run(draws, seed)` for tests/statistical_rule.py: chi2_homogeneity's p-value of two samples from p and q."""
    def run(draws, seed):
        rng = np.random.default_rng(seed)
        return chi2_homogeneity(rng.choice(len(p), draws, p=p), rng.choice(len(q), draws, p=q))[2]
    return run


@pytest.mark.statistical
def test_chi2_homogeneity():
    p = np.array([0.5, 0.3, 0.15, 0.05])
    assert_same_law(homogeneity_run(p, p), draws=HOMOGENEITY_DRAWS, seed=0,
                    what="chi2_homogeneity of two samples of one law")
    q = np.array([0.4, 0.35, 0.2, 0.05])
    assert homogeneity_run(p, q)(2000, 1) < 1e-4
    # rare tokens are pooled: 3 singletons become one "other" cell
    stat, dof, pv, cells = chi2_homogeneity(np.array([0] * 50 + [7]), np.array([0] * 50 + [8, 9]))
    assert cells == 2 and dof == 1
    assert chi2_homogeneity(np.zeros(10, int), np.zeros(10, int)) == (0.0, 0, 1.0, 1)


def test_report_files(hand_run, tmp_path):
    summaries = summarize(hand_run, n_resamples=100)
    rounds = [rd for r in hand_run if r.method == "eagle2" for rd in r.stats.rounds]
    report = EvalReport(meta={"target": "t", "methods": {"vanilla": {"describe": "naivegenerate"},
                                                         "eagle2": {"describe": "dynamic 60/5/10"}}},
                        run=BenchmarkRun(hand_run), summaries=summaries,
                        comparisons=[compare(hand_run, "eagle2", "vanilla", n_resamples=100)],
                        greedy=check_greedy(hand_run), calibration={"eagle2": calibrate(rounds)})
    paths = write_report(report, tmp_path)
    for name in ("tau_by_category.png", "speedup_by_category.png", "depth_acceptance.png", "calibration_eagle2.png",
                 "report.json", "report.md"):
        assert (tmp_path / name).stat().st_size > 0, name
    data = json.loads((tmp_path / "report.json").read_text())  # strict JSON (NaN -> null)
    overall = {s["method"]: s for s in data["summaries"] if s["category"] == OVERALL}
    assert overall["eagle2"]["tau"]["value"] == pytest.approx(3.5)
    assert len(data["turns"]) == 4 and data["losslessness"]["lossless"]
    md = paths["markdown"].read_text()
    assert "| eagle2 | 3.50" in md and "LOSSLESS" in md and "calibration_eagle2.png" in md


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_report_rerun_that_fails_while_writing_keeps_the_previous_report(hand_run, tmp_path, monkeypatch):
    """Every report a rerun replaces is first written whole beside the previous one: a failure at its last file (the
    markdown, on a full disk here) leaves the previous evaluation, autotune, chi2 and serve-check reports
    byte-identical, with no partial file or folder left; a complete rerun then replaces each (the evaluation's
    plots the new report lacks and its answers.jsonl, not saved this time, go too)."""
    import dataclasses
    import errno

    from eagle.decoding_config import DecodingConfig
    from evaluation.autotune import TunePoint, TuneResult
    from evaluation.losslessness import DistributionTest, PositionTest
    from evaluation.report import write_autotune_report, write_chi2_report
    from evaluation.serve_check import write_check_report

    summaries = summarize(hand_run, n_resamples=100)
    rounds = [rd for r in hand_run if r.method == "eagle2" for rd in r.stats.rounds]
    report = EvalReport(meta={"target": "t", "methods": {"vanilla": {"describe": "naivegenerate"},
                                                         "eagle2": {"describe": "dynamic 60/5/10"}}},
                        run=BenchmarkRun(hand_run), summaries=summaries, comparisons=[],
                        greedy=check_greedy(hand_run), calibration={"eagle2": calibrate(rounds)})
    tune = TuneResult(vanilla_tokens_per_s=10.0, points=[TunePoint(16, 3, 2, 20.0, 2.5, 2.0, 6.0, 0.01, 0.01, 250.0)],
                      best=DecodingConfig(total_token=16, depth=3, top_k=2), pick={"by": "model", "rule": "r"})
    chi2 = [DistributionTest("eagle2", 100, 1.0, 0.01, [PositionTest(0, 1.0, 2, 3, 0.5)])]
    eval_dir = tmp_path / "eval"

    def write_all(tag: str, calibration: bool = True, answers: bool = True) -> None:
        write_report(dataclasses.replace(report, meta={**report.meta, "tag": tag},
                                         calibration=report.calibration if calibration else {}), eval_dir,
                     (lambda path: path.write_text(f"{tag} answers\n") and path) if answers else None)
        write_autotune_report(tune, {"tag": tag}, eval_dir / "autotune")
        write_chi2_report(chi2, {"tag": tag}, eval_dir / "chi2")
        write_check_report(eval_dir / "serve_check", {"tag": tag}, f"# {tag}\n", f"{tag} engine log\n")

    write_all("old")
    previous = files_of(eval_dir)
    assert {"report.json", "report.md", "answers.jsonl", "calibration_eagle2.png", "autotune/autotune.md",
            "chi2/chi2.md", "serve_check/report.md", "serve_check/engine.log"} <= set(previous)
    real_write_text = Path.write_text

    def full_disk_at_markdown(self, data, *a, **kw):
        if self.suffix == ".md":
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return real_write_text(self, data, *a, **kw)

    with monkeypatch.context() as m:
        m.setattr(Path, "write_text", full_disk_at_markdown)
        for writer in (lambda: write_all("new"),
                       lambda: write_autotune_report(tune, {"tag": "new"}, eval_dir / "autotune"),
                       lambda: write_chi2_report(chi2, {"tag": "new"}, eval_dir / "chi2"),
                       lambda: write_check_report(eval_dir / "serve_check", {}, "# new\n", "new log\n")):
            with pytest.raises(OSError, match="No space left"):
                writer()
            assert files_of(eval_dir) == previous
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval"]
    write_all("new", calibration=False, answers=False)
    now = files_of(eval_dir)
    assert "calibration_eagle2.png" not in now and "answers.jsonl" not in now
    assert all(b"new" in now[name] and b"old" not in now[name] for name in (
        "report.json", "autotune/autotune.md", "chi2/chi2.md", "serve_check/report.md", "serve_check/engine.log"))


def test_report_headline_is_the_fastest_speculative_method():
    from evaluation.bootstrap import Estimate
    from evaluation.losslessness import GreedyCheck
    from evaluation.metrics import MethodSummary
    from evaluation.report import headline, headline_text

    def summary(method, tau, speedup):
        return MethodSummary(method, OVERALL, 4, 4, 100, 1.0, 10, Estimate(tau, tau - 0.1, tau + 0.1, 4),
                             Estimate(50.0, 45.0, 55.0, 4), Estimate(*speedup, 4))

    methods = {"vanilla": {"mode": "vanilla", "describe": "naivegenerate"},
               "eagle2": {"mode": "dynamic", "describe": "dynamic total_token=60 depth=5 top_k=10"},
               "tuned": {"mode": "dynamic", "describe": "dynamic total_token=16 depth=4 top_k=2"}}
    summaries = [summary("vanilla", 1.0, (1.0, 1.0, 1.0)), summary("eagle2", 3.4, (1.13, 1.09, 1.17)),
                 summary("tuned", 3.66, (1.71, 1.61, 1.82))]
    h = headline(summaries, GreedyCheck(compared=12), methods)
    assert h["method"] == "tuned" and h["faster"] and h["mismatches"] == 0
    assert headline_text(h) == ("fastest: tuned (dynamic total_token=16 depth=4 top_k=2): tau 3.66, speedup 1.71x "
                                "[1.61, 1.82] over vanilla, 0 mismatches with vanilla greedy over 12 outputs")
    slower = [summary("vanilla", 1.0, (1.0, 1.0, 1.0)), summary("eagle2", 3.4, (0.8, 0.7, 1.02))]
    h = headline(slower, None, methods)  # a CI that reaches below 1 is not "faster"; T > 0: no mismatch count
    assert h["method"] == "eagle2" and not h["faster"] and h["mismatches"] is None
    assert headline([summaries[0]], None, methods) is None  # vanilla alone: no headline
