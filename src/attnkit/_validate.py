"""Small checks and helpers every module shares (one wording for every message, one copy of each helper)."""

from __future__ import annotations

import numbers
from collections.abc import Sequence

import torch
from torch import Tensor

from attnkit._value_checks import checked, value_check

# B batch, Lq query length, n number of blocks

# The seeds torch.manual_seed accepts; a negative one means seed + 2**64.
TORCH_SEEDS = (-(2**63), 2**64 - 1)


def describe(x: object) -> str:
    """What a user passed, for an error message: a tensor's dtype and shape, or another object's type."""
    if isinstance(x, Tensor):
        return f"tensor of dtype {x.dtype} and shape {tuple(x.shape)}"
    return type(x).__name__


def listed(t: Tensor, limit: int = 8) -> str:
    """A tensor's first ``limit`` values, for a message or a note: ``[3, 3, 2, ...]``."""
    flat = t.detach().flatten()
    shown = flat[:limit].tolist()
    text = ", ".join(str(int(v)) if float(v).is_integer() else f"{v:.3g}" for v in shown)
    return f"[{text}{', ...' if flat.numel() > limit else ''}]"


def short(t: Tensor) -> str:
    """A tensor for an error message: its shape and first values, ``(3,) tensor [4, 0, 2]``."""
    return f"{tuple(t.shape)} tensor {listed(t)}"


def check_device(name: str, t: Tensor, device: torch.device | None) -> None:
    """``t`` is on ``device`` (when one is given), or a ``ValueError`` naming both."""
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but the inputs are on {device}")


def check_whole(name: str, value: object, *, minimum: int = 1) -> int:
    """A whole number (Python's or NumPy's) from ``minimum`` to ``2**62``, returned as an ``int``.

    Raises:
        TypeError: not a whole number (``True`` and ``2.0`` are not).
        ValueError: out of range, naming ``name`` and the value.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a whole number, got {value!r}")
    number = int(value)
    if number < minimum:
        if minimum == 1:
            raise ValueError(f"{name} must be positive, got {value}: a whole number, at least 1")
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    if number > 2**62:
        raise ValueError(f"{name} must be at most 2**62, got {value}")
    return number


def indices(value: object) -> list[int] | None:
    """``value`` as a list of whole numbers: one (an ``int``) or a sequence of them (``True`` is none); ``None``
    when it is neither, for the caller to say so in its own words. An empty sequence gives ``[]``."""
    items = [value] if isinstance(value, int) else value
    if isinstance(value, bool) or not isinstance(items, Sequence) or isinstance(items, str):
        return None
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in items):
        return None
    return list(items)


def check_sizes(**sizes: object) -> None:
    """Each size given is a positive whole number (``None``: inferred at the first call)."""
    for name, value in sizes.items():
        if value is not None:
            check_whole(name, value)


def check_dropout(dropout: object, name: str = "dropout") -> float:
    """A probability in ``[0, 1)`` (Python's or NumPy's real number), returned as a ``float``."""
    if isinstance(dropout, bool) or not isinstance(dropout, numbers.Real):
        raise TypeError(f"{name} must be a number in [0, 1), got {dropout!r}")
    if not 0.0 <= float(dropout) < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {dropout}")
    return float(dropout)


def as_lengths(
    valid_lens: Tensor, name: str, num_keys: int, device: torch.device | None = None, what: str = "the number of keys"
) -> Tensor:
    """Check lengths are whole numbers in ``[0, num_keys]`` on ``device`` (``what``: what ``num_keys`` counts, for
    the message); return them as int64 (never in place)."""
    if not isinstance(valid_lens, Tensor):
        raise TypeError(f"{name} must be a tensor of lengths, got {describe(valid_lens)}")
    if valid_lens.dtype == torch.bool or valid_lens.is_complex():
        raise TypeError(f"{name} must hold whole numbers (integer or float dtype), got dtype {valid_lens.dtype}")
    if valid_lens.dim() not in (1, 2):
        raise ValueError(f"{name} must have shape (B,) or (B, Lq), got {tuple(valid_lens.shape)}")
    check_device(name, valid_lens, device)
    if valid_lens.numel() == 0:
        return valid_lens.long()
    if torch.compiler.is_compiling():  # the values are checked where they are, each time the compiled code runs
        return checked(valid_lens, "lengths", name, num_keys, what, keep=valid_lens.long())
    _length_values(valid_lens, name, num_keys, what)
    return valid_lens.long()


@value_check("lengths")
def _length_values(valid_lens: Tensor, name: str, num_keys: int, what: str) -> None:
    """The values of :func:`as_lengths`'s lengths: whole numbers in ``[0, num_keys]``."""
    if valid_lens.is_floating_point():
        # One reduction (one host sync) for all three checks keeps small calls cheap.
        whole = valid_lens == valid_lens.round()
        if not bool(whole.all()):
            bad = valid_lens[~whole][0].item()
            raise ValueError(f"{name} must hold whole numbers, got {bad} in {short(valid_lens)}")
    lo, hi = valid_lens.aminmax()
    if lo < 0:
        raise ValueError(f"{name} must not be negative, got {lo.item()} in {short(valid_lens)}")
    if hi > num_keys:
        raise ValueError(f"{name} may be at most {what} ({num_keys}), got {hi.item()} in {short(valid_lens)}")


def broadcasts(shape: Sequence[int], target: Sequence[int]) -> bool:
    """Whether a tensor of ``shape`` broadcasts to ``target`` without growing it (no more dims, each 1 or equal)."""
    return len(shape) <= len(target) and all(
        s in (1, t) for s, t in zip(reversed(shape), reversed(target), strict=False)
    )


def ranges(start: int, stop: int, step: int) -> Tensor:
    """``[start, stop)`` cut into consecutive blocks of ``step`` positions (the last may be shorter): ``(n, 2)``
    int64 ``[first, end)`` pairs, on the CPU."""
    starts = torch.arange(start, stop, step)  # (n,)
    return torch.stack([starts, (starts + step).clamp(max=stop)], dim=1)  # (n, 2)


def check_qkv(
    q: Tensor, k: Tensor, v: Tensor | None, names: tuple[str, str, str] = ("q", "k", "v"), *, same_features: bool = True
) -> bool:
    """Check that queries, keys and values fit together; return True for 3-dim (head-less) inputs. ``v=None``:
    a call without values (its weights alone), whose errors name only ``q`` and ``k``.

    ``same_features=False`` skips the check that ``q`` and ``k`` have one feature size (layers whose
    projections bring them to one size).

    Raises:
        TypeError: a non-tensor, a non-floating dtype, or mixed dtypes.
        ValueError: mixed devices, wrong number of dims, batch sizes, feature sizes, key/value lengths or head
            counts that do not fit, no keys, or queries without features.
    """
    nq, nk, nv = names
    if v is None:  # checked as values equal to the keys, named as keys only
        v, names = k, (nq, nk, nk)
        nv = nk
    for name, t in zip(names, (q, k, v), strict=True):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be floating point, got dtype {t.dtype}")
    check_same_kind((nq, q), (nk, k), (nv, v))

    def shapes() -> str:  # (made only for a message: under torch.compile, dynamo cannot join the strings)
        values = "" if v is k else f", {nv} {tuple(v.shape)}"
        return f"{nq} {tuple(q.shape)}, {nk} {tuple(k.shape)}{values}"

    if q.dim() not in (3, 4):
        raise ValueError(f"{nq} must be (B, H, Lq, D) or (B, Lq, D), got {q.dim()} dims: {shapes()}")
    if k.dim() != q.dim() or v.dim() != q.dim():
        both = f"{nq} and {nk}" if v is k else f"{nq}, {nk} and {nv}"
        raise ValueError(f"{both} must have the same number of dims: {shapes()}")
    if not q.shape[0] == k.shape[0] == v.shape[0]:
        also = "" if v is k else f", {nv} has {v.shape[0]}"
        raise ValueError(f"batch sizes differ: {nq} has {q.shape[0]}, {nk} has {k.shape[0]}{also}: {shapes()}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"{nk} has {k.shape[-2]} positions but {nv} has {v.shape[-2]}: {nk} {tuple(k.shape)}, {nv} {tuple(v.shape)}"
        )
    if same_features and q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"{nq} and {nk} must have the same feature size, got {q.shape[-1]} and {k.shape[-1]}: "
            f"{nq} {tuple(q.shape)}, {nk} {tuple(k.shape)}"
        )
    if k.shape[-2] == 0:
        raise ValueError(f"{nk} must have at least one position: {shapes()}")
    if q.shape[-1] == 0:
        raise ValueError(f"{nq} must have at least one feature (D >= 1): {shapes()}")
    if q.dim() == 4:
        H, Hkv = q.shape[1], k.shape[1]
        if v.shape[1] != Hkv:
            raise ValueError(f"{nk} has {Hkv} heads but {nv} has {v.shape[1]}: {shapes()}")
        if Hkv == 0 or H % Hkv:
            values = "" if v is k else f" and {nv}"
            raise ValueError(f"the {H} heads of {nq} must be a multiple of the {Hkv} heads of {nk}{values}: {shapes()}")
    return q.dim() == 3


def check_torch_heads(tensors: dict[str, object], heads: int, kv_heads: int, enable_gqa: object) -> None:
    """torch's rules for the inputs of its ``flex_attention`` and ``varlen_attn``: tensors, and ``heads`` query heads
    equal to the ``kv_heads`` key/value heads, or a multiple of them with ``enable_gqa=True``."""
    for name, t in tensors.items():
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a tensor, got {describe(t)}")
    if not isinstance(enable_gqa, bool):
        raise TypeError(f"enable_gqa must be True or False, got {enable_gqa!r}")
    if not enable_gqa and heads != kv_heads:
        raise ValueError(
            f"query has H={heads} heads and key/value Hkv={kv_heads}: pass enable_gqa=True for grouped queries"
        )
    if enable_gqa and heads % kv_heads:
        raise ValueError(f"enable_gqa: query's H={heads} heads must be a multiple of key/value's Hkv={kv_heads}")


def check_scale(scale: object, dtype: torch.dtype = torch.float64) -> float:
    """Any real number (Python or NumPy, any precision) finite in ``dtype``, the dtype the scores are computed in,
    is a scale; ``bool``, NaN and infinities are not (``1e300`` is infinite in float32: every score would be). A
    symbolic number (``torch.SymFloat``: the default ``D ** -0.5`` while ``torch.compile`` traces with dynamic
    shapes) is checked by arithmetic, which dynamo traces."""
    if not isinstance(scale, numbers.Real) or isinstance(scale, bool):
        raise TypeError(f"scale must be a number, got {scale!r}")
    # (arithmetic, not math.isfinite: under torch.compile with dynamic shapes a scale made from a shape is a
    # symbolic number, which math.isfinite cannot read; x - x is 0 for a finite x only)
    # (a number dynamo traces as a float stays as it is: it may be a symbolic one, and float() would fix it)
    value: float = scale if torch.compiler.is_compiling() and isinstance(scale, float) else float(scale)
    if not value - value == 0:
        raise ValueError(f"scale must be finite, got {value}")
    largest = torch.finfo(dtype).max
    if abs(value) > largest:
        raise ValueError(
            f"scale must be finite in {str(dtype).removeprefix('torch.')}, the dtype the scores are computed in "
            f"(at most {largest:g} in magnitude), got {value:g}"
        )
    return value  # type: ignore[return-value]


def check_same_kind(*named: tuple[str, Tensor]) -> None:
    """Every tensor named has the first's dtype and device."""
    (n0, t0), rest = named[0], named[1:]
    for name, t in rest:
        if t.dtype != t0.dtype:
            raise TypeError(f"{n0} and {name} must have the same dtype, got {t0.dtype} and {t.dtype}")
        if t.device != t0.device:
            raise ValueError(f"{n0} and {name} must be on the same device, got {t0.device} and {t.device}")
