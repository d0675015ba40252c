"""Per-round statistics of a generation: what evaluation builds tau, per-depth acceptance and calibration from."""
from __future__ import annotations

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
