"""Run the frozen target once per tokenised sample and cache its hidden states.

EAGLE-2: the input of the LM head, the decoder's ``last_hidden_state`` (after the final norm), i.e.
``model.model(input_ids).last_hidden_state`` for Llama. EAGLE-3 (`head.kind: eagle3`): the three
`head.aux_layers` states + that final state, concatenated (data_prep/feature_layers.py).
"""
from __future__ import annotations

import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from data_prep.feature_cache import FeatureCacheWriter, bytes_per_token
from data_prep.feature_layers import target_features
from data_prep.target import base_decoder
from eagle.cli_errors import UserError


class DiskSpaceError(UserError, RuntimeError):
    """Not enough free disk for the feature cache."""


def free_bytes(path: Path) -> int:
    path = Path(path)
    while not path.exists():  # the cache dir may not exist yet: ask its nearest existing parent
        path = path.parent
    return shutil.disk_usage(path).free


def check_disk(out_dir: Path, num_tokens: int, hidden_size: int, dtype: str, headroom_gb: float,
               layers: list[int] | None = None) -> dict:
    """Print the estimated cache size (bytes/token first); raise DiskSpaceError if it (plus headroom) does not fit.
    `layers`: the hidden-state ids cached per token (EAGLE-3: 3 aux + final), None = the final state only."""
    segments = 1 if layers is None else len(layers)
    per_token = bytes_per_token(hidden_size, dtype, segments)
    needed = num_tokens * per_token
    free = free_bytes(out_dir)
    gb = 1024**3
    what = f"{hidden_size} hidden" if layers is None else f"{segments} x {hidden_size} hidden: layers {layers}"
    line = (f"[cache] {per_token} B/token ({what} x {dtype}); estimated disk use: {num_tokens:,} tokens x {per_token} "
            f"B/token = {needed / gb:.3f} GiB; free at {out_dir}: {free / gb:.1f} GiB")
    print(line, flush=True)
    if needed + headroom_gb * gb > free:
        raise DiskSpaceError(
            f"not enough disk for the feature cache at {out_dir}: needs {needed / gb:.2f} GiB + {headroom_gb} GiB "
            f"headroom, only {free / gb:.2f} GiB free. Free space, set data.cache_dtype=int8 "
            f"({bytes_per_token(hidden_size, 'int8', segments)} B/token), or point output_dir at a bigger disk."
        )
    return {"estimated_bytes": needed, "bytes_per_token": per_token, "free_bytes": free}


@dataclass
class CacheStats:
    records_total: int = 0
    records_skipped_done: int = 0
    records_cached: int = 0
    tokens_cached: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["records_per_s"] = self.records_cached / self.seconds if self.seconds else 0.0
        d["tokens_per_s"] = self.tokens_cached / self.seconds if self.seconds else 0.0
        return d


@torch.inference_mode()
def final_hidden_states(model, input_ids: list[int], layers: list[int] | None = None) -> torch.Tensor:
    """[T, W] features of one sample (W = H, or len(layers) * H): one forward of the decoder (no lm_head, no KV cache)."""
    device = next(model.parameters()).device
    ids = torch.tensor([input_ids], dtype=torch.long, device=device)  # [1, T]
    return target_features(base_decoder(model), ids, None, layers)[0]  # [T, W]


def cache_shard(model, records: list[dict], writer: FeatureCacheWriter, shard: int, num_shards: int,
                progress: bool = True, layers: list[int] | None = None) -> CacheStats:
    """Cache this shard's records (index % num_shards == shard), skipping ids the cache already holds."""
    mine = [r for i, r in enumerate(records) if i % num_shards == shard]
    stats = CacheStats(records_total=len(mine))
    todo = [r for r in mine if r["id"] not in writer]
    stats.records_skipped_done = len(mine) - len(todo)
    start = time.perf_counter()
    for rec in tqdm(todo, desc=f"cache {shard}/{num_shards}", disable=not progress, unit="sample"):
        hidden = final_hidden_states(model, rec["input_ids"], layers)
        writer.add(rec["id"], torch.tensor(rec["input_ids"]), hidden, torch.tensor(rec["loss_mask"]))
        stats.records_cached += 1
        stats.tokens_cached += len(rec["input_ids"])
    writer.flush()
    stats.seconds = time.perf_counter() - start
    return stats
