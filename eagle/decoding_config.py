"""Decoding settings: the ONE home of the tree defaults (EaModel, recipes and evaluation read them here)."""
from __future__ import annotations

from dataclasses import dataclass, fields

TREE_MODES = ("dynamic", "static", "chain", "vanilla")


@dataclass
class DecodingConfig:
    """How drafts are built each round.

    mode: "dynamic" (EAGLE-2 tree), "static" (EAGLE-1 choice tree), "chain" (k tokens), "vanilla".
    total_token / depth / top_k: EAGLE-2 published defaults 60 / 5 / 10.
    static_choices: name of a shipped choice list (see eagle.static_trees) for mode "static".
    chain_length: draft tokens per round for mode "chain".
    calibrate: mode "dynamic" ranks the tree by the head's calibrated acceptance for the sampling setting being
        decoded when its tree_config.json holds a map fitted for it (eagle/score_calibration.py), else by the raw
        draft probabilities (the published EAGLE-2 rule, and what `calibrate: false` always uses).
    """

    mode: str = "dynamic"
    total_token: int = 60
    depth: int = 5
    top_k: int = 10
    static_choices: str = "mc_sim_7b_63"
    chain_length: int = 5
    calibrate: bool = True

    @classmethod
    def from_section(cls, section) -> "DecodingConfig":
        """From a recipe's `decoding` section (any mapping holding every field)."""
        return cls(**{f.name: section[f.name] for f in fields(cls)})

    def validate(self, vocab_size: int | None = None) -> "DecodingConfig":
        if self.mode not in TREE_MODES:
            raise ValueError(f"decoding.mode={self.mode!r}: expected one of {TREE_MODES}")
        if self.mode == "dynamic":
            if self.total_token < 2:
                raise ValueError(f"total_token={self.total_token}: must be >= 2 (root + at least one draft node)")
            if self.depth < 1:
                raise ValueError(f"depth={self.depth}: must be >= 1")
            if self.top_k < 1:
                raise ValueError(f"top_k={self.top_k}: must be >= 1")
            if vocab_size is not None and self.top_k > vocab_size:
                raise ValueError(f"top_k={self.top_k} exceeds the vocabulary size {vocab_size}")
        if self.mode == "chain" and self.chain_length < 1:
            raise ValueError(f"chain_length={self.chain_length}: must be >= 1")
        return self
