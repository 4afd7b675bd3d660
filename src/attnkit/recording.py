"""Recording what attention modules attend to: :func:`record_weights` (whole weights, or the layers, heads and
query rows chosen), :func:`record_stats` (statistics of every row, :mod:`attnkit.stats`, in memory linear in the
length), and :func:`report_weights`, which every attention module calls after its forward. Weights are kept only
when asked, so the fast path stays fast: ``with attnkit.record_weights(model) as rec: model(x)``, then
``rec["encoder.attention"]`` is ``(B, H, Lq, Lk)``, pre-dropout, detached. The differentiable output still comes
from the fast backend; the weights are computed beside it, under ``torch.no_grad()``: for looking at, not a loss.

A recording belongs to the thread or asyncio task that opened it (the open recordings live in a
:class:`contextvars.ContextVar`, never on the modules, so ``copy.deepcopy(model)`` copies none of it).
Recordings nest and overlap: each one sees every call, made while it is open, of the modules it records.
"""

from __future__ import annotations

import contextlib
import contextvars
import fnmatch
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from attnkit import _scoped_state, stats
from attnkit._validate import describe

__all__ = [
    "StatsRecord",
    "WeightRecord",
    "is_recording",
    "record_stats",
    "record_weights",
    "recorder",
    "report_weights",
    "wants_stats",
]

# What a selection of heads or query rows may be: one index, several, or a slice (negative ones count from the end).
Index = int | Sequence[int] | slice | range

# B batch, H heads, Lq/Lk query/key length


class _Record(dict):
    """``rec[name]``: what the last call of the attention module called ``name`` in the model gave (``""`` for the
    model itself); ``rec.calls(name)``: every call's, in order; ``rec.kv_heads``: the key/value heads of the
    modules with grouped-query heads."""

    def __init__(self) -> None:
        super().__init__()
        self._calls: dict[str, list[Any]] = {}
        self.kv_heads: dict[str, int] = {}

    def add(self, name: str, value: Any, kv_heads: int | None = None, heads: int | None = None) -> None:
        self._calls.setdefault(name, []).append(value)
        self[name] = value
        if kv_heads is not None and heads is not None and kv_heads < heads:
            self.kv_heads[name] = kv_heads

    def calls(self, name: str) -> list[Any]:
        return list(self._calls.get(name, []))

    def __missing__(self, name: str) -> Any:
        recorded = ", ".join(repr(n) for n in list(self)[:12]) + (", ..." if len(self) > 12 else "")
        recorded = recorded or "nothing (did the model run inside the block?)"
        raise KeyError(f"no call of a module named {name!r} was recorded; recorded: {recorded}")


class WeightRecord(_Record):
    """``rec[name]``: the weights of the last call of the attention module called ``name`` in the model
    (``""`` for the model itself); ``rec.calls(name)``: those of every call, in order. With a selection
    (``record_weights(heads=, queries=)``), ``rec.selected[name]``: the heads and query rows each of the last
    call's axes holds, ``(heads, rows)``."""

    def __init__(self) -> None:
        super().__init__()
        self.selected: dict[str, tuple[list[int] | None, list[int]]] = {}

    def add(self, name: str, weights: Tensor, kv_heads: int | None = None, heads: int | None = None) -> None:
        super().add(name, weights, kv_heads, weights.shape[1] if weights.dim() == 4 else None)


class StatsRecord(_Record):
    """``rec[name]``: the :class:`~attnkit.stats.AttentionStats` of the last call of the attention module called
    ``name``; ``rec.calls(name)``: every call's. :meth:`save` writes it for ``attnkit view``."""

    def __init__(self, topk: int = 8, sink_keys: int = stats.SINK_KEYS) -> None:
        super().__init__()
        self.topk, self.sink_keys = topk, sink_keys
        self._said_topk = False  # whether a call over fewer keys than topk was said

    def add(self, name: str, value: Any, kv_heads: int | None = None, heads: int | None = None) -> None:
        assert isinstance(value, stats.AttentionStats)
        H = value.entropy.shape[1] if value.entropy.dim() == 3 else None
        keys = value.column_sum.shape[-1]
        if self.topk > keys and not self._said_topk:
            self._said_topk = True  # once a record
            warnings.warn(
                f"record_stats(topk={self.topk}): {name or 'the model'!r} was called over {keys} keys, fewer than "
                "topk: each row's entries past its keys are weight 0 with index -1 (said once for this record)",
                UserWarning,
                stacklevel=2,
            )
        super().add(name, value, kv_heads, H)

    @property
    def nbytes(self) -> int:
        """The bytes of every call's statistics."""
        return sum(s.nbytes for calls in self._calls.values() for s in calls)

    def as_dict(self) -> dict[str, Any]:
        """Plain values that ``torch.load(..., weights_only=True)`` reads back (:meth:`from_dict` inverts it)."""
        calls = {name: [s.as_dict() for s in calls] for name, calls in self._calls.items()}
        return {"attnkit_stats": 1, "topk": self.topk, "sink_keys": self.sink_keys, "calls": calls}

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> StatsRecord:
        """A record from :meth:`as_dict`'s values (as ``torch.load`` gives them back)."""
        if not isinstance(saved, dict) or saved.get("attnkit_stats") != 1 or not isinstance(saved.get("calls"), dict):
            raise ValueError("not a saved attnkit statistics record (StatsRecord.save writes one)")
        record = cls(int(saved.get("topk", 8)), int(saved.get("sink_keys", stats.SINK_KEYS)))
        record._said_topk = True  # (said when it was recorded)
        for name, calls in saved["calls"].items():
            for values in calls:
                record.add(name, stats.AttentionStats.from_dict(values), values.get("kv_heads"))
        return record

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the record to ``path`` (``torch.save`` of :meth:`as_dict`), atomically: ``attnkit view`` reads it."""
        from attnkit._atomic import write_atomically

        return write_atomically(Path(path), lambda f: torch.save(self.as_dict(), f))


class Observer(_Record):
    """A record that is handed each call as it happens, not kept: :meth:`observe` gets the call's statistics
    parts (a press, :mod:`attnkit.presses`, scores the keys from them and compresses the cache), computed only if
    it asks. With ``wants_lse`` its calls run with each row's log-sum-exp, as :func:`record_stats`' do (a press
    that reads the attention weights; one that reads keys alone does not slow the call)."""

    wants_lse = True
    recording: _Recording | None = None  # the block that hands it calls, while it is open

    def observe(
        self, name: str, module: nn.Module, parts: Callable[[], stats.Parts | None], kv_heads: int | None
    ) -> None:
        raise NotImplementedError


class _Recording:
    """One open recording block: the record it fills, the name of each module it records, and what it keeps."""

    def __init__(
        self,
        model: nn.Module,
        record: _Record,
        what: str,
        layers: str | Sequence[str] | None = None,
        heads: Index | None = None,
        queries: Index | None = None,
    ) -> None:
        self.record, self.what = record, what
        named = list(model.named_modules())
        if layers is not None:
            named = _chosen(named, layers, what)
        self.names = {id(m): name for name, m in named}
        # Held while the block is open, so that no module made meanwhile (a deepcopy) can reuse one of these ids.
        self._modules = [m for _, m in named]
        self.heads, self.queries = heads, queries

    def close(self) -> None:
        # A context copied inside the block (an asyncio task) may outlive it: it then records nothing.
        self.names, self._modules = {}, []


# The recordings open in this thread or task, outermost first.
_RECORDINGS: ContextVar[tuple[_Recording, ...]] = ContextVar("attnkit_recordings", default=())


def is_recording() -> bool:
    """Whether some recording is open in this thread or task (the cost of asking: one lookup)."""
    return bool(_scoped_state.read(_RECORDINGS, ()))


def wants_stats(module: nn.Module) -> bool:
    """Whether a recording open in this thread or task keeps ``module``'s statistics (then its rows' sums help)."""
    return any(
        (isinstance(r.record, StatsRecord) or (isinstance(r.record, Observer) and r.record.wants_lse))
        and id(module) in r.names
        for r in _scoped_state.read(_RECORDINGS, ())
    )


def recorder(module: nn.Module) -> tuple[_Record, str] | None:
    """``(record, name)`` of the first recording open in this thread or task that records ``module``, else
    ``None``. Nothing is stored on the module."""
    for recording in _scoped_state.read(_RECORDINGS, ()):
        name = recording.names.get(id(module))
        if name is not None:
            return recording.record, name
    return None


def report_weights(
    module: nn.Module,
    weights: Tensor | Callable[[], Tensor] | None,
    *,
    kv_heads: int | None = None,
    parts: Callable[[], stats.Parts] | None = None,
    positions: tuple[Tensor | None, Tensor | None] | None = None,
) -> None:
    """Give what one call of ``module`` attended to every recording, open in this thread or task, that records
    it. Attention modules call this after each forward.

    Args:
        module: the module that ran.
        weights: the pre-dropout weights, or a function that computes them, called once, only if recorded;
            ``None`` (a call without weights) records nothing.
        kv_heads: the call's key/value heads, when fewer than its query heads (grouped-query attention): kept in
            ``record.kv_heads`` (the viewer groups the heads by it).
        parts: a function giving the call's :class:`attnkit.stats.Parts`, called once, only if a recording wants
            statistics or chosen rows: they are then computed block by block, never as whole weights. Without it,
            they are reduced from the whole weights.
        positions: where the call's queries ``(B, Lq)`` and keys ``(B, Lk)`` stand, for statistics reduced from
            whole weights (a cache's rows; ``None`` for each default: :mod:`attnkit.stats`).
    """
    recordings = _scoped_state.read(_RECORDINGS, ())
    if not recordings or weights is None:  # the cost while nothing records: one lookup
        return
    wanted = [(r, r.names[id(module)]) for r in recordings if id(module) in r.names]
    if not wanted:
        return
    made: dict[object, Any] = {}

    def once(key: object, make: Callable[[], Any]) -> Any:
        if key not in made:
            made[key] = make()
        return made[key]

    def whole() -> Tensor:
        return once("weights", lambda: (weights if isinstance(weights, Tensor) else weights()).detach())

    def the_parts() -> stats.Parts | None:
        return None if parts is None else once("parts", parts)

    for recording, name in wanted:
        record = recording.record
        if isinstance(record, Observer):
            record.observe(name, module, the_parts, kv_heads)
        elif isinstance(record, StatsRecord):
            topk, sink_keys = record.topk, record.sink_keys
            found = made.get(("stats", topk, sink_keys))
            if found is None:
                found = _stats(whole, the_parts(), topk, sink_keys, kv_heads, positions)
                made["stats", topk, sink_keys] = found
            record.add(name, found, kv_heads)
        elif recording.heads is None and recording.queries is None:
            record.add(name, whole(), kv_heads)
        else:
            assert isinstance(record, WeightRecord)
            kept, chosen = _selected(recording, name, whole, the_parts())
            # chosen heads are no longer whole key/value groups: the record says nothing of groups then
            record.add(name, kept, kv_heads if recording.heads is None else None)
            record.selected[name] = chosen


def _stats(
    whole: Callable[[], Tensor],
    parts: stats.Parts | None,
    topk: int,
    sink_keys: int,
    kv_heads: int | None,
    positions: tuple[Tensor | None, Tensor | None] | None,
) -> stats.AttentionStats:
    if parts is not None:
        return stats.compute(parts, topk, sink_keys, kv_heads=kv_heads)
    return stats.from_weights(whole(), topk, sink_keys, *(positions or (None, None)), kv_heads=kv_heads)


def _selected(
    recording: _Recording, name: str, whole: Callable[[], Tensor], parts: stats.Parts | None
) -> tuple[Tensor, tuple[list[int] | None, list[int]]]:
    """The chosen heads and query rows of one call's weights, ``(B, h, q, Lk)``, and which they are (the heads
    ``None`` for weights without a head axis, ``(B, Lq, Lk)``: the book's inner attention)."""
    if parts is not None:
        B, H, Lq, _ = parts.q.shape
        four_d = not parts.three_d
    else:
        w = whole()
        four_d = w.dim() == 4
        H, Lq = (w.shape[1], w.shape[2]) if four_d else (0, w.shape[1])
    label = name or "the model"
    rows = _indices(recording.queries, Lq, "queries", f"{label}'s call has {Lq} query rows")
    heads = _indices(recording.heads, H, "heads", f"{label} has {H} heads") if four_d else None
    if parts is not None:  # only the chosen heads' and rows' blocks are computed
        kept = stats.rows_of(parts, rows, heads).to(parts.q.dtype)  # (B, h, q, Lk), or (B, q, Lk) for 3-dim inputs
    else:
        kept = w[:, :, rows] if four_d else w[:, rows]  # (B, H, q, Lk) or (B, q, Lk)
        if heads is not None:
            kept = kept[:, heads]  # (B, h, q, Lk)
    return kept, (heads, rows)


def _indices(chosen: Index | None, size: int, what: str, has: str) -> list[int]:
    """``chosen`` (an int, several, a slice; negative ones from the end) as sorted distinct indices below
    ``size``; all of them when ``None``."""
    if chosen is None:
        return list(range(size))
    noun = what[:-1] if what != "queries" else "query"
    if isinstance(chosen, slice):
        found = sorted(range(size)[chosen])  # (a negative step names the same indices, kept in order)
        if not found and size:  # (a call of no rows has none to name: all of them, none)
            raise ValueError(f"record_weights({what}={chosen!r}) names no {noun}: {has}")
        return found
    picked = [chosen] if isinstance(chosen, int) else list(chosen)
    out = set()
    for i in picked:
        if not -size <= i < size:
            raise ValueError(f"record_weights({what}=...) names {noun} {i}, but {has}")
        out.add(i % size)
    return sorted(out)


def _check_index(chosen: object, what: str) -> None:
    if chosen is None:
        return
    if isinstance(chosen, slice):
        if chosen.step == 0:
            raise ValueError(f"{what} must be a slice with a step other than 0, got {chosen!r}")
        if not all(x is None or isinstance(x, int) for x in (chosen.start, chosen.stop, chosen.step)):
            raise TypeError(f"{what} must be a slice of ints, got {chosen!r}")
        # empty at every length: start and stop counted from the same end, stop not past start (a start left out
        # is the first index, or the last for a negative step)
        step = chosen.step or 1
        start, stop = (0 if step > 0 else -1) if chosen.start is None else chosen.start, chosen.stop
        if stop is not None and (start < 0) == (stop < 0) and (stop - start) * step <= 0:
            raise ValueError(f"{what} must name at least one index, got {chosen!r}: it names none at any length")
        return
    if isinstance(chosen, range) and not len(chosen):
        raise ValueError(f"{what} must name at least one index, got {chosen!r}")
    if isinstance(chosen, range):
        return
    items = [chosen] if isinstance(chosen, int) else chosen
    if isinstance(chosen, bool) or not isinstance(items, Sequence) or isinstance(items, str):
        raise TypeError(f"{what} must be an int, a list of ints or a slice, got {describe(chosen)}")
    if not items:
        raise ValueError(f"{what} must name at least one index, got {chosen!r}")
    for i in items:
        if not isinstance(i, int) or isinstance(i, bool):
            raise TypeError(f"{what} must be an int, a list of ints or a slice, got {describe(chosen)}")


def _chosen(named: list[tuple[str, nn.Module]], layers: str | Sequence[str], what: str) -> list[tuple[str, nn.Module]]:
    """The modules whose names match one of the ``layers`` patterns (``fnmatch``: ``"layers.*.attn"``); a pattern
    that matches none is a ValueError that lists the model's attention modules."""
    patterns = [layers] if isinstance(layers, str) else list(layers) if isinstance(layers, Sequence) else None
    if patterns == []:
        raise ValueError(f"{what}(layers=...) must name at least one module, got {layers!r}")
    if not patterns or not all(isinstance(p, str) for p in patterns):
        raise TypeError(f"{what}(layers=...) takes module names or patterns (strings), got {describe(layers)}")
    kept = [(n, m) for n, m in named if any(fnmatch.fnmatchcase(n, p) for p in patterns)]
    for p in patterns:
        if not any(fnmatch.fnmatchcase(n, p) for n, _ in named):
            known = [repr(n) for n, m in named if "Attention" in type(m).__name__] or [repr(n) for n, _ in named]
            shown = ", ".join(known[:12]) + (f", ... ({len(known)} in all)" if len(known) > 12 else "")
            raise ValueError(f"{what}(layers=...): {p!r} names no module of the model; its attention modules: {shown}")
    return kept


@contextlib.contextmanager
def _open(recording: _Recording) -> Iterator[Any]:
    _RECORDINGS.set((*_RECORDINGS.get(), recording))
    try:
        with _scoped_state.counted("recording"):
            yield recording.record
    finally:
        recording.close()
        # not a reset to the value before: blocks may close in any order (contextlib.ExitStack, generators)
        _RECORDINGS.set(tuple(r for r in _RECORDINGS.get() if r is not recording))


def record_weights(
    model: nn.Module,
    *,
    layers: str | Sequence[str] | None = None,
    heads: Index | None = None,
    queries: Index | None = None,
) -> contextlib.AbstractContextManager[WeightRecord]:
    """Record the pre-dropout attention weights of every attention module inside ``model``.

    attnkit's layers and those of :mod:`attnkit.d2l` are recorded (a ``d2l.MultiHeadAttention`` in attnkit's
    layout ``(B, H, Lq, Lk)``, and its inner ``.attention`` in the book's ``(B*H, Lq, Lk)``: one tensor, two
    views), and Hugging Face models with attnkit registered (:mod:`attnkit.integrations.transformers`). Only the
    calls of the thread or asyncio task that opened the block are recorded, and only those of the modules inside
    ``model`` when it opened (a copy made inside the block is another module). Blocks nest and overlap, on the
    same model or on a part of it: each records every call made while it is open.

    While recording, the differentiable output still comes from the fast backend; the weights are computed beside
    it, detached: they are for looking at, not for a loss.

    Args:
        model: any module; the attention modules inside it (or ``model`` itself) are recorded.
        layers: only the modules with these names (as ``named_modules()`` gives them), ``fnmatch`` patterns
            allowed (``"model.layers.*.self_attn"``).
        heads: only these heads (an index, a list, a slice; negative ones count from the last), of weights with a
            head axis (the book's inner attention, ``(B*H, Lq, Lk)``, keeps its batch).
        queries: only these query rows of each call (as ``heads``): ``queries=-1`` is the last query of a
            prompt and each decoding step's one. The rows chosen are computed a block at a time, never the
            whole ``Lq x Lk`` weights. ``rec.selected[name]`` says which heads and rows the last call kept.

    Yields:
        A :class:`~attnkit.recording.WeightRecord`, filled as the model runs; keys: ``named_modules()``'s names.

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module``, or a selection of the wrong type.
        ValueError: a ``layers`` pattern that names no module (the error lists the attention modules), an empty
            selection; at a call, a head or query row it does not have.

    Example:
        >>> import attnkit
        >>> mha = attnkit.MultiHeadAttention(8, 2)
        >>> x = torch.randn(1, 3, 8)
        >>> with record_weights(mha) as rec:
        ...     _ = mha(x, x, x, torch.tensor([2]))
        >>> rec[""].shape, rec[""][0, 0, 0, 2].item()
        (torch.Size([1, 2, 3, 3]), 0.0)
    """
    _check_model(model, "record_weights")
    _check_index(heads, "heads")
    _check_index(queries, "queries")
    return _open(_Recording(model, WeightRecord(), "record_weights", layers, heads, queries))


def record_stats(
    model: nn.Module, topk: int = 8, *, sink_keys: int = stats.SINK_KEYS, layers: str | Sequence[str] | None = None
) -> contextlib.AbstractContextManager[StatsRecord]:
    """Record statistics of the attention weights of every attention module inside ``model``, in memory linear in
    the sequence length: each row's ``topk`` largest weights and their keys, its entropy, the mean distance it
    attends over and its weight on the first ``sink_keys`` keys, and the weight each key receives
    (:class:`attnkit.stats.AttentionStats`; the formulas are in :mod:`attnkit.stats`).

    The modules recorded and the rules (threads and tasks, nesting, copies) are those of :func:`record_weights`;
    decoding steps through a cache are recorded call by call. The output still comes from the fast backend; the
    statistics are computed beside it, a block of rows at a time in a budget that does not grow with the length
    (or, under ``torch.no_grad()`` where the forward's fused kernel gave each row's log-sum-exp, a tile at a time:
    :mod:`attnkit.stats`), from the same queries, keys, masks, modifiers and sinks, detached. The book's layers,
    which compute their weights anyway, have them reduced from those.

    Args:
        model: any module.
        topk: how many of each row's largest weights to keep (a row that has fewer keys, or sees fewer, has its
            other entries 0 with index -1).
        sink_keys: ``sink_mass`` is the weight on keys ``[0, sink_keys)``.
        layers: only these modules, as in :func:`record_weights`.

    Yields:
        A :class:`~attnkit.recording.StatsRecord`: ``rec[name]`` the last call's statistics, ``rec.calls(name)``
        every call's; ``rec.save(path)`` for ``attnkit view``.

    Raises:
        TypeError: ``model`` not a module, ``topk`` or ``sink_keys`` not an int.
        ValueError: ``topk < 1``, ``sink_keys < 0``, a ``layers`` pattern that names no module.

    Example:
        >>> import attnkit
        >>> mha = attnkit.MultiHeadAttention(8, 2)
        >>> x = torch.randn(1, 5, 8)
        >>> with record_stats(mha, topk=2) as rec:
        ...     _ = mha(x, x, x, is_causal=True)
        >>> rec[""].topk_indices[0, 0, 0].tolist(), rec[""].entropy.shape
        ([0, -1], torch.Size([1, 2, 5]))
    """
    _check_model(model, "record_stats")
    stats.check_topk(topk, sink_keys)
    return _open(_Recording(model, StatsRecord(topk, sink_keys), "record_stats", layers))


@contextlib.contextmanager
def observe(model: nn.Module, observer: Observer, what: str) -> Iterator[Observer]:
    """Hand ``observer`` every call, made while the block is open in this thread or task, of the attention modules
    inside ``model`` (as :func:`record_weights` chooses them); ``what`` names the caller in errors. A call made in
    another thread joins the block with :func:`join`."""
    _check_model(model, what)
    recording = _Recording(model, observer, what)
    observer.recording = recording
    try:
        with _open(recording):
            yield observer
    finally:
        observer.recording = None


def join(observer: Observer) -> contextvars.Token | None:
    """Make ``observer``'s open block seen in this thread or task too, until :func:`leave` (a press's hook, around
    one call made in a thread that did not open the block: a ``generate`` running in a thread of its own); ``None``
    when it is seen here already or closed."""
    recording = observer.recording
    open_here = _RECORDINGS.get()
    if recording is None or any(r is recording for r in open_here):
        return None
    return _RECORDINGS.set((*open_here, recording))


def leave(token: contextvars.Token | None) -> None:
    """Undo :func:`join` (a call's block, closed meanwhile, records nothing more either way)."""
    if token is not None:
        _RECORDINGS.reset(token)


def _check_model(model: object, what: str) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{what} records the attention modules of a torch.nn.Module, got {describe(model)}")
