"""The building blocks of the draft heads: RMSNorm, rotary embedding (and the rolled form the decode paths use),
attention, SwiGLU MLP and the EAGLE-1/2 decoder layer (a Llama layer without input_layernorm)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from eagle.head_config import HeadConfig


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
        # lazy: transformers' model code costs seconds at import; only building a head needs its rope functions
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

