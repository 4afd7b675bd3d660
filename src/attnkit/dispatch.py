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

from torch import Tensor

from attnkit.backends import ALL
from attnkit.masks import Mask

__all__ = ["ADDITIVE_CHUNK_ELEMENTS", "BACKENDS", "available_backends", "choose", "watch"]

BACKENDS: dict[str, ModuleType] = {b.NAME: b for b in ALL}

# 2**22 float32 elements = 16 MiB for one copy of the features; the reference keeps several.
ADDITIVE_CHUNK_ELEMENTS = 2**22

# The watch() blocks open in this thread or task, outermost first.
_WATCHERS: ContextVar[tuple[_Watch, ...]] = ContextVar("attnkit_watchers", default=())


def available_backends() -> list[str]:
    """Names of attnkit's backends. Each runs wherever PyTorch runs (``torch>=2.4``, any device): what one cannot
    run is said per call, by its ``why_not``, and a backend named explicitly lists every backend's reasons.

    Example:
        >>> available_backends()
        ['reference', 'sdpa', 'chunked']
    """
    return list(BACKENDS)


def describe_backends() -> dict[str, str]:
    """For each backend, the first line of its module docstring (``attnkit info`` shows them)."""
    return {name: (b.__doc__ or "").strip().splitlines()[0] for name, b in BACKENDS.items()}


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


def choose(
    backend: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Mask,
    *,
    w_v: Tensor | None,
    scale: float,
    dropout_p: float,
    need_weights: bool,
) -> ModuleType:
    """The backend module that will run this call (see the module docstring for the policy)."""
    call = {"w_v": w_v, "scale": scale, "dropout_p": dropout_p, "need_weights": need_weights}
    if backend == "auto":
        for name in _preferences(q, k, w_v, need_weights):
            if not BACKENDS[name].why_not(q, k, v, mask, **call):
                return _ran(BACKENDS[name])
        raise ValueError("no backend can run this call: " + _all_reasons(q, k, v, mask, call))
    if backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {sorted(BACKENDS)}, got {backend!r}")
    chosen = BACKENDS[backend]
    if chosen.why_not(q, k, v, mask, **call):
        raise ValueError(f"backend={backend!r} cannot run this call: " + _all_reasons(q, k, v, mask, call))
    return _ran(chosen)


def _preferences(q: Tensor, k: Tensor, w_v: Tensor | None, need_weights: bool) -> tuple[str, ...]:
    if need_weights:
        return ("reference",)
    if w_v is None:
        return ("sdpa", "chunked", "reference")
    B, H, Lq, D = q.shape
    if B * H * Lq * k.shape[2] * D >= ADDITIVE_CHUNK_ELEMENTS:
        return ("chunked", "reference")
    return ("reference", "chunked")


def _all_reasons(q: Tensor, k: Tensor, v: Tensor, mask: Mask, call: dict) -> str:
    parts = []
    for name, b in BACKENDS.items():
        reasons = b.why_not(q, k, v, mask, **call)
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
