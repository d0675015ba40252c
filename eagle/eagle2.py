"""The EAGLE-1/2 draft head (`EagleHead`) in the official checkpoint format of the released yuhuili/EAGLE-* heads.

  f_{t+1} = Layer( fc( cat[ embed(tok_{t+1}), f_t ] ) )

`fc` is Linear(2H -> H) (bias optional), `Layer` is ONE Llama decoder layer whose input_layernorm is
removed, there is no final norm, and token logits come from the TARGET's frozen lm_head. The module
names below are the state-dict keys of the released `yuhuili/EAGLE-*` heads, so those load strictly
and our exports load in the reference code.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from eagle.head_checks import layout_problems
from eagle.head_config import HeadConfig, head_config_from_target
from eagle.head_decoder import HeadDecoder
from eagle.head_files import load_weights, resolve_head_files, read_head_config
from eagle.head_kinds import EAGLE2, HeadConfigError
from eagle.head_module import HeadModule
from eagle.layers import DecoderLayer, Rotary, init_head_weights
from eagle.sliding_window import window_size
from eagle.unroll import causal_attention, padded_positions, unroll_self_fed


class EagleHead(HeadModule, kind=EAGLE2):
    """The EAGLE-1/2 draft head. See the module docstring for the equation; keys follow the released checkpoints."""

    def __init__(self, config: HeadConfig):
        super().__init__()
        self.check_kind(config)
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

    def decoder(self, capacity: int, fast: bool | None = None, lm_head: nn.Module | None = None) -> HeadDecoder:
        """A `HeadDecoder` (eagle/head_decoder.py): the decoding forward with its own KV cache of `capacity`; it
        scores drafts through `lm_head` (the target's)."""
        return HeadDecoder(self, capacity, fast=fast, lm_head=lm_head)

    # -- forward ----------------------------------------------------------------------
    def forward(
        self,
        features: torch.Tensor,
        next_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        steps: int | None = None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor | list[torch.Tensor]:
        """Training forward, causal over the sequence.

        features [B, T, H]: target features f_t;  next_ids [B, T]: the token that follows f_t;
        attention_mask [B, T]: 1 = real token (right or left padding). Returns predicted f_{t+1} [B, T, H].
        steps (int): `unroll(features, next_ids, attention_mask, steps, rows)` instead (a list of hiddens), so a
        DeepSpeed engine wrapping the head runs the unrolled training through its forward hooks.
        """
        if steps is not None:
            return self.unroll(features, next_ids, attention_mask, steps=steps, rows=rows)
        B, T, _ = features.shape
        x = self.fc(torch.cat([self.embed_tokens(next_ids).to(features.dtype), features], dim=-1))  # [B, T, H]
        window = window_size(self.config.options)
        if window is not None:  # eagle/sliding_window.py: query blocks against their window, no [T, T] mask
            real, pos, _ = padded_positions(attention_mask, T, x.device)
            pos = pos if position_ids is None else position_ids
            attn = self.layers[0].self_attn
            q, k, v = attn.qkv(x, *self.rotary(pos, x.dtype))
            out = causal_attention(q, k, v, None, pos, real, window)  # [B, h, T, D]
            return self._finish(x, attn.o_proj(out.transpose(1, 2).reshape(B, T, -1)))
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

    def unroll(self, features: torch.Tensor, next_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
               steps: int = 1, rows: torch.Tensor | None = None) -> list[torch.Tensor]:
        """Training forward with HASS-style multi-step alignment: the head unrolled `steps` times on its own features.

        Step 1 [B, T, H] = `forward` (index t reads the true f_t and x_{t+1}; predicts f_{t+1}). Step j >= 2
        [B, R, H] at index t reads ITS OWN step j-1 prediction (of f_{t+j-1}) with the data's token x_{t+j} at
        position t + j - 1, and attends to the step-1 keys at indices <= t plus its own steps 2..j: the context a
        drafted chain sees when decoding (eagle/unroll.py). Step j's output at t predicts f_{t+j}; indices where
        t + j - 1 runs off the sequence must be masked by the caller. rows [R] (sorted, None = all T): the indices
        where steps >= 2 run. steps = 1 is `forward` itself (the plain EAGLE-2 training, bit for bit).
        """
        if steps < 1:
            raise ValueError(f"steps={steps}: must be >= 1")
        if steps == 1:
            return [self(features, next_ids, attention_mask)]
        B, T, _ = features.shape
        layer, attn = self.layers[0], self.layers[0].self_attn
        dev, dt = features.device, features.dtype
        x = self.fc(torch.cat([self.embed_tokens(next_ids).to(dt), features], dim=-1))  # [B, T, H]
        real, pos, mask = padded_positions(attention_mask, T, dev)  # [B, T] | None, [B|1, T], [B, 1, T, T] | None
        cos, sin = self.rotary(pos, dt)
        q, k1, v1 = attn.qkv(x, cos, sin)  # [B, h, T, D], [B, kv, T, D] x 2
        window = window_size(self.config.options)
        out = causal_attention(q, k1, v1, mask, pos, real, window)  # [B, h, T, D]
        hidden = self._finish(x, attn.o_proj(out.transpose(1, 2).reshape(B, T, -1)))  # [B, T, H]

        def prepare(emb: torch.Tensor, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            x = self.fc(torch.cat([emb, prev], dim=-1))  # [B, R, H]: the attention input is also the residual
            return x, x

        return [hidden] + unroll_self_fed(attn, self.rotary, self.embed_tokens, prepare, self._finish, hidden, k1, v1,
                                          next_ids, pos, real, steps, rows, window)

    def _finish(self, x: torch.Tensor, attn_out: torch.Tensor) -> torch.Tensor:
        """The decoder layer after its attention: residual, post-attention norm, MLP (as `DecoderLayer.forward`)."""
        layer = self.layers[0]
        x = x + attn_out
        return x + layer.mlp(layer.post_attention_layernorm(x))

    # -- checkpoint I/O ---------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path_or_hub_id: str | Path, dtype: torch.dtype | None = None, revision: str | None = None,
                        device: str | torch.device | None = None) -> "EagleHead":
        """Load a head folder (ours or a released `yuhuili/EAGLE-*`) from a local dir or the Hub, strictly."""
        config_file, weights_file = resolve_head_files(str(path_or_hub_id), revision)
        config = read_head_config(config_file)
        cls.check_kind(config, config_file)
        sd = load_weights(weights_file)
        problems = layout_problems(config, {k: tuple(v.shape) for k, v in sd.items()})  # eagle/head_checks.py
        if problems:
            raise HeadConfigError(f"head checkpoint {weights_file} does not match its config: {'; '.join(problems)}")
        head = cls(config)
        head.load_state_dict(sd, strict=True)
        if dtype is not None:
            head.to(dtype)
        if device is not None:
            head.to(device)
        return head
