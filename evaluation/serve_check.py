"""Train-to-serve parity: run the exported head IN a serving engine and compare it with this project's decoder.

    python -m evaluation serve-check --engine vllm --head HEAD --base TARGET \
        [--engine-python /work/venvs/vllm/bin/python] [--num-speculative-tokens 4] [--tolerance 0.05] \
        [--temperature 1.0]          # T > 0: evaluation/serve_check_sampling.py

1. The head (EAGLE-1/2 or EAGLE-3) is written in the engine's format (export/head_kinds.py; `--engine-format
   eagle` serves the official / released-layout folder unchanged instead). The vLLM method follows the folder's
   head kind (eagle / eagle3); `--engine-method` serves it with another, which the check refuses with one line
   naming the mismatch (the trap that otherwise shows up as acceptance 1.0 or a loader error).
2. When the engine's CPU attention does not support the model's head_dim (vLLM: 32, 64, 80, ...), target and
   head are replaced by exactly equivalent zero-padded copies (engine/head_dim_pad.py); the copies are
   first shown to decode token-identically to the originals in this project's decoder (vanilla and chain).
   A quantized target (`target.quantization`) is served as its dequantized float copy
   (engine/quantized_target.py), the function this project's decoder runs in memory; the report says so.
3. The engine (engine/vllm_side/generate.py, in a subprocess under `--engine-python`, so this venv never needs
   vllm) decodes the evaluation prompts greedily without and with speculation (a chain of k drafted tokens).
4. This project's decoder runs the same prompts with the same chain of k (`DecodingConfig(mode="chain")`).
Reported: outputs identical per prompt (engine speculative vs engine plain, engine vs ours), the engine's
mean acceptance length (1 + accepted / drafts) and per-position acceptance (accepted at position i / drafts)
next to ours, and their ratio, also per bucket of prompt tokens (`eval.context_buckets`, the buckets evaluation
reports; from vLLM's per-request counts): a draft served with another attention window than it was trained with
agrees on short prompts and parts at long ones. Fails (exit 1) when any engine output changes with speculation or
the mean acceptance length (overall or in any bucket) or any position's acceptance differs by more than
`--tolerance` (relative). Greedy decoding is
deterministic on both sides, so the tolerance only absorbs floating-point near-ties.

A draft-length schedule (`--speculative-config FILE`: serve-sweep's speculative_config.json, vLLM's
`num_speculative_tokens_per_batch_size`, export/speculative_schedule.py) is checked as one k is, at T = 0: the engine
serves every prompt at once with the schedule (the batch shrinks as requests finish, so k switches), whose outputs
must equal plain decoding's and whose mean drafted tokens per draft must lie within the schedule's k for those batch
sizes; and once more with one request at a time (`max_num_seqs` 1), where the schedule's k at batch size 1 is one
fixed chain, compared with this project's chain of that k exactly as above (a schedule with k = 0 at batch size 1
must then draft nothing). The file's `model` is not served: the check converts `--head` itself.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import torch

from data_prep.target import load_target_config
from eagle.atomic_folder import write_results_folder
from eagle.decoding_config import DecodingConfig
from eagle.ea_model import EaModel
from eagle.head_config import read_head_json
from eagle.head_files import load_head
from engine.engine_process import check_engine
from data_prep.default_target import default_cache_dir
from eagle.quantization import NONE
from engine.head_dim_pad import pad_head
from engine.quantized_target import engine_target, served_label
from evaluation import serve_check_sampling
from evaluation.context_buckets import bucket_labels, bucket_of
from evaluation.engine_runs import ENGINES, ServeCheckError, engine_runs
from evaluation.head_health import acceptance_warning, warn
from export.head_kinds import ExportKind, check_vllm_method, export_kind, served_kind, write_engine_head
from export.speculative_schedule import (SCHEDULE_KEY, ScheduleError, check_speculative_config, k_at,
                                         vllm_speculative_config)

log = logging.getLogger(__name__)
DEFAULT_TOLERANCE = 0.05  # relative difference of mean acceptance lengths (T = 0)


@dataclasses.dataclass
class Acceptance:
    """Chain acceptance in the engine's terms: drafts = verification steps, accepted_per_pos[i] = steps whose
    draft token i+1 was accepted."""

    num_drafts: int
    num_accepted: int
    accepted_per_pos: list[int]

    @property
    def mean_length(self) -> float:
        return 1.0 + self.num_accepted / max(self.num_drafts, 1)

    def per_position(self) -> list[float]:
        return [a / max(self.num_drafts, 1) for a in self.accepted_per_pos]

    @classmethod
    def from_rounds(cls, accept_lengths: list[int], k: int) -> "Acceptance":
        return cls(len(accept_lengths), sum(accept_lengths), [sum(a > i for a in accept_lengths) for i in range(k)])

    @classmethod
    def pooled(cls, parts: list["Acceptance"], k: int) -> "Acceptance":
        """The counts of several prompts' acceptances added up (positions past a part's list count 0)."""
        return cls(sum(a.num_drafts for a in parts), sum(a.num_accepted for a in parts),
                   [sum(a.accepted_per_pos[i] if i < len(a.accepted_per_pos) else 0 for a in parts) for i in range(k)])

    @classmethod
    def from_engine_request(cls, r: dict, k: int) -> "Acceptance":
        """One request's acceptance from the engine's per-request counts ({"num_drafts", "accepted_per_pos"},
        engine/vllm_side/generate.py): accepted tokens = the sum over positions."""
        per_pos = list(r["accepted_per_pos"])[:k]
        per_pos += [0] * (k - len(per_pos))
        return cls(int(r["num_drafts"]), sum(per_pos), per_pos)


def by_context(prompts: list[list[int]], engine_requests: list[dict | None], ours: list[Acceptance], k: int,
               edges: list[int], tolerance: float) -> list[dict]:
    """Engine vs project acceptance per bucket of prompt tokens (eval.context_buckets, labelled as
    evaluation/context_buckets.py labels them): each bucket's requests pooled on both sides, the ratio of mean
    acceptance lengths and whether it is within `tolerance`. Buckets without prompts are left out."""
    missing = [i for i, r in enumerate(engine_requests) if r is None]
    if missing:
        raise ServeCheckError(f"the engine returned no per-request acceptance for prompts {missing[:5]}: the "
                              "per-context-length comparison needs it (vLLM's per_request_spec_decode_metrics)")
    rows = []
    for label in bucket_labels(edges):
        idx = [i for i, p in enumerate(prompts) if bucket_of(len(p), edges) == label]
        if not idx:
            continue
        e = Acceptance.pooled([Acceptance.from_engine_request(engine_requests[i], k) for i in idx], k)
        o = Acceptance.pooled([ours[i] for i in idx], k)
        ratio = e.mean_length / o.mean_length
        rows.append({"bucket": label, "prompts": len(idx), "prompt_tokens": [min(len(prompts[i]) for i in idx),
                                                                               max(len(prompts[i]) for i in idx)],
                     "engine": {**dataclasses.asdict(e), "mean_length": e.mean_length, "per_position": e.per_position()},
                     "project": {**dataclasses.asdict(o), "mean_length": o.mean_length, "per_position": o.per_position()},
                     "ratio": ratio, "within_tolerance": abs(ratio - 1.0) <= tolerance})
    return rows


def strip_stop(ids: list[int], stops: list[int]) -> list[int]:
    """Generated ids without a trailing stop token (engines differ in whether they return it)."""
    return ids[:-1] if ids and ids[-1] in stops else ids


def project_run(model, prompts: list[list[int]], k: int, max_new_tokens: int, max_length: int, eos: list[int]):
    """This project's decoder on the prompts: (vanilla outputs, chain outputs, chain Acceptance, seconds, the chain
    Acceptance of each prompt)."""
    device = next(model.base_model.parameters()).device
    chain = DecodingConfig(mode="chain", chain_length=k).validate()
    vanilla, spec, per_prompt = [], [], []
    start = time.perf_counter()
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], dtype=torch.long, device=device)
            kw = dict(temperature=0.0, max_new_tokens=max_new_tokens, max_length=max_length, eos_token_id=eos)
            vanilla.append(model.naivegenerate(ids, **kw)[0, len(p):].tolist())
            out, stats = model.eagenerate(ids, decoding=chain, return_stats=True, **kw)
            spec.append(out[0, len(p):].tolist())
            per_prompt.append(Acceptance.from_rounds([r.accept_length for r in stats.rounds], k))
    return vanilla, spec, Acceptance.pooled(per_prompt, k), time.perf_counter() - start, per_prompt


def prepare_engine_models(target_path: str, head_path: str, engine: str, engine_format: str, work: Path,
                          k: int = 4, quantization: str = NONE, dtype: str = "float32",
                          revision: str | None = None) -> tuple[str, str, int | None]:
    """(target folder, draft folder, padded head_dim or None) that the engine will load: a quantized target's
    dequantized float copy (engine/quantized_target.py), padded when the engine needs it. EAGLE-3 heads go to vLLM
    as its speculators config naming the (padded) target as verifier, or as the released folder (`engine_format`
    eagle)."""
    tcfg = load_target_config(target_path)
    target_path, padded = engine_target(target_path, tcfg, work, quantization, dtype, default_cache_dir(), revision)
    if padded:  # the head gets the same head_dim as the padded target
        head = pad_head(load_head(head_path, dtype=torch.float32), padded)
        head_path = str(head.save_pretrained(work / "head_padded", dtype=torch.float32))
        tcfg = load_target_config(target_path)  # the padded copy's
    if engine_format == "eagle":
        return target_path, head_path, padded  # the official / released folder, unchanged
    draft = write_engine_head(head_path, work / f"head_{engine}", engine, tcfg, verifier=target_path,
                              num_speculative_tokens=k)
    return target_path, str(draft), padded


def padded_equivalence(ours: tuple, dtype, padded_target: str, padded_head_dir: str, prompts, k, gen) -> dict:
    """The padded copies decode token-identically to the originals (`ours` = project_run of the originals) in
    this project's decoder, vanilla and chain, with identical acceptance."""
    padded = EaModel.from_pretrained(base_model_path=padded_target, ea_model_path=padded_head_dir, torch_dtype=dtype)
    pad = project_run(padded, prompts, k, gen.max_new_tokens, gen.max_length, list(gen.eos_token_id or []))
    same_v = sum(a == b for a, b in zip(ours[0], pad[0]))
    same_c = sum(a == b for a, b in zip(ours[1], pad[1]))
    return {"prompts": len(prompts), "vanilla_identical": same_v, "chain_identical": same_c,
            "acceptance_identical": ours[2] == pad[2]}


def served_spec(kind: ExportKind, engine_method: str | None = None, parallel_drafting: bool | None = None,
                schedule_config: dict | None = None) -> dict:
    """The vLLM speculative-config keys serve-check serves the head with: its kind's (`ExportKind.vllm_spec`: method,
    and parallel_drafting for P-EAGLE), overridden on purpose by --engine-method / --parallel-drafting (showing the
    trap), else by a --speculative-config file's method and, when it has the key, parallel_drafting."""
    if schedule_config is not None:
        engine_method = engine_method or schedule_config["method"]
        if parallel_drafting is None and "parallel_drafting" in schedule_config:
            parallel_drafting = bool(schedule_config["parallel_drafting"])
    return kind.vllm_spec(method=engine_method or None, parallel_drafting=parallel_drafting)


def evaluation_prompts(s, questions: list, num_prompts: int | None) -> list[list[int]]:
    """The first prompts of the question set (first turns) that fit max_length with max_new_tokens."""
    n = num_prompts or (s.cfg.eval.num_questions if s.cfg.eval.num_questions > 0 else len(questions))
    prompts = [s.fmt.first_prompt(q.turns[0]) for q in questions[:n]]
    prompts = [p for p in prompts if len(p) + s.gen.max_new_tokens <= s.gen.max_length]
    if not prompts:
        raise ValueError("no prompt fits max_length with max_new_tokens")
    return prompts


def serve_check(setup, questions: list, engine: str = "vllm", engine_python: str | None = None, k: int = 4,
                tolerance: float = DEFAULT_TOLERANCE, num_prompts: int | None = None,
                engine_format: str | None = None, engine_method: str | None = None, temperature: float = 0.0,
                alpha: float | None = None, patch_engine: bool = False, parallel_drafting: bool | None = None,
                schedule_config: dict | None = None) -> int:
    """Run the check (module docstring; temperature > 0: evaluation/serve_check_sampling.py, `alpha` its error
    rate; `schedule_config`: a checked speculative config with a k-per-batch-size schedule, replacing `k`);
    writes serve_check/report.{json,md} under the eval output folder. Exit code 0 = pass, 1 = fail."""
    if schedule_config is not None:
        if temperature > 0:
            raise ScheduleError("--speculative-config (a k-per-batch-size schedule) is checked at T = 0 only; drop "
                                "eval.temperature or check one k at T > 0 with --num-speculative-tokens")
        k = int(schedule_config["num_speculative_tokens"])
    if engine not in ENGINES:
        raise ServeCheckError(f"--engine {engine!r}: this check runs {ENGINES} (SGLang has no CPU build to run here; "
                              "its export format is checked by tests/test_engine_formats.py)")
    engine_python = engine_python or sys.executable
    engine_format = engine_format or engine
    check_engine(engine_python, engine)
    s = setup
    prompts = evaluation_prompts(s, questions, num_prompts)
    out_dir = s.out_dir / "serve_check"
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="serve_check_") as tmp:
        work = Path(tmp)
        t = s.cfg.target
        target, draft, padded = prepare_engine_models(s.target_path, s.head_path, engine, engine_format, work, k,
                                                      t.quantization, t.dtype, t.revision)
        draft_config = read_head_json(draft)
        spec = served_spec(export_kind(served_kind(draft_config)), engine_method, parallel_drafting, schedule_config)
        method, parallel = spec["method"], bool(spec.get("parallel_drafting"))
        check_vllm_method(method, draft_config, s.head_path, parallel)  # the traps, named before any engine time is spent
        if schedule_config is not None:  # as this head is served (evaluation/main.py checked so before any load)
            check_speculative_config(schedule_config, "--speculative-config", served=spec)
        request = {"model": target, "dtype": str(s.cfg.target.dtype), "max_model_len": int(s.gen.max_length),
                   "prompts": prompts, "max_tokens": int(s.gen.max_new_tokens),
                   "stop_token_ids": list(s.gen.eos_token_id or []), "seed": int(s.cfg.seed),
                   "patch_cpu_expand": bool(patch_engine)}
        spec_config = vllm_speculative_config(spec, draft, k)
        if schedule_config is not None:
            spec_config[SCHEDULE_KEY] = schedule_config[SCHEDULE_KEY]
            report = schedule_check(s, prompts, engine, engine_python, work, request, spec_config, target, padded,
                                    tolerance)
        elif temperature > 0:
            report = serve_check_sampling.check(s, prompts, k, temperature, engine, engine_python, work, request,
                                                spec_config, alpha or serve_check_sampling.DEFAULT_ALPHA)
        else:
            report = greedy_check(s, prompts, k, engine, engine_python, work, request, spec_config, target, padded,
                                  tolerance)
        engine_log = (work / f"{engine}.log").read_text(errors="replace")
    report = {"engine": engine, "engine_python": engine_python, "engine_format": engine_format, "method": method,
              "parallel_drafting": parallel,
              "draft_config": draft_config, "target": s.target_path, "head": s.head_path, "padded_head_dim": padded,
              "prompts": len(prompts), "max_new_tokens": s.gen.max_new_tokens, "num_speculative_tokens": k,
              **report}
    if served_label(s.cfg.target.quantization):
        report["served_target"] = served_label(s.cfg.target.quantization)
    report["seconds"]["total"] = time.perf_counter() - t0
    md = (serve_check_sampling.markdown(report) if temperature > 0 else
          schedule_markdown(report) if schedule_config is not None else markdown(report))
    md = with_served_target(md, report)
    write_check_report(out_dir, report, md, engine_log)
    print(md)
    print(f"report: {out_dir / 'report.md'}")
    return 0 if report["passed"] else 1


def with_served_target(md: str, report: dict) -> str:
    """The report's markdown with the served target's line after its first paragraph (a quantized target only)."""
    if not report.get("served_target"):
        return md
    title, _, rest = md.partition("\n\n")
    line = (f"Target served by the engine: `{report['served_target']}` (engine/quantized_target.py), the weights "
            "this project's decoder quantizes in memory.")
    return f"{title}\n\n{line}\n\n{rest}"


def write_check_report(out_dir: Path, report: dict, md: str, engine_log: str) -> Path:
    """serve_check/ with report.json, report.md and the engine's log, replaced whole once complete
    (eagle/atomic_folder.py `write_results_folder`): a rerun that fails leaves the previous check's report."""
    def fill(tmp: Path) -> None:
        (tmp / "engine.log").write_text(engine_log)
        (tmp / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        (tmp / "report.md").write_text(md)

    return write_results_folder(out_dir, fill, "serve-check report")


def schedule_check(s, prompts, engine, engine_python, work, request, spec_config, target, padded,
                   tolerance) -> dict:
    """T = 0 with a k-per-batch-size schedule (module docstring): the greedy check at batch size 1 (the schedule's k
    there), plus the whole batch served with the schedule: outputs equal plain decoding's, and its mean drafted
    tokens per draft within the schedule's k over the batch sizes it passed through."""
    schedule, n = spec_config[SCHEDULE_KEY], spec_config["num_speculative_tokens"]
    k1 = k_at(schedule, 1, n)
    batched = {"name": "schedule_batched", "speculative_config": spec_config}
    single = {"name": "schedule_batch1", "speculative_config": spec_config, "engine_args": {"max_num_seqs": 1}}
    report = greedy_check(s, prompts, max(k1, 1), engine, engine_python, work, request, spec_config, target, padded,
                          tolerance, runs=[single, batched], speculative_name="schedule_batch1")
    eos = list(s.gen.eos_token_id or [])
    plain, whole = report.pop("engine_runs")
    same = sum(strip_stop(a, eos) == strip_stop(b, eos) for a, b in zip(plain["outputs"], whole["outputs"]))
    ks = sorted({k_at(schedule, b, n) for b in range(1, len(prompts) + 1)} - {0})
    m = whole["metrics"]
    mean_k = m["num_draft_tokens"] / m["num_drafts"] if m["num_drafts"] else 0.0
    obeys = (m["num_drafts"] == 0) if not ks else ks[0] <= mean_k <= ks[-1]
    if k1 == 0:  # no speculation at batch size 1: the single-request run must draft nothing
        e = report["engine_acceptance"]
        report["passed"] = report["identical_outputs"] == len(prompts) and e["num_drafts"] == 0
        report["ratio"], report["position_ratios"] = None, []
    report.update(schedule=schedule, k_at_batch1=k1, batched_identical_outputs=same,
                  batched_k_range=[ks[0], ks[-1]] if ks else [0, 0], batched_mean_drafted_per_draft=mean_k,
                  batched_metrics=m, batched_obeys_schedule=obeys,
                  passed=report["passed"] and same == len(prompts) and obeys)
    report["seconds"]["engine_generate_batched"] = whole["generate_s"]
    return report


def greedy_check(s, prompts, k, engine, engine_python, work, request, spec_config, target, padded, tolerance,
                 runs: list[dict] | None = None, speculative_name: str = "speculative") -> dict:
    """T = 0: engine plain vs speculative outputs, engine vs project acceptance (mean and per position). `runs`:
    other engine runs beside "plain" (default: `spec_config` as "speculative"); `speculative_name` is the one
    compared; with `runs` given the report keeps the engine's plain and last runs under "engine_runs"."""
    gen = s.gen
    eos = list(gen.eos_token_id or [])
    ours = project_run(s.models["A"], prompts, k, gen.max_new_tokens, gen.max_length, eos)
    ours_vanilla, ours_chain, ours_acc, ours_s, ours_per_prompt = ours
    equivalence = None
    if padded:
        equivalence = padded_equivalence(ours, s.models["A"].base_model.dtype, target, str(work / "head_padded"),
                                         prompts, k, gen)
        log.info("padded copies vs originals in our decoder: %s", equivalence)
    extra = runs or [{"name": "speculative", "speculative_config": spec_config}]
    result = engine_runs(engine, engine_python, {**request, "runs": [
        {"name": "plain", "speculative_config": None}, *extra]}, work)
    plain, spec = result["runs"]["plain"], result["runs"][speculative_name]
    m = spec["metrics"]
    engine_acc = Acceptance(m["num_drafts"], m["num_accepted_tokens"], list(m["accepted_per_pos"]))
    per_prompt = []
    for i, p in enumerate(prompts):
        a, b = strip_stop(plain["outputs"][i], eos), strip_stop(spec["outputs"][i], eos)
        per_prompt.append({"prompt": i, "engine_spec_vs_plain": a == b,
                           "engine_vs_project_vanilla": a == strip_stop(ours_vanilla[i], eos),
                           "project_chain_vs_vanilla": strip_stop(ours_chain[i], eos) == strip_stop(ours_vanilla[i], eos),
                           "new_tokens": len(b)})
    warn(acceptance_warning(f"serve-check ({engine})", s.head_path, engine_acc.mean_length, engine_acc.num_drafts))
    warn(acceptance_warning("serve-check (this project's decoder)", s.head_path, ours_acc.mean_length,
                            ours_acc.num_drafts))
    ratio = engine_acc.mean_length / ours_acc.mean_length
    position_ratios = [e / o if o else (1.0 if e == o else float("inf"))
                       for e, o in zip(engine_acc.per_position(), ours_acc.per_position())]
    identical = sum(r["engine_spec_vs_plain"] for r in per_prompt)
    context = [] if not m["num_drafts"] else by_context(  # a schedule with k = 0 at batch size 1 drafts nothing
        prompts, spec.get("per_request") or [None] * len(prompts), ours_per_prompt, k, [int(e) for e in s.cfg.eval.context_buckets], tolerance)
    passed = (identical == len(prompts) and abs(ratio - 1.0) <= tolerance
              and all(abs(r - 1.0) <= tolerance for r in position_ratios)
              and all(b["within_tolerance"] for b in context))
    return {
        "engine_version": result.get("vllm_version"), "temperature": 0.0, "padded_equivalence": equivalence,
        "identical_outputs": identical, "per_prompt": per_prompt,
        "engine_acceptance": {**dataclasses.asdict(engine_acc), "mean_length": engine_acc.mean_length,
                              "per_position": engine_acc.per_position()},
        "project_acceptance": {**dataclasses.asdict(ours_acc), "mean_length": ours_acc.mean_length,
                               "per_position": ours_acc.per_position()},
        "ratio": ratio, "position_ratios": position_ratios, "tolerance": tolerance, "passed": passed,
        "context_buckets": [int(e) for e in s.cfg.eval.context_buckets], "by_context": context,
        "seconds": {"project_decode": ours_s, "engine_load_plain": plain["load_s"],
                    "engine_generate_plain": plain["generate_s"], "engine_load_speculative": spec["load_s"],
                    "engine_generate_speculative": spec["generate_s"]},
        **({"engine_runs": (plain, result["runs"][extra[-1]["name"]])} if runs else {}),
    }


def markdown(r: dict) -> str:
    """The serve-check report as markdown."""
    e, p = r["engine_acceptance"], r["project_acceptance"]
    k = r["num_speculative_tokens"]
    lines = [f"# serve-check: {r['engine']} {r['engine_version']} ({'PASS' if r['passed'] else 'FAIL'})", "",
             f"head `{r['head']}` on `{r['target']}`, served as format `{r['engine_format']}` with vLLM method "
             f"`{r['method']}`{' with parallel_drafting' if r.get('parallel_drafting') else ''}; {r['prompts']} prompts "
             f"x {r['max_new_tokens']} new tokens, greedy, chain of {k} drafted tokens"
             f"{' (all from one head forward, on both sides)' if r.get('parallel_drafting') else ''}.", ""]
    if r["padded_head_dim"]:
        eq = r["padded_equivalence"]
        lines += [f"head_dim padded to {r['padded_head_dim']} for the engine's CPU attention; in this project's "
                  f"decoder the padded copies are token-identical to the originals on {eq['vanilla_identical']}/"
                  f"{eq['prompts']} prompts (vanilla) and {eq['chain_identical']}/{eq['prompts']} (chain), "
                  f"acceptance identical: {eq['acceptance_identical']}.", ""]
    lines += [f"Outputs identical with and without speculation in the engine: {r['identical_outputs']}/{r['prompts']}; "
              f"engine = this project's vanilla: {sum(x['engine_vs_project_vanilla'] for x in r['per_prompt'])}/"
              f"{r['prompts']}.", "",
              "| | mean acceptance length | " + " | ".join(f"pos {i + 1}" for i in range(k)) + " | drafts |",
              "|---|---|" + "---|" * k + "---|",
              f"| {r['engine']} | {e['mean_length']:.3f} | " + " | ".join(f"{x:.3f}" for x in e["per_position"])
              + f" | {e['num_drafts']} |",
              f"| this project | {p['mean_length']:.3f} | " + " | ".join(f"{x:.3f}" for x in p["per_position"])
              + f" | {p['num_drafts']} |",
              "", f"ratio engine / project: {r['ratio']:.4f}, per position "
              + " ".join(f"{x:.4f}" for x in r["position_ratios"]) + f" (tolerance +-{r['tolerance']:.2%}).",
              f"Time: {r['seconds']['total']:.0f} s in all (engine generate {r['seconds']['engine_generate_plain']:.1f} s "
              f"plain, {r['seconds']['engine_generate_speculative']:.1f} s speculative).", ""]
    lines += context_markdown(r)
    bad = [x["prompt"] for x in r["per_prompt"] if not x["engine_spec_vs_plain"]]
    if bad:
        lines += [f"Prompts whose engine output changed with speculation: {bad}", ""]
    return "\n".join(lines)


def context_markdown(r: dict) -> list[str]:
    """The per-context-length table (lines), when the prompts fall in more than one bucket of eval.context_buckets."""
    rows = r.get("by_context") or []
    if len(rows) < 2:
        return []
    k = r["num_speculative_tokens"]
    lines = [f"By context length (prompt tokens, eval.context_buckets={r['context_buckets']}): mean acceptance "
             "length and per-position acceptance, engine / this project, each bucket's requests pooled.", "",
             "| bucket | prompts | prompt tokens | engine | this project | ratio | "
             + " | ".join(f"pos {i + 1} engine / ours" for i in range(k)) + " |",
             "|---|---|---|---|---|---|" + "---|" * k]
    for b in rows:
        e, o = b["engine"], b["project"]
        lo, hi = b["prompt_tokens"]
        lines.append(f"| {b['bucket']} | {b['prompts']} | {lo}-{hi} | {e['mean_length']:.3f} | {o['mean_length']:.3f} "
                     f"| {b['ratio']:.4f}{'' if b['within_tolerance'] else ' (outside tolerance)'} | "
                     + " | ".join(f"{x:.3f} / {y:.3f}" for x, y in zip(e["per_position"], o["per_position"])) + " |")
    return lines + [""]


def schedule_markdown(r: dict) -> str:
    """The report of a schedule check: the batch-size-1 chain as `markdown`, then the batched run."""
    k1 = r["k_at_batch1"]
    head = markdown({**r, "num_speculative_tokens": max(k1, 1)}) if k1 else (
        f"# serve-check: {r['engine']} {r['engine_version']} ({'PASS' if r['passed'] else 'FAIL'})\n\n"
        f"The schedule serves no speculation at batch size 1: that run drafted {r['engine_acceptance']['num_drafts']} "
        f"times (0 expected); outputs identical to plain decoding: {r['identical_outputs']}/{r['prompts']}.\n")
    lo, hi = r["batched_k_range"]
    return head + "\n".join([
        "", f"Schedule `{r['schedule']}` (num_speculative_tokens {r['num_speculative_tokens']}); the table above is "
        f"one request at a time (max_num_seqs 1: k = {k1}).",
        f"All {r['prompts']} prompts at once (k switching as the batch shrinks): outputs identical to plain decoding "
        f"{r['batched_identical_outputs']}/{r['prompts']}; drafted tokens per draft {r['batched_mean_drafted_per_draft']:.2f}"
        f" (the schedule's k over batch sizes 1-{r['prompts']}: {lo}-{hi}; obeyed: {r['batched_obeys_schedule']}); "
        f"engine mean acceptance length {1 + r['batched_metrics']['num_accepted_tokens'] / max(r['batched_metrics']['num_drafts'], 1):.3f}.",
        ""])
