"""Openings for a stories260K measurement corpus when TinyStories is not at hand: stories260K's own samples from BOS
(T = 1, 24 tokens each), one paragraph each, blank-line separated (train.corpus_cache's --text format).

    python -m benchmarks.stories_openings OUT.txt [--n 1000] [--seed 48]
"""
from __future__ import annotations

import argparse

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.stories_openings", description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--target", default="../shared/models/stories260K")
    ap.add_argument("--n", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=48)
    a = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(a.target)
    model = AutoModelForCausalLM.from_pretrained(a.target, dtype=torch.float32).eval()
    torch.manual_seed(a.seed)
    out = []
    with torch.no_grad():
        for start in range(0, a.n, 100):
            ids = torch.full((min(100, a.n - start), 1), tok.bos_token_id)
            g = model.generate(ids, do_sample=True, temperature=1.0, max_new_tokens=24, min_new_tokens=24,
                               pad_token_id=0)
            out += [tok.decode(r[1:], skip_special_tokens=True).strip().replace("\n", " ") for r in g]
    with open(a.out, "w") as f:
        f.write("\n\n".join(o for o in out if o) + "\n")


if __name__ == "__main__":
    main()
