"""Is the draft's confidence an acceptance probability? (the EAGLE-2 premise)

For every drafted node the decoder records its own probability (given its parent), the path
value (product of probabilities root->node) and whether verification accepted it. Two
reliability analyses:
  path_prob : path value vs P(node accepted)                        - what EAGLE-2 ranks by
  node_prob : node probability vs P(node accepted | parent accepted)  - parent = root for depth 1;
              deeper nodes are used only when the stats carry `node_parent` (else depth 1 only)
Reported per quantity: reliability bins (mean confidence, observed acceptance, count), ECE
(count-weighted mean |acceptance - confidence| over bins), Pearson r between confidence and the
0/1 outcome over nodes, and Pearson r between bin confidence and bin acceptance.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

QUANTITIES = ("path_prob", "node_prob")


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
    pearson_r: float  # node level: confidence vs 0/1 accepted
    binned_pearson_r: float  # bin mean confidence vs bin acceptance rate (non-empty bins)
    bins: list[ReliabilityBin] = field(default_factory=list)
    note: str = ""

    def to_dict(self) -> dict:
        return {"quantity": self.quantity, "nodes": self.nodes, "ece": self.ece, "pearson_r": self.pearson_r,
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
    binned = _pearson(np.array([b.mean_confidence for b in full]), np.array([b.acceptance_rate for b in full]))
    return Calibration(quantity, n, ece, pearson, binned, bins)


def _pearson(x: np.ndarray, y: np.ndarray) -> float:
    """Pearson r, NaN when undefined (fewer than 2 points or a constant input)."""
    if len(x) < 2 or np.all(x == x[0]) or np.all(y == y[0]):
        return float("nan")
    # lazy: scipy.stats costs over a second at import; only the statistics need it, not a command's --help
    from scipy import stats as sps

    return float(sps.pearsonr(x, y).statistic)


def collect_nodes(rounds: list) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(confidence [N], accepted [N]) per quantity from RoundStats, see the module docstring."""
    path_c, path_a, node_c, node_a = [], [], [], []
    for rd in rounds:
        if rd.node_depth.numel() == 0:
            continue
        depth = rd.node_depth.cpu().numpy()
        accepted = rd.node_accepted.cpu().numpy().astype(bool)
        path_c.append(rd.node_path_prob.float().cpu().numpy())
        path_a.append(accepted)
        parent = getattr(rd, "node_parent", None)  # [N] index into this round's nodes, -1 = root
        if parent is not None:
            parent = parent.cpu().numpy()
            parent_ok = np.where(parent < 0, True, accepted[np.clip(parent, 0, None)])
        else:
            parent_ok = depth == 1
        node_c.append(rd.node_prob.float().cpu().numpy()[parent_ok])
        node_a.append(accepted[parent_ok])
    cat = lambda xs, dt: np.concatenate(xs).astype(dt) if xs else np.zeros(0, dt)  # noqa: E731
    return {"path_prob": (cat(path_c, np.float64), cat(path_a, bool)),
            "node_prob": (cat(node_c, np.float64), cat(node_a, bool))}


def calibrate(rounds: list, n_bins: int = 10) -> dict[str, Calibration]:
    """Reliability analysis of both quantities over all drafted nodes of `rounds`."""
    has_parent = any(getattr(rd, "node_parent", None) is not None for rd in rounds)
    out = {}
    for quantity, (conf, acc) in collect_nodes(rounds).items():
        cal = reliability(conf, acc, n_bins, quantity)
        if quantity == "node_prob" and not has_parent:
            cal.note = "depth-1 nodes only (stats carry no node_parent)"
        out[quantity] = cal
    return out
