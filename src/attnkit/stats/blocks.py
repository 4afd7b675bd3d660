"""The weights of a call, a block of rows at a time: each block scored against the keys some of its rows may see,
its softmax taken over whole rows (:mod:`attnkit.stats`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import Tensor

from attnkit import mods
from attnkit._checks import ranges
from attnkit.backends.common import additive_scores, repeat_kv, zero_dead
from attnkit.masks import Mask, compute_dtype

__all__ = ["CHUNK", "Parts", "blocks"]

# B batch, H heads, Hkv key/value heads, Lq/Lk query/key length, D head dim, n rows of a block, m keys of a block

# Keys per chunk: the mask says from index ranges which chunks a block's rows see (and the top-k search keeps one
# maximum per chunk).
CHUNK = 32


class Parts(NamedTuple):
    """One call, validated, as the statistics need it: ``q (B, H, Lq, D)``, ``k (B, Hkv, Lk, D)``, its combined
    ``mask``, ``w_v`` (additive scoring) or ``scale``, the bound ``score_mod``, ``sinks (H,)``, and the positions
    of its queries ``(B, Lq)`` and keys ``(B, Lk)`` where they are not the default (see the module docstring)."""

    q: Tensor
    k: Tensor
    mask: Mask
    w_v: Tensor | None = None
    scale: float = 1.0
    score_mod: mods.ScoreFn | None = None
    sinks: Tensor | None = None
    query_positions: Tensor | None = None
    key_positions: Tensor | None = None
    three_d: bool = False  # the inputs had no head axis: results drop it too


def blocks(
    parts: Parts, runs: list[tuple[int, int]], block_bytes: int, *, logs: bool = True
) -> Iterator[tuple[int, int, int, Tensor, Tensor, Tensor | None]]:
    """``(r0, r1, a, w, t, live)`` for each block of rows ``[r0, r1)`` in ``runs``: ``w (B, H, n, m)`` the weights
    of those rows over the keys ``[a, a + m)`` that some of them may see (every other key of theirs weighs 0),
    ``t`` the log-weights (finite, any value where ``w`` is 0; with ``logs=False``, the scores' memory, spent), and
    which rows see some key, ``(B|1, H|1, n|1, 1)`` (``None``: all do)."""
    q, k, mask = parts.q.detach(), parts.k.detach(), parts.mask
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    dtype = compute_dtype(q.dtype)
    q, k, _ = zero_dead(q, k, k, mask)  # padding and empty rows hold zeros (NaN there reaches nothing)
    q, k = q.to(dtype), k.to(dtype)
    w_v = None if parts.w_v is None else parts.w_v.detach().to(dtype)
    protected = None if parts.score_mod is None else mods.protected_storages(parts.score_mod)
    sinks = None if parts.sinks is None else mask.sink_logits(parts.sinks.detach().to(dtype))  # (B|1, H, Lq|1, 1)
    row_bytes = max(1, B * H * Lk * torch.finfo(dtype).bits // 8)  # (no batch: no block has a byte)
    step = max(1, block_bytes // row_bytes)
    chunks = ranges(0, Lk, CHUNK)  # (nc, 2)
    for start, stop in runs:
        for r0 in range(start, stop, step):
            r1 = min(r0 + step, stop)
            known = mask.tiles(torch.tensor([[r0, r1]]), chunks)
            seen = known.some[0].nonzero()[:, 0]  # (chunks some row of the block may see,)
            if not len(seen):
                continue  # these rows see no key: every statistic of theirs is 0
            a, b = int(chunks[int(seen[0]), 0]), int(chunks[int(seen[-1]), 1])
            s = _scores(q, k, w_v, parts.scale, r0, r1, a, b, block_bytes)  # (B, H, n, m)
            # the mask is built only over the chunks the ranges do not know to be seen whole (a causal block's
            # diagonal, a window's two edges), unless a bias or a score_mod covers them all
            first, last = int(seen[0]), int(seen[-1])
            partial = (~known.every[0, first : last + 1]).nonzero()[:, 0] + first  # hidden ones between included
            if mask.bias is not None or parts.score_mod is not None:
                p0, p1 = a, b
            elif len(partial):
                p0, p1 = int(chunks[int(partial[0]), 0]), int(chunks[int(partial[-1]), 1])
            else:
                p0 = p1 = a
            allowed, bias = mask.tile(r0, r1, p0, p1, dtype) if p1 > p0 else (None, None)  # (B|1, H|1, n|1, p)
            if parts.score_mod is not None:
                idx = mods.indices(B, H, (r0, r1), (a, b), q.device)
                s = mods.evaluate_score(parts.score_mod, s, *idx, protected=protected)  # (B, H, n, m)
                hidden = torch.isneginf(s)  # a score_mod's -inf hides the key, as in the reference
                if bool(hidden.any()):
                    allowed = ~hidden if allowed is None else allowed & ~hidden  # (B, H, n, m)
            part = s[..., p0 - a : p1 - a]  # (B, H, n, p): a view
            if bias is not None:
                part.add_(bias)
            if allowed is not None:
                part.masked_fill_(~allowed, torch.finfo(dtype).min)  # exp() of it is 0 beside the row's largest
            live = _live(allowed, (p0, p1) == (a, b))
            sink = None if sinks is None else sinks[..., r0:r1, :] if sinks.shape[2] > 1 else sinks
            w, t = _softmax(s, live, sink, logs)
            yield r0, r1, a, w, t, live


def _scores(q: Tensor, k: Tensor, w_v: Tensor | None, scale: float, r0: int, r1: int, a: int, b: int, budget: int):
    """The scores ``(B, H, n, m)`` of queries ``[r0, r1)`` against keys ``[a, b)``, before the score_mod."""
    B, H, _, D = q.shape
    Hkv, n, m = k.shape[1], r1 - r0, b - a
    if w_v is None:  # each key/value head's query heads as one matrix: one product per key/value head
        qb = q[:, :, r0:r1].reshape(B, Hkv, H // Hkv * n, D)  # (B, Hkv, G*n, D)
        s = torch.matmul(qb, k[:, :, a:b].transpose(-1, -2))  # (B, Hkv, G*n, m)
        return s.view(B, H, n, m).mul_(scale)  # (B, H, n, m)
    s = q.new_empty(B, H, n, m)
    step = max(1, budget // (B * H * n * D * q.element_size()))  # keys whose tanh features fit the budget
    for j0 in range(a, b, step):
        j1 = min(j0 + step, b)
        s[..., j0 - a : j1 - a] = additive_scores(q[:, :, r0:r1], repeat_kv(k[:, :, j0:j1], H), w_v)[0]
    return s  # (B, H, n, m)


def _live(allowed: Tensor | None, whole: bool) -> Tensor | None:
    """Which rows see some key, ``(B|1, H|1, n|1, 1)``, or ``None`` when all do (``allowed`` covers the whole
    block, ``whole``, or some keys are seen by every row)."""
    if allowed is None or not whole:
        return None
    live = allowed.any(dim=-1, keepdim=True)  # (B|1, H|1, n|1, 1)
    return None if bool(live.all()) else live


def _softmax(s: Tensor, live: Tensor | None, sink: Tensor | None, logs: bool) -> tuple[Tensor, Tensor]:
    """Weights ``(B, H, n, m)`` of masked scores (hidden ones at ``finfo.min``) over whole rows, and the
    log-weights ``s - lse`` in the scores' memory (``logs``); rows not ``live`` are all zeros."""
    top = s.amax(dim=-1, keepdim=True)  # (B, H, n, 1)
    if sink is not None:
        top = torch.maximum(top, sink)  # (B, H, n, 1)
    s = s.sub_(top)
    w = s.exp()  # (B, H, n, m)
    total = w.sum(dim=-1, keepdim=True)  # (B, H, n, 1)
    if sink is not None:
        total = total + torch.exp(sink - top)  # (B, H, n, 1)
    w = w.div_(total)
    if live is not None:
        w = w.masked_fill_(~live, 0.0)
    if logs:
        s = s.sub_(torch.log(total))  # (B, H, n, m): log a[i, j] where a key is seen, finite elsewhere
    return w, s
