"""Calibrated tree scores: what the EAGLE-2 tree ranks by when the draft's own probability is not an acceptance rate.

EAGLE-2 grows and reranks its tree by the product of the draft's probabilities along a path, on the premise that
a node's probability approximates the chance verification accepts it given its parent was accepted. That holds for
a head that is sharp where the target is sharp; on a high-entropy target decoded greedily it does not: the target's
argmax is a far likelier acceptance than the head's flat probabilities say, and the tree comes out wide and shallow.

`ScoreCalibration` maps a node's draft log-probability (given its parent) at tree depth d and sibling rank r (0 = the
draft's best token) to log P(accepted | parent accepted) for ONE sampling setting (greedy, or a temperature / top-p /
top-k): at T = 0 that is P(token = the target's argmax), at T > 0 it is the target's processed probability of the
token (multi-draft rejection sampling accepts each child with exactly that marginal). Rank is an input because at
T = 0 it says more than the probability: on the default target the draft's best token is the target's argmax 83% of
the time at a mean probability of 0.20, its second best 12% at 0.10 (docs/results/default-target-calibration.md).
The map is an increasing piecewise-linear function of the probability per (depth, rank) (an isotonic fit,
evaluation/calibration.py), tabulated over log-probabilities so that a draft level applies it in a handful of tensor
ops. It changes tree SCORES only -- which candidates are expanded and kept; the verified tokens, their order among
siblings and verification itself are untouched, so decoding stays exactly lossless whatever the map says (greedy:
identical to vanilla; sampling: verification reads only the target's probabilities). Saved in the head's tree_config.json under "calibration" (a list, one map per sampling setting).

A map also records which (depth, rank) cells its fit saw and how many nodes of each (fitted_on["coverage"]):
`covered()` is the largest tree shape (node depth x ranks) every cell of which had at least MIN_NODES_PER_CELL
nodes; a tree decoded deeper or wider than that ranks by scores extrapolated from shallower depths / lower ranks
(evaluation warns in one line).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

GREEDY_TEMPERATURE = 1e-5  # at or below this, decoding is greedy (eagle.sampling.SamplingParams.greedy)
TABLE_LOGPROB_MIN = -16.0  # log-probabilities below this share the first table entry (p < 1.1e-7)
TABLE_SIZE = 4096  # entries over [TABLE_LOGPROB_MIN, 0]: 0.004 nats apart
MIN_NODES_PER_CELL = 30  # a (depth, rank) cell the fit saw fewer nodes of (parent accepted) is not covered
SCORE_FLOOR = 1e-6  # calibrated acceptance is clipped to [SCORE_FLOOR, 1]: scores stay finite and never increase along a path


@dataclass
class ScoreCalibration:
    """Increasing maps draft probability -> acceptance probability per (depth, sibling rank), for one sampling setting.

    knots_x[d][r] increasing in [0, 1], knots_y[d][r] non-decreasing in [0, 1]: the map of depth d + 1, rank r; depths
    past the last use the last depth's maps, ranks past the last use that depth's last map. Between knots: linear;
    outside them: the nearest knot's value (as an isotonic fit says: no data, no slope).
    """

    temperature: float  # the decoding setting the map was fitted for (0 = greedy)
    top_p: float
    top_k: int
    knots_x: list[list[list[float]]]  # [depth][rank][knot]
    knots_y: list[list[list[float]]]
    fitted_on: dict = field(default_factory=dict)  # nodes, prompts, tree, ... (provenance, reported)
    _tables: dict = field(default_factory=dict, repr=False, compare=False)  # device -> [D, R * TABLE_SIZE] float32

    def __post_init__(self):
        if not self.knots_x or len(self.knots_x) != len(self.knots_y):
            raise ValueError("calibration: knots_x and knots_y need one list per depth (at least one)")
        for d, (xd, yd) in enumerate(zip(self.knots_x, self.knots_y), start=1):
            if not xd or len(xd) != len(yd):
                raise ValueError(f"calibration depth {d}: knots_x and knots_y need one list per rank (at least one)")
            for r, (xs, ys) in enumerate(zip(xd, yd)):
                where = f"calibration depth {d} rank {r}"
                if not xs or len(xs) != len(ys):
                    raise ValueError(f"{where}: knots_x and knots_y must be non-empty and of equal length")
                if any(not (0.0 <= v <= 1.0) or not math.isfinite(v) for v in [*xs, *ys]):
                    raise ValueError(f"{where}: knots must lie in [0, 1]")
                if any(b <= a for a, b in zip(xs, xs[1:])) or any(b < a for a, b in zip(ys, ys[1:])):
                    raise ValueError(f"{where}: knots_x must increase and knots_y must not decrease")
        cov = self.fitted_on.get("coverage")
        if cov is not None:
            nodes = cov.get("nodes") if isinstance(cov, dict) else None
            need = cov.get("min_nodes", MIN_NODES_PER_CELL) if isinstance(cov, dict) else None
            if (not isinstance(nodes, list) or not all(isinstance(row, list) for row in nodes)
                    or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for row in nodes for n in row)
                    or not isinstance(need, int) or isinstance(need, bool) or need < 1):
                raise ValueError('calibration fitted_on.coverage: expected {"nodes": [[count per rank] per depth] of '
                                 'integers >= 0, "min_nodes": an integer >= 1}; refit the map (python -m '
                                 'evaluation autotune)')
        for name in ("temperature", "top_p", "top_k"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"calibration {name}={v!r}: expected a finite number >= 0")

    @property
    def ranks(self) -> int:
        """Rank maps per depth in the table (the largest count over depths; a depth with fewer repeats its last)."""
        return max(len(xd) for xd in self.knots_x)

    # ------------------------------------------------------------------ which decoding it is for
    @property
    def greedy(self) -> bool:
        return self.temperature <= GREEDY_TEMPERATURE

    def matches(self, temperature: float, top_p: float, top_k: int) -> bool:
        """Fitted for this sampling setting? Greedy matches greedy; T > 0 needs T, top-p and top-k equal (top_p
        0 and >= 1 both mean no nucleus cut)."""
        if temperature <= GREEDY_TEMPERATURE or self.greedy:
            return temperature <= GREEDY_TEMPERATURE and self.greedy
        cut = lambda p: p if 0 < p < 1 else 0.0  # noqa: E731
        return (math.isclose(temperature, self.temperature, rel_tol=1e-6) and math.isclose(cut(top_p), cut(self.top_p))
                and int(top_k) == int(self.top_k))

    def describe(self) -> str:
        setting = "greedy" if self.greedy else f"T={self.temperature:g}, top_p={self.top_p:g}, top_k={self.top_k}"
        shape = self.covered()
        cover = "" if shape is None else f", covering node depths 1-{shape[0]} x ranks 0-{shape[1] - 1}"
        return f"{setting}, maps for {len(self.knots_x)} depth(s) x {self.ranks} rank(s){cover}"

    # ------------------------------------------------------------------ what the fit saw
    def covered(self) -> tuple[int, int] | None:
        """(node depth, ranks) of the largest tree whose every (depth, rank) cell the fit saw at least `min_nodes`
        nodes of (parent accepted): ranks = the leading ranks covered at depth 1, depth = the leading depths at
        which all of those are covered. None when the map records no coverage (fitted before it was recorded)."""
        cov = self.fitted_on.get("coverage")
        if cov is None:
            return None
        nodes, need = cov["nodes"], cov.get("min_nodes", MIN_NODES_PER_CELL)
        ranks = 0
        while nodes and ranks < len(nodes[0]) and nodes[0][ranks] >= need:
            ranks += 1
        depth = 0
        while ranks and depth < len(nodes) and len(nodes[depth]) >= ranks and min(nodes[depth][:ranks]) >= need:
            depth += 1
        return depth, ranks

    def cell_nodes(self, depth: int, rank: int) -> int | None:
        """Nodes (parent accepted) of cell (depth, rank) the fit saw; None when the map records no coverage."""
        cov = self.fitted_on.get("coverage")
        if cov is None:
            return None
        nodes = cov["nodes"]
        return nodes[depth - 1][rank] if depth - 1 < len(nodes) and rank < len(nodes[depth - 1]) else 0

    # ------------------------------------------------------------------ applying it
    def probability(self, prob: torch.Tensor, depth: int, rank: int = 0) -> torch.Tensor:
        """Calibrated acceptance of draft probabilities `prob` (any shape) of rank-`rank` children at tree depth
        `depth` (1 = root's children): exact piecewise-linear evaluation (what the table samples)."""
        xs, ys = self._curve(depth, rank)
        x = torch.tensor(xs, dtype=torch.float64, device=prob.device)
        y = torch.tensor(ys, dtype=torch.float64, device=prob.device)
        p = prob.double().clamp(0.0, 1.0)
        i = torch.searchsorted(x, p.contiguous(), right=True).clamp(1, len(xs) - 1)  # segment [x[i-1], x[i]]
        x0, x1, y0, y1 = x[i - 1], x[i], y[i - 1], y[i]
        out = y0 + (y1 - y0) * (p - x0) / (x1 - x0)
        return out.clamp(SCORE_FLOOR, 1.0).to(prob.dtype if prob.is_floating_point() else torch.float32)

    def log_score(self, logprob: torch.Tensor, depth: int) -> torch.Tensor:
        """[..., k] draft log-probs of the top-k children of each parent at `depth`, in rank order along the last
        dimension (as `topk` returns them) -> [..., k] log calibrated acceptance (float32): one table lookup."""
        table = self._table(logprob.device)  # [D, R * TABLE_SIZE]
        row = table[min(depth, table.shape[0]) - 1]  # [R * TABLE_SIZE]
        k = logprob.shape[-1]
        offsets = torch.arange(k, device=logprob.device).clamp_(max=self.ranks - 1).mul_(TABLE_SIZE)  # [k] rank rows
        scale = (TABLE_SIZE - 1) / -TABLE_LOGPROB_MIN  # entry i holds log-prob TABLE_LOGPROB_MIN + i / scale
        idx = logprob.mul(scale).add_(0.5 - TABLE_LOGPROB_MIN * scale).clamp_(0, TABLE_SIZE - 1).long()  # nearest entry
        return row[idx.add_(offsets)]

    def _curve(self, depth: int, rank: int) -> tuple[list[float], list[float]]:
        """Knots of (depth, rank), extended flat to probabilities 0 and 1."""
        maps_x = self.knots_x[min(max(depth, 1), len(self.knots_x)) - 1]
        maps_y = self.knots_y[min(max(depth, 1), len(self.knots_y)) - 1]
        r = min(max(rank, 0), len(maps_x) - 1)
        xs, ys = list(maps_x[r]), list(maps_y[r])
        if xs[0] > 0.0:
            xs, ys = [0.0] + xs, [ys[0]] + ys
        if xs[-1] < 1.0:
            xs, ys = xs + [1.0], ys + [ys[-1]]
        return xs, ys

    def _table(self, device) -> torch.Tensor:
        key = str(device)
        if key not in self._tables:
            grid = torch.linspace(TABLE_LOGPROB_MIN, 0.0, TABLE_SIZE, dtype=torch.float64).exp()  # [TABLE_SIZE] probs
            rows = [torch.cat([self.probability(grid, d, r).double().log() for r in range(self.ranks)])
                    for d in range(1, len(self.knots_x) + 1)]
            self._tables[key] = torch.stack(rows).float().to(device)  # [D, R * TABLE_SIZE]
        return self._tables[key]

    # ------------------------------------------------------------------ saving
    def to_dict(self) -> dict:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
                "knots_x": self.knots_x, "knots_y": self.knots_y, "fitted_on": self.fitted_on}

    @classmethod
    def from_dict(cls, data: dict, where: str = "calibration") -> "ScoreCalibration":
        keys = {"temperature", "top_p", "top_k", "knots_x", "knots_y", "fitted_on"}
        unknown, missing = set(data) - keys, keys - {"fitted_on"} - set(data)
        if unknown or missing:
            raise ValueError(f"{where}: unknown keys {sorted(unknown)}, missing keys {sorted(missing)}; "
                             f"valid: {sorted(keys)}")
        try:
            knots = [[[[float(v) for v in xs] for xs in xd] for xd in data[k]] for k in ("knots_x", "knots_y")]
            setting = float(data["temperature"]), float(data["top_p"]), int(data["top_k"])
        except (TypeError, ValueError):
            raise ValueError(f"{where}: knots_x / knots_y must be lists [depth][rank][knot] of numbers and "
                             "temperature / top_p / top_k numbers") from None
        return cls(*setting, knots_x=knots[0], knots_y=knots[1], fitted_on=dict(data.get("fitted_on", {})))


def pick_calibration(calibrations: list[ScoreCalibration], temperature: float, top_p: float,
                     top_k: int) -> ScoreCalibration | None:
    """The map fitted for this sampling setting, or None (then the tree ranks by the draft's raw probabilities)."""
    return next((c for c in calibrations if c.matches(temperature, top_p, top_k)), None)
