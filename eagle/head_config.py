"""The shape of a draft head (`HeadConfig`), as its config.json holds it; what differs per kind is the kind's
(eagle/head_kinds.py)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from pathlib import Path

from eagle.cli_errors import FileFormatError
from eagle.head_kinds import (DEFAULT_KIND, HEAD_KINDS, HeadConfigError, HeadKind, KindOptions, head_kind, kind_of_config,
                              text_config)
from eagle.state_files import StateFile, read_json_state, register


@dataclass
class HeadConfig:
    """Shape of a draft head. Serialised as a LlamaConfig-style `config.json` with num_hidden_layers 1."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # HF rope parameters beyond theta (llama3 / linear / dynamic / yarn ...)
    max_position_embeddings: int = 2048
    bias: bool = True  # fc.bias; released Llama-3 heads say false, Vicuna/Llama-2/Mixtral heads omit the key (= true)
    qkv_bias: bool = False  # Qwen2-style q/k/v projection bias
    hidden_act: str = "silu"
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    torch_dtype: str = "float32"
    kind: str = DEFAULT_KIND.name  # a name in eagle.head_kinds.HEAD_KINDS
    options: KindOptions | None = None  # the kind's own options (`kind.options`, e.g. Eagle3Options); None = its defaults
    extra: dict = field(default_factory=dict)  # unknown keys of a loaded config, written back unchanged

    def __post_init__(self):
        if self.options is None:
            self.options = self.head_kind.options()
        self.head_kind.check_config(self)
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act={self.hidden_act!r}: the EAGLE head uses a SwiGLU (silu) MLP")

    def rope_parameters(self) -> dict:
        """transformers-5 style rope parameters (`rope_type`, `rope_theta`, scaling fields)."""
        params = {"rope_type": "default", "rope_theta": float(self.rope_theta)}
        if self.rope_scaling:
            scaling = dict(self.rope_scaling)
            scaling["rope_type"] = scaling.pop("type", None) or scaling.get("rope_type", "default")
            params.update(scaling)
        return params

    @property
    def head_kind(self) -> HeadKind:
        """The kind object of `kind` (eagle/head_kinds.py)."""
        return head_kind(self.kind)

    def to_dict(self) -> dict:
        """The config.json dict, in the released layout of the head's kind."""
        return self.head_kind.config_dict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "HeadConfig":
        """Read an official head config.json (released heads carry many LlamaConfig keys; unknown ones are kept)."""
        d = dict(d)
        kind = kind_of_config(d)
        n_layers = d.pop("num_hidden_layers", 1)
        if n_layers != 1:
            raise HeadConfigError(f"head config has num_hidden_layers={n_layers}; an EAGLE head has exactly 1")
        options, kind_extra = kind.parse_config(d)
        rope = d.pop("rope_parameters", None) or {}
        if "rope_theta" not in d and "rope_theta" in rope:
            d["rope_theta"] = rope["rope_theta"]
        if d.get("rope_scaling") is None and rope and rope.get("rope_type", "default") != "default":
            d["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
        if "attention_bias" in d and "qkv_bias" not in d:
            d["qkv_bias"] = bool(d["attention_bias"])
        if "dtype" in d and "torch_dtype" not in d:
            d["torch_dtype"] = d["dtype"]
        known = {f.name for f in fields(cls)} - {"extra", "kind", "options"}
        missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size") if k not in d]
        if missing:
            raise ValueError(f"head config.json lacks required keys {missing}")
        d.setdefault("num_key_value_heads", d["num_attention_heads"])
        nullable = {"rope_scaling", "head_dim", "pad_token_id", "bos_token_id", "eos_token_id"}
        kwargs = {k: d[k] for k in known if k in d and (d[k] is not None or k in nullable)}
        extra = {k: v for k, v in d.items() if k not in known and k not in ("architectures", "model_type", "dtype")}
        foreign = [(k, other) for other in HEAD_KINDS.values() if other is not kind for k in other.options.head_keys()
                   if extra.get(k) and k not in kind.options.head_keys()]  # every kind's own (sliding_window) kept
        if foreign:  # e.g. EAGLE-3.1's fc_norm on an EAGLE-2 head: its weights would never be built
            key, other = foreign[0]
            raise HeadConfigError(f"{key}={extra[key]!r}: a setting of an {other.title} head (kind={other.name!r}), "
                                  f"not of this {kind.title} head; set kind={other.name!r} or drop the key")
        return cls(**kwargs, kind=kind.name, options=options, extra={**extra, **kind_extra})


def check_head_fits_target(config: HeadConfig, target_config) -> None:
    """Config-level fit of a head to a target, before any weights load (one-line errors): hidden size and vocabulary,
    and what else the head's kind needs (an EAGLE-3 head's aux layer ids against the target's layer count;
    `bind_target` checks the same on the loaded modules)."""
    config.head_kind.fit_to_target(config, text_config(target_config))


def head_config_from_target(target_config, bias: bool = True, kind: str = DEFAULT_KIND.name,
                            options: KindOptions | None = None, **option_values) -> HeadConfig:
    """Derive the head's shape from a target's HF config (Llama, Mistral, Mixtral, Qwen2 families), with the kind's
    options (`options`, or its defaults updated by `option_values`, e.g. aux_layers=[1, 2, 4]) completed for the target
    (`kind.from_target`: EAGLE-3's default aux layers (2, L//2, L-3), checked against its layer count)."""
    the_kind = head_kind(kind)
    options = the_kind.options(**option_values) if options is None else dataclasses.replace(options, **option_values)
    c = text_config(target_config)
    rope = dict(getattr(c, "rope_parameters", None) or {})
    theta = rope.pop("rope_theta", None) or getattr(c, "rope_theta", 10000.0)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    scaling = rope if rope_type != "default" else getattr(c, "rope_scaling", None)
    qkv_bias = bool(getattr(c, "attention_bias", False)) or c.model_type in ("qwen2", "qwen2_moe")
    shape = dict(
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
        head_dim=getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        vocab_size=c.vocab_size,
        rms_norm_eps=getattr(c, "rms_norm_eps", 1e-6),
        rope_theta=float(theta),
        rope_scaling=dict(scaling) if scaling else None,
        max_position_embeddings=getattr(c, "max_position_embeddings", 2048),
        bias=bias,
        qkv_bias=qkv_bias,
        pad_token_id=getattr(c, "pad_token_id", None),
        bos_token_id=getattr(c, "bos_token_id", None),
        eos_token_id=getattr(c, "eos_token_id", None),
    )
    return HeadConfig(**the_kind.from_target(shape, c.num_hidden_layers, options))


HEAD_CONFIG = register(StateFile(
    "config.json", "HEAD_DIR", writer="eagle/head_module.py (export/engine_formats.py for engine folders)",
    schema={"hidden_size?": int, "transformer_layer_config?": dict, "architectures?": [str], "*": object},
    check=lambda c: None if "hidden_size" in c or "transformer_layer_config" in c else
    "names neither hidden_size (an EAGLE head) nor transformer_layer_config (vLLM's speculators layout)",
    rebuild="export the head again (`python -m train.export --recipe RECIPE --format ...`, or rerun `python "
            "train/main.py --recipe RECIPE`: a finished run only exports), or fetch the released head again",
    example={"hidden_size": 64, "vocab_size": 512, "num_attention_heads": 8}))


def read_head_json(folder: str | Path) -> dict:
    """A head folder's config.json as a dict (official or engine layout), checked to be a head's config."""
    return read_json_state(Path(folder) / HEAD_CONFIG.name, HEAD_CONFIG)


def read_head_config(config_file: str | Path) -> HeadConfig:
    """A head's config.json as a HeadConfig; any problem (JSON, UTF-8, types, values) raises naming the file."""
    raw = read_json_state(config_file, HEAD_CONFIG)
    ints = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size",
            "max_position_embeddings")
    bad = [k for k in ints if k in raw and not (isinstance(raw[k], int) and not isinstance(raw[k], bool) and raw[k] >= 1)]
    if bad:
        raise FileFormatError(f"head config {config_file}: {', '.join(f'{k}={raw[k]!r}' for k in bad)}: expected integers >= 1")
    try:
        config = HeadConfig.from_dict(raw)
        if config.hidden_size % config.num_attention_heads and "head_dim" not in raw:
            raise ValueError(f"hidden_size={config.hidden_size} is not a multiple of "
                             f"num_attention_heads={config.num_attention_heads}")
    except (TypeError, ValueError, ZeroDivisionError) as e:
        raise FileFormatError(f"head config {config_file}: {' '.join(str(e).split())}") from None
    return config
