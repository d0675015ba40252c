"""The checks a head's tensors get, for every kind, in one place: the loaders (`check_head_files`, `from_pretrained`),
every export (official, vLLM, SGLang; train/export.py, export/) and evaluation's warnings all ask these.

    layout_problems(config, {name: shape})                 # the tensors the config implies, shapes included
    head_problems(config, state_dict, target_config=None)  # + finite weights, the kind's maps, fit to the target
    check_head_weights(config, state_dict, where, ...)     # HeadConfigError listing them on one line

Loaders refuse a layout or map problem but load non-finite weights (evaluation then warns, naming the head);
exports refuse all of them before anything is written."""
from __future__ import annotations

import copy
from types import SimpleNamespace

import torch

from eagle.head_kinds import HeadConfigError, text_config

MAX_LISTED = 4  # names listed per problem (a broken head can have every tensor wrong)


def expected_shapes(config, present: set[str] | None = None) -> dict[str, tuple[int, ...]]:
    """{name: shape} of the tensors a head folder of `config` holds: the kind's module built on the meta device; a
    weight the kind lets a checkpoint omit (`optional_weights`) is expected only when `present` has it."""
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in config.head_kind.module(config).state_dict().items()}
    optional = config.head_kind.optional_weights(config)
    return {k: v for k, v in shapes.items() if k not in optional or (present is not None and k in present)}


def layout_problems(config, shapes: dict[str, tuple[int, ...]], optional: set[str] = frozenset()) -> list[str]:
    """Missing, unexpected and mis-shaped tensors of a head folder against its config (`optional`: names the caller
    also lets the folder omit)."""
    expect = {k: v for k, v in expected_shapes(config, set(shapes)).items() if k in shapes or k not in optional}
    missing = sorted(set(expect) - set(shapes))
    unexpected = sorted(set(shapes) - set(expect))
    out = []
    if missing or unexpected:
        hint = (" (the config says \"bias\": true but there is no fc.bias: set \"bias\": false)" if "fc.bias" in missing
                else " (fc.bias but the config says \"bias\": false)" if "fc.bias" in unexpected else "")
        out.append(f"missing keys {missing[:2 * MAX_LISTED]}, unexpected keys {unexpected[:2 * MAX_LISTED]}{hint}")
    out += [f"{k} has shape {tuple(shapes[k])}, config implies {expect[k]}"
            for k in sorted(set(shapes) & set(expect)) if tuple(shapes[k]) != expect[k]][:MAX_LISTED]
    return out


def is_finite(t: torch.Tensor) -> bool:
    """No NaN/inf in `t`: its min and max are finite (aminmax propagates NaN). One pass without a [numel] bool
    temporary: several times faster than isfinite().all() (benchmarks/export_checks.py)."""
    return t.numel() == 0 or all(bool(torch.isfinite(x)) for x in torch.aminmax(t))


def non_finite(state_dict: dict[str, torch.Tensor]) -> list[str]:
    """Names of the floating tensors holding NaN or inf."""
    return sorted(k for k, v in state_dict.items() if v.is_floating_point() and not is_finite(v))


def target_problems(config, target_config) -> list[str]:
    """What keeps the head off this target (hidden size, vocabulary, the kind's needs: EAGLE-3's aux ids against its
    layers), from the kind's own `fit_to_target` on a copy (the config is not completed)."""
    t = text_config(target_config)
    fit = SimpleNamespace(hidden_size=t.hidden_size, vocab_size=getattr(t, "vocab_size", None),
                          num_hidden_layers=getattr(t, "num_hidden_layers", None))
    try:
        config.head_kind.fit_to_target(copy.deepcopy(config), fit)
    except (HeadConfigError, TypeError) as e:
        return [" ".join(str(e).split())]
    return []


def head_problems(config, state_dict: dict[str, torch.Tensor], target_config=None, finite: bool = True,
                  optional: set[str] = frozenset()) -> list[str]:
    """Every problem of a head's config + tensors: the layout, the kind's own (`weight_problems`: d2t / t2d), non-finite
    weights (unless finite=False) and, when the target's config is known, its fit."""
    out = layout_problems(config, {k: tuple(v.shape) for k, v in state_dict.items()}, optional)
    out += config.head_kind.weight_problems(config, state_dict)
    if finite:
        bad = non_finite(state_dict)
        if bad:
            out.append(f"non-finite weights (NaN/inf) in {bad[:MAX_LISTED]}")
    if target_config is not None:
        out += target_problems(config, target_config)
    return out


def check_head_weights(config, state_dict: dict[str, torch.Tensor], where: str, target_config=None,
                       finite: bool = True, optional: set[str] = frozenset()) -> None:
    """HeadConfigError (one line: `where` and every problem) unless `head_problems` finds nothing."""
    problems = head_problems(config, state_dict, target_config, finite, optional)
    if problems:
        raise HeadConfigError(f"{where}: " + "; ".join(problems))


__all__ = ["expected_shapes", "layout_problems", "non_finite", "target_problems", "head_problems", "check_head_weights"]
