"""The decisions serve-check and serve-sweep make from engine numbers, without an engine: vLLM method vs folder
kind (the trap), the T > 0 agreement statistics, the sweep's result parsing, best-k choice, report and plot, and
the CPU expand fix the engine script installs. The same against real vLLM: tests/test_vllm_engine.py (slow)."""
from __future__ import annotations

import json
import math
import random

import pytest
import torch

from eagle.cli_errors import is_expected
from evaluation.serve_check_sampling import acceptance, compare, per_prompt_counts
from evaluation.serve_sweep import (best_k, markdown, parse_int_list, plot, prompts_per_level, read_bench_result,
                                    recommendation_lines, sharegpt_dataset)
from eagle.head_kinds import HEAD_KINDS
from engine.vllm_side.generate import fixed_expand
from export.engine_formats import EngineFormatError
from export.head_kinds import check_vllm_method, served_kind
from export.hub import push_to_hub
from recipes import load_config
from statistical_rule import assert_same_law, binomial_pvalue
from test_engine_formats import perturbed_head

RELEASED_EAGLE3 = {"architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 32000}
SPECULATORS_EAGLE3 = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3"}
EAGLE2 = {"architectures": ["LlamaForCausalLM"], "bias": False}


def test_served_kind_and_the_method_trap():
    assert [served_kind(c) for c in (RELEASED_EAGLE3, SPECULATORS_EAGLE3, EAGLE2)] == [
        HEAD_KINDS["eagle3"], HEAD_KINDS["eagle3"], HEAD_KINDS["eagle2"]]
    check_vllm_method("eagle3", SPECULATORS_EAGLE3, "H")
    check_vllm_method("eagle", EAGLE2, "H")
    with pytest.raises(EngineFormatError, match=r"H holds an EAGLE-3 head .*speculators_model_type eagle3.* method "
                                                r"'eagle', which is for EAGLE-2 heads: use \"method\": \"eagle3\"") as e:
        check_vllm_method("eagle", SPECULATORS_EAGLE3, "H")
    assert is_expected(e.value)  # one line at the CLI, exit 2
    with pytest.raises(EngineFormatError, match=r"holds an EAGLE-2 head .* method 'eagle3'.*use \"method\": \"eagle\""):
        check_vllm_method("eagle3", EAGLE2, "H")


SPECULATORS_PEAGLE = {"architectures": ["PeagleSpeculator"], "speculators_model_type": "peagle", "mask_token_id": 3}
RELEASED_PEAGLE = {"architectures": ["PeagleLlamaForCausalLM"], "draft_vocab_size": 64, "mask_token_id": 3}


def test_the_parallel_drafting_traps():
    """A P-EAGLE folder must be served with parallel_drafting, a sequential head without it: each mismatch is one line
    naming the right speculative config, before any engine time."""
    assert served_kind(SPECULATORS_PEAGLE) is HEAD_KINDS["peagle"] is served_kind(RELEASED_PEAGLE)
    check_vllm_method("eagle3", SPECULATORS_PEAGLE, "H", parallel_drafting=True)
    with pytest.raises(EngineFormatError, match=r"H holds a P-EAGLE head .*speculators_model_type peagle.* method "
                                                r"'eagle3', which is for EAGLE-3 heads: use \"method\": \"eagle3\", "
                                                r"\"parallel_drafting\": true") as e:
        check_vllm_method("eagle3", RELEASED_PEAGLE | {"speculators_model_type": "peagle"}, "H")
    assert is_expected(e.value) and "\n" not in str(e.value)
    with pytest.raises(EngineFormatError, match=r"holds a P-EAGLE head .*method 'eagle3', which is for EAGLE-3"):
        check_vllm_method("eagle3", RELEASED_PEAGLE, "H")
    with pytest.raises(EngineFormatError, match=r"holds an EAGLE-3 head .*method 'eagle3' with parallel_drafting, "
                                                r"which is for P-EAGLE heads: use \"method\": \"eagle3\"$"):
        check_vllm_method("eagle3", SPECULATORS_EAGLE3, "H", parallel_drafting=True)
    with pytest.raises(EngineFormatError, match=r"EAGLE-2 head .*'eagle' with parallel_drafting, which no head kind"):
        check_vllm_method("eagle", EAGLE2, "H", parallel_drafting=True)


def test_per_position_acceptance_and_its_cluster_se():
    k = 3
    prompts = [per_prompt_counts([0, 3, 1, 2], k), per_prompt_counts([3, 3], k), per_prompt_counts([], k)]
    assert prompts[0] == {"num_drafts": 4, "accepted_per_pos": [3, 2, 1]}
    a = acceptance(prompts, k)
    assert a["num_drafts"] == 6 and a["per_position"] == pytest.approx([5 / 6, 4 / 6, 3 / 6])
    assert a["mean_length"] == pytest.approx(1 + 12 / 6)
    # the cluster-robust se by hand for position 1 (n = 2 prompts with rounds): A = [3, 2], D = [4, 2], a = 5/6
    resid = (3 - 5 / 6 * 4) ** 2 + (2 - 5 / 6 * 2) ** 2
    assert a["se"][0] == pytest.approx(math.sqrt(2 / 1 * resid) / 6)
    assert a["se_binomial"][0] == pytest.approx(math.sqrt(5 / 6 * 1 / 6 / 6))


def simulate(rates, prompts, rounds, seed):
    """Per-prompt counts of chains whose position i is accepted with conditional probability rates[i]."""
    rng = random.Random(seed)
    out = []
    for _ in range(prompts):
        lengths = []
        for _ in range(rounds):
            a = 0
            while a < len(rates) and rng.random() < rates[a]:
                a += 1
            lengths.append(a)
        out.append(per_prompt_counts(lengths, len(rates)))
    return out


AGREEMENT_REPEATS = 1500  # power: tests/test_statistical_power.py


# compare's z uses the normal approximation of a cluster-robust se over 40 prompts: measured over 3000 repeats of
# equal rules, 39 disagree (1.3% at alpha = 0.01); the test holds it to twice its alpha
FALSE_ALARM_SLACK = 2.0


def agreement_run(rates_a, rates_b, k=4, alpha=0.01, compare=compare):
    """`run(repeats, seed)` for tests/statistical_rule.py: `compare` of two simulated acceptance runs, `repeats`
    times; p-value of the disagreements under compare's promise (a false-alarm rate <= FALSE_ALARM_SLACK * alpha),
    one-sided exact binomial test."""
    def run(repeats, seed):
        agree = [compare(acceptance(simulate(rates_a, 40, 30, seed + s), k),
                         acceptance(simulate(rates_b, 40, 30, seed + s + 100_000), k), k, alpha)["agrees"]
                 for s in range(repeats)]
        wrong = repeats - sum(agree)
        return (binomial_pvalue(wrong, repeats, FALSE_ALARM_SLACK * alpha, alternative="greater"),
                f"{wrong} of {repeats} disagree")
    return run


@pytest.mark.statistical
def test_agreement_holds_for_equal_rules_and_fails_for_a_real_gap():
    k = 4
    # equal rules agree: compare's false-alarm rate is (about) its alpha = 0.01
    assert_same_law(agreement_run([0.8, 0.7, 0.6, 0.5], [0.8, 0.7, 0.6, 0.5], k), draws=AGREEMENT_REPEATS, seed=0,
                    what="compare of two runs of one rule")
    gap = compare(acceptance(simulate([0.8, 0.7, 0.6, 0.5], 40, 30, 1), k),
                  acceptance(simulate([0.6, 0.7, 0.6, 0.5], 40, 30, 2), k), k, 0.01)
    assert not gap["agrees"] and not gap["positions"][0]["agrees"]
    assert gap["z"] == pytest.approx(3.023, abs=1e-3)  # normal quantile at 1 - 0.01 / 8


def bench_json(path, k, c, tps, lat):
    r = {"completed": 8, "failed": 0, "duration": 1.0, "total_output_tokens": 256, "output_throughput": tps,
         "median_e2el_ms": lat, "p90_e2el_ms": 1.5 * lat, "median_ttft_ms": 5.0, "median_tpot_ms": 2.0}
    if k:
        r.update(spec_decode_acceptance_length=1 + 0.5 * k, spec_decode_per_position_acceptance_rates=[0.5] * k,
                 spec_decode_num_drafts=40)
    path.write_text(json.dumps(r))
    return read_bench_result(path, k, c)


def test_sweep_picks_the_fastest_k_per_level_and_says_when_speculation_loses(tmp_path):
    tps = {(0, 1): 100, (2, 1): 150, (4, 1): 140, (0, 16): 900, (2, 16): 700, (4, 16): 500}
    points = [bench_json(tmp_path / f"{k}_{c}.json", k, c, v, 100.0 * k + c) for (k, c), v in tps.items()]
    assert points[1]["acceptance_length"] == 2.0 and "acceptance_length" not in points[0]
    best = best_k(points)
    assert [(b["concurrency"], b["best_k"], b["no_speculation_best"]) for b in best] == [(1, 2, False), (16, 0, True)]
    assert best[0]["speedup_vs_no_speculation"] == pytest.approx(1.5)
    assert best[0]["runner_up_k"] == 4 and best[0]["runner_up_slower_by"] == pytest.approx(1 - 140 / 150)
    lines = recommendation_lines(best)
    assert lines == ["concurrency 1: num_speculative_tokens = 2 (1.50x no speculation); next best: k = 4, 7% slower",
                     "concurrency 16: no speculation; next best: k = 2, 22% slower"]
    report = {"title": "h on t", "engine_version": "0.32.0", "method": "eagle", "prompts_available": 100,
              "requests_per_level": {"1": 16, "16": 64}, "max_new_tokens": 32, "load_average": [1, 1, 1],
              "points": points, "best": best}
    md = markdown(report)
    assert "| 2 | 150 (0.20 / 0.30; 2.00) | 700 (0.22 / 0.32; 2.00) |" in md and "concurrency 16: no speculation" in md
    assert "load average" not in md  # a report from before the sweep recorded it
    for i, p in enumerate(points):
        p["load_1min"] = 1.0 + i
    assert "at the end of each point (by concurrency): k = 0: 1.0/4.0; k = 2: 2.0/5.0; k = 4: 3.0/6.0." in markdown(report)
    assert plot(points, tmp_path / "p.png", "t").stat().st_size > 1000


def test_sweep_inputs():
    assert parse_int_list("16, 1,4,4", "--concurrency", minimum=1) == [1, 4, 16]
    with pytest.raises(ValueError, match="--ks: expected comma-separated integers"):
        parse_int_list("1,x", "--ks")
    with pytest.raises(ValueError, match=">= 1"):
        parse_int_list("0,4", "--concurrency", minimum=1)
    assert [prompts_per_level(c, 100, 16) for c in (1, 4, 16, 64)] == [16, 16, 64, 100]


def test_sharegpt_dataset_is_what_vllm_bench_reads(tmp_path):
    rows = json.loads(sharegpt_dataset(["Once upon a time", "Hi"], tmp_path / "d.json").read_text())
    assert rows[0]["conversations"][0] == {"from": "human", "value": "Once upon a time"}
    assert all(len(r["conversations"]) >= 2 for r in rows)  # vLLM's ShareGPT loader drops shorter ones


def test_fixed_expand_follows_the_kernel_contract():
    out = torch.empty(6)
    fixed_expand(out, torch.tensor([0.3, 0.0, 0.7]), torch.tensor([2, 3, 6], dtype=torch.int32), 0, 1)
    assert torch.allclose(out, torch.tensor([0.3, 0.3, 1.0, 0.7, 0.7, 0.7]))
    ints = torch.empty(3, dtype=torch.int32)
    fixed_expand(ints, torch.tensor([5, 9], dtype=torch.int32), torch.tensor([1, 3]), 0, 0)
    assert ints.tolist() == [5, 9, 9]


def test_the_sweep_reaches_the_model_card_and_the_hub_upload(tmp_path):
    """serve-sweep's output under the eval folder is staged for the Hub and the card states the draft length per
    concurrency level; without a sweep the card has no such section."""
    head, target = perturbed_head("llama", True)
    target.save_pretrained(tmp_path / "target")
    head.save_pretrained(tmp_path / "run" / "head")
    cfg = load_config("tiny", [f"target.path={tmp_path / 'target'}", f"output_dir={tmp_path / 'run'}",
                               "export.repo_id=someone/head-x"])
    push_to_hub(cfg, dry_run=True)
    assert "Draft length by load" not in (tmp_path / "run" / "hub_upload" / "README.md").read_text()
    points = [bench_json(tmp_path / f"{k}_{c}.json", k, c, v, 50.0) for (k, c), v in
              {(0, 1): 100, (3, 1): 180, (0, 64): 900, (3, 64): 600}.items()]
    sweep_dir = tmp_path / "run" / "eval" / "serve_sweep"
    sweep_dir.mkdir(parents=True)
    (sweep_dir / "sweep.json").write_text(json.dumps({"engine_version": "0.32.0", "max_new_tokens": 128,
                                                      "load_average": [2.0, 2.0, 2.0], "best": best_k(points),
                                                      "points": points}))
    (sweep_dir / "sweep.md").write_text("# serve-sweep\n")
    plot(points, sweep_dir / "throughput.png", "t")
    result = push_to_hub(cfg, dry_run=True)
    assert {"eval/serve_sweep/sweep.json", "eval/serve_sweep/sweep.md", "eval/serve_sweep/throughput.png"} <= set(
        result["files"])
    card = (tmp_path / "run" / "hub_upload" / "README.md").read_text()
    assert "### Draft length by load" in card and "vLLM 0.32.0" in card
    assert "| 1 | 3 | 180 | 1.80x | no speculation, 44% slower |" in card
    assert "| 64 | 0 (no speculation) | 900 | 1.00x | k = 3, 33% slower |" in card
    assert "![throughput vs concurrency](eval/serve_sweep/throughput.png)" in card
