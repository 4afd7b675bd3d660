"""The parts of a mask as a call gives them, checked: a float ``attn_mask`` (no NaN, no ``+inf``, a warning for
0/1 masks), any mask's shape against the call's, and the causal mask's blocks."""

from __future__ import annotations

import math
import sys
import warnings

import torch
from torch import Tensor

from attnkit._validate import broadcasts, describe
from attnkit._value_checks import checked, value_check

__all__ = ["FloatMaskWarning", "as_4d_mask", "causal_block", "check_bias"]

# B batch, H heads, Lq/Lk query/key length, blk a block of keys [j0, j1)


class FloatMaskWarning(UserWarning):
    """A float ``attn_mask`` that holds only 0 and 1: it is added to the scores, so it masks nothing."""


def _finite_range(bias: Tensor) -> tuple[float, float]:
    finite = bias.detach().masked_fill(torch.isneginf(bias), 0.0)
    lo, hi = finite.aminmax()
    return float(lo), float(hi)


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside attnkit and torch (the user's call), seen from the caller."""
    level, frame = 1, sys._getframe(1)
    while frame.f_back is not None and frame.f_globals.get("__name__", "").split(".")[0] in ("attnkit", "torch"):
        frame, level = frame.f_back, level + 1
    return level


def check_bias(attn_mask: Tensor) -> tuple[tuple[float, float], bool]:
    """Check a float mask once (one pass, one host sync): no NaN, no ``+inf``; warn for 0/1 masks.

    Returns:
        The smallest and largest finite values, and whether it holds ``-inf``.
    """
    if attn_mask.numel() == 0:
        return (0.0, 0.0), False
    attn_mask = attn_mask.detach()  # values only: a bias that requires grad keeps it, elsewhere
    lo_t, hi_t = attn_mask.aminmax()  # NaN anywhere makes both NaN
    lo, hi = float(lo_t), float(hi_t)
    if lo != lo or hi != hi:
        where = tuple(torch.isnan(attn_mask).nonzero()[0].tolist())
        raise ValueError(
            f"attn_mask holds NaN (first at index {where} of shape {tuple(attn_mask.shape)}): a float mask holds "
            f"finite biases, and -inf where a query may not attend (a NaN often comes from -inf * 0)"
        )
    if hi == float("inf"):
        where = tuple(torch.isposinf(attn_mask).nonzero()[0].tolist())
        raise ValueError(
            f"attn_mask holds +inf (first at index {where} of shape {tuple(attn_mask.shape)}): +inf has no meaning "
            f"as a bias; use -inf (or False in a boolean mask) where a query may not attend"
        )
    has_neg_inf = lo == float("-inf")
    if has_neg_inf:
        lo, hi = _finite_range(attn_mask)
    if lo == 0.0 and hi == 1.0 and bool(((attn_mask == 0) | (attn_mask == 1)).all()):
        warnings.warn(
            "attn_mask is a float tensor holding only 0 and 1: it is added to the scores as a bias, so it masks "
            "nothing. For a mask pass a boolean tensor, True = may attend (attn_mask.bool()); to keep it as a bias, "
            "silence this with warnings.filterwarnings('ignore', category=attnkit.masks.FloatMaskWarning)",
            FloatMaskWarning,
            stacklevel=_caller_level(),  # the user's line: shown once per line under the default filters
        )
    return (lo, hi), has_neg_inf


def causal_block(
    Lq: int, Lk: int, j0: int, j1: int, device: torch.device | str | None, r0: int = 0, r1: int | None = None
) -> Tensor:
    """The bottom-right causal mask of queries ``[r0, r1)`` (all by default) and keys ``[j0, j1)``."""
    rows = torch.arange(r0, Lq if r1 is None else r1, device=device)[:, None]  # (n, 1)
    cols = torch.arange(j0, j1, device=device)[None, :]  # (1, blk)
    return cols <= rows + (Lk - Lq)  # (n, blk)


def as_4d_mask(attn_mask: Tensor, B: int, H: int, Lq: int, Lk: int, mask_dims: int) -> Tensor:
    """A view of ``attn_mask`` with 4 dims, broadcastable to ``(B, H, Lq, Lk)``."""
    if not isinstance(attn_mask, Tensor):
        raise TypeError(f"attn_mask must be a tensor, got {describe(attn_mask)}")
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise TypeError(
            f"attn_mask must be boolean (True = may attend) or floating point (added to the scores), "
            f"got dtype {attn_mask.dtype}"
        )
    target = (B, Lq, Lk) if mask_dims == 3 else (B, H, Lq, Lk)
    shape = tuple(attn_mask.shape)
    if not broadcasts(shape, target):
        names = "(B, Lq, Lk)" if mask_dims == 3 else "(B, H, Lq, Lk)"
        raise ValueError(f"attn_mask of shape {shape} is not broadcastable to {names} = {target}")
    m = attn_mask.reshape((1,) * (mask_dims - len(shape)) + shape)  # (B|1, [H|1,] Lq|1, Lk|1)
    return m.unsqueeze(1) if mask_dims == 3 else m  # (B|1, H|1, Lq|1, Lk|1)


@value_check("float mask")
def _float_mask_values(attn_mask: Tensor, name: str, bound: int, what: str) -> None:
    check_bias(attn_mask)


def checked_bias(attn_mask: Tensor, view: Tensor) -> tuple[Tensor, tuple[float, float], bool]:
    """:func:`check_bias` of a float mask, and ``view`` (its 4-dim view): eagerly, now; while ``torch.compile``
    traces, as the compiled code runs (``attnkit::check_values``), its range then unknown (every block is shifted and
    clamped) and ``-inf`` assumed."""
    if torch.compiler.is_compiling():
        return checked(attn_mask, "float mask", "attn_mask", keep=view), (-math.inf, math.inf), True
    bias_range, has_neg_inf = check_bias(attn_mask)
    return view, bias_range, has_neg_inf
