"""Stream mode (train.mode=stream) against capture-then-train on the same records: wall time, peak disk of the
window vs the offline cache, each side's records/s and waits, and whether the two heads are bit-identical.

    python -m benchmarks.stream_vs_offline --recipe stories260k --text ../shared/data/corpora/tinystories_val_a.txt \\
        --first 3000 --out /tmp/stream-bench train.epochs=2 [--window-steps 4 --window-mb 4]
    python -m benchmarks.stream_vs_offline --recipe tiny --tokenized RUN/data/tokenized.jsonl --out /tmp/sb \\
        [--ranks 2] target.path=~/.cache/eagle2-train/default-target

Records: --tokenized = a data prep's tokenized.jsonl as it is (the demo's own data: data prep of recipe `tiny` on
the default target's conversations writes RUN/data/tokenized.jsonl), or --text = the first N paragraphs of a text
file, tokenized with the target's tokenizer (its BOS added), cut to data.max_length, loss on every token
(train.corpus_cache's records without --continue-with-target), written to {out}/tokenized.jsonl. Both runs read the
same file. Offline: data prep's cache stage function (`cache_shard`, one forward per record) into
{out}/offline/data/features, then `train/main.py` offline; stream: `train/main.py train.mode=stream` once at the
recipe's default window, then once per --window-steps / --window-mb / --producers given. --ranks N runs both trainings under
torchrun on N ranks (the capture stays one process, as the stream's one producer). Every run is a subprocess
(`nice -n 19` from the caller) so wall time includes its start-up.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from safetensors.torch import load_file

from data_prep.corpus_cache import read_paragraphs
from data_prep.target import load_target_tokenizer, resolve_target_path
from data_prep.tokenized import load_tokenized, write_tokenized
from recipes import load_config

CAPTURE = """
import sys
from data_prep.cache_features import cache_shard
from data_prep.feature_cache import FeatureCacheWriter
from data_prep.target import load_target_model, resolve_target_path, target_config_hash
from data_prep.tokenized import load_tokenized
from eagle.device import pick_device
from recipes import layout, load_config
cfg = load_config(sys.argv[1], sys.argv[3:])
model = load_target_model(cfg.target, pick_device(cfg.data.device), resolve_target_path(cfg.target))
meta = {"target": resolve_target_path(cfg.target), "config_hash": target_config_hash(model.config),
        "hidden_size": int(model.config.hidden_size), "vocab_size": int(model.config.vocab_size),
        "target_dtype": cfg.target.dtype}
w = FeatureCacheWriter(layout.cache_dir(cfg), meta, dtype=cfg.data.cache_dtype)
cache_shard(model, list(load_tokenized(sys.argv[2])), w, 0, 1, progress=False)
print(w.close()["bytes_on_disk"])
"""


def run(cmd: list[str]) -> float:
    tic = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{' '.join(cmd[:6])} ... failed: {proc.stderr.strip().splitlines()[-1:]}")
    return time.perf_counter() - tic


def text_records(cfg, text: str, first: int) -> list[dict]:
    tok = load_target_tokenizer(cfg.target, resolve_target_path(cfg.target), need_template=False)
    recs = []
    for i, para in enumerate(read_paragraphs(text, first)):
        ids = tok(para)["input_ids"][: cfg.data.max_length] if para else []
        if len(ids) >= 2:
            recs.append({"id": f"p{i:06d}", "input_ids": ids, "loss_mask": [1] * len(ids)})
    return recs


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.stream_vs_offline", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", required=True)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", help="a text file: its first --first paragraphs are the records")
    src.add_argument("--tokenized", help="a data prep tokenized.jsonl, read as it is (e.g. the demo's own data)")
    p.add_argument("--first", type=int, default=3000)
    p.add_argument("--out", required=True)
    p.add_argument("--ranks", type=int, default=1, help="trainer ranks of both trainings (torchrun when > 1)")
    p.add_argument("--window-steps", type=int, action="append", default=[],
                   help="also a stream run at train.stream_window_steps=N (repeatable)")
    p.add_argument("--window-mb", type=float, action="append", default=[],
                   help="also a stream run with the window capped at train.stream_window_mb=X (repeatable)")
    p.add_argument("--producers", type=int, action="append", default=[],
                   help="also a stream run at the default window with train.stream_producers=N (repeatable)")
    p.add_argument("--no-default-window", action="store_true", help="skip the run at the recipe's default window")
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = load_config(args.recipe, args.overrides)
    if args.tokenized:
        tokenized = Path(args.tokenized).resolve()
        recs = list(load_tokenized(tokenized))
    else:
        recs = text_records(cfg, args.text, args.first)
        tokenized = out / "tokenized.jsonl"
        write_tokenized(tokenized, recs)
    common = [*args.overrides, f"train.tokenized={tokenized}", "logging.backend=none", "logging.progress=false"]
    launcher = [sys.executable] if args.ranks == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.ranks), "--master_port", "29517"]
    train = [*launcher, "train/main.py", "--recipe", args.recipe]
    result = {"records": len(recs), "tokens": sum(len(r["input_ids"]) for r in recs), "overrides": args.overrides,
              "tokenized": str(tokenized), "ranks": args.ranks}
    off = [*common, f"output_dir={out / 'offline'}"]
    result["offline_capture_s"] = run([sys.executable, "-c", CAPTURE, args.recipe, str(tokenized), *off])
    result["offline_train_s"] = run([*train, *off])
    cache = out / "offline" / "data" / "features"
    result["offline_cache_bytes"] = sum(p.stat().st_size for p in (cache / "shards").glob("*.safetensors"))
    summary = json.loads((out / "offline" / "train" / "summary.json").read_text())
    result["offline_eval"] = summary.get("eval", {})
    head = load_file(str(out / "offline" / "head" / "model.safetensors"))
    windows = ([("default", [])] if not args.no_default_window else []) \
        + [(f"{n}steps", [f"train.stream_window_steps={n}"]) for n in args.window_steps] \
        + [(f"{mb:g}mb", [f"train.stream_window_mb={mb}"]) for mb in args.window_mb] \
        + [(f"{n}producers", [f"train.stream_producers={n}"]) for n in args.producers]
    result["streams"] = []
    for label, window in windows:
        d = out / f"stream-{label}"
        wall = run([*train, *common, f"output_dir={d}", "train.mode=stream", *window])
        s = json.loads((d / "train" / "summary.json").read_text())
        other = load_file(str(d / "head" / "model.safetensors"))
        result["streams"].append({
            "window": label, "wall_s": wall, **s["stream"], "train_time_s": s["train_time_s"],
            "eval_records": s["eval_records"], "offline_eval_records": summary["eval_records"],
            "peak_vs_cache": s["stream"]["window_peak_bytes"] / result["offline_cache_bytes"],
            "bit_identical_head": all((head[k] == other[k]).all().item() for k in head),
            "eval_equal": s.get("eval", {}) == result["offline_eval"], "eval": s.get("eval", {})})
        print(json.dumps(result["streams"][-1]), flush=True)
    (out / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "offline_eval"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
