"""Run every method on every prompt in ONE pass, interleaved per prompt, after a warm-up.

For each question and each of its turns, every method generates once (the method order rotates
from question to question so that no method is always first after a cache-cold switch). Each
method keeps its own conversation: turn k+1 is built from THAT method's own turn-k answer.
Tokens are counted identically for every method: generated ids = output minus prompt; wall time
is measured around the generate call.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from evaluation.chat_format import ChatFormat
from evaluation.methods import Method
from evaluation.questions import Question

log = logging.getLogger(__name__)


@dataclass
class GenerationArgs:
    """What every method is asked to do (identical for all methods of a run)."""

    max_new_tokens: int = 256
    max_length: int = 2048
    temperature: float = 0.0
    top_p: float = 0.0
    top_k: int = 0
    eos_token_id: int | list[int] | None = None


@dataclass
class TurnResult:
    """One generate call: one method on one turn of one question."""

    question_id: str
    category: str
    turn: int
    method: str
    prompt_ids: list[int]
    output_ids: list[int]  # generated tokens only (prompt excluded)
    wall_s: float
    stats: object | None = None  # eagle.stats.GenerationStats

    @property
    def new_tokens(self) -> int:
        return len(self.output_ids)


@dataclass
class BenchmarkRun:
    results: list[TurnResult] = field(default_factory=list)
    skipped: list[dict] = field(default_factory=list)  # {"question_id", "turn", "method", "reason"}


def generate(model, method: Method, prompt_ids: list[int], gen: GenerationArgs,
             generator: torch.Generator | None = None) -> tuple[list[int], object, float]:
    """Generate with `method`; returns (new token ids, GenerationStats, wall seconds)."""
    device = _model_device(model)
    input_ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)  # [1, T]
    kwargs = dict(temperature=gen.temperature, top_p=gen.top_p, top_k=gen.top_k, max_new_tokens=gen.max_new_tokens,
                  max_length=gen.max_length, eos_token_id=gen.eos_token_id, generator=generator, return_stats=True)
    start = time.perf_counter()
    with torch.inference_mode():
        if method.is_vanilla:
            out, stats = model.naivegenerate(input_ids, **kwargs)
        else:
            out, stats = model.eagenerate(input_ids, decoding=method.decoding, **kwargs)
    wall = time.perf_counter() - start
    if out.shape[0] != 1 or out.shape[1] < len(prompt_ids) or out[0, : len(prompt_ids)].tolist() != prompt_ids:
        raise RuntimeError(f"method {method.label}: the returned ids do not start with the prompt (shape {tuple(out.shape)})")
    return out[0, len(prompt_ids):].tolist(), stats, wall


def _model_device(model) -> torch.device:
    base = getattr(model, "base_model", None)
    params = base.parameters() if base is not None else model.parameters()
    return next(iter(params)).device


def run_benchmark(models: dict[str, object], fmt: ChatFormat, questions: list[Question], methods: list[Method],
                  gen: GenerationArgs, *, warmup: int = 1, seed: int = 0, progress: bool = True) -> BenchmarkRun:
    """Every method on every turn of every question, interleaved; `models` maps a head name
    ("A", "B") to an EaModel (all sharing one target)."""
    run = BenchmarkRun()
    warm_up(models, fmt, questions[0], methods, gen, warmup)
    history: dict[str, list[tuple[str, str]]] = {}
    prev: dict[str, tuple[list[int], list[int]]] = {}
    bar = tqdm(total=sum(len(q.turns) for q in questions) * len(methods), disable=not progress, desc="eval")
    for qi, q in enumerate(questions):
        order = methods[qi % len(methods):] + methods[: qi % len(methods)]
        history = {m.label: [] for m in methods}
        prev = {m.label: ([], []) for m in methods}
        alive = {m.label for m in methods}
        for ti, turn in enumerate(q.turns):
            for m in order:
                bar.update(1)
                if m.label not in alive:
                    continue
                prompt = fmt.next_prompt(*prev[m.label], history[m.label], turn, q.tools or None)
                if len(prompt) + gen.max_new_tokens > gen.max_length:
                    reason = (f"prompt of {len(prompt)} tokens + max_new_tokens {gen.max_new_tokens} "
                              f"> max_length {gen.max_length}")
                    log.warning("skipping question %s turn %d (%s) and its later turns: %s", q.question_id, ti, m.label, reason)
                    run.skipped.append({"question_id": q.question_id, "turn": ti, "method": m.label, "reason": reason})
                    alive.discard(m.label)
                    continue
                generator = None
                if gen.temperature > 0:
                    generator = torch.Generator(device=_model_device(models[m.head])).manual_seed(
                        seed * 1_000_003 + qi * 1009 + ti * 101 + methods.index(m))
                out, stats, wall = generate(models[m.head], m, prompt, gen, generator)
                run.results.append(TurnResult(q.question_id, q.category, ti, m.label, prompt, out, wall, stats))
                history[m.label].append((turn, fmt.decode(out)))
                prev[m.label] = (prompt, out)
    bar.close()
    return run


def warm_up(models: dict[str, object], fmt: ChatFormat, question: Question, methods: list[Method],
            gen: GenerationArgs, times: int) -> None:
    """Run every method `times` times on the first prompt (untimed): kernels, allocator and caches warm up."""
    short = GenerationArgs(**{**gen.__dict__, "max_new_tokens": min(gen.max_new_tokens, 32)})
    prompt = fmt.first_prompt(question.turns[0])[: max(1, gen.max_length - short.max_new_tokens)]
    for _ in range(times):
        for m in methods:
            generator = torch.Generator(device=_model_device(models[m.head])).manual_seed(0) if gen.temperature > 0 else None
            generate(models[m.head], m, prompt, short, generator)
