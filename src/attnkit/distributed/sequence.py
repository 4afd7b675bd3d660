"""How a sequence is split across the ranks of a group, and the helpers that apply and undo the split.

Two layouts, both defined for any length ``L >= W`` (``W`` ranks); pieces are cut as by
:func:`torch.tensor_split`, so when ``L`` is not a multiple, the first pieces are one position longer:

* ``"contiguous"``: rank ``r`` holds piece ``r`` of ``W``.
* ``"zigzag"``: the sequence is cut into ``2W`` chunks and rank ``r`` holds chunks ``r`` and ``2W-1-r``. With a
  causal mask, every rank then has about the same number of (query, key) pairs to score: each rank's early
  chunk sees little, its late chunk sees much. For ``L = 8`` over ``W = 2``::

      positions  0 1 2 3 4 5 6 7
      contiguous 0 0 0 0 1 1 1 1      rank 0 scores 10 causal pairs, rank 1 scores 26
      zigzag     0 0 1 1 1 1 0 0      18 each

Example:
    >>> segments(8, 2, "zigzag")
    [[(0, 2), (6, 8)], [(2, 4), (4, 6)]]
    >>> segments(7, 3, "contiguous")
    [[(0, 3)], [(3, 5)], [(5, 7)]]
"""

from __future__ import annotations

from datetime import timedelta

import torch
from torch import Tensor

from attnkit.distributed import comm

__all__ = ["LAYOUTS", "gather_sequence", "positions", "segments", "shard_sequence"]

LAYOUTS = ("contiguous", "zigzag")
_MAX_DIMS = 16

# W world size, L sequence length, L_r the positions rank r holds


def check_layout(layout: object) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def segments(length: int, world_size: int, layout: str) -> list[list[tuple[int, int]]]:
    """For each rank, the ``[start, stop)`` ranges of the sequence it holds, in the order it holds them.

    Raises:
        ValueError: an unknown layout, or fewer positions than ranks (a rank would hold nothing).
    """
    check_layout(layout)
    if length < world_size:
        raise ValueError(
            f"a sequence of {length} positions cannot be split over {world_size} ranks: each rank needs at least one"
        )
    if layout == "contiguous":
        return [[piece] for piece in _pieces(length, world_size)]
    chunks = _pieces(length, 2 * world_size)
    return [[chunks[r], chunks[2 * world_size - 1 - r]] for r in range(world_size)]


def positions(ranges: list[tuple[int, int]], device: torch.device | str | None = None) -> Tensor:
    """The sequence positions a rank holds, ``(L_r,)`` int64, from its :func:`segments`."""
    return torch.cat([torch.arange(a, b, device=device) for a, b in ranges])  # (L_r,)


def shard_sequence(x: Tensor, *, layout: str = "contiguous", dim: int = -2, group: object | None = None) -> Tensor:
    """This rank's shard of the whole sequence ``x`` (every rank passes the same ``x``).

    Args:
        x: the whole sequence, ``L`` positions along ``dim`` (``(B, H, L, D)`` by default).
        layout: ``"contiguous"`` or ``"zigzag"`` (see the module docstring).
        dim: the sequence axis.
        group: a ``torch.distributed`` process group; the default group when ``None``.

    Returns:
        A new tensor with this rank's ``L_r`` positions along ``dim``.

    Example:
        On rank 1 of 2, ``shard_sequence(torch.arange(8)[None], layout="zigzag", dim=-1)`` is
        ``tensor([[2, 3, 4, 5]])``.
    """
    rank, world = comm.rank_and_size(group)
    dim = _axis(x, dim)
    ranges = segments(x.shape[dim], world, layout)[rank]
    return torch.cat([x.narrow(dim, a, b - a) for a, b in ranges], dim)  # (..., L_r, ...)


def gather_sequence(
    x: Tensor,
    *,
    layout: str = "contiguous",
    dim: int = -2,
    group: object | None = None,
    timeout: float | timedelta | None = None,
) -> Tensor:
    """Undo :func:`shard_sequence`: every rank gets the whole sequence back, in sequence order.

    Args:
        x: this rank's shard, ``L_r`` positions along ``dim``; the other dims must agree across ranks.
        layout, dim, group: as given to :func:`shard_sequence`.
        timeout: seconds (or a ``timedelta``) to wait for the other ranks; :data:`comm.DEFAULT_TIMEOUT` when ``None``.

    Returns:
        The whole sequence, ``L = sum(L_r)`` positions along ``dim``.

    Raises:
        ValueError: shapes that differ across ranks other than along ``dim``, or shards that are not the split
            ``layout`` gives.
        RingError: a rank failed or did not answer within ``timeout``.
    """
    check_layout(layout)
    rank, world = comm.rank_and_size(group)
    dim = _axis(x, dim)
    wait = comm.as_timeout(timeout)
    shape = list(x.shape)
    if x.dim() > _MAX_DIMS:
        raise ValueError(f"gather_sequence takes at most {_MAX_DIMS} dims, got {tuple(x.shape)}")
    meta = torch.zeros(3 + _MAX_DIMS, dtype=torch.long)  # ndim, axis, dtype, then the shape
    meta[:3] = torch.tensor([x.dim(), dim, comm.dtype_code(x.dtype)])
    meta[3 : 3 + x.dim()] = torch.tensor(shape)
    metas = comm.all_gather(meta.to(x.device), group=group, timeout=wait, step="gather_sequence: agreeing on shapes")
    mine = _other_dims(metas[rank])
    for r, other in enumerate(metas):
        if _other_dims(other) != mine:
            raise ValueError(
                f"gather_sequence: ranks {rank} and {r} hold shards that differ apart from the sequence axis: "
                f"rank {rank} has {tuple(x.shape)} {x.dtype} (dim {dim}), "
                f"rank {r} has {_shape(other)} {comm.DTYPES[int(other[2])]} (dim {int(other[1])})"
            )
    counts = [_shape(m)[dim] for m in metas]
    expected = [sum(b - a for a, b in ranges) for ranges in segments(sum(counts), world, layout)]
    if counts != expected:
        raise ValueError(
            f"gather_sequence: ranks hold {counts} positions, but the {layout} split of {sum(counts)} positions "
            f"over {world} ranks is {expected}"
        )
    longest = max(counts)
    padded = torch.zeros((*shape[:dim], longest, *shape[dim + 1 :]), dtype=x.dtype, device=x.device)
    padded.narrow(dim, 0, counts[rank]).copy_(x)  # all_gather needs one shape on every rank
    shards = comm.all_gather(padded, group=group, timeout=wait, step="gather_sequence: shards")
    whole = x.new_empty((*shape[:dim], sum(counts), *shape[dim + 1 :]))  # (..., L, ...)
    for shard, ranges in zip(shards, segments(sum(counts), world, layout), strict=True):
        at = 0
        for a, b in ranges:
            whole.narrow(dim, a, b - a).copy_(shard.narrow(dim, at, b - a))
            at += b - a
    return whole


def _pieces(length: int, parts: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of ``parts`` pieces as :func:`torch.tensor_split` cuts them: the first are longer."""
    size, extra = divmod(length, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + size + (i < extra))
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def _shape(meta: Tensor) -> tuple[int, ...]:
    ndim = int(meta[0])
    return tuple(int(n) for n in meta[3 : 3 + ndim].tolist())


def _other_dims(meta: Tensor) -> tuple[int, ...]:
    """What must agree across ranks: the number of dims, the axis, the dtype and every size but the length."""
    shape, axis = list(_shape(meta)), int(meta[1])
    shape[axis] = -1
    return (len(shape), axis, int(meta[2]), *shape)


def _axis(x: Tensor, dim: int) -> int:
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a tensor, got {type(x).__name__}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim {dim} is out of range for a tensor of shape {tuple(x.shape)}")
    return dim % x.dim()
