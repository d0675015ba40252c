"""evaluation/spans.py on hand-built runs: each round counts for the span of its first committed token, tau and
alpha_1 per (category, span), the paired per-span difference of two heads, the report's section; and the shipped
reasoning / tool-call question set with its tools reaching the chat template."""
from __future__ import annotations

import pytest
import torch

from data_prep.assistant_spans import label_tokens
from data_prep.tool_calls import FORMATS
from eagle.stats import GenerationStats, RoundStats
from evaluation.chat_format import ChatFormat
from evaluation.metrics import OVERALL
from evaluation.questions import load_questions
from evaluation.report import EvalReport, markdown
from evaluation.runner import BenchmarkRun, TurnResult
from evaluation.spans import compare_spans, round_spans, summarize_spans
from test_data_prep_helpers import build_reasoning_tokenizer, build_tokenizer


def rnd(accept: int, new_tokens: int | None = None) -> RoundStats:
    depth = torch.arange(1, 6)
    prob = torch.full((5,), 0.5)
    return RoundStats(accept, accept + 1 if new_tokens is None else new_tokens, depth, prob, prob, depth <= accept)


def turn(qid, cat, method, labels, rounds) -> TurnResult:
    """A turn whose generated ids are 0..n-1, labelled by `labels` (the labeler looks them up)."""
    n = len(labels)
    stats = GenerationStats(prompt_tokens=2, new_tokens=n, rounds=rounds)
    return TurnResult(qid, cat, 0, method, [7, 7], list(range(n)), 1.0, stats)


R, A, T = "reasoning", "answer", "tool_call"


def labeler_for(labels_by_len):
    return lambda ids: labels_by_len[len(ids)]


def test_rounds_count_for_the_span_of_their_first_token():
    # prefill commits token 0; rounds commit 1-3 (starts in reasoning), 4-5 (reasoning), 6-9 (answer), 10 (answer)
    labels = [R] * 6 + [A] * 5
    r = turn("q", "c", "h", labels, [rnd(2), rnd(1), rnd(3), rnd(0)])
    assert round_spans(r, labels) == [(R, 3, 2), (R, 2, 1), (A, 4, 3), (A, 1, 0)]
    by = {(s.category, s.span): s for s in summarize_spans([r], lambda ids: labels, n_resamples=100)}
    assert by[("c", R)].tau.value == pytest.approx(5 / 2) and by[("c", R)].alpha_1 == 1.0
    assert by[("c", A)].tau.value == pytest.approx(5 / 2) and by[("c", A)].alpha_1 == 0.5
    assert by[(OVERALL, A)].rounds == 2 and by[(OVERALL, R)].committed == 5


def test_paired_span_difference_of_two_heads():
    la, lb = [R] * 5 + [A] * 4, [R] * 5 + [A] * 4
    results = []
    for q in ("q1", "q2", "q3"):
        results.append(turn(q, "c", "a", la, [rnd(1), rnd(1), rnd(1), rnd(1)]))  # reasoning 2 rounds tau 2, answer 2
        results.append(turn(q, "c", "b", lb, [rnd(3), rnd(0), rnd(2)]))  # reasoning: 1 round tau 4; answer: 2 rounds tau 2
    cmp = {(c.category, c.span): c for c in compare_spans(results, "a", "b", lambda ids: la, n_resamples=200)}
    assert cmp[("c", R)].tau_difference.value == pytest.approx(4 - 2)
    assert cmp[("c", A)].tau_difference.value == pytest.approx((1 + 3) / 2 - 2)
    assert cmp[(OVERALL, R)].questions == 3


def test_report_shows_the_span_section_only_when_a_reasoning_or_call_span_exists():
    labels = [R] * 4 + [A] * 4
    results = [turn(q, "c", "h", labels, [rnd(2), rnd(3)]) for q in ("q1", "q2")]
    report = EvalReport(meta={}, run=BenchmarkRun(results), summaries=[], comparisons=[], greedy=None,
                        spans=summarize_spans(results, lambda ids: labels, n_resamples=100))
    text = markdown(report, {})
    assert "## tau by span of the answer" in text and "| c | reasoning |" in text and "| overall | answer |" in text
    answers_only = [turn("q1", "c", "h", [A] * 8, [rnd(2), rnd(3)])]
    report.spans = summarize_spans(answers_only, lambda ids: [A] * 8, n_resamples=100)
    assert "tau by span" not in markdown(report, {})


def test_generated_ids_are_labelled_by_the_templates_markup():
    tok = build_reasoning_tokenizer("qwen3")
    text = '<think>\nplan\n</think>\n\nOK <tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><|im_end|>'
    ids = tok(text, add_special_tokens=False)["input_ids"]
    labels = label_tokens(tok, ids, [1] * len(ids), FORMATS["hermes"])
    assert labels[0] == R and labels[-1] == A and T in labels
    assert tok.decode([i for i, lab in zip(ids, labels) if lab == T]) == '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'


def test_reasoning_tools_question_set_reaches_the_template_with_its_tools():
    qs = load_questions("reasoning-tools")
    cats = {q.category for q in qs}
    assert cats == {"reasoning", "tool_call"} and len(qs) == 16
    assert all(q.tools for q in qs if q.category == "tool_call") and not any(q.tools for q in qs if q.category == "reasoning")
    tok = build_reasoning_tokenizer("qwen3")
    fmt = ChatFormat(tok)
    q = next(q for q in qs if q.category == "tool_call")
    text = tok.decode(fmt.first_prompt(q.turns[0], q.tools))
    assert "<tools>" in text and q.tools[0]["function"]["name"] in text and text.endswith("<|im_start|>assistant\n")
    with pytest.raises(ValueError, match="needs a chat template"):  # raw text cannot show tools: said, not dropped
        ChatFormat(build_tokenizer(None)).first_prompt(q.turns[0], q.tools)
