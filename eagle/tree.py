"""Draft trees: the structure verified by the target in one forward.

Node 0 is the root (the last committed token, not yet in the target's KV cache); nodes are
ordered so that parents precede children. All tensors are 1-D over nodes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DraftTree:
    tokens: torch.Tensor  # [N] int64
    parents: torch.Tensor  # [N] int64, parents[0] = -1, parents[i] < i
    depth: torch.Tensor  # [N] int64, root 0
    prob: torch.Tensor  # [N] float32, draft prob of the token given its parent (root 1.0)
    path_logprob: torch.Tensor  # [N] float32, cumulative draft log-prob root->node (root 0)
    # [N] float32 what the tree was ranked by: log calibrated acceptance root->node (eagle/score_calibration.py);
    # None = path_logprob (no calibration)
    path_score: torch.Tensor | None = None
    rank: torch.Tensor | None = None  # [N] int64 the node's rank among its parent's top-k draft tokens (root 0)
    ancestors: torch.Tensor | None = field(default=None, repr=False, compare=False)  # [N, N]; see attention_mask
    draft_probs: torch.Tensor | None = field(default=None, repr=False, compare=False)  # [N, V] q each token was SAMPLED from (probabilistic chains; row 0 unused)

    @property
    def size(self) -> int:
        return self.tokens.numel()

    def attention_mask(self) -> torch.Tensor:
        """[N, N] bool: node i sees node j iff j is i or an ancestor of i. Taken from `ancestors` when the
        builder knows it, else computed once per tree (the target's verification forward and `verify_greedy`
        both read it); treat it as read-only."""
        if self.ancestors is None:
            # With P the child -> parent adjacency, ancestor-or-self = I + P + P^2 + ... = (I - P)^-1: one
            # triangular solve (parents precede children, so I - P is unit lower triangular; the sums are path
            # counts, 0 or 1 in a tree, exact in float) instead of one gather per tree level.
            n = self.size
            eye = torch.eye(n, device=self.tokens.device)  # [N, N] float32
            unit_lower = eye.index_put((torch.arange(1, n, device=eye.device), self.parents[1:]), eye.new_tensor(-1.0))
            self.ancestors = torch.linalg.solve_triangular(unit_lower, eye, upper=False, unitriangular=True) != 0
        return self.ancestors

    def position_ids(self, prefix_len: int) -> torch.Tensor:
        """[N] target position of each node: the root sits right after the cached prefix."""
        return self.depth + prefix_len

    def retrieve_paths(self) -> torch.Tensor:
        """[L, max_depth + 1] node indices root..leaf, -1 padded, one row per leaf (leaves in node order)."""
        parents = self.parents.tolist()
        depth = self.depth.tolist()
        is_parent = [False] * len(parents)
        for p in parents[1:]:
            is_parent[p] = True
        width = max(depth) + 1
        rows = []
        for leaf in (i for i, par in enumerate(is_parent) if not par):
            row = [-1] * width
            node = leaf
            while node >= 0:
                row[depth[node]] = node
                node = parents[node]
            rows.append(row)
        return torch.tensor(rows, dtype=torch.long, device=self.tokens.device)

    def children(self) -> list[list[int]]:
        """Children of every node in node order (= rank order for the trees built here)."""
        kids: list[list[int]] = [[] for _ in range(self.size)]
        for i, p in enumerate(self.parents.tolist()[1:], start=1):
            kids[p].append(i)
        return kids


def sampled_chain(tokens: torch.Tensor, q_rows: torch.Tensor) -> DraftTree:
    """The chain root -> tokens[1] -> ... whose token d was SAMPLED from q_rows[d - 1]: tokens [N] (tokens[0] the
    root), q_rows [N-1, V]. `draft_probs` keeps every q (row 0, the root's, zeros) for `verify_chain_sampling`."""
    n, dev = tokens.numel(), tokens.device
    q_all = torch.cat([torch.zeros_like(q_rows[:1]), q_rows])  # [N, V]
    prob = q_all.gather(1, tokens[:, None])[:, 0]
    prob[0] = 1.0
    return DraftTree(tokens=tokens, parents=torch.arange(-1, n - 1, device=dev), depth=torch.arange(n, device=dev),
                     prob=prob, path_logprob=prob.log().cumsum(0),
                     ancestors=torch.ones(n, n, dtype=torch.bool, device=dev).tril(), draft_probs=q_all)


def rerank_tree(
    root_token: int | torch.Tensor,
    cand_tokens: torch.Tensor,
    cand_logprob: torch.Tensor,
    cand_path_logprob: torch.Tensor,
    cand_parent: torch.Tensor,
    cand_depth: torch.Tensor,
    total_token: int,
    cand_score: torch.Tensor | None = None,
    cand_rank: torch.Tensor | None = None,
) -> DraftTree:
    """EAGLE-2 rerank: keep the total_token - 1 candidates with the highest path value.

    Candidates must be listed parents-before-children (as drafting generates them level by level);
    cand_parent indexes candidates (-1 = root), cand_depth is each candidate's depth (root's children 1).
    cand_score: calibrated path values to rank by instead of cand_path_logprob (eagle/score_calibration.py).
    cand_rank: each candidate's rank among its parent's top-k (kept in the tree's `rank`, for statistics).
    Path values never increase along a path and ties go to the lower candidate index, so every kept
    node's parent is kept: the result is a tree.
    """
    m = cand_tokens.numel()
    dev = cand_tokens.device
    keep_n = min(total_token - 1, m)
    ranked = cand_path_logprob if cand_score is None else cand_score
    order = torch.sort(ranked, descending=True, stable=True).indices[:keep_n]  # [K]
    keep = torch.sort(order).values  # [K] candidate ids, parents first
    node_of = torch.full((m + 1,), -1, dtype=torch.long, device=dev)  # cand id -> node; id -1 (root) -> slot m
    node_of[m] = 0
    node_of[keep] = torch.arange(1, keep_n + 1, device=dev)
    parents = node_of[cand_parent[keep]]  # [K] (-1 indexes slot m: the root)
    if bool((parents < 0).any()):
        raise AssertionError("rerank produced an orphan node: candidate values increase along a path")
    zero = torch.zeros(1, dtype=torch.long, device=dev)
    root = torch.as_tensor(root_token, device=dev).reshape(1).long()
    return DraftTree(
        tokens=torch.cat([root, cand_tokens[keep].long()]),
        parents=torch.cat([zero - 1, parents]),
        depth=torch.cat([zero, cand_depth[keep]]),
        prob=torch.cat([torch.ones(1, device=dev), cand_logprob[keep].float().exp()]),
        path_logprob=torch.cat([torch.zeros(1, device=dev), cand_path_logprob[keep].float()]),
        path_score=None if cand_score is None else torch.cat([torch.zeros(1, device=dev), cand_score[keep].float()]),
        rank=None if cand_rank is None else torch.cat([zero, cand_rank[keep]]),
    )


@dataclass
class StaticTreeSpec:
    """An EAGLE-1 tree given by child-rank paths, e.g. [0, 1] = 2nd child of the 1st child of the root.

    Nodes (excluding the root) are sorted by depth, then lexicographically; node i+1 <-> choices[i].
    """

    choices: list[tuple[int, ...]]
    parents: torch.Tensor  # [N] node index of each node's parent (root included, -1)
    ranks: torch.Tensor  # [N] child rank of each node (root 0)
    depth: torch.Tensor  # [N]
    ancestors: torch.Tensor  # [N, N] bool, ancestor-or-self
    levels: list[tuple[int, int]]  # [lo, hi) node range of depth 1, 2, ... (contiguous: nodes sorted by depth)
    max_rank: int

    @classmethod
    def from_choices(cls, choices: list[list[int]] | list[tuple[int, ...]]) -> "StaticTreeSpec":
        ch = sorted({tuple(int(r) for r in c) for c in choices}, key=lambda c: (len(c), c))
        if not ch:
            raise ValueError("a static tree needs at least one choice path")
        index = {(): 0}
        for i, c in enumerate(ch, start=1):
            index[c] = i
        parents, ranks, depth = [-1], [0], [0]
        for c in ch:
            if any(r < 0 for r in c):
                raise ValueError(f"static tree choice {list(c)} has a negative rank")
            if c[:-1] not in index:
                raise ValueError(f"static tree choice {list(c)} has no parent path {list(c[:-1])} in the list")
            parents.append(index[c[:-1]])
            ranks.append(c[-1])
            depth.append(len(c))
        tree = DraftTree(tokens=torch.zeros(len(parents), dtype=torch.long), parents=torch.tensor(parents),
                         depth=torch.tensor(depth), prob=torch.ones(len(parents)), path_logprob=torch.zeros(len(parents)))
        levels = [(depth.index(d), len(depth) - depth[::-1].index(d)) for d in range(1, depth[-1] + 1)]
        return cls(choices=ch, parents=tree.parents, ranks=torch.tensor(ranks), depth=tree.depth,
                   ancestors=tree.attention_mask(), levels=levels, max_rank=max(ranks))

    @property
    def size(self) -> int:
        return self.parents.numel()

    @property
    def max_depth(self) -> int:
        return len(self.levels)


def chain_choices(length: int) -> list[tuple[int, ...]]:
    """A chain of `length` draft tokens as a static tree: [0], [0, 0], ..."""
    return [(0,) * d for d in range(1, length + 1)]
