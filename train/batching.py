"""Which records form each micro-batch, per epoch and rank: deterministic from (seed, epoch) and the global batch,
so a resumed run replays exactly the same order and can continue from any position, on any number of ranks.

The order is GLOBAL: an epoch is one list of micro-batches (`global_epoch`), cut into optimizer steps of
G = world_size x grad_accum consecutive micro-batches; within a step, accumulation micro-step a of rank r takes
micro-batch a * world_size + r. The order depends on G (the global batch), never on how G splits into ranks and
accumulation steps: 2 ranks x grad_accum 1 and 1 rank x grad_accum 2 train on the same micro-batches at every
step. A data position is therefore a count of global micro-batches (`consumed`), valid for any world size.

grouped: shuffle, cut into buckets of `group_size` optimizer steps, sort each bucket by length, slice it into
         micro-batches, shuffle the step order. Sequences in a micro-batch have similar lengths, so little compute
         is spent on padding; the micro-batches of one step (all ranks, all accumulation micro-steps) are
         neighbours in the sorted order, so no rank waits long for a rank holding much longer sequences.
padded:  the naive baseline: shuffle and slice; every micro-batch is padded to its longest sequence.

Each epoch drops the < G micro-batches that cannot fill a last optimizer step.
"""
from __future__ import annotations

import random


class MicroBatchPlan:
    """Micro-batches (lists of record indices) for this rank, epoch by epoch."""

    def __init__(self, lengths: list[int], micro_batch_size: int, seed: int, strategy: str = "grouped",
                 group_size: int = 32, world_size: int = 1, rank: int = 0, grad_accum: int = 1):
        if strategy not in ("grouped", "padded"):
            raise ValueError(f"batching strategy {strategy!r}: expected 'grouped' or 'padded'")
        self.lengths = list(lengths)
        self.micro_batch_size, self.seed, self.strategy = micro_batch_size, seed, strategy
        self.group_size, self.world_size, self.rank, self.grad_accum = group_size, world_size, rank, grad_accum
        self.step_size = world_size * grad_accum  # G: micro-batches per optimizer step, over all ranks
        self.global_per_epoch = len(self.global_epoch(0))
        self.per_epoch = self.global_per_epoch // world_size  # this rank's micro-batches per epoch
        if self.per_epoch == 0:
            raise ValueError(
                f"{len(self.lengths)} training records cannot fill one micro-batch on each of {world_size} ranks "
                f"x {grad_accum} accumulation steps (micro_batch_size={micro_batch_size}); add data or lower "
                "train.micro_batch_size"
            )

    def global_epoch(self, epoch: int, step_size: int | None = None) -> list[list[int]]:
        """Every rank's micro-batches of `epoch` in global order (optimizer steps of `step_size` micro-batches, this
        plan's G by default); a multiple of the step size long."""
        G = step_size or self.step_size
        rng = random.Random(f"{self.seed}:{epoch}")
        order = list(range(len(self.lengths)))
        rng.shuffle(order)
        B = self.micro_batch_size
        if self.strategy == "grouped":
            batches = []
            span = B * G * self.group_size
            for start in range(0, len(order), span):
                bucket = sorted(order[start : start + span], key=self.lengths.__getitem__, reverse=True)
                batches += [bucket[j : j + B] for j in range(0, len(bucket), B)]
        else:
            batches = [order[j : j + B] for j in range(0, len(order), B)]
        steps = [batches[k : k + G] for k in range(0, len(batches) - G + 1, G)]  # one optimizer step each
        if self.strategy == "grouped":
            rng.shuffle(steps)  # sorted buckets would otherwise run long-to-short
        return [b for step in steps for b in step]

    def segment(self, epoch: int, start: int = 0, order_step_size: int | None = None) -> list[tuple[int, list[int]]]:
        """This rank's (global position, micro-batch) pairs, in training order, for the rest of `epoch` from global
        position `start`. `order_step_size`: the G the epoch's order was made for (a run resumed inside an epoch
        with another global batch finishes that epoch's order, cut into its own steps, then uses its own)."""
        batches = self.global_epoch(epoch, order_step_size)
        G, W = self.step_size, self.world_size
        out = []
        for s in range(start, len(batches) - G + 1, G):
            for a in range(self.grad_accum):
                p = s + a * W + self.rank
                out.append((p, batches[p]))
        return out

    def epoch(self, epoch: int) -> list[list[int]]:
        """This rank's micro-batches of a whole `epoch`, in training order."""
        return [b for _, b in self.segment(epoch)]

    def consumed(self, start: int, done: int) -> int:
        """Global micro-batches of the epoch consumed once this rank has trained `done` micro-batches of a segment
        that began at global position `start` (every rank trains in step: the same `done`)."""
        whole, part = divmod(done, self.grad_accum)
        return start + whole * self.step_size + part * self.world_size

    def padding_fraction(self, epoch: int = 0) -> float:
        """Share of the padded micro-batch cells that are padding (0 = none), over this rank's epoch."""
        real = padded = 0
        for b in self.epoch(epoch):
            lens = [self.lengths[i] for i in b]
            real += sum(lens)
            padded += max(lens) * len(lens)
        return 1.0 - real / max(padded, 1)
