"""A score_mod that is a bias on the distance ``q_idx - kv_idx``: ``score + f(b, h, q_idx - kv_idx)``, element by
element (a learned table of relative-position biases, T5's buckets, ALiBi written as a function).

Such a bias takes ``Lq + Lk - 1`` values per (example, head), not ``Lq Lk``: a kernel can read it as a vector
(``distance_bias``) and give back its gradient as one, where a function of the caller's would otherwise be run
on every tile of scores, forward and backward. ``is_distance_bias`` proves the form from the function's graph,
traced once with fake tensors (:func:`torch.fx.experimental.proxy_tensor.make_fx`): the score enters once, added
to the rest; the positions enter only through their difference (``q_idx - kv_idx``, moved or scaled by whole
numbers); and everything that reads the indices is element-wise (PyTorch's ``pointwise`` operators, and indexing a
tensor the function holds with a full set of indices). A function whose graph shows anything else, or which cannot
be traced (Python ``if`` on a value, randomness, writes in place), is not one: it runs as before.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import types
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from attnkit._validate import broadcasts
from attnkit.mods.base import ScoreFn, reads_positions
from attnkit.mods.evaluate import indices

__all__ = ["declares_distance_bias", "distance_bias", "is_distance_bias"]

# B batch, H heads, R distances

_FREE = "free"  # a value of (b, h, q_idx - kv_idx), element-wise
_CONST = "const"  # no index or score read
_aten = torch.ops.aten
_LINEAR = {_aten.add.Tensor, _aten.sub.Tensor, _aten.neg.default, _aten.mul.Tensor}
_ELEMENTWISE = {  # element-wise, without PyTorch's pointwise tag
    _aten._to_copy.default,
    _aten.clone.default,
    _aten.floor_divide.default,
    _aten.floor_divide.Scalar,
    _aten.where.ScalarOther,
    _aten.where.ScalarSelf,
    _aten.where.Scalar,
    _aten.full_like.default,
    _aten.zeros_like.default,
    _aten.ones_like.default,
}


def is_distance_bias(score_mod: ScoreFn) -> bool:
    """Whether ``score_mod(score, b, h, q_idx, kv_idx)`` is ``score + f(b, h, q_idx - kv_idx)`` element by element,
    as its graph shows it.

    The function is traced once on small blocks of fake tensors (so it runs once more than the call itself, on
    tensors without values). A built-in that reads no position (softcap) is not one; ALiBi and attnkit's own
    wrappers (a score_mod moved into a packed document's piece) say it themselves (:func:`declares_distance_bias`).
    A Python function found not to be one is remembered while its code and what its closure holds live (weakly,
    compared by identity): asked again, it is not traced again. One found to be one is traced at every call, since
    what it reads may change its graph.

    Args:
        score_mod: a function of the caller's, or a built-in bound to a call.

    Returns:
        ``True`` only where the graph proves the form; ``False`` for anything else, including a function that
        cannot be traced (a Python ``if`` on a value, randomness, a write in place, a wrong signature).
    """
    if declares_distance_bias(score_mod):
        return bool(score_mod.attnkit_distance_bias())  # type: ignore[attr-defined]
    if not reads_positions(score_mod):
        return False
    closure = _closure(score_mod)
    if _known_not(score_mod, closure):
        return False
    found = _traced_form(score_mod)
    if not found:
        with _TRACING:
            _remember_not(score_mod, closure)
    return found


def declares_distance_bias(score_mod: ScoreFn) -> bool:
    """Whether ``score_mod`` says itself whether it is a bias on the distance, through a method
    ``attnkit_distance_bias()`` (ALiBi; attnkit's wrappers, which ask the function they wrap once for all of a
    call's pieces), so that asking traces nothing new."""
    return callable(getattr(score_mod, "attnkit_distance_bias", None))


def distance_bias(score_mod: ScoreFn, *, batch: int, heads: int, distances: tuple[int, int], device: Any) -> Tensor:
    """The bias of a score_mod :func:`is_distance_bias` proved to be ``score + f(b, h, q_idx - kv_idx)``, at each
    distance of ``[d0, d1)``, computed by the function itself (on positions ``q_idx = max(d, 0)``,
    ``kv_idx = max(-d, 0)``), so that autograd carries its gradient to what it reads.

    Args:
        score_mod: the function (or a built-in bound to the call).
        batch, heads: ``B`` and ``H`` of the call.
        distances: ``(d0, d1)``, the distances ``q_idx - kv_idx`` to evaluate.
        device: where the call's tensors are.

    Returns:
        ``(B|1, H|1, d1 - d0)`` float32: ``f(b, h, d0 + u)`` at ``[b, h, u]``.

    Raises:
        TypeError: the function returns no floating point tensor. ValueError: its result does not broadcast to
        the block it was given.
    """
    d = torch.arange(*distances, device=device)  # (R,)
    score, b, h, q_idx, kv_idx = _probe(batch, heads, d, device)
    out = score_mod(score, b, h, q_idx, kv_idx)  # (B|1, H|1, 1, R|1)
    if not isinstance(out, Tensor) or not out.is_floating_point():
        raise TypeError(f"score_mod must return the scores (floating point), got {out!r:.80}")
    block = (batch, heads, 1, d.numel())
    if not broadcasts(out.shape, block):
        raise ValueError(f"score_mod must return a tensor that broadcasts to the block {block}, got {tuple(out.shape)}")
    out = out.reshape((1,) * (4 - out.dim()) + tuple(out.shape))  # (B|1, H|1, 1, R|1)
    return out.to(torch.float32).expand(out.shape[0], out.shape[1], 1, d.numel())[:, :, 0]  # (B|1, H|1, R)


# make_fx patches module state while it traces (two threads at once: "CURRENT_PATCHER is None"): one at a time
_TRACING = threading.Lock()
# Python functions found not to be a bias on the distance: by code object (weakly: an entry goes with the code), the
# last _REMEMBERED closures of each, held weakly and compared by identity (a stale entry cannot arise: a dead
# referent matches nothing), so that a lambda made again at each call over the same table is traced once.
_NOT_DISTANCE: weakref.WeakKeyDictionary[types.CodeType, list[tuple[object, ...]]] = weakref.WeakKeyDictionary()
_REMEMBERED = 8


def _closure(score_mod: ScoreFn) -> tuple[object, ...] | None:
    """What a Python function's closure and defaults hold, each as a weak reference (a number or string as
    itself), or ``None`` for anything else, or for a function that holds what can be neither (a list)."""
    if not isinstance(score_mod, types.FunctionType):
        return None
    try:
        held = [c.cell_contents for c in score_mod.__closure__ or ()] + list(score_mod.__defaults__ or ())
    except ValueError:  # a cell not filled yet
        return None
    out: list[object] = []
    for x in held:
        if x is None or isinstance(x, (bool, int, float, str)):
            out.append(x)
        else:
            try:
                out.append(weakref.ref(x))
            except TypeError:  # not weakly referable
                return None
    return tuple(out)


def _same_closure(a: tuple[object, ...], b: tuple[object, ...]) -> bool:
    """Two closures of :func:`_closure` hold the same objects (alive, and identical) and equal numbers."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b, strict=True):
        if isinstance(x, weakref.ref) and isinstance(y, weakref.ref):
            if x() is None or x() is not y():
                return False
        elif isinstance(x, weakref.ref) or isinstance(y, weakref.ref) or type(x) is not type(y) or x != y:
            return False
    return True


def _known_not(score_mod: ScoreFn, closure: tuple[object, ...] | None) -> bool:
    if closure is None:
        return False
    seen = _NOT_DISTANCE.get(score_mod.__code__, ())  # type: ignore[union-attr]
    return any(_same_closure(closure, c) for c in seen)


def _remember_not(score_mod: ScoreFn, closure: tuple[object, ...] | None) -> None:
    if closure is None:
        return
    seen = _NOT_DISTANCE.setdefault(score_mod.__code__, [])  # type: ignore[union-attr]
    seen[:] = [c for c in seen if all(x() is not None for x in c if isinstance(x, weakref.ref))][-_REMEMBERED + 1 :]
    seen.append(closure)


def _traced_form(score_mod: ScoreFn) -> bool:
    """Traced twice, on the small probe :func:`distance_bias` uses and on a block of scores as the backends give
    it, of other sizes throughout: both graphs of the form, and the same graph (a function that reads a size, say
    ``score.size(1)`` for the number of heads, bakes it in as a constant that differs: not one)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    graphs = []
    for args in (_probe(2, 3, torch.arange(-2, 3), torch.device("cpu")), _block()):
        try:
            with _TRACING, torch.no_grad(), _quiet():
                graph = make_fx(score_mod, tracing_mode="fake", _allow_non_fake_inputs=True)(*args).graph
        except Exception:  # Python control flow on a value, an operation fake tensors lack, a wrong signature
            return False
        try:
            if not _additive_in_distance(graph):
                return False
        except (AttributeError, KeyError, TypeError, ValueError):  # a graph of a shape this reading does not expect
            return False
        graphs.append(_signature(graph))
    return graphs[0] == graphs[1]


def _block() -> tuple[Tensor, ...]:
    """A block of scores ``(7, 6, 4, 9)`` and its index tensors, as the backends call a score_mod (no size in common
    with :func:`_probe`'s)."""
    b, h, q_idx, kv_idx = indices(7, 6, (0, 4), (0, 9), None)  # (7, 1, 1, 1), (1, 6, 1, 1), (1, 1, 4, 1), (1, 1, 1, 9)
    return torch.zeros(7, 6, 4, 9), b, h, q_idx, kv_idx  # the scores (7, 6, 4, 9)


def _signature(graph: torch.fx.Graph) -> list[tuple[object, ...]]:
    """The graph's operations and their arguments, nodes by position (what two traces of one code path share)."""
    where = {node: i for i, node in enumerate(graph.nodes)}

    def plain(a: Any) -> Any:
        if isinstance(a, torch.fx.Node):
            return ("node", where[a])
        if isinstance(a, (list, tuple)):
            return tuple(plain(x) for x in a)
        if isinstance(a, dict):
            return tuple(sorted((k, plain(x)) for k, x in a.items()))
        return repr(a)

    return [(n.op, str(n.target), plain(n.args), plain(n.kwargs)) for n in graph.nodes]


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """FakeTensor logs an error, with its traceback, for an operation that fails while traced: here that only means
    the function is not a distance bias. Drops this thread's records of that logger while it lasts (a filter: the
    logger's level, which other threads read, is left alone)."""
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    me = threading.get_ident()

    def others(record: logging.LogRecord) -> bool:
        return record.thread != me

    logger.addFilter(others)
    try:
        yield
    finally:
        logger.removeFilter(others)


def _probe(batch: int, heads: int, d: Tensor, device: Any) -> tuple[Tensor, ...]:
    """A score of 0 and index tensors at the distances ``d``, in the layout attnkit's blocks use."""
    score = torch.zeros(1, 1, 1, 1, device=device)  # (1, 1, 1, 1)
    b = torch.arange(batch, device=device).view(batch, 1, 1, 1)  # (B, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, heads, 1, 1)  # (1, H, 1, 1)
    q_idx = d.clamp(min=0).view(1, 1, 1, -1)  # (1, 1, 1, R)
    kv_idx = (-d).clamp(min=0).view(1, 1, 1, -1)  # (1, 1, 1, R)
    return score, b, h, q_idx, kv_idx


def _additive_in_distance(graph: torch.fx.Graph) -> bool:
    """The graph of ``score_mod`` is ``score + f`` with ``f`` element-wise in ``b``, ``h`` and ``q_idx - kv_idx``.

    Each value is one of: the score; constant (reads no placeholder); ``free`` (element-wise in ``b``, ``h`` and
    ``q_idx - kv_idx``); or ``(a, c)``, the whole-number combination ``a q_idx + c kv_idx + const``, which is free
    where ``a == -c``. An operation that reads a combination other than a difference is refused."""
    nodes = list(graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    outputs = [n for n in nodes if n.op == "output"]
    if len(placeholders) != 5 or len(outputs) != 1:
        return False
    score, b, h, q_idx, kv_idx = placeholders
    result = outputs[0].args[0]
    if not isinstance(result, torch.fx.Node) or list(score.users) != [result] or not _adds_score(result, score):
        return False
    kind: dict[torch.fx.Node, Any] = {b: _FREE, h: _FREE, q_idx: (1, 0), kv_idx: (0, 1)}
    for node in nodes:
        if node.op == "get_attr":
            kind[node] = _CONST
        elif node.op == "call_function" and node is not result:
            found = _kind(node, kind)
            if found is None:
                return False
            kind[node] = found
        elif node.op not in ("placeholder", "output", "get_attr", "call_function"):
            return False
    other = [a for a in result.args[:2] if a is not score]
    return all(not isinstance(a, torch.fx.Node) or (_free(kind[a]) and _scalar(a, kind)) for a in other)


def _adds_score(node: torch.fx.Node, score: torch.fx.Node) -> bool:
    """``node`` is ``score + x``, ``x + score`` or ``score - x`` (no ``alpha`` other than 1)."""
    if node.kwargs.get("alpha", 1) != 1 or len(node.args) != 2:
        return False
    if node.target is _aten.add.Tensor:
        return score in node.args and node.args[0] is not node.args[1]
    return node.target is _aten.sub.Tensor and node.args[0] is score and node.args[1] is not score


def _free(kind: Any) -> bool:
    """A value that is element-wise in ``b``, ``h`` and ``q_idx - kv_idx`` (a constant, or a difference)."""
    return kind in (_FREE, _CONST) or (isinstance(kind, tuple) and kind[0] == -kind[1])


def _scalar(node: torch.fx.Node, kind: dict[torch.fx.Node, Any]) -> bool:
    """Not a constant of more than one element (which would broadcast against a block's shape)."""
    return kind[node] != _CONST or node.meta["val"].numel() == 1


def _kind(node: torch.fx.Node, kind: dict[torch.fx.Node, Any]) -> Any:
    """What ``node`` is, from what it reads (``None``: not of the form)."""
    op = node.target
    if not isinstance(op, torch._ops.OpOverload) or op._schema.is_mutable:
        return None
    if torch.Tag.nondeterministic_seeded in op.tags:
        return None
    inputs = [a for a in _flat(node.args) + _flat(node.kwargs) if isinstance(a, torch.fx.Node)]
    if any(a not in kind for a in inputs):  # the score, read a second time
        return None
    kinds = [kind[a] for a in inputs]
    if all(k == _CONST for k in kinds):
        return _CONST
    linear = [k for k in kinds if isinstance(k, tuple)]
    if linear and len(linear) == len(kinds) and op in _LINEAR:
        combined = _combine(node, kind)
        if combined is not None:
            return combined
    if not all(_free(k) for k in kinds):
        return None  # q_idx or kv_idx read other than through their difference
    if torch.Tag.pointwise in op.tags or op in _ELEMENTWISE:
        # a constant of more than one element would broadcast against the block's positions, not the indices
        return _FREE if all(_scalar(a, kind) for a in inputs) else None
    if op is _aten.index.Tensor:  # a tensor the function holds, indexed element by element
        table, index = node.args[0], node.args[1]
        if not isinstance(index, (list, tuple)):
            return None
        if not isinstance(table, torch.fx.Node) or kind[table] != _CONST:
            return None
        nodes = [i for i in index if isinstance(i, torch.fx.Node)]
        if len(nodes) == len(index) == table.meta["val"].dim() and all(
            i.meta["val"].dtype not in (torch.bool, torch.uint8) and _scalar(i, kind) for i in nodes
        ):
            return _FREE
    return None


def _combine(node: torch.fx.Node, kind: dict[torch.fx.Node, Any]) -> tuple[int, int] | None:
    """``a q_idx + c kv_idx`` of an addition, subtraction, negation or product by a whole number."""
    op, args = node.target, node.args
    alpha = node.kwargs.get("alpha", 1)
    if not isinstance(alpha, int) or any(k not in ("alpha",) for k in node.kwargs):
        return None

    def coefficients(x: Any) -> tuple[int, int] | None:
        if isinstance(x, torch.fx.Node):
            return kind[x]  # type: ignore[no-any-return]
        return (0, 0) if isinstance(x, int) and not isinstance(x, bool) else None

    if op is _aten.neg.default:
        a = coefficients(args[0])
        return None if a is None else (-a[0], -a[1])
    x, y = coefficients(args[0]), coefficients(args[1])
    if x is None or y is None:
        return None
    if op is _aten.add.Tensor:
        return (x[0] + alpha * y[0], x[1] + alpha * y[1])
    if op is _aten.sub.Tensor:
        return (x[0] - alpha * y[0], x[1] - alpha * y[1])
    factor = args[1] if isinstance(args[0], torch.fx.Node) else args[0]  # mul: by a whole number only
    if isinstance(args[0], torch.fx.Node) and isinstance(args[1], torch.fx.Node):
        return None
    if not isinstance(factor, int) or isinstance(factor, bool):
        return None
    return (x[0] * factor + y[0] * factor, x[1] * factor + y[1] * factor)


def _flat(x: Any) -> list[Any]:
    if isinstance(x, (list, tuple)):
        return [y for item in x for y in _flat(item)]
    if isinstance(x, dict):
        return [y for item in x.values() for y in _flat(item)]
    return [x]
