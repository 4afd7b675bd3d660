"""The statistics of a block of weights, folded into a call's (:mod:`attnkit.stats` says what each is)."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from attnkit.stats.blocks import CHUNK

__all__ = ["Sums", "Where", "reduce"]

# B batch, H heads, Lq/Lk query/key length, n rows of a block, m keys of a block, k the top-k


class Where(NamedTuple):
    """Where a call's queries and keys stand: ``Lq``, ``Lk``, and the positions given (see the module docstring)."""

    num_queries: int
    num_keys: int
    query_positions: Tensor | None = None  # (B, Lq)
    key_positions: Tensor | None = None  # (B, Lk)
    sinks: bool = False  # the call has sinks: its rows' weights sum to less than 1


class Sums:
    """The statistics of a call as its blocks are reduced into them."""

    def __init__(self, B: int, H: int, Lq: int, Lk: int, topk: int, dtype: torch.dtype, device: torch.device):
        self.values = torch.zeros(B, H, Lq, topk, dtype=dtype, device=device)
        self.indices = torch.full((B, H, Lq, topk), -1, dtype=torch.long, device=device)
        self.entropy = torch.zeros(B, H, Lq, dtype=dtype, device=device)
        self.column = torch.zeros(B, H, Lk, dtype=dtype, device=device)
        self.distance = torch.zeros(B, H, Lq, dtype=dtype, device=device)
        self.sink = torch.zeros(B, H, Lq, dtype=dtype, device=device)


def reduce(
    sums: Sums, w: Tensor, t: Tensor, live: Tensor | None, r0: int, r1: int, a: int, where: Where, sink_keys: int
) -> None:
    """Fold one block's weights ``w (B, H, n, m)`` (keys ``[a, a + m)``) and log-weights ``t`` into ``sums``."""
    B, H, n, m = w.shape
    values, indices = _topk(w, sums.values.shape[-1])  # (B, H, n, k) each
    sums.values[:, :, r0:r1] = values
    sums.indices[:, :, r0:r1] = torch.where(values > 0, indices + a, -1)
    # -sum_j w t as a batch of dot products (one read of each): 0 where w is 0, t being finite
    dots = w.reshape(-1, 1, m) @ t.reshape(-1, m, 1)  # (B*H*n, 1, 1)
    sums.entropy[:, :, r0:r1] = -dots.view(B, H, n)
    sums.column[:, :, a : a + m] += w.sum(dim=-2)  # (B, H, m)
    if where.key_positions is None:
        if a < sink_keys:
            sums.sink[:, :, r0:r1] = w[..., : sink_keys - a].sum(dim=-1)  # (B, H, n)
    else:
        first = (where.key_positions[:, None, None, a : a + m] < sink_keys).to(w.dtype)  # (B, 1, 1, m)
        sums.sink[:, :, r0:r1] = (w * first).sum(dim=-1)  # (B, H, n)
    if where.sinks:
        # a ratio: from weights relative to the row's largest, which a sink's share cannot leave subnormal
        w = torch.exp(t - t.amax(dim=-1, keepdim=True))  # (B, H, n, m)
        if live is not None:
            w = w.masked_fill_(~live, 0.0)
    mass = w.sum(dim=-1)  # (B, H, n)
    sums.distance[:, :, r0:r1] = _distance(w, mass, r0, r1, a, where)


def _topk(w: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The ``k`` largest of each row of ``w (B, H, n, m)`` and their columns, descending; rows of fewer than ``k``
    columns padded with 0. Reads each row once for its chunk maxima, then only the ``k`` chunks of largest maxima
    and the columns past the last whole chunk: the chunk of any of the k largest has a maximum at least the k-th
    largest, and the k chunks of largest maxima include every chunk whose maximum exceeds the k-th largest (ties
    may name other chunks, of equal values: the values found are the k largest all the same)."""
    B, H, n, m = w.shape
    whole = m // CHUNK
    if whole <= 2 * k:  # too few chunks to leave out
        top = w.topk(min(k, m), dim=-1)  # (B, H, n, <=k) each
        values, indices = top.values, top.indices
    else:
        maxima = w[..., : whole * CHUNK].unflatten(-1, (whole, CHUNK)).amax(dim=-1)  # (B, H, n, whole)
        chosen = maxima.topk(k, dim=-1).indices  # (B, H, n, k): chunks that may hold the k largest
        grouped = w[..., : whole * CHUNK].unflatten(-1, (whole, CHUNK))  # (B, H, n, whole, CHUNK)
        picked = grouped.gather(3, chosen[..., None].expand(B, H, n, k, CHUNK))  # (B, H, n, k, CHUNK)
        columns = (chosen[..., None] * CHUNK + torch.arange(CHUNK, device=w.device)).flatten(-2)  # (B, H, n, k*C)
        candidates = picked.flatten(-2)  # (B, H, n, k*CHUNK)
        if m > whole * CHUNK:  # the columns past the last whole chunk are always candidates
            tail = torch.arange(whole * CHUNK, m, device=w.device).expand(B, H, n, -1)  # (B, H, n, m % CHUNK)
            candidates = torch.cat([candidates, w[..., whole * CHUNK :]], dim=-1)
            columns = torch.cat([columns, tail], dim=-1)
        top = candidates.topk(k, dim=-1)  # (B, H, n, k) each
        values, indices = top.values, columns.gather(-1, top.indices)
    if values.shape[-1] < k:
        pad = k - values.shape[-1]
        values = torch.nn.functional.pad(values, (0, pad))  # (B, H, n, k)
        indices = torch.nn.functional.pad(indices, (0, pad), value=-1)  # (B, H, n, k)
    return values, indices


def _distance(w: Tensor, mass: Tensor, r0: int, r1: int, a: int, where: Where) -> Tensor:
    """``sum_j w |pos(i) - pos(j)| / sum_j w`` for a block ``(B, H, n, m)``; 0 in rows of no weight."""
    B, H, n, m = w.shape
    device, dtype = w.device, w.dtype
    Lq, Lk = where.num_queries, where.num_keys
    if where.query_positions is None:
        qpos = torch.arange(r0, r1, device=device, dtype=dtype).add_(Lk - Lq).view(1, 1, n, 1)  # (1, 1, n, 1)
    else:
        qpos = where.query_positions[:, None, r0:r1, None].to(dtype)  # (B, 1, n, 1)
    if where.key_positions is not None:  # a sliding cache's ring: as many keys as its window, each read once
        kpos = where.key_positions[:, None, None, a : a + m].to(dtype)  # (B, 1, 1, m)
        total = (w * (qpos - kpos).abs_()).sum(dim=-1)  # (B, H, n)
    else:
        # sum_j w (pos_i - j) + 2 sum_{j > pos_i} w (j - pos_i), positions taken from the block's first query's
        # (so that a head attending near its queries loses no digits to the distance from the start)
        p0 = float(qpos.min()) if qpos.numel() else 0.0
        keys = torch.arange(a, a + m, device=device, dtype=dtype).sub_(p0)  # (m,)
        rel = (qpos - p0).view(*qpos.shape[:-1])  # (B|1, 1, n)
        total = rel * mass - (w @ keys)  # (B, H, n)
        later = max(0, int(float(qpos.min()) - a) + 1) if qpos.numel() else 0  # keys after some query of the block
        if later < m:
            past = (keys[later:] - (qpos - p0)).clamp_min_(0.0)  # (B|1, 1, n, m - later)
            total = total + 2 * (w[..., later:] * past).sum(dim=-1)  # (B, H, n)
    return torch.where(mass > 0, total / mass.clamp_min(torch.finfo(dtype).tiny), 0.0)  # (B, H, n)
