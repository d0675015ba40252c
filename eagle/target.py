"""The target adapter: one HF causal LM, its final features AND logits, a preallocated KV cache,
tree verification in one forward (tree mask + per-node position ids).

Never mutates the wrapped model: the cache is passed to every forward call.
"""
from __future__ import annotations

import inspect

import torch
from torch import nn

from eagle.fused_decoder import FusedDecoder, fused_unsupported_reason
from eagle.head_kinds import text_config
from eagle.kv_cache import PreallocatedKVCache

SUPPORTED_FAMILIES = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe")


def cache_kwarg(module: nn.Module) -> str:
    """The keyword under which `module.forward` takes the KV cache in the installed transformers: `cache` in
    recent 5.x releases (where `past_key_values` is deprecated, to be removed in 5.40: it would then land in
    **kwargs and the cache would silently go unused), `past_key_values` in earlier ones."""
    params = inspect.signature(module.forward).parameters  # follows the deprecation wrappers' __wrapped__
    return "cache" if "cache" in params else "past_key_values"


class Target:
    """Wraps `AutoModelForCausalLM`: `forward` returns final hidden states (the LM-head input)."""

    def __init__(self, model: nn.Module, capacity: int, fused: bool | None = None):
        """fused: use `FusedDecoder` (None = whenever it supports the model; see eagle/fused_decoder.py)."""
        cfg = text_config(model.config)
        impl = getattr(model.config, "_attn_implementation", None)
        if impl not in ("sdpa", "eager", None):
            raise ValueError(
                f"target uses attn_implementation={impl!r}; tree verification supports 'sdpa' (fastest) and 'eager'"
            )
        self.model = model
        self.config = cfg
        self.body = model.get_decoder()
        self.lm_head = model.get_output_embeddings()
        self.embed_tokens = model.get_input_embeddings()
        self.num_layers = cfg.num_hidden_layers
        self.vocab_size = self.lm_head.weight.shape[0]
        self.hidden_size = cfg.hidden_size
        self.sliding_window = self._uniform_sliding_window(cfg)
        self.cache = PreallocatedKVCache(self.num_layers, capacity)
        # Families whose decoder is embed -> rotary -> layers -> norm with `layer(h, ...) -> h`: we drive the
        # layers directly, skipping the model-level mask construction and wrappers (a large share of a
        # decode step on small targets). Other architectures go through the model's own forward.
        self.direct_layers = cfg.model_type in SUPPORTED_FAMILIES and all(
            hasattr(self.body, a) for a in ("embed_tokens", "rotary_emb", "layers", "norm"))
        self._cache_kw = cache_kwarg(self.body.layers[0] if self.direct_layers else self.body)  # chosen once
        # Small dense targets: one module-free forward with fused weights (chosen once, here).
        reason = fused_unsupported_reason(model) if self.direct_layers else "not a supported family"
        if fused and reason is not None:
            raise ValueError(f"fused=True but FusedDecoder cannot run this target: {reason}")
        self.fused = FusedDecoder(model) if (fused is not False and reason is None) else None

    @staticmethod
    def _uniform_sliding_window(cfg) -> int | None:
        window = getattr(cfg, "sliding_window", None)
        layer_types = getattr(cfg, "layer_types", None)
        if not window:
            return None
        if layer_types is None or all(t == "sliding_attention" for t in layer_types):
            return int(window)
        if all(t != "sliding_attention" for t in layer_types):
            return None
        raise NotImplementedError("targets mixing sliding-window and full-attention layers are not supported yet")

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    @property
    def length(self) -> int:
        """Positions held in the KV cache."""
        return self.cache.length

    def reset(self, capacity: int | None = None) -> None:
        if capacity is not None and capacity > self.cache.capacity:
            self.cache = PreallocatedKVCache(self.num_layers, capacity)
        if self.fused is not None:
            if self.fused.is_stale():  # the model's weights were edited since the fused copy was taken
                self.fused.refresh()
            if capacity is not None:
                self.fused.reserve(capacity)
        self.cache.reset()

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None,
                tree_mask: torch.Tensor | None = None, aux_layers: tuple[int, ...] | None = None):
        """Run n new tokens after the cached prefix and append their K/V.

        input_ids [1, n]; position_ids [n] (default: consecutive after the prefix);
        tree_mask [n, n] bool among the new tokens (default: causal). Returns hidden [1, n, H].
        aux_layers (EAGLE-3 drafting): HF `output_hidden_states` indices (j = the state entering decoder layer j);
        then returns (hidden [1, n, H], aux [1, n, len(aux_layers) H]: those states concatenated in the given order).
        """
        n = input_ids.shape[1]
        past = self.cache.length
        mask = None
        if n > 1 or self.sliding_window is not None:
            mask = self._mask(past, n, position_ids, tree_mask)
        if self.fused is not None:
            positions = range(past, past + n) if position_ids is None else position_ids
            return self.fused.forward(input_ids, positions, mask, self.cache, capture=aux_layers)
        if position_ids is None:
            position_ids = torch.arange(past, past + n, device=input_ids.device)
        if not self.direct_layers:
            out = self.body(input_ids=input_ids, position_ids=position_ids[None], attention_mask=mask,
                            use_cache=True, output_hidden_states=aux_layers is not None, **{self._cache_kw: self.cache})
            if aux_layers is None:
                return out.last_hidden_state
            return out.last_hidden_state, torch.cat([out.hidden_states[i] for i in aux_layers], dim=-1)
        pos = position_ids[None]  # [1, n]
        h = self.body.embed_tokens(input_ids)  # [1, n, H]
        rope = self.body.rotary_emb(h, pos)
        captured = {} if aux_layers else None  # layer id -> the state entering that layer
        for i, layer in enumerate(self.body.layers[: self.num_layers]):
            if captured is not None and i in aux_layers:
                captured[i] = h
            h = layer(h, attention_mask=mask, position_ids=pos, use_cache=True, position_embeddings=rope,
                      **{self._cache_kw: self.cache})
        if captured is None:
            return self.body.norm(h)
        return self.body.norm(h), torch.cat([captured[i] for i in aux_layers], dim=-1)

    def _mask(self, past: int, n: int, position_ids: torch.Tensor | None,
              tree_mask: torch.Tensor | None) -> torch.Tensor:
        """Additive float mask [1, 1, n, past + n]: read the same way by sdpa and eager (a bool mask is
        misread by eager), and sdpa does not have to convert it again in every layer."""
        dev = self.device
        if tree_mask is None:
            tree_mask = torch.ones(n, n, dtype=torch.bool, device=dev).tril()  # [n, n] causal
        mask = torch.zeros(n, past + n, dtype=self.dtype, device=dev)  # [n, past + n]: the prefix is visible
        mask[:, past:].masked_fill_(~tree_mask, torch.finfo(self.dtype).min)
        if self.sliding_window is not None:
            if position_ids is None:
                position_ids = torch.arange(past, past + n, device=dev)
            key_pos = torch.cat([torch.arange(past, device=dev), position_ids])  # [past + n]
            mask.masked_fill_((position_ids[:, None] - key_pos[None, :]) >= self.sliding_window,
                              torch.finfo(self.dtype).min)
        return mask[None, None]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head on features [..., H] -> float32 logits [..., V]."""
        return self.lm_head(hidden).float()

    def keep(self, start: int, path: torch.Tensor) -> None:
        """Compact the KV cache to the accepted tree path (node indices relative to `start`)."""
        self.cache.keep(start, path)

    def truncate(self, length: int) -> None:
        self.cache.truncate(length)
