"""The one-command demo: default target -> data prep -> training + export -> tuning -> evaluation, for an EAGLE-2 and
an EAGLE-3 head side by side.

    python -m quickstart [--target PATH] [--out DIR] [--fresh] [--head-kind {both,eagle2,eagle3}]
                         [--recipe tiny] [--recipe-eagle3 tiny-eagle3] [--eagle3-override key=value ...] [key=value ...]

--head-kind both (the default) runs two chains of stages and one evaluation:
    EAGLE-2 (--recipe, head A)       {out}/data, {out}/train, {out}/head, {out}/tune
    EAGLE-3 (--recipe-eagle3, B)     {out}/eagle3/{data,train,head,tune}; its data prep reuses {out}/data's
                                     regenerated answers (copied, not regenerated again) and caches the aux layers
    eval                             {out}/eval: both heads on the same questions, interleaved, with paired CIs
                                     of EAGLE-3 vs EAGLE-2 (tau and speed) and the losslessness of both
--head-kind eagle2 runs the EAGLE-2 chain and its evaluation alone (the folders above), eagle3 the EAGLE-3 chain
(regenerating its own answers) and its evaluation, in {out}/eval. key=value overrides go to every stage of
both chains; --eagle3-override key=value only to the EAGLE-3 chain (after them, e.g. head.aux_layers=[1,2,4] for
a --target with fewer layers than the default target's 16).

Every stage runs as its own documented command in a subprocess (the same command a user would type,
printed before it runs), so the demo exercises exactly the real CLIs and never reimplements them.
Output: progress (this script's `[quickstart]` lines and every stage's own output, progress bars included) goes
to stdout; stderr carries only the outcome of a failure, as ONE line (`error: stage train: <the stage's own
error line>; ...`), so `2>err.txt` captures exactly what to fix. Exit code: the failing stage's (2 for an
expected error), 0 on success.
Rerunnable: `{out}/quickstart_state.json` records each finished stage with a fingerprint of the recipe
sections it reads and of the stages it reads from; a finished stage with the same fingerprint is skipped, an
interrupted one is rerun (data prep and training resume from their own partial outputs), and a stage whose settings
changed is redone from scratch together with every stage that reads its output. Its previous outputs are not
deleted before that: when the stage starts they move to {out}/.superseded/ (with their state), a rerun with those
settings again (a typo fixed) puts them back instead of redoing the stage, and they are deleted only once the run
that superseded them has finished every stage.
Side by side: a stage starts as soon as the stages it reads from are done, up to --jobs (default 2) at a time, so
with both heads the EAGLE-3 chain (data prep, training, tuning) runs on the second core beside the EAGLE-2 training
and tuning, each stage with one intra-op thread; their progress lines interleave. When a stage fails no further
stage starts, the ones running finish (and are reused by the rerun), and the failure is still the one stderr line.
"""
from __future__ import annotations

import argparse
import codecs
import contextlib
import hashlib
import json
import os
import resource
import shlex
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from filelock import FileLock, Timeout
from omegaconf import OmegaConf

from data_prep.default_target import (CONVERSATIONS_FILE, QUESTIONS_FILE, SIZES, default_cache_dir,
                                      ensure_default_target, read_build_info)
from data_prep.docstring_corpus import default_conversations, default_questions
from data_prep.target import load_target_config, resolve_target_path
from eagle.cli_errors import DEBUG_ENV, ArgumentParser, debug_enabled, one_line_errors
from eagle.head_kinds import EAGLE2, EAGLE3, HEAD_KINDS, HeadKind
from eagle.state_files import StateFile, StateFileError, read_json_state, register, write_json_state
from evaluation.headline import headline_text
from export.eval_outputs import EVAL_REPORT
from recipes import RecipeError, layout, load_config
from recipes.head import check_head_fits_target

STATE_FILE = "quickstart_state.json"
PROMPTS_DIR = "prompts"  # stdlib prompt sets written here when --target is a user model


@dataclass(frozen=True)
class Stage:
    name: str
    module: str  # run as `python -m MODULE --recipe ... key=value ...`
    sections: tuple[str, ...]  # recipe sections whose values decide the stage's output
    outputs: tuple[str, ...]  # folders under the run folder the stage writes (removed when its settings change)
    title: str
    command: tuple[str, ...] = ()  # a subcommand before --recipe (e.g. evaluation's "autotune")
    head: HeadKind = EAGLE2  # whose chain: EAGLE2 = --recipe in {out}, EAGLE3 = --recipe-eagle3 in {out}/eagle3
    after: tuple[str, ...] = ()  # the stages whose outputs it reads: their fingerprints are part of its own


E3 = layout.EAGLE3_DIR
EAGLE2_STAGES = (
    Stage("data", "data_prep.main", ("seed", "target", "data"), (layout.DATA_DIR,),
          "data prep: regenerate answers with the target, loss masks, hidden-state cache"),
    Stage("train", "train.main", ("head", "train", "export"), (layout.TRAIN_DIR, layout.HEAD_DIR),
          "training the EAGLE-2 draft head (DeepSpeed) and exporting it", after=("data",)),
    Stage("tune", "evaluation", ("decoding", "eval"), (layout.TUNE_DIR,),
          "auto-tuning the EAGLE-2 tree for this machine (python -m evaluation autotune)", ("autotune",),
          after=("train",)),
)
EAGLE3_STAGES = (  # the aux layers decide the feature cache: the head section is part of the data stage's fingerprint
    Stage("eagle3-data", "data_prep.main", ("seed", "target", "data", "head"), (f"{E3}/{layout.DATA_DIR}",),
          "EAGLE-3 data prep: the aux-layer hidden-state cache", head=EAGLE3),
    Stage("eagle3-train", "train.main", ("head", "train", "export"),
          (f"{E3}/{layout.TRAIN_DIR}", f"{E3}/{layout.HEAD_DIR}"),
          "training the EAGLE-3 draft head (DeepSpeed) and exporting it", head=EAGLE3, after=("eagle3-data",)),
    Stage("eagle3-tune", "evaluation", ("decoding", "eval"), (f"{E3}/{layout.TUNE_DIR}",),
          "auto-tuning the EAGLE-3 tree for this machine", ("autotune",), head=EAGLE3, after=("eagle3-train",)),
)
EVAL_STAGE = Stage("eval", "evaluation", ("decoding", "eval"), (layout.EVAL_DIR,),
                   "evaluation: vanilla / EAGLE-1 / EAGLE-2 (60/5/10 and tuned), calibration, losslessness")
STAGES = (*EAGLE2_STAGES, *EAGLE3_STAGES, EVAL_STAGE)  # every stage any --head-kind runs (--fresh removes them all)


@dataclass(frozen=True)
class Chain:
    """The demo's part of a head kind: its stages, the options naming its recipe and its own overrides, its folder."""
    stages: tuple[Stage, ...]
    recipe_option: str
    subdir: str  # under {out} ("" = {out} itself)
    override_dest: str | None = None  # the argparse dest of overrides for this chain only
    eval_title: str = EVAL_STAGE.title  # the evaluation's title when this chain runs alone
    fit_hint: str = ""  # what to pass when the recipe's head does not fit the target

    @property
    def recipe_dest(self) -> str:
        """The argparse dest of `recipe_option` (--recipe-eagle3 -> recipe_eagle3)."""
        return self.recipe_option.removeprefix("--").replace("-", "_")


CHAINS = {EAGLE2: Chain(EAGLE2_STAGES, "--recipe", ""),
          EAGLE3: Chain(EAGLE3_STAGES, "--recipe-eagle3", E3, "eagle3_override",
                        "evaluation: vanilla / EAGLE-1 / EAGLE-3 (60/5/10 and tuned), calibration, losslessness",
                        "pass the EAGLE-3 head's layers for this target with --eagle3-override "
                        "head.aux_layers=[i,j,k], or --head-kind eagle2")}
HEAD_KIND_CHOICES = ("both", *(kind.name for kind in CHAINS))
# what head B (EAGLE-3) adds to the evaluation's methods with --head-kind both: its 60/5/10 tree (calibrated by its
# own tune stage) and its tuned tree, each paired with head A's method of the same name
HEAD_B_METHODS = ("eagle2@B", "tuned@B")


def plan(head_kind: str) -> list[Stage]:
    """The stages one --head-kind runs, in order."""
    if head_kind != "both":
        kind = HEAD_KINDS[head_kind]
        chain = CHAINS[kind]
        return [*chain.stages, replace(EVAL_STAGE, head=kind, after=(chain.stages[-1].name,), title=chain.eval_title)]
    return [*EAGLE2_STAGES, replace(EAGLE3_STAGES[0], after=("data",),  # it copies data's regenerated answers
                                    title="EAGLE-3 data prep: the aux-layer hidden-state cache, on the EAGLE-2 run's "
                                          "regenerated answers"),
            *EAGLE3_STAGES[1:],
            replace(EVAL_STAGE, after=("tune", "eagle3-tune"),
                    title="evaluation: vanilla / EAGLE-1 / EAGLE-2 and EAGLE-3 (60/5/10 and tuned) on the same "
                          "questions, paired; calibration, losslessness")]


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m quickstart", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="a local HF causal-LM folder or hub id to use instead of the "
                                                  "embedded default target (then also set data.source / eval.questions "
                                                  "for its domain, else the stdlib-docstring prompts are used)")
    p.add_argument("--target-size", default="default", choices=sorted(SIZES),
                   help="size preset of the embedded default target (test: seconds to build, for tests)")
    p.add_argument("--out", default=None, help="run folder (default: the recipe's output_dir, runs/tiny)")
    p.add_argument("--fresh", action="store_true", help="redo every stage (the cached default target is kept)")
    p.add_argument("--head-kind", default="both", choices=HEAD_KIND_CHOICES,
                   help="which draft heads to train and evaluate: both (default; one paired evaluation of EAGLE-3 vs "
                        "EAGLE-2 on the same questions), eagle2 or eagle3 alone")
    p.add_argument("--recipe", "--recipe-eagle2", default="tiny",
                   help="the EAGLE-2 head's recipe, name or YAML path (default: tiny); its output_dir is the run folder")
    p.add_argument("--recipe-eagle3", default="tiny-eagle3",
                   help=f"the EAGLE-3 head's recipe (default: tiny-eagle3, the same data and target as tiny); it runs "
                        f"in {{out}}/{layout.EAGLE3_DIR}")
    p.add_argument("--eagle3-override", action="append", default=[], metavar="key=value",
                   help="a recipe override for the EAGLE-3 stages only, after the shared ones (repeatable), e.g. "
                        "head.aux_layers=[1,2,4] for a --target with fewer than 14 layers")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                   help="stages run side by side when they do not read each other's output (default: 2, or 1 on a "
                        "one-core machine): with both heads the EAGLE-3 chain runs beside the EAGLE-2 training and "
                        "tuning; each stage keeps one intra-op thread")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="recipe overrides passed to every stage (of both "
                                                                     "heads)")
    return p


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and of its finished stage subprocesses."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def say(msg: str) -> None:
    """A progress line (stdout: stderr is reserved for the one line of a failure)."""
    print(f"[quickstart] {msg}", file=sys.stdout, flush=True)


def fail(msg: str, err) -> None:
    """The one stderr line of a failed run."""
    print(f"error: {' '.join(msg.split())}", file=err, flush=True)


def resolve_inputs(target: str | None, out_dir: Path, size: str = "default") -> tuple[str, dict[str, str], dict]:
    """(target path, overrides naming target/prompt files, target identity for the fingerprints)."""
    if target is None:
        path = ensure_default_target(size=size)
        info = read_build_info(path)
        return str(path), {"data.source": str(path / CONVERSATIONS_FILE),
                           "eval.questions": str(path / QUESTIONS_FILE)}, {"default_target": info["fingerprint"]}
    if Path(target).exists():  # a local folder: absolute, so reports and the printed commands name it exactly
        target = str(Path(target).resolve())

    prompts = out_dir / PROMPTS_DIR
    prompts.mkdir(parents=True, exist_ok=True)
    conv, questions = prompts / CONVERSATIONS_FILE, prompts / QUESTIONS_FILE
    conv.write_text(json.dumps(default_conversations("train"), indent=1, ensure_ascii=False))
    questions.write_text("".join(json.dumps(q, ensure_ascii=False) + "\n" for q in default_questions("eval")))
    config = Path(target) / "config.json"
    identity = {"target": target, "config_sha256": _sha256(config.read_bytes()) if config.is_file() else None}
    return target, {"data.source": str(conv), "eval.questions": str(questions)}, identity


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def stage_fingerprint(cfg, stage: Stage, upstream: str, identity: dict) -> str:
    """Hash of what the stage reads: its recipe sections, the target's identity and the hashes of the stages it reads
    from (`upstream`)."""
    resolved = OmegaConf.to_container(cfg, resolve=True)
    parts = {"sections": {s: resolved[s] for s in stage.sections}, "upstream": upstream, "target": identity}
    return _sha256(json.dumps(parts, sort_keys=True, default=str).encode())[:16]


QUICKSTART_STATE = register(StateFile(
    STATE_FILE, "QUICKSTART_OUT", writer="quickstart/demo.py",
    schema={"*": {"fingerprint": str, "done": bool, "seconds?": float}},
    rebuild="delete it (the demo then reruns every stage it cannot vouch for) or rerun with --fresh",
    when_missing="a fresh demo folder: every stage runs",
    example={"data": {"fingerprint": "0123456789abcdef", "done": True, "seconds": 12.5}}))


def read_state(out_dir: Path) -> dict:
    return read_json_state(out_dir / STATE_FILE, QUICKSTART_STATE) or {}


def write_state(out_dir: Path, state: dict) -> None:
    write_json_state(out_dir / STATE_FILE, state, QUICKSTART_STATE)


def remove_outputs(out_dir: Path, stages) -> None:
    for stage in stages:
        for name in stage.outputs:
            shutil.rmtree(out_dir / name, ignore_errors=True)


SUPERSEDED_DIR = ".superseded"  # in the run folder: outputs of stages whose settings changed, with their state


def supersede(out_dir: Path, stage: Stage, state: dict, held: dict) -> None:
    """Move `stage`'s outputs and state record out of the way of its rerun with other settings, into SUPERSEDED_DIR
    (`held`: its state file): kept there until the run that superseded them finishes. A finished run already held
    there is not replaced by an unfinished one (that one's partial outputs are dropped instead)."""
    rec, slot = state.pop(stage.name, None), out_dir / SUPERSEDED_DIR
    keep_held = held.get(stage.name, {}).get("done") and not (rec or {}).get("done")
    for name in stage.outputs:
        if keep_held:
            shutil.rmtree(out_dir / name, ignore_errors=True)
        elif (out_dir / name).exists():
            shutil.rmtree(slot / name, ignore_errors=True)
            (slot / name).parent.mkdir(parents=True, exist_ok=True)
            os.replace(out_dir / name, slot / name)
    if not keep_held and rec:
        held[stage.name] = rec
    write_state(slot, held)
    write_state(out_dir, state)


def put_back(out_dir: Path, stage: Stage, state: dict, held: dict) -> None:
    """Swap `stage`'s outputs and record with the superseded ones (those have this run's settings)."""
    slot, rec = out_dir / SUPERSEDED_DIR, held.pop(stage.name)
    for name in stage.outputs:
        here, there, aside = out_dir / name, slot / name, slot / f"{name}.swap"
        if here.exists():
            aside.parent.mkdir(parents=True, exist_ok=True)
            os.replace(here, aside)
        if there.exists():
            here.parent.mkdir(parents=True, exist_ok=True)
            os.replace(there, here)
        if aside.exists():
            os.replace(aside, there)
    if stage.name in state:
        held[stage.name] = state[stage.name]
    state[stage.name] = rec
    write_state(slot, held)
    write_state(out_dir, state)


def drop_superseded(out_dir: Path, stages, held: dict) -> None:
    """After every stage of a run finished: the outputs it superseded go."""
    slot = out_dir / SUPERSEDED_DIR
    for stage in stages:
        held.pop(stage.name, None)
        for name in stage.outputs:
            shutil.rmtree(slot / name, ignore_errors=True)
    if held:
        write_state(slot, held)
    else:
        shutil.rmtree(slot, ignore_errors=True)


def run_stage(stage: Stage, recipe: str, overrides: list[str], env: dict) -> float:
    """Run one stage's command; returns the CPU seconds (user + system) of it and its children."""
    cmd = [sys.executable, "-m", stage.module, *stage.command, "--recipe", recipe, *overrides]
    if "autotune" in stage.command:  # its report goes to {output_dir}/tune, not into the evaluation's folder
        out = dict(o.split("=", 1) for o in overrides if "=" in o)["output_dir"]
        cmd.append(f"eval.output_dir={Path(out) / layout.TUNE_DIR}")
    say("$ " + " ".join(shlex.quote(c) for c in cmd))
    sys.stdout.flush()
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE)
    tail = relay(proc.stderr, sys.stdout)
    _, status, usage = os.wait4(proc.pid, 0)  # this stage's own CPU time: stages may run side by side
    code = proc.returncode = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise StageFailed(stage, code, last_line(tail))
    return usage.ru_utime + usage.ru_stime


def relay(src, dst, keep: int = 8192) -> str:
    """Copy a stage's stderr (progress bars, warnings, its error line) to `dst` as it arrives; returns its tail."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    tail = ""
    while chunk := os.read(src.fileno(), 65536):
        text = decoder.decode(chunk)
        dst.write(text)
        dst.flush()
        tail = (tail + text)[-keep:]
    return tail


def last_line(text: str) -> str:
    """The last non-empty line of a stream (progress bars redraw with carriage returns): a CLI's `error: ...` line or the last
    line of a traceback."""
    lines = [ln.strip() for ln in text.replace("\r", "\n").splitlines() if ln.strip()]
    return lines[-1] if lines else ""


class StageFailed(RuntimeError):
    def __init__(self, stage: Stage, code: int, detail: str = ""):
        detail = detail.removeprefix("error:").strip()
        super().__init__(f"stage {stage.name} failed with exit code {code}" + (f": {detail}" if detail else ""))
        self.stage, self.code, self.detail = stage, code, detail


def read_eval_report(eval_dir: Path) -> dict:
    """The evaluation stage's report.json (it must exist: the stage just wrote it)."""
    path = eval_dir / EVAL_REPORT.name
    report = read_json_state(path, EVAL_REPORT)
    if report is None:
        raise StateFileError(f"{path}: missing (the eval stage writes it); {EVAL_REPORT.rebuild}")
    return report


def summarize_report(eval_dir: Path) -> list[str]:
    """One line per method (tau, speedup over vanilla) and the losslessness verdict, from report.json."""
    report = read_eval_report(eval_dir)
    lines = []
    for s in report["summaries"]:
        if s["category"] != "overall":
            continue
        speed = (s.get("speedup") or {}).get("value")
        lines.append(f"{s['method']:>10}: tau {s['tau']['value']:.2f}, {s['tokens_per_s']['value']:.1f} tokens/s"
                     + (f", speedup {speed:.2f}x" if speed is not None else ""))
    greedy = report.get("losslessness")
    if greedy is not None:
        lines.append(f"losslessness: {len(greedy['mismatches'])} mismatches with vanilla greedy "
                     f"over {greedy['compared']} outputs")
    return lines


def head_pair_lines(eval_dir: Path) -> list[str]:
    """Head B (EAGLE-3) beside head A (EAGLE-2), one line per tree both were evaluated with ("eagle2" and "eagle2@B"):
    tau and speed-up of each, and B / A paired over the same questions with its CI. [] without a head B."""
    report = read_eval_report(eval_dir)
    overall = {s["method"]: s for s in report["summaries"] if s["category"] == "overall"}
    pairs = {(c["a"], c["b"]): c for c in report.get("comparisons", []) if c["category"] == "overall"}
    lines = []
    for b in overall:
        spec, sep, args = b.partition(":")
        name, _, head = spec.partition("@")
        a = name + sep + args  # head A's method of the same tree: "tuned@B" -> "tuned", "eagle2@B:depth=8" -> ...
        if head != "B" or a not in overall:
            continue
        c = pairs.get((a, b))
        if c is None:  # listed the other way round: B / A is then the comparison's own ratio
            c, flip = pairs.get((b, a)), False
        else:
            flip = True
        if c is None:
            continue
        sa, sb = overall[a], overall[b]
        if not lines:
            n = sa.get("questions", "?")
            lines.append(f"EAGLE-3 (head B) vs EAGLE-2 (head A), paired over the same {n} questions "
                         "(B / A with 95% CI):")
        lines.append(f"{a:>10} vs {b}: tau {sa['tau']['value']:.2f} vs {sb['tau']['value']:.2f}, B / A "
                     f"{_ratio_text(c['tau_ratio'], flip)}; speed-up {_speedup(sa)} vs {_speedup(sb)}, tokens/s B / A "
                     f"{_ratio_text(c['speed_ratio'], flip)}")
    return lines


def _ratio_text(ci: dict, invert: bool) -> str:
    """'0.87 [0.81, 0.92]'; invert: of 1 / the ratio (a bootstrap percentile interval maps through 1/x exactly)."""
    value, low, high = ci["value"], ci["ci_low"], ci["ci_high"]
    if invert:
        value, low, high = 1 / value, 1 / high, 1 / low
    return f"{value:.2f} [{low:.2f}, {high:.2f}]"


def _speedup(summary: dict) -> str:
    speed = (summary.get("speedup") or {}).get("value")
    return "–" if speed is None else f"{speed:.2f}x"


def headline_line(eval_dir: Path) -> str | None:
    """The report's headline sentence (fastest method, tau, speedup with CI, mismatches), or None."""
    h = read_eval_report(eval_dir).get("headline")
    return None if h is None else headline_text(h)


@one_line_errors
def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    bad = [o for o in [*args.overrides, *args.eagle3_override] if "=" not in o]
    if bad:
        raise SystemExit(f"expected key=value overrides, got {bad}")
    if args.jobs < 1:
        raise SystemExit(f"--jobs {args.jobs}: expected at least 1 (stages run side by side)")
    started = time.time()
    env = dict(os.environ)
    env.setdefault("WANDB_MODE", "disabled")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if debug_enabled():  # --debug: every stage shows the traceback of its error too
        env[DEBUG_ENV] = "1"
    # One intra-op thread in every stage, the default target's training included: the tiny recipe's models are
    # per-op-overhead bound, so a second OpenMP thread gains at most ~1.9x on an idle 2-core machine, and when
    # another job holds a core the two threads wait on each other at every op (measured: target training
    # 0.33 s/step with 2 threads idle, 5.5 s/step with 2 threads beside other jobs, 0.8 s/step with 1).
    # Set OMP_NUM_THREADS to override.
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("MKL_NUM_THREADS", env["OMP_NUM_THREADS"])
    cache = default_cache_dir()
    # libraries that cache under ~ or /tmp write into the documented cache folder instead
    env.setdefault("MPLCONFIGDIR", str(cache / "matplotlib"))
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", str(cache / "torchinductor"))
    env.setdefault("TRITON_CACHE_DIR", str(cache / "triton"))
    for key in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "MPLCONFIGDIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        os.environ[key] = env[key]  # this process too (it builds the default target)
    torch.set_num_threads(int(env["OMP_NUM_THREADS"]))

    user = list(args.overrides)
    if args.out is not None:
        user.append(f"output_dir={args.out}")
    heads = heads_of(args.head_kind)
    cfg = load_config(args.recipe, user)  # fails fast on unknown keys, before the target is built
    for kind in heads:  # so do the EAGLE-3 recipe and a recipe of the wrong kind
        check_head_kind(kind, *head_recipe(args, kind, user))
    out_dir = Path(cfg.output_dir).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(out_dir / ".quickstart.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise SystemExit(f"another `python -m quickstart` is running on {out_dir}; wait for it or use --out") from None
    err = sys.stderr
    try:
        # the default target is built in this process: what libraries print on stderr (transformers' shard-writing
        # bar, warnings) is progress too; only the failure line below goes to the real stderr
        with contextlib.redirect_stderr(sys.stdout):
            return run_pipeline(args, user, out_dir, env, started, err)
    finally:
        lock.release()


def heads_of(head_kind: str) -> list[HeadKind]:
    return list(CHAINS) if head_kind == "both" else [HEAD_KINDS[head_kind]]


def head_recipe(args, kind: HeadKind, overrides: list[str]) -> tuple[str, list[str], str]:
    """(recipe, its overrides, the option naming it) of one head's chain: --recipe, or --recipe-eagle3 with the
    --eagle3-override keys after the shared ones."""
    chain = CHAINS[kind]
    own = getattr(args, chain.override_dest) if chain.override_dest else []
    return getattr(args, chain.recipe_dest), [*overrides, *own], chain.recipe_option


def check_head_kind(kind: HeadKind, recipe: str, overrides: list[str], option: str):
    """The chain's recipe, loaded (unknown keys fail here); it must train the kind of head its chain names."""
    cfg = load_config(recipe, overrides)
    if HEAD_KINDS.get(cfg.head.kind) is not kind:
        other = CHAINS[HEAD_KINDS[cfg.head.kind]].recipe_option  # load_config accepts only the kinds of HEAD_KINDS
        raise RecipeError(f"{option} {recipe} trains a head.kind={cfg.head.kind} head, but the {kind.title} head's "
                          f"recipe must have head.kind={kind.name}; pass it as {other} (and --head-kind "
                          f"{cfg.head.kind} to train it alone)")
    return cfg


def run_pipeline(args, user: list[str], out_dir: Path, env: dict, started: float, err) -> int:
    if args.fresh:
        say(f"--fresh: removing the previous run's stage outputs in {out_dir}")
        remove_outputs(out_dir, STAGES)
        (out_dir / STATE_FILE).unlink(missing_ok=True)
        shutil.rmtree(out_dir / SUPERSEDED_DIR, ignore_errors=True)
    stages = plan(args.head_kind)
    t0, c0 = time.time(), cpu_seconds()
    say(f"1/{len(stages) + 1} target: " + (args.target or "the embedded default target (built once, then cached)"))
    target, inputs, identity = resolve_inputs(args.target, out_dir, args.target_size)
    say(f"target ready in {time.time() - t0:.0f}s: {target}")
    given = {o.split("=", 1)[0] for o in user}
    shared = [f"target.path={target}"]
    shared += [f"{k}={v}" for k, v in inputs.items() if k not in given]  # the user's choice wins
    shared += [o for o in user if not o.startswith("output_dir=")]
    chains = {}  # head kind -> (recipe, overrides, cfg) of its chain of stages
    for kind in heads_of(args.head_kind):
        recipe, overrides, option = head_recipe(args, kind, shared)
        chain_dir = out_dir / CHAINS[kind].subdir
        overrides = [f"output_dir={chain_dir}", *overrides]
        cfg = check_head_kind(kind, recipe, overrides, option)
        try:  # a head that does not fit the target (EAGLE-3's aux layers) fails now, not after the other chain
            check_head_fits_target(cfg.head, load_target_config(resolve_target_path(cfg.target), cfg.target.revision))
        except RecipeError as e:
            raise RecipeError(f"{e}; {CHAINS[kind].fit_hint}" if CHAINS[kind].fit_hint else str(e)) from None
        chains[kind] = (recipe, overrides, cfg)

    state, held = read_state(out_dir), read_state(out_dir / SUPERSEDED_DIR)
    superseding: set[str] = set()  # stages whose outputs move aside when they start (their settings changed)
    fingerprints: dict[str, str] = {}
    timings = {"target": round(time.time() - t0, 1)}
    cpu = {"target": round(cpu_seconds() - c0, 1)}
    todo: list[tuple[int, Stage]] = []  # (step number, stage) to run, in plan order
    for i, stage in enumerate(stages):
        recipe, overrides, cfg = stage_run(stage, chains, out_dir)
        fp = stage_fingerprint(cfg, stage, "+".join(fingerprints[s] for s in stage.after), identity)
        fingerprints[stage.name] = fp
        rec = state.get(stage.name, {})
        header = f"{i + 2}/{len(stages) + 1} {stage.title}"
        if rec.get("fingerprint") != fp and held.get(stage.name, {}).get("fingerprint") == fp:
            put_back(out_dir, stage, state, held)  # a rerun with the settings of the outputs set aside (a typo fixed)
            rec = state[stage.name]
            say(f"{header}: putting back its outputs with these settings from {out_dir / SUPERSEDED_DIR}")
        if rec.get("fingerprint") == fp and rec.get("done"):
            say(f"{header}: already done ({rec.get('seconds', '?')}s), reusing")
            continue
        if rec and rec.get("fingerprint") != fp:
            say(f"{header}: settings changed since the last run; redoing it and the stages that read its output (the "
                f"previous outputs move to {out_dir / SUPERSEDED_DIR} when it starts, until this run finishes)")
            superseding.add(stage.name)
        elif rec:
            say(f"{header}: resuming an interrupted run")
        todo.append((i, stage))
    write_state(out_dir, state)

    lock = threading.Lock()  # state, timings and the progress lines of stages running side by side

    def one(i: int, stage: Stage) -> None:
        recipe, overrides, cfg = stage_run(stage, chains, out_dir)
        with lock:
            beside = sorted(running - {stage.name})
            if beside:  # the other stage's progress bar may be mid-line (redrawn with carriage returns)
                print(file=sys.stdout, flush=True)
            say(f"{i + 2}/{len(stages) + 1} {stage.title}" + (f" (beside {', '.join(beside)})" if beside else ""))
            if stage.name in superseding:
                supersede(out_dir, stage, state, held)
            state[stage.name] = {"fingerprint": fingerprints[stage.name], "done": False}
            write_state(out_dir, state)
        t = time.time()
        if stage.name == "eagle3-data" and "data" in stage.after:
            reuse_answers(chains[EAGLE2][2], cfg)
        used = run_stage(stage, recipe, overrides, env)
        with lock:
            timings[stage.name] = round(time.time() - t, 1)
            cpu[stage.name] = round(used or 0.0, 1)
            state[stage.name] = {"fingerprint": fingerprints[stage.name], "done": True, "seconds": timings[stage.name]}
            write_state(out_dir, state)

    running: set[str] = set()
    failed = run_parallel(todo, one, running, lock, jobs=args.jobs)
    if failed is not None:
        stage, e = failed
        cfg = stage_run(stage, chains, out_dir)[2]
        eval_report = layout.eval_dir(cfg) / "report.json"
        if stage.name == "eval" and e.code == 1 and eval_report.exists():  # the report lists the mismatches
            for line in summarize_report(eval_report.parent):
                say("  " + line)
            fail(f"evaluation found outputs that differ from vanilla: see {eval_report.parent / 'report.md'}", err)
        elif e.code == 2:  # the stage's own one-line error names what to fix
            fail(f"stage {stage.name}: {e.detail or 'failed (exit code 2)'}; fix it and rerun the same command "
                 "(finished stages are reused)", err)
        else:  # a crash: its traceback is in the output above
            fail(f"{e} (its traceback is above, on stdout); rerun the same command to resume", err)
        return e.code
    drop_superseded(out_dir, stages, held)

    eval_dir = out_dir / layout.EVAL_DIR
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    say(f"done in {time.time() - started:.0f}s wall, {sum(cpu.values()):.0f}s CPU (this run, seconds wall/CPU per stage: "
        + ", ".join(f"{k} {timings[k]}/{cpu[k]}" for k in timings) + f"; load average now {load})")
    for line in summarize_report(eval_dir):
        say("  " + line)
    for line in head_pair_lines(eval_dir):
        say("  " + line)
    for png in sorted(eval_dir.glob("calibration_*.png")):
        say(f"calibration plot: {png}")
    say(f"report: {eval_dir / 'report.md'}")
    best = headline_line(eval_dir)
    if best is not None:
        say(best)
    return 0


def run_parallel(todo: list[tuple[int, Stage]], one, running: set[str], lock, jobs: int
                 ) -> tuple[Stage, StageFailed] | None:
    """Run `one(step, stage)` for every stage of `todo`, up to `jobs` at a time, each as soon as the stages it reads
    from (`after`) are done (finished before or in this run), in plan order among the ready ones. After a failure no
    further stage starts; those running finish (their work is kept for the rerun). Returns the first failure, or
    None."""
    pending = list(todo)
    names = {s.name for _, s in todo}
    finished: set[str] = set()
    failed: tuple[Stage, StageFailed] | None = None
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        active: dict = {}  # future -> stage
        while pending or active:
            while failed is None and len(active) < max(1, jobs):
                ready = next(((i, s) for i, s in pending if all(a in finished or a not in names for a in s.after)),
                             None)
                if ready is None:
                    break
                pending.remove(ready)
                with lock:
                    running.add(ready[1].name)
                active[pool.submit(one, *ready)] = ready[1]
            if not active:
                break
            done, _ = wait(active, return_when=FIRST_COMPLETED)
            for future in done:
                stage = active.pop(future)
                with lock:
                    running.discard(stage.name)
                try:
                    future.result()
                except StageFailed as e:
                    failed = failed or (stage, e)
                else:
                    finished.add(stage.name)
    return failed


def stage_run(stage: Stage, chains: dict, out_dir: Path) -> tuple[str, list[str], object]:
    """(recipe, overrides, resolved config) one stage runs with: its head's chain; the evaluation with both heads also
    gets head B (eval.compare_head) and head B's methods, and its report always goes to {out}/eval."""
    recipe, overrides, cfg = chains[stage.head]
    if stage.name != EVAL_STAGE.name:
        return recipe, overrides, cfg
    extra = [f"eval.output_dir={out_dir / layout.EVAL_DIR}"] if CHAINS[stage.head].subdir else []
    head_b = next((kind for kind in chains if kind is not stage.head), None)  # --head-kind both: the other chain's
    if head_b is not None:
        methods = list(cfg.eval.methods)
        methods += [m for m in HEAD_B_METHODS if m not in methods]
        extra = [f"eval.compare_head={layout.head_dir(chains[head_b][2])}", f"eval.methods={json.dumps(methods)}"]
    overrides = [*overrides, *extra]
    return recipe, overrides, load_config(recipe, overrides)


def reuse_answers(source_cfg, cfg) -> None:
    """Seed the EAGLE-3 data prep with the EAGLE-2 run's regenerated answers (copied: its regenerate step then finds
    every record done) when both recipes regenerate the same way (same seed, target and data sections); otherwise
    the EAGLE-3 data prep regenerates its own."""
    same = all(OmegaConf.to_container(source_cfg[k], resolve=True) == OmegaConf.to_container(cfg[k], resolve=True)
               for k in ("target", "data")) and source_cfg.seed == cfg.seed
    src, dst = layout.regenerated_dir(source_cfg), layout.regenerated_dir(cfg)
    if not same:
        say(f"the {EAGLE3.title} recipe's data or target settings differ from the {EAGLE2.title} recipe's: its data "
            "prep regenerates its own answers")
        return
    if dst.exists() or not src.exists():
        return
    tmp = dst.with_name(f"{dst.name}.partial")  # one quickstart per run folder (its lock): a fixed name is safe
    shutil.rmtree(tmp, ignore_errors=True)  # what an interrupted copy left
    shutil.copytree(src, tmp)
    os.replace(tmp, dst)  # whole or not at all: an interrupted copy is redone, never resumed half-copied
    say(f"reusing the {EAGLE2.title} run's regenerated answers: {src} -> {dst}")
