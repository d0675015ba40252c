"""EAGLE-2 decoding at a real 7-8B shape on CPU: the round's non-forward overhead, verification cost at 60
nodes vs a one-token step, and a prompt longer than the head's max_position_embeddings.

    python -m benchmarks.real_shape_decode --recipe llama3-8b [--threads 1] [--rounds 12] [--context 512]

Target: the random-weight real-shape folder benchmarks/real_shape.py builds (the recipe target's hidden size,
vocabulary, attention and MLP sizes; --layers decoder layers), loaded in float32 and driven through the HF
decoder layers (`EaModel(..., fused_target=False)`: the path every real model takes). Head: a random EAGLE-2
head of the real shape (a random head is accepted rarely, so tau ~ 1; the per-round work is the same: the
dynamic tree always drafts depth x top_k nodes and verifies total_token of them).

1. Round overhead: every target forward (`Target.forward` + `Target.logits`) and every head forward
   (`HeadDecoder.forward` + the draft log-probs through the lm_head) is timed; overhead = round time - those,
   i.e. drafting bookkeeping, tree building, verification, cache compaction. Reported as a fraction of the round.
2. Verify cost: median `verify_s` of a 60-node round (forward + logits + acceptance + KV compaction) over the
   median vanilla step (one token: forward + logits + argmax) at the same context.
3. Long context: a prompt of --long-prompt tokens, past a head config of --head-positions positions (the
   released heads' 2048): EAGLE output identical to vanilla, and per-round acceptance identical to the same
   head under a config with 4x the target's positions (no position is clamped or wrapped).
Results: a table on stdout and JSON in --work/{recipe}/decode.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from eagle import EaModel
from eagle.decoding_config import DecodingConfig
from eagle.eagle2 import EagleHead


class Timed:
    """Wrap obj.name so every call's wall time is added to self.total (and counted)."""

    def __init__(self, obj, name: str):
        self.obj, self.name, self.inner = obj, name, getattr(obj, name)
        self.total, self.calls = 0.0, 0
        setattr(obj, name, self)

    def __call__(self, *a, **k):
        t = time.perf_counter()
        out = self.inner(*a, **k)
        self.total += time.perf_counter() - t
        self.calls += 1
        return out

    def restore(self):
        setattr(self.obj, self.name, self.inner)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.real_shape_decode", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="llama3-8b")
    p.add_argument("--work", default="/work/notes/plan/real_shape", help="where real_shape.py put the target")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--context", type=int, default=512, help="prompt tokens for the round / verify measurements")
    p.add_argument("--rounds", type=int, default=12, help="EAGLE rounds (= new tokens when tau ~ 1)")
    p.add_argument("--long-prompt", type=int, default=2100)
    p.add_argument("--head-positions", type=int, default=2048)
    p.add_argument("--long-new-tokens", type=int, default=6)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    # lazy: transformers' model classes cost seconds at import; --help does not need them
    from transformers import AutoModelForCausalLM

    work = Path(args.work) / args.recipe
    target = AutoModelForCausalLM.from_pretrained(work / "target", dtype=torch.float32, attn_implementation="sdpa").eval()
    torch.manual_seed(0)
    head = EagleHead.from_target(target, bias=True).eval()
    dyn = DecodingConfig(mode="dynamic", total_token=60, depth=5, top_k=10)
    model = EaModel(target, head, dyn, fused_target=False)
    assert model.target.fused is None  # the HF decoder-layer path
    vocab = target.config.vocab_size
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, vocab, (1, args.context), generator=g)
    out = {"recipe": args.recipe, "threads": args.threads, "context": args.context,
           "layers": target.config.num_hidden_layers}

    # -- 1. round overhead
    model.eagenerate(prompt[:, :32], max_new_tokens=2)  # warm-up (allocations)
    timers = [Timed(model.target, "forward"), Timed(model.target, "logits")]
    model.drafter.reset(64)  # the decoder exists: wrap its forward and its scoring (lm_head, log-softmax, top-k)
    timers += [Timed(model.drafter.decoder, "forward"), Timed(model.drafter.decoder, "topk")]
    t0 = time.perf_counter()
    ids, stats = model.eagenerate(prompt, max_new_tokens=args.rounds, return_stats=True)
    wall = time.perf_counter() - t0
    for tm in timers:
        tm.restore()
    rounds = stats.rounds
    round_s = sum(r.draft_s + r.verify_s + r.commit_s for r in rounds)
    forward_s = sum(tm.total for tm in timers) - stats.prefill_s  # minus the prefill's target forward + logits
    prefill_extend = rounds[0].draft_s - statistics.median(r.draft_s for r in rounds[1:]) if len(rounds) > 1 else 0.0
    overhead = round_s - forward_s
    out["round"] = {"rounds": len(rounds), "round_ms_median": 1e3 * statistics.median(r.draft_s + r.verify_s + r.commit_s for r in rounds[1:]),
                    "draft_ms_median": 1e3 * statistics.median(r.draft_s for r in rounds[1:]),
                    "verify_ms_median": 1e3 * statistics.median(r.verify_s for r in rounds[1:]),
                    "commit_ms_median": 1e3 * statistics.median(r.commit_s for r in rounds[1:]),
                    "forward_s": forward_s, "round_s": round_s, "overhead_s": overhead,
                    "overhead_fraction": overhead / round_s, "tau": len(ids[0][args.context:]) / len(rounds),
                    "first_round_prompt_extend_s": prefill_extend, "wall_s": wall}

    # -- 2. verify at 60 nodes vs a one-token step
    _, vstats = model.naivegenerate(prompt, max_new_tokens=args.rounds, return_stats=True)
    step = statistics.median(r.verify_s + r.commit_s for r in vstats.rounds)
    verify = statistics.median(r.verify_s for r in rounds[1:])
    out["verify"] = {"vanilla_step_ms": 1e3 * step, "verify60_ms": 1e3 * verify, "ratio": verify / step}
    same = torch.equal(model.naivegenerate(prompt, max_new_tokens=args.rounds), ids)
    out["lossless_round_run"] = same

    # -- 3. long prompt past the head's positions
    long_prompt = torch.randint(0, vocab, (1, args.long_prompt), generator=g)
    max_len = args.long_prompt + args.long_new_tokens + 1
    vanilla = model.naivegenerate(long_prompt, max_new_tokens=args.long_new_tokens, max_length=max_len)
    accepts = {}
    for positions in (args.head_positions, 4 * target.config.max_position_embeddings):
        head.config.max_position_embeddings = positions  # what a loaded config.json would say
        m = EaModel(target, EagleHead(head.config).eval(), dyn, fused_target=False)
        m.ea_layer.load_state_dict(head.state_dict())
        got, st = m.eagenerate(long_prompt, max_new_tokens=args.long_new_tokens, max_length=max_len, return_stats=True)
        assert torch.equal(got, vanilla), f"head positions {positions}: output differs from vanilla"
        accepts[positions] = [r.accept_length for r in st.rounds]
    out["long_context"] = {"prompt": args.long_prompt, "head_positions": args.head_positions,
                           "target_positions": target.config.max_position_embeddings, "lossless": True,
                           "accept_lengths": accepts[args.head_positions],
                           "same_as_unlimited_head": accepts[args.head_positions] == accepts[4 * target.config.max_position_embeddings]}
    (work / "decode.json").write_text(json.dumps(out, indent=1) + "\n")
    r, v, lc = out["round"], out["verify"], out["long_context"]
    print(f"{args.recipe} shape, {out['layers']}-layer random target (HF decoder layers, fp32, {args.threads} thread), "
          f"context {args.context}, EAGLE-2 60/5/10, random head (tau {r['tau']:.2f})")
    print(f"  round: median {r['round_ms_median']:.0f} ms (draft {r['draft_ms_median']:.0f}, verify {r['verify_ms_median']:.0f}, "
          f"commit {r['commit_ms_median']:.1f}); non-forward overhead {r['overhead_s'] * 1e3:.0f} ms of "
          f"{r['round_s'] * 1e3:.0f} ms over {r['rounds']} rounds = {r['overhead_fraction']:.1%}")
    print(f"  verify 60 nodes {v['verify60_ms']:.0f} ms vs one-token step {v['vanilla_step_ms']:.0f} ms: {v['ratio']:.2f}x; "
          f"output identical to vanilla: {same}")
    print(f"  long prompt {lc['prompt']} tokens > head positions {lc['head_positions']} (target {lc['target_positions']}): "
          f"lossless, accept lengths {lc['accept_lengths']} identical to an unlimited head: {lc['same_as_unlimited_head']}")
    return 0 if same and lc["same_as_unlimited_head"] else 1


if __name__ == "__main__":
    sys.exit(main())
