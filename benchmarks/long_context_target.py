"""A long-context variant of the embedded default target, for measuring draft heads by context length (issue 49).

    python -m benchmarks.long_context_target [--cache-dir DIR] [--size default|test] [--seed 0] [--rebuild]

The default target (data_prep/default_target.py) was trained on 256-token rows: past a few hundred positions it has
never seen a key, so no draft can be measured on long prompts against it. This script continues training it (same
architecture, tokenizer and chat template) on LONG DOCUMENTS made from its own corpus: one multi-turn conversation
per document, the stdlib-docstring conversations of the training split one after another (shuffled, seeded) until
the document is `doc_tokens` long, and every `recall_every` conversations a RECALL turn: a question asked earlier in
the same document asked again, with the same answer, so the document holds something only its far context predicts
(the answer is a copy of text thousands of tokens back). Training runs in stages of growing row length (the
preset's `stages`: row tokens, optimizer steps, rows per step), each a short warmup + cosine schedule, so most of
the CPU goes to short rows and a few steps teach the longest positions. The config says `max_position_embeddings`
= the preset's `max_positions` (RoPE itself unchanged: the rotary angles of every position up to the longest stage
are trained).

The folder (cached at {cache}/long-context-target[-SIZE], built under a file lock into a temporary sibling and
renamed into place, as the default target is; rebuilt when the preset, the seed or the base target changed) is a
normal HF folder plus:
  conversations_train.json   the default target's conversations (what data prep trains a head on by default)
  questions_eval.jsonl       the default target's held-out questions
  long_documents_train.json  the long documents it was trained on (ShareGPT, one record per document)
  long_documents_eval.json   held-out long documents (the eval split's names, never trained on)
  long_context_target.json   fingerprint, losses, CPU seconds, and the held-out next-token loss per position
                             bucket for this target AND the default target it started from (where each still
                             predicts); written last: its presence with a matching fingerprint marks a complete build

docs/results/long-context.md has the measured build and the heads measured on it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from data_prep.default_target import (CONVERSATIONS_FILE, QUESTIONS_FILE, SIZES, build_cached, default_cache_dir,
                                      ensure_default_target, heldout_conversations, read_build_info,
                                      read_build_state, sharegpt_to_messages, train_model)
from data_prep.docstring_corpus import default_conversations
from eagle.state_files import StateFile, register, write_json_state
from evaluation.context_buckets import bucket_labels, bucket_of

FORMAT_VERSION = 1  # bump when the build changes: cached long-context targets of another version are rebuilt
BUILD_INFO_FILE = "long_context_target.json"
BUILD_INFO = register(StateFile(
    BUILD_INFO_FILE, "LONG_CONTEXT_TARGET_DIR", writer="benchmarks/long_context_target.py",
    schema={"fingerprint": dict, "parameters": int, "eval_loss_by_position": dict, "*": object},
    rebuild="delete that folder and rerun `python -m benchmarks.long_context_target`: it builds it again",
    when_missing="an incomplete build: `python -m benchmarks.long_context_target` builds it again",
    example={"fingerprint": {"seed": 0}, "parameters": 1000, "eval_loss_by_position": {"<1k": 2.5}}))
TRAIN_DOCS_FILE = "long_documents_train.json"
EVAL_DOCS_FILE = "long_documents_eval.json"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                  "generation_config.json", CONVERSATIONS_FILE, QUESTIONS_FILE, TRAIN_DOCS_FILE, EVAL_DOCS_FILE,
                  BUILD_INFO_FILE)


@dataclass(frozen=True)
class LongSize:
    """One preset: the base default target's size, the long documents and the training stages."""

    base: str  # the default target's size preset (data_prep/default_target.py SIZES)
    max_positions: int  # config.json max_position_embeddings of the result
    stages: tuple[tuple[int, int, int], ...]  # (row tokens, optimizer steps, rows per step), shortest first
    lr: float
    recall_every: int  # a recall turn after every this many conversations of a document
    eval_docs: int  # held-out documents of the longest stage's length for the loss by position
    eval_edges: tuple[int, ...]  # position-bucket edges of that loss

    @property
    def doc_tokens(self) -> int:
        return max(t for t, _, _ in self.stages)


SIZES_LONG = {
    # 330 CPU-s on 1 thread (docs/results/long-context.md "The long-context target"); rows of 20k tokens cost ~40 CPU-s a step
    "default": LongSize(base="default", max_positions=32768,
                        stages=((1024, 60, 4), (4096, 24, 1), (20480, 4, 1)), lr=2e-3, recall_every=4,
                        eval_docs=1, eval_edges=(1024, 4096, 16384)),
    # for tests: a few seconds on the default target's test size
    "test": LongSize(base="test", max_positions=4096, stages=((96, 3, 2), (384, 2, 1)), lr=3e-3, recall_every=2,
                     eval_docs=1, eval_edges=(64, 128)),
}


def long_context_target_dir(cache_dir: str | Path | None = None, size: str = "default") -> Path:
    """{cache_dir}/long-context-target[-{size}] (cache_dir default: `$EAGLE_HOME` or ~/.cache/eagle2-train)."""
    base = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    return base / ("long-context-target" if size == "default" else f"long-context-target-{size}")


def ensure_long_context_target(cache_dir: str | Path | None = None, *, size: str = "default", seed: int = 0,
                               rebuild: bool = False, progress: bool = True) -> Path:
    """The cached long-context target folder, built first (with the default target it starts from) when missing,
    incomplete or built from another preset, seed or base."""
    if size not in SIZES_LONG:
        raise ValueError(f"size={size!r}: expected one of {sorted(SIZES_LONG)}")
    preset = SIZES_LONG[size]
    base = ensure_default_target(cache_dir, size=preset.base, progress=progress)
    fingerprint = {"format_version": FORMAT_VERSION, "size": size, "seed": seed, **asdict(preset),
                   "base": read_build_info(base)["fingerprint"]}
    fingerprint = json.loads(json.dumps(fingerprint))  # tuples as lists: what the file holds when read back
    return build_cached(long_context_target_dir(cache_dir, size), fingerprint, REQUIRED_FILES, BUILD_INFO,
                        lambda tmp: build_long_context_target(base, tmp, preset, seed=seed, fingerprint=fingerprint,
                                                              progress=progress),
                        rebuild=rebuild, label="long-context target")


def read_long_build_info(target: str | Path) -> dict:
    """The fingerprint and build summary of a built long-context target."""
    return read_build_state(target, BUILD_INFO)


# ------------------------------------------------------------------------------------------------- documents


def rendered_length(tokenizer, turns: list[dict]) -> int:
    """Tokens of `turns` as the chat template renders them inside a conversation (without the leading BOS)."""
    ids = tokenizer.apply_chat_template(sharegpt_to_messages({"conversations": turns}), tokenize=True,
                                        return_dict=True)["input_ids"]
    return len(ids) - 1


def long_documents(tokenizer, records: list[dict], tokens: int, count: int, recall_every: int, seed: int,
                   prefix: str) -> list[dict]:
    """`count` ShareGPT documents of at least `tokens` rendered tokens each (module docstring): the records' turns
    one conversation after another (shuffled; reshuffled when used up), a recall turn (an earlier question of the
    same document again, with its answer) after every `recall_every` conversations."""
    if not records:
        raise ValueError("no conversations to build long documents from")
    rng = random.Random(seed)
    order: list[dict] = []
    docs = []
    for d in range(count):
        turns: list[dict] = []
        asked: list[tuple[dict, dict]] = []
        length, since_recall = 1, 0  # the BOS
        while length <= tokens:
            if not order:
                order = list(records)
                rng.shuffle(order)
            conv = order.pop()["conversations"]
            turns += conv
            length += rendered_length(tokenizer, conv)
            asked += [(conv[i], conv[i + 1]) for i in range(0, len(conv) - 1, 2)]
            since_recall += 1
            if since_recall == recall_every and len(asked) > 1:
                q, a = asked[rng.randrange(len(asked) - 1)]  # not the pair just asked
                turns += [q, a]
                length += rendered_length(tokenizer, [q, a])
                since_recall = 0
        docs.append({"id": f"{prefix}-{d}", "conversations": turns})
    return docs


def document_rows(tokenizer, docs: list[dict], tokens: int) -> torch.Tensor:
    """[len(docs), tokens + 1]: each document rendered with the chat template and cut to its first tokens + 1."""
    rows = []
    for doc in docs:
        ids = tokenizer.apply_chat_template(sharegpt_to_messages(doc), tokenize=True, return_dict=True)["input_ids"]
        if len(ids) < tokens + 1:
            raise ValueError(f"document {doc['id']!r}: {len(ids)} tokens, fewer than the row's {tokens + 1}")
        rows.append(ids[: tokens + 1])
    return torch.tensor(rows, dtype=torch.long)


@torch.no_grad()
def loss_by_position(model, rows: torch.Tensor, edges: tuple[int, ...]) -> dict[str, float]:
    """Mean next-token loss (nats) of the rows' predictions per bucket of the predicting position, labelled as
    evaluation/context_buckets.py labels prompt lengths ("<1k", "1k-4k", ...); one row at a time."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    model.eval()
    for row in rows:
        logits = model(input_ids=row[None, :-1]).logits[0]
        nll = torch.nn.functional.cross_entropy(logits, row[1:], reduction="none")
        for pos, value in enumerate(nll.tolist()):
            b = bucket_of(pos, list(edges))
            sums[b] = sums.get(b, 0.0) + value
            counts[b] = counts.get(b, 0) + 1
    return {b: round(sums[b] / counts[b], 4) for b in bucket_labels(list(edges)) if b in counts}


# ------------------------------------------------------------------------------------------------- build


def build_long_context_target(base: str | Path, out_dir: str | Path, preset: LongSize, *, seed: int = 0,
                              fingerprint: dict | None = None, progress: bool = True) -> Path:
    """Continue training the default target at `base` on long documents (module docstring); save to out_dir."""
    # lazy: transformers' model classes cost seconds at import; only building a target needs them
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

    base, out_dir = Path(base), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    started, cpu0 = time.time(), time.process_time()
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(base)
    config = AutoConfig.from_pretrained(base)
    config.max_position_embeddings = preset.max_positions
    model = LlamaForCausalLM.from_pretrained(base, config=config, dtype=torch.float32, attn_implementation="sdpa")
    base_size = SIZES[preset.base]
    train_records = default_conversations("train")[: base_size.max_conversations]
    eval_records = heldout_conversations()[: base_size.max_conversations]
    eval_docs = long_documents(tokenizer, eval_records, preset.doc_tokens, preset.eval_docs, preset.recall_every,
                               seed + 1, "long-eval")
    eval_rows = document_rows(tokenizer, eval_docs, preset.doc_tokens)
    base_loss = loss_by_position(LlamaForCausalLM.from_pretrained(base, config=config, dtype=torch.float32,
                                                                  attn_implementation="sdpa"),
                                 eval_rows, preset.eval_edges)
    train_docs, stages = [], []
    for i, (tokens, steps, batch) in enumerate(preset.stages):
        docs = long_documents(tokenizer, train_records, tokens, steps * batch, preset.recall_every, seed + 100 + i,
                              f"long-train-{tokens}")
        rows = document_rows(tokenizer, docs, tokens)
        stage = dataclasses.replace(base_size, block_size=tokens, batch_size=batch, steps=steps, lr=preset.lr)
        cpu_stage = time.process_time()
        losses = train_model(model, rows, stage, seed=seed + i, progress=progress)
        stages.append({"tokens": tokens, "steps": steps, "rows_per_step": batch, "loss_first": round(losses[0], 4),
                       "loss_last": round(losses[-1], 4), "cpu_s": round(time.process_time() - cpu_stage, 1)})
        train_docs += docs
    eval_loss = loss_by_position(model, eval_rows, preset.eval_edges)

    model.save_pretrained(out_dir)
    tokenizer.model_max_length = preset.max_positions
    tokenizer.save_pretrained(out_dir, save_jinja_files=False)
    tok_cfg = json.loads((base / "tokenizer_config.json").read_text())  # the base's template and class, unchanged
    tok_cfg["model_max_length"] = preset.max_positions
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False))
    for name in (CONVERSATIONS_FILE, QUESTIONS_FILE):
        shutil.copyfile(base / name, out_dir / name)
    (out_dir / TRAIN_DOCS_FILE).write_text(json.dumps(train_docs, indent=1, ensure_ascii=False))
    (out_dir / EVAL_DOCS_FILE).write_text(json.dumps(eval_docs, indent=1, ensure_ascii=False))
    info = {
        "fingerprint": fingerprint or {"format_version": FORMAT_VERSION, "seed": seed, **asdict(preset)},
        "base": str(base),
        "parameters": sum(p.numel() for p in model.parameters()),
        "max_position_embeddings": preset.max_positions,
        "stages": stages,
        "train_documents": len(train_docs),
        "eval_documents": len(eval_docs),
        "eval_tokens_per_document": preset.doc_tokens,
        "eval_loss_by_position": eval_loss,
        "base_eval_loss_by_position": base_loss,
        "cpu_s": round(time.process_time() - cpu0, 1),
        "wall_s": round(time.time() - started, 1),
        "torch": torch.__version__,
    }
    # written last: its presence (with a matching fingerprint) marks the folder as complete
    write_json_state(out_dir / BUILD_INFO_FILE, info, BUILD_INFO)
    return out_dir


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.long_context_target", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cache-dir", type=Path, default=None,
                   help="parent folder (default: $EAGLE_HOME or ~/.cache/eagle2-train), as the default target's")
    p.add_argument("--size", choices=sorted(SIZES_LONG), default="default")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rebuild", action="store_true", help="build even if a matching folder exists")
    args = p.parse_args(argv)
    target = ensure_long_context_target(args.cache_dir, size=args.size, seed=args.seed, rebuild=args.rebuild)
    info = read_long_build_info(target)
    print(json.dumps({k: info[k] for k in ("stages", "eval_loss_by_position", "base_eval_loss_by_position",
                                           "cpu_s", "wall_s")}, indent=1))
    print(target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
