"""Mask and score modifiers, with FlexAttention's signatures, and the built-ins modern models use.

A **mask_mod** says who may attend to whom, a **score_mod** changes a score::

    mask_mod(b, h, q_idx, kv_idx) -> bool         True = may attend
    score_mod(score, b, h, q_idx, kv_idx) -> score  on the scaled score, before the softmax

Both are PyTorch's ``torch.nn.attention.flex_attention`` signatures, so a Flex function runs unchanged:
``b`` is the batch index, ``h`` the *query* head, ``q_idx`` in ``[0, Lq)`` and ``kv_idx`` in ``[0, Lk)`` the raw
positions. attnkit calls a function on whole blocks at once, with index tensors that broadcast against each other
(``b (B, 1, 1, 1)``, ``h (1, H, 1, 1)``, ``q_idx (1, 1, Lq', 1)``, ``kv_idx (1, 1, 1, Lk')``, ``score`` the
``(B, H, Lq', Lk')`` block): the element-wise code Flex asks for (no Python ``if`` on a value) works as is; a
function that fails on blocks is run element by element through ``torch.vmap``, as Flex does.

A mask_mod combines with ``valid_lens``, ``attn_mask`` and ``is_causal`` (all must allow a pair); a score_mod is
applied to ``scale * q . k`` (or the additive score), then the float ``attn_mask`` is added. A score_mod may close
over tensors that require grad (ALiBi slopes, a table of relative-position biases): they get their gradients.

The built-ins below are aligned to the bottom right, like ``is_causal``: with ``Lq`` queries and ``Lk`` keys,
query ``i`` stands at key position ``p = i + Lk - Lq`` (with ``Lq == Lk``, ``p = i``; one query decoded against a
cache stands at the last key). attnkit binds them to each call's lengths; called directly (say, handed to
``flex_attention``), they take ``p = q_idx``. Each knows, from a block's index ranges alone, whether the block
is hidden entirely or visible entirely (:meth:`MaskMod.tiles`): the chunked backend skips hidden blocks without
evaluating anything, and skips the mask of visible ones.

Example:
    >>> import torch, attnkit
    >>> from attnkit import mods
    >>> q = k = v = torch.randn(1, 4, 16, 8)
    >>> out = attnkit.scaled_dot_product_attention(
    ...     q, k, v, mask_mod=mods.sliding_window(4), score_mod=mods.alibi(mods.alibi_slopes(4)))
    >>> out.output.shape
    torch.Size([1, 4, 16, 8])
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from attnkit._checks import check_device, describe

__all__ = [
    "MaskMod",
    "ScoreMod",
    "alibi",
    "alibi_slopes",
    "and_masks",
    "document",
    "or_masks",
    "prefix_lm",
    "sliding_window",
    "softcap",
]

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
        """Some of it (a user's function inside) is known only by evaluating it: :meth:`tiles` says "maybe"."""
        return False


class ScoreMod:
    """A built-in score_mod: callable as ``score_mod(score, b, h, q_idx, kv_idx)``; ``offset`` as in
    :class:`MaskMod`."""

    offset: int = 0

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
        _check_whole("window", self.window, minimum=1)
        object.__setattr__(self, "window", int(self.window))  # a NumPy integer becomes a Python one

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
        from attnkit.masks import as_lengths

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

    def bind(self, *, batch: int, heads: int, num_queries: int, num_keys: int, device: torch.device | None) -> ScoreMod:
        if self.slopes.shape != (heads,):
            raise ValueError(f"alibi: slopes must have shape (H,) = ({heads},), got {tuple(self.slopes.shape)}")
        check_device("alibi: slopes", self.slopes, device)
        return dataclasses.replace(self, offset=num_keys - num_queries)

    def tensors(self) -> tuple[Tensor, ...]:
        return (self.slopes,)


def alibi_slopes(num_heads: int) -> Tensor:
    """The ALiBi paper's slopes for ``num_heads`` heads: the geometric sequence ``2^(-8 k / n)``, ``k = 1..n``, for
    ``n`` a power of two; otherwise those of the next lower power of two, then every other slope of twice that
    many (the reference implementation's rule, also BLOOM's).

    Example:
        >>> alibi_slopes(4)
        tensor([0.2500, 0.0625, 0.0156, 0.0039])
    """
    _check_whole("num_heads", num_heads, minimum=1)
    closest = 2 ** math.floor(math.log2(num_heads))

    def powers(n: int) -> list[float]:
        return [2.0 ** (-8.0 * k / n) for k in range(1, n + 1)]

    slopes = powers(closest) + powers(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(slopes)


@dataclasses.dataclass(frozen=True)
class softcap(ScoreMod):  # noqa: N801
    """Logit soft-capping (Gemma 2, Grok-1): ``score -> cap * tanh(score / cap)`` on the scaled scores, which keeps
    every score inside ``(-cap, cap)`` smoothly (Gemma 2 uses ``cap = 50``)."""

    cap: float
    offset: int = 0

    def __post_init__(self) -> None:
        cap = self.cap
        if isinstance(cap, Tensor) and cap.numel() == 1 and not cap.requires_grad:
            cap = cap.item()
        if isinstance(cap, bool) or not isinstance(cap, numbers.Real) or not 0 < float(cap) < math.inf:
            raise ValueError(f"softcap: cap must be a positive finite number, got {self.cap!r}")
        object.__setattr__(self, "cap", float(cap))

    def __call__(self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return torch.tanh(score / self.cap) * self.cap


# ------------------------------------------------------------------------------------------------- evaluation


def evaluate_mask(mask_mod: MaskFn, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """``mask_mod`` on a block of broadcasting index tensors, as a bool tensor broadcastable to the block;
    through ``torch.vmap`` element by element when the function does not take blocks.

    Raises:
        TypeError: the function does not return a boolean tensor.
    """
    shape = _block_shape(b, h, q_idx, kv_idx)
    if isinstance(mask_mod, ScoreMod):
        raise TypeError(f"{type(mask_mod).__name__} is a score_mod: pass it as score_mod=, not as a mask_mod")
    out = _on_block(mask_mod, (b, h, q_idx, kv_idx), shape, "mask_mod")
    if out.dtype != torch.bool:
        raise TypeError(f"mask_mod must return a boolean tensor (True = may attend), got dtype {out.dtype}")
    return out.reshape((1,) * (len(shape) - out.dim()) + tuple(out.shape))  # as many dims as the block (a 0-dim True)


def evaluate_score(score_mod: ScoreFn, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    """``score_mod`` on a block of scores, ``(B, H, Lq', Lk')``, in the scores' dtype and shape."""
    if isinstance(score_mod, MaskMod):
        raise TypeError(f"{type(score_mod).__name__} is a mask_mod: pass it as mask_mod=, not as a score_mod")
    out = _on_block(score_mod, (score, b, h, q_idx, kv_idx), score.shape, "score_mod")
    if not out.is_floating_point():
        raise TypeError(f"score_mod must return the scores (floating point), got dtype {out.dtype}")
    out = out.to(score.dtype)
    # a result that only broadcasts (say, a bias that ignores the score) becomes a block of its own: backends write
    # into it, which an expanded view would refuse
    return out if out.shape == score.shape else out.expand(score.shape).clone()


def _on_block(fn: Callable[..., Any], args: tuple[Tensor, ...], shape: Sequence[int], what: str) -> Tensor:
    try:
        out = fn(*args)
        if isinstance(out, Tensor) and _broadcasts(out.shape, shape):
            return out
    except (RuntimeError, IndexError, TypeError, ValueError) as error:
        first: Exception | None = error
    else:
        first = None
    try:  # element by element, as FlexAttention runs it
        out = _vmapped(fn, args, shape)
    except Exception as error:
        if first is not None:
            raise first from None
        got = f"a tensor of shape {tuple(out.shape)}" if isinstance(out, Tensor) else type(out).__name__
        raise ValueError(
            f"{what} must return a tensor that broadcasts to the block {tuple(shape)}, got {got}"
        ) from error
    if not isinstance(out, Tensor) or tuple(out.shape) != tuple(shape):
        got = f"a tensor of shape {tuple(out.shape)}" if isinstance(out, Tensor) else type(out).__name__
        raise ValueError(
            f"{what} must return one value per (b, h, q_idx, kv_idx): run element by element, it gave {got} for "
            f"the block {tuple(shape)}"
        )
    return out


def _vmapped(fn: Callable[..., Any], args: tuple[Tensor, ...], shape: Sequence[int]) -> Tensor:
    """``fn`` on every element, through nested ``torch.vmap`` over the four index axes (FlexAttention's way)."""
    *score, b, h, q_idx, kv_idx = args
    flat = [b.reshape(-1), h.reshape(-1), q_idx.reshape(-1), kv_idx.reshape(-1)]  # (B,), (H,), (Lq',), (Lk',)
    g = fn
    for axis in (3, 2, 1, 0):  # innermost first: kv, q, h, b; the score, when given, varies along every one
        dims = tuple(0 if i == axis else None for i in range(4))
        g = torch.vmap(g, in_dims=(0, *dims) if score else dims)
    if score:
        return g(score[0].expand(*shape), *flat)  # (B, H, Lq', Lk')
    return g(*flat)  # (B, H, Lq', Lk')


def _block_shape(*indices: Tensor) -> torch.Size:
    return torch.broadcast_shapes(*(t.shape for t in indices))


def _broadcasts(shape: Sequence[int], target: Sequence[int]) -> bool:
    return len(shape) <= len(target) and all(
        s in (1, t) for s, t in zip(reversed(shape), reversed(target), strict=False)
    )


def indices(batch: int, heads: int, rows: tuple[int, int], cols: tuple[int, int], device: torch.device | None) -> tuple:
    """The broadcasting index tensors of a block: ``b (B, 1, 1, 1)``, ``h (1, H, 1, 1)``, ``q_idx (1, 1, n, 1)`` for
    rows ``[r0, r1)``, ``kv_idx (1, 1, 1, m)`` for columns ``[j0, j1)``."""
    b = torch.arange(batch, device=device).view(batch, 1, 1, 1)  # (B, 1, 1, 1)
    h = torch.arange(heads, device=device).view(1, heads, 1, 1)  # (1, H, 1, 1)
    q_idx = torch.arange(*rows, device=device).view(1, 1, -1, 1)  # (1, 1, n, 1)
    kv_idx = torch.arange(*cols, device=device).view(1, 1, 1, -1)  # (1, 1, 1, m)
    return b, h, q_idx, kv_idx


def bind(mod: Any, **sizes: Any) -> Any:
    """A built-in bound to a call's sizes (aligned and checked); a user function as it is."""
    return mod.bind(**sizes) if isinstance(mod, (MaskMod, ScoreMod)) else mod


def check_callable(name: str, fn: object) -> None:
    if fn is not None and not callable(fn):
        raise TypeError(f"{name} must be a function ({_SIGNATURES[name]}), got {type(fn).__name__}")


_SIGNATURES = {
    "mask_mod": "mask_mod(b, h, q_idx, kv_idx) -> bool",
    "score_mod": "score_mod(score, b, h, q_idx, kv_idx) -> score",
}


def grad_inputs(score_mod: ScoreFn, probe: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
    """The tensors requiring grad that ``score_mod`` reads, for a backend that takes its gradient itself: the
    tensors it closes over (a built-in's, a closure's or a global's, a module's parameters), and any other leaf its
    result turns out to depend on when it is run once on ``probe`` (walking the autograd graph of that result)."""
    direct = {id(t): t for t in _closed_over(score_mod, depth=3) if t.requires_grad}
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


def read_tensors(fn: object) -> list[Tensor]:
    """The tensors a mask_mod or score_mod reads from outside (see :func:`grad_inputs`)."""
    return _closed_over(fn, depth=3)


def _closed_over(fn: object, depth: int) -> list[Tensor]:
    """The tensors a function reads from outside: a built-in's, a closure's cells and the globals it names, a
    module's parameters and buffers, a bound method's object, a ``functools.partial``'s arguments."""
    if depth < 0:
        return []
    if isinstance(fn, Tensor):
        return [fn]
    if isinstance(fn, torch.nn.Module):
        return [*fn.parameters(), *fn.buffers()]
    if isinstance(fn, (list, tuple)):
        return [t for x in fn for t in _closed_over(x, depth - 1)]
    if isinstance(fn, dict):
        return [t for x in fn.values() for t in _closed_over(x, depth - 1)]
    if isinstance(fn, (MaskMod, ScoreMod)):
        return list(fn.tensors())
    if isinstance(fn, functools.partial):
        return [t for x in (fn.func, fn.args, fn.keywords) for t in _closed_over(x, depth - 1)]
    if inspect.ismethod(fn):
        return _closed_over(fn.__self__, depth - 1) + _closed_over(fn.__func__, depth - 1)
    if inspect.isfunction(fn):
        names = inspect.getclosurevars(fn)
        values = [*names.nonlocals.values(), *names.globals.values()]
        return [t for x in values if not inspect.ismodule(x) for t in _closed_over(x, depth - 1)]
    return []


def _aligned(mod: Any, offset: int) -> Any:
    """A copy of a built-in (or of a subclass of one, a dataclass or not) with its ``offset`` set."""
    if dataclasses.is_dataclass(mod) and not isinstance(mod, type):
        return dataclasses.replace(mod, offset=offset)
    aligned = copy.copy(mod)
    aligned.offset = offset
    return aligned


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
    return mods


def _check_whole(name: str, value: object, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be a whole number, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")
    if int(value) > 2**62:
        raise ValueError(f"{name} must be at most 2**62, got {value}")
