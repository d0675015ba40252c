"""Recipe sections `head`, `train`, `logging`, `export` (owned by train/)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class HeadSettings:
    bias: bool = True  # fc bias; Llama-3 released heads use False, Vicuna/Llama-2/Mixtral True


@dataclass
class TrainSettings:
    pass


@dataclass
class LoggingSettings:
    pass


@dataclass
class ExportSettings:
    pass
