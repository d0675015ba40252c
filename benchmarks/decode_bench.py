"""Decode speed: vanilla step time vs context length, and the EAGLE-2 per-round time breakdown.

    python -m benchmarks.decode_bench [--shared ../shared] [--head DIR] [--threads 1] [--repeats 5] [--json FILE]

Results: a table on stdout and JSON in outputs/decode_bench.json (or --json).

1. Vanilla ms per decode step (`naivegenerate`, i.e. the library's Target + preallocated KV cache) at
   contexts 64 / 256 / 480 on ../shared/models/stories260K and 64 / 1024 / 2048 on a random tiny Llama.
   A step must not cost more as the context grows (no cache copies): "flat" = max/min of the medians <= 1.15.
   Control: the same steps with attention capped at the first 64 keys show what grows besides attention.
2. EAGLE-2 at total_token 60 / depth 5 / top_k 10 on stories260K: median per-round time split into
   draft / verify / bookkeeping (RoundStats.draft_s / verify_s / commit_s), tau, ms per token of
   EAGLE and of vanilla (decode only, prefill excluded), and the speedup. Prompts are TinyStories
   paragraph openings from the END of tinystories_val_a.txt (the stories260k recipe never trains on
   them); generation stops at ids {1, 2} or 128 new tokens. EAGLE and vanilla calls alternate
   prompt by prompt so machine-load drift hits both; outputs are checked token-identical.
   Head: --head, else /work/heads/stories260K-head (../heads/stories260K-head) when present, else a
   RANDOM head (the breakdown is then still meaningful, tau is not) - the table says which.

Everything runs in one process; medians over repeats. Both wall and process-CPU times are reported
(on a shared machine the CPU figures are the fair ones; with --threads 1 they match wall time on an
idle machine). Reference implementation on this CPU: 6.6 ms per EAGLE-2 round on stories260K,
vanilla 1.15 ms/token; target: < 3.3 ms per round.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from eagle import DecodingConfig, EaModel, EagleHead, fused_decoder
from eagle.attention import sdpa_attention

REPO = Path(__file__).resolve().parent.parent
REFERENCE_ROUND_MS = 6.6
REFERENCE_VANILLA_MS_PER_TOKEN = 1.15
TARGET_ROUND_MS = REFERENCE_ROUND_MS / 2
FLAT_TOLERANCE = 1.15
STOP_IDS = [1, 2]  # llama2.c stories end with <s> (1)


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def p10(xs):
    """10th percentile: on a shared machine, the step time with the least interference from other processes."""
    return statistics.quantiles(xs, n=10)[0] if len(xs) >= 10 else float("nan")


# ----------------------------------------------------------------------------- models
def random_tiny_llama(seed: int = 0):
    # lazy: transformers' model classes cost seconds at import; --help does not need them
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=4096,
                      attn_implementation="sdpa", bos_token_id=None, eos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).float().eval()
    model.generation_config.eos_token_id = None
    return model


def load_stories(shared: Path, head_arg: str | None, fused: bool | None = None):
    """(EaModel on stories260K, tokenizer, head description)."""
    # lazy: transformers' model classes cost seconds at import; --help does not need them
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = shared / "models" / "stories260K"
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    # the 480-token context sweep decodes a few dozen steps past the 512 trained positions: raised explicitly (the
    # decoder refuses it otherwise); step time does not depend on what the model learned there
    base.config.max_position_embeddings = max(base.config.max_position_embeddings, 1024)
    tok = AutoTokenizer.from_pretrained(path)
    candidates = [Path(head_arg)] if head_arg else [REPO.parent / "heads" / "stories260K-head"]
    head_dir = next((c for c in candidates if (c / "config.json").exists()), None)
    if head_arg and head_dir is None:
        raise FileNotFoundError(f"--head {head_arg}: no config.json there")
    if head_dir is not None:
        head = EagleHead.from_pretrained(head_dir, dtype=torch.float32)
        what = f"trained head {head_dir}"
    else:
        torch.manual_seed(0)
        head = EagleHead.from_target(base)
        what = "RANDOM head (no trained stories260K head found: tau and speedup are not meaningful)"
    return EaModel(base, head.eval(), fused_target=fused), tok, what


def story_prompts(shared: Path, tok, n: int) -> list[torch.Tensor]:
    text = (shared / "data" / "corpora" / "tinystories_val_a.txt").read_text(encoding="utf-8")
    paragraphs = [p.strip() for p in re.split(r"\n\s*\n", text) if p.strip()]
    prompts = []
    for p in reversed(paragraphs):  # from the end: never trained on by recipes/stories260k.yaml
        first = re.split(r"(?<=[.!?])\s", p, maxsplit=1)[0]
        ids = tok(first, return_tensors="pt").input_ids
        if 6 <= ids.shape[1] <= 48:
            prompts.append(ids)
        if len(prompts) == n:
            break
    return prompts


def corpus_context(shared: Path, tok, length: int) -> torch.Tensor:
    text = (shared / "data" / "corpora" / "tinystories_val_a.txt").read_text(encoding="utf-8")[:200_000]
    ids = tok(text, return_tensors="pt").input_ids[:, :length]
    assert ids.shape[1] == length, f"corpus too short for a {length}-token context"
    return ids


# ----------------------------------------------------------------------------- 1. vanilla step vs context
def vanilla_steps(model, prompt: torch.Tensor, steps: int) -> tuple[list[float], float]:
    """One timed vanilla run after `prompt`: (wall ms of each decode step from RoundStats, CPU ms per step).

    CPU per step = (CPU of prefill + `steps` steps - CPU of the prefill alone) / steps.
    """
    kw = dict(eos_token_id=[], max_length=prompt.shape[1] + steps + 2)
    c0 = time.process_time()
    model.naivegenerate(prompt, max_new_tokens=1, **kw)  # prefill only
    c1 = time.process_time()
    _, stats = model.naivegenerate(prompt, max_new_tokens=steps + 1, return_stats=True, **kw)
    c2 = time.process_time()
    assert len(stats.rounds) == steps
    wall = [(r.draft_s + r.verify_s + r.commit_s) * 1e3 for r in stats.rounds]
    return wall, ((c2 - c1) - (c1 - c0)) / steps * 1e3


def kv_layout(config) -> tuple[int, int, int]:
    """(layers, KV heads, head_dim) of a decoder config: the shape of its K/V cache per position."""
    d = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers, config.num_key_value_heads, d


def attention_floor_ms(config, context: int, fused: bool = True, repeats: int = 200) -> float:
    """Median time of the decode-step attention kernels alone (one query over `context` cached keys in every
    layer, each layer with its own K/V buffer as in the real cache, so the memory traffic is the same): what a
    step MUST spend more at a longer context, whatever the cache bookkeeping does. The kernel is the one the
    step runs: `eagle.attention.sdpa_attention` on the fused path, sdpa with `enable_gqa` (as transformers'
    sdpa layers call it) on the HF layers path."""
    layers, kv, d = kv_layout(config)
    heads = config.num_attention_heads
    buf = torch.randn(layers, 2, 1, kv, context + 64, d)  # capacity > context, like the cache
    q = torch.randn(1, 1, heads, d).transpose(1, 2)  # [1, h, 1, d] as the forward's view
    times = []
    for i in range(repeats + 20):
        t = time.perf_counter()
        for layer in range(layers):
            k, v = buf[layer, 0, :, :, :context], buf[layer, 1, :, :, :context]
            if fused:
                sdpa_attention(q, k, v, None)
            else:
                F.scaled_dot_product_attention(q, k, v, enable_gqa=kv != heads)
        if i >= 20:
            times.append(time.perf_counter() - t)
    return median(times) * 1e3


def kv_read_floor_ms(config, context: int, repeats: int = 50) -> float:
    """Fastest time to READ every layer's K/V at `context` positions once (float32, one `sum` per layer over its
    own buffer, best of `repeats`): a lower bound on what attention over that context costs, whatever the kernel,
    set by memory bandwidth once the cache outgrows L2 (stories260K at 480 positions: 0.59 MiB, tiny Llama at
    2048: 4 MiB)."""
    layers, kv, d = kv_layout(config)
    bufs = [torch.randn(2, kv, context, d) for _ in range(layers)]
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for b in bufs:
            b.sum()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


@contextlib.contextmanager
def attention_capped(keys: int):
    """Control experiment: one-query attention in the fused forward reads only the first `keys` cached positions
    (outputs become wrong; costs do not depend on token values). Everything else in the step still runs at the
    full context, so a step that stays flat under the cap has no context-dependent cost besides attention."""
    full = fused_decoder.sdpa_attention

    def capped(q, k, v, mask):
        if q.shape[2] == 1 and mask is None:
            return full(q, k[:, :, :keys], v[:, :, :keys], None)
        return full(q, k, v, mask)

    fused_decoder.sdpa_attention = capped
    try:
        yield
    finally:
        fused_decoder.sdpa_attention = full


def context_sweep(model, contexts: list[int], make_prompt, steps: int, repeats: int) -> dict:
    """Vanilla step time at each context, and max/min of the medians (flat = no growth with context).

    Contexts are visited round-robin within each repeat, so load drift on a shared machine hits all.
    Also reports the step minus the attention kernels' own time measured alone (`attention_floor_ms`; in the
    step, attention's K/V reads also evict the weights from L2, so some growth remains in that column), and a
    control run that settles where growth comes from (`attention_capped`, fused path only): the step with
    attention over the first min(contexts) keys, everything else at the full context. Growth there would be
    cache overhead (copies, concatenation), which must not exist. And a lower bound on max/min that no
    attention kernel can beat: the shortest context's step without its attention, plus the time to merely read
    the longest context's K/V once (`kv_read_floor_ms`), over the shortest context's step.
    """
    prompts = {c: make_prompt(c) for c in contexts}
    for c in contexts:  # warm-up: allocates the caches, first-call overheads
        vanilla_steps(model, prompts[c], steps)
    wall = {c: [] for c in contexts}
    cpu = {c: [] for c in contexts}
    capped = {c: [] for c in contexts}
    fused = model.target.fused is not None  # the control patches the fused forward's kernel
    for _ in range(repeats):
        for c in contexts:
            w, cp = vanilla_steps(model, prompts[c], steps)
            wall[c] += w
            cpu[c].append(cp)
            if fused:
                with attention_capped(min(contexts)):
                    capped[c] += vanilla_steps(model, prompts[c], steps)[0]
    rows = [{"context": c, "wall_ms_per_step": median(wall[c]), "wall_p10_ms_per_step": p10(wall[c]),
             "cpu_ms_per_step": median(cpu[c]), "attention_ms": attention_floor_ms(model.base_model.config, c, fused),
             "attention_capped_ms_per_step": median(capped[c]) if fused else None}
            for c in contexts]
    for r in rows:
        r["wall_minus_attention_ms"] = r["wall_ms_per_step"] - r["attention_ms"]
        r["kv_read_floor_ms"] = kv_read_floor_ms(model.base_model.config, r["context"])
    for kind in ("wall", "cpu"):
        first = rows[0][f"{kind}_ms_per_step"]
        for r in rows:
            r[f"{kind}_vs_shortest"] = r[f"{kind}_ms_per_step"] / first
    out = {"rows": rows}
    for kind, key in (("wall", "wall_ms_per_step"), ("wall_p10", "wall_p10_ms_per_step"), ("cpu", "cpu_ms_per_step"),
                      ("wall_minus_attention", "wall_minus_attention_ms"),
                      ("attention_capped", "attention_capped_ms_per_step")):
        vals = [r[key] for r in rows]
        if None in vals:  # no control run on the HF layers path
            continue
        out[f"{kind}_max_over_min"] = max(vals) / min(vals)
        out[f"{kind}_flat"] = max(vals) / min(vals) <= FLAT_TOLERANCE
    first, last = rows[0], rows[-1]
    out["max_over_min_lower_bound"] = (first["wall_minus_attention_ms"] + last["kv_read_floor_ms"]) / first["wall_ms_per_step"]
    return out


# ----------------------------------------------------------------------------- 2. EAGLE-2 rounds
def eagle_vs_vanilla(model, prompts, decoding, max_new_tokens: int, repeats: int) -> dict:
    rounds = []  # RoundStats of every EAGLE round
    e_wall = e_cpu = e_tok = 0.0
    v_wall = v_cpu = v_tok = 0.0
    per_repeat = []
    mismatches = 0
    for p in prompts[:2]:  # warm-up
        model.eagenerate(p, max_new_tokens=16, eos_token_id=STOP_IDS, decoding=decoding)
        model.naivegenerate(p, max_new_tokens=16, eos_token_id=STOP_IDS)
    for _ in range(repeats):
        rep = {"eagle_s": 0.0, "eagle_tokens": 0, "vanilla_s": 0.0, "vanilla_tokens": 0, "eagle_cpu": 0.0,
               "vanilla_cpu": 0.0}
        for p in prompts:
            c0 = time.process_time()
            ids_e, se = model.eagenerate(p, max_new_tokens=max_new_tokens, eos_token_id=STOP_IDS, decoding=decoding,
                                         return_stats=True)
            c1 = time.process_time()
            ids_v, sv = model.naivegenerate(p, max_new_tokens=max_new_tokens, eos_token_id=STOP_IDS, return_stats=True)
            c2 = time.process_time()
            mismatches += not torch.equal(ids_e, ids_v)
            rounds += se.rounds
            # decode only: the prefill (and its token) is the same work on both sides
            rep["eagle_s"] += se.total_s - se.prefill_s
            rep["eagle_tokens"] += se.new_tokens - 1
            rep["eagle_cpu"] += (c1 - c0) - se.prefill_s
            rep["vanilla_s"] += sv.total_s - sv.prefill_s
            rep["vanilla_tokens"] += sv.new_tokens - 1
            rep["vanilla_cpu"] += (c2 - c1) - sv.prefill_s
        per_repeat.append(rep)
    ms = lambda s, n: 1e3 * s / max(n, 1)  # noqa: E731
    eagle_ms_tok = median([ms(r["eagle_s"], r["eagle_tokens"]) for r in per_repeat])
    vanilla_ms_tok = median([ms(r["vanilla_s"], r["vanilla_tokens"]) for r in per_repeat])
    eagle_cpu_tok = median([ms(r["eagle_cpu"], r["eagle_tokens"]) for r in per_repeat])
    vanilla_cpu_tok = median([ms(r["vanilla_cpu"], r["vanilla_tokens"]) for r in per_repeat])
    total = [(r.draft_s + r.verify_s + r.commit_s) * 1e3 for r in rounds]
    tau = sum(r.new_tokens for r in rounds) / len(rounds)
    return {
        "rounds": len(rounds),
        "tau": tau,
        "round_ms_median": median(total),
        "round_ms_p10": p10(total),
        "draft_ms_median": median([r.draft_s * 1e3 for r in rounds]),
        "verify_ms_median": median([r.verify_s * 1e3 for r in rounds]),
        "bookkeeping_ms_median": median([r.commit_s * 1e3 for r in rounds]),
        "round_ms_mean": statistics.fmean(total),
        "eagle_ms_per_token": eagle_ms_tok,
        "vanilla_ms_per_token": vanilla_ms_tok,
        "speedup_wall": vanilla_ms_tok / eagle_ms_tok,
        "eagle_cpu_ms_per_token": eagle_cpu_tok,
        "vanilla_cpu_ms_per_token": vanilla_cpu_tok,
        "speedup_cpu": vanilla_cpu_tok / eagle_cpu_tok,
        "eagle_cpu_ms_per_round": eagle_cpu_tok * tau,
        "outputs_identical": mismatches == 0,
        "mismatched_prompts": mismatches,
    }


# ----------------------------------------------------------------------------- report
def print_sweep(title: str, sweep: dict) -> None:
    print(f"\n{title}")
    print(f"  {'context':>8} {'wall ms/step':>13} {'wall p10':>9} {'cpu ms/step':>12} {'wall vs first':>14} "
          f"{'attn kernels':>13} {'wall - attn':>12} {'K/V read':>9} {'attn capped':>12}")
    for r in sweep["rows"]:
        print(f"  {r['context']:>8} {r['wall_ms_per_step']:>13.3f} {r['wall_p10_ms_per_step']:>9.3f} "
              f"{r['cpu_ms_per_step']:>12.3f} {r['wall_vs_shortest']:>14.2f} {r['attention_ms']:>13.3f} "
              f"{r['wall_minus_attention_ms']:>12.3f} {r['kv_read_floor_ms']:>9.3f} {r['attention_capped_ms_per_step'] or float('nan'):>12.3f}")
    flat = lambda k: f"{sweep[k + '_max_over_min']:.2f} ({'flat' if sweep[k + '_flat'] else 'NOT flat'})"  # noqa: E731
    print(f"  max/min: wall median {flat('wall')}, wall p10 {flat('wall_p10')}, cpu {flat('cpu')}, "
          f"wall - attention kernels {flat('wall_minus_attention')} [flat = within {FLAT_TOLERANCE - 1:.0%}]")
    first = sweep["rows"][0]["context"]
    print(f"  control, attention capped at the first {first} keys (all else at full context): "
          + (flat("attention_capped") if "attention_capped_flat" in sweep else "n/a (HF layers path)"))
    bound = sweep["max_over_min_lower_bound"]
    print(f"  lower bound on max/min for ANY attention kernel (step without attention + reading the longest "
          f"context's K/V once): {bound:.2f}{' - flat within 15% is out of reach on this model' if bound > FLAT_TOLERANCE else ''}")


def print_eagle(e: dict, head_what: str) -> None:
    print(f"\nEAGLE-2 60/5/10 on stories260K ({head_what})")
    print(f"  rounds measured            {e['rounds']}")
    print(f"  tau (tokens / round)       {e['tau']:.2f}")
    print(f"  round, median              {e['round_ms_median']:.3f} ms   (reference {REFERENCE_ROUND_MS} ms, "
          f"target < {TARGET_ROUND_MS:.1f} ms: {'MET' if e['round_ms_median'] < TARGET_ROUND_MS else 'NOT met'})")
    print(f"  round, p10 (least load)    {e['round_ms_p10']:.3f} ms")
    print(f"    draft                    {e['draft_ms_median']:.3f} ms")
    print(f"    verify (target forward)  {e['verify_ms_median']:.3f} ms")
    print(f"    bookkeeping              {e['bookkeeping_ms_median']:.3f} ms")
    print(f"  round, CPU (per token x tau) {e['eagle_cpu_ms_per_round']:.3f} ms")
    print(f"  EAGLE   ms/token  wall {e['eagle_ms_per_token']:.3f}  cpu {e['eagle_cpu_ms_per_token']:.3f}")
    print(f"  vanilla ms/token  wall {e['vanilla_ms_per_token']:.3f}  cpu {e['vanilla_cpu_ms_per_token']:.3f}"
          f"   (reference implementation: {REFERENCE_VANILLA_MS_PER_TOKEN})")
    print(f"  speedup           wall {e['speedup_wall']:.2f}x  cpu {e['speedup_cpu']:.2f}x")
    print(f"  outputs identical to vanilla: {e['outputs_identical']} ({e['mismatched_prompts']} mismatched)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.decode_bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shared", default=os.environ.get("EAGLE_SHARED_DIR", str(REPO.parent / "shared")))
    p.add_argument("--head", default=None, help="stories260K head folder (default: ../heads/stories260K-head if present)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-fused", action="store_true",
                   help="run targets through the HF decoder layers instead of eagle.fused_decoder (for comparison)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=64, help="decode steps timed per context and repeat")
    p.add_argument("--prompts", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--json", default=str(REPO / "outputs" / "decode_bench.json"), help="results file (outputs/ is git-ignored)")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    results = {"threads": args.threads, "repeats": args.repeats, "torch": torch.__version__,
               "machine": platform.processor() or platform.machine(), "loadavg_start": os.getloadavg()}
    shared = Path(args.shared)
    have_shared = (shared / "models" / "stories260K" / "config.json").exists()

    # 1. vanilla step time vs context
    tiny = random_tiny_llama()
    fused = False if args.no_fused else None
    results["target_path"] = "hf layers" if args.no_fused else "fused"
    tiny_model = EaModel(tiny, EagleHead.from_target(tiny), fused_target=fused)
    g = torch.Generator().manual_seed(0)
    sweep_tiny = context_sweep(tiny_model, [64, 1024, 2048], lambda c: torch.randint(0, 512, (1, c), generator=g),
                               args.steps, args.repeats)
    results["vanilla_random_tiny_llama"] = sweep_tiny
    if have_shared:
        stories, tok, head_what = load_stories(shared, args.head, fused)
        sweep_stories = context_sweep(stories, [64, 256, 480], lambda c: corpus_context(shared, tok, c),
                                      args.steps, args.repeats)
        results["vanilla_stories260K"] = sweep_stories
        # 2. EAGLE-2 rounds
        decoding = DecodingConfig(mode="dynamic", total_token=60, depth=5, top_k=10)
        prompts = story_prompts(shared, tok, args.prompts)
        eagle = eagle_vs_vanilla(stories, prompts, decoding, args.max_new_tokens, args.repeats)
        results["eagle2_stories260K"] = {"head": head_what, "decoding": "dynamic 60/5/10",
                                         "prompts": len(prompts), **eagle}
    results["loadavg_end"] = os.getloadavg()

    print(f"decode_bench: target path {results['target_path']}, torch {torch.__version__}, {args.threads} thread(s), {args.repeats} repeats, "
          f"load average at start {results['loadavg_start'][0]:.1f}, end {results['loadavg_end'][0]:.1f}")
    if have_shared:
        print_sweep("vanilla ms per decode step, stories260K", results["vanilla_stories260K"])
    print_sweep("vanilla ms per decode step, random tiny Llama (hidden 128, 4 layers, GQA 8/4)", sweep_tiny)
    if have_shared:
        print_eagle(results["eagle2_stories260K"], results["eagle2_stories260K"]["head"])
    else:
        print(f"\n{shared} not found: stories260K sections skipped")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=2) + "\n")
    print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
