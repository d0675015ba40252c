"""Pick the EAGLE-2 tree (total_token, depth, top_k) that is fastest on THIS hardware.

Acceptance length grows with the tree, but so does the cost of drafting and verifying it;
where the optimum lies depends on the model, the head and the machine. The sweep times every
grid point (and vanilla, as a baseline) on a few prompts, in a shuffled order per repeat so
drift in machine speed does not favour one region of the grid, and keeps the median tokens/s
over repeats.
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
    tokens_per_s: float  # median over repeats of (tokens / seconds over all tune prompts)
    tau: float
    speedup: float  # tokens_per_s / vanilla tokens_per_s


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
                  repeats: int = 1, seed: int = 0, progress: bool = True) -> TuneResult:
    """Time every config (and vanilla) on `prompts` (T as in `gen`); the best maximises tokens/s."""
    if not configs:
        raise ValueError("autotune: no valid grid point")
    vanilla = Method("vanilla", dataclasses.replace(configs[0], mode="vanilla"))
    methods = [vanilla] + [Method(f"{c.total_token}/{c.depth}/{c.top_k}", c) for c in configs]
    speed: dict[str, list[float]] = {m.label: [] for m in methods}
    committed: dict[str, int] = {m.label: 0 for m in methods}
    rounds: dict[str, int] = {m.label: 0 for m in methods}
    rng = random.Random(seed)
    for m in methods:  # warm-up: one short untimed run of every shape
        generate(model, m, prompts[0], dataclasses.replace(gen, max_new_tokens=min(8, gen.max_new_tokens)))
    bar = tqdm(total=repeats * len(methods), disable=not progress, desc="autotune")
    for _ in range(repeats):
        order = methods[:]
        rng.shuffle(order)
        for m in order:
            tokens, secs = 0, 0.0
            for p in prompts:
                out, stats, wall = generate(model, m, p, gen)
                tokens += len(out)
                secs += wall
                committed[m.label] += sum(int(r.new_tokens) for r in stats.rounds)
                rounds[m.label] += len(stats.rounds)
            speed[m.label].append(tokens / secs)
            bar.update(1)
    bar.close()
    v = float(np.median(speed["vanilla"]))
    result = TuneResult(vanilla_tokens_per_s=v)
    for m in methods[1:]:
        c = m.decoding
        tps = float(np.median(speed[m.label]))
        result.points.append(TunePoint(c.total_token, c.depth, c.top_k, tps,
                                       committed[m.label] / max(rounds[m.label], 1), tps / v))
    best = max(result.points, key=lambda p: p.tokens_per_s)
    result.best = dataclasses.replace(configs[0], mode="dynamic", total_token=best.total_token, depth=best.depth,
                                      top_k=best.top_k)
    return result
