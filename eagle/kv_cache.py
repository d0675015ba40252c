"""A preallocated KV cache for HF decoder models, compacted in place to the accepted tree path.

Each layer owns [B, kv_heads, capacity, head_dim] buffers allocated once. `update` writes the new
positions at `length` and returns VIEWS of the filled part, so attention costs what the context
costs (no O(n) concatenation per step, no attention over empty capacity). After tree verification
`keep(start, path)` moves the accepted nodes' K/V next to the prefix and drops the rest.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class PreallocatedLayer(CacheLayerMixin):
    is_compileable = False
    is_sliding = False

    def __init__(self, capacity: int):
        super().__init__()
        self.capacity = capacity
        self.length = 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        B, H, _, D = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.keys = torch.zeros(B, H, self.capacity, D, dtype=key_states.dtype, device=key_states.device)
        self.values = torch.zeros(B, H, self.capacity, value_states.shape[-1], dtype=value_states.dtype,
                                  device=value_states.device)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[-2]
        end = self.length + n
        if end > self.capacity:
            raise RuntimeError(f"KV cache overflow: {end} positions > capacity {self.capacity}; raise max_length")
        self.keys[:, :, self.length : end] = key_states
        self.values[:, :, self.length : end] = value_states
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.capacity

    def reset(self) -> None:
        self.length = 0

    def keep(self, start: int, path: torch.Tensor) -> None:
        """Keep positions start + path[i] at start + i (path ascending, path[0] = 0); drop everything after."""
        n = path.numel()
        if self.is_initialized:
            src = path + start  # [n]
            self.keys[:, :, start : start + n] = self.keys[:, :, src]  # RHS gathers a copy first: safe in place
            self.values[:, :, start : start + n] = self.values[:, :, src]
        self.length = start + n


class PreallocatedKVCache(Cache):
    """HF `Cache` made of PreallocatedLayer, one per decoder layer."""

    def __init__(self, num_layers: int, capacity: int):
        super().__init__(layers=[PreallocatedLayer(capacity) for _ in range(num_layers)])
        self.capacity = capacity

    @property
    def length(self) -> int:
        return self.layers[0].length

    def keep(self, start: int, path: torch.Tensor) -> None:
        for layer in self.layers:
            layer.keep(start, path)

    def truncate(self, length: int) -> None:
        for layer in self.layers:
            layer.length = length

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()
