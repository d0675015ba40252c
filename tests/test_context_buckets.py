"""evaluation/context_buckets.py: tau and alpha_d per prompt-length bucket (eval.context_buckets) with paired CIs,
paired differences between heads per bucket, the report's section and its tau_by_context.png."""
from __future__ import annotations

import json

import pytest
import torch

from eagle.stats import GenerationStats, RoundStats
from evaluation.context_buckets import bucket_labels, bucket_of, by_context
from evaluation.metrics import summarize
from evaluation.report import EvalReport, markdown, write_report
from evaluation.runner import BenchmarkRun, TurnResult

EDGES = [1024, 4096, 16384]


def chain_round(accept: int, depth: int = 4) -> RoundStats:
    d = torch.arange(1, depth + 1)
    p = torch.full((depth,), 0.5)
    return RoundStats(accept_length=accept, new_tokens=accept + 1, node_depth=d, node_prob=p,
                      node_path_prob=p.cumprod(0), node_accepted=d <= accept)


def turn(qid: str, method: str, prompt_tokens: int, accepts: list[int]) -> TurnResult:
    rounds = [chain_round(a) for a in accepts]
    n = sum(a + 1 for a in accepts)
    stats = GenerationStats(prompt_tokens=prompt_tokens, new_tokens=n, rounds=rounds)
    return TurnResult(qid, "long", 0, method, [1] * prompt_tokens, list(range(n)), 1.0, stats)


def test_bucket_labels_and_placement():
    assert bucket_labels(EDGES) == ["<1k", "1k-4k", "4k-16k", "16k+"]
    assert bucket_labels([]) == ["all"] and bucket_labels([500, 1536]) == ["<500", "500-1.5k", "1.5k+"]
    assert [bucket_of(n, EDGES) for n in (0, 1023, 1024, 4095, 16384, 10**6)] == [
        "<1k", "<1k", "1k-4k", "1k-4k", "16k+", "16k+"]


@pytest.fixture
def results():
    """Head `full` accepts 3 per round on short prompts and 0 on long ones; `window` accepts 2 everywhere."""
    out = []
    for i in range(6):
        short, long = 200 + 10 * i, 5000 + 10 * i
        out += [turn(f"s{i}", "full", short, [3, 3, 3]), turn(f"s{i}", "window", short, [2, 2, 2]),
                turn(f"l{i}", "full", long, [0, 0, 1 if i == 0 else 0]), turn(f"l{i}", "window", long, [2, 2, 2])]
    return out


def test_tau_and_depth_acceptance_per_bucket_and_paired_differences(results):
    ctx = by_context(results, EDGES, ["full", "window"], n_resamples=200)
    by = {(s.method, s.category): s for s in ctx.summaries}
    assert set(ctx.turns) == {"<1k", "4k-16k"} and ctx.turns["<1k"] == 12
    assert by[("full", "<1k")].tau.value == pytest.approx(4.0) and by[("window", "4k-16k")].tau.value == pytest.approx(3.0)
    assert by[("full", "4k-16k")].tau.value == pytest.approx(19 / 18)
    assert [a.rate for a in by[("full", "<1k")].depth_acceptance][:3] == [1.0, 1.0, 1.0]
    assert by[("window", "4k-16k")].depth_acceptance[2].rate == 0.0
    # the same statistic as the per-category one, restricted to the bucket's turns
    same = summarize([r for r in results if len(r.prompt_ids) < 1024], n_resamples=200)
    assert {s.method: s.tau.value for s in same if s.category == "overall"} == {
        m: by[(m, "<1k")].tau.value for m in ("full", "window")}
    diff = {c.category: c for c in ctx.comparisons}
    assert diff["<1k"].tau_difference.value == pytest.approx(1.0)
    long = diff["4k-16k"].tau_difference
    assert long.value == pytest.approx(19 / 18 - 3) and long.high < 0  # the window wins on long prompts, CI says so


def test_report_section_json_and_plot(results, tmp_path):
    ctx = by_context(results, EDGES, ["full", "window"], n_resamples=200)
    summaries = summarize(results, n_resamples=200)
    report = EvalReport(meta={"methods": {}}, run=BenchmarkRun(results), summaries=summaries, comparisons=[],
                        greedy=None, context=ctx)
    md = markdown(report, {})
    assert "## By context length" in md and "| 4k-16k | window |" in md and "| 4k-16k | full | window |" in md
    paths = write_report(report, tmp_path)
    assert paths["tau by context"].name == "tau_by_context.png" and paths["tau by context"].stat().st_size > 1000
    saved = json.loads((tmp_path / "report.json").read_text())["context"]
    assert saved["edges"] == EDGES and saved["labels"][-1] == "16k+" and len(saved["comparisons"]) == 2


def test_the_recipe_key_is_checked():
    from recipes import RecipeError, load_config

    assert list(load_config("tiny", []).eval.context_buckets) == EDGES
    with pytest.raises(RecipeError, match="eval.context_buckets"):
        load_config("tiny", ["eval.context_buckets=[4096,1024]"])


def test_the_long_context_question_set_is_shipped_and_regenerates_unchanged():
    from benchmarks.long_context_questions import OUT, questions
    from evaluation.questions import QUESTION_SETS, load_questions

    assert QUESTION_SETS["long-context"] == OUT
    assert OUT.read_text() == "".join(json.dumps(q) + "\n" for q in questions())  # the shipped file is the script's
    qs = load_questions("long-context")
    words = sorted(len(q.turns[0].split()) for q in qs)
    assert len(qs) == 12 and words[0] >= 700 and words[-1] >= 18000
