"""The only place that chooses a backend.

Policy for ``backend="auto"``, first backend that can run the call wins:

* weights wanted: ``reference`` (the only backend that returns them);
* dot-product scoring: ``sdpa`` (PyTorch's fused kernels), then ``chunked``, then ``reference``;
* additive scoring: ``chunked`` when the ``(B, H, Lq, Lk, D)`` features would be large
  (``>= ADDITIVE_CHUNK_ELEMENTS``), else ``reference``, each falling back to the other.

A backend named explicitly never falls back: if it cannot run the call, a ``ValueError`` lists every
backend's reasons.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from types import ModuleType

from attnkit.backends import ALL
from attnkit.backends.contract import Call

__all__ = ["ADDITIVE_CHUNK_ELEMENTS", "BACKENDS", "available_backends", "choose", "watch"]

BACKENDS: dict[str, ModuleType] = {b.NAME: b for b in ALL}

# 2**22 float32 elements = 16 MiB for one copy of the features; the reference keeps several.
ADDITIVE_CHUNK_ELEMENTS = 2**22

# The watch() blocks open in this thread or task, outermost first.
_WATCHERS: ContextVar[tuple[_Watch, ...]] = ContextVar("attnkit_watchers", default=())


def available_backends() -> list[str]:
    """Names of attnkit's backends. Each runs wherever PyTorch runs (``torch>=2.4``, any device): what one cannot
    run is declared in its ``SUPPORTS`` and said per call, and a backend named explicitly lists every backend's
    reasons.

    Example:
        >>> available_backends()
        ['reference', 'sdpa', 'chunked']
    """
    return list(BACKENDS)


def describe_backends() -> dict[str, str]:
    """For each backend, what it can run, as it declares (``attnkit info`` shows them)."""
    return {name: b.SUPPORTS.describe() for name, b in BACKENDS.items()}


@contextlib.contextmanager
def watch() -> Iterator[list[str]]:
    """Collect the names of the backends that run inside the ``with`` block, in order.

    Only the calls of the thread or asyncio task that opened it are seen. Blocks nest: a call is seen by
    every block open around it.

    Example:
        >>> import torch, attnkit
        >>> with watch() as ran:
        ...     _ = attnkit.scaled_dot_product_attention(torch.ones(1, 2, 4), torch.ones(1, 3, 4),
        ...                                              torch.ones(1, 3, 4), need_weights=True)
        >>> ran
        ['reference']
    """
    seen: list[str] = []
    entry = _Watch(seen)
    _WATCHERS.set((*_WATCHERS.get(), entry))
    try:
        yield seen
    finally:  # blocks may close in any order (contextlib.ExitStack): remove this one, keep the others
        entry.open = False  # an asyncio task made inside the block holds a copy of the tuple: it sees nothing more
        _WATCHERS.set(tuple(w for w in _WATCHERS.get() if w is not entry))


def choose(backend: str, call: Call) -> ModuleType:
    """The backend module that will run ``call`` (see the module docstring for the policy).

    Raises:
        ValueError: ``backend`` is not a backend's name, or the backend named cannot run the call (the message
            gives every backend's reasons, from what each declares in its ``SUPPORTS``).
    """
    if backend == "auto":
        for name in _preferences(call):
            if not BACKENDS[name].SUPPORTS.why_not(call):
                return _ran(BACKENDS[name])
        raise ValueError("no backend can run this call: " + _all_reasons(call))
    if backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {sorted(BACKENDS)}, got {backend!r}")
    chosen = BACKENDS[backend]
    if chosen.SUPPORTS.why_not(call):
        raise ValueError(f"backend={backend!r} cannot run this call: " + _all_reasons(call))
    return _ran(chosen)


def _preferences(call: Call) -> tuple[str, ...]:
    if call.need_weights:
        return ("reference",)
    if call.w_v is None:
        return ("sdpa", "chunked", "reference")
    B, H, Lq, D = call.q.shape
    if B * H * Lq * call.k.shape[2] * D >= ADDITIVE_CHUNK_ELEMENTS:
        return ("chunked", "reference")
    return ("reference", "chunked")


def _all_reasons(call: Call) -> str:
    parts = []
    for name, b in BACKENDS.items():
        reasons = b.SUPPORTS.why_not(call)
        parts.append(f"{name}: {'; '.join(reasons) if reasons else 'can run it'}")
    return " | ".join(parts)


def _ran(backend: ModuleType) -> ModuleType:
    for entry in _WATCHERS.get():
        if entry.open:
            entry.seen.append(backend.NAME)
    return backend


class _Watch:
    """One open watch() block: the list it fills, while it is open."""

    def __init__(self, seen: list[str]) -> None:
        self.seen, self.open = seen, True
