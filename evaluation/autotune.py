"""Pick the EAGLE-2 tree (total_token, depth, top_k) that is fastest on THIS hardware.

Acceptance length grows with the tree, but so does the cost of drafting and verifying it; where the optimum lies
depends on the model, the head and the machine. Single timings on a shared machine vary by +-20% (and drift over
seconds), so a grid point is never judged by its own few timings alone. Its speed is split into the two factors that
have different noise:

- tau (tokens per target forward) is a property of the tree, the head and the prompts, not of the machine's load: at
  T = 0 it is exact on the tuning prompts (every pass of a point gives the same value); at T > 0 it is the mean over
  every pass of the point.
- the seconds of one decoding round are modelled from ALL timings of the sweep pooled: round_s = a + b * nodes +
  c * depth + e * depth * top_k (nodes = the tree's verify width per round, measured; depth = the draft steps,
  each drafting top_k tokens), the same function of the tree for every grid point on one machine, fitted by robust
  least squares (soft-L1 loss, so a slow spell during one call moves the fit little) on one observation per (grid
  point, prompt) call: its seconds after the prefill / rounds, weighted by its rounds. Each point's round time is
  then predicted from ~all calls of the sweep instead of measured from its own ~4. On a CPU model with one
  intra-op thread (the demo) the seconds are the process's CPU seconds (time.process_time), not wall seconds: on a
  shared machine the wall clock also counts the time other jobs held the core, which is the noise, while the CPU
  time is the tree's cost. Elsewhere (a GPU, whose kernels CPU time does not see; several threads, whose CPU
  seconds add up) they are wall seconds.

Predicted tokens/s = tau / predicted round_s ranks the grid. Three stages: a screening pass times every point once
on the tuning prompts (shuffled order, vanilla re-timed every few points; this gives every tau and the model's
data); the `finalists` best predicted points are re-timed `repeats` times back to back with vanilla and EAGLE-1's
static tree on each prompt (a slow spell hits all of them alike), and the model is refitted on every call. The pick
is the finalist with the highest predicted tokens/s, unless the direct re-timing (per repeat, on the model's clock)
contradicts it beyond noise: a finalist that was faster than it in EVERY repeat (a sign test: 2^-repeats when
both are equally fast, 1/8 at 3 repeats) AND by a median paired ratio above 1 + OVERRIDE_MARGIN (beyond the ~+-10%
spread of paired repeats on a shared box) replaces it. Finalists' speeds against vanilla and EAGLE-1 (median paired
ratios, wall clock) are reported. A wrong prediction costs speed, never correctness: every grid point decodes
losslessly.
"""
from __future__ import annotations

import dataclasses
import itertools
import random
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from scipy.optimize import least_squares
from scipy.stats import median_abs_deviation
from tqdm.auto import tqdm

from eagle.decoding_config import DecodingConfig
from eagle.score_calibration import ScoreCalibration
from eagle.static_trees import coverage_choices
from evaluation.calibration import fit_score_calibration
from evaluation.methods import Method
from evaluation.runner import GenerationArgs, generate


OVERRIDE_MARGIN = 0.10  # a finalist's median paired speed over the predicted best must exceed 1 + this to replace it
# round_s = a + b * nodes + c * depth + e * depth * top_k: the verify width, the draft steps and the tokens they draft
ROUND_FEATURES = ("intercept", "per_node", "per_depth", "per_draft_token")
cpu_clock = time.process_time  # the clock the model is fitted on (module-level so tests can drive it)


@dataclass
class TunePoint:
    total_token: int
    depth: int
    top_k: int
    tokens_per_s: float  # screening pass: tokens / seconds over all tune prompts
    tau: float  # over every pass of this setting
    speedup: float  # screening tokens/s / vanilla tokens/s timed closest in the sweep (measured, one pass)
    nodes: float = 0.0  # mean tree nodes verified per round (the verify width), over every pass
    round_s: float = 0.0  # measured: mean seconds per round over this point's own calls (screening + re-timing)
    predicted_round_s: float = 0.0  # the pooled time model's round seconds at (nodes, depth)
    predicted_tokens_per_s: float = 0.0  # tau / predicted_round_s: what ranks the grid
    final_tokens_per_s: float | None = None  # finalists: median over the re-timed repeats
    final_speedup: float | None = None  # finalists: median over repeats of tokens/s / vanilla's in the same repeat
    final_vs_eagle1: float | None = None  # finalists: median over repeats of tokens/s / EAGLE-1's in the same repeat


@dataclass
class TimeModel:
    """CPU seconds of one decoding round as a function of the tree: intercept + per_node * nodes + per_depth * depth
    + per_draft_token * depth * top_k."""
    intercept: float
    per_node: float
    per_depth: float
    per_draft_token: float
    residual_s: float  # robust scale (1.4826 x MAD) of the per-call residuals of the mean round seconds
    calls: int  # observations the fit used
    clock: str = "cpu"  # "cpu" (process CPU seconds) or "wall" (timing_clock)

    def round_s(self, nodes: float, depth: int, top_k: int) -> float:
        return self.intercept + self.per_node * nodes + self.per_depth * depth + self.per_draft_token * depth * top_k


@dataclass
class TuneResult:
    vanilla_tokens_per_s: float
    points: list[TunePoint] = field(default_factory=list)
    best: DecodingConfig | None = None
    skipped: list[dict] = field(default_factory=list)  # grid points the tree builder cannot make
    eagle1_tokens_per_s: float | None = None  # median of the re-timed repeats (None without repeats)
    time_model: TimeModel | None = None
    pick: dict = field(default_factory=dict)  # {"by": "model" | "timing", "predicted_best": "tt/d/k", "rule": ...}

    def to_dict(self) -> dict:
        return {"vanilla_tokens_per_s": self.vanilla_tokens_per_s, "eagle1_tokens_per_s": self.eagle1_tokens_per_s,
                "best": dataclasses.asdict(self.best), "pick": self.pick,
                "time_model": dataclasses.asdict(self.time_model) if self.time_model else None,
                "points": [p.__dict__ for p in self.points], "skipped": self.skipped}


@dataclass(frozen=True)
class RoundTiming:
    """One timed call of a dynamic tree: its decoding rounds, the nodes they verified, its draft depth and top_k, and
    the CPU seconds of the call after the prefill."""
    rounds: int
    nodes: int
    depth: int
    top_k: int
    seconds: float


def fit_time_model(calls: list[RoundTiming], clock: str = "cpu") -> TimeModel:
    """Robust least squares of each call's mean round seconds on (1, mean nodes per round, depth, depth x top_k),
    weighted by the call's rounds (its mean rests on that many rounds): soft-L1 loss at the scale of the ordinary
    fit's residuals, so calls caught in a slow spell pull on the coefficients like a linear, not a quadratic,
    penalty."""
    calls = [c for c in calls if c.rounds > 0]
    if not calls:
        raise ValueError("autotune: no timed call decoded a round (every tuning prompt stopped at its first token); "
                         "raise eval.tune_max_new_tokens or use other tuning prompts")
    # fewer calls than coefficients, or a grid with one depth / top_k: the minimum-norm solution, whose predictions
    # at the grid's own points are still the least-squares ones (they lie in the span of the calls' features)
    x = np.array([[1.0, c.nodes / c.rounds, float(c.depth), float(c.depth * c.top_k)] for c in calls])  # [C, 4]
    y = np.array([c.seconds / c.rounds for c in calls])  # [C]
    w = np.sqrt(np.array([float(c.rounds) for c in calls]))  # [C]
    ols = np.linalg.lstsq(x * w[:, None], y * w, rcond=None)[0]
    resid = (x @ ols - y) * w
    scale = float(median_abs_deviation(resid, scale="normal"))
    coef = ols
    if scale > 0:
        coef = least_squares(lambda c: (x @ c - y) * w, ols, loss="soft_l1", f_scale=scale).x
    r = x @ coef - y
    spread = float(median_abs_deviation(r, scale="normal"))
    return TimeModel(*(float(v) for v in coef), residual_s=spread, calls=len(calls), clock=clock)


def timing_clock(model) -> str:
    """"cpu" when `model` runs on the CPU with one intra-op thread (its process CPU seconds are the tree's cost),
    else "wall" (CPU time does not see GPU kernels, and sums the threads of a parallel op)."""
    base = getattr(model, "base_model", None)
    device = next(iter((base if base is not None else model).parameters())).device
    return "cpu" if device.type == "cpu" and torch.get_num_threads() == 1 else "wall"


def point_label(p: TunePoint) -> str:
    """A grid point's name, as in the sweep: "total_token/depth/top_k"."""
    return f"{p.total_token}/{p.depth}/{p.top_k}"


def choose(points: list[TunePoint], final_tps: dict[str, list[float]], margin: float = OVERRIDE_MARGIN
           ) -> tuple[TunePoint, dict]:
    """The pick among the re-timed finalists `points` (all of them in `final_tps`: label -> tokens per second of the
    model's clock, one per repeat): the highest predicted tokens/s, unless another finalist was faster than it in every repeat and
    by a median paired ratio above 1 + margin (then the one with the highest such ratio). Without repeats: the
    highest predicted tokens/s. Returns (pick, the record of why)."""
    predicted = max(points, key=lambda p: p.predicted_tokens_per_s)
    rule = (f"highest predicted tokens/s (tau / modelled round seconds) among the finalists, unless a finalist was "
            f"faster in every re-timed repeat and by a median paired ratio > {1 + margin:.2f}")
    record = {"by": "model", "predicted_best": point_label(predicted), "rule": rule, "challengers": {}}
    ref = final_tps.get(point_label(predicted)) or []
    if not ref:
        return predicted, record
    best, best_ratio = predicted, 1 + margin
    for p in points:
        reps = final_tps[point_label(p)]
        if p is predicted or len(reps) != len(ref):
            continue
        ratios = [t / r for t, r in zip(reps, ref)]
        med = float(np.median(ratios))
        record["challengers"][point_label(p)] = {"median_ratio": med, "faster_in_every_repeat": min(ratios) > 1}
        if min(ratios) > 1 and med > best_ratio:
            best, best_ratio = p, med
    if best is not predicted:
        record["by"] = "timing"
    return best, record


def max_tree_nodes(depth: int, top_k: int) -> int:
    """Tree nodes (root included) an EAGLE-2 expansion can offer: 1 + top_k + depth * top_k^2.

    The root's top_k children, then `depth` expansion steps of the top_k frontier nodes into
    top_k children each (eagle-reference.md section 3); a larger total_token adds nothing."""
    return 1 + top_k + depth * top_k * top_k


def grid(total_tokens: list[int], depths: list[int], top_ks: list[int], base: DecodingConfig,
         draft_positions: int | None = None) -> tuple[list[DecodingConfig], list[dict]]:
    """Valid dynamic-tree settings of the grid, and the skipped ones with the reason. `draft_positions`: the deepest
    draft position the head has a distribution for (EaModel.draft_positions; None = any): a dynamic tree of depth d
    expands d + 1 positions (EAGLE-2's), so deeper settings are skipped."""
    keep, skipped = [], []
    for tt, d, k in itertools.product(total_tokens, depths, top_ks):
        cfg = dataclasses.replace(base, mode="dynamic", total_token=tt, depth=d, top_k=k)
        try:
            cfg.validate()
        except ValueError as e:
            skipped.append({"total_token": tt, "depth": d, "top_k": k, "reason": str(e)})
            continue
        if draft_positions is not None and d + 1 > draft_positions:
            skipped.append({"total_token": tt, "depth": d, "top_k": k,
                            "reason": f"depth {d} expands {d + 1} draft positions; the head drafts {draft_positions}"})
            continue
        if tt > max_tree_nodes(d, k):
            skipped.append({"total_token": tt, "depth": d, "top_k": k,
                            "reason": f"depth {d}, top_k {k} drafts at most {max_tree_nodes(d, k) - 1} nodes"})
            continue
        keep.append(cfg)
    return keep, skipped


def autotune_tree(model, prompts: list[list[int]], configs: list[DecodingConfig], gen: GenerationArgs, *,
                  finalists: int = 5, repeats: int = 3, vanilla_every: int = 4, seed: int = 0,
                  margin: float = OVERRIDE_MARGIN, clock: str | None = None, progress: bool = True) -> TuneResult:
    """Screen every config once (its tau and the time model's data), re-time the `finalists` with the highest
    predicted tokens/s `repeats` more times back to back with vanilla and EAGLE-1's static tree per prompt, refit the
    model on every call and pick by `choose` (module docstring).

    One screening pass over a setting = all `prompts` (T as in `gen`); vanilla is timed every `vanilla_every`
    settings, so each point's measured screening speedup uses vanilla timed close to it (reported, not ranked on).
    clock: "cpu" or "wall", the seconds the model is fitted on (default: timing_clock(model))."""
    if not configs:
        raise ValueError("autotune: no valid grid point")
    clock = clock or timing_clock(model)
    if clock not in ("cpu", "wall"):
        raise ValueError(f"autotune: clock={clock!r}: expected 'cpu' or 'wall'")
    vanilla = Method("vanilla", dataclasses.replace(configs[0], mode="vanilla"))
    eagle1 = Method("eagle1", dataclasses.replace(configs[0], mode="static"))
    methods = [Method(f"{c.total_token}/{c.depth}/{c.top_k}", c) for c in configs]
    by_label = {m.label: m for m in methods}
    rng = random.Random(seed)
    for m in [vanilla, eagle1] + methods:  # warm-up: one short untimed run of every shape
        generate(model, m, prompts[0], dataclasses.replace(gen, max_new_tokens=min(8, gen.max_new_tokens)))
    tau: dict[str, tuple[int, int, int]] = {}  # label -> (committed tokens in rounds, rounds, nodes verified)
    calls: dict[str, list[RoundTiming]] = {m.label: [] for m in methods}  # the time model's observations

    def timed(m: Method, prompt: list[int]) -> tuple[int, float, float]:
        """(new tokens, wall seconds, the model's seconds: CPU or wall as `clock` says) of one call."""
        cpu0 = cpu_clock()
        out, stats, wall = generate(model, m, prompt, gen)
        cpu = cpu_clock() - cpu0 if clock == "cpu" else wall
        c0, r0, n0 = tau.get(m.label, (0, 0, 0))
        nodes = sum(int(r.node_depth.numel()) for r in stats.rounds)
        tau[m.label] = (c0 + sum(int(r.new_tokens) for r in stats.rounds), r0 + len(stats.rounds), n0 + nodes)
        if m.label in calls:
            # the prefill's CPU share: its wall share of the call (its own CPU time is not measured)
            after_prefill = cpu * (1 - stats.prefill_s / wall) if wall > 0 else cpu
            calls[m.label].append(RoundTiming(len(stats.rounds), nodes, m.decoding.depth, m.decoding.top_k,
                                              after_prefill))
        return len(out), wall, cpu

    def one_pass(m: Method) -> float:
        runs = [timed(m, p) for p in prompts]
        return sum(n for n, _, _ in runs) / sum(w for _, w, _ in runs)

    def predict(model_fit: TimeModel) -> dict[str, float]:
        """label -> predicted tokens/s = tau / modelled round seconds at the point's measured verify width."""
        out = {}
        for m in methods:
            committed, rounds, nodes = tau[m.label]
            round_s = model_fit.round_s(nodes / max(rounds, 1), m.decoding.depth, m.decoding.top_k)
            if round_s <= 0:
                raise ValueError(f"autotune: the round-time model ({model_fit}) predicts {round_s:.3g} s per round "
                                 f"for {m.label}: the timings are too noisy to fit; rerun on a quieter machine or "
                                 "with more eval.tune_prompts")
            out[m.label] = committed / max(rounds, 1) / round_s
        return out

    n_final = min(finalists, len(methods))
    bar = tqdm(total=len(methods) + len(methods) // vanilla_every + 1 + repeats * len(prompts),
               disable=not progress, desc="autotune")
    screen, screen_vanilla = {}, []  # label -> tokens/s; [(index in order, vanilla tokens/s)]
    order = methods[:]
    rng.shuffle(order)
    for i, m in enumerate(order):
        if i % vanilla_every == 0:
            screen_vanilla.append((i, one_pass(vanilla)))
            bar.update(1)
        screen[m.label] = one_pass(m)
        bar.update(1)
    speedup = {m.label: screen[m.label] / min(screen_vanilla, key=lambda iv: abs(iv[0] - i))[1]
               for i, m in enumerate(order)}
    predicted = predict(fit_time_model([c for cs in calls.values() for c in cs], clock))
    top = sorted(methods, key=lambda m: -predicted[m.label])[:n_final]
    group = [vanilla, eagle1] + top
    final_tps: dict[str, list[float]] = {m.label: [] for m in group}  # per repeat, wall clock
    final_cpu: dict[str, list[float]] = {m.label: [] for m in group}  # per repeat, on the model's clock
    for _ in range(repeats):
        tokens, secs, cpus = {m.label: 0 for m in group}, {m.label: 0.0 for m in group}, {m.label: 0.0 for m in group}
        for p in prompts:
            rng.shuffle(group)
            for m in group:  # back to back on one prompt: a slow spell hits every method alike
                n, wall, cpu = timed(m, p)
                tokens[m.label] += n
                secs[m.label] += wall
                cpus[m.label] += cpu
            bar.update(1)
        for name in final_tps:
            final_tps[name].append(tokens[name] / secs[name])
            final_cpu[name].append(tokens[name] / max(cpus[name], 1e-12))
    bar.close()
    fit = fit_time_model([c for cs in calls.values() for c in cs], clock)  # every call: screening and re-timing
    predicted = predict(fit)
    v_reps, e_reps = final_tps["vanilla"], final_tps["eagle1"]
    v_final = float(np.median(v_reps)) if repeats else float(np.median([v for _, v in screen_vanilla]))
    result = TuneResult(vanilla_tokens_per_s=v_final, eagle1_tokens_per_s=float(np.median(e_reps)) if repeats else None,
                        time_model=fit)
    for m in order:
        c = m.decoding
        committed, rounds, nodes = tau[m.label]
        own = calls[m.label]
        reps = final_tps.get(m.label) if repeats else None
        result.points.append(TunePoint(
            c.total_token, c.depth, c.top_k, screen[m.label], committed / max(rounds, 1), speedup[m.label],
            nodes=nodes / max(rounds, 1),
            round_s=sum(o.seconds for o in own) / max(sum(o.rounds for o in own), 1),
            predicted_round_s=fit.round_s(nodes / max(rounds, 1), c.depth, c.top_k),
            predicted_tokens_per_s=predicted[m.label],
            final_tokens_per_s=float(np.median(reps)) if reps else None,
            final_speedup=float(np.median([t / v for t, v in zip(reps, v_reps)])) if reps else None,
            final_vs_eagle1=float(np.median([t / e for t, e in zip(reps, e_reps)])) if reps else None))
    candidates = [p for p in result.points if p.final_tokens_per_s is not None] or result.points
    best, result.pick = choose(candidates, {k: v for k, v in final_cpu.items() if k in by_label}, margin)
    result.best = dataclasses.replace(configs[0], mode="dynamic", total_token=best.total_token, depth=best.depth,
                                      top_k=best.top_k)
    return result


def covered_tree(base: DecodingConfig, depths: list[int], top_ks: list[int],
                 draft_positions: int | None = None) -> tuple[int, int]:
    """(node depth, top_k) of the coverage tree `fit_tree_calibration` decodes first: the largest dynamic tree decoded
    with the map (the bench's `base` and the tuning grid's depths / top_ks; depth d expands d + 1 positions), no
    deeper than the head drafts (`draft_positions`, EaModel.draft_positions; None = any), as `grid` skips."""
    depth = max(base.depth, *depths) + 1
    return (min(depth, draft_positions) if draft_positions is not None else depth), max(base.top_k, *top_ks)


def fit_tree_calibration(model, prompts: list[list[int]], base: DecodingConfig, gen: GenerationArgs, *,
                         passes: int = 2, cover: tuple[int, int] | None = None, progress: bool = True,
                         fitted_on: dict | None = None) -> ScoreCalibration:
    """Fit the head's tree-score map (eagle/score_calibration.py) for the sampling setting of `gen` on held-out
    `prompts`, and install it on `model` (replacing a map for the same setting).

    cover: (node depth, top_k) of the largest dynamic tree the head will be decoded with (default `base`'s:
    depth + 1, top_k). Pass 1 decodes with the coverage tree of that shape (eagle.static_trees.coverage_choices: a
    rank-0 spine that deep, every spine node drafting all top_k ranks), whatever any score says, so every (depth,
    rank) cell such a tree can expand gets data of its own by construction (the cells a raw tree starves included);
    every later pass decodes the dynamic tree `base` ranked by the map fitted so far and refits on the nodes of all
    passes (the cells that tree actually expands get more data). Sampling passes (T > 0) draw with a fixed seed per
    prompt and pass. Decoding stays lossless in every pass: the scores only choose which nodes are drafted."""
    depth, top_k = cover if cover is not None else (base.depth + 1, base.top_k)
    if passes < 1:
        raise ValueError(f"calibration passes={passes}: need at least 1 (the coverage tree's)")
    tree = dataclasses.replace(base, mode="dynamic", calibrate=True)
    coverage = Method(f"calibration pass 1 (coverage tree {depth} x {top_k})",
                      dataclasses.replace(base, mode="static", calibrate=False))
    rounds: list = []
    cal = None
    keep_static = model.static_tree
    bar = tqdm(total=passes * len(prompts), disable=not progress, desc="calibration")
    try:
        for i in range(passes):
            model.calibrations = [c for c in model.calibrations
                                  if not c.matches(gen.temperature, gen.top_p, gen.top_k)] + ([cal] if cal else [])
            model.static_tree = coverage_choices(depth, top_k) if i == 0 else keep_static
            method = coverage if i == 0 else Method(f"calibration pass {i + 1}", tree)
            for j, p in enumerate(prompts):
                generator = None
                if gen.temperature > 0:
                    generator = torch.Generator(device=model.target.device).manual_seed(1_000_003 * (i + 1) + j)
                _, stats, _ = generate(model, method, p, gen, generator)
                rounds += stats.rounds
                bar.update(1)
            info = {"prompts": len(prompts), "passes": i + 1, "coverage_tree": f"{depth}x{top_k}",
                    "tree": f"{tree.total_token}/{tree.depth}/{tree.top_k}", "max_new_tokens": gen.max_new_tokens,
                    **(fitted_on or {})}
            cal = fit_score_calibration(rounds, gen.temperature, gen.top_p, gen.top_k, fitted_on=info)
    finally:
        model.static_tree = keep_static
        bar.close()
    model.calibrations = [c for c in model.calibrations if not c.matches(gen.temperature, gen.top_p, gen.top_k)] + [cal]
    return cal
