"""What a modifier reads from outside: the tensors a function closes over, for the gradients of a score_mod and
for the chunked backend's check that nothing it reads again in the backward pass was changed in place."""

from __future__ import annotations

import functools
import inspect
from typing import Any

import torch
from torch import Tensor

from attnkit.mods.base import MaskMod, ScoreFn, ScoreMod

__all__ = ["grad_inputs", "read_tensors"]


def grad_inputs(score_mod: ScoreFn, probe: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """The tensors requiring grad that ``score_mod`` reads, for a backend that takes its gradient itself: the
    tensors it closes over (a built-in's, a closure's or a global's, a module's parameters), and any other leaf its
    result turns out to depend on when it is run once on ``probe`` (walking the autograd graph of that result)."""
    direct = {id(t): t for t in _closed_over(score_mod, depth=3) if t.requires_grad}
    stops = {id(t.grad_fn) for t in direct.values() if t.grad_fn is not None}
    try:
        with torch.enable_grad():
            out = score_mod(*probe)
    except Exception:  # a function that only runs on real blocks: what it closes over is all we know
        return tuple(direct.values())
    found = dict(direct)
    seen: set[int] = set()
    stack = [out.grad_fn] if isinstance(out, Tensor) else []
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen or id(node) in stops:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)  # AccumulateGrad: a leaf
        if isinstance(variable, Tensor):
            found.setdefault(id(variable), variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return _without_descendants(list(found.values()))


def _without_descendants(tensors: list[Tensor]) -> tuple[Tensor, ...]:
    """Drop each tensor computed from another of ``tensors``: the other's gradient, taken through every path,
    already holds what flows through it (returning both would count that path twice)."""
    nodes = {id(t): (t.grad_fn if t.grad_fn is not None else _accumulator(t)) for t in tensors}
    kept = []
    for t in tensors:
        others = {id(n) for key, n in nodes.items() if key != id(t) and n is not None}
        if t.grad_fn is None or not _reaches(t.grad_fn, others):
            kept.append(t)
    return tuple(kept)


def _accumulator(leaf: Tensor) -> Any:
    """The AccumulateGrad node of a leaf that requires grad, as the graphs of its uses reach it."""
    node = leaf.view_as(leaf).grad_fn
    assert node is not None  # the leaf requires grad
    return node.next_functions[0][0]


def _reaches(start: Any, targets: set[int]) -> bool:
    """Whether the autograd graph from ``start`` reaches a node in ``targets`` (ids)."""
    seen: set[int] = set()
    stack = [start]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        if id(node) in targets:
            return True
        seen.add(id(node))
        stack.extend(n for n, _ in node.next_functions)
    return False


def read_tensors(fn: object) -> list[Tensor]:
    """The tensors a mask_mod or score_mod reads from outside (see :func:`grad_inputs`)."""
    return _closed_over(fn, depth=3)


def _closed_over(fn: object, depth: int) -> list[Tensor]:
    """The tensors a function reads from outside: a built-in's, a closure's cells and the globals it names, a
    module's parameters and buffers, a bound method's object, a ``functools.partial``'s arguments."""
    if depth < 0:
        return []
    if isinstance(fn, Tensor):
        return [fn]
    if isinstance(fn, torch.nn.Module):
        return [*fn.parameters(), *fn.buffers()]
    if isinstance(fn, (list, tuple)):
        return [t for x in fn for t in _closed_over(x, depth - 1)]
    if isinstance(fn, dict):
        return [t for x in fn.values() for t in _closed_over(x, depth - 1)]
    if isinstance(fn, (MaskMod, ScoreMod)):
        return list(fn.tensors())
    if isinstance(fn, functools.partial):
        return [t for x in (fn.func, fn.args, fn.keywords) for t in _closed_over(x, depth - 1)]
    if inspect.ismethod(fn):
        return _closed_over(fn.__self__, depth - 1) + _closed_over(fn.__func__, depth - 1)
    if inspect.isfunction(fn):
        names = inspect.getclosurevars(fn)
        values = [*names.nonlocals.values(), *names.globals.values()]
        return [t for x in values if not inspect.ismodule(x) for t in _closed_over(x, depth - 1)]
    return []
