"""The scope in which this thread's attention calls see a sequence split across processes.

:func:`attnkit.distributed.context_parallel` opens it; :func:`attnkit.functional.attend`, which every attnkit
attention call goes through (the functions, the layers, ``attnkit.d2l`` and the transformers integration), hands
each call made inside it to the scope's :class:`Runner`, which runs it as ring attention over the scope's process
group. ``import attnkit`` imports nothing of :mod:`attnkit.distributed`: that package puts its runner here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any, Protocol

from torch import Tensor

from attnkit import _scoped_state

__all__ = ["Runner", "active", "opened"]


class Runner(Protocol):
    """Runs :func:`attnkit.functional.attend`'s calls on this rank's shard of the sequence."""

    def attend(self, q: Tensor, k: Tensor, v: Tensor, masks: Any, **options: Any) -> Any:
        """:func:`attnkit.functional.attend`'s arguments, after autocast; returns its ``AttendResult``."""

    def refuse(self, what: str) -> None:
        """Raise ``ValueError`` for something that cannot be computed on a shard (``what`` names it)."""

    def whole(self, x: Tensor, dim: int) -> Tensor:
        """Every rank's shard of ``x`` (cut along ``dim``) put together in sequence order, on every rank."""


_ACTIVE: ContextVar[Runner | None] = ContextVar("attnkit_split_sequence", default=None)


def active() -> Runner | None:
    """The runner of the innermost open scope in this thread or task, or ``None`` (the cost: one lookup)."""
    return _scoped_state.read(_ACTIVE, None)


@contextlib.contextmanager
def opened(runner: Runner) -> Iterator[None]:
    """Let ``runner`` run this thread's attention calls until the block ends (restored even after an error)."""
    token = _ACTIVE.set(runner)
    try:
        with _scoped_state.counted("context_parallel"):
            yield
    finally:
        _ACTIVE.reset(token)
