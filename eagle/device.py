"""The device a command runs on, from a recipe's `device` key (target.device, data.device, train.device)."""
from __future__ import annotations

import os

import torch


def pick_device(device: str, local_rank: int | None = None) -> torch.device:
    """`device` as given, or for "auto" this rank's GPU (`local_rank`, default $LOCAL_RANK, else 0) when CUDA is
    available, else the CPU."""
    if device != "auto":
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) if local_rank is None else local_rank)
    return torch.device("cpu")
