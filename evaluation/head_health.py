"""One-line warnings for a head that cannot draft: non-finite weights (a NaN head drafts garbage, every draft is
rejected and decoding stays lossless but no faster) and an acceptance of exactly 1.0 (not one drafted token accepted
over a whole run). `evaluation/main.py` (bench, serve-check) and `evaluation/serve_check.py` print them; the numbers
still go to the report."""
from __future__ import annotations

import logging

from eagle.head_checks import MAX_LISTED, non_finite

log = logging.getLogger("evaluation")


def weights_warning(head, head_path: str) -> str | None:
    """The warning for a loaded head module whose weights hold NaN/inf (None when they are finite)."""
    bad = non_finite({k: v for k, v in head.state_dict().items() if not k.startswith("embed_tokens")})
    if not bad:
        return None
    return (f"head {head_path} has non-finite weights (NaN/inf in {bad[:MAX_LISTED]}): it cannot draft, every draft "
            "will be rejected (tau 1.0); re-export it from a good checkpoint")


def acceptance_warning(what: str, head_path: str, mean_length: float, rounds: int) -> str | None:
    """The warning for an acceptance (tau, or mean acceptance length) of exactly 1.0 over `rounds` > 0 rounds."""
    if rounds <= 0 or mean_length != 1.0:
        return None
    return (f"{what}: head {head_path} had acceptance exactly 1.0 over {rounds} rounds (not one drafted token "
            "accepted): its weights or its target are wrong (check python -m train.export / the head's config)")


def warn(message: str | None) -> None:
    if message:
        log.warning(message)
