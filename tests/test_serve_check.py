"""serve-check pieces that need no engine (head_dim padding, acceptance accounting), and the engine run itself
(slow + shared: skipped unless $EAGLE_VLLM_PYTHON names a vLLM interpreter, see the `vllm_python` fixture)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eagle.decoding_config import DecodingConfig
from eagle.ea_model import EaModel
from engine.head_dim_pad import pad_head, pad_target_folder, padded_head_dim, row_map
from evaluation.serve_check import Acceptance, strip_stop
from float_tolerance import LAYER_REDUCTIONS, assert_same_function
from tiny_models import random_head, single_thread, tiny_target  # noqa: F401

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.numeric]  # numeric: tests/float_variants.py
REPO = Path(__file__).resolve().parents[1]


def test_row_map_keeps_rotary_frequencies():
    D, D2, theta = 8, 32, 10000.0
    m = row_map(D, D2)
    inv = theta ** (-torch.arange(0, D, 2).float() / D)  # [D/2]
    inv2 = theta ** (-torch.arange(0, D2, 2).float() / D2)
    # first halves: dim i -> j, same frequency. The same exact exponents, but pow over 4 vs 16 elements may take
    # the scalar and the vectorised kernel, each within 1 ulp (2u): 2 roundings apart
    assert_same_function(inv2[m[: D // 2]], inv, terms=1, chained=2)
    assert torch.equal(m[D // 2:] - m[: D // 2], torch.full((D // 2,), D2 // 2))  # partners stay D2/2 apart
    with pytest.raises(ValueError):
        row_map(8, 20)


@pytest.mark.parametrize("bias", [True, False])
def test_padded_copies_decode_token_identically(tmp_path, bias):
    """head_dim 8 -> 32: target and head compute the same function; greedy vanilla and chain decoding agree token
    for token with identical per-round acceptance."""
    target = tiny_target("llama", hidden_size=32, num_heads=4, num_kv_heads=2)  # head_dim 8
    head = random_head(target, bias=bias)
    with torch.no_grad():
        for n, p in head.named_parameters():
            if not n.startswith("embed_tokens"):
                p.add_(torch.randn_like(p) * 0.05)
    target.save_pretrained(tmp_path / "t")
    padded_dir = pad_target_folder(tmp_path / "t", tmp_path / "t32", 32)
    assert json.loads((padded_dir / "config.json").read_text())["head_dim"] == 32
    from transformers import AutoModelForCausalLM

    padded = AutoModelForCausalLM.from_pretrained(padded_dir, dtype=torch.float32).eval()
    head32 = pad_head(head, 32)
    head32.embed_tokens.weight.data.copy_(head.embed_tokens.weight)
    x = torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        # padding adds zero terms and moves the 1/sqrt(d) scale into q: other summation orders, the same function
        assert_same_function(padded(x).logits, target(x).logits, terms=128, chained=2 * LAYER_REDUCTIONS + 2)
        f = torch.randn(1, 12, 32)
        assert_same_function(head32(f, x), head(f, x), terms=128, chained=1 + LAYER_REDUCTIONS)
    a = EaModel(target, head, DecodingConfig(mode="chain", chain_length=4))
    b = EaModel(padded, head32, DecodingConfig(mode="chain", chain_length=4))
    for seed in range(4):
        ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(seed))
        assert torch.equal(a.naivegenerate(ids, max_new_tokens=30), b.naivegenerate(ids, max_new_tokens=30))
        ea, sa = a.eagenerate(ids, max_new_tokens=30, return_stats=True)
        eb, sb = b.eagenerate(ids, max_new_tokens=30, return_stats=True)
        assert torch.equal(ea, eb)
        assert [r.accept_length for r in sa.rounds] == [r.accept_length for r in sb.rounds]


def test_padded_eagle3_head_decodes_token_identically(tmp_path):
    """EAGLE-3: only the output rows of q/k/v (which read 2H inputs) are padded; greedy chain decoding of the padded
    target + head equals the original's token for token, with the same per-round acceptance."""
    target = tiny_target("llama", hidden_size=32, num_heads=4, num_kv_heads=2, num_layers=4)  # head_dim 8
    head = random_head(target, kind="eagle3", aux_layers=(1, 2, 3), draft_vocab_size=200)
    with torch.no_grad():
        for n, p in head.named_parameters():
            if not n.startswith("embed_tokens"):
                p.add_(torch.randn_like(p) * 0.05)
    target.save_pretrained(tmp_path / "t")
    padded = pad_target_folder(tmp_path / "t", tmp_path / "t32", padded_head_dim(8, (32, 64)))
    from transformers import AutoModelForCausalLM

    target32 = AutoModelForCausalLM.from_pretrained(padded, dtype=torch.float32).eval()
    head32 = pad_head(head, 32)
    assert type(head32) is type(head) and head32.midlayer.self_attn.q_proj.weight.shape == (4 * 32, 64)
    assert torch.equal(head32.d2t, head.d2t) and head32.config.head_dim == 32
    with torch.no_grad():  # the same function, every unrolled step
        aux, x = torch.randn(1, 12, 3 * 32), torch.randint(0, 256, (1, 12))
        for h, h32 in zip(head.unroll(aux, x, steps=3), head32.bind_target(target).unroll(aux, x, steps=3)):
            assert torch.allclose(h, h32, atol=1e-5)
    chain = DecodingConfig(mode="chain", chain_length=4)
    a, b = EaModel(target, head, chain), EaModel(target32, head32.bind_target(target32), chain)
    for seed in range(3):
        ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(seed))
        ea, sa = a.eagenerate(ids, max_new_tokens=30, return_stats=True)
        eb, sb = b.eagenerate(ids, max_new_tokens=30, return_stats=True)
        assert torch.equal(ea, eb)
        assert [r.accept_length for r in sa.rounds] == [r.accept_length for r in sb.rounds]
    assert padded_head_dim(16, (32, 64, 80)) == 64 and padded_head_dim(40, (32, 64, 80, 96)) == 80


def test_acceptance_in_engine_terms():
    acc = Acceptance.from_rounds([0, 4, 2, 1, 4], k=4)
    assert (acc.num_drafts, acc.num_accepted, acc.accepted_per_pos) == (5, 11, [4, 3, 2, 2])
    assert acc.mean_length == pytest.approx(1 + 11 / 5)
    assert acc.per_position() == pytest.approx([0.8, 0.6, 0.4, 0.4])
    assert strip_stop([5, 6, 2], [1, 2]) == [5, 6] and strip_stop([5, 6], [1, 2]) == [5, 6]


@pytest.mark.slow
@pytest.mark.shared
@pytest.mark.parametrize("bias", [True, False])
def test_serve_check_runs_vllm(tmp_path, shared_dir, vllm_python, bias):
    """The whole check on stories260K in vLLM, with a head fitted in seconds on the target's continuations of
    TinyStories openings (so acceptance is far from 0 and the engine/project comparison means something)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle.head import EagleHead
    from tiny_models import fit_good_head

    base = shared_dir / "models" / "stories260K"
    target = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval().requires_grad_(False)
    tok = AutoTokenizer.from_pretrained(base)
    text = (shared_dir / "data" / "corpora" / "tinystories_val_a.txt").read_text().split("\n\n")[:24]
    prompts = [torch.tensor([tok(t.split(".")[0] + ".")["input_ids"]]) for t in text if t.strip()]
    fitted = fit_good_head(target, prompts, new_tokens=48)
    head = fitted
    if not bias:  # the same weights without fc.bias
        cfg = fitted.config
        cfg.bias = False
        head = EagleHead(cfg)
        head.load_state_dict({k: v for k, v in fitted.state_dict().items() if k != "fc.bias"})
    else:
        assert fitted.fc.bias.abs().max() > 0  # the vLLM export has a real bias to fold
    head.save_pretrained(tmp_path / "head")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(REPO / "evaluation" / "main.py"), "serve-check", "--recipe", "stories260k",
                           "--base", str(base), "--head", str(tmp_path / "head"), "--engine-python", vllm_python,
                           "--num-prompts", "4", "eval.max_new_tokens=48", "--out", str(tmp_path / "eval")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "eval" / "serve_check" / "report.json").read_text())
    assert report["engine_version"] == "0.32.0" and report["identical_outputs"] == 4
    assert report["padded_equivalence"]["chain_identical"] == 4
    assert report["draft_config"]["bias"] is False and report["draft_config"]["attention_bias"] is bias
    assert report["project_acceptance"]["mean_length"] > 1.5
    assert abs(report["ratio"] - 1) <= report["tolerance"]


@pytest.mark.slow
@pytest.mark.shared
def test_vllm_loads_converted_eagle3_folders(tmp_path, shared_dir, vllm_python):
    """A hand-written released-layout EAGLE-3 folder and its vLLM speculators conversion load in vLLM on a
    head_dim-32 copy of stories260K (vLLM finds the speculators config and the verifier), decode unchanged by
    speculation, and report the same draft statistics. Random weights accept almost nothing, so this shows
    loading, not acceptance; norm_before_residual is pinned by tests/test_engine_formats.py."""
    from safetensors.torch import save_file

    from evaluation.engine_runs import engine_run
    from test_engine_formats import eagle3_folder
    from export.engine_formats import convert_eagle3_folder

    target = pad_target_folder(shared_dir / "models" / "stories260K", tmp_path / "t32", 32)
    cfg, sd = eagle3_folder(tmp_path / "released", H=64, V=512, Vd=256, aux=(1, 2, 4))
    g = torch.Generator().manual_seed(0)
    cfg.update(num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=512)
    for k, rows in (("q", 64), ("k", 32), ("v", 32)):
        sd[f"midlayer.self_attn.{k}_proj.weight"] = torch.randn(rows, 128, generator=g) * 0.05
    sd["midlayer.self_attn.o_proj.weight"] = torch.randn(64, 64, generator=g) * 0.05
    (tmp_path / "released" / "config.json").write_text(json.dumps(cfg))
    save_file(sd, str(tmp_path / "released" / "model.safetensors"))
    convert_eagle3_folder(tmp_path / "released", tmp_path / "spec", "vllm", verifier=str(target),
                          verifier_architectures=["LlamaForCausalLM"], num_speculative_tokens=3)
    spec = lambda d: {"method": "eagle3", "model": str(d), "num_speculative_tokens": 3}  # noqa: E731
    res = engine_run("vllm", vllm_python, {
        "model": str(target), "dtype": "float32", "max_model_len": 512, "prompts": [[1, 400, 300, 200], [1, 50, 60]],
        "max_tokens": 32, "stop_token_ids": [1, 2], "seed": 0,
        "runs": [{"name": "plain", "speculative_config": None},
                 {"name": "speculators", "speculative_config": spec(tmp_path / "spec")},
                 {"name": "released", "speculative_config": spec(tmp_path / "released")}]}, tmp_path)
    runs = res["runs"]
    assert runs["speculators"]["outputs"] == runs["plain"]["outputs"] == runs["released"]["outputs"]
    assert runs["speculators"]["metrics"]["num_drafts"] > 0
    assert runs["speculators"]["metrics"] == runs["released"]["metrics"]


def test_serve_check_without_the_engine_says_how_to_get_it(tmp_path):
    """With an interpreter lacking vllm the command stops with exit 2 and the install recipe, before any work."""
    from evaluation.main import main
    from test_evaluation_questions import char_tokenizer

    target = tiny_target("llama", vocab_size=258, eos_token_id=1)
    target.save_pretrained(tmp_path / "t")
    char_tokenizer(with_template=False).save_pretrained(tmp_path / "t")
    random_head(target).save_pretrained(tmp_path / "h")
    (tmp_path / "q.txt").write_text("Once upon a time\n")
    fake = tmp_path / "python-without-vllm"
    fake.write_text(f"#!/bin/sh\nexec {sys.executable} -I \"$@\"\n")  # isolated: the project's venv has no vllm
    fake.chmod(0o755)
    rc = main(["serve-check", "--base", str(tmp_path / "t"), "--head", str(tmp_path / "h"), "--questions",
               str(tmp_path / "q.txt"), "--engine-python", str(fake), "--out", str(tmp_path / "e")])
    assert rc == 2


def test_acceptance_by_context_bucket_pools_each_buckets_requests():
    """serve-check's per-context-length comparison: the engine's per-request counts and ours pooled per bucket of
    prompt tokens; a bucket whose engine acceptance parts from ours (a window served as full attention) is flagged."""
    from evaluation.serve_check import by_context, context_markdown

    prompts = [[1] * 10, [1] * 30, [1] * 40, [1] * 200]
    k = 2
    ours = [Acceptance(4, 4, [3, 1]), Acceptance(5, 2, [2, 0]), Acceptance(3, 3, [2, 1]), Acceptance(10, 10, [6, 4])]
    engine = [{"num_drafts": 4, "accepted_per_pos": [3, 1]}, {"num_drafts": 5, "accepted_per_pos": [2, 0]},
              {"num_drafts": 3, "accepted_per_pos": [2, 1]}, {"num_drafts": 10, "accepted_per_pos": [2]}]
    rows = by_context(prompts, engine, ours, k, [32, 128], tolerance=0.05)
    assert [r["bucket"] for r in rows] == ["<32", "32-128", "128+"]
    assert [r["prompts"] for r in rows] == [2, 1, 1]
    assert rows[0]["prompt_tokens"] == [10, 30]
    assert rows[0]["engine"]["num_drafts"] == 9 and rows[0]["engine"]["accepted_per_pos"] == [5, 1]
    assert rows[0]["engine"]["mean_length"] == pytest.approx(1 + 6 / 9) == rows[0]["project"]["mean_length"]
    assert [r["within_tolerance"] for r in rows] == [True, True, False]
    assert rows[2]["ratio"] == pytest.approx((1 + 2 / 10) / (1 + 10 / 10))
    assert rows[2]["engine"]["accepted_per_pos"] == [2, 0]  # positions the engine did not report count 0
    md = "\n".join(context_markdown({"by_context": rows, "num_speculative_tokens": k, "context_buckets": [32, 128]}))
    assert "| 128+ | 1 | 200-200 | 1.200 | 2.000 | 0.6000 (outside tolerance) | 0.200 / 0.600 | 0.000 / 0.400 |" in md
    assert context_markdown({"by_context": rows[:1], "num_speculative_tokens": k, "context_buckets": [32]}) == []
    with pytest.raises(Exception, match="no per-request acceptance for prompts \\[1\\]"):
        by_context(prompts, [engine[0], None, *engine[2:]], ours, k, [32, 128], tolerance=0.05)
