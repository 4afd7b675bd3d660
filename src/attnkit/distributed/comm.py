"""The only place that talks to ``torch.distributed``: every collective and exchange waits with a timeout, and a
failure or a silence becomes a :class:`~attnkit.distributed.RingError` that names the step that failed.

Point-to-point exchanges go through :func:`torch.distributed.batch_isend_irecv`, which NCCL needs (a ring of
separate sends and receives can deadlock there) and which gloo runs as separate sends and receives.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["DEFAULT_TIMEOUT", "RingError"]

DEFAULT_TIMEOUT = timedelta(minutes=5)

# dtypes whose names agreement errors can show; any other dtype still gets its own code
_NAMED_DTYPES = (
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
    """Another rank failed, died or did not answer in time; the message names the step that was waiting.

    The process group is not usable afterwards: destroy it (``torch.distributed.destroy_process_group()``)
    and start again, as after any failed collective.
    """


def rank_and_size(group: object | None) -> tuple[int, int]:
    """This process's rank in ``group`` (the default group when ``None``) and the group's size."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: call torch.distributed.init_process_group() first "
            "(torchrun sets the environment it reads)"
        )
    return dist.get_rank(group), dist.get_world_size(group)  # type: ignore[arg-type]


def as_timeout(timeout: float | timedelta | None) -> timedelta:
    """``None`` -> ``DEFAULT_TIMEOUT``; a number of seconds or a ``timedelta``, which must be positive."""
    if timeout is None:
        return DEFAULT_TIMEOUT
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float, timedelta)):
        raise TypeError(f"timeout must be a number of seconds or a timedelta, got {timeout!r}")
    if not isinstance(timeout, timedelta) and not (0 < timeout < 10**9):  # (NaN and infinity fail this too)
        raise ValueError(f"timeout must be positive and finite (seconds), got {timeout!r}")
    wait = timeout if isinstance(timeout, timedelta) else timedelta(seconds=timeout)
    if wait <= timedelta(0):
        raise ValueError(f"timeout must be positive, got {timeout!r}")
    return wait


def dtype_code(dtype: torch.dtype) -> int:
    """A number for ``dtype`` that is the same in every process (a checksum of its name)."""
    return zlib.crc32(str(dtype).encode())


def dtype_name(code: int) -> str:
    """The dtype whose :func:`dtype_code` is ``code``, as text."""
    return next((str(d) for d in _NAMED_DTYPES if dtype_code(d) == code), "another dtype")


@contextlib.contextmanager
def named_failures(step: str, timeout: timedelta) -> Iterator[None]:
    """Turn a failure of ``torch.distributed`` inside the block into a :class:`~attnkit.distributed.RingError` that
    names ``step``."""
    try:
        yield
    except RingError:
        raise
    except RuntimeError as e:  # gloo: "Connection closed by peer", "Timed out waiting ...", ...
        cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise RingError(f"{step} failed (timeout {timeout.total_seconds():g} s): {cause}") from e


def wait(works: list[dist.Work], timeout: timedelta, step: str, parts: tuple[str, ...] = ()) -> None:
    """Wait for ``works``; raise :class:`~attnkit.distributed.RingError` naming ``step`` (and the one of ``parts``,
    one per work, that failed) when one fails or times out."""
    for i, work in enumerate(works):
        which = f"{step} ({parts[i]})" if len(parts) == len(works) else step
        with named_failures(which, timeout):
            if work.wait(timeout) is False:  # gloo raises on a timeout; a backend that returns False is caught too
                raise RingError(f"{which} failed: no answer within the timeout of {timeout.total_seconds():g} s")


def all_gather(t: Tensor, *, group: object | None, timeout: timedelta, step: str) -> list[Tensor]:
    """Every rank's ``t`` (one shape and dtype on every rank), in rank order."""
    _, world = rank_and_size(group)
    out = [torch.empty_like(t) for _ in range(world)]  # W x t.shape
    with named_failures(step, timeout):
        work = dist.all_gather(out, t.contiguous(), group=group, async_op=True)  # type: ignore[arg-type]
    wait([work], timeout, step)
    return out


def gather_checked(
    values: list[int] | None,
    error: Exception | None,
    *,
    size: int,
    who: str,
    group: object | None,
    timeout: timedelta,
    device: torch.device,
) -> list[list[int]]:
    """All-gather ``size`` integers from every rank, with a flag for a rank whose own checks failed.

    That rank raises its ``error`` (naming its rank), the others a ``ValueError`` naming that rank: every rank
    raises at once, none waits for messages that will never come.

    Args:
        values: this rank's ``size`` integers, or ``None`` when ``error`` is given.
        error: what this rank's own checks raised, or ``None``.
        who: the function, for the messages and the step name.
    """
    rank, _ = rank_and_size(group)
    row = torch.zeros(1 + size, dtype=torch.long)  # (1 + size,): failed flag, then the values
    row[0] = error is not None
    if values is not None:
        row[1:] = torch.tensor(values, dtype=torch.long)
    step = f"{who}: agreeing on shapes and options (all-gather of metadata)"
    rows = all_gather(row.to(device), group=group, timeout=timeout, step=step)  # W x (1 + size,)
    if isinstance(error, (ValueError, TypeError)):
        raise type(error)(f"{who} on rank {rank}: {error}") from error
    if error is not None:
        raise error
    failed = [r for r, other in enumerate(rows) if other[0]]
    if failed:
        raise ValueError(f"{who}: rank {failed[0]} rejected its inputs (its error says why); nothing was exchanged")
    return [[int(x) for x in other[1:].tolist()] for other in rows]


class Ring:
    """This rank's neighbours in ``group``: it sends to ``rank + 1`` and receives from ``rank - 1``."""

    def __init__(self, group: object | None) -> None:
        self.group = group
        self.rank, self.size = rank_and_size(group)
        self.next = self._global((self.rank + 1) % self.size)
        self.prev = self._global((self.rank - 1) % self.size)

    def start(self, send: Tensor, recv: Tensor, tag: int, *, timeout: timedelta, step: str) -> list[dist.Work]:
        """Send ``send`` to the next rank and receive ``recv`` from the previous one, without waiting; the works
        are in the order of :meth:`parts`."""
        ops = [
            dist.P2POp(dist.isend, send, self.next, self.group, tag),  # type: ignore[arg-type]
            dist.P2POp(dist.irecv, recv, self.prev, self.group, tag),  # type: ignore[arg-type]
        ]
        with named_failures(step, timeout):
            return dist.batch_isend_irecv(ops)

    def parts(self) -> tuple[str, str]:
        """What each work of :meth:`start` is, for errors: the rank whose connection failed is named."""
        return f"the send to rank {(self.rank + 1) % self.size}", f"the receive from rank {(self.rank - 1) % self.size}"

    def _global(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)  # type: ignore[arg-type]
