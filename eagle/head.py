"""The draft heads in their official checkpoint formats: EAGLE-1/2 (`EagleHead`) and EAGLE-3 (`Eagle3Head`).

  f_{t+1} = Layer( fc( cat[ embed(tok_{t+1}), f_t ] ) )

`fc` is Linear(2H -> H) (bias optional), `Layer` is ONE Llama decoder layer whose input_layernorm is
removed, there is no final norm, and token logits come from the TARGET's frozen lm_head. The module
names below are the state-dict keys of the released `yuhuili/EAGLE-*` heads, so those load strictly
and our exports load in the reference code.

EAGLE-3 (`Eagle3Head`, `HeadConfig.kind == "eagle3"`):

  x_t = fc( cat[ a_t^(l1), a_t^(l2), a_t^(l3) ] )              (committed positions: the target's aux layers)
  h   = x + Attn( cat[ input_layernorm(embed(tok)), hidden_norm(x) ] )   (q/k/v read 2H)
  h   = h + MLP(post_attention_layernorm(h))                     (the head's output hidden, pre-norm)
  logits over the DRAFT vocabulary = lm_head(norm(h)); draft id d is target id d + d2t[d]

Drafted nodes take the head's own output hidden h as their feature x. Aux layer ids follow the EAGLE reference
and vLLM: id j = HF `output_hidden_states[j]` = the residual stream ENTERING decoder layer j (0 = embeddings).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

CONFIG_NAME = "config.json"
SAFE_WEIGHTS_NAME = "model.safetensors"
LEGACY_WEIGHTS_NAME = "pytorch_model.bin"
HEAD_KINDS = ("eagle2", "eagle3")
N_AUX_LAYERS = 3  # EAGLE-3 fuses three target layers (low, middle, high): fc is [H, 3H]


class HeadConfigError(ValueError):
    """A head config, checkpoint or target that does not fit: the one-line message names the mismatch."""


def default_aux_layers(num_layers: int) -> list[int]:
    """The common EAGLE-3 default (2, L//2, L-3) for an L-layer target (ids: see `check_aux_layers`)."""
    return [2, num_layers // 2, num_layers - 3]


def check_aux_layers(ids, num_layers: int | None = None) -> list[int]:
    """Validate EAGLE-3 aux layer ids: 3 strictly increasing HF `output_hidden_states` indices, each in [0, L-1]
    (id j = the state ENTERING decoder layer j, 0 = the embeddings; L, the final normed output, is not a valid id)."""
    ids = list(ids)
    if len(ids) != N_AUX_LAYERS or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise HeadConfigError(f"aux_layers={ids}: EAGLE-3 needs exactly {N_AUX_LAYERS} integer layer ids")
    if num_layers is not None:
        bad = [i for i in ids if not 0 <= i < num_layers]
        if bad:
            raise HeadConfigError(
                f"aux layer id(s) {bad} out of range for a {num_layers}-layer target: ids are HF hidden_states indices "
                f"0..{num_layers - 1} (0 = embeddings, j = the input of decoder layer j)")
    elif min(ids) < 0:
        raise HeadConfigError(f"aux_layers={ids}: ids must be >= 0 (HF hidden_states indices, 0 = embeddings)")
    if any(a >= b for a, b in zip(ids, ids[1:])):
        raise HeadConfigError(f"aux_layers={ids} must be strictly increasing (distinct low < middle < high layers)")
    return ids


# ----------------------------------------------------------------------------- config
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
    kind: str = "eagle2"  # "eagle2" (EAGLE-1/2 head) or "eagle3"
    aux_layers: list[int] | None = None  # eagle3: 3 target hidden_states ids (see module docstring); None = target default
    draft_vocab_size: int | None = None  # eagle3: size of the draft vocabulary (None = the full vocabulary)
    extra: dict = field(default_factory=dict)  # unknown keys of a loaded config, written back unchanged

    def __post_init__(self):
        if self.kind not in HEAD_KINDS:
            raise HeadConfigError(f"head kind={self.kind!r}: expected one of {HEAD_KINDS}")
        if self.kind == "eagle2" and (self.aux_layers is not None or self.draft_vocab_size is not None):
            raise HeadConfigError("aux_layers / draft_vocab_size are EAGLE-3 settings: set kind='eagle3'")
        if self.kind == "eagle3":
            self.bias = False  # EAGLE-3's fc has no bias
            if self.draft_vocab_size is None:
                self.draft_vocab_size = self.vocab_size
            if not 1 <= self.draft_vocab_size <= self.vocab_size:
                raise HeadConfigError(f"draft_vocab_size={self.draft_vocab_size} must be in [1, vocab_size={self.vocab_size}]")
            if self.aux_layers is not None:
                self.aux_layers = check_aux_layers(self.aux_layers)
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

    def to_dict(self) -> dict:
        """Official-format config dict (what the reference code reads as a LlamaConfig)."""
        if self.kind == "eagle3":
            return self._eagle3_dict()
        d = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "num_hidden_layers": 1,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": self.hidden_act,
            "bias": self.bias,
            "pad_token_id": self.pad_token_id,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": self.torch_dtype,
        }
        if self.qkv_bias:
            d["qkv_bias"] = True
        return {**self.extra, **d}

    @classmethod
    def from_dict(cls, d: dict) -> "HeadConfig":
        """Read an official head config.json (released heads carry many LlamaConfig keys; unknown ones are kept)."""
        d = dict(d)
        kind = d.pop("kind", None) or ("eagle3" if "draft_vocab_size" in d or any(
            "eagle3" in str(a).lower() for a in d.get("architectures") or []) else "eagle2")
        n_layers = d.pop("num_hidden_layers", 1)
        if n_layers != 1:
            raise HeadConfigError(f"head config has num_hidden_layers={n_layers}; an EAGLE head has exactly 1")
        aux, eagle_config = None, {}
        if kind == "eagle3":
            eagle_config = dict(d.pop("eagle_config", None) or {})
            aux = eagle_config.pop("eagle_aux_hidden_state_layer_ids", None)
            top = d.pop("eagle_aux_hidden_state_layer_ids", None)
            aux = top if aux is None else aux
            eagle_config.pop("use_aux_hidden_state", None)  # always true for EAGLE-3; written back by to_dict
            d.pop("bias", None)  # EAGLE-3's fc has no bias
            d.pop("tie_word_embeddings", None)
            target_h = d.get("target_hidden_size")
            if target_h is not None and target_h != d.get("hidden_size"):
                raise HeadConfigError(f"head config has target_hidden_size={target_h} != hidden_size="
                                      f"{d.get('hidden_size')}: heads narrower than their target are not supported")
        rope = d.pop("rope_parameters", None) or {}
        if "rope_theta" not in d and "rope_theta" in rope:
            d["rope_theta"] = rope["rope_theta"]
        if d.get("rope_scaling") is None and rope and rope.get("rope_type", "default") != "default":
            d["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
        if "attention_bias" in d and "qkv_bias" not in d:
            d["qkv_bias"] = bool(d["attention_bias"])
        if kind == "eagle3":
            d.pop("attention_bias", None)
        if "dtype" in d and "torch_dtype" not in d:
            d["torch_dtype"] = d["dtype"]
        known = {f.name for f in fields(cls)} - {"extra", "kind", "aux_layers"}
        missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size") if k not in d]
        if missing:
            raise ValueError(f"head config.json lacks required keys {missing}")
        d.setdefault("num_key_value_heads", d["num_attention_heads"])
        nullable = {"rope_scaling", "head_dim", "pad_token_id", "bos_token_id", "eos_token_id"}
        kwargs = {k: d[k] for k in known if k in d and (d[k] is not None or k in nullable)}
        extra = {k: v for k, v in d.items() if k not in known and k not in ("architectures", "model_type", "dtype")}
        if kind == "eagle3":
            kwargs.update(kind="eagle3", aux_layers=aux)
            if eagle_config:
                extra["eagle_config"] = eagle_config
        return cls(**kwargs, extra=extra)

    def _eagle3_dict(self) -> dict:
        """The released EAGLE-3 layout (yuhuili/EAGLE3-*, SpecForge): a one-layer LlamaConfig with
        `draft_vocab_size` and `architectures: ["LlamaForCausalLMEagle3"]` (what SGLang requires; vLLM maps it to its
        EAGLE-3 Llama), the aux ids in `eagle_config.eagle_aux_hidden_state_layer_ids` (read by vLLM)."""
        d = {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "num_hidden_layers": 1,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": self.hidden_act,
            "attention_bias": self.qkv_bias,
            "tie_word_embeddings": False,
            "pad_token_id": self.pad_token_id,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "torch_dtype": self.torch_dtype,
        }
        extra = dict(self.extra)
        eagle_config = dict(extra.pop("eagle_config", None) or {})
        if self.aux_layers is not None:
            eagle_config.update(eagle_aux_hidden_state_layer_ids=list(self.aux_layers), use_aux_hidden_state=True)
        if eagle_config:
            d["eagle_config"] = eagle_config
        return {**extra, **d}


def text_config(target_config):
    """The language-model part of a (possibly multimodal) HF config."""
    return target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config


def check_head_fits_target(config: "HeadConfig", target_config) -> None:
    """Config-level fit of a head to a target, before any weights load (one-line errors): hidden size and vocabulary
    (both kinds), and an EAGLE-3 head's aux layer ids against the target's layer count (`bind_target` and
    `EaModel._check_compatible` check the same on the loaded modules)."""
    t = text_config(target_config)
    eagle3 = config.kind == "eagle3"
    if config.hidden_size != t.hidden_size:
        if eagle3:
            raise HeadConfigError(f"EAGLE-3 head hidden_size={config.hidden_size} (fc reads 3 x {config.hidden_size}) "
                                  f"does not fit the target's hidden_size={t.hidden_size}")
        raise HeadConfigError(f"head hidden_size={config.hidden_size} does not match the target's hidden_size={t.hidden_size}")
    vocab = getattr(t, "vocab_size", None)
    if vocab is not None and config.vocab_size != vocab:
        raise HeadConfigError(f"{'EAGLE-3 ' if eagle3 else ''}head vocab_size={config.vocab_size} does not match the "
                              f"target's vocabulary ({vocab})")
    if not eagle3:
        return
    if config.aux_layers is None:
        try:
            check_aux_layers(default_aux_layers(t.num_hidden_layers), t.num_hidden_layers)
        except HeadConfigError as e:
            raise HeadConfigError(f"the head names no aux layers and the default does not fit a "
                                  f"{t.num_hidden_layers}-layer target: {e}") from None
    else:
        check_aux_layers(config.aux_layers, t.num_hidden_layers)


def head_config_from_target(target_config, bias: bool = True, kind: str = "eagle2", aux_layers=None,
                            draft_vocab_size: int | None = None) -> HeadConfig:
    """Derive the head's shape from a target's HF config (Llama, Mistral, Mixtral, Qwen2 families).

    kind="eagle3": aux_layers (None = `default_aux_layers`) are validated against the target's layer count;
    draft_vocab_size None = the full vocabulary; the head is a plain Llama layer (no fc / q/k/v bias)."""
    c = text_config(target_config)
    if kind == "eagle3":
        num_layers = c.num_hidden_layers
        ids = default_aux_layers(num_layers) if aux_layers is None else list(aux_layers)
        try:
            ids = check_aux_layers(ids, num_layers)
        except HeadConfigError as e:
            if aux_layers is not None:
                raise
            raise HeadConfigError(f"the default aux layers {ids} do not fit a {num_layers}-layer target ({e}); "
                                  f"set aux_layers explicitly") from None
        base = head_config_from_target(target_config, bias=False)
        return replace(base, kind="eagle3", qkv_bias=False, aux_layers=ids, draft_vocab_size=draft_vocab_size)
    if kind != "eagle2":
        raise HeadConfigError(f"head kind={kind!r}: expected one of {HEAD_KINDS}")
    rope = dict(getattr(c, "rope_parameters", None) or {})
    theta = rope.pop("rope_theta", None) or getattr(c, "rope_theta", 10000.0)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    scaling = rope if rope_type != "default" else getattr(c, "rope_scaling", None)
    qkv_bias = bool(getattr(c, "attention_bias", False)) or c.model_type in ("qwen2", "qwen2_moe")
    eos = getattr(c, "eos_token_id", None)
    return HeadConfig(
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
        eos_token_id=eos,
    )


# ----------------------------------------------------------------------------- modules
def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """Norms and softmaxes run in at least float32: float32 for 16-bit heads (as HF does), float64 heads stay float64
    (so a float64 copy of a head computes exactly in float64: the tests compare code paths that way)."""
    return torch.promote_types(dtype, torch.float32)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama RMSNorm: normalise in float32, scale in the input dtype (bit-identical to HF's LlamaRMSNorm,
    pinned by a test; torch's rms_norm does the x * rsqrt(mean(x^2) + eps) part in fewer ops)."""
    return weight * F.rms_norm(x.to(accumulation_dtype(x.dtype)), (x.shape[-1],), None, eps).to(x.dtype)


def linear_t(x: torch.Tensor, w_t: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x [n, in] @ w_t [in, out] (+ b): a transposed-weight linear as one mm / addmm call (decode paths)."""
    return torch.mm(x, w_t) if b is None else torch.addmm(b, x, w_t)


def init_head_weights(head: nn.Module, std: float = 0.02) -> None:
    """Fresh-head init of both kinds: norms 1, biases 0, the rest N(0, std); the target's embedding is left alone."""
    for name, p in head.named_parameters():
        if name.startswith("embed_tokens"):
            continue
        if name.endswith("norm.weight"):  # input_layernorm, hidden_norm, post_attention_layernorm, the final norm
            nn.init.ones_(p)
        elif name.endswith(".bias"):
            nn.init.zeros_(p)
        else:
            nn.init.normal_(p, std=std)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Rotary(nn.Module):
    """cos/sin tables indexed by position id; inverse frequencies from transformers' rope functions."""

    def __init__(self, config: HeadConfig):
        super().__init__()
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        lc = LlamaConfig(
            hidden_size=config.hidden_size,
            num_attention_heads=config.num_attention_heads,
            head_dim=config.head_dim,
            max_position_embeddings=config.max_position_embeddings,
            rope_parameters=config.rope_parameters(),
        )
        ref = LlamaRotaryEmbedding(lc)
        self.inv_freq = nn.Buffer(ref.inv_freq.float().clone(), persistent=False)
        self.scaling = float(ref.attention_scaling)
        self._cos = self._sin = self._sin_signed = None

    def tables(self, n: int, device, dtype):
        """cos, sin [P >= n, D] (rows = positions)."""
        if self._cos is None or self._cos.shape[0] < n or self._cos.device != device or self._cos.dtype != dtype:
            size = max(n, 2 * (0 if self._cos is None else self._cos.shape[0]), 256)
            # normal tensors even when first built under inference_mode, so training can reuse them
            with torch.inference_mode(False), torch.no_grad():
                t = torch.arange(size, device=device, dtype=torch.float32)
                freqs = torch.outer(t, self.inv_freq.to(device).clone())  # [P, D/2]
                emb = torch.cat([freqs, freqs], -1)  # [P, D]
                self._cos = (emb.cos() * self.scaling).to(dtype)
                self._sin = (emb.sin() * self.scaling).to(dtype)
                self._sin_signed = signed_sin(self._sin)
        return self._cos, self._sin

    def forward(self, position_ids: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.tables(int(position_ids.max()) + 1, position_ids.device, dtype)
        return cos[position_ids], sin[position_ids]  # [..., T, D]

    def at(self, positions: "torch.Tensor | range | int", device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, signed sin) rows for `rotate_rolled`: [n, D] for a tensor or range of positions, [1, D] for
        one int shared by every row. Ranges and ints are slices (no gather, no host sync)."""
        self.tables(positions_end(positions), device, dtype)
        return rows_at(positions, self._cos, self._sin_signed)


def positions_end(positions: "torch.Tensor | range | int") -> int:
    """One past the largest position (for a tensor this reads it back: a host sync)."""
    if isinstance(positions, int):
        return positions + 1
    return positions.stop if isinstance(positions, range) else int(positions.max()) + 1


def rows_at(positions: "torch.Tensor | range | int", *tables: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Rows of each [P, ...] table at `positions`: an int ([1, ...]) or a range is a slice (no gather, no
    host sync), a tensor [n] a gather."""
    if isinstance(positions, int):
        return tuple(t[positions : positions + 1] for t in tables)
    if isinstance(positions, range):
        return tuple(t[positions.start : positions.stop] for t in tables)
    return tuple(t[positions] for t in tables)


def rotate_half(x):
    """[x1, x2] -> [-x2, x1] over the last dim (rotary embedding)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """[s1, s2] -> [-s1, s2] over the last dim: the sin table `rotate_rolled` multiplies with."""
    s1, s2 = sin.chunk(2, dim=-1)
    return torch.cat((-s1, s2), dim=-1)


def rotate_rolled(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin in 3 ops instead of 6, bit-identical:
    rotate_half(x) * sin = [-x2 s1, x1 s2] = roll(x) * [-s1, s2], and IEEE negation is exact."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin_signed


class Attention(nn.Module):
    def __init__(self, c: HeadConfig, in_features: int | None = None):
        """in_features: width of the q/k/v input (H; 2H in the EAGLE-3 layer)."""
        super().__init__()
        d_in = in_features or c.hidden_size
        self.n_heads, self.n_kv, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(d_in, self.n_heads * self.head_dim, bias=c.qkv_bias)
        self.k_proj = nn.Linear(d_in, self.n_kv * self.head_dim, bias=c.qkv_bias)
        self.v_proj = nn.Linear(d_in, self.n_kv * self.head_dim, bias=c.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, c.hidden_size, bias=False)

    def qkv(self, x, cos, sin):
        """x [B, T, in] -> rotated q [B, h, T, D], rotated k [B, kv, T, D], v [B, kv, T, D]; cos/sin [B|1, T, D]."""
        B, T, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # [B, h, T, D]
        k = k.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)  # [B, kv, T, D]
        v = v.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B|1, 1, T, D]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        return q, k, v

    def forward(self, x, cos, sin, mask, is_causal: bool = False):
        B, T, _ = x.shape
        q, k, v = self.qkv(x, cos, sin)
        # enable_gqa: no copy of K/V per query-head group (a copy would cost O(context) every draft step)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal and mask is None,
                                             enable_gqa=self.n_kv != self.n_heads)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Llama decoder layer WITHOUT input_layernorm (layer 0 of the EAGLE head)."""

    def __init__(self, c: HeadConfig):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, cos, sin, mask, is_causal=False):
        x = x + self.self_attn(x, cos, sin, mask, is_causal)
        return x + self.mlp(self.post_attention_layernorm(x))


class HeadModule(nn.Module):
    """What both head kinds share as modules: dtype and device are those of `fc` (never the frozen embedding)."""

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device


class EagleHead(HeadModule):
    """The draft head. See module docstring for the equation; keys follow the released checkpoints."""

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=None)
        self.embed_tokens.weight.requires_grad_(False)  # the target's frozen embedding
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=config.bias)
        self.layers = nn.ModuleList([DecoderLayer(config)])
        self.rotary = Rotary(config)
        self._init_weights()

    def _init_weights(self, std: float = 0.02) -> None:
        init_head_weights(self, std)

    # -- construction -----------------------------------------------------------------
    @classmethod
    def from_target(cls, target_model, bias: bool = True) -> "EagleHead":
        """A freshly initialised head for `target_model` (HF causal LM), with its embedding copied in."""
        head = cls(head_config_from_target(target_model.config, bias=bias))
        emb = target_model.get_input_embeddings().weight
        head.embed_tokens.weight.data.copy_(emb.detach().to(head.embed_tokens.weight.dtype))
        return head

    def decoder(self, capacity: int, fast: bool | None = None):
        """A `HeadDecoder` (eagle/head_decoder.py): the decoding forward with its own KV cache of `capacity`."""
        from eagle.head_decoder import HeadDecoder

        return HeadDecoder(self, capacity, fast=fast)

    # -- forward ----------------------------------------------------------------------
    def forward(
        self,
        features: torch.Tensor,
        next_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Training forward, causal over the sequence.

        features [B, T, H]: target features f_t;  next_ids [B, T]: the token that follows f_t;
        attention_mask [B, T]: 1 = real token (right or left padding). Returns predicted f_{t+1} [B, T, H].
        """
        B, T, _ = features.shape
        x = self.fc(torch.cat([self.embed_tokens(next_ids).to(features.dtype), features], dim=-1))  # [B, T, H]
        mask = None
        if attention_mask is not None and not bool(attention_mask.all()):
            real = attention_mask.bool()  # [B, T]
            causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()  # [T, T]
            mask = causal[None] & real[:, None, :]  # [B, T, T]
            mask = (mask | torch.eye(T, dtype=torch.bool, device=x.device)[None]).unsqueeze(1)  # pad rows see self
            if position_ids is None:
                position_ids = (real.long().cumsum(-1) - 1).clamp(min=0)  # [B, T]
        if position_ids is None:
            position_ids = torch.arange(T, device=x.device)[None]  # [1, T]
        cos, sin = self.rotary(position_ids, x.dtype)
        return self.layers[0](x, cos, sin, mask, is_causal=mask is None)

    # -- checkpoint I/O ---------------------------------------------------------------
    def official_state_dict(self) -> dict[str, torch.Tensor]:
        """State dict with exactly the released key names (no buffers)."""
        return {k: v.detach().contiguous() for k, v in self.state_dict().items()}

    def save_pretrained(self, save_directory: str | Path, legacy_bin: bool = False, dtype: torch.dtype | None = None):
        """Write config.json + model.safetensors (and pytorch_model.bin when legacy_bin)."""
        from safetensors.torch import save_file

        out = Path(save_directory)
        out.mkdir(parents=True, exist_ok=True)
        sd = self.official_state_dict()
        if dtype is not None:
            sd = {k: v.to(dtype) for k, v in sd.items()}
        cfg = self.config.to_dict()
        cfg["torch_dtype"] = str(next(iter(sd.values())).dtype).replace("torch.", "")
        (out / CONFIG_NAME).write_text(json.dumps(cfg, indent=2) + "\n")
        save_file(sd, str(out / SAFE_WEIGHTS_NAME), metadata={"format": "pt"})
        if legacy_bin:
            torch.save(sd, out / LEGACY_WEIGHTS_NAME)
        return out

    @classmethod
    def from_pretrained(cls, path_or_hub_id: str | Path, dtype: torch.dtype | None = None, revision: str | None = None,
                        device: str | torch.device | None = None) -> "EagleHead":
        """Load a head folder (ours or a released `yuhuili/EAGLE-*`) from a local dir or the Hub, strictly."""
        config_file, weights_file = _resolve_head_files(str(path_or_hub_id), revision)
        config = read_head_config(config_file)
        if config.kind != "eagle2":
            raise HeadConfigError(f"{config_file} describes an EAGLE-3 head: load it with Eagle3Head / load_head")
        sd = _load_weights(weights_file)
        head = cls(config)
        own = set(head.state_dict().keys())
        missing, unexpected = sorted(own - set(sd)), sorted(set(sd) - own)
        if missing or unexpected:
            hint = ""
            if "fc.bias" in missing:
                hint = " (config says bias=true but the checkpoint has no fc.bias: set \"bias\": false)"
            elif "fc.bias" in unexpected:
                hint = " (checkpoint has fc.bias but config says \"bias\": false)"
            raise ValueError(
                f"head checkpoint {weights_file} does not match its config: missing keys {missing}, "
                f"unexpected keys {unexpected}{hint}"
            )
        for k, v in sd.items():
            expect = head.state_dict()[k].shape
            if tuple(v.shape) != tuple(expect):
                raise ValueError(f"head checkpoint {weights_file}: {k} has shape {tuple(v.shape)}, config implies {tuple(expect)}")
        head.load_state_dict(sd, strict=True)
        if dtype is not None:
            head.to(dtype)
        if device is not None:
            head.to(device)
        return head


UNROLL_ROW_CHUNKS = 4  # Eagle3Head.unroll splits the query rows of steps >= 2 into this many causal chunks


def _prefix_diag_attention(q, k1, v1, bias, dk, dv):
    """Attention of training-time-test step j: each query row r attends to the step-1 keys (additive bias masks the
    ones after its index / padding) and to its OWN keys of steps 2..j (the diagonal).
    q [B, h, R, D]; k1, v1 [B, kv, S, D]; bias [B|1, R, S]; dk, dv [B, kv, R, n, D] -> [B, h, R, D]."""
    B, h, R, D = q.shape
    kv, S, n = k1.shape[1], k1.shape[2], dk.shape[3]
    g = h // kv
    qg = q.reshape(B, kv, g * R, D) * (1.0 / math.sqrt(D))  # query heads of a kv group stacked: no K/V copies
    s_prefix = (qg @ k1.transpose(-1, -2)).view(B, kv, g, R, S) + bias[:, None, None]  # [B, kv, g, R, S]
    s_diag = (qg.view(B, kv, g, R, 1, D) * dk[:, :, None]).sum(-1)  # [B, kv, g, R, n]
    s = torch.cat([s_prefix, s_diag], dim=-1)  # [B, kv, g, R, S + n]
    p = s.softmax(-1, dtype=accumulation_dtype(q.dtype)).to(q.dtype)
    o = (p[..., :S].reshape(B, kv, g * R, S) @ v1).view(B, kv, g, R, D)
    o = o + (p[..., S:, None] * dv[:, :, None]).sum(-2)  # + diagonal values
    return o.reshape(B, h, R, D)


class Eagle3Layer(nn.Module):
    """The EAGLE-3 draft layer: attention reads [input_layernorm(embed) ; hidden_norm(feature)] (2H wide), the
    residual stream starts at the feature; then the usual post-attention norm + SwiGLU MLP."""

    def __init__(self, c: HeadConfig):
        super().__init__()
        self.self_attn = Attention(c, in_features=2 * c.hidden_size)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def attn_input(self, emb: torch.Tensor, feat: torch.Tensor) -> torch.Tensor:
        """emb, feat [..., H] -> [..., 2H] (embedding first, as the reference)."""
        return torch.cat([self.input_layernorm(emb), self.hidden_norm(feat)], dim=-1)

    def finish(self, feat: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """Residual + MLP: feat [..., H] + o_proj output [..., H] -> the layer's output hidden [..., H]."""
        x = feat + attn_out
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Head(HeadModule):
    """The EAGLE-3 draft head (see module docstring). Keys follow the released EAGLE-3 checkpoints; `embed_tokens`
    is a frozen copy of the target's, never saved (`bind_target` / `EaModel.from_pretrained` fill it)."""

    def __init__(self, config: HeadConfig):
        super().__init__()
        if config.kind != "eagle3":
            raise HeadConfigError(f"Eagle3Head needs a config with kind='eagle3', got {config.kind!r}")
        self.config = config
        H, V, Vd = config.hidden_size, config.vocab_size, config.draft_vocab_size
        self.embed_tokens = nn.Embedding(V, H)
        self.embed_tokens.weight.requires_grad_(False)  # the target's frozen embedding
        self.fc = nn.Linear(N_AUX_LAYERS * H, H, bias=False)
        self.midlayer = Eagle3Layer(config)
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.lm_head = nn.Linear(H, Vd, bias=False)
        self.d2t = nn.Buffer(torch.zeros(Vd, dtype=torch.long))  # target id = draft id + d2t[draft id]
        self.t2d = nn.Buffer(torch.arange(V) < Vd)  # [V] bool: target token is in the draft vocabulary
        self.rotary = Rotary(config)
        self._init_weights()

    def _init_weights(self, std: float = 0.02) -> None:
        init_head_weights(self, std)

    # -- construction -----------------------------------------------------------------
    @classmethod
    def from_target(cls, target_model, aux_layers=None, draft_vocab_size: int | None = None) -> "Eagle3Head":
        """A freshly initialised EAGLE-3 head for `target_model` (HF causal LM), its embedding copied in; the draft
        vocabulary is the first `draft_vocab_size` target ids until `set_vocab` installs a real one."""
        head = cls(head_config_from_target(target_model.config, kind="eagle3", aux_layers=aux_layers,
                                           draft_vocab_size=draft_vocab_size))
        head.bind_target(target_model)
        return head

    def bind_target(self, target_model) -> "Eagle3Head":
        """Check the head fits `target_model` (layer count, hidden size, vocabulary; resolves aux_layers=None to
        the target default) and copy its input embedding into `embed_tokens`."""
        c, t = self.config, text_config(target_model.config)
        if c.hidden_size != t.hidden_size:
            raise HeadConfigError(f"EAGLE-3 head hidden_size={c.hidden_size} (fc reads 3 x {c.hidden_size}) does not fit "
                                  f"the target's hidden_size={t.hidden_size}")
        emb = target_model.get_input_embeddings().weight
        if emb.shape[0] != c.vocab_size:
            raise HeadConfigError(f"EAGLE-3 head vocab_size={c.vocab_size} does not match the target's vocabulary "
                                  f"({emb.shape[0]})")
        if c.aux_layers is None:
            try:
                c.aux_layers = check_aux_layers(default_aux_layers(t.num_hidden_layers), t.num_hidden_layers)
            except HeadConfigError as e:
                raise HeadConfigError(f"the head names no aux layers and the default does not fit a "
                                      f"{t.num_hidden_layers}-layer target: {e}") from None
        else:
            check_aux_layers(c.aux_layers, t.num_hidden_layers)
        with torch.no_grad():
            self.embed_tokens.weight.copy_(emb.detach().to(self.embed_tokens.weight))
        return self

    def set_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor | None = None) -> None:
        """Install a draft vocabulary: d2t int [Vd] (target id = draft id + d2t[draft id]); t2d bool [V] (derived from
        d2t when None). Checked: lengths, target ids in range and distinct, t2d consistent with d2t."""
        c = self.config
        d2t = torch.as_tensor(d2t).long().flatten().cpu()
        if d2t.numel() != c.draft_vocab_size:
            raise HeadConfigError(f"d2t has {d2t.numel()} entries, draft_vocab_size is {c.draft_vocab_size}")
        target_ids = torch.arange(d2t.numel()) + d2t
        if bool((target_ids < 0).any() | (target_ids >= c.vocab_size).any()):
            raise HeadConfigError(f"d2t maps draft ids outside the target vocabulary [0, {c.vocab_size})")
        derived = torch.zeros(c.vocab_size, dtype=torch.bool).index_fill_(0, target_ids, True)
        if int(derived.sum()) != d2t.numel():
            raise HeadConfigError("d2t maps two draft ids to the same target id")
        if t2d is not None:
            t2d = torch.as_tensor(t2d).bool().flatten().cpu()
            if t2d.numel() != c.vocab_size:
                raise HeadConfigError(f"t2d has {t2d.numel()} entries, the target vocabulary (vocab_size) has {c.vocab_size}")
            if not torch.equal(t2d, derived):
                raise HeadConfigError("t2d does not mark exactly the target ids that d2t maps to")
        self.d2t.copy_(d2t.to(self.d2t.device))
        self.t2d.copy_(derived.to(self.t2d.device))

    def decoder(self, capacity: int, fast: bool | None = None):
        """An `Eagle3HeadDecoder` (eagle/head_decoder.py): the decoding forward with its own KV cache."""
        from eagle.head_decoder import Eagle3HeadDecoder

        return Eagle3HeadDecoder(self, capacity, fast=fast)

    # -- forward ----------------------------------------------------------------------
    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [..., H] (the layer's output, pre-norm) -> logits over the draft vocabulary [..., Vd]."""
        return self.lm_head(self.norm(hidden))

    def map_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft ids [...] -> target ids [...] (draft id + d2t[draft id])."""
        return draft_ids + self.d2t[draft_ids]

    def unroll(self, aux: torch.Tensor, next_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
               steps: int = 1, rows: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Training forward with the training-time test: the head unrolled `steps` times over every position.

        aux [B, T, 3H]: the target's aux-layer states at position t; next_ids [B, T]: the token after position t;
        attention_mask [B, T] (1 = real token; right or left padding). Returns `steps` hiddens (pre-norm):
        step 1 [B, T, H] at index t reads (fc(aux_t), embed(next_ids[t])) at position t, causal over step-1 keys;
        step j >= 2 [B, R, H] at index t reads (its own step j-1 hidden, embed(next_ids[t + j - 1])) at position
        t + j - 1 and attends to the step-1 keys at indices <= t plus its own steps 2..j (the diagonal): exactly what
        decoding sees for a drafted chain. Step j's output at t predicts the token at t + j + 1; indices where
        t + j - 1 runs off the sequence read a pad token and must be masked by the caller.
        rows [R] (sorted indices, None = all T): steps >= 2 are computed only at these indices (a cost knob: each
        such step costs one [R, T] score matrix against the cached step-1 keys plus j - 1 diagonal products).
        """
        if steps < 1:
            raise ValueError(f"steps={steps}: must be >= 1")
        B, T, _ = aux.shape
        layer, attn = self.midlayer, self.midlayer.self_attn
        dev, dt = aux.device, aux.dtype
        feat = self.fc(aux)  # [B, T, H]
        emb = self.embed_tokens(next_ids).to(dt)  # [B, T, H]
        real = None if attention_mask is None or bool(attention_mask.all()) else attention_mask.bool()  # [B, T]
        pos = torch.arange(T, device=dev)[None] if real is None else (real.long().cumsum(-1) - 1).clamp(min=0)  # [B|1, T]
        mask = None
        if real is not None:
            causal = torch.ones(T, T, dtype=torch.bool, device=dev).tril()  # [T, T]
            mask = causal[None] & real[:, None, :] | torch.eye(T, dtype=torch.bool, device=dev)[None]  # pad rows see self
            mask = mask.unsqueeze(1)  # [B, 1, T, T]
        cos, sin = self.rotary(pos, dt)
        q, k1, v1 = attn.qkv(layer.attn_input(emb, feat), cos, sin)  # [B, h, T, D], [B, kv, T, D] x 2
        out = F.scaled_dot_product_attention(q, k1, v1, attn_mask=mask, is_causal=mask is None,
                                             enable_gqa=attn.n_kv != attn.n_heads)  # [B, h, T, D]
        hidden = layer.finish(feat, attn.o_proj(out.transpose(1, 2).reshape(B, T, -1)))  # [B, T, H]
        hiddens = [hidden]
        if steps == 1:
            return hiddens
        h_, kv_, D = attn.n_heads, attn.n_kv, attn.head_dim
        idx = torch.arange(T, device=dev) if rows is None else rows.to(dev)  # [R]
        R = idx.numel()
        # row chunks: chunk c reads step-1 keys [0, end_c) only (causality), ~(1 + 1/n) / 2 of the full score matrix
        bounds = [(c * R // UNROLL_ROW_CHUNKS, (c + 1) * R // UNROLL_ROW_CHUNKS) for c in range(UNROLL_ROW_CHUNKS)]
        bounds = [(lo, hi) for lo, hi in bounds if hi > lo]
        ends = (idx[torch.tensor([hi - 1 for _, hi in bounds], device=dev)] + 1).tolist()  # one host sync per unroll
        visible = torch.arange(T, device=dev)[None, :] <= idx[:, None]  # [R, T] step-1 keys at indices <= t
        visible = visible[None] if real is None else visible[None] & real[:, None, :]  # [B|1, R, T]
        bias = torch.zeros(visible.shape, dtype=dt, device=dev).masked_fill_(~visible, torch.finfo(dt).min)
        ids_ext = torch.cat([next_ids, next_ids.new_zeros(B, steps - 1)], dim=1)  # [B, T + steps - 1]
        pos_r = pos[:, idx]  # [B|1, R]
        prev = hidden if rows is None else hidden[:, idx]  # [B, R, H]
        # k1/v1 are transposed views of the projections ([B, T, kv, D] underneath): with B > 1 every prefix slice
        # below would be copied by matmul (per chunk and per step, and kept for backward); one copy serves them all
        k1, v1 = k1.contiguous(), v1.contiguous()  # [B, kv, T, D]
        diag_k, diag_v = [], []  # per step >= 2: [B, kv, R, D]
        for j in range(2, steps + 1):
            tok_emb = self.embed_tokens(ids_ext[:, idx + j - 1]).to(dt)  # [B, R, H]
            cos, sin = self.rotary(pos_r + j - 1, dt)
            q, k, v = attn.qkv(layer.attn_input(tok_emb, prev), cos, sin)  # [B, h, R, D], [B, kv, R, D] x 2
            diag_k.append(k)
            diag_v.append(v)
            dk, dv = torch.stack(diag_k, dim=-2), torch.stack(diag_v, dim=-2)  # [B, kv, R, j - 1, D]
            o = torch.cat([_prefix_diag_attention(q[:, :, lo:hi], k1[:, :, :end], v1[:, :, :end],
                                                  bias[:, lo:hi, :end], dk[:, :, lo:hi], dv[:, :, lo:hi])
                           for (lo, hi), end in zip(bounds, ends)], dim=2)  # [B, h, R, D]
            prev = layer.finish(prev, attn.o_proj(o.transpose(1, 2).reshape(B, R, h_ * D)))  # [B, R, H]
            hiddens.append(prev)
        return hiddens

    def forward(self, aux: torch.Tensor, next_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                steps: int = 1, rows: torch.Tensor | None = None) -> list[torch.Tensor]:
        """= `unroll` (so a DeepSpeed engine wrapping the head runs it through its forward hooks)."""
        return self.unroll(aux, next_ids, attention_mask, steps=steps, rows=rows)

    # -- checkpoint I/O ---------------------------------------------------------------
    def official_state_dict(self) -> dict[str, torch.Tensor]:
        """The released EAGLE-3 keys: everything but the target's embedding (d2t int64, t2d bool included)."""
        return {k: v.detach().contiguous() for k, v in self.state_dict().items() if not k.startswith("embed_tokens")}

    def save_pretrained(self, save_directory: str | Path, legacy_bin: bool = False, dtype: torch.dtype | None = None):
        """Write config.json + model.safetensors (and pytorch_model.bin when legacy_bin) in the released layout."""
        from safetensors.torch import save_file

        out = Path(save_directory)
        out.mkdir(parents=True, exist_ok=True)
        sd = self.official_state_dict()
        if dtype is not None:
            sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}
        cfg = self.config.to_dict()
        cfg["torch_dtype"] = str(sd["fc.weight"].dtype).replace("torch.", "")
        (out / CONFIG_NAME).write_text(json.dumps(cfg, indent=2) + "\n")
        save_file(sd, str(out / SAFE_WEIGHTS_NAME), metadata={"format": "pt"})
        if legacy_bin:
            torch.save(sd, out / LEGACY_WEIGHTS_NAME)
        return out

    @classmethod
    def from_pretrained(cls, path_or_hub_id: str | Path, dtype: torch.dtype | None = None, revision: str | None = None,
                        device: str | torch.device | None = None) -> "Eagle3Head":
        """Load an EAGLE-3 head folder (ours, or the released / SpecForge layout). `embed_tokens` is loaded when the
        checkpoint has it, else stays empty until `bind_target`; `t2d` is derived from `d2t` when absent, and both may
        be absent only for a full draft vocabulary."""
        config_file, weights_file = _resolve_head_files(str(path_or_hub_id), revision)
        config = read_head_config(config_file)
        if config.kind != "eagle3":
            raise HeadConfigError(f"{config_file} describes an EAGLE-1/2 head: load it with EagleHead / load_head")
        return cls.from_state_dict(config, _load_weights(weights_file), str(weights_file), dtype=dtype, device=device)

    @classmethod
    def from_state_dict(cls, config: HeadConfig, sd: dict[str, torch.Tensor], source: str = "state dict",
                        dtype: torch.dtype | None = None, device=None) -> "Eagle3Head":
        """Build a head from released-layout tensors, checking every key and shape (one-line errors)."""
        head = cls(config)
        sd = dict(sd)
        d2t, t2d = sd.pop("d2t", None), sd.pop("t2d", None)
        if d2t is None and config.draft_vocab_size != config.vocab_size:
            raise HeadConfigError(f"{source} has no d2t but draft_vocab_size={config.draft_vocab_size} < "
                                  f"vocab_size={config.vocab_size}")
        own = {k: v for k, v in head.state_dict().items() if k not in ("d2t", "t2d")}
        optional = {"embed_tokens.weight"}
        missing, unexpected = sorted(set(own) - set(sd) - optional), sorted(set(sd) - set(own))
        if missing or unexpected:
            raise HeadConfigError(f"EAGLE-3 checkpoint {source} does not match its config: missing keys {missing}, "
                                  f"unexpected keys {unexpected}")
        for k, v in sd.items():
            if tuple(v.shape) != tuple(own[k].shape):
                raise HeadConfigError(f"EAGLE-3 checkpoint {source}: {k} has shape {tuple(v.shape)}, config implies "
                                      f"{tuple(own[k].shape)}")
        head.load_state_dict(sd, strict=False)
        if d2t is not None:
            head.set_vocab(d2t, t2d)
        if dtype is not None:
            head.to(dtype)
        if device is not None:
            head.to(device)
        return head


def head_class(config: HeadConfig) -> type:
    """The module class of a head config: `EagleHead` (kind eagle2) or `Eagle3Head` (kind eagle3)."""
    return Eagle3Head if config.kind == "eagle3" else EagleHead


def load_head(path_or_hub_id: str | Path, dtype: torch.dtype | None = None, revision: str | None = None,
              device: str | torch.device | None = None) -> "EagleHead | Eagle3Head":
    """Load any head folder, dispatching on its config: EAGLE-1/2 -> `EagleHead`, EAGLE-3 -> `Eagle3Head` (call
    `bind_target` on an EAGLE-3 head before use: its embedding is the target's)."""
    config_file, _ = _resolve_head_files(str(path_or_hub_id), revision)
    cls = head_class(read_head_config(config_file))
    return cls.from_pretrained(path_or_hub_id, dtype=dtype, revision=revision, device=device)


def _resolve_head_files(path_or_hub_id: str, revision: str | None) -> tuple[str, str]:
    p = Path(path_or_hub_id)
    if p.is_dir():
        cfg = p / CONFIG_NAME
        if not cfg.exists():
            raise FileNotFoundError(f"head folder {p} has no {CONFIG_NAME}")
        for name in (SAFE_WEIGHTS_NAME, LEGACY_WEIGHTS_NAME):
            if (p / name).exists():
                return str(cfg), str(p / name)
        raise FileNotFoundError(f"head folder {p} has neither {SAFE_WEIGHTS_NAME} nor {LEGACY_WEIGHTS_NAME}")
    if p.exists():
        raise ValueError(f"{p} is a file; pass the head folder (config.json + weights)")
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        cfg = hf_hub_download(path_or_hub_id, CONFIG_NAME, revision=revision)
        try:
            weights = hf_hub_download(path_or_hub_id, SAFE_WEIGHTS_NAME, revision=revision)
        except EntryNotFoundError:
            weights = hf_hub_download(path_or_hub_id, LEGACY_WEIGHTS_NAME, revision=revision)
    except Exception as e:  # network / auth / missing repo: say what we tried
        raise OSError(f"could not load head {path_or_hub_id!r}: not a local folder, and the Hub download failed: {e}") from e
    return cfg, weights


def check_head_files(path_or_hub_id: str | Path, revision: str | None = None) -> HeadConfig:
    """Cheap pre-flight check of a head folder before a target is loaded: config.json parses, the weights file
    opens (safetensors header / weights-only unpickling) and holds the tensors its config implies (EAGLE-1/2 or
    EAGLE-3 layout, by the config's kind)."""
    from eagle.cli_errors import FileFormatError

    config_file, weights_file = _resolve_head_files(str(path_or_hub_id), revision)
    config = read_head_config(config_file)
    if weights_file.endswith(".safetensors"):
        from safetensors import SafetensorError, safe_open

        from eagle.cli_errors import file_error

        try:
            with safe_open(weights_file, "pt") as f:
                shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        except SafetensorError as e:
            raise file_error(weights_file, e, "head weights") from None
    else:
        shapes = {k: tuple(v.shape) for k, v in _load_weights(weights_file).items()}
    cls = head_class(config)
    with torch.device("meta"):
        expect = {k: tuple(v.shape) for k, v in cls(config).state_dict().items()}
    if cls is Eagle3Head:  # as Eagle3Head.from_state_dict: the target's embedding and t2d may be absent (d2t too
        optional = {"embed_tokens.weight", "t2d"}  # for a full draft vocabulary)
        if config.draft_vocab_size == config.vocab_size:
            optional.add("d2t")
        expect = {k: v for k, v in expect.items() if k in shapes or k not in optional}
    if shapes != expect:
        diff = sorted(k for k in set(shapes) | set(expect) if shapes.get(k) != expect.get(k))
        raise FileFormatError(f"head weights {weights_file} do not match {config_file}: {diff[:4]} "
                              f"(file {[shapes.get(k) for k in diff[:4]]}, config {[expect.get(k) for k in diff[:4]]})")
    return config


def read_head_config(config_file: str | Path) -> HeadConfig:
    """A head's config.json as a HeadConfig; any problem (JSON, UTF-8, types, values) raises naming the file."""
    from eagle.cli_errors import FileFormatError, file_error

    try:
        raw = json.loads(Path(config_file).read_bytes().decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise file_error(config_file, e, "head config") from None
    if not isinstance(raw, dict):
        raise FileFormatError(f"head config {config_file}: expected a JSON object, got {type(raw).__name__}")
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


def _load_weights(weights_file: str) -> dict[str, torch.Tensor]:
    """The head's tensors: safetensors, or a legacy .bin through the weights-only unpickler (never runs code)."""
    import pickle

    from eagle.cli_errors import file_error

    if weights_file.endswith(".safetensors"):
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(weights_file)
        except SafetensorError as e:
            raise file_error(weights_file, e, "head weights") from None
    try:
        sd = torch.load(weights_file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        raise file_error(weights_file, e, "head weights") from None
    except (RuntimeError, EOFError) as e:  # not a torch file / truncated zip
        raise file_error(weights_file, e, "head weights") from None
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        from eagle.cli_errors import FileFormatError

        raise FileFormatError(f"head weights {weights_file}: expected a mapping of tensor names to tensors")
    return sd


# ----------------------------------------------------------------------------- target's frozen tensors
EMBED_KEYS = ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight", "transformer.wte.weight")
LM_HEAD_KEYS = ("lm_head.weight", "model.lm_head.weight")


def load_target_embedding_and_lm_head(target_path: str | Path, revision: str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Read ONLY the target's input embedding and lm_head ([V, H] each) from its weight shards.

    Works on a local HF folder or a hub id (downloads the index and only the shards holding these two
    tensors). Tied embeddings (no lm_head tensor) return the embedding twice.
    """
    files = _target_weight_index(str(target_path), revision)  # {tensor name: local shard path (lazy)}
    emb_key = next((k for k in EMBED_KEYS if k in files), None)
    if emb_key is None:
        raise KeyError(f"target {target_path}: no embedding tensor among {EMBED_KEYS}")
    head_key = next((k for k in LM_HEAD_KEYS if k in files), None)
    emb = _read_tensor(files[emb_key](), emb_key)
    lm = _read_tensor(files[head_key](), head_key) if head_key else emb
    return emb, lm


def _target_weight_index(target: str, revision: str | None) -> dict:
    local = Path(target)
    if local.is_dir():
        fetch = lambda name: str(local / name)  # noqa: E731
        exists = lambda name: (local / name).exists()  # noqa: E731
    else:
        from huggingface_hub import hf_hub_download

        def fetch(name):
            return hf_hub_download(target, name, revision=revision)

        def exists(name):
            try:
                fetch(name)
                return True
            except Exception:  # absent file on the Hub (or no network): try the next layout
                return False

    for index_name, single in (("model.safetensors.index.json", "model.safetensors"),
                               ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        if exists(index_name):
            wm = json.loads(Path(fetch(index_name)).read_text())["weight_map"]
            return {k: (lambda f=f: fetch(f)) for k, f in wm.items()}
        if exists(single):
            path = fetch(single)
            keys = _tensor_names(path)
            return {k: (lambda p=path: p) for k in keys}
    raise FileNotFoundError(f"target {target}: no model.safetensors[.index.json] or pytorch_model.bin[.index.json] found")


def _tensor_names(path: str) -> list[str]:
    if path.endswith(".safetensors"):
        from safetensors import safe_open

        with safe_open(path, "pt") as f:
            return list(f.keys())
    return list(torch.load(path, map_location="cpu", weights_only=True, mmap=True).keys())


def _read_tensor(path: str, key: str) -> torch.Tensor:
    if path.endswith(".safetensors"):
        from safetensors import safe_open

        with safe_open(path, "pt") as f:
            return f.get_tensor(key)
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)[key].clone()


def count_parameters(head: "EagleHead | Eagle3Head") -> int:
    """Trainable parameters (the embedding is the target's, frozen)."""
    return sum(p.numel() for n, p in head.named_parameters() if not n.startswith("embed_tokens"))


__all__ = [
    "HeadConfig", "HeadConfigError", "EagleHead", "Eagle3Head", "load_head", "head_class", "head_config_from_target",
    "check_aux_layers", "default_aux_layers", "load_target_embedding_and_lm_head",
    "count_parameters",
]
