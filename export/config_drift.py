"""Config drift between a draft head and its target, checked before a head is exported or served.

Each finding is an error (the head cannot work as exported: refuse) or a warning (it works, but an engine
or a user is likely to be surprised). `check_drift` returns them all; `raise_on_errors` turns the errors
into one `DriftError` naming every problem and logs the warnings.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from eagle.head_checks import non_finite
from eagle.head_config import HeadConfig, head_config_from_target

log = logging.getLogger(__name__)

# largest finite value of each export dtype (a weight beyond it becomes inf)
DTYPE_MAX = {"float16": 65504.0, "bfloat16": 3.3895313892515355e38, "float32": 3.4028234663852886e38}


class DriftError(ValueError):
    """The head and its config (or its target) disagree in a way that breaks it; the message lists each problem."""


@dataclass(frozen=True)
class Finding:
    level: str  # "error" | "warning"
    key: str  # the config key concerned, e.g. "bias", "max_position_embeddings"
    message: str

    def __str__(self) -> str:
        return f"{self.level}: {self.key}: {self.message}"


def _rope_of(c: HeadConfig) -> dict:
    """Comparable rope parameters (theta + scaling, type names normalised)."""
    return {k: (float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v)
            for k, v in c.rope_parameters().items()}


def check_drift(config: HeadConfig, state_dict: dict[str, torch.Tensor] | None = None, target_config=None,
                export_dtype: str | None = None) -> list[Finding]:
    """Every inconsistency between a head's config, its weights, its target's HF config and the export dtype.

    errors: fc bias in the weights but `bias` false (or the reverse); hidden/vocab/head shapes unlike the
    target's; non-finite weights; weights beyond the export dtype's range.
    warnings: head max_position_embeddings below the target's; rope parameters unlike the target's; an
    export dtype unlike the target's.
    """
    out: list[Finding] = []
    if state_dict is not None:
        has_bias = "fc.bias" in state_dict
        if has_bias and not config.bias:
            out.append(Finding("error", "bias", "the weights have fc.bias but the config says \"bias\": false "
                               "(engines and the reference would drop it and change the head's function)"))
        if config.bias and not has_bias:
            out.append(Finding("error", "bias", "the config says \"bias\": true but the weights have no fc.bias "
                               "(engines would leave it uninitialised)"))
        bad = non_finite(state_dict)  # eagle/head_checks.py, the test every export and evaluation use
        if bad:
            out.append(Finding("error", "weights", f"non-finite values in {bad}"))
        if export_dtype is not None:
            limit = DTYPE_MAX[export_dtype]
            big = [k for k, v in state_dict.items() if v.is_floating_point() and v.numel()
                   and float(v.abs().max()) > limit]
            if big:
                out.append(Finding("error", "dtype", f"{big} exceed the largest {export_dtype} ({limit:g}): "
                                   "export in a wider dtype"))
    if target_config is not None:
        t = head_config_from_target(target_config, bias=config.bias)
        for key in ("hidden_size", "vocab_size"):
            if getattr(config, key) != getattr(t, key):
                out.append(Finding("error", key, f"head {getattr(config, key)} != target {getattr(t, key)}: "
                                   "the head was made for another model"))
        if config.max_position_embeddings < t.max_position_embeddings:
            out.append(Finding("warning", "max_position_embeddings",
                               f"head {config.max_position_embeddings} < target {t.max_position_embeddings}: engines cap "
                               "the draft (and so speculation) at the head's length; engine exports raise it to the "
                               "target's when the rope does not depend on it"))
        if _rope_of(config) != _rope_of(t):
            out.append(Finding("warning", "rope", f"head rope {_rope_of(config)} != target rope {_rope_of(t)}: "
                               "engines build the draft's rotary embedding from the head's config, so it keeps "
                               "the function it was trained with, but a head trained for another target version "
                               "drafts poorly"))
        if export_dtype is not None:
            tdtype = str(getattr(target_config, "dtype", None) or getattr(target_config, "torch_dtype", None) or "")
            tdtype = tdtype.replace("torch.", "")
            if tdtype and tdtype != export_dtype:
                out.append(Finding("warning", "dtype", f"export dtype {export_dtype} != target dtype {tdtype}: engines "
                                   "run the draft in the target's dtype, so the weights are cast once more"))
    return out


def raise_on_errors(findings: list[Finding], what: str) -> None:
    """Log the warnings; raise one DriftError listing every error."""
    for f in findings:
        if f.level == "warning":
            log.warning("%s: %s", what, f)
    errors = [f for f in findings if f.level == "error"]
    if errors:
        raise DriftError(f"{what}: " + "; ".join(str(f) for f in errors))


def rope_uses_max_position(config: HeadConfig) -> bool:
    """True when the rotary frequencies depend on max_position_embeddings (dynamic NTK scaling): then it
    cannot be raised without changing the head's function."""
    return config.rope_parameters().get("rope_type") == "dynamic"


__all__ = ["DriftError", "Finding", "check_drift", "raise_on_errors", "rope_uses_max_position"]
