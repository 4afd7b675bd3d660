"""The statistics of a block of weights, folded into a call's (:mod:`attnkit.stats` says what each is)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from attnkit.stats.blocks import CHUNK, Block

__all__ = ["Sums", "Where", "chunk_topk", "reduce", "windows"]

# B batch, H heads, Lq/Lk query/key length, n rows of a block, m keys of a block, c whole chunks of them, k the top-k

# Strided groups of a chosen chunk the top-k search ranks by their maxima before reading values (see _topk).
GROUPS = 8


class Where(NamedTuple):
    """Where a call's queries and keys stand: ``Lq``, ``Lk``, and the positions given (see the module docstring)."""

    num_queries: int
    num_keys: int
    query_positions: Tensor | None = None  # (B, Lq)
    key_positions: Tensor | None = None  # (B, Lk)


class Sums:
    """The statistics of a call as its blocks are reduced into them."""

    def __init__(self, B: int, H: int, Lq: int, Lk: int, topk: int, dtype: torch.dtype, device: torch.device):
        self.values = torch.zeros(B, H, Lq, topk, dtype=dtype, device=device)
        self.indices = torch.full((B, H, Lq, topk), -1, dtype=torch.long, device=device)
        self.entropy = torch.zeros(B, H, Lq, dtype=dtype, device=device)
        self.column = torch.zeros(B, H, Lk, dtype=dtype, device=device)
        self.distance = torch.zeros(B, H, Lq, dtype=dtype, device=device)
        self.sink = torch.zeros(B, H, Lq, dtype=dtype, device=device)

    def clear(self) -> None:
        """Back to no block reduced."""
        self.indices.fill_(-1)
        for sums in (self.values, self.entropy, self.column, self.distance, self.sink):
            sums.zero_()


def reduce(sums: Sums, block: Block, where: Where, sink_keys: int) -> None:
    """Fold one block's weights ``keep * w`` into ``sums``: each reduction reads ``w`` once (``t`` once more for the
    entropy), and ``keep`` scales the results, not the weights."""
    r0, r1, h0, a, w, t, lse, normalized, keep, live, maxima = block
    B, H, n, m = w.shape  # H: the block's heads
    heads = slice(h0, h0 + H)
    share = None if keep is None else keep.expand(B, H, n, 1)  # (B, H, n, 1)
    values, indices = _topk(w, sums.values.shape[-1], maxima)  # (B, H, n, k) each
    if lse is None:
        lse = values[..., :1].log().neg_()  # (B, H, n, 1): t is 0 at the row's largest weight
    if share is not None:
        values = values * share  # (B, H, n, k)
    sums.values[:, heads, r0:r1] = values
    sums.indices[:, heads, r0:r1] = torch.where(values > 0, indices + a, -1)
    mass = None if normalized else w.sum(dim=-1)  # (B, H, n); None: 1
    total: Tensor | float = 1.0 if mass is None else mass
    # -sum_j w log w = lse sum_j w - sum_j w t; with keep: -sum_j keep w log(keep w)
    entropy = lse[..., 0] * total - t.mul_(w).sum(dim=-1)  # (B, H, n): t is spent
    if share is not None:
        entropy = share[..., 0] * entropy - torch.special.xlogy(share[..., 0], share[..., 0]) * total  # (B, H, n)
    sums.entropy[:, heads, r0:r1] = entropy
    coefficient = (
        w.new_ones(1, 1, 1, 1).expand(B, H, 1, n) if share is None else share.transpose(-1, -2)
    )  # (B, H, 1, n)
    sums.column[:, heads, a : a + m] += (coefficient @ w)[:, :, 0]  # (B, H, m): a product reads w faster than a sum
    if where.key_positions is not None:
        first = (where.key_positions[:, None, None, a : a + m] < sink_keys).to(w.dtype)  # (B, 1, 1, m)
        sink = (w * first).sum(dim=-1)  # (B, H, n)
    elif a < sink_keys:
        sink = w[..., : sink_keys - a].sum(dim=-1)  # (B, H, n)
    else:
        sink = None
    if sink is not None:
        sums.sink[:, heads, r0:r1] = sink if share is None else sink * share[..., 0]
    distance = _distance(w, mass, r0, r1, a, where)  # (B, H, n)
    sums.distance[:, heads, r0:r1] = distance if live is None else distance * live[..., 0]


def _topk(w: Tensor, k: int, maxima: Tensor | None) -> tuple[Tensor, Tensor]:
    """The ``k`` largest of each row of ``w (B, H, n, m)`` and their columns, descending; rows of fewer than ``k``
    columns padded with 0 (column -1). ``maxima (B, H, n, c)`` ranks each row's whole chunks of ``CHUNK``
    columns as their largest weights would (``None``: taken from ``w``).

    The search narrows twice by the same argument: a group's largest value ranks the group, and the ``k`` groups of
    largest maxima hold the ``k`` largest values (the group of any of them has a maximum at least the k-th largest,
    and every group whose maximum exceeds it is among the k chosen; ties may name other groups, of equal values:
    the values found are the k largest all the same). First the ``k`` chunks of largest maxima, then, of their
    ``k * CHUNK`` values, the ``k`` groups of largest maxima among ``GROUPS`` strided groups a chunk (columns
    ``j, j + GROUPS, ...`` of it); ``torch.topk`` reads ``k * CHUNK / GROUPS`` values a row at the end, not
    ``k * CHUNK``. The columns past the last whole chunk are always candidates."""
    B, H, n, m = w.shape
    whole = m // CHUNK
    if whole <= 2 * k or w.numel() == 0:  # too few chunks to leave out (or no rows)
        top = w.topk(min(k, m), dim=-1)  # (B, H, n, <=k) each
        values, indices = top.values, top.indices
    else:
        w = w.contiguous()  # (B, H, n, m): a block's already; whole weights given may be a view
        if maxima is None:
            maxima = w[..., : whole * CHUNK].unflatten(-1, (whole, CHUNK)).amax(dim=-1)  # (B, H, n, c)
        chosen = maxima.topk(k, dim=-1, sorted=False).indices  # (B, H, n, k): chunks that may hold the k largest
        starts = (
            _row_starts(w.shape[:-1], m, w.device) + chosen * CHUNK
        )  # (B, H, n, k): where each chosen chunk starts in w
        tail = w[..., whole * CHUNK :] if m > whole * CHUNK else None  # (B, H, n, m % CHUNK)
        values, indices = chunk_topk(w, chosen, starts, k, tail)  # (B, H, n, k) each
    if values.shape[-1] < k:
        pad = k - values.shape[-1]
        values = torch.nn.functional.pad(values, (0, pad))  # (B, H, n, k)
        indices = torch.nn.functional.pad(indices, (0, pad), value=-1)  # (B, H, n, k)
    return values, indices


def chunk_topk(w: Tensor, chosen: Tensor, starts: Tensor, k: int, tail: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The ``k`` largest values, descending, and their columns, of the chunks ``chosen (..., k)`` of each row (the
    chunks of largest maxima), which start at ``starts (..., k)`` in contiguous ``w``; and of ``tail (..., t)``, the
    columns past a row's last whole chunk, when given: its columns follow the whole chunks'. (``_topk``.)"""
    *lead, _ = chosen.shape
    picked = windows(w, starts, CHUNK, 1)  # (..., k, CHUNK)
    per = CHUNK // GROUPS  # values a group
    groups = picked.view(*lead, k, per, GROUPS).amax(dim=-2).view(*lead, k * GROUPS)  # (..., k*GROUPS)
    kept = groups.topk(k, dim=-1, sorted=False).indices  # (..., k): groups that may hold the k largest
    # group g of the picked values: chunk slot g // GROUPS, its columns g % GROUPS + GROUPS * i
    at_group = _row_starts(picked.shape[:-2], k * CHUNK, w.device) + kept // GROUPS * CHUNK + kept % GROUPS  # (..., k)
    candidates = windows(picked, at_group, per, GROUPS).view(*lead, k * per)  # (..., k*per)
    if tail is not None:
        candidates = torch.cat([candidates, tail], dim=-1)  # (..., k*per + t)
    top = candidates.topk(k, dim=-1)  # (..., k) each
    # candidate p: value p % per of kept group p // per, or in the tail
    at = top.indices  # (..., k)
    group = kept.gather(-1, (at // per).clamp_max_(k - 1))  # (..., k)
    slot = group // GROUPS  # (..., k): which chosen chunk
    indices = chosen.gather(-1, slot) * CHUNK + group % GROUPS + at % per * GROUPS  # (..., k)
    if tail is not None:
        first = w.shape[-1] - tail.shape[-1]  # the tail's first column: past the row's whole chunks
        indices = torch.where(at >= k * per, at - k * per + first, indices)
    return top.values, indices


def _row_starts(lead: torch.Size, width: int, device: torch.device) -> Tensor:
    """Where each row of a contiguous tensor of rows ``lead`` (its leading axes) of ``width`` elements each
    starts: ``(*lead, 1)``."""
    return torch.arange(0, lead.numel() * width, width, device=device).view(*lead, 1)


def windows(x: Tensor, starts: Tensor, size: int, step: int) -> Tensor:
    """The ``size`` elements ``start, start + step, ...`` of contiguous ``x`` from each of ``starts (B, H, n, j)``:
    ``(B, H, n, j, size)``. One ``index_select`` of the rows of a view whose row ``r`` holds those elements from
    ``r`` on: a ``gather`` of the same values is ~30x slower (docs/benchmarks.md)."""
    flat = x.reshape(-1)  # a view: x is contiguous
    span = (size - 1) * step + 1  # elements a window covers
    windows = flat.as_strided((flat.numel() - span + 1, size), (1, step))  # (elements - span + 1, size)
    return windows.index_select(0, starts.reshape(-1)).view(*starts.shape, size)  # (B, H, n, j, size)


def _distance(w: Tensor, mass: Tensor | None, r0: int, r1: int, a: int, where: Where) -> Tensor:
    """``sum_j w |pos(i) - pos(j)| / sum_j w`` for a block ``(B, H, n, m)`` whose rows sum to ``mass (B, H, n)``
    (``None``: 1); 0 in rows of no weight."""
    B, H, n, m = w.shape
    device, dtype = w.device, w.dtype
    Lq, Lk = where.num_queries, where.num_keys
    if where.query_positions is None:
        qpos = torch.arange(r0, r1, device=device, dtype=dtype).add_(Lk - Lq).view(1, 1, n, 1)  # (1, 1, n, 1)
        lowest, highest = r0 + Lk - Lq, r1 - 1 + Lk - Lq
    else:
        qpos = where.query_positions[:, None, r0:r1, None].to(dtype)  # (B, 1, n, 1)
        chosen = where.query_positions[:, r0:r1]  # (B|1, n)
        lowest, highest = (int(chosen.min()), int(chosen.max())) if chosen.numel() else (0, 0)
    if where.key_positions is not None:  # a sliding cache's ring: as many keys as its window, each read once
        kpos = where.key_positions[:, None, None, a : a + m].to(dtype)  # (B, 1, 1, m)
        total = (w * (qpos - kpos).abs_()).sum(dim=-1)  # (B, H, n)
    else:
        # keys at least R before every query of the block ([0, lo)) or after every one ([hi, m)): there the distance
        # is linear in the key, one product with the keys' positions each, whose rounding (of the positions' size
        # less the block's first query's) is small beside distances of R or more; the keys between, within R of some
        # query, are read key by key, exactly: a head attending next to its queries keeps every digit
        R = max(r1 - r0, CHUNK)
        lo = min(max(lowest - R - a, 0), m)
        hi = min(max(highest + R + 1 - a, lo), m)
        keys = torch.arange(a - lowest, a - lowest + m, device=device, dtype=dtype)  # (m,): from the first query
        rel = (qpos - lowest).view(*qpos.shape[:-1])  # (B|1, 1, n)
        total = torch.zeros(B, H, n, device=device, dtype=dtype)
        if lo > 0:
            total += rel * w[..., :lo].sum(dim=-1) - w[..., :lo] @ keys[:lo]  # (B, H, n)
        if hi < m:
            total += w[..., hi:] @ keys[hi:] - rel * w[..., hi:].sum(dim=-1)  # (B, H, n)
        if hi > lo:
            near = (keys[lo:hi] - (qpos - lowest)).abs_()  # (B|1, 1, n, hi - lo)
            total += (w[..., lo:hi] * near).sum(dim=-1)  # (B, H, n)
    if mass is None:
        return total
    return torch.where(mass > 0, total / mass.clamp_min(torch.finfo(dtype).tiny), 0.0)  # (B, H, n)
