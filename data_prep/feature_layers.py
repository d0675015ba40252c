"""Which target hidden states a head kind trains on, and how they are read out of the target.

EAGLE-2: the final hidden state (after the final norm) only, [T, H] — the cache layout of every existing cache.
EAGLE-3: the three aux layers of `head.aux_layers` followed by the final hidden state, concatenated: [T, 4H].
The aux states are the head's input (fc reads [T, 3H]); the final state gives the target's next-token
distribution for the token loss (lm_head(final)), so the trainer never needs the whole target offline.

Layer ids are HF `output_hidden_states` indices: id j = the residual stream ENTERING decoder layer j (0 = the
embeddings), id L (= num_hidden_layers) = the final, normed output (`last_hidden_state`). A cache written for
EAGLE-3 records them in its meta as `feature_layers`; an EAGLE-2 cache has no such key (= [L]).
"""
from __future__ import annotations

import torch

from eagle.head_kinds import HeadConfigError, text_config
from recipes import RecipeError
from recipes.head import head_options, section_kind


def feature_layers(head_cfg, target_config) -> list[int] | None:
    """The hidden-state ids a recipe's head needs, from its kind (eagle/head_kinds.py): None for eagle2 (final state
    only, the legacy layout), [a, b, c, L] for eagle3 (aux ids resolved against the target; a bad id raises
    RecipeError naming head.aux_layers)."""
    options = head_options(head_cfg)
    aux = list(getattr(options, "aux_layers", []))
    try:
        return section_kind(head_cfg).feature_layers(options, int(text_config(target_config).num_hidden_layers))
    except HeadConfigError as e:
        hint = "" if aux else " (the default (2, L//2, L-3)); set head.aux_layers explicitly"
        raise RecipeError(f"head.aux_layers={aux}{hint}: {e}") from None


def width(hidden_size: int, layers: list[int] | None) -> int:
    """Cached feature width per token: H for eagle2, 4H for eagle3."""
    return hidden_size * (1 if layers is None else len(layers))


@torch.no_grad()
def target_features(decoder, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                    layers: list[int] | None) -> torch.Tensor:
    """One forward of the target's decoder (no lm_head): [B, T, H] final states (layers None) or the named
    hidden states concatenated [B, T, len(layers) * H]."""
    out = decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                  output_hidden_states=layers is not None)
    if layers is None:
        return out.last_hidden_state  # [B, T, H]
    return torch.cat([out.hidden_states[j] for j in layers], dim=-1)  # [B, T, len(layers) * H]
