"""Recipe section `head`: which head kind to train, the keys every kind shares (`SharedHeadSettings`, their one home),
and each kind's own options, whose one home is the kind's options class (eagle/head_kinds.py, `kind.options`).

The section's dataclass is built from the registry (`head_settings()`): the shared keys, then the union of every
kind's option fields in registry order, so a kind's keys are recipe keys without being listed here and `--help` shows
each with the comment in its options class. A key of another kind set away from its default is refused in one line;
the stages read a kind's options typed, `head_options(cfg.head)` (an `Eagle3Options`, ...), never flat fields.
"""
from __future__ import annotations

import typing
from dataclasses import MISSING, dataclass, field, fields, make_dataclass

from eagle.head_kinds import DEFAULT_KIND, HEAD_KINDS, HeadKind, KindOptions, text_config
from recipes.check import check


@dataclass
class SharedHeadSettings:
    kind: str = DEFAULT_KIND.name  # the head kind, one of eagle.head_kinds.HEAD_KINDS: eagle2 (fc over the final hidden state + feature loss) | eagle3 (3 aux layers, training-time test) | peagle (P-EAGLE: eagle3's layout drafting all ttt_steps positions in ONE forward)
    bias: bool = True  # EAGLE-2 fc bias; Llama-3 released heads use False, Vicuna/Llama-2/Mixtral True (eagle3: no fc bias)
    init_from: str = ""  # start from an existing head (folder or hub id) instead of a fresh init; "" = fresh


_SCHEMAS: dict[tuple, type] = {}


def head_settings() -> type:
    """The `head` section's dataclass for the kinds registered now (cached per registry): `SharedHeadSettings`' keys,
    then every kind's option fields. A field two kinds both declare (P-EAGLE inherits EAGLE-3's) must agree on its
    type and default, else this raises naming both kinds: the recipe has one key per name."""
    kinds = tuple(HEAD_KINDS.values())
    if kinds not in _SCHEMAS:
        specs, owners = [], {}
        for kind in kinds:
            hints = typing.get_type_hints(kind.options)
            for f in fields(kind.options):
                spec = (hints[f.name], f.default, f.default_factory)
                if f.name in owners:
                    if owners[f.name][1][0] != spec[0] or default_of(owners[f.name][1]) != default_of(spec):
                        raise TypeError(f"head.{f.name}: kinds {owners[f.name][0]} and {kind.name} declare it with "
                                        "different types or defaults; give one of them another name")
                    continue
                owners[f.name] = (kind.name, spec)
                default = {"default_factory": f.default_factory} if f.default_factory is not MISSING else {"default": f.default}
                specs.append((f.name, spec[0], field(**default)))
        cls = make_dataclass("HeadSettings", specs, bases=(SharedHeadSettings,))
        cls.__module__ = __name__
        cls.comment_sources = (SharedHeadSettings, *dict.fromkeys(k.options for k in kinds))  # for --help
        _SCHEMAS[kinds] = cls
    return _SCHEMAS[kinds]


def default_of(spec) -> object:
    """The default of a (type, default, default_factory) field spec."""
    return spec[2]() if spec[2] is not MISSING else spec[1]


def section_kind(h) -> HeadKind:
    """The kind of a recipe's head section; a section without `kind` (the recipe.yaml of an older export) is the
    default kind's."""
    return HEAD_KINDS[h.get("kind", DEFAULT_KIND.name) if hasattr(h, "get") else h.kind]


def head_options(h) -> KindOptions:
    """The typed options of a recipe's head section for its kind (eagle/head_kinds.py: `kind.options_of`)."""
    return section_kind(h).options_of(h)


def dpace(loss) -> bool:
    """The recipe's loss section (None: a recipe without it) weights the unrolled steps by D-PACE (recipes/loss.py)."""
    return getattr(loss, "position_weighting", "fixed") == "dpace"


def step_weights(h, loss=None) -> list[float]:
    """The per-step loss weights of a head section: its kind's explicit list (head.ttt_step_weights /
    head.align_step_weights) or 0.8^(j-1); 1 each under loss.position_weighting=dpace."""
    return head_options(h).step_weights(dpace(loss))


def validate_head_section(h) -> None:
    """Check the head section: its kind, the values of the kind's own options, and that no other kind's key is set
    (the target-dependent checks: `check_head_fits_target`)."""
    check(h.kind in HEAD_KINDS, "head.kind", h.kind, f"expected one of {tuple(HEAD_KINDS)}")
    kind, defaults = HEAD_KINDS[h.kind], head_settings()()
    own = set(kind.options.keys())
    for other in HEAD_KINDS.values():
        for key in (k for k in other.options.keys() if k not in own):
            value = list(h[key]) if isinstance(getattr(defaults, key), list) else h[key]
            check(value == getattr(defaults, key), f"head.{key}", value, f"only used by head.kind={other.name}")
    raise_first(head_options(h).problems())


def check_head_fits_target(h, target_config) -> None:
    """The head section's checks that need the target (its config, not its weights; e.g. EAGLE-3's aux layers are
    layers of it, the draft vocabulary no larger than its vocabulary). Every command that knows the target runs this,
    after `load_config` (train/main.py, train.plan), so what one command accepts the others accept."""
    raise_first(head_options(h).target_problems(text_config(target_config)))


def raise_first(problems) -> None:
    """RecipeError naming the first (key, value, expected) of a kind's options problems, as `head.KEY=value: ...`."""
    for key, value, expect in problems[:1]:
        check(False, f"head.{key}", value, expect)


def has_feature_loss(h) -> bool:
    """The head section's kind trains a next-feature loss (loss.feature applies to it)."""
    return section_kind(h).predicts_features


HeadSettings = head_settings()  # the section of the kinds the library ships (recipes/schema.py's `Recipe.head`)
