"""Which records form each micro-batch, per epoch and rank: deterministic from (seed, epoch), so a
resumed run replays exactly the same order and can skip to any micro-step.

grouped: shuffle, cut into buckets of `group_size` micro-batches per rank, sort each bucket by length,
         slice it into micro-batches, shuffle the micro-batch order. Sequences in a micro-batch have
         similar lengths, so little compute is spent on padding.
padded:  the naive baseline: shuffle and slice; every micro-batch is padded to its longest sequence.

Ranks step together: the micro-batches of one step (one per rank) are neighbours in the sorted order,
so no rank waits long for a rank holding much longer sequences. Each epoch drops the < world_size
micro-batches that cannot be spread over all ranks.
"""
from __future__ import annotations

import random


class MicroBatchPlan:
    """Micro-batches (lists of record indices) for this rank, epoch by epoch."""

    def __init__(self, lengths: list[int], micro_batch_size: int, seed: int, strategy: str = "grouped",
                 group_size: int = 32, world_size: int = 1, rank: int = 0):
        if strategy not in ("grouped", "padded"):
            raise ValueError(f"batching strategy {strategy!r}: expected 'grouped' or 'padded'")
        self.lengths = list(lengths)
        self.micro_batch_size, self.seed, self.strategy = micro_batch_size, seed, strategy
        self.group_size, self.world_size, self.rank = group_size, world_size, rank
        self.per_epoch = len(self.epoch(0))
        if self.per_epoch == 0:
            raise ValueError(
                f"{len(self.lengths)} training records cannot fill one micro-batch on each of {world_size} ranks "
                f"(micro_batch_size={micro_batch_size}); add data or lower train.micro_batch_size"
            )

    def epoch(self, epoch: int) -> list[list[int]]:
        """This rank's micro-batches of `epoch`, in training order."""
        rng = random.Random(f"{self.seed}:{epoch}")
        order = list(range(len(self.lengths)))
        rng.shuffle(order)
        B, W = self.micro_batch_size, self.world_size
        if self.strategy == "grouped":
            batches = []
            span = B * W * self.group_size
            for start in range(0, len(order), span):
                bucket = sorted(order[start : start + span], key=self.lengths.__getitem__, reverse=True)
                batches += [bucket[j : j + B] for j in range(0, len(bucket), B)]
        else:
            batches = [order[j : j + B] for j in range(0, len(order), B)]
        steps = [batches[k : k + W] for k in range(0, len(batches) - W + 1, W)]  # one micro-batch per rank
        if self.strategy == "grouped":
            rng.shuffle(steps)  # sorted buckets would otherwise run long-to-short
        return [step[self.rank] for step in steps]

    def position(self, micro_step: int) -> tuple[int, int]:
        """(epoch, index within the epoch) of a global micro-step."""
        return divmod(micro_step, self.per_epoch)

    def padding_fraction(self, epoch: int = 0) -> float:
        """Share of the padded micro-batch cells that are padding (0 = none), over this rank's epoch."""
        real = padded = 0
        for b in self.epoch(epoch):
            lens = [self.lengths[i] for i in b]
            real += sum(lens)
            padded += max(lens) * len(lens)
        return 1.0 - real / max(padded, 1)
