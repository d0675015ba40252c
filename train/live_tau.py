"""Real speculative decoding during training: `eval/live_tau` next to the simulated acceptance length.

At every evaluation, rank 0 decodes the prompts of a few held-out records with the head being trained and the
recipe's `decoding` tree (EAGLE-2 by default), through `eagle.tau.measure_tau` - the same decoder and
token counting as `evaluation/main.py`. The simulated rollout metrics only see chains; this sees the tree.

Prompt of a record = its tokens before the first trained-on token (the user turn of a conversation). Raw-text
records are trained on from the first token; their first `RAW_TEXT_PROMPT_TOKENS` tokens are the prompt.
Cost: one greedy generation per prompt; in offline mode the full target is loaded once (rank 0 only).
"""
from __future__ import annotations

from copy import deepcopy

import torch

from data_prep.target import load_target_model
from eagle.decoding_config import DecodingConfig

RAW_TEXT_PROMPT_TOKENS = 16


def live_prompts(records, n: int) -> list[list[int]]:
    """Prompts (token-id lists) of the first n records with at least one token after the prompt."""
    prompts = []
    for i in range(len(records)):
        if len(prompts) == n:
            break
        rec = records[i]
        ids, mask = rec["input_ids"].tolist(), rec["loss_mask"].tolist()
        first = next((j for j, m in enumerate(mask) if m), None)
        if first is None:
            continue  # nothing trained on in this record: no assistant turn to speculate
        cut = first if first > 0 else min(RAW_TEXT_PROMPT_TOKENS, len(ids) - 1)
        if 0 < cut < len(ids):
            prompts.append(ids[:cut])
    return prompts


class LiveTau:
    """Holds the target and prompts between evaluations (built lazily on first use)."""

    def __init__(self, cfg, target_path: str, frozen, eval_set, device: torch.device):
        self.cfg, self.target_path, self.frozen, self.eval_set, self.device = cfg, target_path, frozen, eval_set, device
        self.model = None
        self.prompts = None

    def _target(self):
        if self.model is None:
            model = getattr(self.frozen, "model", None)  # online mode: the target already runs in the loop
            if model is None:
                model = load_target_model(self.cfg.target, self.device, path=self.target_path)
            self.model = model.eval()
        return self.model

    def measure(self, head) -> dict:
        """eval/live_tau, eval/live_alpha_d, eval/live_prompts, eval/live_seconds for `head`."""
        # lazy: EaModel's target adapter imports transformers (over a second); only runs with live tau need it, not --help
        from eagle.tau import measure_tau

        t = self.cfg.train
        if self.prompts is None:
            self.prompts = live_prompts(self.eval_set, t.live_tau_prompts)
            if not self.prompts:
                raise ValueError("train.live_tau_prompts > 0 but no eval record has a prompt followed by trained-on "
                                 "tokens (is the eval split empty?)")
        model = self._target()
        # a copy in the target's dtype: the training module (or its dtype) must not change under the optimizer;
        # deepcopy, not a fresh EagleHead: initialising one would draw from the global RNG (the noise stream)
        copy = deepcopy(head).to(device=self.device, dtype=model.get_output_embeddings().weight.dtype).eval()
        decoding = DecodingConfig.from_section(self.cfg.decoding)
        eos = list(self.cfg.eval.eos_token_ids) or None
        result = measure_tau(model, copy, self.prompts, decoding=decoding,
                             max_new_tokens=t.live_tau_max_new_tokens, eos_token_id=eos)
        out = result.to_dict(prefix="eval/live_")
        out["eval/live_prompts"] = result.prompts
        out["eval/live_seconds"] = result.seconds
        return out
