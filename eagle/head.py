"""The EAGLE-1/2 draft head in the official checkpoint format.

  f_{t+1} = Layer( fc( cat[ embed(tok_{t+1}), f_t ] ) )

`fc` is Linear(2H -> H) (bias optional), `Layer` is ONE Llama decoder layer whose input_layernorm is
removed, there is no final norm, and token logits come from the TARGET's frozen lm_head. The module
names below are the state-dict keys of the released `yuhuili/EAGLE-*` heads, so those load strictly
and our exports load in the reference code.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

CONFIG_NAME = "config.json"
SAFE_WEIGHTS_NAME = "model.safetensors"
LEGACY_WEIGHTS_NAME = "pytorch_model.bin"


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
    extra: dict = field(default_factory=dict)  # unknown keys of a loaded config, written back unchanged

    def __post_init__(self):
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
        n_layers = d.pop("num_hidden_layers", 1)
        if n_layers != 1:
            raise ValueError(f"head config has num_hidden_layers={n_layers}; an EAGLE-1/2 head has exactly 1")
        rope = d.pop("rope_parameters", None) or {}
        if "rope_theta" not in d and "rope_theta" in rope:
            d["rope_theta"] = rope["rope_theta"]
        if d.get("rope_scaling") is None and rope and rope.get("rope_type", "default") != "default":
            d["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
        if "attention_bias" in d and "qkv_bias" not in d:
            d["qkv_bias"] = bool(d["attention_bias"])
        if "dtype" in d and "torch_dtype" not in d:
            d["torch_dtype"] = d["dtype"]
        known = {f.name for f in fields(cls)} - {"extra"}
        missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size") if k not in d]
        if missing:
            raise ValueError(f"head config.json lacks required keys {missing}")
        d.setdefault("num_key_value_heads", d["num_attention_heads"])
        nullable = {"rope_scaling", "head_dim", "pad_token_id", "bos_token_id", "eos_token_id"}
        kwargs = {k: d[k] for k in known if k in d and (d[k] is not None or k in nullable)}
        extra = {k: v for k, v in d.items() if k not in known and k not in ("architectures", "model_type", "dtype")}
        return cls(**kwargs, extra=extra)


def text_config(target_config):
    """The language-model part of a (possibly multimodal) HF config."""
    return target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config


def head_config_from_target(target_config, bias: bool = True) -> HeadConfig:
    """Derive the head's shape from a target's HF config (Llama, Mistral, Mixtral, Qwen2 families)."""
    c = text_config(target_config)
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
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama RMSNorm: normalise in float32, scale in the input dtype (bit-identical to HF's LlamaRMSNorm,
    pinned by a test; torch's rms_norm does the x * rsqrt(mean(x^2) + eps) part in fewer ops)."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def linear_t(x: torch.Tensor, w_t: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x [n, in] @ w_t [in, out] (+ b): a transposed-weight linear as one mm / addmm call (decode paths)."""
    return torch.mm(x, w_t) if b is None else torch.addmm(b, x, w_t)


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
    def __init__(self, c: HeadConfig):
        super().__init__()
        self.n_heads, self.n_kv, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.n_heads * self.head_dim, bias=c.qkv_bias)
        self.k_proj = nn.Linear(c.hidden_size, self.n_kv * self.head_dim, bias=c.qkv_bias)
        self.v_proj = nn.Linear(c.hidden_size, self.n_kv * self.head_dim, bias=c.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, c.hidden_size, bias=False)

    def forward(self, x, cos, sin, mask, is_causal: bool = False):
        B, T, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # [B, h, T, D]
        k = k.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)  # [B, kv, T, D]
        v = v.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B|1, 1, T, D]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
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


class EagleHead(nn.Module):
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
        for name, p in self.named_parameters():
            if name.startswith("embed_tokens"):
                continue
            if name.endswith("layernorm.weight"):
                nn.init.ones_(p)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)
            else:
                nn.init.normal_(p, std=std)

    # -- construction -----------------------------------------------------------------
    @classmethod
    def from_target(cls, target_model, bias: bool = True) -> "EagleHead":
        """A freshly initialised head for `target_model` (HF causal LM), with its embedding copied in."""
        head = cls(head_config_from_target(target_model.config, bias=bias))
        emb = target_model.get_input_embeddings().weight
        head.embed_tokens.weight.data.copy_(emb.detach().to(head.embed_tokens.weight.dtype))
        return head

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

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
    opens (safetensors header / weights-only unpickling) and holds the tensors its config implies."""
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
    with torch.device("meta"):
        expect = {k: tuple(v.shape) for k, v in EagleHead(config).state_dict().items()}
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


def count_parameters(head: EagleHead) -> int:
    """Trainable parameters (the embedding is the target's, frozen)."""
    return sum(p.numel() for n, p in head.named_parameters() if not n.startswith("embed_tokens"))


__all__ = [
    "HeadConfig", "EagleHead", "head_config_from_target", "load_target_embedding_and_lm_head",
    "count_parameters",
]
