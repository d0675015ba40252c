"""How far a quantized target's hidden states move from the full-precision ones, per layer (issue 50's "measured
reason"): relative RMS difference of every HF hidden state (0 = embeddings, L = the final normed state the EAGLE-2
head reads), cosine similarity, and how often the two models' greedy next tokens agree, over text the target reads.

    python -m benchmarks.quantized_states --target ../shared/models/stories260K \
        --text ../shared/data/corpora/tinystories_val_a.txt --paragraphs 200 --methods int8 int4 int4-g32

Both models run on the same token ids (the full-precision target's own tokenisation of the paragraphs), teacher
forced, so the differences are the quantization's alone, not a divergence of generated text.
"""
from __future__ import annotations

import argparse
import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from data_prep.corpus_cache import read_paragraphs
from eagle.quantization import QUANT_METHODS, quantize_target


@torch.no_grad()
def states(model, ids: list[list[int]]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(per hidden-state index: the states of every token [N, H], concatenated over records; greedy next ids [N])."""
    per_layer, greedy = None, []
    for seq in ids:
        out = model(torch.tensor([seq]), output_hidden_states=True)
        hs = [h[0] for h in out.hidden_states]  # L + 1 of [T, H]; the last one is after the final norm
        per_layer = [[h] for h in hs] if per_layer is None else [acc + [h] for acc, h in zip(per_layer, hs)]
        greedy.append(out.logits[0].argmax(-1))
    return [torch.cat(h) for h in per_layer], torch.cat(greedy)


def compare(full: tuple, quant: tuple) -> dict:
    rows = []
    for i, (a, b) in enumerate(zip(full[0], quant[0])):
        rel = float((b - a).pow(2).sum().sqrt() / a.pow(2).sum().sqrt())
        cos = float(torch.nn.functional.cosine_similarity(a, b, dim=-1).mean())
        rows.append({"state": i, "relative_rms": rel, "cosine": cos})
    return {"layers": rows, "greedy_agreement": float((full[1] == quant[1]).float().mean()),
            "tokens": int(full[1].numel())}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.quantized_states", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--text", required=True, help="UTF-8 text, paragraphs separated by blank lines")
    p.add_argument("--paragraphs", type=int, default=200, help="the first N paragraphs (teacher forced)")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens kept per paragraph")
    p.add_argument("--methods", nargs="+", default=["int8", "int4"], choices=[m for m in QUANT_METHODS if m != "none"])
    p.add_argument("--json", default=None, help="also write the numbers here")
    args = p.parse_args(argv)
    tok = AutoTokenizer.from_pretrained(args.target)
    ids = [tok(t)["input_ids"][: args.max_tokens] for t in read_paragraphs(args.text, args.paragraphs) if t]
    load = lambda: AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()  # noqa: E731
    full = states(load(), ids)
    out = {}
    for name in args.methods:
        out[name] = r = compare(full, states(quantize_target(load(), name), ids))
        print(f"{name}: greedy next token agrees on {r['greedy_agreement']:.3f} of {r['tokens']} positions; per "
              "hidden state (0 = embeddings, last = final normed) relative RMS / cosine: "
              + ", ".join(f"{x['state']}: {x['relative_rms']:.3f}/{x['cosine']:.4f}" for x in r["layers"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
