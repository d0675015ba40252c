"""A module-free forward of small dense Llama-family decoders (llama, mistral, qwen2).

Why it exists: on a target as small as stories260K a decode step is dominated by per-module and
per-op overhead (nn.Module dispatch, transformers' attention plumbing, three q/k/v and two gate/up
matmuls), not by arithmetic. This path does the same arithmetic as the HF layers with q|k|v and
gate|up weights concatenated into one matmul each, a rotary table looked up by position, and the
`PreallocatedKVCache` buffers written directly.

Trade-off: the concatenated weights are a second copy of most of the decoder's parameters.
`Target` therefore chooses this path only for targets below `FUSED_MAX_BYTES`, where overhead is
what matters; larger targets run the HF layers (their matmuls dwarf the overhead). The copy is
re-taken at the next `Target.reset` (every generation) when a source parameter was modified in place
or re-allocated (autograd version counter / storage pointer); edits through `param.data` bypass the
version counter, so call `refresh()` after those.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from eagle.attention import bmm_attention, sdpa_attention, use_bmm_attention
from eagle.head_kinds import text_config
from eagle.layers import linear_t, rms_norm, rotate_rolled, rows_at, signed_sin
from eagle.kv_cache import PreallocatedKVCache

FUSED_MAX_BYTES = 256 * 2**20  # decoder parameter bytes up to which the fused copy is worth its memory
FUSED_LAYER_CLASSES = ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer")
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")  # tables that do not depend on the sequence length


@dataclass
class FusedLayer:
    """One decoder layer's weights as the fused forward multiplies them: transposed [in, out] (views of
    contiguous tensors, read by torch.mm / addmm without a per-call transpose)."""

    ln1: torch.Tensor  # [H] input_layernorm weight
    ln2: torch.Tensor  # [H] post_attention_layernorm weight
    w_qkv_t: torch.Tensor  # [H, (h + 2 kv) D]
    b_qkv: torch.Tensor | None  # [(h + 2 kv) D] (Qwen2, Llama attention_bias)
    w_o_t: torch.Tensor  # [h D, H]
    b_o: torch.Tensor | None
    w_gate_up_t: torch.Tensor  # [H, 2 I]
    b_gate_up: torch.Tensor | None  # (Llama mlp_bias)
    w_down_t: torch.Tensor  # [I, H]
    b_down: torch.Tensor | None


def fused_unsupported_reason(model: nn.Module) -> str | None:
    """None when `FusedDecoder` can run `model` exactly; otherwise why not (kept for logs and tests)."""
    cfg = text_config(model.config)
    body = model.get_decoder()
    if not all(hasattr(body, a) for a in ("embed_tokens", "rotary_emb", "layers", "norm")):
        return "decoder is not embed -> rotary -> layers -> norm"
    names = {type(layer).__name__ for layer in body.layers}
    if not names <= set(FUSED_LAYER_CLASSES):
        return f"decoder layers {sorted(names)} are not among {FUSED_LAYER_CLASSES}"
    if getattr(cfg, "hidden_act", "silu") not in ("silu", "swish"):
        return f"hidden_act={cfg.hidden_act!r}"
    rope_type = (getattr(cfg, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES:
        return f"rope_type={rope_type!r} depends on the sequence length"
    packed = sorted({type(p.data).__name__ for p in body.layers.parameters() if type(p.data) is not torch.Tensor})
    if packed:  # packed quantized weights (torchao's tensor subclasses): the HF layers run their own kernels
        return f"decoder weights are {packed} (packed quantized), which the fused copy cannot concatenate"
    size = sum(p.numel() * p.element_size() for p in body.layers.parameters())
    if size > FUSED_MAX_BYTES:
        return f"decoder has {size / 2**20:.0f} MiB of layer weights (> {FUSED_MAX_BYTES / 2**20:.0f} MiB)"
    return None


def _cat_bias(*linears: nn.Linear) -> torch.Tensor | None:
    biases = [lin.bias for lin in linears]
    if all(b is None for b in biases):
        return None
    return torch.cat([b if b is not None else torch.zeros(lin.out_features, dtype=lin.weight.dtype,
                                                          device=lin.weight.device)
                      for b, lin in zip(biases, linears)]).detach()


class FusedDecoder:
    """Same outputs as `model.model(...).last_hidden_state` with a PreallocatedKVCache, fewer ops."""

    def __init__(self, model: nn.Module):
        reason = fused_unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"FusedDecoder cannot run this model: {reason}")
        cfg = text_config(model.config)
        body = model.get_decoder()
        self.body = body
        self._sources = list(body.layers.parameters())
        attn0 = body.layers[0].self_attn
        self.head_dim = attn0.head_dim
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.eps = body.norm.variance_epsilon
        self.layer_eps = [layer.input_layernorm.variance_epsilon for layer in body.layers]
        self._cos = self._sin_signed = None  # [P, D] rotary tables (see head.rotate_rolled), built by `reserve`
        self.refresh()

    def _fingerprint(self) -> tuple:
        return tuple((-1 if p.is_inference() else p._version, p.data_ptr()) for p in self._sources)

    def is_stale(self) -> bool:
        return self._fingerprint() != self._seen

    def refresh(self) -> None:
        """(Re)take the fused copies of the layer weights."""
        body = self.body
        self.layers = []
        with torch.no_grad():
            for layer in body.layers:
                a, m = layer.self_attn, layer.mlp
                self.layers.append(FusedLayer(
                    ln1=layer.input_layernorm.weight.detach(), ln2=layer.post_attention_layernorm.weight.detach(),
                    w_qkv_t=torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).detach().t(),
                    b_qkv=_cat_bias(a.q_proj, a.k_proj, a.v_proj),
                    w_o_t=a.o_proj.weight.detach().t(), b_o=None if a.o_proj.bias is None else a.o_proj.bias.detach(),
                    w_gate_up_t=torch.cat([m.gate_proj.weight, m.up_proj.weight]).detach().t(),
                    b_gate_up=_cat_bias(m.gate_proj, m.up_proj),
                    w_down_t=m.down_proj.weight.detach().t(),
                    b_down=None if m.down_proj.bias is None else m.down_proj.bias.detach(),
                ))
        self._seen = self._fingerprint()

    def reserve(self, positions: int) -> None:
        """Build rotary tables for positions [0, positions) with the model's own rotary module."""
        have = 0 if self._cos is None else self._cos.shape[0]
        if have >= positions:
            return
        positions = max(positions, 2 * have, 256)  # geometric growth: rebuilt O(log n) times
        w = self.body.embed_tokens.weight
        probe = torch.zeros(1, 1, 1, dtype=w.dtype, device=w.device)
        pos = torch.arange(positions, device=w.device)[None]  # [1, P]
        cos, sin = self.body.rotary_emb(probe, pos)  # [1, P, D] each, computed per position (batch-independent)
        self._cos, self._sin_signed = cos[0], signed_sin(sin[0])

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | range, mask: torch.Tensor | None,
                cache: PreallocatedKVCache, capture: tuple[int, ...] | None = None):
        """input_ids [1, n]; positions: a tensor [n] (a tree: every entry < cache.length + n, as node
        depths guarantee) or a `range` of consecutive positions (sliced, no gather); mask additive
        [1, 1, n, past + n] or None (n == 1, full attention). Appends K/V to `cache`; returns normed final
        hidden states [1, n, H]; with `capture` (HF hidden_states ids: the state entering layer j) returns
        (hidden, [1, n, len(capture) H] those states concatenated in the given order)."""
        n = input_ids.shape[1]
        h_, kv_, d_ = self.n_heads, self.n_kv, self.head_dim
        # a tree's positions are < cache.length + n: that bound avoids reading the tensor back (a host sync)
        self.reserve(positions.stop if isinstance(positions, range) else cache.length + n)
        cos, sin = rows_at(positions, self._cos, self._sin_signed)  # [n, D] each
        bmm_bias = None
        if mask is not None and use_bmm_attention(n, d_, mask.dtype):
            bmm_bias = mask[0, 0].repeat(h_ // kv_, 1)  # [g n, past + n]: the mask per query row of a kv group
        x = F.embedding(input_ids[0], self.body.embed_tokens.weight)  # [n, H]: 2-D activations, mm / addmm
        captured = {} if capture else None  # layer id -> the state entering that layer
        for i, (layer, eps, cache_layer) in enumerate(zip(self.layers, self.layer_eps, cache.layers)):
            if captured is not None and i in capture:
                captured[i] = x
            qkv = linear_t(rms_norm(x, layer.ln1, eps), layer.w_qkv_t, layer.b_qkv)  # [n, (h + 2 kv) D]
            qkv = qkv.view(n, h_ + 2 * kv_, d_).transpose(0, 1)  # [h + 2 kv, n, D]
            qk = rotate_rolled(qkv[: h_ + kv_], cos, sin)  # q and k rotate together: [h + kv, n, D]
            k, v = cache_layer.update(qk[None, h_:], qkv[None, h_ + kv_:])  # views [1, kv, past + n, D]
            if bmm_bias is None:
                att = sdpa_attention(qk[None, :h_], k, v, mask)  # [n, h D]
            else:
                att = bmm_attention(qk[None, :h_], k, v, bmm_bias)  # [n, h D]
            x = torch.addmm(x, att, layer.w_o_t)  # residual + o_proj
            if layer.b_o is not None:
                x = x + layer.b_o
            gate, up = linear_t(rms_norm(x, layer.ln2, eps), layer.w_gate_up_t, layer.b_gate_up).chunk(2, dim=-1)
            x = torch.addmm(x, F.silu(gate) * up, layer.w_down_t)  # residual + down_proj
            if layer.b_down is not None:
                x = x + layer.b_down
        out = rms_norm(x, self.body.norm.weight, self.eps)[None]  # [1, n, H]
        if captured is None:
            return out
        return out, torch.cat([captured[i] for i in capture], dim=-1)[None]  # [1, n, 3H]
