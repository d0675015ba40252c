"""Drafting: run the head on committed positions, then grow a draft tree from its own guesses.

`Drafter` owns the head's decoder (`head.decoder(...)`: its decoding forward and preallocated KV cache). Committed
positions stay in the cache across rounds; tree nodes are appended while drafting and rolled back
afterwards (`truncate`).

Head kinds differ in two places only, both answered by the decoder their head builds: what a committed position
feeds the head (`decoder.fuse`: EAGLE-2 the target's final state as it is, EAGLE-3 fc over its aux states) and how
drafts are scored (`decoder.topk`: EAGLE-2 through the target's lm_head, EAGLE-3 through its own over the draft
vocabulary, mapped to target ids). Tree building is shared.
"""
from __future__ import annotations

import torch

from eagle.head_decoder import HeadDecoder
from eagle.head_module import HeadModule
from eagle.score_calibration import ScoreCalibration
from eagle.tree import DraftTree, StaticTreeSpec, rerank_tree, sampled_chain


class Drafter:
    def __init__(self, head: HeadModule, lm_head: torch.nn.Module, capacity: int):
        """lm_head: the target's (EAGLE-2 drafts are scored through it; an EAGLE-3 head has its own)."""
        self.head = head
        self.lm_head = lm_head
        self.decoder: HeadDecoder | None = None  # built by the first reset, under the caller's grad mode
        self._layouts: dict[tuple, object] = {}  # per (k, depth, device): constant candidate layouts

    @property
    def length(self) -> int:
        return self.decoder.length

    def reset(self, capacity: int) -> None:
        """Empty the draft cache (at least `capacity` positions) and re-take the head's and lm_head's weights
        (they may have changed between generations)."""
        if self.decoder is None:
            self.decoder = self.head.decoder(capacity, lm_head=self.lm_head)
        else:
            self.decoder.reset(capacity)

    def _topk(self, features: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """[n, H] -> (log-probs [n, k], target token ids [n, k]) of the k best draft tokens."""
        return self.decoder.topk(features, k)

    @torch.no_grad()
    def extend(self, features: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """Commit n positions (what the target hands the drafter [1, n, W]: its final states, or an EAGLE-3 head's
        aux states; the tokens that follow them [1, n]). Returns the head's output after the last one, [1, H]: it
        scores the root's children."""
        pos = range(self.decoder.length, self.decoder.length + next_ids.shape[1])
        out = self.decoder.forward(self.decoder.fuse(features[0]), next_ids[0], pos)
        return out[-1:]  # [1, H]

    @torch.no_grad()
    def draft_dynamic(self, root: torch.Tensor, feature: torch.Tensor, total_token: int, depth: int,
                      top_k: int, calibration: ScoreCalibration | None = None) -> DraftTree:
        """EAGLE-2 dynamic tree. root [1] token, feature [1, H] predicted feature at the root.

        calibration: rank paths by calibrated acceptance (eagle/score_calibration.py) instead of the draft's raw
        probabilities; only the choice of nodes changes (siblings stay in the draft's rank order)."""
        committed = self.decoder.length
        dev = root.device
        k = top_k
        score = (lambda lp, d: lp) if calibration is None else calibration.log_score  # noqa: E731
        lp, tok = (t[0] for t in self._topk(feature, k))  # [k], [k] depth-1 candidates
        front_score = score(lp, 1)  # [k] log calibrated acceptance (= lp uncalibrated)
        cand_tok, cand_lp, cand_path, cand_score, bests = [tok], [lp], [lp], [front_score], []
        front_feat = feature.expand(k, -1)  # [k, H] input feature of each frontier node (its parent's prediction)
        front_tok, front_path = tok, lp  # [k] each
        # [k, committed + depth k] attention rows of the frontier: the whole committed prefix, then the tree
        # nodes already in the draft KV cache that are its ancestors or itself (columns of later levels blocked)
        # (additive float: sdpa would convert a bool mask at every level)
        blocked = torch.finfo(feature.dtype).min
        mask = torch.full((k, committed + depth * k), blocked, dtype=feature.dtype, device=dev)
        mask[:, :committed] = 0.0
        eye = torch.full((k, k), blocked, dtype=feature.dtype, device=dev).fill_diagonal_(0.0)
        for d in range(depth):
            end = committed + (d + 1) * k
            mask[:, end - k : end] = eye  # each frontier node sees itself
            out = self.decoder.forward(front_feat, front_tok, committed + d, mask.narrow(1, 0, end))  # [k, H]; one position per level
            lp, tok = self._topk(out, k)  # [k, k]
            path = (front_path.unsqueeze(1) + lp).flatten()  # [k k] value = log of the product of confidences
            ranked = path if calibration is None else (front_score.unsqueeze(1) + score(lp, d + 2)).flatten()  # [k k]
            lp, tok = lp.flatten(), tok.flatten()  # [k k]: children of frontier row r at r k .. r k + k - 1
            cand_tok.append(tok)
            cand_lp.append(lp)
            cand_path.append(path)
            cand_score.append(ranked)
            if d == depth - 1:
                break  # the last level's children are candidates only, never expanded
            if calibration is None:
                front_path, best = path.topk(k)  # [k] new frontier among the k k children
                front_score = front_path
            else:
                front_score, best = ranked.topk(k)
                front_path = path.index_select(0, best)
            bests.append(best)
            parent_row = best // k
            front_feat, front_tok = out.index_select(0, parent_row), tok.index_select(0, best)
            mask = mask.index_select(0, parent_row)  # a child sees what its parent saw (the prefix: every row)
        self.decoder.truncate(committed)
        return rerank_tree(root, torch.cat(cand_tok), torch.cat(cand_lp), torch.cat(cand_path),
                           self._candidate_parents(bests, k, depth, dev), self._candidate_depth(k, depth, dev),
                           total_token, cand_score=None if calibration is None else torch.cat(cand_score),
                           cand_rank=self._candidate_rank(k, depth, dev))

    def _candidate_parents(self, bests: list[torch.Tensor], k: int, depth: int, device) -> torch.Tensor:
        """[k + depth k^2] parent candidate id of every candidate: -1 (the root) for level 1, then each
        frontier node k times. The frontier of level 0 is candidates 0..k-1; that of level d >= 1 is
        bests[d - 1] (indices among the k^2 candidates of level d, which start at id k + (d - 1) k^2)."""
        key = ("parents", k, depth, str(device))
        if key not in self._layouts:
            level_start = torch.tensor([0] + [k + d * k * k for d in range(depth - 1)], device=device)[:, None]  # [depth, 1]
            self._layouts[key] = (torch.full((k,), -1, device=device), torch.arange(k, device=device), level_start)
        root_parents, level0, level_start = self._layouts[key]
        fronts = torch.stack([level0] + bests) + level_start  # [depth, k] candidate ids of each level's frontier
        return torch.cat([root_parents, fronts[:, :, None].expand(depth, k, k).flatten()])

    def _candidate_rank(self, k: int, depth: int, device) -> torch.Tensor:
        """[k + depth k^2] rank of every candidate among its parent's top-k: every level lists k children per
        parent in rank order, starting at a multiple of k, so the rank is the candidate id mod k."""
        key = ("rank", k, depth, str(device))
        if key not in self._layouts:
            self._layouts[key] = torch.arange(k + depth * k * k, device=device) % k
        return self._layouts[key]

    def _candidate_depth(self, k: int, depth: int, device) -> torch.Tensor:
        """[k + depth k^2] tree depth of every candidate `draft_dynamic` generates (fixed by k and depth)."""
        key = ("depth", k, depth, str(device))
        if key not in self._layouts:
            sizes = torch.tensor([k] + [k * k] * depth, device=device)
            self._layouts[key] = torch.arange(1, depth + 2, device=device).repeat_interleave(sizes)
        return self._layouts[key]

    @torch.no_grad()
    def draft_chain_sampled(self, root: torch.Tensor, feature: torch.Tensor, length: int, temperature: float,
                            generator: torch.Generator | None = None) -> DraftTree:
        """A chain of `length` tokens, each SAMPLED from the head's distribution q at `temperature` given the chain so
        far (probabilistic drafting); the tree keeps every q ([N, V], row 0 unused) for `verify_chain_sampling`.
        root [1] token, feature [1, H] the head's prediction at the root."""
        committed = self.decoder.length
        dev = root.device
        tokens = torch.empty(length + 1, dtype=torch.long, device=dev)  # [N] root, then the chain
        tokens[0] = root[0]
        q_rows = []
        for d in range(1, length + 1):
            q = self.decoder.probs(feature, temperature)  # [1, V] (temperature only, as vLLM's probabilistic drafting)
            tokens[d : d + 1] = torch.multinomial(q, 1, generator=generator)[0]
            q_rows.append(q[0])
            if d < length:  # the head's prediction after this token (position of node d, like draft_static)
                feature = self.decoder.forward(feature, tokens[d : d + 1], committed + d - 1)
        self.decoder.truncate(committed)
        return sampled_chain(tokens, torch.stack(q_rows))

    @torch.no_grad()
    def draft_static(self, root: torch.Tensor, feature: torch.Tensor, spec: StaticTreeSpec) -> DraftTree:
        """EAGLE-1 static tree (a chain is the tree [0], [0, 0], ...)."""
        committed = self.decoder.length
        dev = root.device
        n = spec.size
        kmax = spec.max_rank + 1
        tokens = torch.zeros(n, dtype=torch.long, device=dev)
        tokens[0] = root[0]
        logprob = torch.zeros(n, device=dev)
        feats = torch.zeros(n, feature.shape[-1], dtype=feature.dtype, device=dev)  # predicted feature AT each node
        feats[0] = feature[0]
        depth, parents, ranks = spec.depth.to(dev), spec.parents.to(dev), spec.ranks.to(dev)
        ancestors = spec.ancestors.to(dev)
        for d, (lo, hi) in enumerate(spec.levels, start=1):  # Python bounds: no host sync per level
            lp, tok = self._topk(feats[parents[lo:hi]], kmax)  # [m, kmax]
            pick = ranks[lo:hi, None]
            tokens[lo:hi] = tok.gather(1, pick)[:, 0]
            logprob[lo:hi] = lp.gather(1, pick)[:, 0]
            if d == spec.max_depth:
                break
            # run the head on this level to predict the features its children will read
            mask = torch.cat([torch.ones(hi - lo, committed, dtype=torch.bool, device=dev), ancestors[lo:hi, 1:hi]], 1)
            self.decoder.truncate(committed + lo - 1)
            feats[lo:hi] = self.decoder.forward(feats[parents[lo:hi]], tokens[lo:hi], committed + d - 1, mask)
        self.decoder.truncate(committed)
        path_lp = logprob.clone()  # [N] accumulate parents' log-probs level by level
        anc = parents.clamp(min=0)
        for _ in range(spec.max_depth - 1):
            path_lp += torch.where(anc > 0, logprob[anc], 0.0)
            anc = parents.clamp(min=0)[anc]
        return DraftTree(tokens=tokens, parents=parents.clone(), depth=depth.clone(), prob=logprob.exp(),
                         path_logprob=path_lp, ancestors=ancestors, rank=ranks)  # the fixed shape's mask, built once per spec
