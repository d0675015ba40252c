"""Block drafting (DFlash heads, eagle/dflash_head.py): a round's draft positions from ONE block forward.

`BlockDrafter.extend` appends the committed positions' fused target states to the head's context cache and keeps the
last verified token (the root); the drafting call runs one block, [root, mask x (block_size - 1)], over the whole
context. Block row i is the distribution q_i of draft position i, which does not depend on the drafted tokens before
it, so every draft shape of `ParallelDrafter` applies unchanged (eagle/parallel_draft.py): chains and static trees
(node at depth d, rank r = the r-th best token of q_d), EAGLE-2's dynamic tree over q_1 .. q_depth with raw or
calibrated scores, and sampled chains. Verification is the target's, unchanged: greedy decoding stays lossless and
sampling exact. Cost per round: one draft forward of block_size rows, whatever the tree (`forwards` counts them).
A draft deeper than block_size - 1 has no distribution and is refused.
"""
from __future__ import annotations

import torch

from eagle.draft import Drafter
from eagle.parallel_draft import ParallelDrafter


class BlockDrafter(ParallelDrafter):
    """A drafter whose rounds take one block forward (module docstring). The head must be a `DFlashHead`."""

    def __init__(self, head, lm_head: torch.nn.Module, capacity: int):
        super().__init__(head, lm_head, capacity)
        self._root: torch.Tensor | None = None

    def reset(self, capacity: int) -> None:
        Drafter.reset(self, capacity)
        self._root = None

    @property
    def length(self) -> int:
        return self.decoder.length

    @torch.no_grad()
    def extend(self, features: torch.Tensor, next_ids: torch.Tensor) -> None:
        """Commit n positions ([1, n, K H] target layers' states, [1, n] the tokens after them): their context rows
        enter the cache; the last token is the next block's root. Returns None (no separate root prediction)."""
        self.decoder.commit(features[0])
        self._root = next_ids[0, -1]

    @torch.no_grad()
    def outputs(self, depth: int) -> torch.Tensor:
        """The block's outputs [depth, H] for draft positions 1..depth (one forward)."""
        if self._root is None:
            raise RuntimeError("BlockDrafter: extend() the committed positions before drafting")
        limit = self.head.block_size - 1
        if depth > limit:
            raise ValueError(f"a draft of depth {depth} needs {depth} block positions; this DFlash head drafts "
                             f"head.block_size - 1 = {limit}: set the chain length / tree depth <= {limit}")
        out = self.decoder.block(self._root)
        self._root = None
        self.forwards += 1
        return out[1:depth + 1]
