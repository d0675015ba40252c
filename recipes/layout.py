"""The run folder: what each stage writes under the recipe's `output_dir`, and the keys that move a part elsewhere.

    {output_dir}/data/            data_prep (conversations, regenerated/, tokenized.jsonl, features/ = the feature cache)
    {output_dir}/train/           the trainer (checkpoints/, metrics.jsonl, tensorboard/, summary.json)
    {output_dir}/head/            the exported head (export.dir moves it)
    {output_dir}/eval/            evaluation reports (eval.output_dir moves them); eval/serve_sweep/: serve-sweep's
                                  draft length per concurrency level, which the Hub card stages
    {output_dir}/tune/            the quickstart demo's auto-tuning report
    {output_dir}/eagle3/          the quickstart demo's EAGLE-3 head: its own data/ (the aux-layer cache), train/, head/, tune/

Every stage finds another stage's output through these functions, never by joining path parts itself.
"""
from __future__ import annotations

from pathlib import Path

from eagle.head_kinds import EAGLE3

DATA_DIR = "data"
FEATURES_DIR = "features"  # the feature cache, in DATA_DIR
REGENERATED_DIR = "regenerated"  # the target's regenerated answers (part-*.jsonl + settings.json), in DATA_DIR
TOKENIZED_FILE = "tokenized.jsonl"  # tokenised conversations, in DATA_DIR
TRAIN_DIR = "train"
CHECKPOINTS_DIR = "checkpoints"  # in TRAIN_DIR
HEAD_DIR = "head"
EVAL_DIR = "eval"
TUNE_DIR = "tune"
EAGLE3_DIR = EAGLE3.name  # the quickstart demo's second head, an EAGLE-3 one (its output_dir)


def data_dir(cfg) -> Path:
    """{output_dir}/data: where data prep writes."""
    return Path(cfg.output_dir) / DATA_DIR


def regenerated_dir(cfg) -> Path:
    """{output_dir}/data/regenerated: the on-policy answers data prep's regenerate step writes (and resumes)."""
    return data_dir(cfg) / REGENERATED_DIR


def cache_dir(cfg) -> Path:
    """The feature cache training reads: train.cache_dir, or the one data prep writes, {output_dir}/data/features."""
    return Path(cfg.train.cache_dir or data_dir(cfg) / FEATURES_DIR)


def tokenized_file(cfg) -> Path:
    """Tokenised conversations online training reads: train.tokenized, or {output_dir}/data/tokenized.jsonl."""
    return Path(cfg.train.tokenized or data_dir(cfg) / TOKENIZED_FILE)


def train_dir(cfg) -> Path:
    """{output_dir}/train: the trainer's logs, summary and checkpoints."""
    return Path(cfg.output_dir) / TRAIN_DIR


def stream_dir(cfg) -> Path:
    """The window of stream mode (train.mode=stream): train.stream_dir, or {output_dir}/train/stream."""
    return Path(cfg.train.stream_dir or train_dir(cfg) / "stream")


def checkpoint_dir(cfg) -> Path:
    """{output_dir}/train/checkpoints."""
    return train_dir(cfg) / CHECKPOINTS_DIR


def head_dir(cfg) -> Path:
    """The exported head: export.dir, or {output_dir}/head."""
    return Path(cfg.export.dir or Path(cfg.output_dir) / HEAD_DIR)


def eval_head(cfg) -> str:
    """The head evaluation decodes with: eval.head_path (a folder or hub id), or {output_dir}/head."""
    return str(cfg.eval.head_path or Path(cfg.output_dir) / HEAD_DIR)


def eval_dir(cfg) -> Path:
    """Evaluation reports: eval.output_dir, or {output_dir}/eval."""
    return Path(cfg.eval.output_dir or Path(cfg.output_dir) / EVAL_DIR)


SERVE_SWEEP_DIR = "serve_sweep"  # in EVAL_DIR: python -m evaluation serve-sweep writes it, the Hub card stages it
SERVE_SWEEP_FILES = ("sweep.md", "sweep.json", "throughput.png", "speculative_config.json")  # what serve-sweep writes there
SERVE_SWEEP_PARTIAL = f"{SERVE_SWEEP_DIR}.partial"  # beside it: a sweep being measured, or interrupted (resumable)


def serve_sweep_dir(cfg) -> Path:
    """serve-sweep's report (draft length per concurrency level): {eval dir}/serve_sweep."""
    return eval_dir(cfg) / SERVE_SWEEP_DIR
