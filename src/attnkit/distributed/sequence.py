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

__all__ = ["LAYOUTS", "gather_sequence", "length", "positions", "segments", "shard_sequence"]

LAYOUTS = ("contiguous", "zigzag")
_MAX_DIMS = 16
_META = 4 + _MAX_DIMS  # what gather_sequence all-gathers: layout, ndim, axis, dtype, then the shape

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


def length(ranges: list[tuple[int, int]]) -> int:
    """How many positions a rank holds, ``L_r``, from its :func:`segments`."""
    return sum(b - a for a, b in ranges)


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
        timeout: seconds (or a ``timedelta``) to wait for the other ranks; ``DEFAULT_TIMEOUT`` when ``None``.

    Returns:
        The whole sequence, ``L = sum(L_r)`` positions along ``dim``: a new tensor, outside autograd (no
        gradient flows back to ``x``).

    Raises:
        ValueError, TypeError: on every rank, when the shards differ across ranks other than in length (dims,
            dtype, layout), are not the split ``layout`` gives, or a rank's own arguments are wrong.
        RingError: a rank failed or did not answer within ``timeout``.
    """
    rank, world = comm.rank_and_size(group)
    error: Exception | None = None
    meta: list[int] | None = None
    wait = comm.DEFAULT_TIMEOUT
    try:  # this rank's own checks; every rank learns of a failure in the all-gather below
        wait = comm.as_timeout(timeout)
        check_layout(layout)
        dim = _axis(x, dim)
        if x.dim() > _MAX_DIMS:
            raise ValueError(f"gather_sequence takes at most {_MAX_DIMS} dims, got {tuple(x.shape)}")
        meta = [LAYOUTS.index(layout), x.dim(), dim, comm.dtype_code(x.dtype), *x.shape]
        meta += [0] * (_META - len(meta))
    except Exception as e:  # noqa: BLE001 - every rank must hear of it; gather_checked raises it here
        error = e
    device = x.device if isinstance(x, Tensor) else torch.device("cpu")
    metas = comm.gather_checked(
        meta, error, size=_META, who="gather_sequence", group=group, timeout=wait, device=device
    )
    mine = _other_dims(metas[rank])
    for r, other in enumerate(metas):
        if _other_dims(other) != mine:
            raise ValueError(
                f"gather_sequence: ranks {rank} and {r} hold shards that differ apart from the sequence: "
                f"rank {rank} has {_describe(metas[rank])}, rank {r} has {_describe(other)}"
            )
    counts = [_shape(m)[dim] for m in metas]
    ranges = segments(sum(counts), world, layout)
    expected = [length(r) for r in ranges]
    if counts != expected:
        raise ValueError(
            f"gather_sequence: ranks hold {counts} positions, but the {layout} split of {sum(counts)} positions "
            f"over {world} ranks is {expected}"
        )
    shape = list(x.shape)
    padded = x.new_zeros((*shape[:dim], max(counts), *shape[dim + 1 :]))  # (..., max L_r, ...)
    padded.narrow(dim, 0, counts[rank]).copy_(x)  # all_gather needs one shape on every rank
    shards = comm.all_gather(
        padded, group=group, timeout=wait, step="gather_sequence: shards"
    )  # W x (..., max L_r, ...)
    whole = x.new_empty((*shape[:dim], sum(counts), *shape[dim + 1 :]))  # (..., L, ...)
    for shard, held in zip(shards, ranges, strict=True):
        at = 0
        for a, b in held:
            whole.narrow(dim, a, b - a).copy_(shard.narrow(dim, at, b - a))
            at += b - a
    return whole


def _pieces(n: int, parts: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of ``parts`` pieces of ``n`` as :func:`torch.tensor_split` cuts them: the first are longer."""
    size, extra = divmod(n, parts)
    bounds = [0]
    for i in range(parts):
        bounds.append(bounds[-1] + size + (i < extra))
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def _shape(meta: list[int]) -> tuple[int, ...]:
    return tuple(meta[4 : 4 + meta[1]])


def _other_dims(meta: list[int]) -> tuple[int, ...]:
    """What must agree across ranks: the layout, the number of dims, the axis, the dtype and every size but
    the sequence length."""
    shape = list(_shape(meta))
    shape[meta[2]] = -1
    return (*meta[:4], *shape)


def _describe(meta: list[int]) -> str:
    layout, ndim, dim, dtype = meta[:4]
    return f"{_shape(meta)} {comm.dtype_name(dtype)} (dim {dim}, layout {LAYOUTS[layout]!r})"


def _axis(x: Tensor, dim: int) -> int:
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a tensor, got {type(x).__name__}")
    if not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim {dim} is out of range for a tensor of shape {tuple(x.shape)}")
    return dim % x.dim()
