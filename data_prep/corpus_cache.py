"""Feature cache from a plain-text corpus: for base LMs without a chat template (e.g. stories260K).

    python -m train.corpus_cache --recipe stories260k --text ../shared/data/corpora/tinystories_val_a.txt --first 3000

Records are the blank-line separated paragraphs of the file (the first N with --first, so the rest stays
unseen for evaluation prompts), tokenised with the target's tokenizer (its BOS added), truncated to
data.max_length, loss on every token. Written with data_prep's FeatureCacheWriter to the trainer's cache
directory ({output_dir}/data/features) with the same meta data_prep writes, so the trainer's target check
applies. Resumable: paragraphs already in the cache are skipped. With `head.kind: eagle3` the cache holds the
three `head.aux_layers` states + the final state per token (data_prep/feature_layers.py), e.g.

    python -m train.corpus_cache --recipe stories260k-eagle3 --text ../shared/data/corpora/tinystories_val_a.txt --first 3000 --continue-with-target 160

On-policy variant (`--continue-with-target N`, the raw-text analogue of data_prep's regeneration): each
record is the paragraph's opening sentence followed by the TARGET's own continuation (greedy, or sampled
with --temperature) of up to N tokens, loss on the continuation only. The head then learns the text it will
draft at decoding time instead of human text the target would not have written.

    python -m train.corpus_cache --recipe stories260k --text ../shared/data/corpora/tinystories_val_a.txt --first 3000 --continue-with-target 160
"""
from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from data_prep.cache_features import check_disk
from data_prep.chat_template import stop_token_ids
from data_prep.feature_cache import FeatureCacheWriter
from data_prep.feature_layers import feature_layers, target_features
from data_prep.target import (load_target_model, load_target_tokenizer, quantization_meta, resolve_target_path,
                              target_config_hash)
from eagle.cli_errors import ArgumentParser, bounded, one_line_errors
from eagle.device import pick_device
from eagle.run_lock import run_lock
from recipes import add_print_config, command_config, layout


def read_paragraphs(path: str | Path, first: int = 0) -> list[str | None]:
    """Non-empty blank-line separated paragraphs of a UTF-8 text file (the first `first`; 0 = all). A paragraph
    that is not valid UTF-8 is None (a rejected record: counted, and the other paragraphs keep their ids)."""
    paras = []
    for raw in Path(path).read_bytes().split(b"\n\n"):
        try:
            text = raw.decode("utf-8").strip()
        except UnicodeDecodeError:
            if raw.strip():
                paras.append(None)
            continue
        if text:
            paras.append(text)
    return paras[:first] if first else paras


def opening_sentence(paragraph: str) -> str:
    """Up to and including the first sentence end (. ! ?) followed by a space; the whole text if none."""
    m = re.search(r"[.!?](?=\s)", paragraph)
    return paragraph[: m.end()] if m else paragraph


@torch.no_grad()
def continue_with_target(model, prompts: list[list[int]], max_new_tokens: int, stop_ids: list[int],
                         temperature: float, seed: int) -> list[list[int]]:
    """The target's continuation of each prompt (token ids, first stop token included, if any)."""
    device = next(model.parameters()).device
    T = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), T, dtype=torch.long)
    attn = torch.zeros(len(prompts), T, dtype=torch.long)
    for b, p in enumerate(prompts):  # left padding: every row's last prompt token is at T - 1
        ids[b, T - len(p):] = torch.tensor(p)
        attn[b, T - len(p):] = 1
    kw = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else dict(do_sample=False)
    if temperature > 0:
        torch.manual_seed(seed)
    out = model.generate(input_ids=ids.to(device), attention_mask=attn.to(device), max_new_tokens=max_new_tokens,
                         eos_token_id=stop_ids or None, pad_token_id=0, **kw)[:, T:].cpu()
    conts = []
    for row in out.tolist():
        cut = next((j + 1 for j, t in enumerate(row) if t in stop_ids), len(row))
        conts.append(row[:cut])
    return conts


@torch.no_grad()
def build_corpus_cache(cfg, text_file: str | Path, first: int = 0, batch_size: int = 16, progress: bool = True,
                       continue_tokens: int = 0, temperature: float = 0.0) -> dict:
    """Cache the target's final hidden states for every paragraph (continue_tokens > 0: for its opening
    sentence + the target's own continuation, loss on the continuation); returns the cache manifest."""
    target_path = resolve_target_path(cfg.target)
    tokenizer = load_target_tokenizer(cfg.target, target_path, need_template=False)  # raw text
    model = load_target_model(cfg.target, pick_device(cfg.data.device), target_path)
    decoder = getattr(model, model.base_model_prefix)
    device = next(model.parameters()).device
    meta = {"target": target_path, "config_hash": target_config_hash(model.config),
            "hidden_size": int(model.config.hidden_size), "vocab_size": int(model.config.vocab_size),
            "target_dtype": cfg.target.dtype, "source": f"text:{Path(text_file).name}" + (f"[:{first}]" if first else "")}
    meta.update(quantization_meta(cfg.target))  # a quantized target's states (none: the legacy meta)
    layers = feature_layers(cfg.head, model.config)  # None for eagle2 (final state only: the legacy meta)
    if layers is not None:
        meta["feature_layers"] = layers
    if continue_tokens:
        meta["source"] += f" openings + target continuations ({continue_tokens} tokens, T={temperature})"
        stop_ids = sorted(set(stop_token_ids(tokenizer, model.generation_config)) | {int(i) for i in cfg.data.extra_stop_ids})
    writer = FeatureCacheWriter(layout.cache_dir(cfg), meta, dtype=cfg.data.cache_dtype)
    paragraphs = read_paragraphs(text_file, first)
    rejected = [f"p{i:06d}" for i, p in enumerate(paragraphs) if p is None]
    if rejected:
        print(f"[corpus_cache] {text_file}: {len(rejected)} of {len(paragraphs)} paragraphs are not valid UTF-8 and are "
              f"skipped: {rejected[:5]}{' ...' if len(rejected) > 5 else ''}", flush=True)
    if len(rejected) == len(paragraphs):
        raise ValueError(f"{text_file}: no usable paragraph (need UTF-8 text, paragraphs separated by blank lines)")
    todo = [(f"p{i:06d}", p) for i, p in enumerate(paragraphs) if p is not None and f"p{i:06d}" not in writer]
    rough = sum(min(len(tokenizer(opening_sentence(p) if continue_tokens else p)["input_ids"]) + continue_tokens,
                    cfg.data.max_length) for _, p in todo)  # upper bound with continuations
    check_disk(layout.cache_dir(cfg), rough, meta["hidden_size"], cfg.data.cache_dtype, cfg.data.disk_headroom_gb, layers)
    start = time.perf_counter()
    for k in tqdm(range(0, len(todo), batch_size), desc="cache", disable=not progress):
        chunk = todo[k : k + batch_size]
        encoded = [tokenizer(opening_sentence(p) if continue_tokens else p)["input_ids"][: cfg.data.max_length]
                   for _, p in chunk]
        n_prompt = [len(e) for e in encoded]
        if continue_tokens:
            conts = continue_with_target(model, encoded, continue_tokens, stop_ids, temperature, cfg.seed + k)
            encoded = [(e + c)[: cfg.data.max_length] for e, c in zip(encoded, conts)]
        T = max(len(e) for e in encoded)
        ids = torch.zeros(len(chunk), T, dtype=torch.long)
        attn = torch.zeros(len(chunk), T, dtype=torch.long)
        for b, e in enumerate(encoded):
            ids[b, : len(e)] = torch.tensor(e)
            attn[b, : len(e)] = 1
        hidden = target_features(decoder, ids.to(device), attn.to(device), layers)  # [B, T, W]
        for b, (rid, _) in enumerate(chunk):
            n = len(encoded[b])
            loss = torch.ones(n, dtype=torch.long)
            if continue_tokens:
                loss[: n_prompt[b]] = 0  # the human-written opening is context, not something to draft
            writer.add(rid, ids[b, :n], hidden[b, :n].float().cpu(), loss)
    manifest = writer.close()
    manifest["seconds"] = time.perf_counter() - start
    manifest["rejected_paragraphs"] = rejected
    return manifest


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m train.corpus_cache", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", required=True)
    p.add_argument("overrides", nargs="*", metavar="key=value")
    p.add_argument("--text", required=True, help="UTF-8 text file, paragraphs separated by blank lines")
    p.add_argument("--first", type=bounded(int, at_least=0), default=0, metavar="N",
                   help="use only the first N paragraphs (0 = all; the paragraphs after them stay unseen for evaluation)")
    p.add_argument("--batch-size", type=bounded(int, at_least=1), default=16, metavar="N")
    p.add_argument("--continue-with-target", type=bounded(int, at_least=0), default=0, metavar="N",
                   help="on-policy records: opening sentence + the target's own continuation of up to N tokens")
    p.add_argument("--temperature", type=bounded(float, at_least=0), default=0.0,
                   help="continuations: 0 = greedy, else sampled")
    add_print_config(p)
    args = p.parse_args(argv)
    cfg = command_config(args)
    with run_lock(layout.cache_dir(cfg).parent, "shard0of1", "data prep"):  # the lock data_prep/main.py takes there
        m = build_corpus_cache(cfg, args.text, args.first, args.batch_size, continue_tokens=args.continue_with_target,
                               temperature=args.temperature)
    print(f"cache: {m['num_records']} records, {m['num_tokens']} tokens, {m['bytes_on_disk']:,} bytes "
          f"({m['seconds']:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
