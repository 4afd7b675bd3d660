"""The statistics of a block of weights, folded into a call's (:mod:`attnkit.stats` says what each is)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from attnkit.stats.blocks import CHUNK, Block

__all__ = ["Sums", "Where", "reduce"]

# B batch, H heads, Lq/Lk query/key length, n rows of a block, m keys of a block, c whole chunks of them, k the top-k


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
    columns padded with 0 (column -1). ``maxima (B, H, n, c)`` ranks each row's whole chunks of :data:`CHUNK`
    columns as their largest weights would (``None``: taken from ``w``). Only the ``k`` chunks of largest maxima and
    the columns past the last whole chunk are read again: the chunk of any of the k largest has a maximum at least
    the k-th largest, and the k chunks of largest maxima include every chunk whose maximum exceeds the k-th largest
    (ties may name other chunks, of equal values: the values found are the k largest all the same)."""
    B, H, n, m = w.shape
    whole = m // CHUNK
    if whole <= 2 * k:  # too few chunks to leave out
        top = w.topk(min(k, m), dim=-1)  # (B, H, n, <=k) each
        values, indices = top.values, top.indices
    else:
        grouped = w[..., : whole * CHUNK].unflatten(-1, (whole, CHUNK))  # (B, H, n, c, CHUNK)
        if maxima is None:
            maxima = grouped.amax(dim=-1)  # (B, H, n, c)
        chosen = maxima.topk(k, dim=-1, sorted=False).indices  # (B, H, n, k): chunks that may hold the k largest
        picked = grouped.gather(3, chosen[..., None].expand(B, H, n, k, CHUNK))  # (B, H, n, k, CHUNK)
        candidates = picked.flatten(-2)  # (B, H, n, k*CHUNK)
        if m > whole * CHUNK:  # the columns past the last whole chunk are always candidates
            candidates = torch.cat([candidates, w[..., whole * CHUNK :]], dim=-1)  # (B, H, n, k*CHUNK + m % CHUNK)
        top = candidates.topk(k, dim=-1)  # (B, H, n, k) each
        # the column of candidate c: in chosen chunk c // CHUNK at c % CHUNK, or past the whole chunks
        at = top.indices  # (B, H, n, k)
        indices = chosen.gather(-1, (at // CHUNK).clamp_max_(k - 1)) * CHUNK + at % CHUNK  # (B, H, n, k)
        indices = torch.where(at >= k * CHUNK, at - k * CHUNK + whole * CHUNK, indices)
        values = top.values
    if values.shape[-1] < k:
        pad = k - values.shape[-1]
        values = torch.nn.functional.pad(values, (0, pad))  # (B, H, n, k)
        indices = torch.nn.functional.pad(indices, (0, pad), value=-1)  # (B, H, n, k)
    return values, indices


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
