"""The frozen target as the trainer sees it: its lm_head (token distributions) and, in online mode, the whole
model computing features inside the loop. Offline mode reads ONLY the embedding and lm_head tensors from
the target's weight shards (never the full model), and checks that the feature cache was made by this target.
"""
from __future__ import annotations

from pathlib import Path

import torch

from data_prep.feature_layers import target_features
from data_prep.target import base_decoder, cache_quantization, load_target_model, target_config_hash
from eagle.head_kinds import text_config
from eagle.target_weights import load_target_embedding_and_lm_head


class CacheMismatchError(ValueError):
    """The feature cache was written for another target (name, architecture, hidden size or vocabulary)."""


def target_name(path: str) -> str:
    """Comparable name of a target: the last component of a local path or hub id."""
    return Path(str(path).rstrip("/")).name


def check_cache_matches_target(manifest: dict, cache_path: Path, target_path: str, target_config,
                               layers: list[int] | None, quantization: str) -> None:
    """Raise CacheMismatchError, naming both sides, unless the cache's meta fits the recipe's target and holds the
    hidden states the head needs (`layers`: data_prep.feature_layers.feature_layers; None = final state only), computed
    by the target quantized as the recipe's `target.quantization` says (`quantization`)."""
    text = text_config(target_config)
    problems = []
    if int(manifest.get("hidden_size", -1)) != int(text.hidden_size):
        problems.append(f"hidden_size {manifest.get('hidden_size')} (cache) != {text.hidden_size} (target)")
    if "vocab_size" in manifest and int(manifest["vocab_size"]) != int(text.vocab_size):
        problems.append(f"vocab_size {manifest['vocab_size']} (cache) != {text.vocab_size} (target)")
    if target_name(manifest.get("target", "")) != target_name(target_path):
        problems.append(f"target {manifest.get('target')!r} (cache) != {target_path!r} (recipe)")
    expected_hash = target_config_hash(target_config)
    if manifest.get("config_hash") not in (None, expected_hash):
        problems.append(f"config_hash {manifest.get('config_hash')} (cache) != {expected_hash} (target config)")
    if manifest.get("feature_layers") != layers:
        problems.append(f"hidden-state layers {manifest.get('feature_layers') or 'final only (EAGLE-2)'} (cache) != "
                        f"{layers or 'final only (EAGLE-2)'} (recipe head.kind / head.aux_layers)")
    if cache_quantization(manifest) != quantization:
        problems.append(f"target quantization {cache_quantization(manifest)} (cache) != {quantization} (recipe "
                        "target.quantization): the head would learn states of another model than the one it serves")
    if problems:
        raise CacheMismatchError(
            f"feature cache {cache_path} does not match the recipe's target:\n  " + "\n  ".join(problems)
            + "\nRegenerate the cache for this target (python data_prep/main.py --recipe ...) or point "
            "train.cache_dir / target.path at the matching pair."
        )


class OfflineTarget:
    """Features come from the cache; only the frozen lm_head [V, H] is kept."""

    def __init__(self, lm_head: torch.Tensor):
        self.lm_head = lm_head

    def features(self, batch) -> torch.Tensor:
        return batch.hidden  # [B, T, W]


class OnlineTarget:
    """The frozen target runs in the loop: features = its last hidden state (after the final norm), or for
    EAGLE-3 the aux-layer states + that final state concatenated (`layers`), exactly what the cache would hold."""

    def __init__(self, model, lm_head: torch.Tensor, layers: list[int] | None = None):
        self.model = model
        self.decoder = base_decoder(model)
        self.lm_head = lm_head
        self.layers = layers

    @torch.no_grad()
    def features(self, batch) -> torch.Tensor:
        return target_features(self.decoder, batch.input_ids, batch.attention_mask, self.layers)  # [B, T, W]


def load_frozen_target(mode: str, target_cfg, target_path: str, device: torch.device, dtype: torch.dtype,
                       layers: list[int] | None = None):
    """(frozen target, input embedding [V, H]) for `mode` ("offline" | "online"); online features are the hidden
    states `layers` (None = the final state only).

    The lm_head is kept in the head's compute dtype `dtype` on `device`.
    """
    if mode == "offline":
        embedding, lm_head = load_target_embedding_and_lm_head(target_path, revision=target_cfg.revision)
        return OfflineTarget(lm_head.to(device=device, dtype=dtype)), embedding

    model = load_target_model(target_cfg, device, path=target_path)
    embedding = model.get_input_embeddings().weight.detach()
    lm_head = model.get_output_embeddings().weight.detach().to(dtype)
    return OnlineTarget(model, lm_head, layers), embedding
