"""Drafting: run the head on committed positions, then grow a draft tree from its own guesses.

`Drafter` owns the head's preallocated KV cache. Committed positions stay in it across rounds;
tree nodes are appended while drafting and rolled back afterwards (`truncate`).
"""
from __future__ import annotations

import torch

from eagle.head import EagleHead
from eagle.tree import DraftTree, StaticTreeSpec, rerank_tree


class Drafter:
    def __init__(self, head: EagleHead, lm_head: torch.nn.Module, capacity: int):
        self.head = head
        self.lm_head = lm_head
        self.kv = head.new_kv_cache(capacity)
        self.fused = None  # concatenated head weights, re-taken at every reset (weights may change between generations)

    @property
    def length(self) -> int:
        return self.kv.length

    def reset(self, capacity: int) -> None:
        if capacity > self.kv.capacity:
            self.kv = self.head.new_kv_cache(capacity)
        self.kv.truncate(0)
        self.fused = self.head.fuse_decode_weights()

    def _logprobs(self, features: torch.Tensor) -> torch.Tensor:
        """[n, H] predicted features -> [n, V] float32 draft log-probs through the target's lm_head."""
        return torch.log_softmax(self.lm_head(features.to(self.lm_head.weight.dtype)).float(), dim=-1)

    @torch.no_grad()
    def extend(self, features: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """Commit n positions (target features [1, n, H], the tokens that follow them [1, n]).

        Returns the predicted feature after the last one, [1, H]: it scores the root's children.
        """
        n = next_ids.shape[1]
        pos = torch.arange(self.kv.length, self.kv.length + n, device=next_ids.device)  # [n]
        out = self.head.forward_cached(features.to(self.head.dtype), next_ids, pos, self.kv, fused=self.fused)  # [1, n, H]
        return out[:, -1]

    @torch.no_grad()
    def draft_dynamic(self, root: torch.Tensor, feature: torch.Tensor, total_token: int, depth: int,
                      top_k: int) -> DraftTree:
        """EAGLE-2 dynamic tree. root [1] token, feature [1, H] predicted feature at the root."""
        committed = self.kv.length
        dev = root.device
        k = top_k
        lp, tok = self._logprobs(feature)[0].topk(k)  # [k], [k] depth-1 candidates
        cand_tok, cand_lp, cand_path, cand_parent = [tok], [lp], [lp], [torch.full((k,), -1, device=dev)]
        front_feat = feature.expand(k, -1)  # [k, H] input feature of each frontier node (its parent's prediction)
        front_tok, front_path, front_cand = tok, lp, torch.arange(k, device=dev)  # [k] each
        anc = torch.zeros(k, depth * k, dtype=torch.bool, device=dev)  # [k, tree-KV] ancestors of frontier nodes
        eye = torch.eye(k, dtype=torch.bool, device=dev)
        n_cand = k
        for d in range(depth):
            anc[:, d * k : (d + 1) * k] = eye  # each frontier node sees itself
            mask = torch.cat([torch.ones(k, committed, dtype=torch.bool, device=dev), anc[:, : (d + 1) * k]], 1)
            pos = torch.full((k,), committed + d, device=dev)  # all nodes of a level share a position
            out = self.head.forward_cached(front_feat[None], front_tok[None], pos, self.kv, mask[None, None],
                                           fused=self.fused)[0]
            lp, tok = self._logprobs(out).topk(k, dim=-1)  # [k, k]
            path = front_path[:, None] + lp  # [k, k] value = log of the product of confidences
            cand_tok.append(tok.flatten())
            cand_lp.append(lp.flatten())
            cand_path.append(path.flatten())
            cand_parent.append(front_cand.repeat_interleave(k))
            best = path.flatten().topk(k).indices  # [k] new frontier among the k*k children
            parent_row = best // k
            front_feat, front_tok, front_path = out[parent_row], tok.flatten()[best], path.flatten()[best]
            front_cand = n_cand + best
            anc = anc[parent_row]
            n_cand += k * k
        self.kv.truncate(committed)
        return rerank_tree(root, torch.cat(cand_tok), torch.cat(cand_lp), torch.cat(cand_path),
                           torch.cat(cand_parent), total_token)

    @torch.no_grad()
    def draft_static(self, root: torch.Tensor, feature: torch.Tensor, spec: StaticTreeSpec) -> DraftTree:
        """EAGLE-1 static tree (a chain is the tree [0], [0, 0], ...)."""
        committed = self.kv.length
        dev = root.device
        n = spec.size
        kmax = spec.max_rank + 1
        tokens = torch.zeros(n, dtype=torch.long, device=dev)
        tokens[0] = root[0]
        logprob = torch.zeros(n, device=dev)
        feats = torch.zeros(n, feature.shape[-1], dtype=feature.dtype, device=dev)  # predicted feature AT each node
        feats[0] = feature[0]
        depth, parents, ranks = spec.depth.to(dev), spec.parents.to(dev), spec.ranks.to(dev)
        for d in range(1, spec.max_depth + 1):
            level = (depth == d).nonzero().flatten()  # [m] nodes of this level
            lp, tok = self._logprobs(feats[parents[level]]).topk(kmax, dim=-1)  # [m, kmax]
            pick = ranks[level][:, None]
            tokens[level] = tok.gather(1, pick)[:, 0]
            logprob[level] = lp.gather(1, pick)[:, 0]
            if d == spec.max_depth:
                break
            # run the head on this level to predict the features its children will read
            lo, hi = int(level[0]), int(level[-1]) + 1  # levels are contiguous in node order
            mask = torch.cat([torch.ones(hi - lo, committed, dtype=torch.bool, device=dev),
                              spec.ancestors[lo:hi, 1:hi].to(dev)], 1)
            self.kv.truncate(committed + lo - 1)
            pos = torch.full((hi - lo,), committed + d - 1, device=dev)
            out = self.head.forward_cached(feats[parents[level]][None], tokens[level][None], pos, self.kv,
                                           mask[None, None], fused=self.fused)[0]
            feats[level] = out
        self.kv.truncate(committed)
        path_lp = logprob.clone()  # [N] accumulate parents' log-probs level by level
        anc = parents.clamp(min=0)
        for _ in range(spec.max_depth - 1):
            path_lp += torch.where(anc > 0, logprob[anc], 0.0)
            anc = parents.clamp(min=0)[anc]
        return DraftTree(tokens=tokens, parents=parents.clone(), depth=depth.clone(), prob=logprob.exp(),
                         path_logprob=path_lp)
