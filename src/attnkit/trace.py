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

While no trace is open this costs one ``is None`` test per step (``benchmarks/trace_overhead.py`` measures
it); opening one installs PyTorch's global module hooks, which are removed when it closes.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["Step", "Trace", "trace_shapes"]

ACTIVE: Trace | None = None  # the open trace, if any; steps check this and do nothing when None

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

    def add(self, step: str, inputs: Sequence[Tensor | Shape], output: Tensor | Shape, note: str = "") -> None:
        module = self._stack[-1][0] if self._stack else "(functional)"
        self.steps.append(Step(module, step, [_shape(x) for x in inputs], _shape(output), note))

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

    def _enter(self, module: nn.Module, inputs: Any) -> None:
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
            self.add(self._child_name(module).rsplit(".", 1)[-1], [inputs[0]], output)

    def _child_name(self, module: nn.Module) -> str:
        parent_name, parent = self._stack[-1]
        for name, child in parent.named_children():
            if child is module:
                return f"{parent_name}.{name}"
        return type(module).__name__


@contextlib.contextmanager
def trace_shapes(model: nn.Module | None = None) -> Iterator[Trace]:
    """Record the shape of every step of every attnkit module called inside the ``with`` block.

    Args:
        model: optional; when given, modules are named as in ``model.named_modules()``.

    Yields:
        A :class:`Trace`: ``print(t)``, ``t.to_markdown()``, ``t.to_json()``, or ``t.steps``.
    """
    global ACTIVE
    if ACTIVE is not None:
        raise RuntimeError("trace_shapes() is already open; traces do not nest")
    trace = Trace()
    if model is not None:
        trace._names = {id(m): name or type(model).__name__ for name, m in model.named_modules()}
    pre = nn.modules.module.register_module_forward_pre_hook(trace._enter)
    post = nn.modules.module.register_module_forward_hook(trace._leave)
    ACTIVE = trace
    try:
        yield trace
    finally:
        ACTIVE = None
        pre.remove()
        post.remove()


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """No steps are recorded inside (for work done beside the traced computation, such as recording weights)."""
    global ACTIVE
    saved, ACTIVE = ACTIVE, None
    try:
        yield
    finally:
        ACTIVE = saved


def _shape(x: Tensor | Shape) -> Shape:
    return tuple(x.shape) if isinstance(x, Tensor) else tuple(x)


def short(t: Tensor, limit: int = 12) -> str:
    """A tensor's values for a note: ``[3, 3, 3, 2]``, cut after ``limit`` values."""
    values = t.flatten().tolist()
    text = ", ".join(str(int(v)) if float(v).is_integer() else f"{v:.3g}" for v in values[:limit])
    return f"[{text}{', ...' if len(values) > limit else ''}]"


def describe_masks(valid_lens: Tensor | None, attn_mask: Tensor | None, is_causal: bool) -> str:
    parts = []
    if valid_lens is not None:
        parts.append(f"valid_lens {short(valid_lens)}")
    if attn_mask is not None:
        kind = "bool" if attn_mask.dtype == torch.bool else "float"
        parts.append(f"{kind} attn_mask {tuple(attn_mask.shape)}")
    if is_causal:
        parts.append("causal")
    return "; ".join(parts) or "none"
