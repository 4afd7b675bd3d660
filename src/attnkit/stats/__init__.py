"""Attention statistics: exact reductions of every row of the weights, computed a block of rows at a time, so that
no ``Lq x Lk`` matrix exists (:func:`attnkit.record_stats`, :func:`attention_stats`).

With ``a[i, j]`` the weights as the reference backend defines them (every mask, modifier, sink and grouped-query
layout applied; :mod:`attnkit.backends.reference`), for each example, head and query row ``i``::

    topk_values[i]   the k largest a[i, j] over the keys, descending
    topk_indices[i]  their keys j (int64); -1 where the value is 0 (past the row's keys, a key the row does not
                     see, or a weight that underflows): a zero names no key, so ties among zeros are not arbitrary
    entropy[i]       -sum_j a[i, j] log a[i, j], in nats; 0 for a row that sees no key
    column_sum[j]    sum_i a[i, j], over the call's rows: the weight key j receives (H2O's and SnapKV's score)
    distance[i]      sum_j a[i, j] |pos(i) - pos(j)| / sum_j a[i, j]: the mean distance attended over, in
                     positions; 0 for a row that sees no key
    sink_mass[i]     sum_{pos(j) < sink_keys} a[i, j]: the weight on the first keys (StreamingLLM's sinks)

``pos(j) = j`` and ``pos(i) = i + Lk - Lq`` (the bottom-right alignment of ``is_causal``); a
:class:`~attnkit.KVCache` gives its rows' own positions (ragged rows, a static cache's slots, a sliding cache's
ring). With learned sinks a row's weights sum to less than 1: the sink's share is no key's, so it is in no
statistic (``sum_j a[i, j]`` is ``1 -`` the sink's weight).

How: each block of rows of one key/value head's query heads is scored against the keys some of its rows may see
(the mask's index ranges say which: a causal block stops at its diagonal, a sliding window keeps its band), its
softmax taken over whole rows by PyTorch's fused kernel, then reduced, each reduction one read of the block. A block
holds at most ``BLOCK_BYTES`` of weights (never less than one row), its scores as much again, both in two
buffers every block reuses (a score_mod's results and the reductions' small temporaries come beside them: a few
times that budget in all, whatever the length); the top-k search reads the largest of each ``CHUNK`` keys,
taken as the row's maximum is found, and then only the chunks that can hold the k largest. The result is
``O(B * H * (Lq * k + Lk))``.

When the forward gave each row's log-sum-exp (a layer recorded under ``torch.no_grad()`` whose call ran PyTorch's
fused CPU kernel: no mask or a causal one, float32 or float64), each weight is ``exp(score - lse)`` on its own, and
the rows are taken a tile of keys at a time instead, each tile reduced while it is in cache
(:mod:`attnkit.stats.tiled`): in float32 by a C++ kernel built on first use (:mod:`attnkit.stats.kernel`), 2-3.5x
faster than whole rows at every length, holding one tile's scores and each row's top-k so far; otherwise (float64,
or no kernel) by torch ops, for rows of ``attnkit.stats.tiled.MIN_KEYS`` keys or more, about a fifth faster at 32k
tokens, holding at most ``attnkit.stats.tiled.KEPT_BYTES`` of weights for the top-k search, whatever the length.

Computed and returned in float32 for float16/bfloat16 inputs (float64 for float64, float32 for float32), detached.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from attnkit import mods
from attnkit.masks import compute_dtype
from attnkit.plan import Plan
from attnkit.stats import tiled
from attnkit.stats.blocks import CHUNK, Block, Parts, blocks
from attnkit.stats.reduce import Sums, Where, reduce

__all__ = [
    "BLOCK_BYTES",
    "CHUNK",
    "SINK_KEYS",
    "AttentionStats",
    "Parts",
    "attention_stats",
    "compute",
    "from_weights",
    "parts",
    "rows_of",
]

# B batch, H heads, Hkv key/value heads, Lq/Lk query/key length, D head dim, n rows of a block, m keys of a block,
# k the top-k

# The weights of one block of rows (its scores, rewritten in place, take as much again).
BLOCK_BYTES = 16 * 2**20
# The first keys whose weight sink_mass sums, by default (StreamingLLM keeps 4).
SINK_KEYS = 4
# topk at or past this is refused: rows past their keys are padded, and so large a pad is a mistake, not a request.
TOPK_LIMIT = 2**31


@dataclass(frozen=True)
class AttentionStats:
    """The statistics of one call (see the module docstring for each formula). Shapes follow the weights': for
    weights ``(B, H, Lq, Lk)``, ``topk_values``/``topk_indices`` ``(B, H, Lq, k)``, ``entropy``, ``distance`` and
    ``sink_mass`` ``(B, H, Lq)``, ``column_sum`` ``(B, H, Lk)`` (without the ``H`` axis for 3-dim weights).
    ``kv_heads``: the call's key/value heads when fewer than its query heads (grouped-query attention).
    ``query_positions`` ``(B|1, Lq)`` and ``key_positions`` ``(B|1, Lk)``, int64: where the call's queries and keys
    stand when not at the default ``i + Lk - Lq`` and ``j`` (a :class:`~attnkit.KVCache`'s rows, a sliding cache's
    ring; through transformers, a cache's slots; ``None``: the default)."""

    topk_values: Tensor
    topk_indices: Tensor
    entropy: Tensor
    column_sum: Tensor
    distance: Tensor
    sink_mass: Tensor
    sink_keys: int = SINK_KEYS
    kv_heads: int | None = None
    query_positions: Tensor | None = None
    key_positions: Tensor | None = None

    @property
    def topk(self) -> int:
        return self.topk_values.shape[-1]

    @property
    def nbytes(self) -> int:
        """The bytes its tensors hold."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def tensors(self) -> dict[str, Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if isinstance(getattr(self, f.name), Tensor)}

    def as_dict(self) -> dict[str, Tensor | int | None]:
        """Plain values (``torch.load(..., weights_only=True)`` reads them back): :meth:`from_dict` inverts it."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @classmethod
    def from_dict(cls, values: dict) -> AttentionStats:
        names = {f.name for f in fields(cls)}
        optional = ("sink_keys", "kv_heads", "query_positions", "key_positions")
        missing = sorted(n for n in names - set(values) if n not in optional)
        if missing:
            raise ValueError(f"attention statistics need {', '.join(missing)}; got {', '.join(sorted(values))}")
        kept = {n: v for n, v in values.items() if n in names}
        wrong = sorted(
            n
            for n, v in kept.items()
            if n not in optional[:2] and not isinstance(v, Tensor) and not (n in optional and v is None)
        )
        if wrong:
            raise ValueError(f"attention statistics hold tensors; {', '.join(wrong)} is not one")
        rows = kept["entropy"].shape  # (B, H, Lq) or (B, Lq)
        shapes = {n: tuple(v.shape) for n, v in kept.items() if isinstance(v, Tensor)}
        B, Lq, Lk = rows[0], rows[-1], kept["column_sum"].shape[-1]
        positions = [(kept.get("query_positions"), Lq), (kept.get("key_positions"), Lk)]
        floating = [str(p.dtype) for p, _ in positions if p is not None and (p.is_floating_point() or p.is_complex())]
        if floating:
            raise ValueError(f"attention statistics' positions are whole numbers, got {', '.join(floating)}")
        if (
            kept["topk_values"].shape[:-1] != rows
            or kept["topk_indices"].shape != kept["topk_values"].shape
            or kept["distance"].shape != rows
            or kept["sink_mass"].shape != rows
            or kept["column_sum"].shape[:-1] != rows[:-1]
            or any(
                p is not None and (p.dim() != 2 or p.shape[0] not in (1, B) or p.shape[1] != L) for p, L in positions
            )
        ):
            raise ValueError(f"attention statistics of shapes that do not fit together: {shapes}")
        return cls(**kept)


def compute(
    parts: Parts, topk: int, sink_keys: int = SINK_KEYS, block_bytes: int = BLOCK_BYTES, kv_heads: int | None = None
) -> AttentionStats:
    """The statistics of the call ``parts``, block by block (see the module docstring)."""
    check_topk(topk, sink_keys)
    q, k = parts.q.detach(), parts.k.detach()
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    dtype = compute_dtype(q.dtype)
    sums = Sums(B, H, Lq, max(Lk, parts.slots), topk, dtype, q.device)
    where = Where(Lq, Lk, parts.query_positions, parts.key_positions)
    with torch.no_grad():
        # the forward gave each row's log-sum-exp, and the tile kernel runs or rows are long: a tile at a time,
        # unless some row's weights do not sum to 1
        tiles = tiled.supports(parts) and (tiled.fused(parts) or Lk >= tiled.MIN_KEYS)
        if tiles and not tiled.compute(parts, sums, sink_keys):
            del sums  # (before its replacement exists: at 32k tokens a layer's top-k alone is 100 MiB)
            sums, tiles = Sums(B, H, Lq, max(Lk, parts.slots), topk, dtype, q.device), False
        if not tiles:
            for block in blocks(parts, [(0, Lq)], block_bytes):
                reduce(sums, block, where, sink_keys)
    found = [sums.values, sums.indices, sums.entropy, sums.column, sums.distance, sums.sink]
    if parts.three_d:
        found = [t.squeeze(1) for t in found]
    return _result(found, sink_keys, kv_heads, (parts.query_positions, parts.key_positions))


def rows_of(parts: Parts, rows: list[int], heads: list[int] | None = None, block_bytes: int = BLOCK_BYTES) -> Tensor:
    """The whole weights of the query ``rows`` (sorted, distinct) of the ``heads`` given (all: ``None``),
    ``(B, h, len(rows), max(Lk, parts.slots))`` in the compute dtype, block by block: the last query of a long prompt,
    or one head's weights, without the ``H x Lq x Lk`` tensor of every head."""
    q, k = parts.q, parts.k
    B, H, Lq, _ = q.shape
    heads = list(range(H)) if heads is None else heads
    for name, chosen, size in (("heads", heads, H), ("rows", rows, Lq)):
        wrong = [i for i in chosen if not 0 <= i < size]
        if wrong:
            raise ValueError(f"{name} must be in [0, {size}), got {wrong}")
    width = max(k.shape[2], parts.slots)
    out = torch.zeros(B, len(heads), len(rows), width, dtype=compute_dtype(q.dtype), device=q.device)  # (B, h, q, Lk)
    runs, start = [], 0  # maximal runs of consecutive rows: (first row, one past its last)
    for i in range(1, len(rows) + 1):
        if i == len(rows) or rows[i] != rows[i - 1] + 1:
            runs.append((rows[start], rows[i - 1] + 1))
            start = i
    starts = [r0 for r0, _ in runs]
    offsets = [0]  # where each run's rows go in out
    for r0, r1 in runs:
        offsets.append(offsets[-1] + r1 - r0)
    with torch.no_grad():
        for block in blocks(parts, runs, block_bytes, heads):
            r0, r1, h0, a, w = block.r0, block.r1, block.h0, block.a, block.w
            run = bisect.bisect_right(starts, r0) - 1
            o = offsets[run] + r0 - starts[run]
            if block.keep is not None:
                w = w * block.keep  # (B, G, n, m)
            for i, h in enumerate(heads):  # (a head may be chosen twice)
                if h0 <= h < h0 + w.shape[1]:
                    out[:, i, o : o + r1 - r0, a : a + w.shape[-1]] = w[:, h - h0]  # (B, n, m)
    return out.squeeze(1) if parts.three_d else out


def from_weights(
    weights: Tensor,
    topk: int,
    sink_keys: int = SINK_KEYS,
    query_positions: Tensor | None = None,
    key_positions: Tensor | None = None,
    kv_heads: int | None = None,
) -> AttentionStats:
    """The statistics of whole weights ``(B, H, Lq, Lk)`` or ``(B, Lq, Lk)`` (a layer that computes them anyway:
    :mod:`attnkit.d2l`'s), by the same reductions as :func:`compute`."""
    three_d = weights.dim() == 3
    w = weights.detach()
    w = w.unsqueeze(1) if three_d else w  # (B, H, Lq, Lk)
    w = w.to(compute_dtype(w.dtype))
    B, H, Lq, Lk = w.shape
    sums = Sums(B, H, Lq, Lk, topk, w.dtype, w.device)
    where = Where(Lq, Lk, query_positions, key_positions)
    with torch.no_grad():
        t = torch.where(w > 0, w.log(), 0.0)  # (B, H, Lq, Lk)
        reduce(sums, Block(0, Lq, 0, 0, w, t, w.new_zeros(B, H, Lq, 1), normalized=False), where, sink_keys)
    stats = [sums.values, sums.indices, sums.entropy, sums.column, sums.distance, sums.sink]
    if three_d:
        stats = [s.squeeze(1) for s in stats]
    return _result(stats, sink_keys, kv_heads, (query_positions, key_positions))


def _result(
    found: list[Tensor], sink_keys: int, kv_heads: int | None, positions: tuple[Tensor | None, Tensor | None]
) -> AttentionStats:
    values, indices, entropy, column, distance, sink = found
    if kv_heads is not None and (entropy.dim() != 3 or kv_heads >= entropy.shape[1]):
        kv_heads = None  # said only for grouped-query heads
    where = [None if p is None else p.detach().to(torch.long) for p in positions]  # (B|1, Lq), (B|1, Lk)
    return AttentionStats(values, indices, entropy, column, distance, sink, sink_keys, kv_heads, *where)


def parts(
    q: Tensor,
    k: Tensor,
    *,
    w_v: Tensor | None = None,
    valid_lens: Tensor | None = None,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    mask_mod: mods.MaskFn | None = None,
    score_mod: mods.ScoreFn | None = None,
    sinks: Tensor | None = None,
    query_positions: Tensor | None = None,
    key_positions: Tensor | None = None,
    plan: Plan | None = None,
) -> tuple[Parts, bool]:
    """A call's :class:`Parts`, validated as :func:`attnkit.functional.attention_weights` validates them (the
    arguments and shapes are its), and whether the inputs were 3-dim (one head, no head axis)."""
    from attnkit import functional as F

    masks = F.Masks(valid_lens, attn_mask, is_causal, mask_mod, score_mod, plan)
    q, k, mask, w_v, scale, score_mod, sinks, three_d = F.scoring(q, k, masks, w_v=w_v, scale=scale, sinks=sinks)
    return Parts(q, k, mask, w_v, scale, score_mod, sinks, query_positions, key_positions, three_d), three_d


def check_topk(topk: object, sink_keys: object = SINK_KEYS) -> None:
    """``topk`` a whole number in ``[1, 2**31)``, ``sink_keys`` one >= 0 (``bool`` is neither)."""
    for name, value, least in (("topk", topk, 1), ("sink_keys", sink_keys, 0)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}: {value!r}")
        if value < least:
            raise ValueError(f"{name} must be at least {least}, got {value}")
    if topk >= TOPK_LIMIT:  # type: ignore[operator]
        raise ValueError(f"topk must be below {TOPK_LIMIT} (more than any row has keys), got {topk}")


def attention_stats(
    q: Tensor,
    k: Tensor,
    *,
    topk: int = 8,
    sink_keys: int = SINK_KEYS,
    w_v: Tensor | None = None,
    valid_lens: Tensor | None = None,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    mask_mod: mods.MaskFn | None = None,
    score_mod: mods.ScoreFn | None = None,
    sinks: Tensor | None = None,
) -> AttentionStats:
    """The statistics of the weights of one call, without the weights: what :func:`attnkit.record_stats` keeps.

    Dot-product scoring, or additive scoring when ``w_v`` is given; the other arguments and the shapes are those of
    :func:`attnkit.scaled_dot_product_attention`. Memory: the result, two buffers of ``BLOCK_BYTES`` (a block's
    weights and scores) and a contiguous copy of ``k``.

    Args:
        topk: how many of each row's largest weights to keep. A row with fewer keys (or fewer it sees) than
            ``topk`` has its other entries 0, with index -1.
        sink_keys: ``sink_mass`` sums the weight on keys ``[0, sink_keys)``.

    Returns:
        :class:`AttentionStats` (see the module docstring), in the compute dtype; 3-dim inputs give no head axis.

    Raises:
        TypeError, ValueError: as :func:`attnkit.functional.attention_weights`; ``topk`` not an int >= 1,
            ``sink_keys`` not an int >= 0.

    Example:
        >>> s = attention_stats(torch.ones(1, 2, 4), torch.ones(1, 3, 4), topk=2, valid_lens=torch.tensor([2]))
        >>> s.topk_values[0, 0].tolist(), s.topk_indices[0, 0].tolist(), round(s.entropy[0, 0].item(), 4)
        ([0.5, 0.5], [0, 1], 0.6931)
    """
    check_topk(topk, sink_keys)
    call, three_d = parts(
        q,
        k,
        w_v=w_v,
        valid_lens=valid_lens,
        attn_mask=attn_mask,
        is_causal=is_causal,
        scale=scale,
        mask_mod=mask_mod,
        score_mod=score_mod,
        sinks=sinks,
    )
    return compute(call, topk, sink_keys, kv_heads=call.k.shape[1])
