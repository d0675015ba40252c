"""The recipe's target, for every stage that loads one: where it is (`resolve_target_path`: a folder, a hub id, or
the embedded default target, built on first use), its config and the hash that identifies it (a feature cache
records it), its tokenizer with the chat template, and the frozen model (`load_target_model`, data prep and the
trainer's online mode)."""
from __future__ import annotations

import contextlib
import hashlib
import json

import torch

from data_prep.chat_template import setup_chat_template
from data_prep.default_target import default_cache_dir, ensure_default_target
from eagle.cli_errors import UserError
from eagle.hub_ids import check_local_exists
from eagle.quantization import NONE, quantize_target
from engine.quantized_target import engine_target

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# config keys that do not change the features (versions, paths, compute dtype recorded separately)
_HASH_IGNORED_KEYS = {"transformers_version", "_name_or_path", "name_or_path", "torch_dtype", "dtype", "use_cache",
                      "_attn_implementation", "_attn_implementation_autoset", "attn_implementation", "output_hidden_states"}


def resolve_target_path(target_cfg) -> str:
    """`target.path`, or the embedded default target when it is "". A local-looking path that does not exist is
    an error naming it (transformers would report it as a malformed hub id)."""
    if target_cfg.path:
        path = str(target_cfg.path)
        check_local_exists(path, "target.path", "a local folder")
        return path
    return str(ensure_default_target())


@contextlib.contextmanager
def naming_target(path, what: str = "target"):
    """Errors transformers raises while loading the target (a config.json that is not JSON, an unknown model_type,
    missing weight or tokenizer files) become one UserError naming the folder or hub id."""
    try:
        yield
    except UserError:
        raise
    except (ValueError, OSError) as e:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise UserError(f"{what} {path}: {type(e).__name__}: {' '.join(str(e).split())[:600]}") from e


def load_target_config(path, revision=None):
    """AutoConfig of the target, load errors naming it."""
    # lazy: transformers costs over a second at import; commands that never read a target (--help) skip it
    from transformers import AutoConfig

    with naming_target(path, "target config of"):
        return AutoConfig.from_pretrained(str(path), revision=revision)


def target_config_hash(config) -> str:
    """Stable hash of a target's architecture config (the feature cache records it; the trainer can compare)."""
    d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    d = {k: v for k, v in d.items() if k not in _HASH_IGNORED_KEYS}
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def load_target_tokenizer(target_cfg, path: str | None = None, need_template: bool = True):
    """Tokenizer of the target, with `target.chat_template` installed when set (conversations need a template;
    raw-text corpora pass need_template=False)."""
    # lazy: transformers costs over a second at import; commands that never read a target (--help) skip it
    from transformers import AutoTokenizer

    path = path or resolve_target_path(target_cfg)
    with naming_target(path, "tokenizer of"):
        tokenizer = AutoTokenizer.from_pretrained(path, revision=target_cfg.revision)
    if need_template or target_cfg.chat_template:
        setup_chat_template(tokenizer, target_cfg.chat_template, where=f"tokenizer of {path}")
    return tokenizer


def load_target_model(target_cfg, device: torch.device, path: str | None = None):
    """The frozen causal LM in eval mode on `device`, in `target.dtype`, quantized by `target.quantization` (the
    served model: eagle/quantization.py)."""
    # lazy: transformers' model classes cost seconds at import; only loading the target needs them
    from transformers import AutoModelForCausalLM

    if target_cfg.dtype not in TORCH_DTYPES:
        raise ValueError(f"target.dtype must be one of {sorted(TORCH_DTYPES)}, got {target_cfg.dtype!r}")
    path = path or resolve_target_path(target_cfg)
    with naming_target(path):
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=TORCH_DTYPES[target_cfg.dtype], attn_implementation=target_cfg.attn_implementation,
            revision=target_cfg.revision,
        )
    model.requires_grad_(False)
    quantize_target(model, getattr(target_cfg, "quantization", NONE))  # an older recipe.yaml: none
    return model.eval().to(device)


def quantization_meta(target_cfg) -> dict:
    """The feature cache's record of the target's quantization: {"target_quantization": method} for a quantized
    target, {} for a full-precision one (the meta of caches written before the key existed, byte for byte)."""
    name = getattr(target_cfg, "quantization", NONE)
    return {} if name == NONE else {"target_quantization": name}


def served_target_folder(target_cfg, target_path: str, config, work) -> str:
    """The folder vLLM serves for a recipe's target (data.serve, the vLLM capture, the stream producer): its
    dequantized float copy under $EAGLE_HOME when `target.quantization` is set, head_dim-padded under `work` when
    vLLM's CPU attention needs it (engine/quantized_target.py `engine_target`)."""
    t = target_cfg
    model, _ = engine_target(target_path, config, work, getattr(t, "quantization", NONE), t.dtype, default_cache_dir(),
                             t.revision)
    return model


def cache_quantization(manifest: dict) -> str:
    """The quantization of the target a feature cache was written from ("none" when its meta does not say)."""
    return manifest.get("target_quantization", NONE)


def base_decoder(model):
    """The decoder stack whose last_hidden_state feeds lm_head (LlamaForCausalLM.model, etc.)."""
    base = getattr(model, model.base_model_prefix, None)
    if base is None or base is model:
        raise ValueError(f"{type(model).__name__}: cannot find the decoder under {model.base_model_prefix!r}")
    return base
