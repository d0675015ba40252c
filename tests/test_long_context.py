"""Prompts longer than the head's max_position_embeddings (within the target's): decoding stays lossless and
keeps its acceptance (the head's rotary tables grow with the context; nothing clamps or wraps positions), and
training records longer than the head's positions follow train.long_records."""
from __future__ import annotations

import json

import pytest
import torch

from benchmarks import real_shape_decode
from eagle import EaModel
from eagle.head import EagleHead
from tiny_models import fit_good_head, hf_greedy, random_prompts, single_thread, tiny_llama  # noqa: F401

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.numeric]  # numeric: tests/float_variants.py


def with_positions(head: EagleHead, positions: int, tmp_path) -> EagleHead:
    """The same weights under a config.json that says max_position_embeddings=positions (saved and reloaded)."""
    out = tmp_path / f"head{positions}"
    head.save_pretrained(out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["max_position_embeddings"] = positions
    (out / "config.json").write_text(json.dumps(cfg))
    loaded = EagleHead.from_pretrained(out)
    assert loaded.config.max_position_embeddings == positions
    return loaded


def decode_all(target, head, prompts, new_tokens, eos=None):
    model = EaModel(target, head)
    outs, taus = [], []
    for p in prompts:
        out, n_new, rounds = model.eagenerate(p, max_new_tokens=new_tokens, max_length=p.shape[1] + new_tokens + 1,
                                              log=True, eos_token_id=eos)
        outs.append(out)
        taus.append(n_new / rounds)
    return outs, sum(taus) / len(taus)


def check_long_context(target, prompts, head, short_positions, new_tokens, tmp_path, eos=None, min_tau=2.0):
    assert min(p.shape[1] for p in prompts) > short_positions  # every prompt starts past the head's positions
    refs = [hf_greedy(target, p, new_tokens, eos_token_id=eos) for p in prompts]
    short = with_positions(head, short_positions, tmp_path)
    long = with_positions(head, 4 * target.config.max_position_embeddings, tmp_path)
    outs_s, tau_s = decode_all(target, short, prompts, new_tokens, eos)
    outs_l, tau_l = decode_all(target, long, prompts, new_tokens, eos)
    for ref, got in zip(refs, outs_s):
        assert torch.equal(got, ref)  # lossless past the head's positions
    assert all(torch.equal(a, b) for a, b in zip(outs_s, outs_l))
    assert tau_s == tau_l  # the config number changes nothing: same drafts, same acceptance
    assert tau_s > min_tau, tau_s  # and the fitted head is still accepted out there
    return tau_s


def test_prompts_past_the_heads_positions_tiny(tmp_path):
    target = tiny_llama(max_position_embeddings=512)
    prompts = random_prompts(3, min_len=40, max_len=56, seed=5)
    head = fit_good_head(target, sequences=[hf_greedy(target, p, 24) for p in prompts])
    check_long_context(target, prompts, head, short_positions=32, new_tokens=24, tmp_path=tmp_path)


@pytest.mark.shared
def test_prompts_past_the_heads_positions_stories260k(shared_dir, tmp_path):
    """stories260K (512 positions) with a head whose config says 256: prompts of ~300 tokens of TinyStories."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = shared_dir / "models" / "stories260K"
    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    tok = AutoTokenizer.from_pretrained(path)
    paragraphs = [p for p in (shared_dir / "data" / "corpora" / "tinystories_val_a.txt").read_text().split("\n\n") if p]
    prompts, i = [], 0
    while len(prompts) < 3:
        ids = tok(" ".join(paragraphs[i:i + 6]), return_tensors="pt").input_ids[:, :300]
        i += 6
        if ids.shape[1] == 300:
            prompts.append(ids)
    eos = [1, 2]
    head = fit_good_head(target, sequences=[hf_greedy(target, p, 48, eos_token_id=eos) for p in prompts])
    check_long_context(target, prompts, head, short_positions=256, new_tokens=48, tmp_path=tmp_path, eos=eos)


# ----------------------------------------------------------------------------- training records
def test_long_records_policy():
    from train.data import LongRecordError, apply_long_records

    lengths = [100, 300, 50, 600]
    idx = [0, 1, 2, 3]
    assert apply_long_records("keep", 256, lengths, idx, 512) == (idx, 512)
    assert apply_long_records("truncate", 256, lengths, idx, 512) == (idx, 256)
    assert apply_long_records("drop", 256, lengths, idx, 512) == ([0, 2], 512)
    assert apply_long_records("drop", 256, lengths, idx, 200) == (idx, 200)  # data.max_length cut them already
    assert apply_long_records("error", 1000, lengths, idx, 2048) == (idx, 2048)
    with pytest.raises(LongRecordError, match="2 of 4 records are longer than the head's max_position_embeddings=256"):
        apply_long_records("error", 256, lengths, idx, 512)


def test_long_records_key_is_validated():
    from recipes import RecipeError
    from recipes import load_config

    with pytest.raises(RecipeError, match="train.long_records"):
        load_config("tiny", ["train.long_records=wrap"])


def test_head_positions_come_from_init_from_or_the_target(tmp_path):
    from omegaconf import OmegaConf

    from train.data import head_positions

    target = tiny_llama(max_position_embeddings=512)
    cfg = OmegaConf.create({"head": {"init_from": "", "bias": True}})
    assert head_positions(cfg, target.config) == 512
    head = with_positions(EagleHead.from_target(target), 64, tmp_path)
    head.save_pretrained(tmp_path / "h")
    cfg.head.init_from = str(tmp_path / "h")
    assert head_positions(cfg, target.config) == 64


def test_real_shape_decode_benchmark_runs_on_a_tiny_target(tmp_path, capsys):
    """benchmarks/real_shape_decode.py end to end on a tiny folder target (the real-shape run is the same code)."""
    tiny_llama(max_position_embeddings=512).save_pretrained(tmp_path / "tiny" / "target")
    rc = real_shape_decode.main(["--recipe", "tiny", "--work", str(tmp_path), "--context", "40", "--rounds", "4",
                                 "--long-prompt", "80", "--head-positions", "64", "--long-new-tokens", "4"])
    out = json.loads((tmp_path / "tiny" / "decode.json").read_text())
    assert rc == 0 and out["lossless_round_run"] and out["long_context"]["same_as_unlimited_head"]
    assert 0.0 <= out["round"]["overhead_fraction"] < 1.0 and out["verify"]["ratio"] > 0
    assert "non-forward overhead" in capsys.readouterr().out
