"""What one speculative round costs, in single-token target steps, on stories260K or the embedded default
target (one thread, inference_mode).

Each piece is timed in isolation (best of 9 bursts, so noise from other jobs is mostly excluded), then
a full generation loop over 10 prompts gives the real round cost. A round pays off when it costs less
than tau single-token steps.

    python -m benchmarks.step_costs --head HEAD --total-token 16 --depth 4 --top-k 2
    python -m benchmarks.step_costs --default-target [--head runs/tiny/head]   # the quickstart's target
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

from benchmarks.decode_bench import STOP_IDS, corpus_context, load_stories, story_prompts
from data_prep import default_target  # used through the module: a test swaps in a small build
from eagle import DecodingConfig, EaModel, EagleHead
from eagle.verify import verify_greedy

REPO = Path(__file__).resolve().parent.parent


def best_ms(fn, calls: int = 400, bursts: int = 9) -> float:
    for _ in range(20):
        fn()
    times = []
    for _ in range(bursts):
        t = time.perf_counter()
        for _ in range(calls // bursts):
            fn()
        times.append((time.perf_counter() - t) / (calls // bursts) * 1e3)
    return min(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.step_costs", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shared", default=os.environ.get("EAGLE_SHARED_DIR", str(REPO.parent / "shared")))
    p.add_argument("--head", default=None, help="stories260K head folder (default: ../heads/stories260K-head)")
    p.add_argument("--total-token", type=int, default=16)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--context", type=int, default=200, help="committed tokens when timing the pieces")
    p.add_argument("--default-target", action="store_true",
                   help="time the embedded default target ($EAGLE_HOME cache; built if missing) instead of "
                        "stories260K; "
                        "--head defaults to a random head there (costs, not tau, are what it measures then)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    with torch.inference_mode():  # as EaModel decodes
        return measure(args)


def measure(args) -> int:
    shared = Path(args.shared)
    if args.default_target:
        model, head_what, prompt, prompts, stop_ids, name = load_default_target(args.head, args.context)
    else:
        if not (shared / "models" / "stories260K" / "config.json").exists():
            print(f"needs {shared}/models/stories260K", file=sys.stderr)
            return 2
        model, tok, head_what = load_stories(shared, args.head)
        prompt, prompts = corpus_context(shared, tok, args.context), story_prompts(shared, tok, 10)
        stop_ids, name = STOP_IDS, "stories260K"
    target, drafter = model.target, model.drafter
    tt, depth, k = args.total_token, args.depth, args.top_k
    target.reset(args.context + 200)
    drafter.reset(args.context + 200)
    hidden = target.forward(prompt)
    feature = drafter.extend(hidden, prompt)
    root, past, committed = prompt[0, -1:], target.length, drafter.length
    tree = drafter.draft_dynamic(root, feature, tt, depth, k)
    positions = tree.position_ids(past)
    verified = target.forward(tree.tokens[None], positions, tree.attention_mask())
    target.truncate(past)

    def one_step():
        target.forward(root[None])
        target.truncate(past)

    def verify_forward():
        target.forward(tree.tokens[None], positions, tree.attention_mask())
        target.truncate(past)

    def extend():
        drafter.extend(hidden[:, :5], prompt[:, :5])
        drafter.decoder.truncate(committed)

    def head_forward():
        mask = torch.ones(k, committed + k, dtype=torch.bool)
        drafter.decoder.forward(feature.expand(k, -1), prompt[0, :k], committed, mask)
        drafter.decoder.truncate(committed)

    def accept():
        path, _ = verify_greedy(tree, target.logits(verified[0]))
        target.cache.truncate(past + tree.size)
        target.keep(past, path)
        target.truncate(past)

    pieces = {
        "target forward, 1 token": one_step,
        f"target forward, {tree.size}-node tree": verify_forward,
        "draft: extend (5 accepted tokens)": extend,
        f"draft: one head forward ({k} rows)": head_forward,
        f"draft: whole tree {tt}/{depth}/{k} (levels, top-k, rerank)": lambda: drafter.draft_dynamic(root, feature, tt, depth, k),
        "logits + verify_greedy + keep": accept,
    }
    times = {name: best_ms(fn) for name, fn in pieces.items()}
    unit = times["target forward, 1 token"]
    print(f"{name}, head {head_what}, context {args.context}, one thread")
    for name, ms in times.items():
        print(f"  {name:55s} {ms:6.3f} ms  {ms / unit:5.2f} steps")

    decoding = DecodingConfig(mode="dynamic", total_token=tt, depth=depth, top_k=k)
    for q in prompts[:2]:
        model.eagenerate(q, max_new_tokens=32, eos_token_id=stop_ids, decoding=decoding)
    best = None
    for _ in range(3):
        t, rounds, tokens = time.perf_counter(), 0, 0
        for q in prompts:
            _, n, r = model.eagenerate(q, max_new_tokens=128, eos_token_id=stop_ids, decoding=decoding, log=True)
            rounds, tokens = rounds + r, tokens + n
        ms = (time.perf_counter() - t) * 1e3 / rounds
        best = ms if best is None else min(best, ms)
    tau = tokens / rounds
    print(f"  {'full generation loop, per round (best of 3)':55s} {best:6.3f} ms  {best / unit:5.2f} steps   "
          f"tau {tau:.2f}: a round pays off below {tau:.2f} steps")
    return 0


def load_default_target(head_arg: str | None, context: int):
    """(EaModel, head description, a [1, context] token context, 10 held-out chat prompts, stop ids, name)."""
    # lazy: transformers' model classes cost seconds at import; --help does not need them
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_target.ensure_default_target()
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    tok = AutoTokenizer.from_pretrained(path)
    if head_arg:
        head, what = EagleHead.from_pretrained(head_arg, dtype=torch.float32), f"trained head {head_arg}"
    else:
        torch.manual_seed(0)
        head, what = EagleHead.from_target(base), "RANDOM head (piece costs only; tau is not meaningful)"
    text = " ".join(t["value"] for r in json.loads((path / default_target.CONVERSATIONS_FILE).read_text())[:200]
                    for t in r["conversations"])
    ctx = tok(text[: 20 * context], return_tensors="pt").input_ids[:, :context]  # [1, context]
    questions = [json.loads(line) for line in (path / default_target.QUESTIONS_FILE).read_text().splitlines()[:10]]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q["turns"][0]}], add_generation_prompt=True,
                                       return_tensors="pt", return_dict=True)["input_ids"] for q in questions]
    c = base.config
    name = f"default target ({c.num_hidden_layers} layers x {c.hidden_size}, vocab {c.vocab_size})"
    return EaModel(base, head.eval()), what, ctx, prompts, [tok.eos_token_id], name


if __name__ == "__main__":
    raise SystemExit(main())
