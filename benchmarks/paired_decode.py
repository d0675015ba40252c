"""Paired decoding measurement on held-out paragraphs of a text file: vanilla vs each (head, decoding) in this
project's decoder, greedy, 1 thread, interleaved per prompt, every output checked identical to vanilla. Prints per
run tau, tokens/s, speed-up over vanilla with a bootstrap 95% CI (2000 resamples of the prompts), P(accept >= d) per
position, draft ms per round (docs/results/dflash.md).

    python -m benchmarks.paired_decode OPENINGS.txt FIRST N RUNS.json [RAW.json] [--vs LABEL[,LABEL...]]
    # RUNS: [[label, head_dir, DecodingConfig kwargs]]; --vs: each run's paired ratio vs those runs too
"""
import argparse
import json
import os
import time

import torch
from transformers import AutoTokenizer
from eagle import DecodingConfig, EaModel

ap = argparse.ArgumentParser(prog="python -m benchmarks.paired_decode", description=__doc__.splitlines()[0])
ap.add_argument("text")
ap.add_argument("first", type=int)
ap.add_argument("n", type=int)
ap.add_argument("runs", help="JSON file: [[label, head_dir, DecodingConfig kwargs], ...]")
ap.add_argument("raw", nargs="?", default="", help="write the per-prompt records here (JSON)")
ap.add_argument("--vs", default="", help="also give every run's paired tokens/s ratio vs these runs' labels "
                                        "(comma-separated), with its CI")
args = ap.parse_args()
torch.set_num_threads(1)
T = os.environ.get("TARGET", "../shared/models/stories260K")
tok = AutoTokenizer.from_pretrained(T)
paras = [p.strip() for p in open(args.text).read().split("\n\n") if p.strip()][args.first:args.first + args.n]
runs = json.loads(open(args.runs).read())
unknown = [v for v in args.vs.split(",") if v and v not in {label for label, _, _ in runs}]
if unknown:
    ap.error(f"--vs {unknown[0]!r}: no run of {args.runs} has that label")
models = {}
for label, head_dir, dec in runs:
    models[label] = (EaModel.from_pretrained(T, head_dir, torch_dtype=torch.float32), DecodingConfig(**dec))
res = {label: [] for label, _, _ in runs}
res["vanilla"] = []
base = next(iter(models.values()))[0]
for p in paras:
    ids = tok(p, return_tensors="pt").input_ids
    t0 = time.perf_counter(); out = base.naivegenerate(ids, max_new_tokens=128, eos_token_id=[1, 2]); dt = time.perf_counter() - t0
    res["vanilla"].append({"new": out.shape[1] - ids.shape[1], "s": dt})
    for label, (m, dec) in models.items():
        t0 = time.perf_counter()
        o, st = m.eagenerate(ids, max_new_tokens=128, eos_token_id=[1, 2], return_stats=True, decoding=dec)
        dt = time.perf_counter() - t0
        assert torch.equal(o, out), f"{label}: output differs from vanilla"
        acc = [r.accept_length for r in st.rounds]
        res[label].append({"new": o.shape[1] - ids.shape[1], "s": dt, "rounds": len(st.rounds), "tau": st.tau,
                           "acc": acc, "draft_s": sum(r.draft_s for r in st.rounds)})
g = torch.Generator().manual_seed(0)
van = torch.tensor([r["new"] / r["s"] for r in res["vanilla"]])
print(f"prompts {len(paras)}; load {os.getloadavg()}; vanilla tok/s {van.mean():.1f}")
for label in models:
    r = res[label]
    tps = torch.tensor([x["new"] / x["s"] for x in r])
    rounds = sum(x["rounds"] for x in r); new = sum(x["new"] for x in r)
    accs = [a for x in r for a in x["acc"]]
    maxd = max(accs)
    per_pos = [sum(a >= d for a in accs) / len(accs) for d in range(1, maxd + 1)]
    ratio = []
    for _ in range(2000):
        i = torch.randint(0, len(r), (len(r),), generator=g)
        ratio.append(float(tps[i].sum() / van[i].sum()))
    ratio.sort()
    vs = {}
    for other in [v for v in args.vs.split(",") if v and v != label]:
        ref = torch.tensor([x["new"] / x["s"] for x in res[other]])
        rv = sorted(float(tps[i].sum() / ref[i].sum())
                    for i in (torch.randint(0, len(r), (len(r),), generator=g) for _ in range(2000)))
        vs.update({f"vs_{other}": round(float(tps.sum() / ref.sum()), 3),
                   f"vs_{other}_ci95": [round(rv[50], 3), round(rv[1949], 3)]})
    print(json.dumps({"label": label, "tau": round(new / rounds, 3), "tok_s": round(float(tps.mean()), 1),
                      "speedup_vs_vanilla": round(float(tps.sum() / van.sum()), 3),
                      "ci95": [round(ratio[50], 3), round(ratio[1949], 3)],
                      "P(accept >= d)": [round(x, 3) for x in per_pos],
                      "draft_ms_per_round": round(1000 * sum(x["draft_s"] for x in r) / rounds, 3),
                      "mismatches": 0, **vs}))
if args.raw:
    json.dump(res, open(args.raw, "w"))
