"""Training records (offline feature cache or online tokenised conversations), the train/eval split, and
collation into right-padded micro-batches.

A record is {"id", "input_ids" LongTensor[T], "loss_mask" LongTensor[T]} plus, offline,
"hidden_states" FloatTensor[T, H] (the target's last hidden state after the final norm).
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from data_prep.feature_cache import FeatureCacheReader
from data_prep.tokenized import load_tokenized
from eagle.cli_errors import UserError
from eagle.head_config import head_config_from_target
from eagle.head_files import head_config_of
from recipes import layout

def open_feature_cache(cfg, verify: str) -> FeatureCacheReader:
    """The recipe's feature cache (layout.cache_dir); a missing one is one line naming the command that builds it."""
    cdir = layout.cache_dir(cfg)
    if not cdir.is_dir():
        raise UserError(f"feature cache {cdir} does not exist: {cache_builder(cfg)}")
    return FeatureCacheReader(cdir, verify=verify)


def cache_builder(cfg) -> str:
    """What builds the feature cache of recipe `cfg`: data prep when it has a data source (or the embedded default
    target, whose conversations the demo passes), else train.corpus_cache (raw text, as stories260k)."""
    name = cfg.name or "RECIPE"
    if cfg.train.cache_dir:
        return f"train.cache_dir={cfg.train.cache_dir} names no cache; point it at one, or unset it to use {{output_dir}}"
    if cfg.data.source:
        return f"build it with `python data_prep/main.py --recipe {name}` (plus the same key=value overrides)"
    if not cfg.target.path:  # the demo takes one recipe per head kind: --recipe-eagle2 (= --recipe), --recipe-eagle3
        return (f"`python -m quickstart --head-kind {cfg.head.kind} --recipe-{cfg.head.kind} {name}` builds it (data "
                "prep of the default target's conversations)")
    return (f"this recipe has no data.source: build it from raw text with `python -m train.corpus_cache --recipe {name} "
            f"--text FILE` (see the recipe's header), or set data.source and run `python data_prep/main.py --recipe {name}`")


class TokenizedRecords:
    """Online-mode records: tokenised conversations held in memory (features are computed in the loop)."""

    def __init__(self, path: str | Path, max_length: int):
        self.path = Path(path)
        self._records = []
        for rec in load_tokenized(path):
            ids, mask = rec["input_ids"][:max_length], rec["loss_mask"][:max_length]
            if len(ids) >= 2:  # one token gives no (feature, next token) pair
                self._records.append((rec["id"], ids, mask))
        if not self._records:
            raise ValueError(f"tokenized data {path} holds no record with at least 2 tokens")
        self.ids = [r[0] for r in self._records]
        self.lengths = [len(r[1]) for r in self._records]

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, i: int) -> dict:
        rid, ids, mask = self._records[i]
        return {"id": rid, "input_ids": torch.tensor(ids, dtype=torch.long), "loss_mask": torch.tensor(mask, dtype=torch.long)}


class Subset:
    """A view on some records of a source (FeatureCacheReader or TokenizedRecords), keeping `lengths`."""

    def __init__(self, source, indices: list[int], max_length: int | None = None):
        self.source, self.indices = source, list(indices)
        self.max_length = max_length
        lengths = [source.lengths[i] for i in self.indices]
        self.lengths = [min(n, max_length) for n in lengths] if max_length else lengths

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> dict:
        rec = self.source[self.indices[i]]
        if self.max_length and rec["input_ids"].shape[0] > self.max_length:
            rec = {k: (v[: self.max_length] if torch.is_tensor(v) else v) for k, v in rec.items()}
        return rec


class LongRecordError(ValueError):
    """train.long_records=error and some records are longer than the head's positions."""


def head_positions(cfg, target_config) -> int:
    """max_position_embeddings of the head this run trains: head.init_from's config, else the target's."""
    if cfg.head.init_from:
        return int(head_config_of(cfg.head.init_from).max_position_embeddings)
    return int(head_config_from_target(target_config, bias=cfg.head.bias).max_position_embeddings)


def apply_long_records(policy: str, positions: int, lengths: list[int], indices: list[int],
                       max_length: int) -> tuple[list[int], int]:
    """(indices kept, record length limit) for records longer than the head's `positions` (after data.max_length):
    keep = as they are; truncate = cut to `positions` tokens; drop = leave them out; error = LongRecordError."""
    long = [i for i in indices if min(lengths[i], max_length) > positions]
    if not long or policy == "keep":
        return indices, max_length
    if policy == "truncate":
        return indices, min(max_length, positions)
    if policy == "drop":
        gone = set(long)
        return [i for i in indices if i not in gone], max_length
    raise LongRecordError(
        f"{len(long)} of {len(indices)} records are longer than the head's max_position_embeddings={positions} "
        f"(up to {max(min(lengths[i], max_length) for i in long)} tokens); set train.long_records=keep (train at those "
        f"positions), truncate, or drop, or lower data.max_length")


def split_train_eval(ids: list[str], eval_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """Indices of (train, eval) records. Membership depends only on (seed, record id): adding records to
    the data never moves an existing record to the other side. At least one eval record when fraction > 0."""
    if eval_fraction <= 0 or len(ids) < 2:
        return list(range(len(ids))), []
    keys = [zlib.crc32(f"{seed}:{rid}".encode()) / 2**32 for rid in ids]  # uniform in [0, 1)
    eval_idx = [i for i, k in enumerate(keys) if k < eval_fraction]
    if not eval_idx:
        eval_idx = [min(range(len(ids)), key=keys.__getitem__)]
    chosen = set(eval_idx)
    return [i for i in range(len(ids)) if i not in chosen], eval_idx


@dataclass
class Batch:
    """Right-padded micro-batch."""

    input_ids: torch.Tensor  # [B, T] long
    attention_mask: torch.Tensor  # [B, T] long, 1 = real token
    loss_mask: torch.Tensor  # [B, T] long, 1 = train on the token (0 on padding)
    hidden: torch.Tensor | None  # [B, T, H] float32 (offline) or None (online: computed by the target)

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens."""
        return int(self.attention_mask.sum())

    @property
    def padded_tokens(self) -> int:
        return self.input_ids.numel()

    def to(self, device) -> "Batch":
        move = lambda t: None if t is None else t.to(device, non_blocking=True)  # noqa: E731
        return Batch(move(self.input_ids), move(self.attention_mask), move(self.loss_mask), move(self.hidden))


class MicroBatches(torch.utils.data.Dataset):
    """The micro-batches of one epoch (lists of record indices) as a map-style dataset of collated Batches,
    so a DataLoader can read and collate them ahead in worker processes."""

    def __init__(self, records, batches: list[list[int]]):
        self.records, self.batches = records, batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, i: int) -> "Batch":
        return collate([self.records[j] for j in self.batches[i]])


def micro_batch_loader(records, batches: list[list[int]], num_workers: int, pin_memory: bool):
    """Iterator over collated micro-batches in the given order (workers only read ahead; order is unchanged)."""
    return iter(torch.utils.data.DataLoader(
        MicroBatches(records, batches), batch_size=None, shuffle=False, num_workers=num_workers,
        pin_memory=pin_memory, prefetch_factor=4 if num_workers else None, persistent_workers=False,
        generator=torch.Generator().manual_seed(0)))  # its own seed draw: the global RNG (noise) stays untouched


def collate(records: list[dict]) -> Batch:
    """Right-pad records to the longest one. Padding positions have attention_mask = loss_mask = 0."""
    B, T = len(records), max(r["input_ids"].shape[0] for r in records)
    ids = torch.zeros(B, T, dtype=torch.long)
    attn = torch.zeros(B, T, dtype=torch.long)
    loss = torch.zeros(B, T, dtype=torch.long)
    hidden = None
    if "hidden_states" in records[0]:
        hidden = torch.zeros(B, T, records[0]["hidden_states"].shape[-1], dtype=torch.float32)
    for b, r in enumerate(records):
        n = r["input_ids"].shape[0]
        ids[b, :n] = r["input_ids"]
        attn[b, :n] = 1
        loss[b, :n] = r["loss_mask"]
        if hidden is not None:
            hidden[b, :n] = r["hidden_states"]
    return Batch(ids, attn, loss, hidden)
