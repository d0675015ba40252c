"""The one error a bad recipe raises, and the one check every section's validation is written with."""
from __future__ import annotations

from typing import Any


class RecipeError(ValueError):
    """A recipe names an unknown key or has a bad value; the message names the key and what is valid."""


def check(cond: bool, key: str, value: Any, expect: str) -> None:
    """Raise RecipeError `key=value: expect` unless `cond`."""
    if not cond:
        raise RecipeError(f"{key}={value!r}: {expect}")
