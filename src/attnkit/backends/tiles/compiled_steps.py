"""The steps of :mod:`attnkit.backends.tiles.compiled`, plain PyTorch on one ``BLOCK x BLOCK`` tile: compiled by
``torch.compile`` (Inductor's C++ code on CPU), one graph each, and run as they are where compiling fails.

A forward step folds a tile into the running softmax of its queries; a backward step recomputes the tile's weights
from each row's log-sum-exp and takes the score_mod's derivative with ``torch.func.vjp`` in the same graph, so that
a ``score_mod`` such as ``softcap`` costs one fused pass over the tile, not one per operation; the closure step's
autograd gives the tensors a score_mod closes over their share of the tile's gradient.

Additive scoring, ``s[i, j] = w . tanh(q[i] + k[j])``, comes in two forms (``_scores``): ``tanh`` as written,
and ``exp``, where the caller passed ``exp(2 (q - mid))`` and ``exp(2 (k + mid))`` for ``q`` and ``k``, the keys
clamped (:func:`exp_form`), so that ``tanh(q + k) = 1 - 2 y`` with ``y = 1 / (q k + 1)``: a product and a reciprocal
per feature instead of a ``tanh``.
"""

from __future__ import annotations

import collections
import functools
import math
import threading
import types
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

__all__ = ["ScoreFn", "closure_grads", "exp_form", "failed", "name", "run", "warn_once"]

# B batch, H heads, n a tile's queries, c a tile's keys (columns), D head dim, Dv value head dim

ScoreFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


def name(fn: object) -> str:
    """The function's name, for messages."""
    if fn is None:
        return "attention without a score_mod"
    return str(getattr(fn, "__qualname__", None) or type(fn).__name__)


def exp_form(q: Tensor, k: Tensor) -> tuple[Tensor, Tensor] | None:
    """``q (B, H, Lq, D)`` and ``k (B, H, Lk, D)`` as the ``exp`` form of additive scoring takes them,
    ``exp(2 (q - mid))`` and ``exp(2 clamp(k + mid, -r - sat, r + sat))``, with ``mid`` the middle and ``r`` the
    half range of each feature of the queries (per example and head), ``sat`` where ``tanh`` rounds to 1 in the
    dtype: every factor is a normal number, so a product is 0 or inf only where ``tanh`` is -1 or 1, and the clamp
    moves only keys that saturate against every query (``|q - mid| <= r``; a key whose ``k + mid`` overflows, or an
    infinite one, among them). ``None`` where that cannot hold (queries not finite, or spread wider than the dtype's
    exponents reach): then the ``tanh`` form."""
    if not q.numel():
        return None
    sat = 10.0 if q.dtype == torch.float32 else 20.0  # tanh(10) rounds to 1 in float32, tanh(20) in float64
    top, bottom = q.amax(dim=2, keepdim=True), q.amin(dim=2, keepdim=True)  # (B, H, 1, D) each
    r = (top - bottom) / 2  # (B, H, 1, D)
    # (B, H, 1, D), finite where r is: (top + bottom) / 2 would overflow near the dtype's largest number
    mid = bottom + r
    reach = -math.log(torch.finfo(q.dtype).tiny) / 2 - sat - 1  # e^(2 (r + sat)) stays a normal number
    if not bool(torch.isfinite(r).all()) or float(r.max()) > reach:
        return None
    kc = torch.minimum(torch.maximum(k + mid, -r - sat), r + sat)  # (B, H, Lk, D); NaN stays NaN
    return torch.exp(2 * (q - mid)), torch.exp(2 * kc)


def _scores(q: Tensor, k: Tensor, w: Tensor | None, scale: float, exp: bool) -> Tensor:
    """The scores ``(B, H, n, c)`` of a tile: ``scale * q . k`` without ``w``, else additive in the form ``exp``
    says (the ``(B, H, n, c, D)`` features are fused into the sum, never stored)."""
    if w is None:
        return (q @ k.transpose(-2, -1)) * scale  # (B, H, n, c)
    if exp:
        y = torch.reciprocal(q[..., :, None, :] * k[..., None, :, :] + 1)  # (B, H, n, c, D): (1 - tanh) / 2
        return w.sum() - 2 * (y * w).sum(dim=-1)  # (B, H, n, c)
    return (torch.tanh(q[..., :, None, :] + k[..., None, :, :]) * w).sum(dim=-1)  # (B, H, n, c)


def _score_grads(
    ds: Tensor, q: Tensor, k: Tensor, w: Tensor | None, scale: float, exp: bool
) -> tuple[Tensor, Tensor, Tensor | None]:
    """``dq (B, H, n, D)``, ``dk (B, H, c, D)`` and ``dw (B, H, n, D)`` (each query's share of ``w``'s gradient; None
    without ``w``) of a tile from ``ds (B, H, n, c)``, the gradient of its scores. Additive: the features are
    recomputed in each sum over keys and in the sum over queries, so that no ``(B, H, n, c, D)`` tensor is stored
    (one tensor feeding sums over two different dimensions would be); ``tanh' = 1 - tanh^2 = 4 y (1 - y)``. ``dw``
    is left per query, for the caller to sum over all of them at the end (``torch.sum`` over many terms rounds
    less than one running total of each tile's ``n c`` terms would)."""
    if w is None:
        return (ds @ k) * scale, (ds.transpose(-2, -1) @ q) * scale, None  # (B, H, n, D), (B, H, c, D)
    dst = ds.transpose(-2, -1)[..., None]  # (B, H, c, n, 1)
    if exp:
        y = torch.reciprocal(q[..., :, None, :] * k[..., None, :, :] + 1)  # (B, H, n, c, D)
        yt = torch.reciprocal(k[..., :, None, :] * q[..., None, :, :] + 1)  # (B, H, c, n, D): y, transposed
        dq = (ds[..., None] * (y - y * y)).sum(dim=-2) * (4 * w)  # (B, H, n, D)
        dk = (dst * (yt - yt * yt)).sum(dim=-2) * (4 * w)  # (B, H, c, D)
        dw = (ds[..., None] * (1 - 2 * y)).sum(dim=-2)  # (B, H, n, D)
        return dq, dk, dw
    f = torch.tanh(q[..., :, None, :] + k[..., None, :, :])  # (B, H, n, c, D)
    ft = torch.tanh(k[..., :, None, :] + q[..., None, :, :])  # (B, H, c, n, D)
    dq = (ds[..., None] * (1 - f * f)).sum(dim=-2) * w  # (B, H, n, D)
    dk = (dst * (1 - ft * ft)).sum(dim=-2) * w  # (B, H, c, D)
    return dq, dk, (ds[..., None] * f).sum(dim=-2)  # (B, H, n, D)


def _forward_step(
    score_mod: ScoreFn | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    w: Tensor | None,
    m: Tensor,
    l: Tensor,  # noqa: E741
    acc: Tensor,
    saw_key: Tensor,
    idx: tuple[Tensor, Tensor, Tensor, Tensor],
    allowed: Tensor | None,
    bias: Tensor | None,
    scale: float,
    exp: bool,
    guard: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """One tile folded into the running softmax ``m, l (B, H, n)``, ``acc (B, H, n, Dv)`` of its queries (scored as
    ``_scores`` says), and ``saw_key (B, H, n)``: the rows that saw some key so far (with a sink, ``l`` cannot tell);
    ``guard``: the keys or values hold a value that is not finite, which must not reach a row through a weight of 0
    (the values of keys no row of the tile sees are zeroed, as in ``tiles:online``)."""
    s = _scores(q, k, w, scale, exp)  # (B, H, n, c)
    if score_mod is not None:
        s = score_mod(s, *idx).to(s.dtype).expand_as(s)  # (B, H, n, c)
    if bias is not None:
        s = s + bias
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    if guard:
        unseen = torch.isneginf(s).all(dim=-2)[..., None]  # (B, H, c, 1): keys no row of the tile sees
        v = v.masked_fill(unseen, 0.0)  # (B, H, c, Dv)
    m_new = torch.maximum(m, s.amax(dim=-1))  # running row max; -inf in rows that saw nothing yet
    m_safe = torch.where(torch.isneginf(m_new), 0.0, m_new)
    alpha = torch.exp(m - m_safe)  # rescales what was summed so far
    p = torch.exp(s - m_safe[..., None])  # (B, H, n, c); 0 where hidden
    saw_key = saw_key | ~torch.isneginf(s).all(dim=-1)  # (B, H, n)
    return m_new, l * alpha + p.sum(dim=-1), acc * alpha[..., None] + p @ v, saw_key


def _backward_step(
    score_mod: ScoreFn | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    w: Tensor | None,
    dout: Tensor,
    lse: tuple[Tensor, Tensor],
    delta: Tensor,
    idx: tuple[Tensor, Tensor, Tensor, Tensor],
    allowed: Tensor | None,
    bias: Tensor | None,
    scale: float,
    exp: bool,
    guard: bool,
    keep: bool,
) -> tuple[Tensor | None, ...]:
    """One tile's gradients ``dq (B, H, n, D)``, ``dk (B, H, c, D)``, ``dv (B, H, c, Dv)``, ``dw (B, H, n, D)`` (its
    queries' shares; None without ``w``), its weights recomputed from ``lse``, the rows' log-sum-exp as two terms
    ``(B, H, n)`` (:class:`~attnkit.backends.tiles.softmax.LogSumExp`; ``exp``, ``guard`` as in
    :func:`_forward_step`); with ``keep``, also the raw scores and the gradient of the modified ones, for the
    tensors the score_mod closes over."""
    raw = _scores(q, k, w, scale, exp)  # (B, H, n, c)
    vjp = None
    if score_mod is None:
        s = raw
    else:
        found = torch.func.vjp(lambda x: score_mod(x, *idx).to(x.dtype).expand_as(x), raw)
        s, vjp = found[0], found[1]  # (B, H, n, c), the score_mod's vector-Jacobian product
    if bias is not None:
        s = s + bias
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    # (B, H, n, c): the weights again; 0 where hidden, whatever the row's lse (NaN in a row whose query is: its
    # output gradient of 0 then keeps dv finite past the keys it sees, as the reference's)
    top, rest = lse
    p = torch.where(torch.isneginf(s), 0.0, torch.exp((s - top[..., None]) - rest[..., None]))
    hidden = torch.isneginf(s) if guard else None  # (B, H, n, c)
    if hidden is not None:
        unseen = hidden.all(dim=-2)[..., None]  # (B, H, c, 1): keys no row of the tile sees
        k, v = k.masked_fill(unseen, 0.0), v.masked_fill(unseen, 0.0)  # (B, H, c, D), (B, H, c, Dv)
    dv = p.transpose(-2, -1) @ dout  # (B, H, c, Dv)
    dp = dout @ v.transpose(-2, -1)  # (B, H, n, c)
    dmod = p * (dp - delta[..., None])  # (B, H, n, c): gradient of the modified scores
    if hidden is not None:
        dmod = dmod.masked_fill(hidden, 0.0)
    ds = dmod if vjp is None else vjp(dmod)[0]  # (B, H, n, c)
    # as FlexAttention: a score_mod singular where the mask hides has no gradient there (nor one that meets a
    # key that is not finite where it hides it)
    if hidden is not None:
        ds = ds.masked_fill(hidden, 0.0)
    elif allowed is not None:
        ds = ds.masked_fill(~allowed, 0.0)
    dq, dk, dw = _score_grads(ds, q, k, w, scale, exp)  # (B, H, n, D), (B, H, c, D), (B, H, n, D) or None
    if keep:
        return dq, dk, dv, dw, raw, dmod
    return dq, dk, dv, dw


def _closure_term(score_mod: ScoreFn, raw: Tensor, dmod: Tensor, idx: tuple[Tensor, ...]) -> Tensor:
    """``sum(score_mod(raw) * dmod)``, whose gradient to what the score_mod closes over is that tensor's share of
    this tile's gradient (0 where ``dmod`` is, whatever the score_mod gives there: -inf included)."""
    modded = score_mod(raw, *idx).to(raw.dtype).expand_as(raw)  # (B, H, n, c)
    return torch.where(dmod == 0, 0.0, modded * dmod).sum()


_STEPS: dict[str, Callable[..., Any]] = {"forward": _forward_step, "backward": _backward_step, "closure": _closure_term}

# The compiled steps, one per step, score_mod (:func:`_key`) and the shapes, strides and flags of the arguments, the
# last used last: each has code of its own, on which dynamo keeps its one graph (its limit of graphs per code
# object, 8, would otherwise send a model's ninth variant to eager code, silently: checked on torch 2.13 by
# tests/test_compiled.py, which counts the graphs).
KEPT_STEPS = 64
# The torch.compile backend the steps are given to: Inductor, whose C++ code is what this engine is for. (The test
# suite gives most of its calls to "aot_eager_decomp_partition", dynamo's and AOTAutograd's graphs without Inductor's
# C++, and its tests marked ``inductor`` to Inductor: conftest.py.)
COMPILER = "inductor"
_KEPT: collections.OrderedDict[object, Callable[..., Any]] = collections.OrderedDict()
# (COMPILER, score_mod's key) of the score_mods whose compiled steps failed: they run eagerly from then on, after one
# warning each.
_FAILED: set[object] = set()
_LOCK = threading.Lock()


def _key(fn: object) -> object:
    """What tells one score_mod's graphs from another's: a function's code and the numbers it closes over (dynamo
    makes them constants of the graph), a partial's function and numbers, a callable object's type and numbers."""
    if isinstance(fn, functools.partial):
        return ("partial", _key(fn.func), _numbers(fn.args), _numbers(fn.keywords.values()))
    code = getattr(fn, "__code__", None)
    if code is not None:
        cells = getattr(fn, "__closure__", None) or ()
        return (code, _numbers(c.cell_contents for c in cells if _filled(c)))
    return (type(fn), _numbers(vars(fn).values()) if hasattr(fn, "__dict__") else ())


def _numbers(values: Iterable[object]) -> tuple[object, ...]:
    return tuple(v if isinstance(v, (bool, int, float, str, type(None))) else type(v).__name__ for v in values)


def _filled(cell: Any) -> bool:
    try:
        _ = cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True


def _variant(args: tuple[Any, ...]) -> tuple[object, ...]:
    """What sets a step's graph: the arguments' shapes and dtypes, which are ``None``, the flags."""
    out: list[object] = []
    for a in args:
        if isinstance(a, tuple):
            out.append(_variant(a))
        elif isinstance(a, Tensor):
            out.append((tuple(a.shape), a.stride(), a.dtype))
        else:
            out.append(a if a is None or isinstance(a, bool) else type(a))
    return tuple(out)


def _compiled(step: str, key: object, args: tuple[Any, ...]) -> Callable[..., Any]:
    compiler = COMPILER
    full_key = (step, key, _variant(args), compiler)
    with _LOCK:
        fn = _KEPT.get(full_key)
        if fn is None:
            fn = _KEPT[full_key] = torch.compile(_copy(_STEPS[step]), backend=compiler, dynamic=False)
            while len(_KEPT) > KEPT_STEPS:
                _KEPT.popitem(last=False)
        _KEPT.move_to_end(full_key)
        return fn


def _copy(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with a code object of its own (dynamo keeps its graphs on the code object)."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def run(step: str, score_mod: ScoreFn | None, *args: Any) -> Any:
    """The step compiled; run eagerly when this score_mod's compiling failed before, or fails now (with a warning,
    once). An error the eager step raises as well is the function's own.

    Raises:
        ValueError: the score_mod raised, naming it.
    """
    key = _key(score_mod)
    if (COMPILER, key) in _FAILED or torch.compiler.is_compiling():
        return _eager(step, score_mod, *args)
    try:
        return _compiled(step, key, args)(score_mod, *args)
    except Exception as error:
        result = _eager(step, score_mod, *args)  # raises the function's own error, when it is one
        reason = str(error).strip().splitlines()[0] if str(error).strip() else ""
        warn_once(score_mod, f"{type(error).__name__}: {reason}")
        return result


def _eager(step: str, score_mod: ScoreFn | None, *args: Any) -> Any:
    try:
        return _STEPS[step](score_mod, *args)
    except Exception as error:
        if score_mod is None:
            raise
        raise ValueError(f"score_mod {name(score_mod)} raised {type(error).__name__} on a tile: {error}") from error


def closure_grads(
    score_mod: ScoreFn, raw: Tensor, dmod: Tensor, idx: tuple[Tensor, ...], closed_over: Sequence[Tensor]
) -> tuple[Tensor | None, ...]:
    """The gradients of the tensors ``closed_over`` (read by the score_mod) through one tile: the autograd gradient
    of ``sum(score_mod(raw) * dmod)``, compiled forward and backward, eagerly where compiling fails (once a
    warning). ``None`` for a tensor the tile's scores do not depend on."""
    with torch.enable_grad():
        term = run("closure", score_mod, raw, dmod, idx)
    try:  # (AOTAutograd compiles the backward graph here, at its first use)
        return torch.autograd.grad(term, closed_over, allow_unused=True)
    except Exception as error:
        if (COMPILER, _key(score_mod)) in _FAILED:
            raise
        warn_once(score_mod, f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error) else ''}")
        with torch.enable_grad():
            term = _eager("closure", score_mod, raw, dmod, idx)
        return torch.autograd.grad(term, closed_over, allow_unused=True)


def failed(score_mod: ScoreFn | None) -> bool:
    """Whether this score_mod's steps failed to compile before (they run eagerly now)."""
    return (COMPILER, _key(score_mod)) in _FAILED


def warn_once(score_mod: ScoreFn | None, why: str) -> None:
    """This score_mod runs eagerly from now on: say so, the first time."""
    key = (COMPILER, _key(score_mod))
    with _LOCK:
        first = key not in _FAILED
        _FAILED.add(key)
    if first:
        warnings.warn(
            f"attnkit: the blocks of {name(score_mod)} cannot be compiled ({why}); they run eagerly from now on "
            "(the same results, slower)",
            RuntimeWarning,
            stacklevel=3,
        )
