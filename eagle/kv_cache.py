"""A preallocated KV cache for HF decoder models, compacted in place to the accepted tree path.

All layers' K and V live in ONE [layers, 2, B, kv_heads, capacity, head_dim] tensor allocated once
(at the first write, when the shapes are known); each layer's `keys` / `values` are views into it.
`update` writes the new positions at `length` and returns views of the filled part, so attention
costs what the context costs (no O(n) concatenation per step, no attention over empty capacity).
After tree verification `keep(start, path)` moves the accepted nodes' K/V of every layer next to the
prefix in one gather (per-layer buffers would take two ops per layer, every round).
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class PreallocatedLayer(CacheLayerMixin):
    is_compileable = False
    is_sliding = False

    def __init__(self, owner: "PreallocatedKVCache", index: int):
        super().__init__()
        self.owner = owner
        self.index = index
        self.length = 0

    @property
    def capacity(self) -> int:
        return self.owner.capacity

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        storage = self.owner.allocate(key_states, value_states)  # [layers, 2, B, kv, capacity, D]
        self.keys, self.values = storage[self.index, 0], storage[self.index, 1]
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


class PreallocatedKVCache(Cache):
    """HF `Cache` made of PreallocatedLayer, one per decoder layer, over one shared storage tensor."""

    def __init__(self, num_layers: int, capacity: int):
        super().__init__(layers=[PreallocatedLayer(self, i) for i in range(num_layers)])
        self.capacity = capacity
        self.storage: torch.Tensor | None = None  # [layers, 2, B, kv, capacity, D]

    def allocate(self, key_states: torch.Tensor, value_states: torch.Tensor) -> torch.Tensor:
        """The shared storage, created by the first layer's first write (shapes from its K/V [B, kv, n, D])."""
        B, H, _, D = key_states.shape
        if self.storage is None:
            if value_states.shape[-1] != D:
                raise NotImplementedError(f"keys and values of different head sizes ({D} vs {value_states.shape[-1]})")
            self.storage = torch.zeros(len(self.layers), 2, B, H, self.capacity, D, dtype=key_states.dtype,
                                       device=key_states.device)
        elif self.storage.shape[2:4] != (B, H) or self.storage.shape[-1] != D:
            raise NotImplementedError(
                f"layers with different K/V shapes: {tuple(key_states.shape)} vs storage {tuple(self.storage.shape)}")
        return self.storage

    @property
    def length(self) -> int:
        return self.layers[0].length

    def keep(self, start: int, path: torch.Tensor) -> None:
        """Keep positions start + path[i] at start + i in every layer (path ascending, path[0] = 0); drop
        everything after."""
        n = path.numel()
        if self.storage is not None:
            # the RHS gathers a copy first, so the in-place write is safe
            self.storage[:, :, :, :, start : start + n] = self.storage[:, :, :, :, path + start]
        self.truncate(start + n)

    def truncate(self, length: int) -> None:
        for layer in self.layers:
            layer.length = length

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()
