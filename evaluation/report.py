"""Write an evaluation's results: report.json (every number), report.md (tables), PNG figures."""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from eagle.atomic_folder import replace_files, write_results_folder
from eagle.state_files import write_json_state
from evaluation import plots
from evaluation.autotune import TuneResult
from evaluation.bootstrap import Estimate
from evaluation.calibration import Calibration
from evaluation.context_buckets import ContextReport
from evaluation.headline import headline_text
from evaluation.headline import number_text
from evaluation.losslessness import DistributionTest, GreedyCheck
from evaluation.metrics import OVERALL, Comparison, MethodSummary, committed_in_rounds, rounds_of
from evaluation.runner import BenchmarkRun
from evaluation.spans import SpanComparison, SpanSummary
from export.eval_outputs import EVAL_REPORT


@dataclass
class EvalReport:
    meta: dict  # target, head, chat format, generation arguments, methods, hardware
    run: BenchmarkRun
    summaries: list[MethodSummary]
    comparisons: list[Comparison]
    greedy: GreedyCheck | None  # None at T > 0
    calibration: dict[str, dict[str, Calibration]] = field(default_factory=dict)  # method -> quantity -> Calibration
    spans: list[SpanSummary] = field(default_factory=list)  # tau per reasoning / answer / tool-call span
    span_comparisons: list[SpanComparison] = field(default_factory=list)  # tau(b) - tau(a) per span, paired
    context: ContextReport | None = None  # tau / alpha_d per prompt-length bucket (eval.context_buckets)

    def to_dict(self) -> dict:
        return {
            "meta": self.meta,
            "summaries": [s.to_dict() for s in self.summaries],
            "comparisons": [c.to_dict() for c in self.comparisons],
            "headline": headline(self.summaries, self.greedy, self.meta.get("methods", {})),
            "losslessness": self.greedy.to_dict() if self.greedy else None,
            "calibration": {m: {q: c.to_dict() for q, c in cals.items()} for m, cals in self.calibration.items()},
            "spans": [x.to_dict() for x in self.spans],
            "span_comparisons": [x.to_dict() for x in self.span_comparisons],
            "context": self.context.to_dict() if self.context is not None else None,
            "skipped": self.run.skipped,
            "turns": [{"question_id": r.question_id, "category": r.category, "turn": r.turn, "method": r.method,
                       "prompt_tokens": len(r.prompt_ids), "new_tokens": r.new_tokens, "wall_s": r.wall_s,
                       "rounds": len(rounds_of(r)), "committed_in_rounds": committed_in_rounds(r),
                       "accept_lengths": [int(x.accept_length) for x in rounds_of(r)]} for r in self.run.results],
        }


def _ci(e: Estimate | None, digits: int = 2) -> str:
    if e is None:
        return "–"
    if e.low is None:
        return number_text(e.value, digits)
    return f"{number_text(e.value, digits)} [{number_text(e.low, digits)}, {number_text(e.high, digits)}]"


def headline(summaries: list[MethodSummary], greedy: GreedyCheck | None, methods: dict) -> dict | None:
    """The fastest speculative method overall (highest speedup point estimate): its label, tree, tau, speedup
    with CI, and the greedy mismatch count (None at T > 0). None when no speculative method has a speedup."""
    ranked = [s for s in summaries if s.category == OVERALL and s.speedup is not None and s.method in methods
               and methods[s.method].get("mode") != "vanilla"]
    if not ranked:
        return None
    best = max(ranked, key=lambda s: s.speedup.value)
    return {"method": best.method, "describe": methods[best.method].get("describe", ""),
            "tau": best.tau.value, "speedup": best.speedup.value, "speedup_low": best.speedup.low,
            "speedup_high": best.speedup.high, "faster": best.speedup.low is not None and best.speedup.low > 1.0,
            "mismatches": None if greedy is None else len(greedy.mismatches),
            "compared": None if greedy is None else greedy.compared}


def span_lines(report: EvalReport) -> list[str]:
    """The 'tau by span' section: per category and span of the answer (reasoning / answer / tool call) each
    method's tau [CI] (rounds) and alpha_1, then the paired tau differences; none when every round drafted an answer
    (no reasoning or tool call was generated)."""
    if not any(x.span != "answer" for x in report.spans):
        return []
    methods = list(dict.fromkeys(x.method for x in report.spans))
    by = {(x.method, x.category, x.span): x for x in report.spans}
    rows = list(dict.fromkeys((x.category, x.span) for x in report.spans))
    rows.sort(key=lambda r: r[0] == OVERALL)
    lines = ["## tau by span of the answer", "",
             "Each round counts for the span of its first committed token: reasoning = inside <think>...</think>, "
             "tool_call = the template's tool-call markup, answer = the rest. Cells: tau [95% CI] (rounds), alpha_1.",
             "", "| category | span | " + " | ".join(methods) + " |", "|" + "---|" * (2 + len(methods))]
    for cat, span in rows:
        cells = [f"{_ci(x.tau)} ({x.rounds}), {number_text(x.alpha_1)}" if (x := by.get((mm, cat, span))) else "–"
                 for mm in methods]
        lines.append(f"| {cat} | {span} | " + " | ".join(cells) + " |")
    lines.append("")
    if report.span_comparisons:
        lines += ["| a | b | category | span | questions | tau(b) - tau(a) |", "|---|---|---|---|---|---|"]
        lines += [f"| {c.a} | {c.b} | {c.category} | {c.span} | {c.questions} | {_ci(c.tau_difference)} |"
                  for c in report.span_comparisons]
        lines.append("")
    return lines


def context_lines(context: ContextReport | None) -> list[str]:
    """The report's "By context length" section: tau and alpha_d per (method, bucket), paired differences per bucket."""
    if context is None or not context.summaries:
        return []
    depth = max((len(s.depth_acceptance) for s in context.summaries), default=0)
    lines = ["## By context length", "", f"Buckets of prompt tokens (eval.context_buckets={list(context.edges)}); "
             "turns per bucket: " + ", ".join(f"{b} {n}" for b, n in context.turns.items()) + ".", "",
             "| bucket | method | questions | rounds | tau | " + " | ".join(f"alpha_{d}" for d in range(1, depth + 1)) + " |",
             "|" + "---|" * (5 + depth)]
    for s in context.summaries:
        alphas = [number_text(a.rate) for a in s.depth_acceptance] + ["–"] * (depth - len(s.depth_acceptance))
        lines.append(f"| {s.category} | {s.method} | {s.questions} | {s.rounds} | {_ci(s.tau)} | " + " | ".join(alphas) + " |")
    if context.comparisons:
        lines += ["", "| bucket | a | b | tau(a) - tau(b) | tau(a) / tau(b) |", "|---|---|---|---|---|"]
        lines += [f"| {c.category} | {c.a} | {c.b} | {_ci(c.tau_difference)} | {_ci(c.tau_ratio)} |"
                  for c in context.comparisons]
    return lines + [""]


def markdown(report: EvalReport, figures: dict[str, str]) -> str:
    """The report's tables as Markdown (figures: caption -> relative PNG path)."""
    m = report.meta
    overall = [s for s in report.summaries if s.category == OVERALL]
    methods = [s.method for s in overall]
    categories = [c for c in dict.fromkeys(s.category for s in report.summaries) if c != OVERALL]
    by = {(s.method, s.category): s for s in report.summaries}
    max_depth = max((len(s.depth_acceptance) for s in overall), default=0)
    lines = [f"# Evaluation: {m.get('title', 'EAGLE decoding')}", ""]
    for k in ("target", "head", "compare_head", "questions", "chat_format", "dtype", "quantization", "generation", "hardware",
              "command", "code", "date"):
        if m.get(k) and not (k == "quantization" and m[k] == "none"):  # a full-precision target: as before
            lines.append(f"- **{k}**: `{m[k]}`" if not isinstance(m[k], dict) else
                         f"- **{k}**: " + ", ".join(f"{a}={b}" for a, b in m[k].items()))
    lines += ["", "tau = tokens committed per target forward (vanilla = 1.00); speedup = tokens/s over vanilla's on the "
              "same prompts; brackets: paired bootstrap 95% CI over questions; alpha_d = P(depth-d token accepted | "
              "depths < d accepted).", ""]
    best = headline(report.summaries, report.greedy, m.get("methods", {}))
    if best is not None:
        lines += ["## Headline", "", f"**{headline_text(best)}**", ""]
    lines += ["## Overall", ""]
    head = "| method | tau | tokens/s | speedup | " + " | ".join(f"alpha_{d}" for d in range(1, max_depth + 1)) + " |"
    lines += [head, "|" + "---|" * (4 + max_depth)]
    modes = {k: v.get("mode") for k, v in m.get("methods", {}).items()}
    for s in sorted(overall, key=lambda s: (modes.get(s.method) != "vanilla",  # vanilla, then the fastest first
                                            -(s.speedup.value if s.speedup is not None else 0.0))):
        alphas = [number_text(a.rate) for a in s.depth_acceptance] + ["–"] * (max_depth - len(s.depth_acceptance))
        lines.append(f"| {s.method} | {_ci(s.tau)} | {_ci(s.tokens_per_s, 1)} | {_ci(s.speedup)} | " + " | ".join(alphas) + " |")
    lines += ["", "Methods: " + "; ".join(f"`{k}` = {v['describe']}" for k, v in m.get("methods", {}).items()), ""]
    for title, attr in (("tau per category", "tau"), ("Speedup per category", "speedup")):
        lines += [f"## {title[0].upper() + title[1:]}", "", "| category | " + " | ".join(methods) + " |",
                  "|" + "---|" * (1 + len(methods))]
        for c in categories + [OVERALL]:
            cells = [_ci(getattr(by[(mm, c)], attr)) if (mm, c) in by else "–" for mm in methods]
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += span_lines(report)
    lines += context_lines(report.context)
    if report.comparisons:
        lines += ["## Paired comparisons", "", "| a | b | tau(a) - tau(b) | tau(a) / tau(b) | tokens/s(a) / tokens/s(b) |",
                  "|---|---|---|---|---|"]
        lines += [f"| {c.a} | {c.b} | {_ci(c.tau_difference)} | {_ci(c.tau_ratio)} | {_ci(c.speed_ratio)} |"
                  for c in report.comparisons]
        lines.append("")
    lines += ["## Losslessness", ""]
    if report.greedy is None:
        lines.append("T > 0: outputs are random; run `python -m evaluation chi2 ...` for the distribution test.")
    else:
        g = report.greedy
        ties = len(g.mismatches) - len(g.divergences)
        verdict = ("LOSSLESS (bit-exact)" if g.lossless else
                   f"LOSSLESS UP TO PRECISION ({ties} near-ties)" if not g.divergences else
                   f"NOT LOSSLESS ({len(g.divergences)} divergences)")
        lines.append(f"Greedy outputs compared with vanilla token by token: {g.compared} turns, "
                     f"{len(g.mismatches)} mismatch(es) -> **{verdict}**.")
        if ties:
            lines.append(f"\nA near-tie: at the first differing position the target's logits of the two tokens differ by "
                         f"<= {g.tie_ulps:g} ulp of the logit scale in {m.get('dtype', 'the target dtype')}; a tree "
                         "forward and a one-token forward round differently, so either token is the argmax up to "
                         "rounding. Evaluate in float32 for a bit-exact check.")
        if g.mismatches:
            lines += ["", "| question | turn | method | first diverging position | vanilla token | method token | "
                      "logit gap (ulp) | kind | lengths |", "|---|---|---|---|---|---|---|---|---|"]
            for x in g.mismatches[:50]:
                gap = f"{x.logit_gap:.3g} ({x.gap_ulps:.1f})" if x.logit_gap is not None else "–"
                kind = "near-tie" if x.near_tie else "divergence"
                lines.append(f"| {x.question_id} | {x.turn} | {x.method} | {x.position} | {x.expected} | {x.got} | "
                             f"{gap} | {kind} | {x.vanilla_tokens} / {x.method_tokens} |")
            if len(g.mismatches) > 50:
                lines.append(f"\n... {len(g.mismatches) - 50} more in report.json")
    lines.append("")
    if report.calibration:
        lines += ["## Calibration (draft confidence vs acceptance)", "",
                  "path_prob / node_prob: the draft's own probabilities (before calibration); path_score / node_score: "
                  "the calibrated acceptance the tree was ranked by (after; only for trees ranked by a fitted map). "
                  "node_*: nodes whose parent was accepted. ECE: count-weighted |acceptance - confidence| over "
                  "equal-width bins; ECE (bins): its unweighted mean over the non-empty bins.", "",
                  "| method | quantity | nodes | ECE | ECE (bins) | Pearson r (nodes) | Pearson r (bins) |",
                  "|---|---|---|---|---|---|---|"]
        for meth, cals in report.calibration.items():
            for q, c in cals.items():
                note = f" ({c.note})" if c.note else ""
                lines.append(f"| {meth} | {q}{note} | {c.nodes} | {number_text(c.ece, 3)} | "
                             f"{number_text(c.ece_bins, 3)} | {number_text(c.pearson_r)} | "
                             f"{number_text(c.binned_pearson_r)} |")
        lines.append("")
        maps = {k: v["calibration"] for k, v in m.get("methods", {}).items() if v.get("calibration")}
        if maps:
            lines += ["Tree scores per method (maps fitted by `python -m evaluation autotune` on held-out prompts and "
                      "saved in the head's tree_config.json): " + "; ".join(f"`{k}`: {v}" for k, v in maps.items()), ""]
    lines += ["## Where the time goes (seconds, overall)", "", "| method | total | prefill | draft | verify | commit |",
              "|---|---|---|---|---|---|"]
    for s in overall:
        p = s.phase_seconds
        lines.append(f"| {s.method} | {number_text(s.seconds)} | {number_text(p.get('prefill_s'))} | "
                     f"{number_text(p.get('draft_s'))} | {number_text(p.get('verify_s'))} | "
                     f"{number_text(p.get('commit_s'))} |")
    lines.append("")
    if report.run.skipped:
        lines += [f"## Skipped turns ({len(report.run.skipped)})", ""]
        lines += [f"- {s['question_id']} turn {s['turn']} ({s['method']}): {s['reason']}" for s in report.run.skipped[:30]]
        lines.append("")
    if figures:
        lines += ["## Figures", ""] + [f"![{cap}]({path})" for cap, path in figures.items()] + [""]
    return "\n".join(lines)



REPORT_FILES = ("report.json", "report.md", "answers.jsonl")  # with the *.png beside them: one evaluation's files


def report_file(name: str) -> bool:
    """A file of the evaluation report in its folder (the eval folder also holds serve_sweep/, serve_check/...)."""
    return name in REPORT_FILES or name.endswith(".png")


def write_report(report: EvalReport, out_dir: Path, answers=None) -> dict[str, Path]:
    """report.json, report.md and the PNGs (and answers.jsonl: `answers(path)` writes it) in `out_dir`, replacing the
    previous report's files only once every new one is written (eagle/atomic_folder.py `replace_files`: a failure
    leaves the previous report whole; its plots the new one lacks go); returns name -> path."""
    out_dir = Path(out_dir)
    paths: dict[str, Path] = {}

    def fill(tmp: Path) -> None:
        paths["tau"] = plots.plot_tau(report.summaries, tmp / "tau_by_category.png")
        if any(s.speedup is not None for s in report.summaries):
            paths["speedup"] = plots.plot_speedup(report.summaries, tmp / "speedup_by_category.png")
        if any(s.depth_acceptance for s in report.summaries):
            paths["depth_acceptance"] = plots.plot_depth_acceptance(report.summaries, tmp / "depth_acceptance.png")
        if report.context is not None and report.context.summaries:
            paths["tau by context"] = plots.plot_tau_by_context(report.context, tmp / "tau_by_context.png")
        for meth, cals in report.calibration.items():
            if any(c.nodes for c in cals.values()):
                paths[f"calibration {meth}"] = plots.plot_calibration(
                    cals, f"Calibration: {meth}", tmp / f"calibration_{plots.safe_name(meth)}.png")
        paths["json"] = tmp / "report.json"
        plain = json.loads(json.dumps(_finite(report.to_dict()), default=_json_default))  # JSON types only
        write_json_state(paths["json"], plain, EVAL_REPORT)
        figures = {k: p.name for k, p in paths.items() if p.suffix == ".png"}
        paths["markdown"] = tmp / "report.md"
        paths["markdown"].write_text(markdown(report, figures))
        if answers is not None:
            paths["answers"] = answers(tmp / "answers.jsonl")

    out_dir.mkdir(parents=True, exist_ok=True)
    replace_files(out_dir, fill, report_file, "evaluation report")
    return {k: out_dir / p.name for k, p in paths.items()}


def write_answers(run: BenchmarkRun, decode, path: Path) -> Path:
    """answers.jsonl: one line per (question, turn, method) with the generated text and token ids."""
    with open(path, "w", encoding="utf-8") as f:
        for r in run.results:
            f.write(json.dumps({"question_id": r.question_id, "category": r.category, "turn": r.turn,
                                "method": r.method, "text": decode(r.output_ids), "output_ids": r.output_ids}) + "\n")
    return path


def write_autotune_report(result: TuneResult, meta: dict, out_dir: Path) -> dict[str, Path]:
    """autotune.json, autotune.md (the whole surface, fastest first) and autotune_surface.png: the folder `out_dir`
    replaced whole once complete (eagle/atomic_folder.py `write_results_folder`)."""
    names = {"png": "autotune_surface.png", "json": "autotune.json", "markdown": "autotune.md"}
    write_results_folder(out_dir, lambda tmp: _autotune_files(result, meta, {k: tmp / v for k, v in names.items()}),
                         "autotune report")
    return {k: Path(out_dir) / v for k, v in names.items()}


def _autotune_files(result: TuneResult, meta: dict, paths: dict[str, Path]) -> None:
    plots.plot_autotune(result, paths["png"])
    paths["json"].write_text(json.dumps(_finite({"meta": meta, **result.to_dict()}), indent=1, default=_json_default) + "\n")
    b = result.best
    lines = ["# EAGLE-2 tree auto-tuning", ""]
    lines += [f"- **{k}**: `{v}`" for k, v in meta.items()]
    finals = sorted((p for p in result.points if p.final_speedup is not None),
                    key=lambda p: -p.predicted_tokens_per_s)
    e1 = f", EAGLE-1 {result.eagle1_tokens_per_s:.1f}" if result.eagle1_tokens_per_s is not None else ""
    lines += ["", f"Best: **total_token={b.total_token}, depth={b.depth}, top_k={b.top_k}**, picked by the "
              f"{result.pick.get('by', 'model')} ({result.pick.get('rule', '')}); vanilla "
              f"{result.vanilla_tokens_per_s:.1f} tokens/s{e1} (medians of the final repeats).", ""]
    tm = result.time_model
    if tm is not None:
        lines += [f"Round-time model (robust least squares on {tm.calls} timed calls, {tm.clock} seconds): round = "
                  f"{tm.intercept * 1e3:.3f} ms + {tm.per_node * 1e3:.4f} ms x nodes + {tm.per_depth * 1e3:.3f} ms x "
                  f"depth + {tm.per_draft_token * 1e3:.4f} ms x depth x top_k; residual spread "
                  f"{tm.residual_s * 1e3:.3f} ms per round.", ""]
    if finals:
        lines += ["## Finalists (re-timed back to back with vanilla and EAGLE-1 on every prompt; medians over repeats)",
                  "", "| total_token | depth | top_k | tau | predicted tokens/s | tokens/s | speedup | vs EAGLE-1 |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {p.total_token} | {p.depth} | {p.top_k} | {p.tau:.2f} | {p.predicted_tokens_per_s:.1f} | "
                  f"{p.final_tokens_per_s:.1f} | {p.final_speedup:.2f} | {p.final_vs_eagle1:.2f} |" for p in finals]
        lines.append("")
    lines += ["## Surface (ranked by predicted tokens/s = tau / modelled round seconds; measured: one screening pass)",
              "", "| total_token | depth | top_k | tau | nodes/round | round ms (model) | round ms (measured) | "
              "predicted tokens/s | screening tokens/s | screening speedup |", "|---|---|---|---|---|---|---|---|---|---|"]
    for p in sorted(result.points, key=lambda p: -p.predicted_tokens_per_s):
        lines.append(f"| {p.total_token} | {p.depth} | {p.top_k} | {p.tau:.2f} | {p.nodes:.1f} | "
                     f"{p.predicted_round_s * 1e3:.3f} | {p.round_s * 1e3:.3f} | {p.predicted_tokens_per_s:.1f} | "
                     f"{p.tokens_per_s:.1f} | {p.speedup:.2f} |")
    if result.skipped:
        lines += ["", f"Skipped {len(result.skipped)} grid points the tree builder cannot make (see autotune.json)."]
    lines += ["", "![surface](autotune_surface.png)", ""]
    paths["markdown"].write_text("\n".join(lines))


def write_chi2_report(tests: list[DistributionTest], meta: dict, out_dir: Path) -> dict[str, Path]:
    """chi2.json and chi2.md: per method and position, statistic, dof, p-value, verdict; the folder `out_dir`
    replaced whole once complete (eagle/atomic_folder.py `write_results_folder`)."""
    names = {"json": "chi2.json", "markdown": "chi2.md"}
    write_results_folder(out_dir, lambda tmp: _chi2_files(tests, meta, {k: tmp / v for k, v in names.items()}),
                         "chi2 report")
    return {k: Path(out_dir) / v for k, v in names.items()}


def _chi2_files(tests: list[DistributionTest], meta: dict, paths: dict[str, Path]) -> None:
    paths["json"].write_text(json.dumps(_finite({"meta": meta, "tests": [t.to_dict() for t in tests]}), indent=1,
                                        default=_json_default) + "\n")
    lines = ["# Distribution test at T > 0 (chi-squared homogeneity vs vanilla)", ""]
    lines += [f"- **{k}**: `{v}`" for k, v in meta.items()]
    for t in tests:
        lines += ["", f"## {t.method}: {'PASS' if t.passed else 'FAIL'} ({t.samples} samples per method, T={t.temperature}, "
                  f"family-wise alpha {t.alpha}, Bonferroni over {len(t.positions)} positions)", "",
                  "| position | chi2 | dof | cells | p-value |", "|---|---|---|---|---|"]
        lines += [f"| {p.position} | {p.statistic:.2f} | {p.dof} | {p.cells} | {p.p_value:.4f} |" for p in t.positions]
    paths["markdown"].write_text("\n".join(lines) + "\n")


def _json_default(o):
    if dataclasses.is_dataclass(o):
        return dataclasses.asdict(o)
    if hasattr(o, "tolist"):
        return o.tolist()
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o)}")


def _finite(o):
    """NaN / inf -> None (strict JSON has no NaN), recursively."""
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, dict):
        return {k: _finite(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_finite(v) for v in o]
    return o
