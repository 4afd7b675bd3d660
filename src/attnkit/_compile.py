"""What attnkit needs of ``torch.compile`` without importing it: ``import attnkit`` loads neither ``torch._dynamo`` nor
Inductor nor Triton (about 1 s here, 4 s with Triton installed: ``tests/test_imports.py``)."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import torch

__all__ = ["outside_graph"]

F = TypeVar("F", bound=Callable[..., Any])


def outside_graph(fn: F) -> F:
    """``fn``, run as it is (a graph break) where ``torch.compile`` traces a call to it: what
    ``torch.compiler.disable`` does, made only when first needed, since making it imports ``torch._dynamo``.

    The first call under a trace makes the disabled form there, which costs that trace one more graph break; the
    form is kept for every later trace, and an eager call made once dynamo is loaded makes it ahead."""
    disabled: list[Callable[..., Any]] = []

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            if not disabled:
                disabled.append(torch.compiler.disable(fn))
            return disabled[0](*args, **kwargs)
        if not disabled and "torch._dynamo" in sys.modules:
            disabled.append(torch.compiler.disable(fn))
        return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]
