"""Calibrated tree scores (eagle/score_calibration.py, evaluation/calibration.py fit, evaluation/autotune.py driver).

1. The fit: an isotonic per-depth map recovers a known acceptance curve from synthetic node outcomes, is
   increasing, and gives deeper depths their own map only when they have the data.
2. Save / load: tree_config.json keeps one map per sampling setting next to the tree settings; EaModel picks the
   one that matches the decoding setting (and none at another), `from_pretrained` loads it.
3. The tree: ranked by the calibrated scores (EAGLE-2's rule with the map applied), siblings kept in rank order,
   the raw draft probabilities untouched; a map that favours depth makes deeper trees.
4. Losslessness with a calibrated tree, both head kinds: greedy equals transformers' greedy `generate` token for
   token; sampling matches the exact law of the first three tokens (chi-square, as tests/test_sampling.py, through
   the sequential rule of tests/statistical_rule.py).
5. The driver fits a map on a tiny model's held-out prompts, at T = 0 and T > 0, and installs it; its first pass
   decodes the coverage tree, so every (depth, rank) cell of the largest tree gets nodes by construction.
6. Coverage: the map records its (depth, rank) cells and node counts; `covered()` is the largest tree shape it
   covers, and evaluation's one-line warning fires for a tree deeper or wider than that (or a map without a record).
"""
from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
import torch

from eagle import DecodingConfig, EaModel
from eagle.ea_model import load_calibrations, load_tree_config, save_tree_config
from eagle.score_calibration import ScoreCalibration, pick_calibration
from eagle.static_trees import coverage_choices
from eagle.stats import RoundStats
from eagle.tree import StaticTreeSpec, rerank_tree
from evaluation.autotune import fit_tree_calibration
from evaluation.calibration import calibrate, coverage_warning, fit_score_calibration, isotonic_knots
from evaluation.runner import GenerationArgs
from statistical_rule import assert_same_law
from test_sampling import SETTINGS, chi_square_run, sampling_setup
from tiny_models import family_setup, first_divergence_report, single_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")


def synthetic_rounds(n_rounds: int, curve, seed: int = 0, depth_curves: dict | None = None,
                     rank_curves: dict | None = None) -> list[RoundStats]:
    """Rounds of 4 chains of 3 nodes (depths 1-3), each node of a random sibling rank 0-2, whose acceptance given the
    parent follows `curve(p)` (or depth_curves[d](p), or rank_curves[r](p)); a node is accepted only if its parent was."""
    rng = np.random.default_rng(seed)
    rounds = []
    for _ in range(n_rounds):
        depth, prob, parent, acc, rank = [], [], [], [], []
        for _chain in range(4):
            prev = -1
            for d in (1, 2, 3):
                p, r = float(rng.beta(0.6, 2.5)), int(rng.integers(0, 3))
                f = (rank_curves or {}).get(r) or (depth_curves or {}).get(d) or curve
                ok = (prev < 0 or acc[prev]) and rng.random() < f(p)
                depth.append(d)
                prob.append(p)
                parent.append(prev)
                acc.append(bool(ok))
                rank.append(r)
                prev = len(depth) - 1
        path = np.ones(len(prob))  # path products are not used by the fit
        rounds.append(RoundStats(accept_length=0, new_tokens=1, node_depth=torch.tensor(depth),
                                 node_prob=torch.tensor(prob, dtype=torch.float32),
                                 node_path_prob=torch.tensor(path, dtype=torch.float32),
                                 node_accepted=torch.tensor(acc), node_parent=torch.tensor(parent),
                                 node_rank=torch.tensor(rank)))
    return rounds


# ----------------------------------------------------------------------------- 1. the fit
def test_isotonic_knots_recover_a_known_curve_and_increase():
    rng = np.random.default_rng(1)
    p = rng.beta(0.6, 2.5, size=20_000)
    acc = rng.random(p.size) < np.sqrt(p)
    xs, ys = isotonic_knots(p, acc)
    assert all(b > a for a, b in zip(xs, xs[1:])) and all(b >= a for a, b in zip(ys, ys[1:]))
    assert 0.0 < ys[0] and ys[-1] < 1.0  # smoothed: a finite sample never says "always" or "never"
    cal = ScoreCalibration(0.0, 0.0, 0, [[xs]], [[ys]])
    grid = torch.tensor([0.02, 0.05, 0.1, 0.2, 0.4, 0.6])
    assert torch.allclose(cal.probability(grid, 1), grid.sqrt(), atol=0.06), cal.probability(grid, 1)


def test_fit_gives_each_depth_with_data_its_own_map():
    curves = {1: lambda p: min(1.0, 3 * p), 2: lambda p: p, 3: lambda p: p}
    rounds = synthetic_rounds(2000, None, depth_curves=curves)
    cal = fit_score_calibration(rounds, 0.0, 0.0, 0, min_nodes_per_depth=500, rank_maps=1)
    per_depth = {d["depth"]: d["nodes"] for d in cal.fitted_on["per_depth"]}
    assert 1 in per_depth and len(cal.knots_x) == len(per_depth)
    p = torch.tensor([0.1, 0.2])
    assert torch.allclose(cal.probability(p, 1), torch.tensor([0.3, 0.6]), atol=0.07)
    assert torch.allclose(cal.probability(p, 2), p, atol=0.07)
    assert torch.equal(cal.probability(p, 9), cal.probability(p, len(cal.knots_x)))  # deeper: the last map
    # a depth without enough data shares the map above it
    sparse = fit_score_calibration(rounds, 0.0, 0.0, 0, min_nodes_per_depth=7000, rank_maps=1)
    assert len(sparse.knots_x) == 1 and sparse.fitted_on["per_depth"][0]["depth"] == 1
    with pytest.raises(ValueError, match="need at least"):
        fit_score_calibration(rounds[:3], 0.0, 0.0, 0)


def test_log_score_table_matches_the_exact_map():
    cal = ScoreCalibration(0.0, 0.0, 0, [[[0.01, 0.1, 0.5], [0.02, 0.3]], [[0.2, 0.6]]],
                           [[[0.05, 0.6, 0.9], [0.01, 0.2]], [[0.3, 0.5]]])
    lp = torch.linspace(-12, 0, 500)[:, None].expand(500, 4)  # [500, 4]: columns are sibling ranks 0..3
    for d in (1, 2, 3):
        got = cal.log_score(lp, d)
        for r in range(4):  # depth 2 has one map for every rank; at depth 1 ranks >= 1 share the rank-1 map
            exact = cal.probability(lp[:, r].exp(), d, r).log()
            assert torch.allclose(got[:, r], exact, atol=0.01), (d, r)
    assert not torch.allclose(cal.log_score(lp, 1)[:, 0], cal.log_score(lp, 1)[:, 1])
    assert float(cal.log_score(torch.tensor([0.0]), 1)) == pytest.approx(math.log(0.9))  # flat past the last knot
    assert bool((cal.log_score(lp, 1) <= 0).all())  # never above 1: values never increase along a path


def test_fit_learns_that_rank_predicts_acceptance():
    # the greedy situation of the default target: the best draft token is accepted whatever its probability
    curves = {0: lambda p: 0.8, 1: lambda p: 0.1, 2: lambda p: 0.02}
    cal = fit_score_calibration(synthetic_rounds(1500, None, rank_curves=curves), 0.0, 0.0, 0)
    p = torch.tensor([0.05, 0.2])
    for r, want in ((0, 0.8), (1, 0.1), (2, 0.02)):
        assert torch.allclose(cal.probability(p, 1, r), torch.full((2,), want), atol=0.06), (r, cal.probability(p, 1, r))
    assert [c[0] > 0 for c in cal.fitted_on["per_depth"][0]["per_rank"]] == [True, True, True, False]


def test_a_short_rank_at_depth_1_borrows_its_own_rank_at_other_depths_not_its_siblings():
    curves = {0: lambda p: 0.85, 1: lambda p: 0.1, 2: lambda p: 0.02}
    rounds = synthetic_rounds(60, None, rank_curves=curves)
    at_1 = sum(int(((r.node_depth == 1) & (r.node_rank == 0)).sum()) for r in rounds)
    assert at_1 < 100  # short of min_nodes_per_map at depth 1, not over all depths
    cal = fit_score_calibration(rounds, 0.0, 0.0, 0, rank_maps=3)
    first = cal.fitted_on["per_depth"][0]["per_rank"][0]  # [nodes, accepted] the rank-0 map was fitted on
    assert first[0] > at_1 and first[1] / first[0] > 0.6, first  # rank 0's own nodes (its siblings': ~6%)
    assert float(cal.probability(torch.tensor([0.05]), 1, 0)) > 0.6


@pytest.mark.parametrize("bad,match", [
    (dict(knots_x=[[[0.2, 0.1]]], knots_y=[[[0.1, 0.2]]]), "increase"),
    (dict(knots_x=[[[0.1, 0.2]]], knots_y=[[[0.3, 0.2]]]), "decrease"),
    (dict(knots_x=[[[0.1]]], knots_y=[[[1.5]]]), r"\[0, 1\]"),
    (dict(knots_x=[], knots_y=[]), "one list per depth"),
    (dict(knots_x=[[]], knots_y=[[]]), "one list per rank"),
])
def test_bad_maps_are_refused(bad, match):
    with pytest.raises(ValueError, match=match):
        ScoreCalibration(temperature=0.0, top_p=0.0, top_k=0, **bad)


# ----------------------------------------------------------------------------- 2. save / load / pick
def test_save_and_load_keep_one_map_per_sampling_setting(tmp_path):
    greedy = ScoreCalibration(0.0, 0.0, 0, [[[0.1, 0.5]]], [[[0.4, 0.9]]], fitted_on={"nodes": 123})
    warm = ScoreCalibration(0.7, 0.9, 8, [[[0.1, 0.5]]], [[[0.1, 0.5]]])
    save_tree_config(tmp_path, DecodingConfig(total_token=16, depth=4, top_k=2), greedy)
    save_tree_config(tmp_path, None, warm)  # the tree settings stay
    assert load_tree_config(tmp_path) == DecodingConfig(total_token=16, depth=4, top_k=2)
    refit = dataclasses.replace(greedy, knots_y=[[[0.5, 0.95]]])
    save_tree_config(tmp_path, DecodingConfig(total_token=10, depth=3, top_k=3), refit)  # replaces the greedy map
    maps = load_calibrations(tmp_path)
    assert [m.to_dict() for m in maps] == [warm.to_dict(), refit.to_dict()]
    assert pick_calibration(maps, 0.0, 0.0, 0).knots_y == [[[0.5, 0.95]]]
    assert pick_calibration(maps, 1e-6, 0.5, 3) is pick_calibration(maps, 0.0, 0.0, 0)  # greedy is greedy
    assert pick_calibration(maps, 0.7, 0.9, 8) is maps[0]
    assert pick_calibration(maps, 0.7, 0.9, 0) is None and pick_calibration(maps, 1.0, 0.0, 0) is None
    data = json.loads((tmp_path / "tree_config.json").read_text())
    data["calibration"][0]["knots"] = []
    (tmp_path / "tree_config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="knots"):
        load_calibrations(tmp_path)


def test_from_pretrained_uses_the_saved_map_by_default(tmp_path):
    s = family_setup("llama")
    s.target.save_pretrained(tmp_path / "target")
    s.good_head.save_pretrained(tmp_path / "head")
    cal = ScoreCalibration(0.0, 0.0, 0, [[[0.05, 0.3]]], [[[0.5, 0.9]]])
    save_tree_config(tmp_path / "head", DecodingConfig(total_token=24, depth=5, top_k=4), cal)
    model = EaModel.from_pretrained(str(tmp_path / "target"), str(tmp_path / "head"), torch_dtype=torch.float32)
    assert [c.to_dict() for c in model.calibrations] == [cal.to_dict()]
    _, stats = model.eagenerate(s.prompts[0], max_new_tokens=16, return_stats=True)
    assert all(r.node_score is not None for r in stats.rounds)  # ranked by the map
    _, stats = model.eagenerate(s.prompts[0], max_new_tokens=16, return_stats=True, temperature=1.0,
                                generator=torch.Generator().manual_seed(0))
    assert all(r.node_score is None for r in stats.rounds)  # no map for T = 1: raw probabilities
    off = dataclasses.replace(model.decoding, calibrate=False)
    _, stats = model.eagenerate(s.prompts[0], max_new_tokens=16, return_stats=True, decoding=off)
    assert all(r.node_score is None for r in stats.rounds)


# ----------------------------------------------------------------------------- 3. the tree
# "the best draft token is almost surely accepted, the others hardly ever": deep, chain-like trees
DEEP = ScoreCalibration(0.0, 0.0, 0, [[[0.001, 0.05, 0.2], [0.01, 0.5]]], [[[0.6, 0.9, 0.97], [0.02, 0.3]]])


def test_rerank_by_calibrated_scores_keeps_raw_probabilities():
    # two depth-1 candidates and one child each; raw values prefer the 2nd root child, the scores the chain
    tokens = torch.tensor([10, 11, 12, 13])
    lp = torch.tensor([0.3, 0.25, 0.2, 0.2]).log()
    parent = torch.tensor([-1, -1, 0, 1])
    depth = torch.tensor([1, 1, 2, 2])
    path = lp + torch.where(parent >= 0, lp[parent.clamp(min=0)], 0.0)
    score = torch.tensor([0.9, 0.5, 0.8, 0.3]).log()
    score = score + torch.where(parent >= 0, score[parent.clamp(min=0)], 0.0)
    raw = rerank_tree(7, tokens, lp, path, parent, depth, total_token=3)
    cal = rerank_tree(7, tokens, lp, path, parent, depth, total_token=3, cand_score=score)
    assert raw.tokens.tolist() == [7, 10, 11] and raw.path_score is None
    assert cal.tokens.tolist() == [7, 10, 12] and cal.parents.tolist() == [-1, 0, 1]
    assert torch.allclose(cal.prob, torch.tensor([1.0, 0.3, 0.2]))  # the draft's own probabilities
    assert torch.allclose(cal.path_score.exp(), torch.tensor([1.0, 0.9, 0.72]))


@pytest.mark.parametrize("kind", ["eagle2", "eagle3"])
def test_calibrated_dynamic_tree_is_eagle2_with_the_map_applied(kind):
    s = family_setup("llama", kind=kind)
    # a map saying "every node above p = 0.001 is accepted half the time": the tree fills nearly level by level,
    # where the fitted head's confident raw probabilities make it deep
    flat = ScoreCalibration(0.0, 0.0, 0, [[[0.001, 1.0]]], [[[0.5, 0.5]]])
    model = EaModel(s.target, s.good_head, DecodingConfig(total_token=20, depth=5, top_k=4))
    model.calibrations = [flat]
    prompt = s.prompts[1]
    with torch.inference_mode():
        _, raw = model.eagenerate(prompt, max_new_tokens=24, return_stats=True,
                                  decoding=dataclasses.replace(model.decoding, calibrate=False))
        _, cal = model.eagenerate(prompt, max_new_tokens=24, return_stats=True)
    depth_raw = np.mean([int(r.node_depth.max()) for r in raw.rounds])
    depth_cal = np.mean([int(r.node_depth.max()) for r in cal.rounds])
    assert depth_cal < depth_raw - 1, (depth_cal, depth_raw)
    for r in cal.rounds:  # the score of a node is the map of its raw probability at its depth
        for d in range(1, int(r.node_depth.max()) + 1):
            sel = r.node_depth == d
            want = flat.probability(r.node_prob[sel], d)
            assert torch.allclose(r.node_score[sel], want, rtol=3e-3, atol=1e-6)  # the table is 0.004 nats fine
        # siblings stay in the draft's rank order
        for p in set(r.node_parent.tolist()):
            kids = r.node_prob[r.node_parent == p]
            assert bool((kids[:-1] >= kids[1:]).all())


# ----------------------------------------------------------------------------- 4. lossless
@pytest.mark.parametrize("kind", ["eagle2", "eagle3"])
@pytest.mark.parametrize("decoding", [DecodingConfig(total_token=60, depth=5, top_k=10),
                                      DecodingConfig(total_token=12, depth=6, top_k=2)], ids=["60-5-10", "12-6-2"])
def test_greedy_with_a_calibrated_tree_equals_transformers_greedy(kind, decoding):
    s = family_setup("llama", kind=kind)
    for head in (s.good_head, s.random_head):
        model = EaModel(s.target, head, decoding)
        model.calibrations = [DEEP]
        for i, (prompt, ref) in enumerate(zip(s.prompts, s.references)):
            out, stats = model.eagenerate(prompt, max_new_tokens=ref.shape[1] - prompt.shape[1], return_stats=True)
            assert torch.equal(out, ref), f"{kind} prompt {i}: {first_divergence_report(s.target, ref, out)}"
            assert all(r.node_score is not None for r in stats.rounds)


def calibrated_generate(kind: str, temperature: float, top_p: float, top_k: int):
    """eagenerate of the sampling setup's head with a map for exactly this sampling setting (a deep-tree one)."""
    target, _, head = sampling_setup(kind)
    model = EaModel(target, head, DecodingConfig(total_token=16, depth=4, top_k=3))
    model.calibrations = [dataclasses.replace(DEEP, temperature=temperature, top_p=top_p, top_k=top_k)]
    return model


@pytest.mark.statistical
@pytest.mark.parametrize("kind,setting,draws", [("eagle2", "T1.0", 2000), ("eagle2", "T0.7-top_p0.9-top_k8", 2000),
                                                ("eagle3", "T1.0", 1000)])
def test_sampling_with_a_calibrated_tree_matches_the_exact_law(kind, setting, draws):
    model = calibrated_generate(kind, *SETTINGS[setting])
    target, prompt, _ = sampling_setup(kind)
    _, stats = model.eagenerate(prompt, temperature=SETTINGS[setting][0], top_p=SETTINGS[setting][1],
                                top_k=SETTINGS[setting][2], max_new_tokens=3, return_stats=True,
                                generator=torch.Generator().manual_seed(0))
    assert stats.rounds[0].node_score is not None, "the map must be in use for this setting"
    assert_same_law(chi_square_run(model.eagenerate, *SETTINGS[setting], kind=kind, max_rounds=2.0), draws=draws,
                    seed=11, what=f"{kind} {setting} calibrated")


@pytest.mark.slow
@pytest.mark.statistical
@pytest.mark.parametrize("kind", ["eagle2", "eagle3"])
@pytest.mark.parametrize("setting", ["T1.0", "T0.7-top_p0.9-top_k8"])
def test_sampling_with_a_calibrated_tree_is_exact_20k_draws(kind, setting):
    model = calibrated_generate(kind, *SETTINGS[setting])
    assert_same_law(chi_square_run(model.eagenerate, *SETTINGS[setting], kind=kind), draws=20_000, seed=12,
                    what=f"{kind} {setting} calibrated")


# ----------------------------------------------------------------------------- 5. the driver
@pytest.mark.parametrize("kind,temperature", [("eagle2", 0.0), ("eagle3", 0.0), ("eagle2", 1.0)])
def test_fit_tree_calibration_fits_installs_and_reports(kind, temperature):
    s = family_setup("llama", kind=kind)
    model = EaModel(s.target, s.good_head, DecodingConfig(total_token=30, depth=4, top_k=5))
    gen = GenerationArgs(max_new_tokens=24, max_length=256, temperature=temperature)
    prompts = [p[0].tolist() for p in s.prompts[:10]]
    cal = fit_tree_calibration(model, prompts, model.decoding, gen, passes=2, progress=False)
    assert cal.matches(temperature, 0.0, 0) and model.calibrations == [cal]
    assert cal.fitted_on["passes"] == 2 and cal.fitted_on["prompts"] == 10 and cal.fitted_on["nodes"] >= 200
    assert cal.fitted_on["coverage_tree"] == "5x5"  # default: the base tree's node depth (4 + 1) x top_k
    # the fitted map predicts acceptance on its own data better than the raw probabilities (log loss)
    _, stats = model.eagenerate(s.prompts[10], max_new_tokens=24, return_stats=True, temperature=temperature,
                                generator=torch.Generator().manual_seed(3))
    assert all(r.node_score is not None for r in stats.rounds)
    report = calibrate(stats.rounds)
    assert {"path_prob", "node_prob", "path_score", "node_score"} <= set(report)
    assert not math.isnan(report["node_score"].ece_bins)


@pytest.mark.parametrize("kind", ["eagle2", "eagle3"])
def test_coverage_pass_fills_every_cell_of_the_largest_tree_by_construction(kind):
    s = family_setup("llama", kind=kind)
    # a map that ranks every node alike: its dynamic tree (20/3/3) would never reach depth 5 or rank 3
    model = EaModel(s.target, s.good_head, DecodingConfig(total_token=20, depth=3, top_k=3))
    gen = GenerationArgs(max_new_tokens=24, max_length=256)
    prompts = [p[0].tolist() for p in s.prompts[:6]]
    static_before = model.static_tree
    cal = fit_tree_calibration(model, prompts, model.decoding, gen, passes=1, cover=(5, 4), progress=False)
    assert model.static_tree is static_before  # the coverage tree was only borrowed for the pass
    cells = cal.fitted_on["coverage"]["nodes"]  # [depth][rank] nodes whose parent was accepted
    assert len(cells) == 5 and all(len(row) == 4 for row in cells)
    rounds = cells[0][0]
    assert rounds > 0 and cells[0] == [rounds] * 4  # depth 1: every rank drafted every round (parent = root)
    for d in range(1, 5):  # deeper: every rank as often as the spine above it was accepted, never more
        assert cells[d] == [cells[d][0]] * 4 and cells[d][0] <= cells[d - 1][0]
    assert cells[4][0] > 0, "the good head's spine never reached depth 4 accepted"
    assert cal.covered()[1] == 4 or rounds < cal.fitted_on["coverage"]["min_nodes"]


def test_coverage_tree_is_a_spine_with_every_rank():
    assert coverage_choices(3, 2) == [[0], [1], [0, 0], [0, 1], [0, 0, 0], [0, 0, 1]]
    spec = StaticTreeSpec.from_choices(coverage_choices(9, 10))
    assert spec.size == 1 + 90 and spec.max_depth == 9 and spec.max_rank == 9
    with pytest.raises(ValueError, match="must be >= 1"):
        coverage_choices(0, 3)


def covering(nodes, min_nodes=30):
    return ScoreCalibration(0.0, 0.0, 0, [[[0.1, 0.5]]], [[[0.4, 0.9]]],
                            fitted_on={"coverage": {"nodes": nodes, "min_nodes": min_nodes}})


def test_covered_is_the_largest_tree_every_cell_of_which_has_data():
    assert covering([[50, 40, 30], [45, 31, 30], [35, 29, 30], [90, 90, 90]]).covered() == (2, 3)
    assert covering([[50, 40, 12], [45, 31, 30], [35, 30, 5]]).covered() == (3, 2)
    assert covering([[50], [45]]).covered() == (2, 1)
    assert covering([[5, 40]]).covered() == (0, 0)
    assert ScoreCalibration(0.0, 0.0, 0, [[[0.1]]], [[[0.4]]]).covered() is None  # fitted before coverage existed
    assert "covering node depths 1-2 x ranks 0-2" in covering([[50, 40, 30], [45, 31, 30]]).describe()
    cal = covering([[50, 40], [45, 31]])
    assert (cal.cell_nodes(2, 1), cal.cell_nodes(3, 0), cal.cell_nodes(1, 5)) == (31, 0, 0)


@pytest.mark.parametrize("bad", [{"nodes": "many"}, {"nodes": [[1, -2]]}, {"nodes": [[1.5]]},
                                 {"nodes": [[1]], "min_nodes": 0}, ["not", "a", "dict"]])
def test_bad_coverage_records_are_refused(bad):
    with pytest.raises(ValueError, match="fitted_on.coverage"):
        ScoreCalibration.from_dict({"temperature": 0.0, "top_p": 0.0, "top_k": 0, "knots_x": [[[0.1]]],
                                    "knots_y": [[[0.4]]], "fitted_on": {"coverage": bad}})


def test_coverage_warning_fires_for_a_deeper_or_wider_tree_only():
    cal = covering([[80] * 10] * 6 + [[80] * 4 + [3] * 6] * 2)  # depths 1-6 x 10 ranks, 7-8 x 4 ranks
    assert cal.covered() == (6, 10)
    eagle2 = DecodingConfig(total_token=60, depth=5, top_k=10)  # nodes at depths 1-6
    assert coverage_warning("method eagle2", "runs/x/head", eagle2, cal) is None
    assert coverage_warning("method eagle2", "runs/x/head", eagle2, None) is None  # no map: raw scores
    assert coverage_warning("method eagle1", "h", DecodingConfig(mode="static"), cal) is None
    # depths 7-8 have data at ranks 0-3: a deep narrow tree is covered cell by cell, a deep wide one is not
    assert coverage_warning("method tuned", "runs/x/head", dataclasses.replace(eagle2, depth=7, top_k=4), cal) is None
    deeper = coverage_warning("method tuned", "runs/x/head", dataclasses.replace(eagle2, depth=6, top_k=6), cal)
    assert "tree 60/6/6 reaches node depth 7 x 6 ranks" in deeper and "covers depth 6 x 10 ranks" in deeper
    assert "(2 cells with fewer than 30 fitted nodes, (depth, rank): nodes (7, 4): 3, (7, 5): 3)" in deeper
    assert "autotune" in deeper and "\n" not in deeper
    assert "(9, 0): 0" in coverage_warning("method eagle2", "h", dataclasses.replace(eagle2, depth=8, top_k=2), cal)
    narrow = covering([[80] * 4] * 6)
    wider = coverage_warning("method eagle2", "runs/x/head", eagle2, narrow)
    assert "covers depth 6 x 4 ranks (36 cells with fewer than 30" in wider and "(1, 4): 0" in wider
    legacy = coverage_warning("method eagle2", "runs/x/head", eagle2, ScoreCalibration(0.0, 0.0, 0, [[[0.1]]],
                                                                                       [[[0.4]]]))
    assert "records no coverage" in legacy and "\n" not in legacy
