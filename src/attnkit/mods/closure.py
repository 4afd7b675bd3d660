"""What a modifier reads from outside: the tensors a function closes over, for the gradients of a score_mod and
for the tile engine's check that nothing it reads again in the backward pass was changed in place."""

from __future__ import annotations

import functools
import inspect
import types
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from attnkit.mods.base import ScoreFn

__all__ = ["Uninspectable", "grad_inputs", "read_tensors"]


def grad_inputs(score_mod: ScoreFn, probe: tuple[Tensor, ...], read: Sequence[Tensor]) -> tuple[Tensor, ...]:
    """The tensors requiring grad that ``score_mod`` reads, for a backend that takes its gradient itself: those among
    ``read``, the tensors it reads from outside (:func:`read_tensors`), and any other leaf its result turns out to
    depend on when it is run once on ``probe`` (walking the autograd graph of that result)."""
    direct = {id(t): t for t in read if t.requires_grad}
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


class Uninspectable(TypeError):
    """A modifier whose state attnkit cannot see (a TorchScript function or module, a callable written in C with
    state of its own): the tensors it reads cannot be found."""


def read_tensors(fn: object) -> list[Tensor]:
    """The tensors a mask_mod or score_mod reads from outside, however the function holds them: a built-in's
    fields (the functions inside ``and_masks``/``or_masks`` included), a closure's cells, its defaults, the globals
    its code names (and the attributes it names of a module or class it reads, to any depth), a
    ``functools.partial``'s function and arguments, a bound method's object, an object's attributes and its class's
    (and its ``__call__``), a module's parameters, buffers and attributes, and what containers of these hold.
    attnkit's, torch's and the standard library's own code is not read (a ``torch.compile``'d function is read
    through the function it wraps).

    Raises:
        Uninspectable: something it holds or is cannot be looked into (see :class:`Uninspectable`), with how to
            pass it instead.
    """
    found: dict[int, Tensor] = {}
    seen: set[int] = set()
    todo: list[object] = [fn]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or obj is None or isinstance(obj, _LEAVES):
            continue
        seen.add(id(obj))
        if isinstance(obj, Tensor):
            found.setdefault(id(obj), obj)
        else:
            todo.extend(_held_by(obj))
    return list(found.values())


# Objects that hold no tensor a function could read: skipped without looking.
_LEAVES = (
    str,
    bytes,
    int,
    float,
    complex,
    bool,
    torch.dtype,
    torch.device,
    torch.Size,
    weakref.ReferenceType,
    property,
    types.ModuleType,  # read only through the attributes a function names (_read_by_code)
    types.MethodDescriptorType,
    types.WrapperDescriptorType,
    types.MethodWrapperType,
    types.GetSetDescriptorType,
    types.MemberDescriptorType,
    types.ClassMethodDescriptorType,
)

# Code that reads no tensor of a caller's: the libraries attnkit stands on, and attnkit itself.
_LIBRARIES = frozenset({"attnkit", "torch", "builtins", "functools", "typing", "abc", "collections", "numpy"})


def _library(obj: object) -> bool:
    return (getattr(obj, "__module__", None) or "").split(".")[0] in _LIBRARIES


def _held_by(obj: object) -> list[object]:
    """What ``obj`` holds that a function could read through it (one level; :func:`read_tensors` walks on)."""
    if isinstance(obj, (list, tuple, set, frozenset)):
        return list(obj)
    if isinstance(obj, dict):
        return [*obj.keys(), *obj.values()]
    if isinstance(obj, type):  # a class: its own attributes, unless it is a library's
        return [] if _library(obj) else list(vars(obj).values())
    if isinstance(obj, functools.partial):
        return [obj.func, obj.args, obj.keywords]
    if inspect.ismethod(obj):
        return [obj.__self__, obj.__func__]
    if inspect.isfunction(obj):
        wrapped = getattr(obj, "__wrapped__", None)  # torch.compile, functools.wraps: the function inside
        return [wrapped] if _library(obj) else [*_read_by_code(obj), wrapped]
    if inspect.isbuiltin(obj):  # C code: stateless at a module's level, else bound to an object we look into
        owner = getattr(obj, "__self__", None)
        return [] if owner is None or isinstance(owner, (types.ModuleType, type)) else [owner]
    if isinstance(obj, (torch.jit.ScriptFunction, torch.jit.ScriptModule)):
        raise Uninspectable(_cannot_see(obj))
    held: list[object] = [cls for cls in type(obj).__mro__ if not _library(cls)]  # class attributes
    if isinstance(obj, torch.nn.Module):
        held += [*obj.parameters(), *obj.buffers()]
    if hasattr(obj, "__dict__"):
        held += list(vars(obj).values())
    held += [getattr(obj, name, None) for name in getattr(type(obj), "__slots__", ())]
    if callable(obj) and not held and not inspect.isfunction(inspect.getattr_static(type(obj), "__call__", None)):
        raise Uninspectable(_cannot_see(obj))  # called through code attnkit cannot read, holding nothing it can
    return [x for x in held if x is not None]


def _read_by_code(fn: Any) -> list[object]:
    """What a function's code can read: its closure's cells, its defaults, the globals its code (and the code of
    the functions defined inside it) names, and the attributes it names of a module among those globals (and of
    the modules among those: ``config.tables.weights``)."""
    names: set[str] = set()
    codes = [fn.__code__]
    while codes:
        code = codes.pop()
        names.update(code.co_names)
        codes.extend(c for c in code.co_consts if inspect.iscode(c))
    held: list[object] = [cell.cell_contents for cell in fn.__closure__ or () if _filled(cell)]
    held += [*(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values()]
    modules = []
    for name in names:
        value = fn.__globals__.get(name)
        if isinstance(value, types.ModuleType):
            modules.append(value)
        elif value is not None:
            held.append(value)
    seen: set[int] = set()
    while modules:  # `tables.weights` or `config.tables.weights` read through modules: the attributes it names
        module = modules.pop()
        if id(module) in seen or _library(module) or (module.__name__.split(".")[0] in _LIBRARIES):
            continue
        seen.add(id(module))
        for attr in names & vars(module).keys():
            value = vars(module)[attr]
            (modules if isinstance(value, types.ModuleType) else held).append(value)
    return held


def _filled(cell: Any) -> bool:
    try:
        cell.cell_contents  # noqa: B018 - an empty cell raises
    except ValueError:
        return False
    return True


def _cannot_see(obj: object) -> str:
    return (
        f"attnkit cannot see which tensors {type(obj).__name__} {obj!r:.60} reads: it is not Python code whose "
        "closure, arguments and attributes can be looked into. Pass a Python function (a closure, a callable "
        "object, or functools.partial(fn, tensor)) that holds the tensors it reads"
    )
