"""Masks: who may attend to whom.

One convention everywhere: a boolean ``True`` means *may attend*. Three ways to say it, which may be given
together and combine (boolean AND; a float mask is a bias added to the scores):

* ``valid_lens``, as in *Dive into Deep Learning*: shape ``(B,)`` lets every query of example ``b`` see its
  first ``valid_lens[b]`` keys; shape ``(B, Lq)`` gives each query its own length.
* ``attn_mask``: boolean, broadcastable to ``(B, H, Lq, Lk)``; or floating point, added to the scores (ALiBi,
  relative positions). In a float mask ``-inf``, and only ``-inf``, means "may not attend": a finite value is a
  bias, however large, and never becomes ``-inf`` (in a cast to the inputs' dtype, or when a score is added to
  it). Where a row's largest visible bias is large (beyond ``BIAS_SHIFT_ABOVE``), the row's bias is shifted by
  it before anything else (the softmax does not change), so that it cannot swamp the scores: a row whose every
  key carries ``-1e30`` (or ``1e4`` with bfloat16 inputs) gives the weights of no bias at all, and the
  gradients agree with them. What remains beyond half the finite range of the dtype is clamped to it.
  ``+inf`` and NaN in a float mask are a ``ValueError``. A float mask holding only 0 and 1 is almost always a
  boolean mask in disguise (it masks nothing): it gives a :class:`FloatMaskWarning`.
* ``is_causal``: query ``i`` sees key ``j`` when ``j <= i + Lk - Lq`` (aligned to the bottom right), so one new
  query decoded against a cache of keys sees the whole cache::

      Lq = Lk = 4        Lq = 2, Lk = 4       Lq = 4, Lk = 2
      1 . . .            1 1 1 .              . .   <- no key: zero weights
      1 1 . .            1 1 1 1              . .
      1 1 1 .                                 1 .
      1 1 1 1                                 1 1

A query row with no key to attend to gets all-zero weights and a zero output, never NaN, and never the
uniform weights over padding that the book's ``-1e6`` fill gives. Which keys some query may see, and which
queries see some key, come from the one combined mask (:meth:`attnkit.masks.Mask.liveness`): every backend zeroes
the other keys, values and queries before it computes, so whatever they hold, NaN included, reaches neither the output
nor any gradient.

The :class:`Mask` keeps these parts apart and builds any block of columns on demand, so the tile engine
never holds the whole ``Lq x Lk`` mask.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from attnkit._validate import as_lengths, check_whole, describe
from attnkit.masks.combined import LIVENESS_BLOCK_ELEMENTS as LIVENESS_BLOCK_ELEMENTS
from attnkit.masks.combined import LIVENESS_ROWS as LIVENESS_ROWS
from attnkit.masks.combined import Mask
from attnkit.masks.parts import FloatMaskWarning, causal_block

__all__ = ["FloatMaskWarning", "Mask", "causal_mask", "masked_softmax", "sequence_mask"]

# B batch, H heads, Lq/Lk query/key length


def sequence_mask(valid_lens: Tensor, num_keys: int) -> Tensor:
    """Boolean mask of the keys each row may see.

    Args:
        valid_lens: ``(B,)`` or ``(B, Lq)``, whole numbers (integer or float dtype).
        num_keys: ``Lk``, the number of key positions.

    Returns:
        ``(B, Lk)`` or ``(B, Lq, Lk)`` boolean, ``True`` where position ``j < valid_lens``.

    Example:
        >>> sequence_mask(torch.tensor([1, 3]), 4)
        tensor([[ True, False, False, False],
                [ True,  True,  True, False]])
    """
    valid_lens = as_lengths(valid_lens, "valid_lens", num_keys)
    positions = torch.arange(num_keys, device=valid_lens.device)  # (Lk,)
    return positions < valid_lens[..., None]  # (B, Lk) or (B, Lq, Lk)


def causal_mask(num_queries: int, num_keys: int, device: torch.device | str | None = None) -> Tensor:
    """Bottom-right aligned causal mask: query ``i`` may see key ``j`` when ``j <= i + Lk - Lq``.

    Returns:
        ``(Lq, Lk)`` boolean.

    Example:
        >>> causal_mask(2, 3)
        tensor([[ True,  True, False],
                [ True,  True,  True]])
    """
    num_queries, num_keys = (
        check_whole("num_queries", num_queries, minimum=0),
        check_whole("num_keys", num_keys, minimum=0),
    )
    return causal_block(num_queries, num_keys, 0, num_keys, device)


def masked_softmax(
    scores: Tensor,
    valid_lens: Tensor | None = None,
    *,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
) -> Tensor:
    """Softmax over the last axis of ``scores`` that only looks at the keys each query may attend to.

    The book's function done right: ``scores`` is never written to (the book's ``sequence_mask`` writes into
    the caller's tensor and fails on a leaf that requires grad); float16/bfloat16 are computed in float32; a
    row with nothing to attend to gets all-zero weights (not uniform weights over padding, not NaN), and its
    gradient is zero and finite.

    Args:
        scores: ``(B, Lq, Lk)`` or ``(B, H, Lq, Lk)`` floating point.
        valid_lens: ``(B,)`` or ``(B, Lq)`` whole numbers, at most ``Lk``.
        attn_mask: boolean (``True`` = may attend) or float bias, broadcastable to ``scores``.
        is_causal: bottom-right aligned causal mask (see the module docstring).

    Returns:
        Weights with the shape and dtype of ``scores``; each row sums to 1, or is all zero.

    Raises:
        ValueError, TypeError: for arguments whose shapes or values do not fit ``scores``.

    Example:
        >>> w = masked_softmax(torch.zeros(2, 1, 4), torch.tensor([2, 0]))
        >>> w
        tensor([[[0.5000, 0.5000, 0.0000, 0.0000]],
        <BLANKLINE>
                [[0.0000, 0.0000, 0.0000, 0.0000]]])
    """
    if not isinstance(scores, Tensor) or not scores.is_floating_point():
        raise TypeError(f"scores must be a floating point tensor, got {describe(scores)}")
    if scores.dim() not in (3, 4):
        raise ValueError(
            f"scores must be (B, Lq, Lk) or (B, H, Lq, Lk), got {scores.dim()} dims: {tuple(scores.shape)}"
        )
    three_d = scores.dim() == 3
    s4 = scores.unsqueeze(1) if three_d else scores  # (B, H, Lq, Lk)
    B, H, Lq, Lk = s4.shape
    mask = Mask.build(
        batch=B,
        heads=H,
        num_queries=Lq,
        num_keys=Lk,
        valid_lens=valid_lens,
        attn_mask=attn_mask,
        is_causal=is_causal,
        mask_dims=3 if three_d else 4,
        device=scores.device,
    )
    compute = compute_dtype(scores.dtype)
    allowed, bias = mask.full(compute)
    weights = softmax_with_mask(s4.to(compute), allowed, bias)  # (B, H, Lq, Lk)
    weights = weights.to(scores.dtype)
    return weights.squeeze(1) if three_d else weights


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half precisions, the dtype itself for float32/float64."""
    return torch.promote_types(dtype, torch.float32)


def softmax_with_mask(
    scores: Tensor,
    allowed: Tensor | None,
    bias: Tensor | None,
    *,
    inplace: bool = False,
    scratch: bool = False,
    empty_rows: bool = True,
    finite: bool | None = None,
) -> Tensor:
    """Softmax of ``scores + bias`` over the allowed keys; rows with none allowed give zeros.

    Masked scores are filled with ``finfo.min`` (finite, so no ``inf - inf``): their ``exp`` is exactly 0 in any row
    with an allowed key. Rows with none would come out uniform: with ``empty_rows`` (the default, the safe side)
    the weights are zeroed where not allowed after the softmax, which zeroes those rows and their gradients; a
    caller that knows no row is empty passes ``empty_rows=False`` and saves that pass and its backward (which then
    reads the weights' gradient once, and drops it where a row may not see only when it is not finite).
    ``inplace=True`` (when no gradient is needed) reuses the memory of ``scores``: no second ``Lq x Lk`` tensor,
    which at ``L = 2048`` halves the time of recording weights (``benchmarks``: ``attnkit bench``,
    ``attnkit+weights``). ``scratch=True``: ``scores`` is the caller's own fresh tensor, which autograd does not
    keep, so the bias and the fill are written into it even when a gradient is needed.

    A score of ``-inf`` (an infinite input, or a product that overflows) hides its key from that query, as the mask
    does: a row whose every allowed score is ``-inf`` gives zeros (the finite fill would otherwise win, and put the
    row's weight on keys it may not see), and the weights where a row may not see are zeros also in a row that NaN
    or ``+inf`` fills. ``finite``: the caller knows that every score the mask allows, with the bias, is finite (True)
    or that some may not be (False); ``None``: one read of the scores finds out.
    """
    if bias is not None:
        scores = scores.add_(bias) if inplace or scratch else scores + bias  # (B, H, Lq, Lk)
    if finite is None:
        finite = all_finite(scores)
    if not finite:
        hidden = torch.isneginf(scores)  # (B, H, Lq, Lk)
        allowed = ~hidden if allowed is None else allowed & ~hidden  # (B, H, Lq, Lk)
        empty_rows = True
    if allowed is None:
        return torch.softmax(scores, dim=-1, out=scores) if inplace else torch.softmax(scores, dim=-1)
    fill = torch.finfo(scores.dtype).min
    scores = scores.masked_fill_(~allowed, fill) if inplace or scratch else scores.masked_fill(~allowed, fill)
    weights = torch.softmax(scores, dim=-1, out=scores) if inplace else torch.softmax(scores, dim=-1)
    if not empty_rows:
        if weights.requires_grad:
            # the gradient of a weight a row may not see is dropped: were it not finite (dout . v overflowing for a
            # huge value some other row sees), the softmax's backward would make it 0 * inf, NaN, in that row
            seen = allowed  # (the hook holds the mask the forward made, and inverts it only where it must)
            weights.register_hook(lambda g: g if g is None or all_finite(g) else g.masked_fill(~seen, 0.0))
        return weights
    return weights.masked_fill_(~allowed, 0.0) if inplace else weights.masked_fill(~allowed, 0.0)


def all_finite(scores: Tensor) -> bool:
    """Whether ``scores`` holds no ``-inf``, ``+inf`` or NaN, from one read: their sum is finite (a sum that overflows
    says no, the safe side; 3x faster than ``aminmax`` on a decode step's row, where it costs 1.4-4 us). Traced by
    ``torch.compile``, it cannot look at the data and answers False (the safe side too)."""
    if torch.compiler.is_compiling():
        return False
    return math.isfinite(scores.detach().sum().item())
