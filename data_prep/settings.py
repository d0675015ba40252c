"""Recipe section `data`: data preparation settings (owned by data_prep/)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DataSettings:
    pass
