"""Per-round statistics of a generation, and what tau and per-depth acceptance are computed from them.

tau     = tokens committed by verification rounds / rounds (a round is one target forward after the prefill; the
          prefill's token belongs to no round; vanilla: tau = 1.00)
alpha_d = P(depth-d draft token accepted | depths 1..d-1 accepted and the draft reached depth d)
Evaluation reports and the trainer's live tau both count with these functions."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch


@dataclass
class RoundStats:
    accept_length: int  # draft tokens accepted this round
    new_tokens: int  # tokens committed this round (accept_length + 1, fewer when a stop cut the round)
    node_depth: torch.Tensor  # [N] int64 depth of every drafted node (1 = child of root), root excluded
    node_prob: torch.Tensor  # [N] float32 draft probability of the node's token given its parent
    node_path_prob: torch.Tensor  # [N] float32 product of draft probabilities along root->node
    node_accepted: torch.Tensor  # [N] bool node lies on the accepted path
    node_parent: torch.Tensor | None = None  # [N] int64 index of the parent among these N nodes, -1 = the root
    node_rank: torch.Tensor | None = None  # [N] int64 rank of the node's token among its parent's top-k draft tokens
    # calibrated acceptance the tree was ranked by (eagle/score_calibration.py); None when the tree used raw probs
    node_score: torch.Tensor | None = None  # [N] float32 of the node given its parent
    node_path_score: torch.Tensor | None = None  # [N] float32 product along root->node
    draft_s: float = 0.0
    verify_s: float = 0.0
    commit_s: float = 0.0


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    total_s: float = 0.0
    rounds: list[RoundStats] = field(default_factory=list)  # one per target forward after the prefill

    @property
    def tau(self) -> float:
        """Tokens per target forward (the first token comes from the prefill and is not counted)."""
        counted = sum(r.new_tokens for r in self.rounds)
        return counted / len(self.rounds) if self.rounds else 0.0


@dataclass
class DepthAcceptance:
    depth: int
    reached: int  # rounds whose draft had a depth-d node and whose depths 1..d-1 were all accepted
    accepted: int  # of those, rounds that accepted a depth-d token

    @property
    def rate(self) -> float:
        return self.accepted / self.reached if self.reached else float("nan")

    def to_dict(self) -> dict:
        return {"depth": self.depth, "reached": self.reached, "accepted": self.accepted, "rate": self.rate}


def committed_tokens(rounds: Iterable[RoundStats]) -> int:
    """Tokens committed by verification rounds (the numerator of tau)."""
    return sum(int(r.new_tokens) for r in rounds)


def acceptance_by_depth(rounds: Iterable[RoundStats]) -> list[DepthAcceptance]:
    """alpha_d for d = 1..the deepest drafted node over `rounds` (empty for vanilla)."""
    accept, tree_depth = [], []
    for rd in rounds:
        accept.append(int(rd.accept_length))
        tree_depth.append(int(rd.node_depth.max()) if rd.node_depth.numel() else 0)
    out = []
    for d in range(1, max(tree_depth, default=0) + 1):
        reached = [a >= d - 1 and t >= d for a, t in zip(accept, tree_depth)]
        out.append(DepthAcceptance(d, sum(reached), sum(r and a >= d for r, a in zip(reached, accept))))
    return out
