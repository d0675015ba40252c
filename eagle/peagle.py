"""The P-EAGLE draft head (`PeagleHead`): an EAGLE-3 head that drafts k tokens in ONE forward (parallel drafting).

Its decoding forward, per round, is one call over
  the committed rows   (fc(aux_t), embed(x_{t+1}))  at positions t          (as EAGLE-3; the last one predicts draft 1)
  k - 1 mask rows      (fc(mask_hidden), embed(mask_token_id)) at positions p+1 .. p+k-1 (mask row i predicts draft i+1)
causal over all of them: vLLM's parallel-drafting input layout for an EAGLE-3 model (v1/spec_decode: the bonus slot,
then `parallel_drafting_token_id` slots whose hidden state is `combine_hidden_states(mask_hidden)`, positions counting
on). `mask_hidden` [1, 3H] lives in the aux space (vLLM's buffer is [1, fc_input_size]) and is learned; the mask
token's embedding is the target's, frozen like every other row.

Training (`unroll`) is the EAGLE-3 training-time test with the self-fed inputs replaced by the mask inputs: step j at
index t reads (fc(mask_hidden), embed(mask)) at position t + j - 1 and attends to the step-1 keys <= t plus its own
steps 2..j, so step j's output at t is exactly the decoding forward's mask row j - 1 after committing 0..t, and it
predicts the token at t + j + 1 (the same targets as EAGLE-3's step j). The steps do not depend on each other's
outputs; they cost what the training-time test costs at equal k.
"""
from __future__ import annotations

import torch
from torch import nn

from eagle.eagle3 import Eagle3Head
from eagle.head_config import HeadConfig
from eagle.head_kinds import N_AUX_LAYERS, PEAGLE
from eagle.parallel_draft import ParallelDrafter
from eagle.sliding_window import window_size
from eagle.unroll import unroll_self_fed


class PeagleHead(Eagle3Head, kind=PEAGLE):
    """EAGLE-3 layout plus `mask_hidden` [1, 3H] (a learned weight) and the config's `mask_token_id`; its drafter is
    `ParallelDrafter` (one head forward per round)."""

    drafter_class = ParallelDrafter

    def __init__(self, config: HeadConfig):
        super().__init__(config)
        self.mask_hidden = nn.Parameter(torch.empty(1, N_AUX_LAYERS * config.hidden_size))
        nn.init.normal_(self.mask_hidden, std=0.02)

    @property
    def mask_token_id(self) -> int:
        return int(self.config.options.mask_token_id)

    def mask_feature(self) -> torch.Tensor:
        """fc(mask_hidden) [1, H]: the feature every mask position reads (vLLM: combine_hidden_states(mask_hidden))."""
        return self.fc(self.mask_hidden.to(self.fc.weight.dtype))

    def later_steps(self, hidden, k1, v1, next_ids, pos, real, steps: int, rows, shards=None) -> list[torch.Tensor]:
        """Steps 2..k: the mask rows (module docstring), each from the mask inputs, not from the previous step."""
        layer, H, dt = self.midlayer, self.config.hidden_size, hidden.dtype
        feat = self.mask_feature().to(dt).view(1, 1, H)  # [1, 1, H]
        emb = self.embed_tokens.weight[self.mask_token_id].to(dt)  # [H]

        def mask_embedding(ids: torch.Tensor) -> torch.Tensor:
            return emb.expand(*ids.shape, H)  # [B, R, H]: every step >= 2 reads the mask token

        def prepare(token_emb: torch.Tensor, prev: torch.Tensor):
            residual = feat.expand_as(prev)  # [B, R, H]
            return layer.attn_input(token_emb, residual), residual

        return unroll_self_fed(layer.self_attn, self.rotary, mask_embedding, prepare, layer.finish, hidden, k1, v1,
                               next_ids, pos, real, steps, rows, window_size(self.config.options), shards)
