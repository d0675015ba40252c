"""Sequence parallelism (`train.sequence_parallel_size` = n): one record split across n ranks, DeepSpeed's Ulysses.

The n ranks of a group train the SAME micro-batch (one record, `train.micro_batch_size` 1): rank r holds the
record's positions [r T/n, (r+1) T/n) only (its features, its noise, its token loss rows; the record is padded at
its end to a multiple of n x the row stride with positions that carry no loss and, being after every real position,
are never seen by a causal query). Every attention of the head's unroll (step 1 and each training-time-test step)
goes through DeepSpeed's `UlyssesSPAttentionHF` (deepspeed/runtime/sequence_parallel/ulysses_sp.py): an all-to-all
(`deepspeed.sequence.layer._dim_zero_all_to_all`, torch's `all_to_all_single`, which gloo runs on CPU) trades the
span's rows of all heads for the whole record's rows of h/n query heads (kv heads replicated when kv < n), the
attention runs there (causal or windowed, the same function as on one rank), and a second all-to-all hands each rank
its span's rows back. The all-to-alls are differentiable: the backward sends each key's gradient to the rank that
owns it.

The loss: each step's mean over the RECORD's loss positions, so each rank's share is its rows' sum over the record's
count (one all-reduce of the counts); `total` sums the shares with a differentiable all-reduce, so every rank of the
group backpropagates the record's loss (the 1-rank value) and each share receives gradient n; DeepSpeed then averages
the gradients over all ranks, which turns the n shares' gradients into their sum: the 1-rank gradient (and with
several groups, their data-parallel mean).
"""
from __future__ import annotations

import importlib

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn

from recipes import RecipeError
from train.distributed import import_deepspeed

ULYSSES_MODULE = "deepspeed.runtime.sequence_parallel.ulysses_sp"  # loaded after `import_deepspeed` (its rule)


def sequence_parallel_problem(t, part, world_size: int, heads: int, kv_heads: int) -> str | None:
    """Why `train.sequence_parallel_size` cannot run here (one line), or None. t: the train section; part: the
    head kind's trainer (train/head_kinds.py: its `sequence_parallel` says whether it splits records)."""
    n, key = t.sequence_parallel_size, f"train.sequence_parallel_size={t.sequence_parallel_size}"
    if n == 1:
        return None
    if not part.sequence_parallel:
        return f"{key}: head.kind={part.kind.name} trains whole records only (EAGLE-3 and P-EAGLE split them)"
    if world_size % n:
        return f"{key} does not divide the run's {world_size} ranks"
    if heads % n or (kv_heads % n and n % kv_heads):
        return (f"{key} does not split the head's {heads} attention / {kv_heads} kv heads (DeepSpeed Ulysses needs "
                "attention heads divisible by it, kv heads divisible by it or dividing it)")
    if t.mode == "stream":
        return f"{key} needs train.mode offline or online (the stream serves each rank its own records)"
    if part.weighting is not None:
        return f"{key} does not run loss.position_weighting=dpace (its chain weights are record-wide statistics)"
    return None


def check_sequence_parallel(t, part, world_size: int, heads: int, kv_heads: int) -> None:
    """RecipeError (one line) when `sequence_parallel_problem` finds one."""
    problem = sequence_parallel_problem(t, part, world_size, heads, kv_heads)
    if problem:
        raise RecipeError(problem)


def sequence_groups(size: int, world_size: int, rank: int):
    """The process group of `rank`'s sequence-parallel group (consecutive ranks [g n, (g+1) n)); every rank
    creates every group (torch requires it), in the same order."""
    mine = None
    for g in range(world_size // size):
        ranks = list(range(g * size, (g + 1) * size))
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


class UlyssesShards:
    """This rank's span of the record and the collectives of its sequence-parallel `group` (module docstring)."""

    def __init__(self, group, n_heads: int, n_kv: int, head_dim: int):
        deepspeed = import_deepspeed()
        if not deepspeed.comm.is_initialized():  # DeepSpeed's collectives (the all-to-all) run on its comm backend
            deepspeed.comm.init_distributed(dist_backend=dist.get_backend(group), auto_mpi_discovery=False)
        self.group = group
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        ulysses_sp = importlib.import_module(ULYSSES_MODULE)
        self.ulysses = ulysses_sp.UlyssesSPAttentionHF(attn=self._core, batch_size=1, attn_head_count=n_heads,
                                            attn_head_size=head_dim, kv_head_count=n_kv, num_hidden_layers=1,
                                            process_group=group, seq_length_is_variable=True)
        self.core, self.keep, self.keys = None, False, None

    # -- the span ----------------------------------------------------------------------
    def span(self, T: int) -> tuple[int, int]:
        """[lo, hi): this rank's indices of a record of T positions (T a multiple of the group size)."""
        if T % self.size:
            raise ValueError(f"a record of {T} positions does not split over {self.size} sequence-parallel ranks")
        n = T // self.size
        return self.rank * n, (self.rank + 1) * n

    def positions(self, T: int, device) -> torch.Tensor:
        """[1, T] the positions of this rank's span of T indices in the record."""
        return torch.arange(self.rank * T, (self.rank + 1) * T, device=device)[None]

    def all_positions(self, T: int, device) -> torch.Tensor:
        """[1, T x size] the whole record's positions."""
        return torch.arange(T * self.size, device=device)[None]

    def all_rows(self, idx: torch.Tensor, T: int) -> torch.Tensor:
        """The whole record's row indices [R x size] from this span's idx [R] (every span has the same rows)."""
        return torch.cat([idx + r * T for r in range(self.size)])

    # -- collectives --------------------------------------------------------------------
    def attend(self, module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, core, keep: bool = False
               ) -> torch.Tensor:
        """q [1, h, R, D], k, v [1, kv, R, D] of this span's rows -> the attention output of those rows [1, R, h D]:
        DeepSpeed Ulysses gathers the whole record's rows of this rank's heads, core(q, k, v, positions) [1, h/n, R
        x n, D] runs there, and the output goes back to the rows' ranks. keep: remember the gathered k, v (`keys`,
        step 1's, which the training-time-test steps attend to)."""
        self.core, self.keep = core, keep
        R = q.shape[2]
        out, _ = self.ulysses(module, q, k, v, None,
                              position_ids=torch.arange(self.rank * R, (self.rank + 1) * R, device=q.device)[None])
        return out

    def _core(self, module, q, k, v, attention_mask, *args, position_ids=None, **kwargs):
        """UlyssesSPAttentionHF's attention callable: gathered [1, h/n, R n, D] -> ([1, R n, h/n, D], None)."""
        if self.keep:
            self.keys = (k, v)
        return self.core(q, k, v, position_ids).transpose(1, 2), None

    def lookahead(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """x [B, T, ...] of this span -> [B, T + n, ...]: followed by the next span's first n rows (zeros after the
        last span), as the 1-rank unroll's zero padding continues the record. No gradient (token ids, targets)."""
        if n == 0:
            return x
        if n > x.shape[1]:
            raise ValueError(f"{n} look-ahead rows are more than the span's {x.shape[1]}: fewer sequence-parallel "
                             "ranks or a longer record")
        head = x[:, :n].contiguous()
        parts = [torch.empty_like(head) for _ in range(self.size)]
        dist.all_gather(parts, head, group=self.group)
        nxt = parts[self.rank + 1] if self.rank + 1 < self.size else torch.zeros_like(head)
        return torch.cat([x, nxt], dim=1)

    def total(self, share: torch.Tensor) -> torch.Tensor:
        """The sum of the group's shares (differentiable: each share's gradient is the sum of the group's)."""
        return dist_nn.all_reduce(share, group=self.group)

    def counts(self, values: list[int]) -> list[int]:
        """Integers summed over the group (loss positions, hits)."""
        t = torch.tensor(values, dtype=torch.long)
        dist.all_reduce(t, group=self.group)
        return [int(x) for x in t.tolist()]
