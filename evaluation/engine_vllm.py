"""Run vLLM on token-id prompts, greedily, with or without an EAGLE draft; print a JSON result.

    /work/venvs/vllm/bin/python evaluation/engine_vllm.py REQUEST.json RESULT.json

Run by `evaluation/main.py serve-check` in a subprocess under the engine's own interpreter: this file imports
only the standard library and vllm (never this project), so the project's venv never needs vllm.
REQUEST: {"model", "dtype", "max_model_len", "prompts": [[ids]], "max_tokens", "stop_token_ids", "seed",
          "runs": [{"name", "speculative_config": {...} | null}]}   (one LLM per run, in this order)
RESULT:  {"vllm_version", "runs": {name: {"outputs": [[ids]], "finish_reasons", "metrics": {"num_drafts",
          "num_draft_tokens", "num_accepted_tokens", "accepted_per_pos": [...]}, "load_s", "generate_s"}}}
"""
import gc
import json
import os
import sys
import time


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


def main(request_path: str, result_path: str) -> int:
    req = json.loads(open(request_path).read())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process: one import of vllm
    # lazy: vllm lives in the engine's own venv; this script runs under that interpreter only
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=int(req["max_tokens"]),
                            stop_token_ids=list(req.get("stop_token_ids") or []), ignore_eos=False)
    prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in req["prompts"]]
    out = {"vllm_version": vllm.__version__, "runs": {}}
    for run in req["runs"]:
        start = time.perf_counter()
        kwargs = dict(model=req["model"], dtype=req.get("dtype", "float32"), max_model_len=int(req["max_model_len"]),
                      seed=int(req.get("seed", 0)), disable_log_stats=False, enforce_eager=True,
                      distributed_executor_backend="uni")
        if run.get("speculative_config"):
            kwargs["speculative_config"] = run["speculative_config"]
        llm = LLM(**kwargs)
        load_s = time.perf_counter() - start
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
                                    "metrics": metrics, "load_s": load_s, "generate_s": generate_s}
        del llm
        gc.collect()
    with open(result_path, "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":  # vLLM may start worker processes: the guard is required
    sys.exit(main(sys.argv[1], sys.argv[2]))
