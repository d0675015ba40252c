"""Tokenised conversations on disk: one JSON line per record, ``{"id", "input_ids", "loss_mask"}``.

Written by the `tokenize` stage to ``{output_dir}/data/tokenized.jsonl``; read by the `cache`
stage and by the trainer's online mode (which runs the target itself instead of reading a cache).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Iterator

from eagle.atomic_file import atomic_output
from recipes.layout import TOKENIZED_FILE


def tokenized_path(path: str | Path) -> Path:
    """Accept the jsonl file itself or a directory holding `tokenized.jsonl`."""
    path = Path(path)
    return path / TOKENIZED_FILE if path.is_dir() else path


def load_tokenized(path: str | Path) -> Iterator[dict]:
    """Yield {"id": str, "input_ids": list[int], "loss_mask": list[int]} per record, in file order."""
    path = tokenized_path(path)
    if not path.exists():
        raise FileNotFoundError(f"tokenized data {path} not found; run `python data_prep/main.py --recipe ... tokenize`")
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
                if not line.strip():
                    continue
                rec = json.loads(line)
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e})") from None
            if not isinstance(rec, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(rec).__name__}")
            ids, mask = rec.get("input_ids"), rec.get("loss_mask")
            if not isinstance(ids, list) or not isinstance(mask, list) or len(ids) != len(mask) or "id" not in rec:
                raise ValueError(f"{path}:{lineno}: record {rec.get('id')!r} needs id, and input_ids/loss_mask lists of equal length")
            yield {"id": str(rec["id"]), "input_ids": ids, "loss_mask": mask}


def write_tokenized(path: str | Path, records: Iterable[dict]) -> int:
    """Write records atomically (tmp file + rename); returns how many were written."""
    n = 0
    with atomic_output(path) as f:  # eagle/atomic_file.py: a full disk leaves no partial file behind
        for rec in records:
            f.write(json.dumps({"id": rec["id"], "input_ids": list(rec["input_ids"]), "loss_mask": list(rec["loss_mask"])}) + "\n")
            n += 1
    return n
