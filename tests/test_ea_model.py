"""EaModel API: construction from folders, tree-mode selection, and clear errors on bad input."""
from __future__ import annotations

import json

import pytest
import torch

from eagle import DecodingConfig, EaModel, EagleHead, HeadConfig
from tiny_models import family_setup, hf_greedy, random_head, single_thread, tiny_target  # noqa: F401

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.numeric]  # numeric: tests/float_variants.py


@pytest.fixture(scope="module")
def llama():
    return family_setup("llama")


def test_eamodel_is_importable_from_the_package():
    import eagle

    assert eagle.EaModel is EaModel
    assert DecodingConfig().total_token == 60 and DecodingConfig().depth == 5 and DecodingConfig().top_k == 10


def test_from_pretrained_on_local_folders(tmp_path, llama):
    llama.target.save_pretrained(tmp_path / "target")
    llama.good_head.save_pretrained(tmp_path / "head")
    model = EaModel.from_pretrained(base_model_path=str(tmp_path / "target"), ea_model_path=str(tmp_path / "head"),
                                    total_token=30, depth=4, top_k=6, torch_dtype=torch.float32, device_map=None)
    assert (model.decoding.total_token, model.decoding.depth, model.decoding.top_k) == (30, 4, 6)
    assert model.decoding.mode == "dynamic"
    for prompt, ref in zip(llama.prompts[:5], llama.references[:5]):
        assert torch.equal(model.eagenerate(prompt, max_new_tokens=32), ref)
    chain = EaModel.from_pretrained(base_model_path=str(tmp_path / "target"), ea_model_path=str(tmp_path / "head"),
                                    tree_mode="chain", chain_length=3, torch_dtype=torch.float32)
    assert chain.decoding.mode == "chain" and chain.decoding.chain_length == 3
    ids, stats = chain.eagenerate(llama.prompts[0], max_new_tokens=32, return_stats=True)
    assert torch.equal(ids, llama.references[0])
    assert max(r.accept_length for r in stats.rounds) == 3


def test_custom_static_tree(llama):
    choices = [[0], [1], [0, 0], [0, 1], [0, 0, 0], [0, 0, 0, 0]]
    model = EaModel(llama.target, llama.good_head, DecodingConfig(mode="static"), static_tree=choices)
    for prompt, ref in zip(llama.prompts[:5], llama.references[:5]):
        ids, stats = model.eagenerate(prompt, max_new_tokens=32, return_stats=True)
        assert torch.equal(ids, ref)
        assert all(r.node_depth.numel() == len(choices) for r in stats.rounds)
        assert sorted(r.node_depth.tolist() for r in stats.rounds[:1])[0] == sorted(len(c) for c in choices)


def test_decoding_override_per_call(llama):
    model = EaModel(llama.target, llama.good_head)
    prompt, ref = llama.prompts[1], llama.references[1]
    for decoding in (DecodingConfig(mode="vanilla"), DecodingConfig(mode="chain", chain_length=2),
                     DecodingConfig(total_token=5, depth=2, top_k=2)):
        ids, stats = model.eagenerate(prompt, max_new_tokens=32, decoding=decoding, return_stats=True)
        assert torch.equal(ids, ref)
        if decoding.mode == "vanilla":
            assert stats.tau == 1.0
        if decoding.mode == "dynamic":
            assert all(r.node_depth.numel() == 4 for r in stats.rounds)
    assert model.decoding.mode == "dynamic" and model.decoding.total_token == 60  # the override did not stick


def test_round_stats_name_each_nodes_parent(llama):
    """node_parent lets calibration condition a node's probability on its parent being accepted."""
    model = EaModel(llama.target, llama.good_head)
    for mode in (DecodingConfig(), DecodingConfig(mode="static")):
        _, stats = model.eagenerate(llama.prompts[2], max_new_tokens=32, decoding=mode, return_stats=True)
        for r in stats.rounds:
            par, depth, acc = r.node_parent, r.node_depth, r.node_accepted
            assert par.shape == depth.shape and bool((par < torch.arange(par.numel())).all())  # parents first
            top = par < 0
            assert bool((depth[top] == 1).all())
            assert torch.equal(depth[~top], depth[par[~top]] + 1)
            assert bool((~acc[~top] | acc[par[~top]]).all())  # an accepted node's parent is accepted
            assert int(acc.sum()) == r.accept_length


# ----------------------------------------------------------------------------- bad input
def other_head(hidden=64, vocab=256, heads=4, kv=2):
    torch.manual_seed(0)
    return EagleHead(HeadConfig(hidden_size=hidden, intermediate_size=96, num_attention_heads=heads,
                                num_key_value_heads=kv, vocab_size=vocab))


def test_head_target_hidden_size_mismatch(llama):
    with pytest.raises(ValueError, match=r"hidden_size.*32.*64|hidden_size.*64.*32"):
        EaModel(llama.target, other_head(hidden=32))


def test_head_target_vocab_mismatch(llama):
    with pytest.raises(ValueError, match=r"vocab.*300.*256|vocab.*256.*300"):
        EaModel(llama.target, other_head(vocab=300))


def test_head_target_mismatch_from_folders(tmp_path, llama):
    llama.target.save_pretrained(tmp_path / "target")
    other_head(hidden=32).save_pretrained(tmp_path / "head")
    with pytest.raises(ValueError, match="hidden_size"):
        EaModel.from_pretrained(base_model_path=str(tmp_path / "target"), ea_model_path=str(tmp_path / "head"),
                                torch_dtype=torch.float32)


def test_prompt_longer_than_max_length(llama):
    model = EaModel(llama.target, llama.random_head)
    prompt = torch.randint(0, 256, (1, 20))
    with pytest.raises(ValueError, match=r"max_length.*10|20.*max_length"):
        model.eagenerate(prompt, max_length=10)
    with pytest.raises(ValueError, match="max_length"):
        model.naivegenerate(prompt, max_length=10)
    with pytest.raises(ValueError, match="max_length"):
        list(model.ea_generate(prompt, max_length=10))


@pytest.mark.parametrize("total_token", [1, 0, -3])
def test_total_token_below_two(llama, total_token):
    with pytest.raises(ValueError, match="total_token"):
        EaModel(llama.target, llama.random_head, DecodingConfig(total_token=total_token))
    model = EaModel(llama.target, llama.random_head)
    with pytest.raises(ValueError, match="total_token"):
        model.eagenerate(llama.prompts[0], decoding=DecodingConfig(total_token=total_token))


def test_total_token_below_two_from_pretrained(tmp_path, llama):
    llama.target.save_pretrained(tmp_path / "target")
    llama.random_head.save_pretrained(tmp_path / "head")
    with pytest.raises(ValueError, match="total_token"):
        EaModel.from_pretrained(base_model_path=str(tmp_path / "target"), ea_model_path=str(tmp_path / "head"),
                                total_token=1, torch_dtype=torch.float32)


def test_top_k_larger_than_vocab(llama):
    with pytest.raises(ValueError, match=r"top_k.*257.*256|top_k=257"):
        EaModel(llama.target, llama.random_head, DecodingConfig(top_k=257))
    model = EaModel(llama.target, llama.random_head)
    with pytest.raises(ValueError, match="top_k"):
        model.eagenerate(llama.prompts[0], decoding=DecodingConfig(top_k=1000))


def test_top_k_equal_to_vocab_is_allowed():
    target = tiny_target("llama", vocab_size=16, seed=2)
    model = EaModel(target, random_head(target), DecodingConfig(total_token=20, depth=2, top_k=16))
    prompt = torch.tensor([[1, 5, 9]])
    assert torch.equal(model.eagenerate(prompt, max_new_tokens=12), hf_greedy(target, prompt, 12))


def test_empty_prompt(llama):
    model = EaModel(llama.target, llama.random_head)
    with pytest.raises(ValueError, match="empty"):
        model.eagenerate(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="empty"):
        model.naivegenerate(torch.zeros(1, 0, dtype=torch.long))


@pytest.mark.parametrize("ids,match", [
    (torch.zeros(2, 5, dtype=torch.long), "batch"),
    (torch.zeros(5, dtype=torch.long), r"\[1, T\]"),
    (torch.tensor([[3, 256, 4]]), "vocab"),
    (torch.tensor([[3, -1, 4]]), "vocab"),
])
def test_malformed_input_ids(llama, ids, match):
    with pytest.raises(ValueError, match=match):
        EaModel(llama.target, llama.random_head).eagenerate(ids)


def test_tokenizer_output_is_accepted_as_the_prompt(llama):
    """transformers 5's `apply_chat_template(..., return_tensors="pt")` returns a BatchEncoding, not a tensor."""
    from transformers import BatchEncoding

    model = EaModel(llama.target, llama.good_head)
    prompt, ref = llama.prompts[0], llama.references[0]
    enc = BatchEncoding({"input_ids": prompt, "attention_mask": torch.ones_like(prompt)})
    assert torch.equal(model.eagenerate(enc, max_new_tokens=32), ref)
    assert torch.equal(model.naivegenerate({"input_ids": prompt}, max_new_tokens=32), ref)
    streamed = list(model.ea_generate(enc, max_new_tokens=32))
    assert torch.equal(streamed[-1], ref)


@pytest.mark.parametrize("prompt,error,match", [
    ({"input_ids": torch.tensor([[0, 3, 4]]), "attention_mask": torch.tensor([[0, 1, 1]])}, ValueError, "padding"),
    ({"ids": torch.tensor([[3, 4]])}, ValueError, "without 'input_ids'"),
    ([[3, 4, 5]], TypeError, "got list"),
    (torch.tensor([[3.0, 4.0]]), TypeError, "integer token ids"),
])
def test_prompt_that_is_not_token_ids_gets_a_clear_error(llama, prompt, error, match):
    model = EaModel(llama.target, llama.random_head)
    with pytest.raises(error, match=match):
        model.eagenerate(prompt)
    with pytest.raises(error, match=match):
        next(model.ea_generate(prompt))


def test_eager_attention_target_is_lossless_too(llama):
    """Tree masks must be read correctly by the eager backend as well (a bool 4D mask is not)."""
    target = tiny_target("llama", seed=0, attn_implementation="eager")
    assert target.config._attn_implementation == "eager"
    model = EaModel(target, llama.good_head)  # same weights as the sdpa llama: the fitted head still applies
    accepted = 0
    for prompt in llama.prompts[:6]:
        ids, stats = model.eagenerate(prompt, max_new_tokens=24, return_stats=True)
        expected = hf_greedy(target, prompt, 24)
        assert torch.equal(ids, expected)
        accepted += sum(r.accept_length for r in stats.rounds)
    assert accepted > 30


def test_unsupported_attention_backend_is_refused_with_a_hint():
    target = tiny_target("llama")
    target.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="sdpa"):
        EaModel(target, random_head(target))


def test_unknown_tree_mode(llama):
    with pytest.raises(ValueError, match="mode"):
        EaModel(llama.target, llama.random_head, DecodingConfig(mode="beam"))


def test_unknown_keys_in_tree_config_json_fail_loudly(tmp_path, llama):
    llama.target.save_pretrained(tmp_path / "target")
    llama.random_head.save_pretrained(tmp_path / "head")
    (tmp_path / "head" / "tree_config.json").write_text(json.dumps({"total_token": 30, "totl_depth": 4}))
    with pytest.raises(ValueError, match="totl_depth"):
        EaModel.from_pretrained(base_model_path=str(tmp_path / "target"), ea_model_path=str(tmp_path / "head"),
                                torch_dtype=torch.float32)


def test_load_and_generate_under_inference_mode(tmp_path, llama):
    llama.target.save_pretrained(tmp_path / "target")
    llama.good_head.save_pretrained(tmp_path / "head")
    with torch.inference_mode():
        model = EaModel.from_pretrained(base_model_path=str(tmp_path / "target"), ea_model_path=str(tmp_path / "head"),
                                        torch_dtype=torch.float32)
        ids = model.eagenerate(llama.prompts[0], max_new_tokens=32)
    assert torch.equal(ids, llama.references[0])


def test_mixed_sliding_and_full_attention_layers_are_refused_clearly():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, use_sliding_window=True, sliding_window=8, max_window_layers=1,
                      attn_implementation="sdpa")
    assert cfg.layer_types == ["full_attention", "sliding_attention"]
    target = Qwen2ForCausalLM(cfg).eval()
    with pytest.raises(NotImplementedError, match="sliding"):
        EaModel(target, random_head(target))
