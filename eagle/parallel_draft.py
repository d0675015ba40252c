"""Parallel drafting (P-EAGLE heads, eagle/peagle.py): every draft position of a round from ONE head forward.

`ParallelDrafter.extend` only records the committed positions; the drafting call runs the head once over them plus
`depth - 1` mask rows (the mask token with the head's `mask_feature`), positions counting on, causal over all (vLLM's
parallel-drafting layout), then rolls the mask rows back out of the draft KV cache. Output row i (0 = the last
committed position) is the draft distribution q_{i+1} of draft position i + 1, which does not depend on the tokens
drafted before it. The drafts built from those k distributions:
- chain / static trees (`draft_static`): the node at depth d with child rank r takes the r-th best token of q_d;
- dynamic trees (`draft_dynamic`): EAGLE-2's expansion with every frontier node's children being q_{d+1}'s top_k
  (a path's score is the sum of its tokens' log q, or their calibrated scores), reranked to total_token;
- sampled chains (`draft_chain_sampled`): token d drawn from q_d at the temperature, q kept for the chain rule.
Verification is the target's, unchanged, so every mode stays lossless (greedy) / exact (sampling).
Cost per round: one head forward of (committed + depth - 1) rows, whatever the tree.
"""
from __future__ import annotations

import torch

from eagle.draft import Drafter
from eagle.score_calibration import ScoreCalibration
from eagle.tree import DraftTree, StaticTreeSpec, rerank_tree, sampled_chain


class ParallelDrafter(Drafter):
    """A `Drafter` whose rounds take one head forward (module docstring). The head must have `mask_feature()` and
    `mask_token_id` (a `PeagleHead`)."""

    def __init__(self, head, lm_head: torch.nn.Module, capacity: int):
        super().__init__(head, lm_head, capacity)
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None  # committed (features [n, 3H], ids [n])
        self.forwards = 0  # head forwards run so far (the round's draft cost)

    def reset(self, capacity: int) -> None:
        super().reset(capacity)
        self._pending = None

    @property
    def length(self) -> int:
        return self.decoder.length + (0 if self._pending is None else self._pending[1].numel())

    @torch.no_grad()
    def extend(self, features: torch.Tensor, next_ids: torch.Tensor) -> None:
        """Record n committed positions ([1, n, 3H] aux states, [1, n] the tokens after them); the drafting call runs
        them with the mask rows in one forward. Returns None: no separate root prediction exists."""
        if self._pending is not None:
            features = torch.cat([self._pending[0], features[0]])
            next_ids = torch.cat([self._pending[1], next_ids[0]])
            self._pending = (features, next_ids)
        else:
            self._pending = (features[0], next_ids[0])

    @torch.no_grad()
    def outputs(self, depth: int) -> torch.Tensor:
        """The head's output hiddens [depth, H] for draft positions 1..depth: one forward over the recorded committed
        rows and depth - 1 mask rows; the committed rows stay in the draft cache, the mask rows are rolled back."""
        if self._pending is None:
            raise RuntimeError("ParallelDrafter: extend() the committed positions before drafting")
        feats, ids = self._pending
        dec = self.decoder
        committed = dec.length + ids.numel()
        mask_feat = dec.fuse(self.head.mask_hidden.detach())  # [1, H]
        x = torch.cat([dec.fuse(feats), mask_feat.expand(depth - 1, -1)])  # [n + depth - 1, H]
        tok = torch.cat([ids, ids.new_full((depth - 1,), self.head.mask_token_id)])
        out = dec.forward(x, tok, range(dec.length, dec.length + tok.numel()))  # causal over the new rows
        dec.truncate(committed)
        self._pending = None
        self.forwards += 1
        return out[ids.numel() - 1:]  # [depth, H]

    @torch.no_grad()
    def draft_static(self, root: torch.Tensor, feature, spec: StaticTreeSpec) -> DraftTree:
        """A static tree (a chain is [0], [0, 0], ...): node (depth d, rank r) = the r-th best token of q_d."""
        dev = root.device
        lp, tok = self._topk(self.outputs(spec.max_depth), spec.max_rank + 1)  # [D, kmax] each
        depth, parents, ranks = spec.depth.to(dev), spec.parents.to(dev), spec.ranks.to(dev)
        row = (depth - 1).clamp(min=0)
        tokens = tok[row, ranks].clone()
        tokens[0] = root[0]
        logprob = torch.where(depth > 0, lp[row, ranks], 0.0)  # [N]
        path_lp = logprob.clone()
        anc = parents.clamp(min=0)
        for _ in range(spec.max_depth - 1):
            path_lp += torch.where(anc > 0, logprob[anc], 0.0)
            anc = parents.clamp(min=0)[anc]
        return DraftTree(tokens=tokens, parents=parents.clone(), depth=depth.clone(), prob=logprob.exp(),
                         path_logprob=path_lp, ancestors=spec.ancestors.to(dev), rank=ranks)

    @torch.no_grad()
    def draft_dynamic(self, root: torch.Tensor, feature, total_token: int, depth: int, top_k: int,
                      calibration: ScoreCalibration | None = None) -> DraftTree:
        """EAGLE-2's dynamic tree over the parallel distributions: depth + 1 draft positions from one forward; level d's
        frontier (the top_k paths by score) each get q_{d+1}'s top_k as children; reranked to total_token."""
        dev, k = root.device, top_k
        score = (lambda lp, d: lp) if calibration is None else calibration.log_score  # noqa: E731
        lps, toks = self._topk(self.outputs(depth + 1), k)  # [depth + 1, k] each
        lp, tok = lps[0], toks[0]
        front_path, front_score = lp, score(lp, 1)
        cand_tok, cand_lp, cand_path, cand_score, bests = [tok], [lp], [lp], [front_score], []
        for d in range(depth):
            lp, tok = lps[d + 1], toks[d + 1]  # [k]: the same children under every frontier node
            path = (front_path[:, None] + lp[None, :]).flatten()  # [k k], frontier row r's children at r k ..
            ranked = path if calibration is None else (front_score[:, None] + score(lp, d + 2)[None, :]).flatten()
            cand_tok.append(tok.repeat(k))
            cand_lp.append(lp.repeat(k))
            cand_path.append(path)
            cand_score.append(ranked)
            if d == depth - 1:
                break
            if calibration is None:
                front_path, best = path.topk(k)
                front_score = front_path
            else:
                front_score, best = ranked.topk(k)
                front_path = path.index_select(0, best)
            bests.append(best)
        return rerank_tree(root, torch.cat(cand_tok), torch.cat(cand_lp), torch.cat(cand_path),
                           self._candidate_parents(bests, k, depth, dev), self._candidate_depth(k, depth, dev),
                           total_token, cand_score=None if calibration is None else torch.cat(cand_score),
                           cand_rank=self._candidate_rank(k, depth, dev))

    @torch.no_grad()
    def draft_chain_sampled(self, root: torch.Tensor, feature, length: int, temperature: float,
                            generator: torch.Generator | None = None) -> DraftTree:
        """A chain of `length` tokens, token d SAMPLED from q_d at `temperature` (all q from one forward); q kept for
        `verify_chain_sampling`."""
        q = self.decoder.probs(self.outputs(length), temperature)  # [length, V]
        drawn = torch.multinomial(q, 1, generator=generator)[:, 0]  # [length]
        return sampled_chain(torch.cat([root[:1], drawn]), q)
