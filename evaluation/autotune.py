"""Pick the EAGLE-2 tree (total_token, depth, top_k) that is fastest on THIS hardware.

Acceptance length grows with the tree, but so does the cost of drafting and verifying it;
where the optimum lies depends on the model, the head and the machine. Two stages, because
single timings on a shared machine vary by +-20% (and drift over seconds): a screening pass times
every grid point once on a few prompts (shuffled order, vanilla re-timed every few points, each
point ranked by its speedup over the vanilla timed closest to it), then the best few are re-timed
with every finalist AND vanilla run back to back on each prompt (so a slow spell hits all of them),
and the highest median per-repeat speedup wins.
"""
from __future__ import annotations

import dataclasses
import itertools
import random
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm.auto import tqdm

from eagle.decoding_config import DecodingConfig
from eagle.score_calibration import ScoreCalibration
from eagle.static_trees import coverage_choices
from evaluation.calibration import fit_score_calibration
from evaluation.methods import Method
from evaluation.runner import GenerationArgs, generate


@dataclass
class TunePoint:
    total_token: int
    depth: int
    top_k: int
    tokens_per_s: float  # screening pass: tokens / seconds over all tune prompts
    tau: float  # over every pass of this setting
    speedup: float  # screening tokens/s / vanilla tokens/s timed closest in the sweep (the screening rank)
    final_tokens_per_s: float | None = None  # finalists: median over the re-timed repeats
    final_speedup: float | None = None  # finalists: median over repeats of tokens/s / vanilla's in the same repeat


@dataclass
class TuneResult:
    vanilla_tokens_per_s: float
    points: list[TunePoint] = field(default_factory=list)
    best: DecodingConfig | None = None
    skipped: list[dict] = field(default_factory=list)  # grid points the tree builder cannot make

    def to_dict(self) -> dict:
        return {"vanilla_tokens_per_s": self.vanilla_tokens_per_s, "best": dataclasses.asdict(self.best),
                "points": [p.__dict__ for p in self.points], "skipped": self.skipped}


def max_tree_nodes(depth: int, top_k: int) -> int:
    """Tree nodes (root included) an EAGLE-2 expansion can offer: 1 + top_k + depth * top_k^2.

    The root's top_k children, then `depth` expansion steps of the top_k frontier nodes into
    top_k children each (eagle-reference.md section 3); a larger total_token adds nothing."""
    return 1 + top_k + depth * top_k * top_k


def grid(total_tokens: list[int], depths: list[int], top_ks: list[int], base: DecodingConfig) -> tuple[list[DecodingConfig], list[dict]]:
    """Valid dynamic-tree settings of the grid, and the skipped ones with the reason."""
    keep, skipped = [], []
    for tt, d, k in itertools.product(total_tokens, depths, top_ks):
        cfg = dataclasses.replace(base, mode="dynamic", total_token=tt, depth=d, top_k=k)
        try:
            cfg.validate()
        except ValueError as e:
            skipped.append({"total_token": tt, "depth": d, "top_k": k, "reason": str(e)})
            continue
        if tt > max_tree_nodes(d, k):
            skipped.append({"total_token": tt, "depth": d, "top_k": k,
                            "reason": f"depth {d}, top_k {k} drafts at most {max_tree_nodes(d, k) - 1} nodes"})
            continue
        keep.append(cfg)
    return keep, skipped


def autotune_tree(model, prompts: list[list[int]], configs: list[DecodingConfig], gen: GenerationArgs, *,
                  finalists: int = 5, repeats: int = 3, vanilla_every: int = 4, seed: int = 0,
                  progress: bool = True) -> TuneResult:
    """Screen every config once, then re-time the `finalists` with the highest screening speedup
    `repeats` more times, interleaved with vanilla per prompt; the best has the highest median speedup.

    One screening pass over a setting = all `prompts` (T as in `gen`); vanilla is timed every
    `vanilla_every` settings, so each point's speedup uses vanilla measured close to it."""
    if not configs:
        raise ValueError("autotune: no valid grid point")
    vanilla = Method("vanilla", dataclasses.replace(configs[0], mode="vanilla"))
    methods = [Method(f"{c.total_token}/{c.depth}/{c.top_k}", c) for c in configs]
    rng = random.Random(seed)
    for m in [vanilla] + methods:  # warm-up: one short untimed run of every shape
        generate(model, m, prompts[0], dataclasses.replace(gen, max_new_tokens=min(8, gen.max_new_tokens)))
    tau: dict[str, tuple[int, int]] = {}  # label -> (committed tokens in rounds, rounds)

    def timed(m: Method, prompt: list[int]) -> tuple[int, float]:
        out, stats, wall = generate(model, m, prompt, gen)
        c0, r0 = tau.get(m.label, (0, 0))
        tau[m.label] = (c0 + sum(int(r.new_tokens) for r in stats.rounds), r0 + len(stats.rounds))
        return len(out), wall

    def one_pass(m: Method) -> float:
        runs = [timed(m, p) for p in prompts]
        return sum(n for n, _ in runs) / sum(w for _, w in runs)

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
    top = sorted(methods, key=lambda m: -speedup[m.label])[:n_final]
    group = [vanilla] + top
    final_tps: dict[str, list[float]] = {m.label: [] for m in group}
    for _ in range(repeats):
        tokens, secs = {m.label: 0 for m in group}, {m.label: 0.0 for m in group}
        for p in prompts:
            rng.shuffle(group)
            for m in group:  # back to back on one prompt: a slow spell hits every method alike
                n, wall = timed(m, p)
                tokens[m.label] += n
                secs[m.label] += wall
            bar.update(1)
        for label in final_tps:
            final_tps[label].append(tokens[label] / secs[label])
    bar.close()
    v_reps = final_tps["vanilla"]
    v_final = float(np.median(v_reps)) if repeats else float(np.median([v for _, v in screen_vanilla]))
    result = TuneResult(vanilla_tokens_per_s=v_final)
    for m in order:
        c = m.decoding
        committed, rounds = tau[m.label]
        reps = final_tps.get(m.label) if repeats else None
        result.points.append(TunePoint(
            c.total_token, c.depth, c.top_k, screen[m.label], committed / max(rounds, 1), speedup[m.label],
            final_tokens_per_s=float(np.median(reps)) if reps else None,
            final_speedup=float(np.median([t / v for t, v in zip(reps, v_reps)])) if reps else None))
    ranked = [p for p in result.points if p.final_speedup is not None] or result.points
    best = max(ranked, key=lambda p: p.final_speedup if p.final_speedup is not None else p.speedup)
    result.best = dataclasses.replace(configs[0], mode="dynamic", total_token=best.total_token, depth=best.depth,
                                      top_k=best.top_k)
    return result


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
