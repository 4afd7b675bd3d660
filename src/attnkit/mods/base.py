"""The modifiers' types: the mask_mod and score_mod signatures, what a mask says of a grid of blocks
(:class:`Tiles`), and the base classes of the built-ins, which can bind themselves to a call's sizes."""

from __future__ import annotations

import copy
import dataclasses
import inspect
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor

__all__ = ["MaskFn", "MaskMod", "ScoreFn", "ScoreMod", "Tiles", "bind", "check_callable"]

# B batch, H heads, Lq/Lk query/key length, nq/nk number of row/column blocks

MaskFn = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
ScoreFn = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]


@dataclasses.dataclass(frozen=True)
class Tiles:
    """What a mask says of a grid of blocks, from their index ranges: ``some[r, c]``, some pair of row block ``r``
    and column block ``c`` may be visible (``False``: the block is hidden, skip it); ``every[r, c]``, every pair
    is visible (the block needs no mask). Both ``(nq, nk)`` bool, on the CPU."""

    some: Tensor
    every: Tensor

    @classmethod
    def unknown(cls, nq: int, nk: int) -> Tiles:
        """Nothing known without looking at the block: maybe visible, maybe not."""
        return cls(torch.ones(nq, nk, dtype=torch.bool), torch.zeros(nq, nk, dtype=torch.bool))

    def __and__(self, other: Tiles) -> Tiles:
        return Tiles(self.some & other.some, self.every & other.every)

    def __or__(self, other: Tiles) -> Tiles:
        return Tiles(self.some | other.some, self.every | other.every)


class MaskMod:
    """A built-in mask_mod: callable as ``mask_mod(b, h, q_idx, kv_idx)``, and able to say which blocks it hides.

    ``offset`` is ``Lk - Lq`` of the call it is bound to (:meth:`bind`): query ``i`` stands at key ``i + offset``.
    """

    offset: int = 0

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        raise NotImplementedError

    def __getstate__(self) -> dict[str, object]:
        """Pickled and copied without the plans its calls kept on it (:func:`attnkit.plan.plan_of`: remade at the
        first call after; they could weigh megabytes)."""
        state = dict(self.__dict__)
        state.pop("attnkit_plans", None)
        return state

    def bind(self, *, batch: int, heads: int, num_queries: int, num_keys: int, device: torch.device | None) -> MaskMod:
        """A copy for one call: aligned to its lengths, its tensors checked against its sizes and device.

        Raises:
            ValueError: tensors whose shapes or device do not fit the call.
        """
        return _aligned(self, num_keys - num_queries)

    def tiles(self, rows: Tensor, cols: Tensor) -> Tiles:
        """What this mask says of the blocks with row ranges ``rows`` ``(nq, 2)`` and column ranges ``cols``
        ``(nk, 2)`` (``[start, stop)``, CPU int64), for every batch element and head."""
        return Tiles.unknown(len(rows), len(cols))

    def tensors(self) -> tuple[Tensor, ...]:
        """The tensors it reads."""
        return ()

    def depends_on(self, batch: int, heads: int) -> tuple[int, int]:
        """``(B|1, H|1)``: the leading shape of the mask it gives for a block (whether it varies by example, by
        head), which sets the size of the dense mask a fused kernel would be given."""
        return batch, heads

    @property
    def opaque(self) -> bool:
        """Whether some of it (a user's function inside) is known only by evaluating it; then :meth:`tiles` says
        "maybe"."""
        return False


class ScoreMod:
    """A built-in score_mod: callable as ``score_mod(score, b, h, q_idx, kv_idx)``; ``offset`` as in
    :class:`MaskMod`; ``positional``: whether it reads ``b``, ``h``, ``q_idx`` or ``kv_idx`` (``False``: a function
    of the score alone, such as :class:`~attnkit.mods.softcap`, the same on any piece of a call), read from the
    class that defines ``__call__`` (``reads_positions``: a subclass that computes something else says it
    again, or is taken to read them)."""

    offset: int = 0
    positional: ClassVar[bool] = True

    def __call__(self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        raise NotImplementedError

    def bind(self, *, batch: int, heads: int, num_queries: int, num_keys: int, device: torch.device | None) -> ScoreMod:
        """A copy for one call (see :meth:`MaskMod.bind`)."""
        return _aligned(self, num_keys - num_queries)

    def bias(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor | None:
        """The score_mod as a bias added to the score, when it is one (so that a fused kernel can take it as a
        float mask); ``None`` when it is not."""
        return None

    def tensors(self) -> tuple[Tensor, ...]:
        return ()

    def compiled(self) -> ScoreFn:
        """The same function, written for compiled code (:mod:`attnkit.backends.tiles.compiled` calls it in its steps):
        itself, unless a form that Inductor's code runs faster exists (:class:`~attnkit.mods.softcap`'s)."""
        return self


def reads_positions(score_mod: Any) -> bool:
    """Whether a score_mod may read ``b``, ``h``, ``q_idx`` or ``kv_idx``: ``True`` but for a built-in whose class
    that defines ``__call__`` declares ``positional = False`` itself (a subclass of softcap that adds a bias per key
    inherits the attribute, not the promise)."""
    if not isinstance(score_mod, ScoreMod):
        return True
    owner = next(c for c in type(score_mod).__mro__ if "__call__" in c.__dict__)
    return bool(owner.__dict__.get("positional", True))


def bind(mod: Any, **sizes: Any) -> Any:
    """A built-in bound to a call's sizes (aligned and checked); a user function as it is."""
    return mod.bind(**sizes) if isinstance(mod, (MaskMod, ScoreMod)) else mod


def check_callable(name: str, fn: object) -> None:
    """``fn`` is a function that takes the parameters of ``name`` (``"mask_mod"``: 4, ``"score_mod"``: 5), when its
    signature can be read; ``None`` passes.

    Raises:
        TypeError: naming the signature wanted and the one given.
    """
    if fn is None:
        return
    signature, count = _SIGNATURES[name]
    if not callable(fn):
        raise TypeError(f"{name} must be a function ({signature}), got {type(fn).__name__}")
    if isinstance(fn, (MaskMod, ScoreMod)) or _takes(fn, count):
        return
    params = inspect.signature(fn)
    given = len([p for p in params.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)])
    raise TypeError(f"{name} must take {count} parameters, {signature}, got a function of {given} parameters: {params}")


def _takes(fn: Any, count: int) -> bool:
    """Whether ``fn`` can be called with ``count`` positional arguments; True when its signature cannot be read (it
    will tell when called). A plain function is read from its code (this runs at every call: inspect.signature
    takes about 12 us)."""
    if inspect.isfunction(fn):
        code, defaults = fn.__code__, len(fn.__defaults__ or ())
        # (getattr: dynamo cannot read __kwdefaults__ of a function made while it traces, torch 2.13)
        required_keywords = code.co_kwonlyargcount and code.co_kwonlyargcount - len(fn.__kwdefaults__ or {})
        if code.co_flags & inspect.CO_VARARGS:
            return code.co_argcount - defaults <= count and not required_keywords
        return code.co_argcount - defaults <= count <= code.co_argcount and not required_keywords
    try:
        inspect.signature(fn).bind(*range(count))
    except TypeError:
        return False
    except ValueError:  # no signature to read
        return True
    return True


_SIGNATURES = {
    "mask_mod": ("mask_mod(b, h, q_idx, kv_idx) -> bool", 4),
    "score_mod": ("score_mod(score, b, h, q_idx, kv_idx) -> score", 5),
}


def _aligned(mod: Any, offset: int) -> Any:
    """A copy of a built-in (or of a subclass of one, a dataclass or not) with its ``offset`` set, which points back
    to the object it was copied from (``attnkit_origin``: where :mod:`attnkit.plan` keeps the plans made for it)."""
    origin = getattr(mod, "attnkit_origin", mod)
    if dataclasses.is_dataclass(mod) and not isinstance(mod, type):
        aligned = dataclasses.replace(mod, offset=offset)
    else:
        aligned = copy.copy(mod)
        aligned.offset = offset
    object.__setattr__(aligned, "attnkit_origin", origin)  # (object's: a frozen dataclass refuses its own)
    return aligned
