"""Every shipped recipe loads and validates against the code; bad keys and values fail with clear errors; the
DeepSpeed config is generated from the recipe (one home for lr / batch sizes)."""
from __future__ import annotations

import json
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
    suffix = name.rsplit("-", 1)[-1]  # llama3-8b-eagle3, tiny-peagle, tiny-dflash: the kind; the others are EAGLE-2 recipes
    assert load_config(name, []).head.kind == (suffix if suffix in ("eagle3", "peagle", "dflash") else "eagle2")


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_published_eagle3_settings(name):
    """SpecForge's / the reference EAGLE-3 settings: lr 1e-4, 10 epochs, batch 1, 2048 tokens, cosine after warm-up,
    clip 0.5, ttt 7 steps weighted 0.8^j, token loss only, 32k draft vocabulary for the 128k/152k-vocabulary targets."""
    from recipes.head import step_weights

    cfg = load_config(f"{name}-eagle3", [])
    h, t = cfg.head, cfg.train
    assert cfg.target.path == PUBLISHED[name][0] and cfg.data.max_length == 2048
    assert (h.kind, list(h.aux_layers), h.draft_vocab_size, h.ttt_steps) == ("eagle3", [], EAGLE3_DRAFT_VOCAB[name], 7)
    assert step_weights(h) == pytest.approx([0.8 ** j for j in range(7)])
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


def flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def resolved(name: str) -> dict:
    from omegaconf import OmegaConf

    return flat(OmegaConf.to_container(load_config(name, []), resolve=True))


PINNED = json.loads((Path(__file__).parent / "data" / "recipes_resolved.json").read_text())


def test_every_shipped_recipe_resolves_as_pinned():
    """Recipes built on recipes (`base:`) resolve to exactly the config each recipe had before (tests/data: every
    key of main 7d6a95f's resolved recipes); a new recipe is pinned here too."""
    assert sorted(PINNED["recipes"]) == list_recipes()
    assert resolved("tiny").keys() == PINNED["defaults"].keys()  # no key appeared or vanished
    for name in list_recipes():
        want, got = {**PINNED["defaults"], **PINNED["recipes"][name]}, resolved(name)
        bad = sorted(k for k in want if got[k] != want[k] or type(got[k]) is not type(want[k]))
        assert not bad, (name, [(k, got[k], want[k]) for k in bad])


@pytest.mark.parametrize("name", sorted(PUBLISHED) + ["stories260k", "tiny"])
def test_eagle3_recipes_build_on_their_eagle2_sibling(name):
    """An EAGLE-3 recipe states its base and only what differs: no section it would merely repeat."""
    import yaml

    own = yaml.safe_load(recipe_path(f"{name}-eagle3").read_text())
    assert own["base"] == name and "target" not in own and "data" not in own
    base = {**PINNED["defaults"], **PINNED["recipes"][name]}
    repeated = [k for k, v in flat({k: v for k, v in own.items() if k != "base"}).items() if base.get(k) == v]
    assert not repeated, repeated


def test_base_recipes_merge_key_by_key(tmp_path):
    (tmp_path / "parent.yaml").write_text("name: parent\ntrain:\n  lr: 0.002\n  betas: [0.8, 0.9]\ndata:\n  max_length: 64\n")
    (tmp_path / "child.yaml").write_text("base: parent.yaml\nname: child\ntrain:\n  betas: [0.5, 0.6]\n")
    (tmp_path / "shipped.yaml").write_text("base: tiny\nname: on-tiny\n")
    cfg = load_config(str(tmp_path / "child.yaml"), ["train.grad_clip=0.1"])
    assert (cfg.name, cfg.output_dir, cfg.train.lr, list(cfg.train.betas), cfg.data.max_length, cfg.train.grad_clip) == \
        ("child", "runs/child", 0.002, [0.5, 0.6], 64, 0.1)  # a list replaces the base's; interpolations see the child
    tiny = load_config("tiny", [])
    on_tiny = load_config(str(tmp_path / "shipped.yaml"), [])
    assert on_tiny.name == "on-tiny" and on_tiny.train == tiny.train and on_tiny.eval == tiny.eval


@pytest.mark.parametrize("files, needle", [
    ({"a.yaml": "base: a.yaml\nname: a\n"}, "builds on itself (a -> a)"),
    ({"a.yaml": "base: b.yaml\nname: a\n", "b.yaml": "base: a.yaml\nname: b\n"}, "builds on itself (a -> b -> a)"),
    ({"a.yaml": "base: no-such-recipe\nname: a\n"}, "recipe 'no-such-recipe' not found"),
    ({"a.yaml": "base: [tiny]\nname: a\n"}, "base=['tiny']: expected the name or path"),
    ({"a.yaml": "base: b.yaml\nname: a\n", "b.yaml": "name: b\ntrain:\n  learning_rate: 1\n"}, "train.learning_rate"),
])
def test_bad_base_recipes_are_one_line_errors(tmp_path, files, needle):
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    with pytest.raises((RecipeError, FileNotFoundError)) as e:
        load_config(str(tmp_path / "a.yaml"), [])
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_print_config_shows_the_whole_resolved_recipe(capsys):
    """--print-config on a command prints every key of the recipe, its base merged and overrides applied."""
    import yaml

    from recipes import config_yaml
    from train.main import main

    with pytest.raises(SystemExit) as e:
        main(["--recipe", "llama3-8b-eagle3", "train.lr=3e-4", "--print-config"])
    assert e.value.code == 0
    printed = capsys.readouterr().out
    assert printed == config_yaml(load_config("llama3-8b-eagle3", ["train.lr=3e-4"]))
    shown = flat(yaml.safe_load(printed))
    assert shown.keys() == PINNED["defaults"].keys()
    assert (shown["target.path"], shown["head.kind"], shown["train.lr"]) == \
        ("meta-llama/Meta-Llama-3-8B-Instruct", "eagle3", 3e-4)  # from the base, the recipe, the override


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


def test_peagle_mask_token_is_checked_and_belongs_to_its_kind():
    """head.mask_token_id: >= -1, a token of the target (checked where the target is known), refused with another kind."""
    from transformers import LlamaConfig

    from recipes.head import check_head_fits_target

    assert load_config("tiny-peagle", ["head.mask_token_id=7"]).head.mask_token_id == 7
    with pytest.raises(RecipeError, match=r"head.mask_token_id=-2: expected -1"):
        load_config("tiny-peagle", ["head.mask_token_id=-2"])
    with pytest.raises(RecipeError, match=r"head.mask_token_id=3: only used by head.kind=peagle"):
        load_config("tiny-eagle3", ["head.mask_token_id=3"])
    h = load_config("tiny-peagle", ["head.mask_token_id=1024", "head.aux_layers=[1,2,3]"]).head
    with pytest.raises(RecipeError, match=r"head.mask_token_id=1024: not a token of the target's vocabulary \[0, 1024\)"):
        check_head_fits_target(h, LlamaConfig(vocab_size=1024, num_hidden_layers=4))


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


@pytest.mark.parametrize("name,eagle3", [("tiny-dflash", "tiny-eagle3"), ("stories260k-dflash", "stories260k-eagle3")])
def test_dflash_recipes_reuse_their_eagle3_cache_and_draft_one_block(name, eagle3):
    """The DFlash recipes read the same feature layers as their EAGLE-3 recipe (one cache serves both) and decode
    a chain of head.block_size - 1 (what one block drafts); the kind's keys are refused with another kind."""
    from types import SimpleNamespace

    from data_prep.feature_layers import feature_layers

    cfg, other = load_config(name, []), load_config(eagle3, [])
    layers = SimpleNamespace(num_hidden_layers=16 if name.startswith("tiny") else 5, hidden_size=64, vocab_size=512)
    assert feature_layers(cfg.head, layers) == feature_layers(other.head, layers)
    assert cfg.decoding.mode == "chain" and cfg.decoding.chain_length == cfg.head.block_size - 1
    with pytest.raises(RecipeError, match=r"^head.block_size=4: only used by head.kind=dflash$"):
        load_config(eagle3, ["head.block_size=4"])
    with pytest.raises(RecipeError, match=r"^head.block_weights=\[1.0\]: expected \[\] or 7 weights"):
        load_config(name, ["head.block_weights=[1.0]"])
