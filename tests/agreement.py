"""The agreement harness: any engine of :data:`attnkit.dispatch.ENGINES` against the float64 math of
tests/mathref.py, held to the accuracy the engine declares itself (``SUPPORTS.accuracy``,
:class:`attnkit.backends.contract.Accuracy`), never to a tolerance of a test's own.

An engine that cannot run a call says so (``backend=... cannot run this call``): :func:`run` gives ``None`` and the
caller counts what ran, so that a matrix no engine runs fails instead of passing empty. An engine without autograd
(``decode``) is compared on its output, computed under ``torch.no_grad()``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

import attnkit
from attnkit import dispatch
from mathref import max_err

#: The engines that run on this machine: the backends, with the tile engine's implementations in its place.
ENGINES_HERE = tuple(attnkit.available_backends(implementations=True))


def bounds(engine: str, dtype: torch.dtype) -> tuple[float, float]:
    """``(output, gradient)`` bounds ``engine`` declares for inputs of ``dtype`` (a gradient's is a multiple of
    ``max(1, max |true gradient|)``)."""
    return dispatch.ENGINES[engine].SUPPORTS.accuracy.bounds(dtype)


def has_autograd(engine: str) -> bool:
    return dispatch.ENGINES[engine].SUPPORTS.grad


def runs_dtype(engine: str, dtype: torch.dtype) -> bool:
    dtypes = dispatch.ENGINES[engine].SUPPORTS.dtypes
    return dtypes is None or dtype in dtypes


class Run(NamedTuple):
    out: Tensor
    weights: Tensor | None
    grads: tuple[Tensor, ...]  # one per leaf, in order; () without autograd
    names: tuple[str, ...]


def run(
    engine: str,
    leaves: Sequence[Tensor],
    names: Sequence[str],
    call: Callable[..., Any],
    grad_out: Tensor,
    *,
    need_weights: bool = False,
) -> Run | None:
    """``call(backend=engine, need_weights=...)`` (a closure over the leaves), its output and the gradient of every
    leaf for ``grad_out``; ``None`` where the engine says it cannot run the call."""
    grad = has_autograd(engine)
    try:
        with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
            out, weights = call(backend=engine, need_weights=need_weights)
    except ValueError as error:
        if f"backend={engine!r} cannot run this call" in str(error):
            return None
        raise
    if not grad:
        return Run(out, weights, (), tuple(names))
    grads = torch.autograd.grad(out, list(leaves), grad_out.to(out.dtype), allow_unused=True)
    grads = tuple(torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves, strict=True))
    return Run(out, weights, grads, tuple(names))


def assert_agrees(
    engine: str,
    ours: Run,
    truth: Run,
    dtype: torch.dtype,
    where: str,
    *,
    low: Run | None = None,
    floors: dict[str, float] | None = None,
) -> None:
    """``ours`` (``engine``'s, from inputs of ``dtype``) within what ``engine`` declares of ``truth`` (float64 math
    from the same inputs): the output (and weights) within its output bound, each gradient within its gradient bound
    times ``max(1, max |true gradient|)``. Low precision (``low``: the math computed in ``dtype`` itself): within
    ``accuracy.low_precision`` times that math's own error, plus the float32 bounds. ``floors``: a gradient's own
    floor where rounding alone may exceed the rule (:func:`rounding_of_sum`), by leaf name."""
    accuracy = dispatch.ENGINES[engine].SUPPORTS.accuracy
    out_tol, grad_tol = accuracy.bounds(dtype)
    assert ours.out.dtype == dtype, f"{where}: the output is {ours.out.dtype}"
    limit = out_tol + (accuracy.low_precision * max_err(low.out, truth.out) if low is not None else 0.0)
    found = max_err(ours.out, truth.out)
    assert found <= limit, f"out: {engine}, {where}: {found:.3g} > {limit:.3g}"
    if ours.weights is not None:
        limit = out_tol + (accuracy.low_precision * max_err(low.weights, truth.weights) if low is not None else 0.0)
        assert max_err(ours.weights, truth.weights) <= limit, f"weights: {engine}, {where}"
    for i, (name, grad) in enumerate(zip(ours.names, ours.grads, strict=False)):
        true = truth.grads[i]
        assert torch.isfinite(grad).all(), f"d{name}: {engine}, {where}: not finite"
        limit = grad_tol * max(1.0, true.abs().max().item() if true.numel() else 0.0)
        if low is not None:
            limit += accuracy.low_precision * max_err(low.grads[i], true)
        limit = max(limit, (floors or {}).get(name, 0.0))
        found = max_err(grad, true)
        assert found <= limit, f"d{name}: {engine}, {where}: {found:.3g} > {limit:.3g}"


def rounding_of_sum(terms: Tensor, dtype: torch.dtype, dims: Sequence[int]) -> float:
    """The size of the rounding error of summing ``terms`` over ``dims`` in ``dtype`` (each term rounded once, the
    errors independent): ``eps * sqrt(sum terms^2)``, the largest over what remains. A gradient that is a sum over
    every pair (ALiBi's slopes: each score's gradient times its distance) is 0 where softmax is flat and its true
    value tells nothing of its error: this is the scale its float32 rounding takes there."""
    if not terms.numel():
        return 0.0
    spread = terms.double().square().sum(dim=tuple(dims)).sqrt()
    return float(torch.finfo(dtype).eps * spread.max().item()) if spread.numel() else 0.0


def count_refused(ran: dict[str, int], engines: Sequence[str]) -> list[str]:
    """The engines of ``engines`` that ran nothing (a matrix that tests nothing of them)."""
    return [e for e in engines if ran.get(e, 0) == 0]
