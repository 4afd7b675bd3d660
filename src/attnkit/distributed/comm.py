"""The only place that talks to ``torch.distributed``: every collective and exchange waits with a timeout, and a
failure or a silence becomes a :class:`RingError` that names the step that failed.

Point-to-point exchanges go through :func:`torch.distributed.batch_isend_irecv`, which NCCL needs (a ring of
separate sends and receives can deadlock there) and which gloo runs as separate sends and receives.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["DEFAULT_TIMEOUT", "RingError"]

DEFAULT_TIMEOUT = timedelta(minutes=5)

DTYPES = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.complex128,
)


class RingError(RuntimeError):
    """Another rank failed, died or did not answer in time; the message names the step that was waiting."""


def rank_and_size(group: object | None) -> tuple[int, int]:
    """This process's rank in ``group`` (the default group when ``None``) and the group's size."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: call torch.distributed.init_process_group() first "
            "(torchrun sets the environment it reads)"
        )
    return dist.get_rank(group), dist.get_world_size(group)  # type: ignore[arg-type]


def as_timeout(timeout: float | timedelta | None) -> timedelta:
    """``None`` -> :data:`DEFAULT_TIMEOUT`; a number of seconds or a ``timedelta``, which must be positive."""
    if timeout is None:
        return DEFAULT_TIMEOUT
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float, timedelta)):
        raise TypeError(f"timeout must be a number of seconds or a timedelta, got {timeout!r}")
    wait = timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)
    if wait <= timedelta(0):
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    return wait


def dtype_code(dtype: torch.dtype) -> int:
    """A small integer for ``dtype`` that every rank agrees on (``len(DTYPES)`` for any other dtype)."""
    return DTYPES.index(dtype) if dtype in DTYPES else len(DTYPES)


def wait(works: list[dist.Work], timeout: timedelta, step: str) -> None:
    """Wait for ``works``; raise :class:`RingError` naming ``step`` when one fails or times out."""
    for work in works:
        try:
            done = work.wait(timeout)
        except RuntimeError as e:  # gloo: "Connection closed by peer", "Timed out waiting ...", ...
            cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise RingError(f"{step} failed (timeout {timeout.total_seconds():g} s): {cause}") from e
        if done is False:
            raise RingError(f"{step} failed: no answer within the timeout of {timeout.total_seconds():g} s")


def all_gather(t: Tensor, *, group: object | None, timeout: timedelta, step: str) -> list[Tensor]:
    """Every rank's ``t`` (one shape and dtype on every rank), in rank order."""
    _, world = rank_and_size(group)
    out = [torch.empty_like(t) for _ in range(world)]
    work = dist.all_gather(out, t.contiguous(), group=group, async_op=True)  # type: ignore[arg-type]
    wait([work], timeout, step)
    return out


class Ring:
    """This rank's neighbours in ``group``: it sends to ``rank + 1`` and receives from ``rank - 1``."""

    def __init__(self, group: object | None, timeout: timedelta) -> None:
        self.group = group
        self.timeout = timeout
        self.rank, self.size = rank_and_size(group)
        self.next = self._global((self.rank + 1) % self.size)
        self.prev = self._global((self.rank - 1) % self.size)

    def start(self, send: Tensor, recv: Tensor, tag: int) -> list[dist.Work]:
        """Send ``send`` to the next rank and receive ``recv`` from the previous one, without waiting."""
        ops = [
            dist.P2POp(dist.isend, send, self.next, self.group, tag),  # type: ignore[arg-type]
            dist.P2POp(dist.irecv, recv, self.prev, self.group, tag),  # type: ignore[arg-type]
        ]
        return dist.batch_isend_irecv(ops)

    def _global(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)  # type: ignore[arg-type]
