"""The statistics' tile kernel (``attnkit/csrc/stats.cpp``): one float32 tile of :mod:`attnkit.stats.tiled`'s pass,
each row of its scores reduced while it is in cache, where the same steps as torch ops read the whole tile a dozen
times. Loaded by :func:`attnkit.csrc.load` (built ahead of time, or on first use: a C++ compiler and ninja, then
cached); where it cannot be built, the pass runs its torch ops (the same results, slower) and says so once.

``ATTNKIT_STATS_KERNEL=0`` in the environment, or :func:`disabled`, keeps the torch ops.
"""

from __future__ import annotations

import contextlib
import os
import threading
import warnings
from collections.abc import Iterator
from contextvars import ContextVar

import torch
from torch import Tensor

from attnkit import csrc

__all__ = ["available", "disabled", "failed", "tile"]

_LOCK = threading.Lock()
_state: dict[str, bool] = {}  # "built": the op is registered; "failed": the build failed (said once)
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
    """Whether the kernel runs here: built (now, the first time) and not turned off."""
    if _OFF.get() or os.environ.get("ATTNKIT_STATS_KERNEL", "1") == "0":
        return False
    with _LOCK:
        if not _state:
            _state.update(_build())
    return _state.get("built", False)


def _build() -> dict[str, bool]:
    try:
        csrc.load("stats")
        return {"built": True}
    except Exception as error:  # no compiler, no ninja, a build error: the torch ops instead
        _warn("could not be built", error)
        return {"failed": True}


def failed(error: Exception) -> None:
    """The kernel raised while it ran (a runtime unlike the one it was built for): say so, and use the torch ops
    from now on."""
    with _LOCK:
        _state.clear()
        _state["failed"] = True
    _warn("failed", error)


def _warn(what: str, error: Exception) -> None:
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
    warnings.warn(
        f"attnkit: the statistics' tile kernel {what} ({type(error).__name__}: {first_line}); record_stats runs "
        "its torch ops instead (the same results, slower; ATTNKIT_STATS_KERNEL=0 skips the kernel)",
        RuntimeWarning,
        stacklevel=5,
    )


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
