"""Why does a dynamic (EAGLE-2) tree lose or win against the static (EAGLE-1) tree on a head? Three checks, T = 0.

1. Node for node: on every round of a static-tree decode, the dynamic tree is drafted from the same drafter state
   with every candidate kept; each static node that is also a dynamic candidate (same token path) must carry the
   same draft probability (the two builders run the head on the same features, positions and masks).
2. tau and tree depth of EAGLE-1, raw EAGLE-2 (the published rule: rank by the product of draft probabilities)
   and EAGLE-2 ranked by a tree-score map fitted here (evaluation/autotune.fit_tree_calibration) on other prompts.
3. What predicts acceptance: P(accepted | parent accepted) of the raw 60/5/10 tree's nodes by depth, by sibling
   rank and by draft probability within rank 0 and ranks > 0.

    python -m benchmarks.tree_diagnosis --target TARGET --head HEAD [--questions Q.jsonl] [--prompts 16]

Prompts: the question file's first turns (default: the default target's questions_eval.jsonl); checks 1 and 3 and
the fit use questions 53 .. 52 + prompts (what the demo's calibration uses), tau is measured on questions 1-48.
"""
from __future__ import annotations

import argparse
import collections
from pathlib import Path

import numpy as np
import torch

from eagle import DecodingConfig, EaModel
from eagle.static_trees import static_choices
from eagle.tree import DraftTree, StaticTreeSpec
from evaluation.autotune import fit_tree_calibration
from evaluation.calibration import calibrate, node_outcomes
from evaluation.chat_format import ChatFormat
from evaluation.questions import load_questions
from evaluation.runner import GenerationArgs


def token_path(tree: DraftTree, i: int) -> tuple[int, ...]:
    toks, parents, out = tree.tokens.tolist(), tree.parents.tolist(), []
    while i > 0:
        out.append(toks[i])
        i = parents[i]
    return tuple(reversed(out))


def node_for_node(model: EaModel, prompts: list, gen: GenerationArgs) -> collections.Counter:
    """Check 1: wrap draft_static so every round also drafts the full dynamic candidate set from the same state."""
    static = model.drafter.draft_static
    counts: collections.Counter = collections.Counter()

    def both(root, feature, spec):
        st = static(root, feature, spec)
        dyn = model.drafter.draft_dynamic(root, feature, 1 + 10 + 5 * 100, 5, 10)  # every candidate kept
        probs = {token_path(dyn, i): float(dyn.prob[i]) for i in range(1, dyn.size)}
        for i in range(1, st.size):
            key = token_path(st, i)
            if key not in probs:
                counts["static node outside the dynamic frontier"] += 1
            elif abs(probs[key] - float(st.prob[i])) > 1e-5:
                counts["same node, different probability"] += 1
            else:
                counts["same node, same probability"] += 1
        return st

    model.drafter.draft_static = both
    try:
        for p in prompts:
            model.eagenerate(torch.tensor([p]), decoding=DecodingConfig(mode="static"),
                             max_new_tokens=gen.max_new_tokens, eos_token_id=gen.eos_token_id)
    finally:
        model.drafter.draft_static = static
    return counts


def decode(model: EaModel, prompts: list, decoding: DecodingConfig, gen: GenerationArgs) -> tuple[float, list]:
    committed, rounds = 0, []
    for p in prompts:
        _, stats = model.eagenerate(torch.tensor([p]), decoding=decoding, max_new_tokens=gen.max_new_tokens,
                                    eos_token_id=gen.eos_token_id, return_stats=True)
        committed += sum(r.new_tokens for r in stats.rounds)
        rounds += stats.rounds
    return committed / len(rounds), rounds


def acceptance_tables(rounds: list) -> list[str]:
    prob, depth, rank, acc = node_outcomes(rounds)
    lines = ["| depth | nodes | mean draft prob | accepted |", "|---|---|---|---|"]
    lines += [f"| {d} | {int((depth == d).sum())} | {prob[depth == d].mean():.3f} | {acc[depth == d].mean():.3f} |"
              for d in range(1, int(depth.max()) + 1)]
    lines += ["", "| sibling rank | nodes | mean draft prob | accepted |", "|---|---|---|---|"]
    lines += [f"| {r} | {int((rank == r).sum())} | {prob[rank == r].mean():.3f} | {acc[rank == r].mean():.3f} |"
              for r in range(int(rank.max()) + 1) if (rank == r).any()]
    lines += ["", "| draft prob | rank 0: nodes | mean prob | accepted | ranks > 0: nodes | mean prob | accepted |",
              "|---|---|---|---|---|---|---|"]
    edges = [0, .02, .05, .1, .2, .3, .5, .7, 1.0001]
    for lo, hi in zip(edges, edges[1:]):
        cells = []
        for sel in ((rank == 0), (rank > 0)):
            s = sel & (prob >= lo) & (prob < hi)
            cells += [str(int(s.sum())), f"{prob[s].mean():.3f}" if s.any() else "–", f"{acc[s].mean():.3f}" if s.any() else "–"]
        lines.append(f"| [{lo:.2f}, {min(hi, 1):.2f}) | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.tree_diagnosis", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--head", required=True)
    ap.add_argument("--questions", default=None, help="default: TARGET/questions_eval.jsonl")
    ap.add_argument("--prompts", type=int, default=16, help="held-out prompts for checks 1 and 3 and the fit")
    ap.add_argument("--bench", type=int, default=48, help="prompts tau is measured on (the first ones)")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = EaModel.from_pretrained(args.target, args.head, torch_dtype=torch.float32)
    model.calibrations = []  # fitted below, never the saved one
    questions = load_questions(args.questions or str(Path(args.target) / "questions_eval.jsonl"))
    fmt = ChatFormat(model.tokenizer, None, "\n")
    held_out = [fmt.first_prompt(q.turns[0]) for q in questions[52: 52 + args.prompts]]
    bench = [fmt.first_prompt(q.turns[0]) for q in questions[: args.bench]]
    gen = GenerationArgs(max_new_tokens=args.max_new_tokens, max_length=2048, eos_token_id=[model.tokenizer.eos_token_id])

    print("## 1. static tree vs dynamic candidates, node for node\n")
    print(", ".join(f"{k}: {v}" for k, v in node_for_node(model, held_out, gen).items()) + "\n")
    print("## 3. what predicts acceptance (raw EAGLE-2 60/5/10, held-out prompts, nodes with an accepted parent)\n")
    _, raw_rounds = decode(model, held_out, DecodingConfig(calibrate=False), gen)
    print("\n".join(acceptance_tables(raw_rounds)) + "\n")
    fit_tree_calibration(model, held_out, DecodingConfig(), gen, progress=False)
    print(f"## 2. tau on {len(bench)} prompts (map fitted on the {len(held_out)} held-out ones)\n")
    print("| tree | tau | mean deepest node | ECE raw path prob (bins) | ECE calibrated path score (bins) |")
    print("|---|---|---|---|---|")
    for name, dec in [("EAGLE-1 mc_sim_7b_63 (26 nodes)", DecodingConfig(mode="static")),
                      ("EAGLE-2 60/5/10 raw", DecodingConfig(calibrate=False)),
                      ("EAGLE-2 60/5/10 calibrated", DecodingConfig()),
                      ("EAGLE-2 26/5/10 raw", DecodingConfig(total_token=26, calibrate=False)),
                      ("EAGLE-2 26/5/10 calibrated", DecodingConfig(total_token=26))]:
        tau, rounds = decode(model, bench, dec, gen)
        cal = calibrate(rounds)
        after = f"{cal['path_score'].ece:.3f} ({cal['path_score'].ece_bins:.3f})" if "path_score" in cal else "–"
        print(f"| {name} | {tau:.2f} | {np.mean([int(r.node_depth.max()) for r in rounds]):.2f} | "
              f"{cal['path_prob'].ece:.3f} ({cal['path_prob'].ece_bins:.3f}) | {after} |", flush=True)


if __name__ == "__main__":
    main()
