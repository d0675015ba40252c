"""The benchmark scripts run (they are measured by hand, not in CI, so nothing else would notice them rot).

benchmarks/ is not installed: it is imported from the repository root, first on sys.path under `python -m pytest`
(run.sh) as under `python -m benchmarks.NAME`; tests/test_cli.py runs each one's --help that way."""
from __future__ import annotations

import json

import pytest
import torch

import eagle.fused_decoder as fused_decoder
from benchmarks import attention_paths, decode_bench, export_checks, step_costs
from data_prep import default_target as dt
from float_tolerance import assert_same_function
from tiny_models import single_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")


def test_decode_bench_without_shared_runs_the_tiny_llama_sweep_and_its_control(tmp_path, capsys):
    kernel = fused_decoder.sdpa_attention
    out = tmp_path / "bench.json"
    assert decode_bench.main(["--shared", str(tmp_path / "no-shared"), "--repeats", "1", "--steps", "3",
                              "--json", str(out)]) == 0
    assert fused_decoder.sdpa_attention is kernel  # the capped-attention control restored the library's kernel
    sweep = json.loads(out.read_text())["vanilla_random_tiny_llama"]
    assert [r["context"] for r in sweep["rows"]] == [64, 1024, 2048]
    for r in sweep["rows"]:
        assert r["wall_ms_per_step"] > 0 and r["attention_capped_ms_per_step"] > 0 and r["kv_read_floor_ms"] > 0
    assert "attention_capped_max_over_min" in sweep and sweep["max_over_min_lower_bound"] > 0
    printed = capsys.readouterr().out
    assert "control, attention capped at the first 64 keys" in printed and "stories260K sections skipped" in printed


def test_attention_capped_caps_only_one_query_unmasked_calls():
    q1, q3 = torch.randn(1, 4, 1, 8), torch.randn(1, 4, 3, 8)
    k, v = torch.randn(1, 2, 100, 8), torch.randn(1, 2, 100, 8)
    full1 = fused_decoder.sdpa_attention(q1, k, v, None)
    full3 = fused_decoder.sdpa_attention(q3, k, v, torch.zeros(1, 1, 3, 100))
    with decode_bench.attention_capped(10):
        capped1 = fused_decoder.sdpa_attention(q1, k, v, None)
        same3 = fused_decoder.sdpa_attention(q3, k, v, torch.zeros(1, 1, 3, 100))
    # attention over the first 10 keys (3 reductions: scores, softmax sum, weights x V), and untouched calls
    assert_same_function(capped1, fused_decoder.sdpa_attention(q1, k[:, :, :10], v[:, :, :10], None), terms=10,
                         chained=3)
    assert not torch.allclose(capped1, full1)
    assert_same_function(same3, full3, terms=100, chained=3)


def test_attention_paths_runs(capsys, monkeypatch):
    monkeypatch.setattr(attention_paths, "SHAPES", attention_paths.SHAPES[:2])
    attention_paths.main(["--threads", "1"])
    assert "sdpa us" in capsys.readouterr().out


@pytest.mark.shared
def test_step_costs_runs_on_stories260k(shared_dir, capsys):
    assert step_costs.main(["--shared", str(shared_dir), "--total-token", "8", "--depth", "2", "--top-k", "2"]) == 0
    assert "full generation loop, per round" in capsys.readouterr().out


@pytest.mark.slow  # ~15 s on an idle machine (400-call timing bursts)
def test_step_costs_runs_on_the_default_target(tmp_path, monkeypatch, capsys):
    """--default-target: the piece costs of the quickstart's target (test-size build here, random head)."""
    built = dt.ensure_default_target(tmp_path, size="test", progress=False)
    monkeypatch.setattr(dt, "ensure_default_target", lambda *a, **k: built)
    assert step_costs.main(["--default-target", "--total-token", "8", "--depth", "2", "--top-k", "2",
                            "--context", "64"]) == 0
    out = capsys.readouterr().out
    size = dt.SIZES["test"]  # the small build above, not the cached full-size target
    assert f"default target ({size.num_layers} layers x {size.hidden_size}, vocab {size.vocab_size})" in out
    assert "target forward, 1 token" in out
    assert "full generation loop, per round" in out


def test_export_checks_bench_runs(capsys):
    assert export_checks.main(["--hidden", "64", "--vocab", "256", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "is_finite (aminmax)" in out and "check_head_weights" in out and "write_engine_folder" in out
