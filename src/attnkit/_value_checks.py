"""Checks that read a tensor's values, kept under ``torch.compile``.

Eagerly, attnkit checks lengths, float masks and sinks by reading their values (``bool(...)``, ``.item()``): under
``torch.compile`` each read is a graph break. :func:`checked` runs such a check where the values are: eagerly, at
once; while dynamo traces, as the custom op ``attnkit::check_values``, which runs the same check (the same error,
message and warning) each time the compiled code runs, and returns a zero that is added to the tensor checked, so
that the op stays in the graph, before what the tensor feeds.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["checked", "value_check"]

# name -> check(x, name, bound, what): raises (or warns) for values the caller may not pass
_CHECKS: dict[str, Callable[[Tensor, str, int, str], None]] = {}


def value_check(
    kind: str,
) -> Callable[[Callable[[Tensor, str, int, str], None]], Callable[[Tensor, str, int, str], None]]:
    """Register ``check(x, name, bound, what)`` as the check of ``kind`` (a decorator, used where the check lives)."""

    def register(check: Callable[[Tensor, str, int, str], None]) -> Callable[[Tensor, str, int, str], None]:
        _CHECKS[kind] = check
        return check

    return register


@torch.library.custom_op("attnkit::check_values", mutates_args=())
def _check_values(x: Tensor, kind: str, name: str, bound: int, what: str) -> Tensor:
    _CHECKS[kind](x, name, bound, what)
    return torch.zeros((), dtype=torch.int64, device=x.device)


@_check_values.register_fake
def _(x: Tensor, kind: str, name: str, bound: int, what: str) -> Tensor:
    return torch.zeros((), dtype=torch.int64, device=x.device)


def checked(x: Tensor, kind: str, name: str, bound: int = 0, what: str = "", *, keep: Tensor | None = None) -> Tensor:
    """``keep`` (``x`` when ``None``), once the values of ``x`` pass the check registered as ``kind`` (``name``,
    ``bound``, ``what``: what its message says). Eagerly the check runs now; while ``torch.compile`` traces, the
    result is ``keep + 0``, the ``0`` from the op that runs the check (the gradient is ``keep``'s)."""
    keep = x if keep is None else keep
    if torch.compiler.is_compiling():
        return keep + _check_values(x.detach(), kind, name, bound, what)
    _CHECKS[kind](x.detach(), name, bound, what)
    return keep
