"""A thinking variant of the embedded default target, for measuring heads on reasoning targets (issue 41).

    python -m benchmarks.thinking_target OUT_DIR [--steps 300] [--seed 0]

Trains the default target's architecture and budget (data_prep/default_target.py, preset `default`) on the same
stdlib-docstring conversations, rendered with the shipped `qwen3` template, where every assistant reply starts with a
short reasoning block: ``<think>\\nThe user asks about `NAME`. It is in the `MODULE` module. Recall its docstring,
then answer in a sentence or two.\\n</think>\\n\\n`` + the reply (Qwen3's rule drops it from earlier turns). The
reasoning is formulaic, as much of a real model's is; the model learns to open every answer with it, so the pipeline
regenerates on-policy replies with their own reasoning and evaluation sees reasoning and answer spans.

OUT_DIR gets a normal HF folder (config, weights, tokenizer with the qwen3 template, generation_config) plus
`conversations_train.json` (the plain conversations: regeneration writes the reasoning) and `questions_eval.jsonl`,
like the default target's folder. docs/results/reasoning-mask.md shows the commands that use it.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from data_prep.default_target import (SIZES, build_model, evaluate_loss, heldout_conversations, pack_conversations,
                                      train_model)
from data_prep.docstring_corpus import default_conversations, default_questions
from recipes.chat_templates import read_template

SPECIALS = ["<|im_start|>", "<|im_end|>", "<|pad|>"]
THINK_TOKENS = ["<think>", "</think>"]  # added, not special: decoded replies keep them (as Qwen3's tokenizer does)


def reasoning_for(record: dict, turn: int) -> str:
    """The formulaic reasoning a reply starts with: what the question is about and where it lives."""
    question = record["conversations"][turn]["value"]
    name = question.split("`")[1] if question.count("`") >= 2 else record["id"].split("-", 2)[-1]
    module = name.rsplit(".", 1)[0] if "." in name else name
    return (f"The user asks about `{name}`. It is in the `{module}` module. Recall its docstring, then answer in a "
            "sentence or two.")


def with_reasoning(record: dict) -> dict:
    turns = []
    for i, t in enumerate(record["conversations"]):
        if t["from"] == "gpt":
            t = {**t, "value": f"<think>\n{reasoning_for(record, i - 1)}\n</think>\n\n{t['value']}"}
        turns.append(t)
    return {**record, "conversations": turns}


def train_tokenizer(records: list[dict], vocab_size: int):
    """Byte-level BPE on the conversations' text (as the default target's), ChatML specials, the qwen3 template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - len(THINK_TOKENS), special_tokens=SPECIALS,
                                  show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator((t["value"] for r in records for t in r["conversations"]), trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|pad|>")
    tok.add_tokens(THINK_TOKENS, special_tokens=False)
    tok.chat_template = read_template("qwen3")
    tok.model_max_length = 2048
    return tok


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.thinking_target", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path, help="folder to write the thinking target to")
    p.add_argument("--steps", type=int, default=SIZES["default"].steps, help="optimizer steps (the default target's)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from transformers import GenerationConfig

    started, cpu0 = time.time(), time.process_time()
    torch.manual_seed(args.seed)
    preset = dataclasses.replace(SIZES["default"], steps=args.steps)
    plain = default_conversations("train")
    train_records = [with_reasoning(r) for r in plain]
    eval_records = [with_reasoning(r) for r in heldout_conversations()]
    tok = train_tokenizer(train_records, preset.vocab_size)
    rows = pack_conversations(tok, train_records, preset.block_size)
    model = build_model(preset, tok)
    losses = train_model(model, rows, preset, seed=args.seed, progress=False)
    eval_loss = evaluate_loss(model, pack_conversations(tok, eval_records, preset.block_size), preset.batch_size)
    model.generation_config = GenerationConfig(eos_token_id=[tok.eos_token_id], pad_token_id=tok.pad_token_id,
                                               do_sample=False)
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tok.save_pretrained(args.out)
    (args.out / "conversations_train.json").write_text(json.dumps(plain, indent=1, ensure_ascii=False))
    with open(args.out / "questions_eval.jsonl", "w") as f:
        for q in default_questions("eval"):
            f.write(json.dumps(q, ensure_ascii=False) + "\n")
    q = default_questions("eval")[0]["turns"][0]
    ids = tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=64, do_sample=False, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)
    info = {"steps": args.steps, "train_loss_last": sum(losses[-10:]) / len(losses[-10:]), "eval_loss": eval_loss,
            "parameters": sum(p.numel() for p in model.parameters()), "wall_s": round(time.time() - started, 1),
            "cpu_s": round(time.process_time() - cpu0, 1),
            "sample": {"question": q, "answer": tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)}}
    (args.out / "thinking_target.json").write_text(json.dumps(info, indent=1))
    print(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
