"""Shape traces: every step of every attnkit module, with its shape in and shape out.

    >>> import torch, attnkit
    >>> mha = attnkit.MultiHeadAttention(100, 5).eval()
    >>> X, Y = torch.ones(2, 4, 100), torch.ones(2, 6, 100)
    >>> with attnkit.trace_shapes() as t:
    ...     _ = mha(X, Y, Y, torch.tensor([3, 2]))
    >>> split = next(s for s in t.steps if s.step == "split heads")
    >>> print(split.module, split.step, split.shapes_in, "->", split.shape_out)
    MultiHeadAttention split heads [(2, 4, 100)] -> (2, 5, 4, 20)

The steps of the attention itself (scores, masking, softmax, weighted sum) are the logical ones, whatever the
backend: a fused kernel never materialises the scores, and the trace says which backend ran.

A trace belongs to the thread or asyncio task that opened it (it lives in a :class:`contextvars.ContextVar`):
it never sees the steps of other threads. Traces nest: each open trace sees every step made while it is open,
each naming the modules its own way. While no trace is open a step costs one context-variable lookup,
``trace.active()`` (``benchmarks/trace_overhead.py`` measures it). PyTorch's module hooks, which name the
modules, are process-wide: they are installed while at least one trace is open in any thread and do nothing in
threads without one.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from attnkit import _scoped_state
from attnkit._validate import listed
from attnkit.mods.base import MaskMod, ScoreMod

__all__ = ["Step", "Trace", "active", "paused", "trace_shapes"]

# The innermost trace open in this thread or task; the traces around it are reached through Trace._outer.
_ACTIVE: ContextVar[Trace | None] = ContextVar("attnkit_trace", default=None)


def active() -> Trace | None:
    """The innermost trace open in this thread or task, or ``None``. Steps call it and do nothing on ``None``; a step
    added to it reaches every trace open around it. Code that ``torch.compile`` traces reads it only while some
    block is open in the process (``attnkit._scoped_state``)."""
    return _scoped_state.read(_ACTIVE, None)


Shape = tuple[int, ...]


@dataclass
class Step:
    """One step: which module, what it did, the shapes it took and gave, and a note (values, backend)."""

    module: str
    step: str
    shapes_in: list[Shape]
    shape_out: Shape
    note: str = ""


@dataclass
class Trace:
    """The steps recorded inside ``with trace_shapes() as t``, in order; ``print(t)`` shows them."""

    steps: list[Step] = field(default_factory=list)
    _names: dict[int, str] = field(default_factory=dict, repr=False)
    _stack: list[tuple[str, nn.Module]] = field(default_factory=list, repr=False)
    _outer: Trace | None = field(default=None, repr=False, compare=False)  # open around this one, same context
    _closed: bool = field(default=False, repr=False, compare=False)  # set when its ``with`` block ends

    def add(self, step: str, inputs: Sequence[Tensor | Shape], output: Tensor | Shape, note: str = "") -> None:
        """Add a step to this trace and to every trace open around it, each attributing it to its own module."""
        shapes_in, shape_out = [_shape(x) for x in inputs], _shape(output)
        trace: Trace | None = self
        while trace is not None:
            trace._append(step, shapes_in, shape_out, note)
            trace = trace._outer

    def _append(self, step: str, shapes_in: list[Shape], shape_out: Shape, note: str = "") -> None:
        if not self._closed:  # a context copied inside the block (an asyncio task) may outlive it
            module = self._stack[-1][0] if self._stack else "(functional)"
            self.steps.append(Step(module, step, list(shapes_in), shape_out, note))

    def rows(self) -> list[tuple[str, str, str, str, str]]:
        return [
            (s.module, s.step, ", ".join(str(x) for x in s.shapes_in), str(s.shape_out), s.note) for s in self.steps
        ]

    def __str__(self) -> str:
        header = ("module", "step", "shape in", "shape out", "note")
        rows = [header, *self.rows()]
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = []
        for r in rows:
            cells = [r[i].ljust(widths[i]) for i in range(4)]
            lines.append(f"{cells[0]}  {cells[1]}  {cells[2]}  -> {cells[3]}  {r[4]}".rstrip())
        return "\n".join(lines)

    def to_markdown(self) -> str:
        """A Markdown table of the steps."""
        lines = ["| module | step | shape in | shape out | note |", "|---|---|---|---|---|"]
        for r in self.rows():
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in r) + " |")
        return "\n".join(lines)

    def to_json(self) -> str:
        """The steps as a JSON list of objects (shapes as lists)."""
        return json.dumps([asdict(s) for s in self.steps], indent=2)

    # --- module bookkeeping, driven by PyTorch's global module hooks while the trace is open -------------

    def _enter(self, module: nn.Module) -> None:
        if getattr(module, "_attnkit_traced", False):
            name = self._names.get(id(module))
            if name is None:
                name = self._child_name(module) if self._stack else type(module).__name__
                self._names[id(module)] = name
            self._stack.append((name, module))

    def _leave(self, module: nn.Module, inputs: Any, output: Any) -> None:
        if not self._stack:
            return
        if self._stack[-1][1] is module:
            self._stack.pop()
        elif isinstance(module, nn.Linear) and inputs and isinstance(output, Tensor):
            # this trace only: the hooks call _leave on every open trace
            self._append(self._child_name(module).rsplit(".", 1)[-1], [_shape(inputs[0])], _shape(output))

    def _child_name(self, module: nn.Module) -> str:
        parent_name, parent = self._stack[-1]
        for name, child in parent.named_children():
            if child is module:
                return f"{parent_name}.{name}"
        return type(module).__name__


def _pre_hook(module: nn.Module, inputs: Any) -> None:
    trace = _ACTIVE.get()  # None in every thread or task without an open trace
    while trace is not None:
        if not trace._closed:
            trace._enter(module)
        trace = trace._outer


def _post_hook(module: nn.Module, inputs: Any, output: Any) -> None:
    trace = _ACTIVE.get()
    while trace is not None:
        if not trace._closed:
            trace._leave(module, inputs, output)
        trace = trace._outer


class _GlobalHooks:
    """PyTorch's global module hooks, installed while at least one trace is open in any thread.

    The hooks are process-wide (PyTorch keeps them in module-level dicts), so this is the one piece of
    process-wide state: a count of open traces, under a lock. Removing the hooks when the last trace closes
    keeps PyTorch's hook-free fast path for every module while nothing is traced.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open = 0
        self._handles: list[Any] = []

    def acquire(self) -> None:
        with self._lock:
            if self._open == 0:
                self._handles = [
                    nn.modules.module.register_module_forward_pre_hook(_pre_hook),
                    nn.modules.module.register_module_forward_hook(_post_hook),
                ]
            self._open += 1

    def release(self) -> None:
        with self._lock:
            self._open -= 1
            if self._open == 0:
                for handle in self._handles:
                    handle.remove()
                self._handles = []


_HOOKS = _GlobalHooks()


@contextlib.contextmanager
def trace_shapes(model: nn.Module | None = None) -> Iterator[Trace]:
    """Record the shape of every step of every attnkit module called inside the ``with`` block.

    The trace sees the calls of the thread or asyncio task that opened it, not those of other threads. Traces
    nest: an inner trace sees the steps made while it is open, and so does every trace around it.

    Args:
        model: optional; when given, modules are named as in ``model.named_modules()``.

    Yields:
        A :class:`~attnkit.trace.Trace`: ``print(t)``, ``t.to_markdown()``, ``t.to_json()``, or ``t.steps``.
    """
    trace = Trace(_outer=_ACTIVE.get())
    if model is not None:
        trace._names = {id(m): name or type(model).__name__ for name, m in model.named_modules()}
    _HOOKS.acquire()
    _ACTIVE.set(trace)
    try:
        with _scoped_state.counted("trace"):
            yield trace
    finally:
        trace._closed = True
        if _ACTIVE.get() is trace:  # closed in the order opened (a trace closed out of order is skipped instead)
            outer = trace._outer
            while outer is not None and outer._closed:
                outer = outer._outer
            _ACTIVE.set(outer)
        _HOOKS.release()


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """No trace of this thread or task sees the steps made inside (for work done beside the traced computation,
    such as recording weights). Other threads' traces are not affected."""
    token = _ACTIVE.set(None)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def _shape(x: Tensor | Shape) -> Shape:
    return tuple(x.shape) if isinstance(x, Tensor) else tuple(x)


def describe_masks(valid_lens: Tensor | None, attn_mask: Tensor | None, is_causal: bool) -> str:
    parts = []
    if valid_lens is not None:
        parts.append(f"valid_lens {listed(valid_lens, limit=12)}")
    if attn_mask is not None:
        kind = "bool" if attn_mask.dtype == torch.bool else "float"
        parts.append(f"{kind} attn_mask {tuple(attn_mask.shape)}")
    if is_causal:
        parts.append("causal")
    return "; ".join(parts) or "none"


_HOW = {
    "sdpa": "fused kernel, scores never materialised",
    "decode": "a decode step: two batched products over the cache",
    "tiles:kernel": "tiles of the plan, attnkit's C++ kernel",
    "tiles:online": "tiles of the plan, online softmax",
    "tiles:compiled": "tiles of the plan, each step compiled",
    "tiles:flex": "FlexAttention, compiled",
}


def attention_steps(
    tracer: Trace,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    w_v: Tensor | None,
    three_d: bool,
    out: Tensor,
    backend: str,
    masks: Any,
    sinks: bool,
) -> None:
    """Add the logical steps of one attention call, in the caller's layout, whichever backend ran (``masks``:
    :class:`attnkit.functional.Masks`)."""
    if three_d:
        q, k, v = q.squeeze(1), k.squeeze(1), v.squeeze(1)  # (B, L, D)
    scores = (*q.shape[:-1], k.shape[-2])  # (B, [H,] Lq, Lk)
    if w_v is None:
        tracer.add("scores", [q, k], scores, "q @ k^T * scale")
    else:
        tracer.add("scores", [q, k], scores, f"w_v . tanh(q + k), via features {(*scores, q.shape[-1])}")
    if masks.score_mod is not None:
        tracer.add("score_mod", [scores], scores, f"score_mod {_name(masks.score_mod)}")
    described = describe_masks(masks.valid_lens, masks.attn_mask, masks.is_causal)
    if masks.mask_mod is not None:
        described += f"; mask_mod {_name(masks.mask_mod)}"
    if masks.plan is not None:  # (the call's whole mask: the others are None)
        made = getattr(masks.plan, "mask", None)
        parts = ["causal"] if made is not None and made.is_causal else []
        if made is not None and made.mask_mod is not None:
            parts.append(f"mask_mod {_name(made.mask_mod)}")
        described = f"plan ({'; '.join(parts) or 'no mask'})"
    tracer.add("mask", [scores], scores, described)
    sink = ", with a sink logit per head" if sinks else ""
    tracer.add("softmax", [scores], scores, f"over keys{sink}; rows with no key -> 0")
    how = _HOW.get(backend)
    tracer.add("weighted sum", [scores, v], out, f"weights @ v; backend {backend}" + (f" ({how})" if how else ""))


def _name(fn: object) -> str:
    """A modifier's name: a built-in's class (``sliding_window``), else the function's own name."""
    return type(fn).__name__ if isinstance(fn, (MaskMod, ScoreMod)) else getattr(fn, "__name__", repr(fn))
