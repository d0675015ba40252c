"""Recipe section `eval` (owned by evaluation/)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EvalSettings:
    pass
