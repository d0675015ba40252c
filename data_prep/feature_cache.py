"""The feature cache: the target's final hidden states (EAGLE-3: aux layers + final state) + token ids + loss
masks, on disk.

Layout of a cache directory::

    shards/{part}-{k:05d}.safetensors   one shard = many records, concatenated along tokens (no padding)
    parts/{part}.json                   what one writer (one rank / `--shard i/n`) has committed
    manifest.json                       merged summary of all parts, rewritten by every `close()`: derived, for
                                        people and tools; no loader reads it (FeatureCacheReader and train.plan
                                        merge parts/*.json, checked against the shards), so a hand edit changes
                                        nothing and the next `close()` overwrites it

A shard holds ``hidden`` [N, W] (bf16 / fp16 / fp32, or int8 with ``scales`` [N] fp16 per row; [N, S] with one
scale per layer segment when the meta names S > 1 ``feature_layers``). W = H for EAGLE-2; W = 4H for EAGLE-3
(meta ``feature_layers`` [a, b, c, L]: three aux layers + the final state, see data_prep/feature_layers.py),
``input_ids`` [N] int32, ``loss_mask`` [N] uint8 and ``offsets`` [R+1] int64 (record r owns rows
offsets[r]:offsets[r+1]). Bytes per token = W*b + 5 (+2 per segment for int8 scales), against 2H + 16 for
the reference EAGLE-2 layout (fp16 hidden + int64 ids + int64 mask per file).

The part manifests are the source of truth: several writers (ranks) can fill one directory at
once, each appending its own part, and a writer re-opened on an existing directory continues
where it stopped, skipping record ids already committed by ANY part. A shard is committed only
after its file is fully written (atomic rename) and the part manifest names it with its sha256;
records still in the in-memory buffer when a run dies are simply redone on the next run.
"""
from __future__ import annotations

import hashlib
import json
from bisect import bisect_right
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from data_prep.feature_shard import FORMAT_NAME, dequantize_int8, quantize_int8, write_shard
from eagle.cli_errors import UserError
from eagle.state_files import StateFile, read_json_state, register, write_json_state

FORMAT_VERSION = 1
CACHE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "int8": torch.int8}
DEFAULT_SHARD_BYTES = 512 * 2**20


class FeatureCacheError(UserError, RuntimeError):
    """A cache directory is missing, corrupt, truncated or inconsistent; the message names the file."""


def bytes_per_token(hidden_size: int, dtype: str, segments: int = 1) -> int:
    """On-disk bytes per cached token for `dtype` with `segments` hidden states of width `hidden_size` per token
    (feature row + int32 id + uint8 mask [+ one fp16 scale per segment])."""
    if dtype not in CACHE_DTYPES:
        raise ValueError(f"unknown cache dtype {dtype!r}; choose one of {sorted(CACHE_DTYPES)}")
    row = segments * hidden_size * CACHE_DTYPES[dtype].itemsize
    return row + 4 + 1 + (2 * segments if dtype == "int8" else 0)


def segments_of(meta: dict) -> int:
    """Hidden states per cached token: len(meta["feature_layers"]) (EAGLE-3), else 1 (the final state)."""
    return len(meta.get("feature_layers") or [None])


def reference_bytes_per_token(hidden_size: int) -> int:
    """Bytes per token of the reference EAGLE layout: fp16 hidden + int64 input id + int64 loss mask."""
    return 2 * hidden_size + 8 + 8


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


PART_MANIFEST = register(StateFile(
    "PART.json", "CACHE_DIR/parts", writer="data_prep/feature_cache.py",
    schema={"meta": dict, "dtype": str, "shards": [dict]},
    rebuild="delete it and the shards it names (shards/PART-*.safetensors) and rerun data_prep: that part is redone",
    when_missing="a part not started yet: its records are cached by the next run",
    example={"meta": {"hidden_size": 8}, "dtype": "float16", "shards": []}))
CACHE_MANIFEST = register(StateFile(
    "manifest.json", "CACHE_DIR", writer="data_prep/feature_cache.py (merged from parts/*.json)",
    schema={"num_records": int, "num_tokens": int, "num_loss_tokens": int, "dtype": str, "*": object},
    rebuild="delete it and rerun data_prep (it is merged again from parts/*.json; nothing is recomputed)",
    when_missing="no cache closed yet", example={"num_records": 2, "num_tokens": 10, "num_loss_tokens": 6,
                                                 "dtype": "float16"}))


# --------------------------------------------------------------------------- manifests
def _load_parts(out_dir: Path) -> dict[str, dict]:
    parts = {}
    pdir = out_dir / "parts"
    if pdir.is_dir():
        for p in sorted(pdir.glob("*.json")):
            part = read_json_state(p, PART_MANIFEST)
            _check_part(part, p)
            parts[p.stem] = part
    return parts


SHARD_KEYS = {"file": str, "sha256": str, "bytes": int, "num_records": int, "num_tokens": int, "num_loss_tokens": int,
              "ids": list, "lengths": list}


def _check_part(part, path: Path) -> None:
    """A part manifest's structure and internal arithmetic (ids and lengths per record, token sums)."""
    def bad(why: str):
        raise FeatureCacheError(f"part manifest {path} is inconsistent: {why}; delete it and its shards to redo that part")

    if not isinstance(part, dict) or not isinstance(part.get("shards"), list) or not isinstance(part.get("meta"), dict) \
            or not isinstance(part.get("dtype"), str):
        bad("expected an object with meta, dtype and a list of shards")
    if part["dtype"] not in CACHE_DTYPES:
        bad(f"unknown dtype {part['dtype']!r}")
    for k, s in enumerate(part["shards"]):
        if not isinstance(s, dict) or any(not isinstance(s.get(key), t) for key, t in SHARD_KEYS.items()):
            bad(f"shard entry {k} needs {sorted(SHARD_KEYS)}")
        if Path(s["file"]).is_absolute() or ".." in Path(s["file"]).parts:
            bad(f"shard entry {k} names {s['file']!r} outside the cache")
        if len(s["ids"]) != s["num_records"] or len(s["lengths"]) != s["num_records"]:
            bad(f"{s['file']}: {len(s['ids'])} ids and {len(s['lengths'])} lengths for num_records={s['num_records']}")
        if any(not isinstance(n, int) or n < 1 for n in s["lengths"]) or sum(s["lengths"]) != s["num_tokens"]:
            bad(f"{s['file']}: record lengths do not sum to num_tokens={s['num_tokens']}")


def _check_meta_consistent(parts: dict[str, dict], out_dir: Path) -> None:
    first = None
    for name, part in parts.items():
        key = (part["meta"], part["dtype"])
        if first is None:
            first = (name, key)
        elif key != first[1]:
            raise FeatureCacheError(
                f"cache {out_dir}: part {name!r} has meta/dtype {key} but part {first[0]!r} has {first[1]}; "
                "one cache directory must hold features of one target in one dtype"
            )


def merge_manifests(out_dir: str | Path) -> dict:
    """Merge every part manifest of `out_dir` into one manifest dict (does not write it)."""
    out_dir = Path(out_dir)
    parts = _load_parts(out_dir)
    if not parts:
        raise FeatureCacheError(f"{out_dir} is not a feature cache (no parts/*.json); run the `cache` stage first")
    _check_meta_consistent(parts, out_dir)
    any_part = next(iter(parts.values()))
    shards = [s for name in sorted(parts) for s in parts[name]["shards"]]
    num_tokens = sum(s["num_tokens"] for s in shards)
    manifest = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        **any_part["meta"],
        "dtype": any_part["dtype"],
        "num_records": sum(s["num_records"] for s in shards),
        "num_tokens": num_tokens,
        "num_loss_tokens": sum(s["num_loss_tokens"] for s in shards),
        "bytes_on_disk": sum(s["bytes"] for s in shards),
        "parts": sorted(parts),
        "shards": shards,
    }
    hidden = any_part["meta"].get("hidden_size")
    if hidden is not None:
        manifest["bytes_per_token"] = bytes_per_token(int(hidden), any_part["dtype"], segments_of(any_part["meta"]))
        manifest["reference_bytes_per_token"] = reference_bytes_per_token(int(hidden))
    if any_part["dtype"] == "int8":
        sq_err = sum(p["quant"]["sum_sq_err"] for p in parts.values())
        sq = sum(p["quant"]["sum_sq"] for p in parts.values())
        manifest["quantization"] = {
            "method": "int8 symmetric, per-row (per layer segment) absmax scale (fp16)",
            "relative_rmse": (sq_err / sq) ** 0.5 if sq > 0 else 0.0,
            "max_abs_error": max(p["quant"]["max_abs_err"] for p in parts.values()),
        }
    return manifest


# --------------------------------------------------------------------------- writer
class FeatureCacheWriter:
    """Append records to a feature cache; resumable and safe for one writer per `part`.

    `meta` must hold at least ``target``, ``config_hash``, ``hidden_size`` (and usually ``vocab_size``);
    re-opening a directory written with a different meta or dtype raises.
    """

    def __init__(
        self,
        out_dir: str | Path,
        meta: dict,
        dtype: str = "bfloat16",
        part: str = "part0",
        max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    ):
        if dtype not in CACHE_DTYPES:
            raise ValueError(f"unknown cache dtype {dtype!r}; choose one of {sorted(CACHE_DTYPES)}")
        for key in ("target", "config_hash", "hidden_size"):
            if key not in meta:
                raise ValueError(f"FeatureCacheWriter meta needs {key!r} (got keys {sorted(meta)})")
        if not part or "/" in part or part.startswith("."):
            raise ValueError(f"bad part name {part!r}")
        self.out_dir = Path(out_dir)
        self.meta = json.loads(json.dumps(meta))  # plain JSON types, so comparisons with reloads are exact
        self.dtype = dtype
        self.part = part
        self.max_shard_bytes = max_shard_bytes
        (self.out_dir / "shards").mkdir(parents=True, exist_ok=True)
        (self.out_dir / "parts").mkdir(parents=True, exist_ok=True)
        self.hidden_size = int(meta["hidden_size"])
        self.segments = segments_of(self.meta)
        self.width = self.segments * self.hidden_size  # cached feature row per token

        parts = _load_parts(self.out_dir)
        for name, p in parts.items():
            if p["meta"] != self.meta or p["dtype"] != dtype:
                old, new = {**p["meta"], "dtype": p["dtype"]}, {**self.meta, "dtype": dtype}
                diff = {k: (old.get(k), new.get(k)) for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)}
                raise FeatureCacheError(
                    f"cache {self.out_dir} part {name!r} was written with other settings {diff} (old, new); "
                    "use a new output directory for a different target/dtype/tokenized data"
                )
        self._done_ids: set[str] = {i for p in parts.values() for s in p["shards"] for i in s["ids"]}
        self._state = parts.get(part) or {
            "meta": self.meta,
            "dtype": dtype,
            "shards": [],
            "quant": {"sum_sq_err": 0.0, "sum_sq": 0.0, "max_abs_err": 0.0},
        }
        self._buffer: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]] = []
        self._buffer_bytes = 0
        self._closed = False

    def __contains__(self, record_id: str) -> bool:
        """True when `record_id` is already committed (by any part) or buffered here."""
        return record_id in self._done_ids

    @property
    def num_committed_tokens(self) -> int:
        return sum(s["num_tokens"] for s in self._state["shards"])

    def add(self, record_id: str, input_ids: torch.Tensor, hidden: torch.Tensor, loss_mask: torch.Tensor) -> bool:
        """Buffer one record (no padding). Returns False (and stores nothing) if the id is already cached."""
        if self._closed:
            raise FeatureCacheError("FeatureCacheWriter.add after close()")
        record_id = str(record_id)
        if record_id in self._done_ids:
            return False
        input_ids = torch.as_tensor(input_ids).reshape(-1)
        loss_mask = torch.as_tensor(loss_mask).reshape(-1)
        T = input_ids.shape[0]
        if T == 0:
            raise ValueError(f"record {record_id!r}: empty input_ids")
        if hidden.dim() != 2 or hidden.shape != (T, self.width):
            raise ValueError(f"record {record_id!r}: hidden has shape {tuple(hidden.shape)}, expected ({T}, {self.width})")
        if loss_mask.shape[0] != T:
            raise ValueError(f"record {record_id!r}: loss_mask has {loss_mask.shape[0]} entries for {T} tokens")
        hidden = hidden.detach().cpu()
        scales = None
        if self.dtype == "int8":
            q, scales = quantize_int8(hidden, self.segments)
            err = (dequantize_int8(q, scales) - hidden.float())  # [T, W]
            quant = self._state["quant"]
            quant["sum_sq_err"] += float(err.double().pow(2).sum())
            quant["sum_sq"] += float(hidden.double().pow(2).sum())
            quant["max_abs_err"] = max(quant["max_abs_err"], float(err.abs().max()))
            stored = q
        else:
            stored = hidden.to(CACHE_DTYPES[self.dtype])
        self._buffer.append((record_id, input_ids.to(torch.int32).cpu(), stored.contiguous(), loss_mask.to(torch.uint8).cpu(), scales))
        self._done_ids.add(record_id)
        self._buffer_bytes += T * bytes_per_token(self.hidden_size, self.dtype, self.segments)
        if self._buffer_bytes >= self.max_shard_bytes:
            self.flush()
        return True

    def flush(self) -> None:
        """Write the buffered records as one shard and commit it to the part manifest."""
        if not self._buffer:
            return
        index = len(self._state["shards"])
        name = f"{self.part}-{index:05d}.safetensors"
        path = self.out_dir / "shards" / name
        entry = write_shard(path, self._buffer, self.dtype)  # data_prep/feature_shard.py: the one shard format
        self._state["shards"].append({"file": f"shards/{name}", "sha256": sha256_file(path), **entry})
        write_json_state(self.out_dir / "parts" / f"{self.part}.json", self._state, PART_MANIFEST)
        self._buffer, self._buffer_bytes = [], 0

    def close(self) -> dict:
        """Flush, then write the merged manifest.json; returns it."""
        self.flush()
        if not (self.out_dir / "parts" / f"{self.part}.json").exists():
            write_json_state(self.out_dir / "parts" / f"{self.part}.json", self._state, PART_MANIFEST)  # an empty part still records meta
        self._closed = True
        manifest = merge_manifests(self.out_dir)
        write_json_state(self.out_dir / "manifest.json", manifest, CACHE_MANIFEST)
        return manifest

    def __enter__(self) -> "FeatureCacheWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # On an exception, commit what is complete (it is valid data) but do not write manifest.json
        # from a half-finished run twice; a rerun resumes from the part manifests.
        if exc_type is None:
            self.close()
        else:
            self.flush()


# --------------------------------------------------------------------------- reader
class FeatureCacheReader:
    """Random access to a feature cache. Verifies every shard (size + sha256) on open.

    ``r[i]`` -> {"id", "input_ids" LongTensor[T], "hidden_states" FloatTensor[T, W] float32 (W = H, or 4H for an
    EAGLE-3 cache: see `feature_layers`), "loss_mask" LongTensor[T]}; ``r.lengths`` for length-grouped batching;
    ``r.manifest``; ``r.feature_layers`` (None = final state only); ``r.tokens(i)`` = (input_ids, loss_mask) only.
    `verify="sha256"` (default) hashes every shard, `"size"` only checks sizes (fast, for huge caches).
    """

    def __init__(self, out_dir: str | Path, verify: str = "sha256"):
        if verify not in ("sha256", "size"):
            raise ValueError(f"verify must be 'sha256' or 'size', got {verify!r}")
        self.out_dir = Path(out_dir)
        if not self.out_dir.is_dir():
            raise FeatureCacheError(f"feature cache {self.out_dir} does not exist")
        self.manifest = merge_manifests(self.out_dir)
        self.dtype = self.manifest["dtype"]
        self.feature_layers = self.manifest.get("feature_layers")  # None: an EAGLE-2 cache (final state only)
        self._shards = self.manifest["shards"]
        for s in self._shards:
            self._verify_shard(s, verify)
        self.ids: list[str] = [i for s in self._shards for i in s["ids"]]
        self.lengths: list[int] = [n for s in self._shards for n in s["lengths"]]
        dup = len(self.ids) - len(set(self.ids))
        if dup:
            raise FeatureCacheError(f"feature cache {self.out_dir} holds {dup} duplicated record ids")
        self._starts = []  # global record index where each shard starts
        total = 0
        for s in self._shards:
            self._starts.append(total)
            total += s["num_records"]
        self._handles: dict[int, Any] = {}
        self._offsets: dict[int, list[int]] = {}

    def _verify_shard(self, shard: dict, verify: str) -> None:
        path = self.out_dir / shard["file"]
        if not path.exists():
            raise FeatureCacheError(f"feature cache shard {path} is missing (listed in the manifest)")
        size = path.stat().st_size
        if size != shard["bytes"]:
            raise FeatureCacheError(
                f"feature cache shard {path} is truncated or altered: {size} bytes on disk, manifest says {shard['bytes']}"
            )
        self._check_tensors(shard, path)
        if verify == "sha256":
            digest = sha256_file(path)
            if digest != shard["sha256"]:
                raise FeatureCacheError(
                    f"feature cache shard {path} is corrupt: sha256 {digest[:16]}... does not match the manifest "
                    f"({shard['sha256'][:16]}...); delete the shard and its entry in parts/ and rerun the cache stage"
                )

    def _check_tensors(self, shard: dict, path: Path) -> None:
        """The shard's tensors agree with the manifest: per-record lengths (offsets), ids, row counts, width."""
        def bad(why: str):
            raise FeatureCacheError(f"feature cache shard {path} does not match its manifest entry: {why}; delete the "
                                    "shard and its entry in parts/ and rerun the cache stage")

        try:
            with safe_open(str(path), framework="pt") as f:
                keys = set(f.keys())
                need = {"hidden", "input_ids", "loss_mask", "offsets"} | ({"scales"} if self.dtype == "int8" else set())
                if not need <= keys:
                    bad(f"tensors {sorted(need - keys)} are missing")
                offsets = f.get_tensor("offsets")
                shapes = {k: tuple(f.get_slice(k).get_shape()) for k in need}
                stored_ids = (f.metadata() or {}).get("ids")
        except FeatureCacheError:
            raise
        except Exception as e:  # SafetensorError and friends: a damaged header
            raise FeatureCacheError(f"cannot read feature cache shard {path}: {e}") from None
        n, t = shard["num_records"], shard["num_tokens"]
        lengths = (offsets[1:] - offsets[:-1]).tolist() if offsets.numel() else []
        if offsets.numel() != n + 1 or lengths != shard["lengths"]:
            bad(f"per-record lengths {lengths[:5]}... in the file, {shard['lengths'][:5]}... in the manifest")
        segments = segments_of(self.manifest)  # hidden states per token: 1 (EAGLE-2) or 4 (EAGLE-3)
        hidden = int(self.manifest.get("hidden_size", shapes["hidden"][-1] // segments)) * segments
        per_token = {"scales": (t,) if segments == 1 else (t, segments)}  # int8: one fp16 scale per state
        if shapes["hidden"] != (t, hidden) or any(shapes[k] != per_token.get(k, (t,)) for k in need - {"hidden", "offsets"}):
            bad(f"tensor shapes {shapes} for {t} tokens of width {hidden}")
        if stored_ids is not None and json.loads(stored_ids) != shard["ids"]:
            bad("record ids differ from the ones stored in the shard")

    def __len__(self) -> int:
        return len(self.ids)

    def _open(self, k: int):
        if k not in self._handles:
            path = self.out_dir / self._shards[k]["file"]
            try:
                handle = safe_open(str(path), framework="pt")
                self._offsets[k] = handle.get_tensor("offsets").tolist()
            except Exception as e:  # safetensors raises its own error types; name the shard
                raise FeatureCacheError(f"cannot read feature cache shard {path}: {e}") from e
            self._handles[k] = handle
        return self._handles[k]

    def __getitem__(self, i: int) -> dict:
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"record index {i} out of range for a cache of {len(self)} records")
        k = bisect_right(self._starts, i) - 1
        handle = self._open(k)
        j = i - self._starts[k]
        a, b = self._offsets[k][j], self._offsets[k][j + 1]
        hidden = handle.get_slice("hidden")[a:b]
        if self.dtype == "int8":
            hidden = dequantize_int8(hidden, handle.get_slice("scales")[a:b])
        return {
            "id": self.ids[i],
            "input_ids": handle.get_slice("input_ids")[a:b].long(),
            "hidden_states": hidden.float(),
            "loss_mask": handle.get_slice("loss_mask")[a:b].long(),
        }

    def tokens(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids [T], loss_mask [T]) of record i without reading its features (draft-vocabulary counts)."""
        k = bisect_right(self._starts, i) - 1
        handle = self._open(k)
        a, b = self._offsets[k][i - self._starts[k]], self._offsets[k][i - self._starts[k] + 1]
        return handle.get_slice("input_ids")[a:b].long(), handle.get_slice("loss_mask")[a:b].long()

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

    def __getstate__(self):  # DataLoader workers re-open shards lazily
        state = self.__dict__.copy()
        state["_handles"] = {}
        return state
