"""Recording attention weights: :func:`record_weights`, and :func:`report_weights`, which every attention module
calls after its forward (attnkit's layers, :mod:`attnkit.d2l`, the transformers integration).

Weights are kept only when asked, so the fast path stays fast::

    with attnkit.record_weights(model) as rec:
        model(x)
    rec["encoder.attention"]            # (B, H, Lq, Lk), pre-dropout, detached

While recording, the differentiable output still comes from the fast backend; the weights are computed beside it
(by the reference math, under ``torch.no_grad()``): they are for looking at, not for a loss.

A recording belongs to the thread or asyncio task that opened it (the open recordings live in a
:class:`contextvars.ContextVar`, never on the modules, so ``copy.deepcopy(model)`` copies none of it).
Recordings nest and overlap: each one sees every call, made while it is open, of the modules it records.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar

from torch import Tensor, nn

from attnkit._checks import describe

__all__ = ["WeightRecord", "is_recording", "record_weights", "recorder", "report_weights"]

# B batch, H heads, Lq/Lk query/key length


class WeightRecord(dict):
    """``rec[name]``: the weights of the last call of the attention module called ``name`` in the model
    (``""`` for the model itself); ``rec.calls(name)``: those of every call, in order."""

    def __init__(self) -> None:
        super().__init__()
        self._calls: dict[str, list[Tensor]] = {}
        self.kv_heads: dict[str, int] = {}  # modules with grouped-query heads: their key/value heads

    def add(self, name: str, weights: Tensor, kv_heads: int | None = None) -> None:
        self._calls.setdefault(name, []).append(weights)
        self[name] = weights
        if kv_heads is not None and weights.dim() == 4 and kv_heads < weights.shape[1]:
            self.kv_heads[name] = kv_heads

    def calls(self, name: str) -> list[Tensor]:
        return list(self._calls.get(name, []))


class _Recording:
    """One open ``record_weights`` block: the record it fills, and the name of each module it records."""

    def __init__(self, model: nn.Module) -> None:
        self.record = WeightRecord()
        named = list(model.named_modules())
        self.names = {id(m): name for name, m in named}
        # Held while the block is open, so that no module made meanwhile (a deepcopy) can reuse one of these ids.
        self._modules = [m for _, m in named]

    def close(self) -> None:
        # A context copied inside the block (an asyncio task) may outlive it: it then records nothing.
        self.names, self._modules = {}, []


# The recordings open in this thread or task, outermost first.
_RECORDINGS: ContextVar[tuple[_Recording, ...]] = ContextVar("attnkit_recordings", default=())


def is_recording() -> bool:
    """Whether some recording is open in this thread or task (the cost of asking: one lookup)."""
    return bool(_RECORDINGS.get())


def recorder(module: nn.Module) -> tuple[WeightRecord, str] | None:
    """``(record, name)`` of the first recording open in this thread or task that records ``module``, else
    ``None``. Nothing is stored on the module."""
    for recording in _RECORDINGS.get():
        name = recording.names.get(id(module))
        if name is not None:
            return recording.record, name
    return None


def report_weights(
    module: nn.Module, weights: Tensor | Callable[[], Tensor] | None, *, kv_heads: int | None = None
) -> None:
    """Give the attention weights of one call of ``module`` to every recording, open in this thread or task,
    that records it. Attention modules call this after each forward.

    Args:
        module: the module that ran.
        weights: the pre-dropout weights, or a function that computes them, called once, only if recorded;
            ``None`` (a call without weights) records nothing.
        kv_heads: the call's key/value heads, when fewer than its query heads (grouped-query attention): kept in
            ``record.kv_heads`` (the viewer groups the heads by it).
    """
    recordings = _RECORDINGS.get()
    if not recordings or weights is None:  # the cost while nothing records: one lookup
        return
    wanted = [(r.record, r.names[id(module)]) for r in recordings if id(module) in r.names]
    if not wanted:
        return
    kept = (weights if isinstance(weights, Tensor) else weights()).detach()
    for record, name in wanted:
        record.add(name, kept, kv_heads)


@contextlib.contextmanager
def record_weights(model: nn.Module) -> Iterator[WeightRecord]:
    """Record the pre-dropout attention weights of every attention module inside ``model``.

    attnkit's layers and those of :mod:`attnkit.d2l` are recorded (a ``d2l.MultiHeadAttention`` in attnkit's
    layout ``(B, H, Lq, Lk)``, and its inner ``.attention`` in the book's ``(B*H, Lq, Lk)``: one tensor, two
    views), and Hugging Face models with attnkit registered (:mod:`attnkit.integrations.transformers`). Only the
    calls of the thread or asyncio task that opened the block are recorded, and only those of the modules inside
    ``model`` when it opened (a copy made inside the block is another module). Blocks nest and overlap, on the
    same model or on a part of it: each records every call made while it is open.

    Args:
        model: any module; the attention modules inside it (or ``model`` itself) are recorded.

    Yields:
        A :class:`WeightRecord`, filled as the model runs; keys are module names from ``named_modules()``.

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module``.

    Example:
        >>> import attnkit
        >>> mha = attnkit.MultiHeadAttention(8, 2)
        >>> x = torch.randn(1, 3, 8)
        >>> with record_weights(mha) as rec:
        ...     _ = mha(x, x, x, torch.tensor([2]))
        >>> rec[""].shape, rec[""][0, 0, 0, 2].item()
        (torch.Size([1, 2, 3, 3]), 0.0)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"record_weights records the attention modules of a torch.nn.Module, got {describe(model)}")
    recording = _Recording(model)
    _RECORDINGS.set((*_RECORDINGS.get(), recording))
    try:
        yield recording.record
    finally:
        recording.close()
        # not a reset to the value before: blocks may close in any order (contextlib.ExitStack, generators)
        _RECORDINGS.set(tuple(r for r in _RECORDINGS.get() if r is not recording))
