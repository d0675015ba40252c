"""The served target's quantization (`target.quantization`, eagle/quantization.py): each method's grid, the loaders
that apply it (data prep / training's `load_target_model`, `EaModel.from_pretrained`), the cache manifest's record
and the mismatch line, the refusals, and losslessness defined against the QUANTIZED target: greedy speculative
output identical to its vanilla decoding and to transformers' greedy generate of the same quantized model; T > 0
(slow): the chi-square test against its sampling distribution."""
from __future__ import annotations

import functools

import pytest
import torch
from fault_helpers import run_cli
from statistical_rule import assert_same_law
from test_evaluation_e2e import DISTRIBUTION_SAMPLES, distribution_test_run
from test_train_helpers import save_target, write_cache
from tiny_models import fit_good_head, hf_greedy, random_prompts, single_thread, tiny_llama  # noqa: F401

from data_prep.target import load_target_model, quantization_meta
from eagle import DecodingConfig, EaModel
from eagle.quantization import QUANT_METHODS, quant_method, quantize_target, quantized_linears, target_quantization
from evaluation.methods import parse_methods
from recipes import load_config
from recipes.check import RecipeError
from train.frozen_target import CacheMismatchError, check_cache_matches_target

pytestmark = pytest.mark.usefixtures("single_thread")
QUANTIZED = [name for name in QUANT_METHODS if name != "none"]


@pytest.mark.parametrize("name", QUANTIZED)
def test_each_method_puts_every_weight_on_its_grid(name):
    m = quant_method(name)
    w = torch.randn(12, 128, generator=torch.Generator().manual_seed(0))
    q = m.quantize_weight(w)
    assert q.shape == w.shape and q.dtype == w.dtype and not torch.equal(q, w)
    groups = q.reshape(12, -1, m.group_size or 128)  # [out, groups, g]
    levels = max(len(torch.unique(g)) for g in groups.reshape(-1, groups.shape[-1]))
    assert levels <= 2 ** m.bits  # at most 256 / 16 distinct values per scale group
    # round to nearest: no weight moves more than half a step of its group's grid
    wg = w.reshape(groups.shape)
    span = wg.abs().amax(-1, keepdim=True) * 2 if m.symmetric else wg.amax(-1, keepdim=True) - wg.amin(-1, keepdim=True)
    step = span / (2 ** m.bits - 1)
    assert bool(((q.reshape(groups.shape) - wg).abs() <= step / 2 * (1 + 1e-4)).all())  # (+-absmax: a tie clamped)


@pytest.mark.parametrize("name", QUANTIZED)
def test_the_grids_are_torchaos_affine_quantization(name):
    """int8: torchao's symmetric int8 mapping (Int8WeightOnlyConfig's); int4: its asymmetric uint4 mapping with an
    integer zero point (AWQ / GPTQ's convention), per channel or per group; point for point, ties included."""
    primitives = pytest.importorskip("torchao.quantization.quant_primitives")
    m = quant_method(name)
    w = torch.randn(24, 128, generator=torch.Generator().manual_seed(4))
    w[3, :64] = w[3, :64].abs()  # a group of one sign: the range still holds 0
    block = (1, m.group_size or 128)
    if m.symmetric:
        mapping, dtype, lo, hi = primitives.MappingType.SYMMETRIC, torch.int8, -128, 127
    else:
        mapping, dtype, lo, hi = primitives.MappingType.ASYMMETRIC, torch.uint8, 0, 15
    scale, zero = primitives.choose_qparams_affine(w, mapping, block, dtype, quant_min=lo, quant_max=hi, eps=1e-12)
    q = primitives.quantize_affine(w, block, scale, zero, dtype, lo, hi)
    assert torch.equal(primitives.dequantize_affine(q, block, scale, zero, dtype, lo, hi), m.quantize_weight(w))


def test_torchaos_packed_int8_model_is_ours_and_the_fused_decoder_falls_back():
    quantization = pytest.importorskip("torchao.quantization")
    from eagle.fused_decoder import fused_unsupported_reason

    packed, ours = tiny_llama(seed=5), quantize_target(tiny_llama(seed=5), "int8")
    quantization.quantize_(packed.model, quantization.Int8WeightOnlyConfig(),
                           filter_fn=lambda mod, fqn: isinstance(mod, torch.nn.Linear))
    for (name, a), (_, b) in zip(quantized_linears(packed), quantized_linears(ours)):
        assert torch.equal(a.weight.dequantize(), b.weight), name
    assert "packed quantized" in fused_unsupported_reason(packed) and fused_unsupported_reason(ours) is None
    model = EaModel(packed, fit_good_head(ours, prompts=random_prompts(2), new_tokens=4, curriculum=((2, 1, 1e-2),)),
                    DecodingConfig(mode="chain", chain_length=3))
    assert model.target.fused is None  # the HF layers run torchao's kernels
    p = random_prompts(1, seed=3)[0]
    assert torch.equal(model.eagenerate(p, max_new_tokens=12), model.naivegenerate(p, max_new_tokens=12))


def test_smaller_groups_and_more_bits_are_closer_to_the_weights():
    w = torch.randn(64, 128, generator=torch.Generator().manual_seed(1))
    err = {n: float((quant_method(n).quantize_weight(w) - w).pow(2).mean()) for n in QUANTIZED}
    assert err["int8"] < err["int4-g16"] < err["int4-g32"] < err["int4-g64"] < err["int4-g128"] <= err["int4"] * 1.0001


def test_a_group_size_not_dividing_the_columns_leaves_a_shorter_last_group():
    m = quant_method("int4-g64")
    w = torch.randn(4, 172, generator=torch.Generator().manual_seed(2))  # stories260K's down_proj width
    q = m.quantize_weight(w)
    assert torch.equal(q[:, :128], m.quantize_weight(w[:, :128]))  # groups 0 and 1 as if alone
    assert torch.equal(q[:, 128:], quant_method("int4").quantize_weight(w[:, 128:]))  # the 44-column last group
    assert max(len(torch.unique(r)) for r in q[:, 128:]) <= 16


def test_quantize_target_changes_only_the_decoder_linears_and_records_it():
    full, model = tiny_llama(seed=3), tiny_llama(seed=3)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    quantize_target(model, "int4-g32")
    assert target_quantization(model) == "int4-g32" and target_quantization(full) == "none"
    changed = {k for k, v in model.state_dict().items() if not torch.equal(v, before[k])}
    linears = {f"model.{name}.weight" for name, _ in quantized_linears(model)}
    assert changed == linears and len(linears) == 2 * 7  # q, k, v, o, gate, up, down per layer
    ids = torch.arange(10)[None]
    assert not torch.equal(model(ids).logits, full(ids).logits)  # another model
    assert quantize_target(model, "int4-g32") is model and target_quantization(model) == "int4-g32"  # idempotent
    with pytest.raises(ValueError, match="already quantized as int4-g32"):
        quantize_target(model, "int8")


def test_recipe_key_is_checked_and_the_vllm_paths_take_it():
    """vLLM serves a quantized target as its dequantized float copy (tests/test_quantized_target.py)."""
    assert load_config("tiny", []).target.quantization == "none"
    assert load_config("tiny", ["target.quantization=int4-g128"]).target.quantization == "int4-g128"
    with pytest.raises(RecipeError, match=r"target.quantization='int3': expected one of \('none', 'int8', 'int4'"):
        load_config("tiny", ["target.quantization=int3"])
    cfg = load_config("tiny", ["target.quantization=int4", "data.backend=openai", "data.serve=true",
                               "data.feature_source=vllm"])
    assert cfg.target.quantization == "int4" and cfg.data.serve


def test_loaders_apply_the_recipe_quantization(tmp_path):
    target = save_target(tmp_path / "target")
    cfg = load_config("tiny", [f"target.path={target}", "target.dtype=float32", "target.quantization=int8"])
    model = load_target_model(cfg.target, torch.device("cpu"))
    assert target_quantization(model) == "int8"
    w = model.model.layers[0].mlp.down_proj.weight
    raw = load_target_model(load_config("tiny", [f"target.path={target}", "target.dtype=float32"]).target,
                            torch.device("cpu")).model.layers[0].mlp.down_proj.weight
    assert torch.equal(quant_method("int8").quantize_weight(raw), w) and not torch.equal(raw, w)
    head = tmp_path / "head"
    fit_good_head(model, prompts=random_prompts(2), new_tokens=4, curriculum=((2, 1, 1e-2),)).save_pretrained(head)
    ea = EaModel.from_pretrained(str(target), str(head), torch_dtype=torch.float32, quantization="int8")
    assert target_quantization(ea.base_model) == "int8"
    assert torch.equal(ea.base_model.model.layers[0].mlp.down_proj.weight, w)
    assert quantization_meta(cfg.target) == {"target_quantization": "int8"}
    assert quantization_meta(load_config("tiny", []).target) == {}  # a full-precision cache's meta is unchanged


def test_training_on_a_cache_of_another_quantization_is_one_clear_line(tmp_path):
    from transformers import AutoConfig

    target = save_target(tmp_path / "target")
    config = AutoConfig.from_pretrained(target)
    manifest = {"target": str(target), "hidden_size": config.hidden_size, "vocab_size": config.vocab_size}
    check_cache_matches_target(manifest, tmp_path, str(target), config, None, "none")  # an old cache: full precision
    with pytest.raises(CacheMismatchError, match=r"target quantization none \(cache\) != int4-g32 \(recipe "
                                                 r"target.quantization\)"):
        check_cache_matches_target(manifest, tmp_path, str(target), config, None, "int4-g32")
    quantized = {**manifest, "target_quantization": "int4-g32"}
    check_cache_matches_target(quantized, tmp_path, str(target), config, None, "int4-g32")
    with pytest.raises(CacheMismatchError, match=r"target quantization int4-g32 \(cache\) != none"):
        check_cache_matches_target(quantized, tmp_path, str(target), config, None, "none")


def test_train_command_refuses_a_full_precision_cache_for_a_quantized_recipe(tmp_path, capsys):
    from train.main import main

    target = save_target(tmp_path / "target")
    cache = write_cache(tmp_path / "cache", target, n=8)
    code, _, err = run_cli(main, ["--recipe", "tiny", f"target.path={target}", f"train.cache_dir={cache}",
                                  f"output_dir={tmp_path / 'run'}", "target.quantization=int4"], capsys)
    assert code == 2 and "target quantization none (cache) != int4 (recipe target.quantization)" in err, err


# ----------------------------------------------------------------------------- losslessness against the quantized target
DECODINGS = [DecodingConfig(mode="dynamic", total_token=24, depth=4, top_k=4), DecodingConfig(mode="chain", chain_length=4),
             DecodingConfig(mode="static", static_choices="mc_sim_7b_63")]
NEW = 20


@functools.lru_cache(maxsize=None)
def full_precision_setup():
    target = tiny_llama(seed=5)
    prompts = random_prompts(3, seed=7)
    return target, prompts, fit_good_head(target, prompts=prompts, new_tokens=NEW)


@pytest.mark.parametrize("name", ["int8", "int4-g32", pytest.param("int4", marks=pytest.mark.slow),
                                  pytest.param("int4-g128", marks=pytest.mark.slow)])
def test_greedy_speculative_output_is_the_quantized_targets_vanilla_output(name):
    """A head fitted on the quantized target (so long paths are accepted) and one fitted on the full-precision
    target: both decode token for token what the QUANTIZED target's vanilla greedy decoding and transformers'
    greedy generate of that quantized model produce, through the fused decoder and through the HF layers."""
    full, prompts, full_head = full_precision_setup()
    target = quantize_target(tiny_llama(seed=5), name)
    refs = [hf_greedy(target, p, NEW) for p in prompts]
    if name != "int8":  # 4 bits move the greedy continuation itself: the references are another model's
        assert any(not torch.equal(r, hf_greedy(full, p, NEW)) for r, p in zip(refs, prompts))
    for head in (fit_good_head(target, sequences=refs), full_head):
        for fused in (None, False):
            for decoding in DECODINGS:
                model = EaModel(target, head, decoding, fused_target=fused)
                assert (model.target.fused is None) == (fused is False)
                for p, ref in zip(prompts, refs):
                    assert torch.equal(model.naivegenerate(p, max_new_tokens=NEW), ref), (name, fused)
                    assert torch.equal(model.eagenerate(p, max_new_tokens=NEW), ref), (name, fused, decoding.mode)


@pytest.mark.slow
@pytest.mark.statistical
@pytest.mark.parametrize("name", ["int8", "int4-g16"])
def test_chi2_sampling_matches_the_quantized_targets_distribution(name):
    target = quantize_target(tiny_llama(vocab_size=16, init_std=0.2, seed=1), name)
    model = EaModel(target, fit_good_head(target, prompts=random_prompts(4, vocab_size=16), new_tokens=12),
                    DecodingConfig(total_token=8, depth=2, top_k=3))
    vanilla, eagle2 = parse_methods(["eagle2"], model.decoding)
    law = dict(positions=[1, 2], temperature=1.0, max_length=64, eos_token_id=[], alpha=0.01)
    assert_same_law(distribution_test_run(model, vanilla, eagle2, **law), draws=DISTRIBUTION_SAMPLES, seed=0,
                    what=f"distribution_test of eagle2 against vanilla on the {name} target")


def test_model_card_names_the_quantization_and_how_to_serve_it():
    from export.model_card import model_card

    report = {"meta": {"quantization": "int4-g128"}}
    card = model_card(load_config("tiny", ["target.quantization=int4-g128"]), "me/head", "apache-2.0", None, None,
                      report, [])
    assert "## Target quantization" in card and 'quantization="int4-g128"' in card
    assert "int4 weight-only, asymmetric per group of 128 input columns" in card
    assert "the evaluation below decoded against the same quantized target" in card
    assert "--quantization awq" in card
    other = model_card(load_config("tiny", ["target.quantization=int8"]), "me/head", "apache-2.0", None, None, report, [])
    assert "decoded against a `int4-g128` target, not the one it was trained for" in other
    plain = model_card(load_config("tiny", []), "me/head", "apache-2.0", None, None, None, [])
    assert "quantization" not in plain.lower()  # a full-precision head's card is as before


def test_corpus_cache_holds_the_quantized_targets_states_and_training_refuses_it_for_another(tmp_path, capsys):
    """The cache a quantized recipe writes: its meta says target_quantization, its states are the quantized model's
    (the batched forward's rounding apart); a recipe of another quantization is refused at training in one line."""
    from test_data_prep_helpers import CORPUS
    from test_data_prep_helpers import save_target as save_chat_target

    from data_prep.corpus_cache import build_corpus_cache
    from data_prep.feature_cache import FeatureCacheReader
    from data_prep.feature_layers import target_features
    from train.main import main

    target = save_chat_target(tmp_path / "target")
    text = tmp_path / "corpus.txt"
    text.write_text("\n\n".join(CORPUS))
    over = [f"target.path={target}", "target.dtype=float32", f"output_dir={tmp_path / 'run'}", "data.cache_dtype=float32"]
    cfg = load_config("tiny", [*over, "target.quantization=int4-g16"])
    manifest = build_corpus_cache(cfg, text, progress=False)
    assert manifest["target_quantization"] == "int4-g16" and manifest["num_records"] == len(CORPUS)
    model = load_target_model(cfg.target, torch.device("cpu"))
    full = load_target_model(load_config("tiny", over).target, torch.device("cpu"))
    rec = FeatureCacheReader(tmp_path / "run" / "data" / "features")[0]
    ids = rec["input_ids"][None]
    quantized_gap = (rec["hidden_states"] - target_features(model.model, ids, None, None)[0]).abs().max()
    full_gap = (rec["hidden_states"] - target_features(full.model, ids, None, None)[0]).abs().max()
    assert quantized_gap < 1e-4 < full_gap  # the batched cache forward rounds apart; 4 bits move the states far more
    code, _, err = run_cli(main, ["--recipe", "tiny", *over, "target.quantization=int8"], capsys)
    assert code == 2 and "target quantization int4-g16 (cache) != int8 (recipe target.quantization)" in err, err
