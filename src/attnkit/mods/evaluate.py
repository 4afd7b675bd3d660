"""Running a modifier on a block: with the broadcasting index tensors FlexAttention's functions take, or element
by element through ``torch.vmap`` when a function does not take blocks."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from attnkit._validate import broadcasts
from attnkit.mods.base import MaskFn, MaskMod, ScoreFn, ScoreMod
from attnkit.mods.closure import Uninspectable, read_tensors

__all__ = ["apply_score", "evaluate_mask", "evaluate_score", "indices", "protected_storages"]

# B batch, H heads, Lq'/Lk' the rows and columns of a block


def evaluate_mask(mask_mod: MaskFn, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """``mask_mod`` on a block of broadcasting index tensors, as a bool tensor broadcastable to the block;
    through ``torch.vmap`` element by element when the function does not take blocks.

    Raises:
        TypeError: the function does not return a boolean tensor.
    """
    shape = _block_shape(b, h, q_idx, kv_idx)
    if isinstance(mask_mod, ScoreMod):
        raise TypeError(f"{type(mask_mod).__name__} is a score_mod: pass it as score_mod=, not as a mask_mod")
    out = _on_block(mask_mod, (b, h, q_idx, kv_idx), shape, "mask_mod")
    if out.dtype != torch.bool:
        raise TypeError(f"mask_mod must return a boolean tensor (True = may attend), got dtype {out.dtype}")
    return out.reshape((1,) * (len(shape) - out.dim()) + tuple(out.shape))  # as many dims as the block (a 0-dim True)


def evaluate_score(
    score_mod: ScoreFn,
    score: Tensor,
    b: Tensor,
    h: Tensor,
    q_idx: Tensor,
    kv_idx: Tensor,
    *,
    protected: frozenset[int] | None = frozenset(),
) -> Tensor:
    """``score_mod`` on a block of scores, ``(B, H, Lq', Lk')``, in the scores' dtype and shape: a tensor of the
    caller's own, which it may write into (never memory in ``protected``, the storages the function reads from
    outside, :func:`protected_storages`; ``None``: not known, so never any memory but the score's own)."""
    out = apply_score(score_mod, score, b, h, q_idx, kv_idx)
    # a result that only broadcasts (say, a bias that ignores the score) becomes a block of its own: backends write
    # into it, which an expanded view would refuse
    if out.shape != score.shape:
        return out.expand(score.shape).clone()
    memory = out.untyped_storage().data_ptr()
    if memory == score.untyped_storage().data_ptr():
        return out  # the score's own memory, changed in place or as it was
    if (protected is None or memory in protected) or not _new(out):
        return out.clone()  # memory the function holds (a tensor it keeps, a view of one): never written to
    return out


def apply_score(score_mod: ScoreFn, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """``score_mod`` on a block of scores, in the scores' dtype, broadcastable to their shape: maybe memory it holds
    or the score's own (:func:`evaluate_score` gives a tensor the caller may write into; code that writes nothing,
    such as the graph backend's, which dynamo traces, takes this)."""
    if isinstance(score_mod, MaskMod):
        raise TypeError(f"{type(score_mod).__name__} is a mask_mod: pass it as mask_mod=, not as a score_mod")
    out = _on_block(score_mod, (score, b, h, q_idx, kv_idx), score.shape, "score_mod")
    if not out.is_floating_point():
        raise TypeError(f"score_mod must return the scores (floating point), got dtype {out.dtype}")
    return out.to(score.dtype)


def _new(out: Tensor) -> bool:
    """Whether ``out`` is a tensor no one else holds, in memory no other tensor uses (what an operation inside the
    function returns), so that the caller may write into it: no other Python reference to it (sys.getrefcount
    counts this frame's and its own argument), and its storage used by it alone (torch._C._storage_Use_Count,
    private, checked against torch 2.13: counts the storage object asked for as well). A tensor kept anywhere, in
    an lru_cache or an attribute made at the first call, fails the first test; a view of one, the second."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:  # (the name moved: every result is copied, the safe side)
        return False
    return sys.getrefcount(out) <= 3 and use_count(out.untyped_storage()._cdata) <= 2


def protected_storages(score_mod: ScoreFn, read: Sequence[Tensor] | None = None) -> frozenset[int] | None:
    """The memory (storage addresses) of the tensors ``score_mod`` reads from outside (``read``, or found here),
    which it could return as its result: :func:`evaluate_score` copies a result there before anything writes into
    it. Empty for a built-in (its results are new tensors); ``None`` when the function cannot be looked into."""
    if isinstance(score_mod, ScoreMod):
        return frozenset()
    if read is None:
        try:
            read = read_tensors(score_mod)
        except Uninspectable:
            return None
    return frozenset(t.untyped_storage().data_ptr() for t in read)


def _on_block(fn: Callable[..., Any], args: tuple[Tensor, ...], shape: Sequence[int], what: str) -> Tensor:
    try:
        out = fn(*args)
        if isinstance(out, Tensor) and broadcasts(out.shape, shape):
            return out
    except (RuntimeError, IndexError, TypeError, ValueError) as error:
        first: Exception | None = error
    else:
        first = None
    try:  # element by element, as FlexAttention runs it
        out = _vmapped(fn, args, shape)
    except Exception as error:
        if first is not None:
            raise first from None
        got = f"a tensor of shape {tuple(out.shape)}" if isinstance(out, Tensor) else type(out).__name__
        raise ValueError(
            f"{what} must return a tensor that broadcasts to the block {tuple(shape)}, got {got}"
        ) from error
    if not isinstance(out, Tensor) or tuple(out.shape) != tuple(shape):
        got = f"a tensor of shape {tuple(out.shape)}" if isinstance(out, Tensor) else type(out).__name__
        raise ValueError(
            f"{what} must return one value per (b, h, q_idx, kv_idx): run element by element, it gave {got} for "
            f"the block {tuple(shape)}"
        )
    return out


def _vmapped(fn: Callable[..., Any], args: tuple[Tensor, ...], shape: Sequence[int]) -> Tensor:
    """``fn`` on every element, through nested ``torch.vmap`` over the four index axes (FlexAttention's way)."""
    *score, b, h, q_idx, kv_idx = args
    flat = [b.reshape(-1), h.reshape(-1), q_idx.reshape(-1), kv_idx.reshape(-1)]  # (B,), (H,), (Lq',), (Lk',)
    g = fn
    for axis in (3, 2, 1, 0):  # innermost first: kv, q, h, b; the score, when given, varies along every one
        dims = tuple(0 if i == axis else None for i in range(4))
        g = torch.vmap(g, in_dims=(0, *dims) if score else dims)
    if score:
        return g(score[0].expand(*shape), *flat)  # (B, H, Lq', Lk')
    return g(*flat)  # (B, H, Lq', Lk')


def _block_shape(*indices: Tensor) -> torch.Size:
    return torch.broadcast_shapes(*(t.shape for t in indices))


def indices(batch: int, heads: int, rows: tuple[int, int], cols: tuple[int, int], device: torch.device | None) -> tuple:
    """The broadcasting index tensors of a block: ``b (B, 1, 1, 1)``, ``h (1, H, 1, 1)``, ``q_idx (1, 1, n, 1)`` for
    rows ``[r0, r1)``, ``kv_idx (1, 1, 1, m)`` for columns ``[j0, j1)``."""
    b = torch.arange(batch, device=device).view(batch, 1, 1, 1)  # (B, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, heads, 1, 1)  # (1, H, 1, 1)
    q_idx = torch.arange(*rows, device=device).view(1, 1, -1, 1)  # (1, 1, n, 1)
    kv_idx = torch.arange(*cols, device=device).view(1, 1, 1, -1)  # (1, 1, 1, m)
    return b, h, q_idx, kv_idx
