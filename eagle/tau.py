"""Real tree-decoding tau of a head on a few prompts (the trainer's live tau at every evaluation).

    from eagle.tau import measure_tau
    result = measure_tau(target_model, head, prompts, max_new_tokens=64)   # prompts: token-id lists or strings
    logger.log({"eval/tau": result.tau, **{f"eval/alpha_{d.depth}": d.rate for d in result.depth_acceptance}})

Greedy (T = 0) decoding with the same EaModel code path and the same tau definition as the evaluation reports
(eagle/stats.py), so a number logged during training is the number the final report shows for those prompts.
The head's train/eval mode and grad flags are restored.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from eagle.decoding_config import DecodingConfig
from eagle.ea_model import EaModel
from eagle.stats import DepthAcceptance, acceptance_by_depth, committed_tokens


@dataclass
class TauMeasurement:
    tau: float  # tokens per target forward over all prompts
    depth_acceptance: list[DepthAcceptance] = field(default_factory=list)
    prompts: int = 0
    new_tokens: int = 0
    rounds: int = 0
    seconds: float = 0.0

    def to_dict(self, prefix: str = "") -> dict:
        """Flat scalars for a metrics logger, e.g. {"eval/tau": ..., "eval/alpha_1": ...}."""
        out = {f"{prefix}tau": self.tau, f"{prefix}rounds": self.rounds, f"{prefix}new_tokens": self.new_tokens}
        out.update({f"{prefix}alpha_{d.depth}": d.rate for d in self.depth_acceptance})
        return out


def measure_tau(base_model, head, prompts, *, tokenizer=None, decoding: DecodingConfig | None = None,
                max_new_tokens: int = 64, eos_token_id=None) -> TauMeasurement:
    """Greedy speculative decoding of every prompt; `base_model` is the frozen HF target, `head` an
    EagleHead (unwrapped, e.g. `engine.module`). String prompts need `tokenizer` (encoded as is, no
    chat template: pass token ids to use one). `decoding` defaults to DecodingConfig() (dynamic)."""
    if not prompts:
        raise ValueError("measure_tau: no prompts")
    was_training = head.training
    grad_flags = [p.requires_grad for p in head.parameters()]
    model = EaModel(base_model, head, decoding or DecodingConfig())  # puts the head in eval mode
    device = next(base_model.parameters()).device
    rounds, new_tokens, prompts_done = [], 0, 0
    start = time.perf_counter()
    try:
        with torch.inference_mode():
            for p in prompts:
                if isinstance(p, str):
                    if tokenizer is None:
                        raise ValueError("measure_tau: string prompts need a tokenizer")
                    p = tokenizer(p)["input_ids"]
                ids = torch.as_tensor(p, dtype=torch.long, device=device).reshape(1, -1)  # [1, T]
                max_length = ids.shape[1] + max_new_tokens + 1
                out, stats = model.eagenerate(ids, max_new_tokens=max_new_tokens, max_length=max_length,
                                              eos_token_id=eos_token_id, return_stats=True)
                rounds += stats.rounds
                new_tokens += out.shape[1] - ids.shape[1]
                prompts_done += 1
    finally:
        head.train(was_training)
        for param, flag in zip(head.parameters(), grad_flags):
            param.requires_grad_(flag)
    committed = committed_tokens(rounds)
    return TauMeasurement(tau=committed / len(rounds) if rounds else float("nan"),
                          depth_acceptance=acceptance_by_depth(rounds), prompts=prompts_done, new_tokens=new_tokens,
                          rounds=len(rounds), seconds=time.perf_counter() - start)
