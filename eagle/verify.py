"""Lossless verification of a draft tree against the target's outputs at every node."""
from __future__ import annotations

import torch

from eagle.sampling import sample_token
from eagle.tree import DraftTree


def verify_greedy(tree: DraftTree, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Longest root->leaf prefix whose tokens equal the target argmax at their parent.

    target_logits [N, V]. Returns (path [a+1] node indices incl. root, bonus token [1]).
    """
    pred = target_logits.argmax(-1)  # [N] target's token after each node
    parent = tree.parents.clamp(min=0)
    correct = tree.tokens == pred[parent]  # [N] bool (root's entry is meaningless)
    paths = tree.retrieve_paths()  # [L, D+1]
    ok = correct[paths.clamp(min=0)] & (paths >= 0)  # [L, D+1]
    accepted = ok[:, 1:].long().cumprod(dim=1).sum(dim=1)  # [L] accepted draft tokens per path
    best = int(accepted.argmax())  # host sync: the one per round
    n_acc = int(accepted[best])
    path = paths[best, : n_acc + 1]  # [a+1]
    return path, pred[path[-1]].reshape(1)


def verify_sampling(tree: DraftTree, target_probs: torch.Tensor,
                    generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-draft rejection sampling (drafts are deterministic top-k picks, i.e. one-hot q).

    At a node with target distribution p, try its children in rank order: accept child x with
    probability p(x); on rejection set p(x) = 0 and renormalise. If all are rejected, or the node
    is a leaf, the next token is sampled from the remaining p. The output is distributed exactly
    as sampling from the target. target_probs [N, V]. Returns (path incl. root, next token [1]).
    """
    kids = tree.children()
    tokens = tree.tokens.tolist()
    node = 0
    path = [0]
    while True:
        p = target_probs[node]
        for child in kids[node]:
            x = tokens[child]
            px = float(p[x])
            u = float(torch.rand((), generator=generator))
            if u < px:
                node = child
                path.append(child)
                break
            p = p.clone()
            p[x] = 0.0
            total = p.sum()
            p = p / total if total > 0 else p
        else:
            return torch.tensor(path, device=tree.tokens.device), sample_token(p, generator)
