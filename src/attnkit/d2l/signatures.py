"""The book's signatures: binding a layer's arguments to its explicit-size form or its newer size-inferring one,
and the checks of a call's inputs, made before any work (a lazy layer draws nothing on a mistake)."""

from __future__ import annotations

import inspect
from typing import Any

from torch import Tensor, nn
from torch.nn.modules.lazy import LazyModuleMixin

from attnkit import _context_parallel
from attnkit._validate import as_lengths, check_dropout, check_qkv, check_sizes

__all__ = ["bind", "check_book_inputs", "check_valid_lens", "unbuilt"]


def check_book_inputs(queries: Tensor, keys: Tensor, values: Tensor, *, same_features: bool) -> None:
    """The book's layers take 3-dim ``(B, L, features)`` inputs; a ValueError naming the argument otherwise."""
    if not check_qkv(queries, keys, values, ("queries", "keys", "values"), same_features=same_features):
        raise ValueError(
            "queries, keys and values must be 3-dim, (B, Lq, d), (B, Lk, d) and (B, Lk, dv), as in the book (heads "
            f"are folded into the batch: transpose_qkv), got queries {tuple(queries.shape)}, keys "
            f"{tuple(keys.shape)}, values {tuple(values.shape)}"
        )


def unbuilt(module: nn.Module) -> bool:
    """A lazy layer whose parameters are not drawn yet."""
    return isinstance(module, LazyModuleMixin) and module.has_uninitialized_params()


def bind(
    cls: str,
    args: tuple,
    kwargs: dict[str, Any],
    *,
    explicit: tuple[str, ...],
    inferred: tuple[str, ...],
    defaults: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Bind the book's arguments to its explicit-size signature or to its newer size-inferring one.

    The explicit form is recognised by its extra leading sizes: more arguments than the newer form takes, or
    any of ``key_size``/``query_size``/``value_size`` by name. The sizes and ``dropout`` are checked here, before
    the caller draws any parameter, with the messages of attnkit's layers.
    """
    defaults = defaults or {}
    sizes_named = any(name in kwargs for name in ("key_size", "query_size", "value_size"))
    names = explicit if sizes_named or len(args) + len(kwargs) > len(inferred) else inferred
    parameters = [
        inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=defaults.get(n, inspect.Parameter.empty))
        for n in names
    ]
    try:
        bound = inspect.Signature(parameters).bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"{cls}({', '.join(explicit)}) or {cls}({', '.join(inferred)}): {e}") from None
    bound.apply_defaults()
    sizes = dict(bound.arguments)
    check_sizes(**{n: v for n, v in sizes.items() if n not in ("dropout", "bias")})
    check_dropout(sizes["dropout"])
    return sizes


def check_valid_lens(valid_lens: object, B: int, Lq: int, Lk: int, name: str = "valid_lens") -> None:
    """``valid_lens`` of the batch, checked before the heads are folded into it (a message in the caller's sizes
    and values)."""
    if not isinstance(valid_lens, Tensor):
        raise TypeError(f"{name} must be a tensor of lengths, got {type(valid_lens).__name__}")
    if valid_lens.shape not in ((B,), (B, Lq)):
        raise ValueError(
            f"{name} must have shape (B,) = ({B},) or (B, Lq) = ({B}, {Lq}), got {tuple(valid_lens.shape)}"
        )
    # whole numbers in [0, Lk], shown as given; inside context_parallel Lk is the whole sequence's, which the ring
    # checks on every rank at once
    as_lengths(valid_lens, name, Lk if _context_parallel.active() is None else 2**62)
