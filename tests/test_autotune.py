"""The tree auto-tuner's pick is robust to timing noise by design (evaluation/autotune.py): the round-time model fitted
on pooled timings, the pick rule, and a whole sweep on synthetic timings where one pass's noise misleads."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from eagle.decoding_config import DecodingConfig
from eagle.stats import GenerationStats, RoundStats
from evaluation import autotune
from evaluation.autotune import RoundTiming, TunePoint, choose, fit_time_model, grid
from evaluation.runner import GenerationArgs
from float_tolerance import assert_same_function, rounding_bound

# seconds per round: intercept, per verified node, per draft step, per drafted token (depth x top_k)
TRUE = (2.0e-3, 1.0e-4, 3.0e-4, 5.0e-5)


def design(rng: np.random.Generator, calls: int) -> list[tuple[int, float, int, int]]:
    """(rounds, mean nodes per round, depth, top_k) of `calls` calls spread like a tuning grid's."""
    return [(int(rng.integers(10, 40)), float(rng.choice([6, 10, 16, 24])), int(rng.choice([4, 5, 6])),
             int(rng.choice([1, 2, 3]))) for _ in range(calls)]


def features(rows) -> np.ndarray:
    return np.array([[1.0, n, d, d * k] for _, n, d, k in rows])


def standard_errors(rows, sigma_round: float) -> np.ndarray:
    """Standard errors of the weighted least-squares coefficients when each call's mean round seconds carries
    independent noise of sd sigma_round / sqrt(rounds): sqrt(diag((X' W X)^-1)) * sigma_round, W = rounds."""
    x = features(rows)
    w = np.array([r for r, _, _, _ in rows], dtype=float)
    return np.sqrt(np.diag(np.linalg.inv(x.T @ (x * w[:, None])))) * sigma_round


def calls_of(rows, mean_round_s) -> list[RoundTiming]:
    return [RoundTiming(r, int(round(n * r)), d, k, s * r) for (r, n, d, k), s in zip(rows, mean_round_s)]


def true_round_s(nodes: float, depth: int, top_k: int) -> float:
    return TRUE[0] + TRUE[1] * nodes + TRUE[2] * depth + TRUE[3] * depth * top_k


def coefficients(fit) -> np.ndarray:
    return np.array([fit.intercept, fit.per_node, fit.per_depth, fit.per_draft_token])


def test_time_model_recovers_known_coefficients_within_the_noise():
    rng = np.random.default_rng(0)
    rows = design(rng, 120)
    sigma = 0.1 * TRUE[0]  # per-round noise: 10% of the intercept
    clean = [true_round_s(n, d, k) + rng.normal(0, sigma / math.sqrt(r)) for r, n, d, k in rows]
    fit = fit_time_model(calls_of(rows, clean))
    se = standard_errors(rows, sigma)
    got = coefficients(fit)
    assert np.all(np.abs(got - TRUE) <= 5 * se), (got, TRUE, se)
    assert fit.calls == 120
    assert_same_function(fit.round_s(16, 5, 2), float(got @ [1, 16, 5, 10]), terms=4, dtype=torch.float64)


def test_time_model_shrugs_off_slow_spells_that_move_least_squares():
    rng = np.random.default_rng(1)
    rows = design(rng, 120)
    sigma = 0.1 * TRUE[0]
    y = np.array([true_round_s(n, d, k) + rng.normal(0, sigma / math.sqrt(r)) for r, n, d, k in rows])
    slow = rng.random(len(rows)) < 0.1  # a tenth of the calls ran in a slow spell: 1.5x their seconds
    y[slow & (np.array([d for _, _, d, _ in rows]) == 6)] *= 1.5  # ... all at depth 6: they bias the depth slope
    fit = fit_time_model(calls_of(rows, y))
    x = features(rows)
    w = np.sqrt([r for r, _, _, _ in rows])
    ols = np.linalg.lstsq(x * w[:, None], y * w, rcond=None)[0]
    got = coefficients(fit)
    se = standard_errors(rows, sigma)
    assert abs(ols[2] - TRUE[2]) > 5 * se[2]  # least squares is pulled off by the spell...
    assert np.all(np.abs(got - TRUE) <= 5 * se), (got, TRUE, se)  # ...the robust fit is not


def test_time_model_on_a_small_grid_predicts_its_own_points():
    # two grid points (one top_k, one prompt each, as the demo's test scale tunes): fewer calls than coefficients
    calls = [RoundTiming(10, 30, 2, 2, 0.030), RoundTiming(8, 24, 3, 2, 0.028), RoundTiming(0, 0, 3, 2, 0.0)]
    fit = fit_time_model(calls)
    assert fit.calls == 2
    # a consistent least-squares solve in float64: relative error <= cond(X) x the rounding of its 2 x 4 products
    cond = float(np.linalg.cond(np.array([[1.0, 3, 2, 4], [1.0, 3, 3, 6]])))
    for (nodes, depth), mean in (((3, 2), 0.003), ((3, 3), 0.0035)):
        got = fit.round_s(nodes, depth, 2)
        assert abs(got - mean) <= cond * rounding_bound(torch.float64, 8, mean), (got, mean)
    with pytest.raises(ValueError, match="no timed call decoded a round"):
        fit_time_model([RoundTiming(0, 0, 3, 2, 0.0)])


def point(tt: int, predicted: float) -> TunePoint:
    return TunePoint(tt, 5, 2, 0.0, 3.0, 1.0, predicted_tokens_per_s=predicted, final_tokens_per_s=1.0)


@pytest.mark.parametrize("challenger, by", [
    ([1.20, 1.15, 1.25], "timing"),  # faster in every repeat, median 1.20 > 1.10: the direct timing wins
    ([1.05, 1.08, 1.06], "model"),  # faster in every repeat but within the margin
    ([1.40, 1.30, 0.95], "model"),  # a large median, but slower in one repeat: noise cannot be ruled out
])
def test_pick_rule_keeps_the_model_unless_every_repeat_contradicts_it(challenger, by):
    best, other = point(16, 200.0), point(24, 180.0)
    ref = [100.0, 90.0, 110.0]
    pick, record = choose([other, best], {"16/5/2": ref, "24/5/2": [c * r for c, r in zip(challenger, ref)]})
    assert record["by"] == by and record["predicted_best"] == "16/5/2"
    assert pick is (other if by == "timing" else best)
    assert record["challengers"]["24/5/2"]["median_ratio"] == pytest.approx(float(np.median(challenger)))


NEW_TOKENS = 64


def tau_of(tt: int, depth: int, top_k: int) -> float:
    """A made-up acceptance length (grows with the tree's nodes and depth, saturating), as `NEW_TOKENS` tokens in
    whole rounds give it."""
    tau = 1.0 + min(depth, 0.35 * tt) * (1 - math.exp(-top_k / 1.5))
    return NEW_TOKENS / math.ceil(NEW_TOKENS / tau)


def test_sweep_picks_the_truly_fastest_tree_where_one_pass_timing_picks_wrong(monkeypatch):
    """A synthetic sweep (generate replaced by exact tau and seconds = rounds x the true round time x noise, on the
    wall and the CPU clock alike): one slow spell during the fastest tree's screening pass and a lucky spell during a
    10%-slower tree's make the screening timings rank the slower tree first; the model, fitted on every call, still
    picks the fastest."""
    base = DecodingConfig(total_token=60, depth=5, top_k=10)
    configs, _ = grid([6, 10, 16, 24], [4, 5, 6], [1, 2, 3], base)
    truth = {(c.total_token, c.depth, c.top_k): tau_of(c.total_token, c.depth, c.top_k)
             / true_round_s(c.total_token - 1, c.depth, c.top_k) for c in configs}
    fastest = max(truth, key=truth.get)
    lucky = max((k for k in truth if truth[k] <= 0.9 * truth[fastest]), key=truth.get)
    prompts = [[1, 2, 3]] * 4
    gen = GenerationArgs(max_new_tokens=NEW_TOKENS)
    rng = np.random.default_rng(0)
    seen: dict[tuple, int] = {}
    clock = [0.0]  # the CPU clock the fake calls advance

    def fake_generate(model, method, prompt, gen_args, generator=None):
        d = method.decoding
        n_new = gen_args.max_new_tokens
        if d.mode == "vanilla":
            tau, nodes, round_s = 1.0, 0, 1.5e-3
        elif d.mode == "static":  # EAGLE-1: 26 nodes, depth 5
            tau, nodes, round_s = 3.2, 26, true_round_s(26, 5, 4)
        else:  # the root is not a drafted node: total_token - 1 verified per round
            nodes = d.total_token - 1
            tau, round_s = tau_of(d.total_token, d.depth, d.top_k), true_round_s(nodes, d.depth, d.top_k)
        key = (d.mode, d.total_token, d.depth, d.top_k)
        seen[key] = seen.get(key, 0) + 1
        spell = 1.0
        if d.mode == "dynamic" and 2 <= seen[key] <= 1 + len(prompts):  # its screening pass (call 1: warm-up)
            spell = {fastest: 1.4, lucky: 0.8}.get((d.total_token, d.depth, d.top_k), 1.0)
        rounds = math.ceil(n_new / tau)
        stats = GenerationStats(prompt_tokens=len(prompt), new_tokens=n_new, prefill_s=1e-3)
        per = [n_new // rounds + (i < n_new % rounds) for i in range(rounds)]
        empty = torch.zeros(nodes)
        stats.rounds = [RoundStats(k - 1, k, torch.ones(nodes, dtype=torch.long), empty, empty,
                                   torch.zeros(nodes, dtype=torch.bool)) for k in per]
        wall = 1e-3 + rounds * round_s * spell * float(rng.lognormal(0, 0.05))
        clock[0] += wall
        return [0] * n_new, stats, wall

    monkeypatch.setattr(autotune, "generate", fake_generate)
    monkeypatch.setattr(autotune, "cpu_clock", lambda: clock[0])
    result = autotune.autotune_tree(None, prompts, configs, gen, finalists=3, repeats=3, clock="cpu", progress=False)
    screened = max(result.points, key=lambda p: p.tokens_per_s)
    assert (screened.total_token, screened.depth, screened.top_k) == lucky  # one pass's timing picks wrong
    assert (result.best.total_token, result.best.depth, result.best.top_k) == fastest
    assert result.pick["by"] == "model" and result.eagle1_tokens_per_s > 0
    tm = result.time_model
    assert tm.calls == len(configs) * len(prompts) + 3 * 3 * len(prompts)  # screening + re-timed finalists
    for p in result.points:  # exact tau, modelled round seconds within 3% of the truth (5% per-call noise)
        assert p.tau == tau_of(p.total_token, p.depth, p.top_k)  # the same integer division
        # 5% per-call noise over ~130 calls: the fitted round time's standard error is ~0.5%; 3% is ~6 of them
        assert p.predicted_round_s == pytest.approx(true_round_s(p.nodes, p.depth, p.top_k), rel=0.03)


def test_timing_clock_is_cpu_only_for_a_one_thread_cpu_model():
    model = torch.nn.Linear(2, 2)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert autotune.timing_clock(model) == "cpu"
        torch.set_num_threads(2)
        assert autotune.timing_clock(model) == "wall"  # CPU seconds of 2 threads add up
    finally:
        torch.set_num_threads(threads)
