"""Lossless verification of a draft tree against the target's outputs at every node."""
from __future__ import annotations

import torch

from eagle.sampling import greedy_ids, sample_token
from eagle.tree import DraftTree


def verify_greedy(tree: DraftTree, target_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Longest root->node path whose tokens equal the target argmax at their parent.

    target_logits [N, V]. Returns (path [a+1] node indices incl. root, new tokens [a+1]: the a accepted
    drafts, then the target's token after the last of them).
    """
    pred = greedy_ids(target_logits)  # [N] target's token after each node
    correct = tree.tokens[1:] == pred[tree.parents[1:]]  # [N-1] bool, nodes 1.. (the root is committed)
    anc = tree.attention_mask()  # [N, N] ancestor-or-self
    ok = (anc[:, 1:] <= correct).all(-1)  # [N] every non-root node on root..i matches (bool <= is "implies")
    # Siblings carry distinct tokens, so at most one child of an accepted node matches: the accepted
    # nodes form one path from the root, ending at the deepest of them.
    end = torch.where(ok, tree.depth, -1).argmax()
    path = anc[end].nonzero().flatten()  # [a+1] host sync; node order = root..end
    return path, pred[path]  # an accepted node's token IS the target's token at its parent


def verify_sampling(tree: DraftTree, target_probs: torch.Tensor,
                    generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Multi-draft rejection sampling (drafts are deterministic top-k picks, i.e. one-hot q).

    At a node with target distribution p, try its children in rank order: accept child x with
    probability p(x); on rejection set p(x) = 0 and renormalise. If all are rejected, or the node
    is a leaf, the next token is sampled from the remaining p. The output is distributed exactly
    as sampling from the target. target_probs [N, V]. Returns (path [a+1] incl. root, new tokens [a+1]: the
    accepted drafts, then the sampled next token).
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
            path_t = torch.tensor(path, device=tree.tokens.device)
            return path_t, torch.cat([tree.tokens[path_t[1:]], sample_token(p, generator)])


def verify_chain_sampling(tree: DraftTree, target_probs: torch.Tensor,
                          generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling of a chain whose tokens were SAMPLED from the draft (`tree.draft_probs`, q).

    Token x_i (drawn from q_i) is accepted with probability min(1, p_i(x_i) / q_i(x_i)), p_i = target_probs of its
    parent; at the first rejection the next token is drawn from max(p_i - q_i, 0) renormalised, and after a fully
    accepted chain from the last node's p. Every output token is then distributed exactly as a draw from the
    target (Leviathan et al. 2023, Chen et al. 2023). target_probs [N, V]. Returns (path [a+1] incl. root, new
    tokens [a+1])."""
    q = tree.draft_probs  # [N, V], row i = the distribution token i was drawn from
    if q is None:
        raise ValueError("verify_chain_sampling needs a chain drafted by sampling (tree.draft_probs)")
    tokens = tree.tokens.tolist()
    n = len(tokens)
    for i in range(1, n):
        p = target_probs[i - 1]  # [V]: the target's distribution for token i
        x = tokens[i]
        u = float(torch.rand((), generator=generator))
        if u * float(q[i, x]) < float(p[x]):  # accept with probability min(1, p(x) / q(x))
            continue
        residual = (p - q[i]).clamp(min=0.0)  # [V]
        total = residual.sum()
        nxt = sample_token(residual / total if total > 0 else p, generator)
        path = torch.arange(i, device=tree.tokens.device)  # root .. node i-1
        return path, torch.cat([tree.tokens[1:i], nxt])
    path = torch.arange(n, device=tree.tokens.device)
    return path, torch.cat([tree.tokens[1:], sample_token(target_probs[n - 1], generator)])
