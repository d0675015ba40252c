"""One feature shard on disk: many records concatenated along tokens, the one format the offline feature cache
(data_prep/feature_cache.py) and the streamed window (train/stream.py) both write and read.

A shard is a safetensors file with ``hidden`` [N, W] (the cache dtype; int8 adds ``scales``), ``input_ids`` [N]
int32, ``loss_mask`` [N] uint8 and ``offsets`` [R+1] int64 (record r owns rows offsets[r]:offsets[r+1]); its
metadata names the format, the dtype and the record ids. It is written to ``NAME.tmp``, fsynced and renamed into
place (os.replace), so a reader never sees half a shard; a write that fails (a full disk) leaves no file behind.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FORMAT_NAME = "eagle2-feature-cache"
RECORD_HEADER_BYTES = 256  # a shard's safetensors header per record, an allowance beside its tensors' bytes: 3-4
#   tensor entries of ~30 bytes plus the record id each (ids up to ~40 characters); stream mode's window sizes shards with it


def quantize_int8(hidden: torch.Tensor, segments: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per row and segment (layers differ in scale): hidden [T, S*H] float -> (q [T, S*H] int8,
    scales [T] fp16 when S = 1 else [T, S])."""
    T = hidden.shape[0]
    x = hidden.float().reshape(T, segments, -1)  # [T, S, H]
    scales = (x.abs().amax(dim=-1) / 127.0).clamp(min=1e-8).to(torch.float16)  # [T, S]
    q = torch.round(x / scales.float()[..., None]).clamp(-127, 127).to(torch.int8).reshape(T, -1)  # [T, S*H]
    return q, (scales[:, 0] if segments == 1 else scales)


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """q [T, S*H] int8, scales [T] or [T, S] -> [T, S*H] float32."""
    s = scales.float().reshape(q.shape[0], -1)  # [T, S]
    return (q.float().reshape(q.shape[0], s.shape[1], -1) * s[..., None]).reshape(q.shape)


def write_shard(path: Path, records: list[tuple], dtype: str) -> dict:
    """Write `records` [(id, input_ids int32 [T], stored hidden [T, W], loss_mask uint8 [T], scales or None)] as one
    shard at `path` (tmp + os.replace). Returns its entry: ids, lengths, bytes, token and loss-token counts."""
    ids = [r[0] for r in records]
    lengths = [int(r[1].shape[0]) for r in records]
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    tensors = {
        "hidden": torch.cat([r[2] for r in records]),  # [N, W]
        "input_ids": torch.cat([r[1] for r in records]),  # [N] int32
        "loss_mask": torch.cat([r[3] for r in records]),  # [N] uint8
        "offsets": offsets,  # [R+1]
    }
    if dtype == "int8":
        tensors["scales"] = torch.cat([r[4] for r in records])  # [N] or [N, S] fp16
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        save_file(tensors, str(tmp), metadata={"format": FORMAT_NAME, "dtype": dtype, "ids": json.dumps(ids)})
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)  # a full disk or a kill between the two: nothing half-written stays
        raise
    return {"bytes": path.stat().st_size, "num_records": len(ids), "num_tokens": int(offsets[-1]),
            "num_loss_tokens": int(tensors["loss_mask"].sum()), "ids": ids, "lengths": lengths}


class ShardRecords:
    """The records of one shard by id: ``s[id]`` -> {"id", "input_ids" [T] long, "hidden_states" [T, W] float32,
    "loss_mask" [T] long}, exactly what FeatureCacheReader returns for the same record."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._f = safe_open(str(path), framework="pt")
        meta = self._f.metadata() or {}
        self.dtype = meta.get("dtype", "")
        self.ids = json.loads(meta.get("ids", "[]"))
        self._offsets = self._f.get_tensor("offsets").tolist()
        self._row = {rid: j for j, rid in enumerate(self.ids)}

    def __contains__(self, record_id: str) -> bool:
        return record_id in self._row

    def __getitem__(self, record_id: str) -> dict:
        j = self._row[record_id]
        a, b = self._offsets[j], self._offsets[j + 1]
        hidden = self._f.get_slice("hidden")[a:b]
        if self.dtype == "int8":
            hidden = dequantize_int8(hidden, self._f.get_slice("scales")[a:b])
        return {"id": record_id, "input_ids": self._f.get_slice("input_ids")[a:b].long(),
                "hidden_states": hidden.float(), "loss_mask": self._f.get_slice("loss_mask")[a:b].long()}
