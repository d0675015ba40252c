"""Every shipped recipe loads and validates against the code; bad keys and values fail with clear errors; the
DeepSpeed config is generated from the recipe (one home for lr / batch sizes)."""
from __future__ import annotations

from pathlib import Path

import pytest

from recipes import RecipeError, list_recipes, load_config, recipe_path
from train.ds_config import deepspeed_config

PUBLISHED = {  # recipe -> (target, fc bias of the released heads)
    "llama3-8b": ("meta-llama/Meta-Llama-3-8B-Instruct", False),
    "llama2-chat-7b": ("meta-llama/Llama-2-7b-chat-hf", True),
    "vicuna-7b": ("lmsys/vicuna-7b-v1.3", True),
    "qwen2-7b": ("Qwen/Qwen2-7B-Instruct", True),
    "mixtral-8x7b": ("mistralai/Mixtral-8x7B-Instruct-v0.1", True),
}


EAGLE3_DRAFT_VOCAB = {"llama3-8b": 32000, "qwen2-7b": 32000, "llama2-chat-7b": 0, "vicuna-7b": 0, "mixtral-8x7b": 0}


def test_every_published_model_has_a_recipe():
    assert set(PUBLISHED) | {"tiny", "stories260k", "stories260k-eagle3"} <= set(list_recipes())
    assert {f"{n}-eagle3" for n in PUBLISHED} <= set(list_recipes())


@pytest.mark.parametrize("name", list_recipes())
def test_every_recipe_names_its_head_kind(name):
    assert "kind:" in recipe_path(name).read_text()
    assert load_config(name, []).head.kind == ("eagle3" if name.endswith("eagle3") else "eagle2")


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_eagle3_settings(name):
    """SpecForge's / the reference EAGLE-3 settings: lr 1e-4, 10 epochs, batch 1, 2048 tokens, cosine after warm-up,
    clip 0.5, ttt 7 steps weighted 0.8^j, token loss only, 32k draft vocabulary for the 128k/152k-vocabulary targets."""
    from recipes.head import ttt_weights

    cfg = load_config(f"{name}-eagle3", [])
    h, t = cfg.head, cfg.train
    assert cfg.target.path == PUBLISHED[name][0] and cfg.data.max_length == 2048
    assert (h.kind, list(h.aux_layers), h.draft_vocab_size, h.ttt_steps) == ("eagle3", [], EAGLE3_DRAFT_VOCAB[name], 7)
    assert ttt_weights(h) == pytest.approx([0.8 ** j for j in range(7)])
    assert (t.lr, t.epochs, t.micro_batch_size, t.schedule, t.grad_clip, t.noise, t.precision) == \
        (1e-4, 10, 1, "cosine", 0.5, "none", "bf16")


@pytest.mark.parametrize("name", list_recipes())
def test_recipe_validates_against_the_code(name):
    from recipes.chat_templates import shipped_templates
    from eagle.decoding_config import DecodingConfig
    from omegaconf import OmegaConf

    cfg = load_config(name, [])
    assert cfg.name == name
    DecodingConfig(**OmegaConf.to_container(cfg.decoding)).validate()
    if cfg.target.chat_template:
        assert cfg.target.chat_template in shipped_templates(), cfg.target.chat_template
    gpu = deepspeed_config(cfg.train, total_steps=1000, world_size=8, on_cpu=False)
    assert gpu["optimizer"]["params"]["lr"] == cfg.train.lr
    assert gpu["train_batch_size"] == cfg.train.micro_batch_size * cfg.train.grad_accum * 8
    assert gpu["zero_optimization"]["stage"] == cfg.train.zero_stage
    if cfg.train.precision != "fp16":  # the CPU recipes must run on a CPU
        deepspeed_config(cfg.train, total_steps=10, world_size=1, on_cpu=True)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_settings(name):
    cfg = load_config(name, [])
    t = cfg.train
    target, bias = PUBLISHED[name]
    assert cfg.target.path == target and cfg.head.bias is bias
    # the EAGLE DeepSpeed recipe (../shared/docs/eagle-reference.md section 2)
    assert (t.lr, list(t.betas), t.weight_decay, t.warmup_steps, t.schedule, t.grad_clip) == (5e-5, [0.9, 0.95], 0.0, 2000, "linear", 0.5)
    assert (t.zero_stage, t.precision, t.micro_batch_size, t.grad_accum) == (2, "fp16", 2, 2)
    assert (t.feature_weight, t.token_weight, t.noise, t.noise_std, t.eval_fraction, t.epochs) == (1.0, 0.1, "uniform", 0.2, 0.05, 20)
    assert cfg.data.max_length == 2048
    ds = deepspeed_config(t, total_steps=50_000, world_size=8, on_cpu=False)
    assert ds["scheduler"] == {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 5e-5,
                               "warmup_num_steps": 2000, "total_num_steps": 50_000, "warmup_type": "linear"}}
    assert ds["fp16"]["enabled"] and ds["fp16"]["loss_scale"] == 0 and not ds["bf16"]["enabled"]
    assert "torch_adam" not in ds["optimizer"]["params"]  # FusedAdam on GPUs


def test_unknown_key_lists_valid_keys():
    with pytest.raises(RecipeError) as e:
        load_config("tiny", ["train.learning_rate=1e-4"])
    msg = str(e.value)
    assert "train.learning_rate" in msg and "train.lr" in msg and "--help" in msg and "\n" not in msg


def test_unknown_key_in_a_yaml_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\ntrain:\n  batch_size: 4\n")
    with pytest.raises(RecipeError, match="train.batch_size"):
        load_config(str(bad), [])


@pytest.mark.parametrize("override, needle", [
    ("train.precision=fp8", "train.precision='fp8'"),
    ("train.zero_stage=4", "train.zero_stage=4"),
    ("train.mode=streaming", "train.mode='streaming'"),
    ("train.eval_fraction=1.5", "train.eval_fraction=1.5"),
    ("logging.backend=mlflow", "logging.backend='mlflow'"),
    ("export.push_to_hub=true", "export.repo_id"),
    ("train.lr=fast", "train.lr"),
    ("train.deepspeed={optimizer: {type: SGD}}", "generated from the train.* settings"),
    ("head.kind=medusa", "head.kind='medusa'"),
    ("head.aux_layers=[1,2,3]", "head.aux_layers=[1, 2, 3]: only used by head.kind=eagle3"),
    ("head.draft_vocab_size=100", "head.draft_vocab_size=100: only used by head.kind=eagle3"),
])
def test_bad_values_are_clear_errors(override, needle):
    with pytest.raises(RecipeError) as e:
        load_config("tiny", [override])
    assert needle in str(e.value), str(e.value)


def test_overrides_and_extra_deepspeed_keys():
    cfg = load_config("tiny", ["train.lr=1e-4", "train.schedule=cosine", "train.offload_optimizer=true",
                               "train.deepspeed={zero_optimization: {reduce_bucket_size: 1000}}"])
    ds = deepspeed_config(cfg.train, total_steps=100, world_size=2, on_cpu=False)
    assert ds["optimizer"]["params"]["lr"] == 1e-4 and ds["scheduler"]["type"] == "WarmupCosineLR"
    assert ds["zero_optimization"] == {"stage": 1, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                       "reduce_bucket_size": 1000}
    with pytest.raises(ValueError, match="fp16 on CPU"):
        deepspeed_config(load_config("tiny", ["train.precision=fp16"]).train, 10, 1, on_cpu=True)


def test_recipe_path_resolution(tmp_path):
    assert recipe_path("tiny") == Path(recipe_path("tiny.yaml"))
    with pytest.raises(FileNotFoundError, match="shipped"):
        recipe_path("no-such-recipe")


@pytest.mark.parametrize("override, needle", [
    ("head.aux_layers=[1,2]", "head.aux_layers=[1, 2]: expected [] (the target default) or 3 strictly increasing"),
    ("head.aux_layers=[3,2,1]", "head.aux_layers=[3, 2, 1]"),
    ("head.aux_layers=[-1,2,3]", "head.aux_layers=[-1, 2, 3]"),
    ("head.draft_vocab_size=-5", "head.draft_vocab_size=-5"),
    ("head.ttt_steps=0", "head.ttt_steps=0"),
    ("head.ttt_step_weights=[1.0,0.5]", "head.ttt_step_weights=[1.0, 0.5]: expected [] or 7 weights"),
    ("head.ttt_row_stride=0", "head.ttt_row_stride=0"),
])
def test_bad_eagle3_values_are_clear_errors(override, needle):
    with pytest.raises(RecipeError) as e:
        load_config("stories260k-eagle3", [override])
    assert needle in str(e.value), str(e.value)


def test_aux_layers_are_checked_against_the_target():
    """Out of range for the target, or the default (2, L//2, L-3) collapsing on a 5-layer target: RecipeError."""
    from transformers import LlamaConfig

    from data_prep.feature_layers import feature_layers

    five = LlamaConfig(num_hidden_layers=5, hidden_size=64, intermediate_size=128, num_attention_heads=4, vocab_size=512)
    assert feature_layers(load_config("stories260k-eagle3", []).head, five) == [1, 2, 4, 5]
    assert feature_layers(load_config("stories260k", []).head, five) is None
    with pytest.raises(RecipeError, match="head.aux_layers=\\[1, 2, 7\\]"):
        feature_layers(load_config("stories260k-eagle3", ["head.aux_layers=[1,2,7]"]).head, five)
    with pytest.raises(RecipeError, match="set head.aux_layers explicitly"):
        feature_layers(load_config("stories260k-eagle3", ["head.aux_layers=[]"]).head, five)
