"""The decisions serve-check and serve-sweep make from engine numbers, without an engine: vLLM method vs folder
kind (the trap), the T > 0 agreement statistics, the sweep's result parsing, best-k choice, report and plot, and
the CPU expand fix the engine script installs. The same against real vLLM: tests/test_vllm_engine.py (slow)."""
from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

import pytest
import torch

from eagle.cli_errors import is_expected
from evaluation.serve_check_sampling import acceptance, compare, per_prompt_counts
from evaluation.serve_sweep import (best_k, markdown, parse_int_list, plot, prompts_per_level, read_bench_result,
                                    recommendation_lines, sharegpt_dataset)
from eagle.head_kinds import HEAD_KINDS, PEAGLE
from eagle.quantization import quant_method
from eagle.peagle import PeagleHead
from engine.vllm_side.generate import fixed_expand
from export.engine_formats import EngineFormatError
from export.head_kinds import EXPORT, check_vllm_method, served_kind
from export.hub import push_to_hub
from export.model_card import card_speculative_config
from export.speculative_schedule import SCHEDULE_KEY, ScheduleError
from recipes import load_config
from statistical_rule import assert_same_law, binomial_pvalue
from test_engine_formats import perturbed_head
from test_evaluation_questions import char_tokenizer
from tiny_models import random_head, tiny_target

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


def test_sweep_default_ks_cover_a_dflash_block_whatever_its_tree_depth():
    """--ks unset: 0 .. the tree depth, except a head with a bounded block (EaModel.draft_positions: DFlash's
    block_size - 1), swept over its whole block (vLLM runs 1 + k block rows; k <= block_size - 1 is the export's check)."""
    from types import SimpleNamespace

    from evaluation.serve_sweep import default_ks

    assert default_ks(SimpleNamespace(draft_positions=None, decoding=SimpleNamespace(depth=5))) == [0, 1, 2, 3, 4, 5]
    assert default_ks(SimpleNamespace(draft_positions=7, decoding=SimpleNamespace(depth=5))) == list(range(8))
    assert default_ks(SimpleNamespace(draft_positions=3, decoding=SimpleNamespace(depth=5))) == [0, 1, 2, 3]


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


def recording_engine(tmp_path, exit_code: int = 3) -> tuple[str, Path]:
    """A stand-in engine interpreter: it passes check_engine's "vllm is importable" probe and records every other
    start in a log (then fails, as an engine that cannot start)."""
    log = tmp_path / "engine_starts.log"
    path = tmp_path / "python-fake-vllm"
    path.write_text(f"#!/bin/sh\ncase \"$2\" in *find_spec*) exit 0;; esac\necho \"$@\" >> {log}\nexit {exit_code}\n")
    path.chmod(0o755)
    return str(path), log


def peagle_folders(tmp_path) -> tuple[Path, Path, Path]:
    """(target with a tokenizer, a random P-EAGLE head, a one-line question file)."""
    target = tiny_target("llama", num_layers=4, vocab_size=258, eos_token_id=1)
    target.save_pretrained(tmp_path / "t")
    char_tokenizer(with_template=False).save_pretrained(tmp_path / "t")
    head = PeagleHead.from_target(target, aux_layers=[1, 2, 3])
    head.kind.with_mask_token(head.config, 5)
    head.save_pretrained(tmp_path / "h")
    (tmp_path / "q.txt").write_text("Once upon a time\n")
    return tmp_path / "t", tmp_path / "h", tmp_path / "q.txt"


def test_a_peagle_schedule_is_refused_as_served_before_any_engine_starts(tmp_path, capsys):
    """serve-check of a P-EAGLE head with a hand-written schedule of k 4 and 2 whose file has no parallel_drafting
    key: serve-check serves the head with parallel_drafting (its kind's), the combination vLLM 0.32's worker crashes
    on, so it is refused in one line before any model loads or engine starts. The same file with parallel drafting
    explicitly off is the sequential trap, refused by the method check."""
    from evaluation.main import main

    target, head, questions = peagle_folders(tmp_path)
    engine, starts = recording_engine(tmp_path)
    spec = tmp_path / "speculative_config.json"
    spec.write_text(json.dumps({"method": "eagle3", "model": str(head) + "-vllm", "num_speculative_tokens": 4,
                                "num_speculative_tokens_per_batch_size": [[1, 2, 4], [3, 64, 2]]}))
    argv = ["serve-check", "--base", str(target), "--head", str(head), "--questions", str(questions),
            "--engine-python", engine, "--out", str(tmp_path / "e"), "--speculative-config", str(spec)]
    capsys.readouterr()
    assert main(argv) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith(f"error: {spec}: vLLM 0.32 cannot run a shorter k (2) than "
                                               "num_speculative_tokens = 4 with parallel_drafting"), err
    assert "the head is served with parallel_drafting (its kind drafts in parallel)" in err[0]
    assert not starts.exists(), starts.read_text()  # no engine was started
    assert not (tmp_path / "e" / "serve_check").exists()
    spec.write_text(json.dumps({**json.loads(spec.read_text()), "parallel_drafting": False}))
    assert main(argv) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and "holds a P-EAGLE head" in err[0] and '"parallel_drafting": true' in err[0], err
    assert not starts.exists(), starts.read_text()
    spec.write_text(json.dumps({k: v for k, v in json.loads(spec.read_text()).items() if k != "parallel_drafting"}))
    with pytest.raises(ScheduleError, match="cannot run a shorter k"):
        card_speculative_config({"schedule": {"speculative_config": json.loads(spec.read_text())}}, "H-vllm",
                                EXPORT[PEAGLE])
    assert card_speculative_config({"schedule": {"speculative_config": {**json.loads(spec.read_text()), "method": "eagle3",
                                    SCHEDULE_KEY: [[1, 2, 4], [3, 64, 0]]}}}, "H-vllm", EXPORT[PEAGLE]) == {
        "method": "eagle3", "model": "H-vllm", "num_speculative_tokens": 4, SCHEDULE_KEY: [[1, 2, 4], [3, 64, 0]],
        "parallel_drafting": True}  # a schedule of one k and 0: served, with the kind's parallel_drafting


FAKE_VLLM = '''#!{python}
"""vLLM's CLI as serve-sweep runs it, without vLLM: `vllm serve` answers /health, or exits before it is ready when
the mode file names its k ("*": every k); `vllm bench serve` writes a result whose tokens/s grow with k. Every start
is logged."""
import json, os, sys
from http.server import BaseHTTPRequestHandler, HTTPServer
args = sys.argv[1:]
if args[:1] == ["-c"]:
    sys.exit(0)  # check_engine: "vllm is importable"
command = args[2]  # `-m vllm_side.cli COMMAND ...` (engine/engine_process.py: engine_command)
if command == "serve":
    spec = json.loads(args[args.index("--speculative-config") + 1]) if "--speculative-config" in args else {{}}
    k = str(spec.get("num_speculative_tokens", 0)) + ("s" if "num_speculative_tokens_per_batch_size" in spec else "")
    with open({log!r}, "a") as f:
        f.write(f"serve k{{k}}\\n")
    with open({log!r} + ".models", "a") as f:  # the folder served (serve's first argument)
        f.write(args[3] + "\\n")
    if not os.path.isdir(args[3]):  # vLLM reads it from its own working folder (else: "Repo id must be in the form")
        print(f"OSError: Repo id must be in the form 'namespace/repo_name': {{args[3]!r}}", flush=True)
        sys.exit(1)
    failing = open({mode!r}).read().split()
    if "*" in failing or k in failing:
        print("RuntimeError: the engine could not allocate its KV cache", flush=True)
        sys.exit(3)
    print("vLLM API server version 0.32.0", flush=True)
    health = type("Health", (BaseHTTPRequestHandler,), {{"log_message": lambda self, *a: None, "do_GET": lambda self: (
        self.send_response(200 if self.path == "/health" else 404), self.end_headers())}})
    HTTPServer(("127.0.0.1", int(args[args.index("--port") + 1])), health).serve_forever()
name = args[args.index("--result-filename") + 1]  # bench serve: k{{K}}_c{{C}}.json or schedule_c{{C}}.json
with open({log!r}, "a") as f:
    f.write(f"bench {{name}}\\n")
n = int(args[args.index("--num-prompts") + 1])
k = 2 if name.startswith("schedule") else int(name[1:name.index("_")])
result = {{"completed": n, "failed": 0, "duration": 1.0, "total_output_tokens": 8 * n,
          "output_throughput": 100.0 + 25 * k - name.startswith("schedule"), "median_e2el_ms": 50.0,
          "p90_e2el_ms": 60.0, "median_ttft_ms": 5.0, "median_tpot_ms": 2.0}}
if k:
    result.update(spec_decode_acceptance_length=1.5, spec_decode_per_position_acceptance_rates=[0.5] * k,
                  spec_decode_num_drafts=10)
with open(args[args.index("--result-dir") + 1] + "/" + name, "w") as f:
    json.dump(result, f)
'''


def fake_vllm(tmp_path) -> tuple[str, Path, Path]:
    """(engine interpreter running FAKE_VLLM, its mode file, its log of starts)."""
    path, mode, log = tmp_path / "python-fake-vllm", tmp_path / "fake_mode", tmp_path / "fake_starts.log"
    path.write_text(FAKE_VLLM.format(python=sys.executable, mode=str(mode), log=str(log)))
    path.chmod(0o755)
    mode.write_text("")
    return str(path), mode, log


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def write_sweep_inputs(tmp_path: Path) -> tuple:
    """A serve-sweep's inputs under tmp_path: the tiny target t/ (char tokenizer), a random head run/head and one
    question q.txt; returns (target model, head folder)."""
    target = tiny_target("llama", vocab_size=258, eos_token_id=1)
    target.save_pretrained(tmp_path / "t")
    char_tokenizer(with_template=False).save_pretrained(tmp_path / "t")
    head = tmp_path / "run" / "head"
    random_head(target).save_pretrained(head)
    (tmp_path / "q.txt").write_text("Once upon a time\n")
    return target, head


def test_a_failed_serve_sweep_rerun_keeps_the_last_sweep_and_a_rerun_resumes(tmp_path, capsys):
    """A finished sweep in the eval folder (what the model card and the Hub upload ship), then serve-sweep reruns:
    with an engine that fails to start, one error line and the sweep is unchanged, byte for byte; with one that
    fails at k = 2, the k = 0 point is kept in serve_sweep.partial/ and the sweep still unchanged; the next rerun with
    the same settings measures only what is missing (k = 0 is not served again), then replaces the sweep whole."""
    from evaluation.main import main

    _, head = write_sweep_inputs(tmp_path)
    eval_dir = tmp_path / "run" / "eval"
    sweep_dir = eval_dir / "serve_sweep"
    sweep_dir.mkdir(parents=True)
    points = [bench_json(tmp_path / f"{k}_{c}.json", k, c, v, 50.0) for (k, c), v in {(0, 1): 90, (3, 1): 170}.items()]
    (sweep_dir / "sweep.json").write_text(json.dumps({"engine_version": "0.32.0", "max_new_tokens": 8,
                                                      "load_average": [1.0, 1.0, 1.0], "best": best_k(points),
                                                      "points": points}))
    (sweep_dir / "sweep.md").write_text("# serve-sweep: the last good one\n")
    (sweep_dir / "speculative_config.json").write_text('{"method": "eagle", "model": "H", "num_speculative_tokens": 3, '
                                                       '"num_speculative_tokens_per_batch_size": [[1, 1, 3]]}')
    good = files_of(sweep_dir)
    engine, mode, starts = fake_vllm(tmp_path)
    argv = ["serve-sweep", "--base", str(tmp_path / "t"), "--head", str(head), "--questions", str(tmp_path / "q.txt"),
            "--engine-python", engine, "--out", str(eval_dir), "--concurrency", "1", "--ks", "0,2",
            "eval.max_new_tokens=8"]

    def sweep() -> tuple[int, list[str]]:
        capsys.readouterr()
        code = main(argv)
        return code, [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]

    mode.write_text("*")  # the engine fails to start
    code, errors = sweep()
    assert code == 2 and len(errors) == 1 and "exited with code 3 before it was ready" in errors[0], errors
    assert files_of(sweep_dir) == good  # the last complete sweep is untouched
    mode.write_text("2")  # k = 0 is measured, then k = 2 fails
    code, errors = sweep()
    assert code == 2 and len(errors) == 1, errors
    assert files_of(sweep_dir) == good
    partial = json.loads((eval_dir / "serve_sweep.partial" / "progress.json").read_text())
    assert [(p["k"], p["concurrency"]) for p in partial["points"]] == [(0, 1)]
    starts.write_text("")
    mode.write_text("")
    code, errors = sweep()
    assert code == 0 and not errors
    assert starts.read_text().split("\n")[:-1] == ["serve k2", "bench k2_c1.json", "serve k2s", "bench schedule_c1.json"]
    report = json.loads((sweep_dir / "sweep.json").read_text())
    assert [(p["k"], p["output_tokens_per_s"]) for p in report["points"]] == [(0, 100.0), (2, 150.0)]
    assert report["points"][0] == partial["points"][0]  # reused as measured, load average included
    assert report["best"][0]["best_k"] == 2 and not (eval_dir / "serve_sweep.partial").exists()
    assert {"sweep.json", "sweep.md", "throughput.png", "speculative_config.json"} <= set(files_of(sweep_dir))
    assert not (sweep_dir / "progress.json").exists() and not (sweep_dir / "models").exists()


@pytest.mark.parametrize("quantization", ["int4", "none"])
def test_serve_sweep_serves_the_recipes_quantized_target(tmp_path, monkeypatch, quantization):
    """`serve-sweep ... target.quantization=int4` starts every vLLM server on the target's dequantized float copy
    (engine/quantized_target.py, under $EAGLE_HOME; its weights the in-memory quantized model's) and its reports say
    so; with `none` the target itself is served and the reports name no quantization. The report folder is relative
    (`--out run/eval`) and the engine, started in the sweep's folder, still finds the (padded) model it is given."""
    from engine.quantized_target import CACHE_SUBDIR
    from evaluation.main import main

    monkeypatch.setenv("EAGLE_HOME", str(tmp_path / "home"))
    target, head = write_sweep_inputs(tmp_path)
    engine, _, starts = fake_vllm(tmp_path)
    monkeypatch.chdir(tmp_path)  # a relative --out: vLLM runs in another folder and is given absolute paths
    code = main(["serve-sweep", "--base", str(tmp_path / "t"), "--head", str(head), "--questions", str(tmp_path / "q.txt"),
                 "--engine-python", engine, "--out", "run/eval", "--concurrency", "1", "--ks", "0,2",
                 "eval.max_new_tokens=8", "target.dtype=float32", f"target.quantization={quantization}"])
    assert code == 0
    models = Path(f"{starts}.models").read_text().split()
    assert len(models) == 3  # k = 0, k = 2, the schedule
    report = json.loads((tmp_path / "run" / "eval" / "serve_sweep" / "sweep.json").read_text())
    md = (tmp_path / "run" / "eval" / "serve_sweep" / "sweep.md").read_text()
    copies = tmp_path / "home" / CACHE_SUBDIR
    if quantization == "none":
        assert not copies.exists() and "served_target" not in report and "Target served as" not in md
        assert all(Path(m).name == "t" or Path(m).name.startswith("t-head_dim") for m in models), models
        return
    [copy] = copies.iterdir()  # made once, served by every start (padded beside the sweep when vLLM needs it)
    assert all(Path(m).name.startswith(copy.name) for m in models), (models, copy.name)
    want = quant_method(quantization).quantize_weight(target.model.layers[0].mlp.up_proj.weight)
    got = type(target).from_pretrained(copy, dtype=torch.float32).model.layers[0].mlp.up_proj.weight
    assert torch.equal(got, want)
    assert report["served_target"] == f"quantization={quantization} (dequantized float copy)"
    assert f"Target served as `quantization={quantization} (dequantized float copy)`" in md
