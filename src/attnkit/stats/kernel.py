"""The statistics' tile kernel (``attnkit/csrc/stats.cpp``): one float32 tile of :mod:`attnkit.stats.tiled`'s pass,
each row of its scores reduced while it is in cache, where the same steps as torch ops read the whole tile a dozen
times. Loaded by :func:`attnkit.csrc.load` (built ahead of time, or on first use: a C++ compiler and ninja, then
cached); where it cannot be built, the pass runs its torch ops (the same results, slower) and says so once.

``ATTNKIT_STATS_KERNEL=0`` in the environment, or :func:`disabled`, keeps the torch ops.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

import torch
from torch import Tensor

from attnkit import csrc

__all__ = ["available", "disabled", "failed", "tile"]

_OFF: ContextVar[bool] = ContextVar("attnkit_stats_kernel_off", default=False)


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within it, the tiled pass runs its torch ops, not the kernel (the tests hold the two equal)."""
    token = _OFF.set(True)
    try:
        yield
    finally:
        _OFF.reset(token)


def available() -> bool:
    """Whether the kernel runs here: loaded (built now, the first time: :func:`attnkit.csrc.ensure`) and not turned
    off."""
    return not _OFF.get() and csrc.ensure("stats") is None


def failed(error: Exception) -> None:
    """The kernel raised while it ran (a runtime unlike the one it was built for): say so, and use the torch ops
    from now on."""
    csrc.failed("stats", error)


def tile(
    t: Tensor,
    shift: Tensor,
    qpos: Tensor,
    a: int,
    real: int,
    causal: bool,
    sink_keys: int,
    n: int,
    sums: Tensor,
    column: Tensor,
    top: tuple[Tensor, Tensor, Tensor],
) -> None:
    """One tile (``stats.cpp`` says what each argument is; ``top``: the top-k's scores, values and indices); only
    where :func:`available`."""
    torch.ops.attnkit_stats.tile(t, shift, qpos, a, real, causal, sink_keys, n, sums, column, *top)
