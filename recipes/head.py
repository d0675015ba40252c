"""Recipe section `head`: which head kind to train and its kind-specific settings. The one home of these defaults."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, NamedTuple

from eagle.head_kinds import EAGLE2, EAGLE3, HEAD_KINDS, PEAGLE, HeadConfigError, fitted_aux_layers, text_config
from recipes.check import RecipeError, check


@dataclass
class HeadSettings:
    kind: str = "eagle2"  # eagle2 (fc over the final hidden state + feature loss) | eagle3 (3 aux layers, training-time test)
    # | peagle (P-EAGLE: eagle3's layout drafting all ttt_steps positions in ONE forward; reads every eagle3 key)
    bias: bool = True  # EAGLE-2 fc bias; Llama-3 released heads use False, Vicuna/Llama-2/Mixtral True (eagle3: no fc bias)
    init_from: str = ""  # start from an existing head (folder or hub id) instead of a fresh init; "" = fresh
    # --- eagle2 only: HASS-style multi-step alignment (the head also trained on its own predicted features)
    align_steps: int = 1  # unrolled steps per position; 1 = the plain EAGLE-2 training (one step on true features)
    align_step_weights: list[float] = field(default_factory=list)  # weight of step j's token AND feature loss; [] = 0.8^(j-1)
    align_row_stride: int = 1  # steps >= 2 run at every n-th position only (offset cycles per micro-batch); 1 = all
    # --- eagle3 only (an error with kind=eagle2 unless left at the default)
    aux_layers: list[int] = field(default_factory=list)  # 3 ids, id j = HF hidden_states[j] (0 = embeddings); [] = (2, L//2, L-3)
    draft_vocab_size: int = 0  # the N most frequent loss tokens of the training data (filled up by id if fewer occur); 0 = full
    ttt_steps: int = 7  # training-time test: unrolled draft steps per position (1 = no self-fed steps)
    ttt_step_weights: list[float] = field(default_factory=list)  # loss weight of step j (1-based); [] = 0.8^(j-1)
    ttt_row_stride: int = 1  # steps >= 2 run at every n-th position only (offset cycles per micro-batch); 1 = all
    lm_head_init: str = "target"  # target = the draft vocabulary's rows of the target's lm_head (a warm start) | random
    # --- eagle3, EAGLE-3.1's normalisations (exported in vLLM's speculators config under the same names)
    norm_before_fc: bool = False  # one RMSNorm over the 3 concatenated aux states before fc
    fc_norm: bool = False  # one RMSNorm per aux state before fc
    norm_output: bool = False  # drafted nodes read norm(h) (the final norm's output, what lm_head reads) instead of h
    # --- peagle only (its ttt_steps = the k draft positions trained from one forward, ttt_step_weights their weights)
    mask_token_id: int = -1  # the target token id draft positions 2..k read; -1 = the smallest id absent from the loss tokens


def dpace(loss) -> bool:
    """The recipe's loss section (None: a recipe without it) weights the unrolled steps by D-PACE (recipes/loss.py)."""
    return getattr(loss, "position_weighting", "fixed") == "dpace"


def ttt_weights(head, loss=None) -> list[float]:
    """The per-step loss weights of an eagle3 head section: head.ttt_step_weights, or 0.8^(j-1) for j = 1..ttt_steps;
    1 each under loss.position_weighting=dpace (its per-chain weights replace the decay: train/loss.py)."""
    if dpace(loss):
        return [1.0] * head.ttt_steps
    return [float(w) for w in head.ttt_step_weights] or [0.8 ** j for j in range(head.ttt_steps)]


def align_weights(head, loss=None) -> list[float]:
    """The per-step loss weights of an eagle2 head section: head.align_step_weights, or 0.8^(j-1) for j = 1..align_steps;
    1 each under loss.position_weighting=dpace."""
    if dpace(loss):
        return [1.0] * head.align_steps
    return [float(w) for w in head.align_step_weights] or [0.8 ** j for j in range(head.align_steps)]


def validate_eagle2_keys(h) -> None:
    check(h.align_steps >= 1, "head.align_steps", h.align_steps, "expected >= 1 (1 = plain EAGLE-2 training)")
    w = list(h.align_step_weights)
    check(not w or (len(w) == h.align_steps and all(x >= 0 for x in w) and w[0] > 0), "head.align_step_weights", w,
          f"expected [] or {h.align_steps} weights >= 0 (one per head.align_steps), the first > 0")
    check(h.align_row_stride >= 1, "head.align_row_stride", h.align_row_stride, "expected >= 1")


def validate_eagle3_keys(h) -> None:
    aux = list(h.aux_layers)
    check(not aux or (len(aux) == 3 and all(a >= 0 for a in aux) and aux == sorted(set(aux))), "head.aux_layers", aux,
          "expected [] (the target default) or 3 strictly increasing layer ids >= 0")
    check(h.draft_vocab_size >= 0, "head.draft_vocab_size", h.draft_vocab_size, "expected >= 0 (0 = the full vocabulary)")
    check(h.ttt_steps >= 1, "head.ttt_steps", h.ttt_steps, "expected >= 1")
    w = list(h.ttt_step_weights)
    check(not w or (len(w) == h.ttt_steps and all(x >= 0 for x in w) and sum(w) > 0), "head.ttt_step_weights", w,
          f"expected [] or {h.ttt_steps} weights >= 0 (one per head.ttt_steps), not all 0")
    check(h.ttt_row_stride >= 1, "head.ttt_row_stride", h.ttt_row_stride, "expected >= 1")
    check(h.lm_head_init in ("target", "random"), "head.lm_head_init", h.lm_head_init, "expected 'target' or 'random'")


def check_eagle3_fits_target(h, target_config) -> None:
    """The aux layers are layers of the target, the draft vocabulary is no larger than its vocabulary."""
    c = text_config(target_config)
    try:
        fitted_aux_layers(list(h.aux_layers) or None, int(c.num_hidden_layers))
    except HeadConfigError as e:
        raise RecipeError(f"head.aux_layers={list(h.aux_layers)}: {e}") from None
    vocab = int(c.vocab_size)
    check(h.draft_vocab_size <= vocab, "head.draft_vocab_size", h.draft_vocab_size,
          f"larger than the target's vocabulary ({vocab}); 0 = the full vocabulary")


def validate_peagle_keys(h) -> None:
    validate_eagle3_keys(h)
    check(h.mask_token_id >= -1, "head.mask_token_id", h.mask_token_id,
          "expected -1 (a token absent from the training loss tokens) or a target token id >= 0")


def check_peagle_fits_target(h, target_config) -> None:
    check_eagle3_fits_target(h, target_config)
    vocab = int(text_config(target_config).vocab_size)
    check(h.mask_token_id < vocab, "head.mask_token_id", h.mask_token_id,
          f"not a token of the target's vocabulary [0, {vocab}); -1 = pick one absent from the loss tokens")


class KindPart(NamedTuple):
    keys: tuple[str, ...]  # the head.* keys the kind reads beyond kind / bias / init_from (other kinds': defaults)
    check_keys: Callable  # their check, on the section alone
    check_target: Callable | None = None  # the checks that need the target's config (None: nothing to check)
    feature_loss: bool = False  # the kind's head predicts the target's next feature (loss.feature applies)
    steps: str = ""  # the key of its unrolled step count ("{steps}" -> "{step}_weights" their weights)


# The recipe's per-kind part, keyed by the kind objects (eagle/head_kinds.py).
KIND_KEYS = {EAGLE2: KindPart(("align_steps", "align_step_weights", "align_row_stride"), validate_eagle2_keys,
                              feature_loss=True, steps="align_steps"),
             EAGLE3: KindPart(("aux_layers", "draft_vocab_size", "ttt_steps", "ttt_step_weights", "ttt_row_stride",
                               "lm_head_init", "norm_before_fc", "fc_norm", "norm_output"), validate_eagle3_keys,
                              check_eagle3_fits_target, steps="ttt_steps"),
             PEAGLE: KindPart(("aux_layers", "draft_vocab_size", "ttt_steps", "ttt_step_weights", "ttt_row_stride",
                               "lm_head_init", "mask_token_id"), validate_peagle_keys, check_peagle_fits_target,
                              steps="ttt_steps")}


def validate_head_section(h) -> None:
    """Check the head section: its kind, the keys that kind reads (the aux layers against the target are checked by
    `check_aux_layers` at train time) and that no other kind's key is set."""
    check(h.kind in HEAD_KINDS, "head.kind", h.kind, f"expected one of {tuple(HEAD_KINDS)}")
    kind, defaults = HEAD_KINDS[h.kind], HeadSettings()
    own, check_own = KIND_KEYS.get(kind, KindPart((), None))[:2]
    for other, part in KIND_KEYS.items():
        for key in (k for k in part.keys if k not in own):
            value = list(h[key]) if isinstance(getattr(defaults, key), list) else h[key]
            check(value == getattr(defaults, key), f"head.{key}", value, f"only used by head.kind={other.name}")
    if check_own is not None:
        check_own(h)


def check_head_fits_target(h, target_config) -> None:
    """The head section's checks that need the target (its config, not its weights): the aux layers are layers of it,
    the draft vocabulary is no larger than its vocabulary. Every command that knows the target runs this, after
    `load_config` (train/main.py, train.plan), so what one command accepts the others accept."""
    part = KIND_KEYS.get(HEAD_KINDS[h.kind])
    if part is not None and part.check_target is not None:
        part.check_target(h, target_config)


def has_feature_loss(h) -> bool:
    """The head section's kind trains a next-feature loss (loss.feature applies to it)."""
    part = KIND_KEYS.get(HEAD_KINDS.get(h.kind))
    return part is not None and part.feature_loss


def step_keys(h) -> tuple[str, str]:
    """The head section's keys of its unrolled step count and their weights (head.align_steps /
    head.align_step_weights, head.ttt_steps / head.ttt_step_weights); ("", "") for a kind without unrolled steps."""
    part = KIND_KEYS.get(HEAD_KINDS.get(h.kind))
    steps = part.steps if part is not None else ""
    return steps, steps.replace("_steps", "_step_weights")
