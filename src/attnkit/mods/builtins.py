"""The built-in modifiers modern models use: mask_mods (sliding_window, document, prefix_lm, and_masks, or_masks)
and score_mods (alibi, softcap). Each is aligned to the bottom right and knows which blocks it hides
(:meth:`~attnkit.mods.base.MaskMod.tiles`)."""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Any, ClassVar

import torch
from torch import Tensor

from attnkit._validate import as_lengths, check_device, check_whole, describe, listed
from attnkit._value_checks import checked, value_check
from attnkit.mods.base import MaskFn, MaskMod, ScoreFn, ScoreMod, Tiles, check_callable
from attnkit.mods.evaluate import evaluate_mask

__all__ = ["alibi", "alibi_slopes", "and_masks", "document", "or_masks", "prefix_lm", "sliding_window", "softcap"]

# B batch, H heads, Lq/Lk query/key length, nq/nk number of row/column blocks

# --------------------------------------------------------------------------------------------------- mask_mods


@dataclasses.dataclass(frozen=True)
class sliding_window(MaskMod):  # noqa: N801 - a function-like name, as FlexAttention's helpers
    """Sliding-window causal attention (Longformer, Beltagy et al. 2020; Mistral 7B, Gemma 2, gpt-oss):
    key ``j`` is visible from query position ``p`` when ``0 <= p - j < window``, the last ``window`` keys up to
    and including itself.

    Example:
        >>> from attnkit.masks import Mask
        >>> sliding_window(2)(torch.tensor(0), torch.tensor(0), torch.arange(4)[:, None], torch.arange(4))
        tensor([[ True, False, False, False],
                [ True,  True, False, False],
                [False,  True,  True, False],
                [False, False,  True,  True]])
    """

    window: int
    offset: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "window", check_whole("window", self.window))  # a NumPy integer becomes an int

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        distance = q_idx + self.offset - kv_idx  # p - j
        return (distance >= 0) & (distance < self.window)

    def tiles(self, rows: Tensor, cols: Tensor) -> Tiles:
        p0, p1 = rows[:, 0, None] + self.offset, rows[:, 1, None] - 1 + self.offset  # (nq, 1) first, last p
        j0, j1 = cols[None, :, 0], cols[None, :, 1] - 1  # (1, nk) first, last j
        nearest, farthest = p0 - j1, p1 - j0  # (nq, nk) the smallest and largest p - j in the block
        return Tiles(some=(farthest >= 0) & (nearest < self.window), every=(nearest >= 0) & (farthest < self.window))

    def depends_on(self, batch: int, heads: int) -> tuple[int, int]:
        return 1, 1


@dataclasses.dataclass(frozen=True, eq=False)
class document(MaskMod):  # noqa: N801
    """Document masking for packed sequences: query ``i`` sees key ``j`` only when both belong to one document,
    ``ids_q[b, i] == ids_k[b, j]`` (packing without cross-contamination: Krell et al. 2021; Llama 3).
    Combine with ``is_causal=True`` for causal language models.

    Args:
        ids_q: ``(B, Lq)`` integer document ids of the queries (``B`` may be 1 for all examples).
        ids_k: ``(B, Lk)`` ids of the keys; ``ids_q`` when ``None`` (self-attention, ``Lq == Lk``).
    """

    ids_q: Tensor
    ids_k: Tensor | None = None
    offset: int = 0

    def __post_init__(self) -> None:
        for name, ids in (("ids_q", self.ids_q), ("ids_k", self.ids_k)):
            if ids is None:
                continue
            if not isinstance(ids, Tensor) or ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
                raise TypeError(f"document: {name} must be an integer tensor, got {describe(ids)}")
            if ids.dim() != 2:
                raise ValueError(f"document: {name} must be (B, L) document ids, got shape {tuple(ids.shape)}")

    @property
    def keys(self) -> Tensor:
        return self.ids_q if self.ids_k is None else self.ids_k

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        # one row of ids serves every example: indexed without b, so the result does not vary by example
        ids_q = self.ids_q[b, q_idx] if self.ids_q.shape[0] != 1 else self.ids_q[0][q_idx]
        ids_k = self.keys[b, kv_idx] if self.keys.shape[0] != 1 else self.keys[0][kv_idx]
        return ids_q == ids_k

    def bind(self, *, batch: int, heads: int, num_queries: int, num_keys: int, device: torch.device | None) -> MaskMod:
        for name, ids, length, L in (("ids_q", self.ids_q, "Lq", num_queries), ("ids_k", self.keys, "Lk", num_keys)):
            if ids.shape[0] not in (1, batch) or ids.shape[1] != L:
                which = f"{name} (ids_q, as ids_k is None)" if name == "ids_k" and self.ids_k is None else name
                shared = f" or (1, {L})" if batch != 1 else ""
                raise ValueError(
                    f"document: {which} must have shape (B, {length}) = ({batch}, {L}){shared}, got {tuple(ids.shape)}"
                )
            check_device(f"document: {name}", ids, device)
        return self

    def tiles(self, rows: Tensor, cols: Tensor) -> Tiles:
        q_lo, q_hi = _range_bounds(self.ids_q, rows)  # (nq, B|1) each: smallest and largest id in each row block
        k_lo, k_hi = _range_bounds(self.keys, cols)  # (nk, B|1)
        q_lo, q_hi, k_lo, k_hi = q_lo[:, None], q_hi[:, None], k_lo[None], k_hi[None]  # (nq, 1, .), (1, nk, .)
        some = ((q_hi >= k_lo) & (k_hi >= q_lo)).any(dim=-1)  # (nq, nk): the id ranges meet for some example
        every = ((q_lo == q_hi) & (k_lo == k_hi) & (q_lo == k_lo)).all(dim=-1)  # one document on both sides
        return Tiles(some, every)

    def tensors(self) -> tuple[Tensor, ...]:
        return (self.ids_q, self.keys)

    def depends_on(self, batch: int, heads: int) -> tuple[int, int]:
        return max(self.ids_q.shape[0], self.keys.shape[0]), 1


@dataclasses.dataclass(frozen=True, eq=False)
class prefix_lm(MaskMod):  # noqa: N801
    """Prefix language model (T5, Raffel et al. 2020; PaLI, UniLM): key ``j`` is visible from query position ``p``
    when ``j < prefix_lens[b]`` (the prefix is seen in full, both ways) or ``j <= p`` (causal after it).

    Args:
        prefix_lens: ``(B,)`` whole numbers, the length of each example's prefix, in key positions.
    """

    prefix_lens: Tensor
    offset: int = 0

    def __post_init__(self) -> None:
        lens = self.prefix_lens
        if not isinstance(lens, Tensor) or lens.dtype == torch.bool or lens.is_complex():
            raise TypeError(f"prefix_lm: prefix_lens must be a tensor of whole numbers, got {describe(lens)}")
        if lens.dim() != 1:
            raise ValueError(f"prefix_lm: prefix_lens must have shape (B,), got {tuple(lens.shape)}")

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        prefix = self.prefix_lens[b] if self.prefix_lens.shape[0] != 1 else self.prefix_lens[0]
        return (kv_idx < prefix) | (kv_idx <= q_idx + self.offset)

    def bind(self, *, batch: int, heads: int, num_queries: int, num_keys: int, device: torch.device | None) -> MaskMod:
        if self.prefix_lens.shape[0] not in (1, batch):
            raise ValueError(
                f"prefix_lm: prefix_lens must have shape (B,) = ({batch},), got {tuple(self.prefix_lens.shape)}"
            )
        lens = as_lengths(self.prefix_lens, "prefix_lm: prefix_lens", num_keys, device)
        return dataclasses.replace(self, prefix_lens=lens, offset=num_keys - num_queries)

    def tiles(self, rows: Tensor, cols: Tensor) -> Tiles:
        lens = self.prefix_lens.detach().cpu()
        shortest, longest = (int(lens.min()), int(lens.max())) if lens.numel() else (0, 0)
        p0, p1 = rows[:, 0, None] + self.offset, rows[:, 1, None] - 1 + self.offset  # (nq, 1)
        j0, j1 = cols[None, :, 0], cols[None, :, 1] - 1  # (1, nk)
        return Tiles(some=(j0 < longest) | (j0 <= p1), every=(j1 < shortest) | (j1 <= p0))

    def tensors(self) -> tuple[Tensor, ...]:
        return (self.prefix_lens,)

    def depends_on(self, batch: int, heads: int) -> tuple[int, int]:
        return self.prefix_lens.shape[0], 1


@dataclasses.dataclass(frozen=True, eq=False)
class _Combined(MaskMod):
    mods: tuple[Any, ...]
    every_one: bool  # True: and_masks, False: or_masks
    offset: int = 0

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        results = [evaluate_mask(m, b, h, q_idx, kv_idx) for m in self.mods]
        return functools.reduce(torch.logical_and if self.every_one else torch.logical_or, results)

    def bind(self, *, batch: int, heads: int, num_queries: int, num_keys: int, device: torch.device | None) -> MaskMod:
        bound = tuple(
            m.bind(batch=batch, heads=heads, num_queries=num_queries, num_keys=num_keys, device=device)
            if isinstance(m, MaskMod)
            else m
            for m in self.mods
        )
        return dataclasses.replace(self, mods=bound, offset=num_keys - num_queries)

    def tiles(self, rows: Tensor, cols: Tensor) -> Tiles:
        parts = [
            m.tiles(rows, cols) if isinstance(m, MaskMod) else Tiles.unknown(len(rows), len(cols)) for m in self.mods
        ]
        return functools.reduce(lambda a, b: a & b if self.every_one else a | b, parts)

    def tensors(self) -> tuple[Tensor, ...]:
        return tuple(t for m in self.mods if isinstance(m, MaskMod) for t in m.tensors())

    def depends_on(self, batch: int, heads: int) -> tuple[int, int]:
        leads = [m.depends_on(batch, heads) if isinstance(m, MaskMod) else (batch, heads) for m in self.mods]
        return max(b for b, _ in leads), max(h for _, h in leads)

    @property
    def opaque(self) -> bool:
        return any(not isinstance(m, MaskMod) or m.opaque for m in self.mods)


def and_masks(*mask_mods: MaskFn) -> MaskMod:
    """A mask_mod that allows a pair when every one of ``mask_mods`` does (FlexAttention's ``and_masks``).

    Example:
        >>> m = and_masks(sliding_window(8), document(torch.tensor([[0, 0, 1, 1]])))
    """
    return _Combined(_check_mods(mask_mods, "and_masks"), every_one=True)


def conjuncts(mask_mod: MaskFn) -> tuple[MaskFn, ...]:
    """The mask_mods that must all allow a pair: those inside :func:`and_masks` (nested ones too), else the
    mask_mod itself."""
    if isinstance(mask_mod, _Combined) and mask_mod.every_one:
        return tuple(part for m in mask_mod.mods for part in conjuncts(m))
    return (mask_mod,)


def or_masks(*mask_mods: MaskFn) -> MaskMod:
    """A mask_mod that allows a pair when any one of ``mask_mods`` does (FlexAttention's ``or_masks``)."""
    return _Combined(_check_mods(mask_mods, "or_masks"), every_one=False)


# -------------------------------------------------------------------------------------------------- score_mods


@dataclasses.dataclass(frozen=True, eq=False)
class alibi(ScoreMod):  # noqa: N801
    """ALiBi, attention with linear biases (Press et al. 2022; BLOOM, MPT): adds ``-slopes[h] * |p - j|`` to the
    score of query position ``p`` and key ``j``, so that far keys weigh less, by a per-head rate.

    Args:
        slopes: ``(H,)``, one rate per query head; :func:`alibi_slopes` gives the paper's. May require grad.
    """

    slopes: Tensor
    offset: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.slopes, Tensor) or not self.slopes.is_floating_point() or self.slopes.dim() != 1:
            raise TypeError(f"alibi: slopes must be a (H,) floating point tensor, got {describe(self.slopes)}")

    def __call__(self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return score + self.bias(b, h, q_idx, kv_idx)

    def bias(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return -self.slopes[h] * (q_idx + self.offset - kv_idx).abs()

    def attnkit_distance_bias(self) -> bool:
        """A bias on the distance ``q_idx - kv_idx`` (``attnkit.mods.relative.is_distance_bias`` need not trace
        it); a subclass that computes something else is not taken for one."""
        return type(self).__call__ is alibi.__call__ and type(self).bias is alibi.bias

    def bind(self, *, batch: int, heads: int, num_queries: int, num_keys: int, device: torch.device | None) -> ScoreMod:
        if self.slopes.shape != (heads,):
            raise ValueError(f"alibi: slopes must have shape (H,) = ({heads},), got {tuple(self.slopes.shape)}")
        check_device("alibi: slopes", self.slopes, device)
        slopes = checked(self.slopes, "alibi slopes", "alibi: slopes", num_queries + num_keys)
        return dataclasses.replace(self, slopes=slopes, offset=num_keys - num_queries)

    def tensors(self) -> tuple[Tensor, ...]:
        return (self.slopes,)


@value_check("alibi slopes")
def _slope_values(slopes: Tensor, name: str, farthest: int, what: str) -> None:
    """Finite slopes whose bias at the farthest distance (``|p - j|`` stays below it) stays inside float32."""
    peak = float(slopes.abs().amax()) if slopes.numel() else 0.0  # one read, one sync
    if not math.isfinite(peak):  # as sinks: a NaN or inf rate is no rate
        raise ValueError(f"{name} must be finite, got {listed(slopes)}")
    if peak * farthest >= torch.finfo(torch.float32).max / 2:  # a bias of -inf would hide keys, NaN in values
        raise ValueError(
            f"{name} times the farthest distance ({farthest}) must stay well inside float32's range, got a slope of "
            f"{peak:g}"
        )


def alibi_slopes(num_heads: int) -> Tensor:
    """The ALiBi paper's slopes for ``num_heads`` heads: the geometric sequence ``2^(-8 k / n)``, ``k = 1..n``, for
    ``n`` a power of two; otherwise those of the next lower power of two, then every other slope of twice that
    many (the reference implementation's rule, also BLOOM's).

    Example:
        >>> alibi_slopes(4)
        tensor([0.2500, 0.0625, 0.0156, 0.0039])
    """
    num_heads = check_whole("num_heads", num_heads)
    closest = 2 ** math.floor(math.log2(num_heads))

    def powers(n: int) -> list[float]:
        return [2.0 ** (-8.0 * k / n) for k in range(1, n + 1)]

    slopes = powers(closest) + powers(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(slopes)


_FLOAT32_MAX = torch.finfo(torch.float32).max


@dataclasses.dataclass(frozen=True)
class softcap(ScoreMod):  # noqa: N801
    """Logit soft-capping (Gemma 2, Grok-1): ``score -> cap * tanh(score / cap)`` on the scaled scores, which keeps
    every score inside ``(-cap, cap)`` smoothly (Gemma 2 uses ``cap = 50``)."""

    cap: float
    offset: int = 0
    positional: ClassVar[bool] = False  # (read from the class that defines __call__: mods.reads_positions)

    def __post_init__(self) -> None:
        cap = self.cap
        if isinstance(cap, Tensor) and cap.numel() == 1 and not cap.requires_grad:
            cap = cap.item()
        if isinstance(cap, bool) or not isinstance(cap, numbers.Real) or not 0 < float(cap) < math.inf:
            raise ValueError(f"softcap: cap must be a positive finite number, got {self.cap!r}")
        if float(cap) > _FLOAT32_MAX:  # float32 rounds it to inf: inf * tanh(score / inf) is NaN for every score
            raise ValueError(
                f"softcap: cap must be at most {_FLOAT32_MAX!r} (float32's largest number), got {self.cap!r}"
            )
        object.__setattr__(self, "cap", float(cap))

    def __call__(self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return torch.tanh(score / self.cap) * self.cap

    def compiled(self) -> ScoreFn:
        return softcap_compiled(self.cap)


@dataclasses.dataclass(frozen=True)
class softcap_compiled:  # noqa: N801  (named as a message names it)
    """:class:`softcap` for compiled code (float32 and float64 scores): ``tanh(x) = e / (e + 2)`` with ``e =
    expm1(2 x)``, the same function within a few roundings of the cap, and 3x faster than ``tanh`` in Inductor's
    C++ code (docs/benchmarks.md); ``|x| <= 20`` keeps ``e`` finite, where ``tanh`` is 1 in float64 already. Eager,
    ``tanh`` is the faster, and autograd keeps one tensor for it instead of four."""

    cap: float

    def __call__(self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        e = torch.expm1(torch.clamp(score / self.cap * 2, -40.0, 40.0))  # (2 / cap overflows for a tiny cap)
        return e / (e + 2) * self.cap


def _range_bounds(ids: Tensor, ranges: Tensor) -> tuple[Tensor, Tensor]:
    """The smallest and largest id in each range of positions, per example: ``(n, B|1)`` each, on the CPU."""
    ids = ids.detach().cpu()  # (B|1, L)
    if not len(ranges):
        return ids.new_zeros(0, ids.shape[0]), ids.new_zeros(0, ids.shape[0])
    lo = torch.stack([ids[:, a:z].amin(dim=1) for a, z in ranges.tolist()])  # (n, B|1)
    hi = torch.stack([ids[:, a:z].amax(dim=1) for a, z in ranges.tolist()])  # (n, B|1)
    return lo, hi


def _check_mods(mods: tuple[Any, ...], name: str) -> tuple[Any, ...]:
    if not mods:
        raise ValueError(f"{name} needs at least one mask_mod")
    for m in mods:
        if not callable(m) or isinstance(m, ScoreMod):
            raise TypeError(f"{name}: every argument must be a mask_mod function, got {type(m).__name__}")
        check_callable("mask_mod", m)  # (a wrong number of parameters, said before any call)
    return mods
