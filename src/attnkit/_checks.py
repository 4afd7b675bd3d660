"""Small checks every module's argument errors share (one wording for every message)."""

from __future__ import annotations

import torch
from torch import Tensor


def describe(x: object) -> str:
    """What a user passed, for an error message: a tensor's dtype and shape, or another object's type."""
    if isinstance(x, Tensor):
        return f"tensor of dtype {x.dtype} and shape {tuple(x.shape)}"
    return type(x).__name__


def check_device(name: str, t: Tensor, device: torch.device | None) -> None:
    """``t`` is on ``device`` (when one is given), or a ``ValueError`` naming both."""
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but the inputs are on {device}")
