"""The draft length per batch size that vLLM runs: `num_speculative_tokens_per_batch_size`, fitted from serve-sweep's
measurements, and the `speculative_config.json` that carries it (serve-sweep writes it, the model card prints it,
Hub staging ships it, serve-check checks it).

vLLM 0.32 (`vllm/config/speculative.py`, `vllm/v1/spec_decode/dynamic/utils.py`) takes
`num_speculative_tokens_per_batch_size = [[lo, hi, k], ...]`: inclusive ranges of the number of requests scheduled
in one engine step, sorted, non-overlapping, the first starting at 1, k >= 0 (0: that step drafts nothing); gaps and
batch sizes beyond the last range carry the previous k forward, and every k is clamped to `num_speculative_tokens`
(the longest chain the drafter is built for), which must be >= 1.

The fit (`fit_schedule`): serve-sweep measures output tokens/s of every k at a few concurrency levels C_1 < ... <
C_n (1, 4, 16, 64 by default: requests in flight, i.e. the engine's batch size while the benchmark runs). For a
batch size B between two levels each k's throughput is interpolated linearly in log B between its two measurements
(the levels are spaced geometrically, and a step's cost grows with the batch's tokens, so log B is the axis on which
the curves are closest to straight); below C_1 and above C_n the nearest level's measurement stands. B gets the k
with the highest interpolated throughput (ties: the shorter chain, which wastes fewer batch slots). At a measured
level this is that level's best k; between two levels the switch happens where the two leading k's interpolated
curves cross, not at an arbitrary midpoint: a k that leads at C_i by 1% hands over early, one that leads by 30%
late. Only k measured at every level compete (a missing point cannot be interpolated).

k = 0 inside a schedule is not the k = 0 serve-sweep measures (a server without a drafter): on a step whose k is 0
vLLM still runs the drafter's forward over the step's tokens to keep its KV cache in sync
(`vllm/v1/spec_decode/llm_base_proposer.py`, `propose`: "No draft tokens requested (e.g. Dynamic SD decided K=0).
The prefill forward pass above already ran"; how much that costs was inside this box's noise:
docs/results/serve-sweep.md). So the fit lets "no speculation" win only when it wins at every batch size (then the
config is None: serve without --speculative-config); otherwise only k >= 1 compete.
"""
from __future__ import annotations

import math
from pathlib import Path

from eagle.cli_errors import UserError
from eagle.state_files import StateFile, read_json_state, register, write_json_state

SCHEDULE_KEY = "num_speculative_tokens_per_batch_size"
SPEC_CONFIG_FILE = "speculative_config.json"  # beside serve-sweep's sweep.json; top level of a Hub upload
SPEC_CONFIG = register(StateFile(
    SPEC_CONFIG_FILE, "SERVE_SWEEP_DIR", writer="evaluation/serve_sweep.py (and Hub staging, export/hub.py)",
    schema={"method": str, "model": str, "num_speculative_tokens": int, f"{SCHEDULE_KEY}?": [[int]], "*": object},
    rebuild="rerun `python -m evaluation serve-sweep` (it fits and writes it again), or write vLLM's "
            "--speculative-config by hand",
    example={"method": "eagle", "model": "HEAD-vllm", "num_speculative_tokens": 4, SCHEDULE_KEY: [[1, 2, 4], [3, 64, 2]]}))


class ScheduleError(UserError, ValueError):
    """A draft-length schedule or speculative config that vLLM would refuse or misread; the message names it."""


def _throughputs(points: list[dict]) -> tuple[list[int], dict[int, list[float]]]:
    """(levels, {k: tokens/s at each level}) for the k measured at every level."""
    levels = sorted({int(p["concurrency"]) for p in points})
    by = {(int(p["k"]), int(p["concurrency"])): p.get("output_tokens_per_s") for p in points}
    ks = sorted({int(p["k"]) for p in points})
    curves = {k: [float(by[k, c]) for c in levels] for k in ks if all(by.get((k, c)) for c in levels)}
    return levels, curves


def interpolated_throughput(levels: list[int], curve: list[float], batch: int) -> float:
    """One k's output tokens/s at `batch`: linear in log(batch) between the two enclosing levels, the nearest
    level's value outside them."""
    if batch <= levels[0]:
        return curve[0]
    if batch >= levels[-1]:
        return curve[-1]
    i = max(j for j, c in enumerate(levels) if c <= batch)
    lo, hi = levels[i], levels[i + 1]
    t = (math.log(batch) - math.log(lo)) / (math.log(hi) - math.log(lo))
    return (1 - t) * curve[i] + t * curve[i + 1]


def fit_schedule(points: list[dict], max_batch: int) -> list[list[int]]:
    """[[lo, hi, k], ...] covering batch sizes 1 .. max_batch (module docstring: the rule). `points`: serve-sweep's
    measurements ({"k", "concurrency", "output_tokens_per_s"})."""
    if max_batch < 1:
        raise ScheduleError(f"max_batch must be >= 1, got {max_batch}")
    levels, curves = _throughputs(points)
    if not curves:
        raise ScheduleError("no draft length was measured at every concurrency level: nothing to fit a schedule from")
    fitted = _fit(levels, curves, max_batch)
    drafting = {k: c for k, c in curves.items() if k > 0}
    if any(k > 0 for _, _, k in fitted) and drafting:  # a drafter is loaded: its k = 0 is not "no speculation"
        fitted = _fit(levels, drafting, max_batch)
    return fitted


def _fit(levels: list[int], curves: dict[int, list[float]], max_batch: int) -> list[list[int]]:
    """The fastest of `curves` per batch size 1 .. max_batch, as ranges."""
    schedule: list[list[int]] = []
    for b in range(1, max_batch + 1):
        speed = {k: interpolated_throughput(levels, curve, b) for k, curve in curves.items()}
        k = min(speed, key=lambda x: (-speed[x], x))  # the fastest; on a tie the shorter chain
        if schedule and schedule[-1][2] == k:
            schedule[-1][1] = b
        else:
            schedule.append([b, b, k])
    return schedule


def validate_schedule(schedule, where: str, num_speculative_tokens: int | None = None) -> list[list[int]]:
    """The schedule as vLLM 0.32 validates it (module docstring), plus: no k above num_speculative_tokens (vLLM
    would clamp it silently). Returns it as lists of ints; a bad one is one ScheduleError naming `where`."""
    def bad(why: str):
        raise ScheduleError(f"{where}: {SCHEDULE_KEY} {why}")

    if not isinstance(schedule, list) or not schedule:
        bad(f"must be a non-empty list of [range_start, range_end, num_speculative_tokens], got {schedule!r}")
    out = []
    for entry in schedule:
        if (not isinstance(entry, (list, tuple)) or len(entry) != 3
                or not all(isinstance(x, int) and not isinstance(x, bool) for x in entry)):
            bad(f"entry {entry!r} is not [range_start, range_end, num_speculative_tokens] (three integers)")
        lo, hi, k = entry
        if lo < 1 or hi < lo:
            bad(f"entry {list(entry)}: the batch-size range must satisfy 1 <= start <= end")
        if k < 0:
            bad(f"entry {list(entry)}: num_speculative_tokens must be >= 0")
        if num_speculative_tokens is not None and k > num_speculative_tokens:
            bad(f"entry {list(entry)}: k = {k} is above num_speculative_tokens = {num_speculative_tokens} (vLLM "
                "would clamp it silently); raise num_speculative_tokens or lower the entry")
        out.append([lo, hi, k])
    out.sort(key=lambda e: e[0])
    if out[0][0] != 1:
        bad(f"must start at batch size 1 (the first range is {out[0]})")
    for a, b in zip(out, out[1:]):
        if b[0] <= a[1]:
            bad(f"ranges {a} and {b} overlap")
    return out


def k_at(schedule: list[list[int]], batch: int, num_speculative_tokens: int) -> int:
    """The k vLLM runs with `batch` requests in a step: the range holding it, else (a gap or beyond the last range)
    the previous range's k; clamped to num_speculative_tokens."""
    k = schedule[0][2]
    for lo, hi, kk in schedule:
        if lo > batch:
            break
        k = kk
    return min(k, num_speculative_tokens)


def vllm_speculative_config(spec: dict, model: str, num_speculative_tokens: int) -> dict:
    """vLLM's --speculative-config serving the draft folder `model` with chains of `num_speculative_tokens`: `spec` is
    the head kind's keys (export/head_kinds.py `ExportKind.vllm_spec`: method, and parallel_drafting for a P-EAGLE
    head), then model and num_speculative_tokens, in that key order (speculative_config.json and the printed
    commands carry it as written). Every --speculative-config of a head is built here."""
    return {**spec, "model": str(model), "num_speculative_tokens": num_speculative_tokens}


def parallel_schedule_refusal(spec: dict, schedule: list[list[int]], longest: int) -> str | None:
    """Why vLLM 0.32 cannot serve `schedule` with `spec`, or None. With parallel_drafting its proposer drafts every
    slot of num_speculative_tokens in one forward and reshapes them as that many columns after the per-batch-size k
    replaced it (v1/spec_decode/llm_base_proposer.py `propose`): any k between 0 and the longest crashes the engine's
    worker ("shape '[-1, k]' is invalid"), measured here with a P-EAGLE head. k = 0 (no speculation) is served."""
    if not spec.get("parallel_drafting"):
        return None
    shorter = sorted({k for _, _, k in schedule if 0 < k < longest})
    if not shorter:
        return None
    return (f"vLLM 0.32 cannot run a shorter k ({', '.join(map(str, shorter))}) than num_speculative_tokens = {longest} "
            "with parallel_drafting (its proposer returns all the parallel slots: the worker crashes); serve a P-EAGLE "
            "head with one fixed k (the sweep's best k per level), or a schedule of that k and 0 only")


def speculative_config(spec: dict, model: str, schedule: list[list[int]]) -> dict | None:
    """vLLM's --speculative-config for the schedule (`spec`: the head kind's keys, `vllm_speculative_config`):
    num_speculative_tokens = its longest chain (a P-EAGLE head's parallel_drafting drafts them in one forward);
    None when the schedule never speculates (then serve without --speculative-config). ScheduleError when the
    engine cannot serve it (`parallel_schedule_refusal`)."""
    longest = max(k for _, _, k in schedule)
    if longest == 0:
        return None
    refusal = parallel_schedule_refusal(spec, schedule, longest)
    if refusal:
        raise ScheduleError(refusal)
    return {**vllm_speculative_config(spec, model, longest), SCHEDULE_KEY: schedule}


def check_speculative_config(config, where: str, served: dict | None = None) -> dict:
    """A speculative config dict with a schedule: method and model strings, num_speculative_tokens >= 1, a valid
    schedule no k of which exceeds it, and one the engine can run as served: `served` holds the keys the engine is
    given for the head beside the file's (the head kind's `ExportKind.vllm_spec()`, with serve-check's overrides:
    a P-EAGLE head turns parallel_drafting on whether the file says so or not), which decide the refusal
    (`parallel_schedule_refusal`). serve-check, serve-sweep's file and the model card's (Hub staging) all check
    here. Returns the config with the schedule normalised."""
    if not isinstance(config, dict):
        raise ScheduleError(f"{where}: expected a JSON object (vLLM's --speculative-config), got {type(config).__name__}")
    for key in ("method", "model"):
        if not isinstance(config.get(key), str) or not config[key]:
            raise ScheduleError(f"{where}: key {key!r} must be a non-empty string (got {config.get(key)!r})")
    n = config.get("num_speculative_tokens")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ScheduleError(f"{where}: num_speculative_tokens must be an integer >= 1 (got {n!r})")
    if SCHEDULE_KEY not in config:
        raise ScheduleError(f"{where}: no {SCHEDULE_KEY}: this file is one fixed k, pass --num-speculative-tokens "
                            "instead, or write the schedule serve-sweep fits")
    schedule = validate_schedule(config[SCHEDULE_KEY], where, n)
    refusal = parallel_schedule_refusal({**config, **(served or {})}, schedule, n)
    if refusal:
        unsaid = not config.get("parallel_drafting")  # the head's kind turns it on, not the file
        raise ScheduleError(f"{where}: {refusal}" + ("; the head is served with parallel_drafting (its kind drafts in "
                                                     "parallel), which the file does not say" if unsaid else ""))
    return {**config, SCHEDULE_KEY: schedule}


def read_speculative_config(path: str | Path, served: dict | None = None) -> dict:
    """A speculative_config.json (serve-sweep's, or hand-written), checked (`check_speculative_config`; `served`: the
    keys the head is served with beside the file's)."""
    path = Path(path)
    return check_speculative_config(read_json_state(path, SPEC_CONFIG), str(path), served)


def write_speculative_config(path: str | Path, config: dict) -> Path:
    """Write the (checked) config as one JSON object, the form `vllm serve --speculative-config` takes."""
    path = Path(path)
    check_speculative_config(config, str(path))
    return write_json_state(path, config, SPEC_CONFIG, indent=None)


def schedule_text(schedule: list[list[int]]) -> str:
    """"batch 1-2: k = 4; 3-24: k = 2; 25-64: no speculation" (the model card's and sweep.md's line)."""
    def k_name(k):
        return "no speculation" if k == 0 else f"k = {k}"
    return "; ".join(f"batch {lo}{'' if hi == lo else f'-{hi}'}: {k_name(k)}" for lo, hi, k in schedule)
