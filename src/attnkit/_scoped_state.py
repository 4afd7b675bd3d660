"""Scoped state that compiled code must still see.

attnkit keeps what a ``with`` block switches on (a recording, a trace, a backend watch, ring attention, the tile
engine's settings) in :class:`contextvars.ContextVar`\\ s, and ``torch.compile`` cannot trace ``ContextVar.get`` (a
graph break, "Dynamo does not know how to trace method `get` of class `ContextVar`", torch 2.13: tested in
``tests/test_compile.py``). So every such block is also counted here, process-wide, and compiled code reads the
variables only while some block is open somewhere: dynamo guards on ``_ANY_OPEN``, so a compiled model runs
its one graph while no block is open, and is compiled again, reading the variables (a graph break), while one is.
A call is never silently run without the recording or the ring attention that its caller opened.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator
from contextvars import ContextVar
from typing import TypeVar

import torch

__all__ = ["counted", "read"]

T = TypeVar("T")

# Blocks open in the process by kind, and the kinds with one open (what dynamo guards on: the kinds, not the counts,
# so that a compiled model is compiled again once per set of kinds, not at each count; and per kind, since a trace
# adds module hooks a recording's graph did not see). A module-level mutable, on purpose: dynamo's guards can read
# a module's state, not a thread's.
_COUNTS: collections.Counter[str] = collections.Counter()
_ANY_OPEN: list[tuple[str, ...]] = [()]
_LOCK = threading.Lock()


def read(var: ContextVar[T], default: T) -> T:
    """``var.get()``; ``default`` (the variable's own default) while ``torch.compile`` traces and no block is open
    anywhere in the process."""
    if torch.compiler.is_compiling() and not _ANY_OPEN[0]:
        return default
    return var.get()


@contextlib.contextmanager
def counted(kind: str) -> Iterator[None]:
    """Count a block of ``kind`` that sets a scoped variable, while it is open (restored even after an error)."""
    with _LOCK:
        _COUNTS[kind] += 1
        _ANY_OPEN[0] = tuple(sorted(+_COUNTS))
    try:
        yield
    finally:
        with _LOCK:
            _COUNTS[kind] -= 1
            _ANY_OPEN[0] = tuple(sorted(+_COUNTS))
