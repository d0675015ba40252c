"""The EAGLE-3 draft vocabulary: the N most frequent target tokens among the training data's loss tokens.

The head's lm_head predicts only these N tokens; `d2t` [N] maps a draft id to its target id (target id = draft
id + d2t[draft id]) and `t2d` [V] marks the target ids in the draft vocabulary (the released / SpecForge layout).
Draft ids are ordered by target id (d2t is then non-decreasing, as in SpecForge's mapping).

Fewer than N distinct tokens in the data (stories260K's own continuations use ~209 of its 512): the vocabulary is
FILLED up to N with the lowest target ids not yet chosen (SpecForge does the same), so the head always has the
recipe's `head.draft_vocab_size` and loads in engines that expect that size. The filled slots never occur as
targets: the soft loss drives their logits down, and drafting them is harmless (the target verifies every token).
Ties in count are broken by the lower target id, so the vocabulary is a pure function of the data.
"""
from __future__ import annotations

import torch


def count_loss_tokens(source, indices: list[int], vocab_size: int, max_length: int | None = None) -> torch.Tensor:
    """Counts [V] int64 of the tokens with loss_mask = 1 over the records `indices` of a FeatureCacheReader
    (read without features) or TokenizedRecords (records truncated to max_length, as the trainer sees them)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for i in indices:
        ids, mask = source.tokens(i) if hasattr(source, "tokens") else _ids_and_mask(source[i])
        if max_length:
            ids, mask = ids[:max_length], mask[:max_length]
        if ids.numel() and int(ids.max()) >= vocab_size:
            raise ValueError(f"record {i} holds token id {int(ids.max())} >= the target vocabulary ({vocab_size})")
        counts += torch.bincount(ids[mask.bool()], minlength=vocab_size)
    return counts


def _ids_and_mask(record: dict) -> tuple[torch.Tensor, torch.Tensor]:
    return record["input_ids"], record["loss_mask"]


def build_draft_vocab(counts: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t [size] int64, t2d [V] bool) of the `size` most frequent ids in `counts` [V] (filled by lowest id, see
    module docstring). size = V gives the identity vocabulary (d2t all 0)."""
    V = counts.numel()
    if not 1 <= size <= V:
        raise ValueError(f"draft vocabulary size {size}: expected 1 <= size <= the target vocabulary ({V})")
    # sort by (-count, id): stable sort on -count keeps ids ascending among equal counts (and among the zeros)
    order = torch.sort(-counts.long(), stable=True).indices  # [V]
    chosen = order[:size].sort().values  # [size] target ids, ascending
    d2t = chosen - torch.arange(size)  # [size]
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[chosen] = True
    return d2t, t2d


def vocab_coverage(counts: torch.Tensor, t2d: torch.Tensor) -> float:
    """Share of the counted loss tokens that are in the draft vocabulary (1.0 = every target token draftable)."""
    total = int(counts.sum())
    return float(counts[t2d].sum()) / total if total else 1.0
