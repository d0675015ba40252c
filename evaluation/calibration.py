"""Is the draft's confidence an acceptance probability? (the EAGLE-2 premise)

For every drafted node the decoder records its own probability (given its parent), the path
value (product of probabilities root->node) and whether verification accepted it. Two
reliability analyses:
  path_prob : path value vs P(node accepted)                        - what EAGLE-2 ranks by
  node_prob : node probability vs P(node accepted | parent accepted)  - parent = root for depth 1;
              deeper nodes are used only when the stats carry `node_parent` (else depth 1 only)
When the tree was ranked by calibrated scores (eagle/score_calibration.py), the same two analyses of what it
ranked by follow: path_score and node_score (the "after" of the fitted map; path_prob / node_prob are the "before").
Reported per quantity: reliability bins (mean confidence, observed acceptance, count), ECE
(count-weighted mean |acceptance - confidence| over bins), the unweighted mean of that gap over the non-empty
bins (a map that is wrong everywhere but in one crowded bin shows here), Pearson r between confidence and the
0/1 outcome over nodes, and Pearson r between bin confidence and bin acceptance.

`fit_score_calibration` fits the map itself: per tree depth, an isotonic (increasing) regression of
"accepted | parent accepted" on the node's draft probability, over equal-count bins of held-out decoding rounds.
It records how many nodes of each (depth, rank) cell it saw; `coverage_warning` is the one line evaluation prints
when a tree is decoded deeper or wider than those cells cover.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from eagle.decoding_config import DecodingConfig
from eagle.score_calibration import MIN_NODES_PER_CELL, ScoreCalibration

QUANTITIES = ("path_prob", "node_prob", "path_score", "node_score")


@dataclass
class ReliabilityBin:
    low: float
    high: float
    count: int
    mean_confidence: float
    acceptance_rate: float


@dataclass
class Calibration:
    quantity: str
    nodes: int
    ece: float
    ece_bins: float  # unweighted mean |acceptance - confidence| over the non-empty bins
    pearson_r: float  # node level: confidence vs 0/1 accepted
    binned_pearson_r: float  # bin mean confidence vs bin acceptance rate (non-empty bins)
    bins: list[ReliabilityBin] = field(default_factory=list)
    note: str = ""

    def to_dict(self) -> dict:
        return {"quantity": self.quantity, "nodes": self.nodes, "ece": self.ece, "ece_bins": self.ece_bins,
                "pearson_r": self.pearson_r,
                "binned_pearson_r": self.binned_pearson_r, "note": self.note,
                "bins": [b.__dict__ for b in self.bins]}


def reliability(confidence: np.ndarray, accepted: np.ndarray, n_bins: int = 10, quantity: str = "") -> Calibration:
    """Equal-width bins on [0, 1]; a confidence of exactly 1.0 falls in the last bin."""
    conf = np.asarray(confidence, dtype=np.float64)  # [N]
    acc = np.asarray(accepted, dtype=np.float64)  # [N] 0/1
    if conf.shape != acc.shape:
        raise ValueError(f"confidence {conf.shape} and accepted {acc.shape} differ in shape")
    edges = np.linspace(0.0, 1.0, n_bins + 1)
    which = np.clip(np.digitize(conf, edges[1:-1], right=False), 0, n_bins - 1)  # [N] bin index
    bins, gaps = [], 0.0
    for b in range(n_bins):
        sel = which == b
        count = int(sel.sum())
        mc = float(conf[sel].mean()) if count else float("nan")
        ar = float(acc[sel].mean()) if count else float("nan")
        bins.append(ReliabilityBin(float(edges[b]), float(edges[b + 1]), count, mc, ar))
        if count:
            gaps += count * abs(ar - mc)
    n = len(conf)
    ece = gaps / n if n else float("nan")
    pearson = _pearson(conf, acc)
    full = [b for b in bins if b.count]
    ece_bins = float(np.mean([abs(b.acceptance_rate - b.mean_confidence) for b in full])) if full else float("nan")
    binned = _pearson(np.array([b.mean_confidence for b in full]), np.array([b.acceptance_rate for b in full]))
    return Calibration(quantity, n, ece, ece_bins, pearson, binned, bins)


def _pearson(x: np.ndarray, y: np.ndarray) -> float:
    """Pearson r, NaN when undefined (fewer than 2 points or a constant input)."""
    if len(x) < 2 or np.all(x == x[0]) or np.all(y == y[0]):
        return float("nan")
    # lazy: scipy.stats costs over a second at import; only the statistics need it, not a command's --help
    from scipy import stats as sps

    return float(sps.pearsonr(x, y).statistic)


def parent_accepted(rd) -> np.ndarray:
    """[N] bool per node of a round: its parent was accepted (the root always is). Without `node_parent` in the
    stats only depth-1 nodes are known to qualify."""
    accepted = rd.node_accepted.cpu().numpy().astype(bool)
    parent = getattr(rd, "node_parent", None)  # [N] index into this round's nodes, -1 = root
    if parent is None:
        return rd.node_depth.cpu().numpy() == 1
    parent = parent.cpu().numpy()
    return np.where(parent < 0, True, accepted[np.clip(parent, 0, None)])


def collect_nodes(rounds: list) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(confidence [N], accepted [N]) per quantity from RoundStats, see the module docstring; the *_score
    quantities only over rounds whose tree was ranked by calibrated scores."""
    parts: dict[str, tuple[list, list]] = {q: ([], []) for q in QUANTITIES}
    for rd in rounds:
        if rd.node_depth.numel() == 0:
            continue
        accepted = rd.node_accepted.cpu().numpy().astype(bool)
        given = parent_accepted(rd)
        values = {"path_prob": (rd.node_path_prob, None), "node_prob": (rd.node_prob, given),
                  "path_score": (getattr(rd, "node_path_score", None), None),
                  "node_score": (getattr(rd, "node_score", None), given)}
        for q, (conf, sel) in values.items():
            if conf is None:
                continue
            conf = conf.float().cpu().numpy()
            parts[q][0].append(conf if sel is None else conf[sel])
            parts[q][1].append(accepted if sel is None else accepted[sel])
    cat = lambda xs, dt: np.concatenate(xs).astype(dt) if xs else np.zeros(0, dt)  # noqa: E731
    return {q: (cat(c, np.float64), cat(a, bool)) for q, (c, a) in parts.items()}


def calibrate(rounds: list, n_bins: int = 10) -> dict[str, Calibration]:
    """Reliability analysis over all drafted nodes of `rounds`: the raw quantities always, the calibrated ones
    when the trees were ranked by them."""
    has_parent = any(getattr(rd, "node_parent", None) is not None for rd in rounds)
    out = {}
    for quantity, (conf, acc) in collect_nodes(rounds).items():
        if quantity.endswith("_score") and not len(conf):
            continue
        cal = reliability(conf, acc, n_bins, quantity)
        if quantity in ("node_prob", "node_score") and not has_parent:
            cal.note = "depth-1 nodes only (stats carry no node_parent)"
        out[quantity] = cal
    return out


# ---------------------------------------------------------------------------------------------- fitting the map
MIN_NODES_PER_DEPTH = 200  # a depth with fewer nodes (parent accepted) shares the maps of the depth above it
MIN_NODES_PER_MAP = 100  # a (depth, rank) with fewer takes the same rank's map of the depth above (or its depth's pool)
RANK_MAPS = 4  # ranks 0, 1, 2 get maps of their own, ranks >= 3 share one
MIN_NODES_PER_BIN = 40  # equal-count bins of at least this many nodes before the isotonic fit


def sibling_ranks(rd) -> np.ndarray:
    """[N] rank of each node among its parent's top-k draft tokens: the stats' `node_rank`, else the node's position
    among its kept siblings (the same for trees that keep a prefix of every parent's ranking, as raw EAGLE-2 does)."""
    if getattr(rd, "node_rank", None) is not None:
        return rd.node_rank.cpu().numpy()
    parents = rd.node_parent.cpu().numpy() if getattr(rd, "node_parent", None) is not None else \
        np.full(rd.node_depth.numel(), -1)
    seen: dict[int, int] = {}
    out = np.zeros(len(parents), np.int64)
    for i, p in enumerate(parents.tolist()):
        out[i] = seen.get(p, 0)
        seen[p] = out[i] + 1
    return out


def node_outcomes(rounds: list) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(draft probability [N], depth [N], sibling rank [N], accepted [N]) of every node whose parent was accepted:
    the data a map from "probability given the parent" to "accepted given the parent" is fitted on."""
    probs, depths, ranks, accs = [], [], [], []
    for rd in rounds:
        if rd.node_depth.numel() == 0:
            continue
        given = parent_accepted(rd)
        probs.append(rd.node_prob.float().cpu().numpy()[given])
        depths.append(rd.node_depth.cpu().numpy()[given])
        ranks.append(sibling_ranks(rd)[given])
        accs.append(rd.node_accepted.cpu().numpy().astype(bool)[given])
    if not probs:
        return np.zeros(0), np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, bool)
    cat = np.concatenate
    return cat(probs).astype(np.float64), cat(depths).astype(np.int64), cat(ranks).astype(np.int64), cat(accs)


def isotonic_knots(prob: np.ndarray, accepted: np.ndarray, min_bin: int = MIN_NODES_PER_BIN) -> tuple[list, list]:
    """Increasing piecewise-linear map prob -> P(accepted): equal-count bins (>= min_bin nodes, <= 64 bins) of the
    sorted probabilities, acceptance smoothed by half a success and half a failure per bin (no bin is exactly 0 or
    1 from a finite sample), then pool-adjacent-violators weighted by counts. Returns knots (x increasing, y non-
    decreasing): one per pooled block, at its nodes' mean probability."""
    order = np.argsort(prob, kind="stable")
    p, a = prob[order], accepted[order].astype(np.float64)
    n_bins = int(max(1, min(64, len(p) // max(1, min_bin))))
    edges = np.linspace(0, len(p), n_bins + 1).round().astype(int)
    counts = np.diff(edges).astype(np.float64)
    x = np.array([p[lo:hi].mean() for lo, hi in zip(edges[:-1], edges[1:])])
    y = np.array([(a[lo:hi].sum() + 0.5) / (hi - lo + 1.0) for lo, hi in zip(edges[:-1], edges[1:])])
    # lazy: scipy.optimize costs over a second at import (1.2 s here); only the fit needs it, not a command's --help
    from scipy.optimize import isotonic_regression
    fitted = isotonic_regression(y, weights=counts, increasing=True).x
    xs, ys, ws = [], [], []
    for xi, yi, wi in zip(x, fitted, counts):  # one knot per pooled block (equal fitted values), at its mean x
        if ys and (math.isclose(yi, ys[-1], rel_tol=1e-12, abs_tol=1e-12) or xi <= xs[-1]):
            w = ws[-1] + wi
            xs[-1], ys[-1], ws[-1] = (xs[-1] * ws[-1] + xi * wi) / w, (ys[-1] * ws[-1] + yi * wi) / w, w
        else:
            xs.append(float(xi))
            ys.append(float(yi))
            ws.append(float(wi))
    return [float(v) for v in np.clip(xs, 0, 1)], [float(v) for v in np.maximum.accumulate(np.clip(ys, 0, 1))]


def fit_score_calibration(rounds: list, temperature: float, top_p: float, top_k: int, *,
                          min_nodes_per_depth: int = MIN_NODES_PER_DEPTH, min_nodes_per_map: int = MIN_NODES_PER_MAP,
                          rank_maps: int = RANK_MAPS, fitted_on: dict | None = None) -> ScoreCalibration:
    """Maps of draft probability -> acceptance probability per (depth, sibling rank) for one sampling setting, from
    decoding rounds at that setting (held-out prompts: never the ones a report is made on).

    Depth d gets maps of its own when it has >= min_nodes_per_depth nodes whose parent was accepted (deeper depths
    share the last ones). Within a depth, ranks 0 .. rank_maps - 2 get one map each and higher ranks share one; a
    rank with fewer than min_nodes_per_map nodes takes its map from the depth above, or, at depth 1, is fitted on
    the nodes of its rank at every depth (at T = 0 the rank says more about acceptance than the depth: pooling it
    with other ranks would give the draft's best token the acceptance of its siblings), and only when those are
    short too on the nodes of its rank and all higher ones of depth 1 (a rank never drafted takes the rank below's
    map). When even depth 1 is short, all depths are pooled as one."""
    prob, depth, rank, acc = node_outcomes(rounds)
    if len(prob) < min_nodes_per_depth:
        raise ValueError(f"calibration: {len(prob)} drafted nodes with an accepted parent, need at least "
                         f"{min_nodes_per_depth}: decode more held-out prompts (eval.calibration_prompts)")
    bucket = np.minimum(rank, rank_maps - 1)
    depth_seen = depth  # the nodes' own depths (coverage), before a short depth 1 pools them all
    if (depth == 1).sum() < min_nodes_per_depth:  # no depth has enough on its own: one set of maps for all depths
        depth = np.ones_like(depth)
    knots_x, knots_y, per_depth = [], [], []
    for d in range(1, int(depth.max()) + 1):
        at_d = depth == d
        if at_d.sum() < min_nodes_per_depth:
            break
        xd, yd, counts = [], [], []
        for r in range(rank_maps):
            sel = at_d & (bucket == r)
            if sel.sum() < min_nodes_per_map and knots_x:  # the depth above's map of this rank
                xs, ys = knots_x[-1][r], knots_y[-1][r]
            elif sel.sum() < min_nodes_per_map and not (at_d & (bucket >= r)).any():  # no such rank drafted yet
                xs, ys = (xd[-1], yd[-1]) if xd else isotonic_knots(prob[at_d], acc[at_d])
            else:
                if sel.sum() < min_nodes_per_map:  # depth 1: the same rank over all depths (rank predicts most) ...
                    sel = bucket == r
                if sel.sum() < min_nodes_per_map:  # ... else with the higher ranks of depth 1
                    sel = at_d & (bucket >= r)
                xs, ys = isotonic_knots(prob[sel], acc[sel])
            xd.append(xs)
            yd.append(ys)
            counts.append([int(sel.sum()), int(acc[sel].sum())])
        knots_x.append(xd)
        knots_y.append(yd)
        per_depth.append({"depth": d, "nodes": int(at_d.sum()), "accepted": int(acc[at_d].sum()),
                          "per_rank": counts})
    cells = np.zeros((int(depth_seen.max()), int(rank.max()) + 1), np.int64)  # [depth, rank] nodes, parent accepted
    np.add.at(cells, (depth_seen - 1, rank), 1)
    info = {"nodes": int(len(prob)), "accepted": int(acc.sum()), "per_depth": per_depth,
            "coverage": {"nodes": cells.tolist(), "min_nodes": MIN_NODES_PER_CELL}, **(fitted_on or {})}
    return ScoreCalibration(temperature=float(temperature), top_p=float(top_p), top_k=int(top_k),
                            knots_x=knots_x, knots_y=knots_y, fitted_on=info)


def coverage_warning(what: str, head: str, decoding: DecodingConfig, cal: ScoreCalibration | None) -> str | None:
    """The one-line warning for a dynamic tree decoded with a calibration map that does not cover it (a (depth, rank)
    cell the tree can expand of which the fit saw fewer than MIN_NODES_PER_CELL nodes: the tree is deeper or wider
    than the map covers), or that records no coverage; None when every cell is covered or no map is used."""
    if cal is None or decoding.mode != "dynamic":
        return None
    tree = f"{decoding.total_token}/{decoding.depth}/{decoding.top_k}"
    refit = ("refit it with `python -m evaluation autotune` (its coverage tree spans eval.tune_depths x "
             "eval.tune_top_ks)")
    shape = cal.covered()
    if shape is None:
        return (f"{what}: head {head}'s calibration map records no coverage (fitted before it was recorded), so whether "
                f"tree {tree} ranks by fitted or extrapolated scores is unknown; {refit}")
    depth, ranks = decoding.depth + 1, decoding.top_k  # a dynamic tree's nodes reach depth `depth` + 1
    need = cal.fitted_on["coverage"].get("min_nodes", MIN_NODES_PER_CELL)
    short = [(d, r, cal.cell_nodes(d, r)) for d in range(1, depth + 1) for r in range(ranks)]
    short = [c for c in short if c[2] < need]
    if not short:
        return None
    listed = ", ".join(f"({d}, {r}): {n}" for d, r, n in short[:4]) + (", ..." if len(short) > 4 else "")
    return (f"{what}: tree {tree} reaches node depth {depth} x {ranks} ranks, but head {head}'s calibration map covers "
            f"depth {shape[0]} x {shape[1]} ranks ({len(short)} cells with fewer than {need} fitted nodes, "
            f"(depth, rank): nodes "
            f"{listed}); its scores there are extrapolated; {refit}")
