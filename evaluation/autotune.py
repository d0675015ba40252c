"""Pick the EAGLE-2 tree (total_token, depth, top_k) that is fastest on THIS hardware.

Acceptance length grows with the tree, but so does the cost of drafting and verifying it;
where the optimum lies depends on the model, the head and the machine. Two stages, because
single timings on a shared machine vary by +-20%: a screening pass times every grid point once
on a few prompts (shuffled order, vanilla re-timed every few points), then the fastest few are
re-timed several times interleaved with vanilla and the best final median wins.
"""
from __future__ import annotations

import dataclasses
import itertools
import random
from dataclasses import dataclass, field

import numpy as np
from tqdm.auto import tqdm

from eagle.decoding_config import DecodingConfig
from evaluation.methods import Method
from evaluation.runner import GenerationArgs, generate


@dataclass
class TunePoint:
    total_token: int
    depth: int
    top_k: int
    tokens_per_s: float  # screening pass: tokens / seconds over all tune prompts
    tau: float  # over every pass of this setting
    speedup: float  # screening tokens/s / vanilla tokens/s timed closest in the sweep
    final_tokens_per_s: float | None = None  # finalists: median over the re-timed passes
    final_speedup: float | None = None  # finalists: final median / vanilla's final median


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
                  finalists: int = 5, repeats: int = 3, vanilla_every: int = 8, seed: int = 0,
                  progress: bool = True) -> TuneResult:
    """Screen every config once, then re-time the `finalists` fastest `repeats` more times
    (interleaved with vanilla, shuffled per pass); the best has the highest final median tokens/s.

    One pass over a setting = all `prompts` (T as in `gen`). During screening vanilla is timed
    every `vanilla_every` settings, so each point's speedup uses vanilla measured close to it."""
    if not configs:
        raise ValueError("autotune: no valid grid point")
    vanilla = Method("vanilla", dataclasses.replace(configs[0], mode="vanilla"))
    methods = [Method(f"{c.total_token}/{c.depth}/{c.top_k}", c) for c in configs]
    rng = random.Random(seed)
    for m in [vanilla] + methods:  # warm-up: one short untimed run of every shape
        generate(model, m, prompts[0], dataclasses.replace(gen, max_new_tokens=min(8, gen.max_new_tokens)))
    tau: dict[str, tuple[int, int]] = {}  # label -> (committed tokens in rounds, rounds)

    def one_pass(m: Method) -> float:
        tokens, secs, committed, rounds = 0, 0.0, 0, 0
        for p in prompts:
            out, stats, wall = generate(model, m, p, gen)
            tokens, secs = tokens + len(out), secs + wall
            committed += sum(int(r.new_tokens) for r in stats.rounds)
            rounds += len(stats.rounds)
        c0, r0 = tau.get(m.label, (0, 0))
        tau[m.label] = (c0 + committed, r0 + rounds)
        return tokens / secs

    n_final = min(finalists, len(methods))
    bar = tqdm(total=len(methods) + len(methods) // vanilla_every + 1 + repeats * (n_final + 1),
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
    top = sorted(methods, key=lambda m: -screen[m.label])[:n_final]
    final: dict[str, list[float]] = {m.label: [] for m in [vanilla] + top}
    for _ in range(repeats):
        passes = [vanilla] + top
        rng.shuffle(passes)
        for m in passes:
            final[m.label].append(one_pass(m))
            bar.update(1)
    bar.close()
    v_final = float(np.median(final["vanilla"])) if repeats else float(np.median([v for _, v in screen_vanilla]))
    result = TuneResult(vanilla_tokens_per_s=v_final)
    for i, m in enumerate(order):
        near = min(screen_vanilla, key=lambda iv: abs(iv[0] - i))[1]  # vanilla timed closest to this point
        c = m.decoding
        committed, rounds = tau[m.label]
        fin = float(np.median(final[m.label])) if final.get(m.label) else None
        result.points.append(TunePoint(c.total_token, c.depth, c.top_k, screen[m.label], committed / max(rounds, 1),
                                       screen[m.label] / near, final_tokens_per_s=fin,
                                       final_speedup=fin / v_final if fin is not None else None))
    ranked = [p for p in result.points if p.final_tokens_per_s is not None] or result.points
    best = max(ranked, key=lambda p: p.final_tokens_per_s if p.final_tokens_per_s is not None else p.tokens_per_s)
    result.best = dataclasses.replace(configs[0], mode="dynamic", total_token=best.total_token, depth=best.depth,
                                      top_k=best.top_k)
    return result
