"""The weights of a call, a block of rows at a time: each block scored against the keys some of its rows may see,
its softmax taken over whole rows (:mod:`attnkit.stats`)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import Tensor

from attnkit import mods
from attnkit._validate import ranges
from attnkit.backends.common import additive_scores, zero_dead
from attnkit.backends.contract import scores_bounded
from attnkit.masks import Mask, compute_dtype

__all__ = ["CHUNK", "Block", "Parts", "blocks"]

# B batch, H heads, Hkv key/value heads, G = H // Hkv heads of a block, Lq/Lk query/key length, D head dim, n rows
# of a block, m keys of a block, c whole chunks of them

# Keys per chunk: the mask says from index ranges which chunks a block's rows see (and the top-k search keeps one
# maximum per chunk).
CHUNK = 32


class Parts(NamedTuple):
    """One call, validated, as the statistics need it: ``q (B, H, Lq, D)``, ``k (B, Hkv, Lk, D)``, its combined
    ``mask``, ``w_v`` (additive scoring) or ``scale``, the bound ``score_mod``, ``sinks (H,)``, the positions
    of its queries ``(B, Lq)`` and keys ``(B, Lk)`` where they are not the default (see the module docstring),
    and ``lse (B, H, Lq)``, each row's log-sum-exp of its scores, where the forward gave it
    (:mod:`attnkit.stats.tiled`)."""

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
    slots: int = 0  # the weights run over this many keys where more than k's: the rest are empty and weigh 0
    lse: Tensor | None = None


class Block(NamedTuple):
    """The rows ``[r0, r1)`` of heads ``[h0, h0 + G)`` of a call over the keys ``[a, a + m)`` some of them may see
    (every other key of theirs weighs 0). The weights are ``keep * w``:

    - ``w (B, G, n, m)``: each row's softmax over its keys, summing to 1 (any finite values in a row not ``live``);
    - ``t (B, G, n, m)``: ``log w = t - lse`` where ``w > 0``, finite everywhere; ``lse (B, G, n, 1)`` (``None``:
      ``-log`` of the row's largest ``w``, ``t`` being 0 there);
    - ``normalized``: each row of ``w`` sums to 1 (a softmax's), or to what it sums (weights given whole);
    - ``keep (B|1, G|1, n|1, 1)``: the share of the row's weight on keys: below 1 with sinks, 0 in a row that sees
      no key (``None``: 1 everywhere);
    - ``live (B|1, G|1, n|1, 1)``: which rows see some key (``None``: all do);
    - ``maxima (B, G, n, c)``: the largest score of each whole chunk of ``CHUNK`` keys, ``t`` before its
      shift (it ranks the chunks as their largest weights do; ``None``: not taken).

    ``w`` and ``t`` live in buffers the next block reuses."""

    r0: int
    r1: int
    h0: int
    a: int
    w: Tensor
    t: Tensor
    lse: Tensor | None = None
    normalized: bool = True
    keep: Tensor | None = None
    live: Tensor | None = None
    maxima: Tensor | None = None


def blocks(
    parts: Parts, runs: list[tuple[int, int]], block_bytes: int, heads: list[int] | None = None
) -> Iterator[Block]:
    """A :class:`Block` for each block of rows in ``runs`` (``(first, one past the last)`` each) and each key/value
    head's query heads (those with one of ``heads``, when given), where some row sees some key; at most
    ``block_bytes`` of weights each (never less than one row). A block of one key/value head's heads, not of all
    heads, has as many more rows: its scores are one tall product, which the BLAS computes faster than a wide one."""
    q, k, mask = parts.q.detach(), parts.k.detach(), parts.mask
    B, H, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    G = H // Hkv  # query heads per key/value head: the heads of a block
    dtype = compute_dtype(q.dtype)
    q, k, _ = zero_dead(q, k, k, mask)  # padding and empty rows hold zeros (NaN there reaches nothing)
    if H == 0:
        return  # no heads, no weights
    # the keys scaled once, not every block's scores: a copy of k, G times smaller than one of q. The queries are
    # not copied whole (at 32k tokens q is 64 MiB a layer): _scores' reshape copies a block's rows of G > 1 heads,
    # and reads one head's in place, strided or not, as fast (measured); float16/bfloat16 ones are converted whole
    q = q.to(dtype)  # (B, H, Lq, D)
    w_v = None if parts.w_v is None else parts.w_v.detach().to(dtype)
    if w_v is None:
        k = k.to(dtype=dtype, memory_format=torch.contiguous_format, copy=True).mul_(parts.scale)  # (B, Hkv, Lk, D)
    else:
        k = k.to(dtype).contiguous()  # (B, Hkv, Lk, D)
    # an infinite input, or a product that overflows, makes scores of -inf: each hides its key as the mask does (a
    # row of them sees nothing, as in the reference), and what is left of them is clamped (weight 0, whose entropy
    # term would be -inf x 0). Looked for in each block where the inputs do not bound every score below half the range
    # (a bias stays within the other half); for additive scoring, where a sum is not finite (an overflow looks too)
    if w_v is None:
        clamp = not scores_bounded(q, k, 1.0, dtype)  # (k holds the scale already)
    else:
        clamp = not bool(torch.isfinite(q.sum()) & torch.isfinite(k.sum()) & torch.isfinite(w_v.abs().sum()))
    protected = None if parts.score_mod is None else mods.protected_storages(parts.score_mod)
    sinks = None if parts.sinks is None else mask.sink_logits(parts.sinks.detach().to(dtype))  # (B|1, H, Lq|1, 1)
    item = torch.finfo(dtype).bits // 8
    budget = max(1, block_bytes // item)  # elements of weights a block may hold
    longest = max((stop - start for start, stop in runs), default=0)
    # two buffers every block reuses: a large tensor allocated anew is paid again in page faults, block after block
    size = min(max(budget, B * G * Lk), B * G * longest * Lk)  # (at least one row: a block never has fewer)
    scores, weights = q.new_empty(size), q.new_empty(size)  # (size,) each: viewed as (B, G, n, m) a block
    chunks = ranges(0, Lk, CHUNK)  # (nc, 2)
    for start, stop in runs:
        for r0, r1, known, first, last in _row_blocks(mask, chunks, start, stop, max(1, budget // max(1, B * G))):
            a, b = int(chunks[first, 0]), int(chunks[last, 1])
            n, m = r1 - r0, b - a
            # the mask is built only over the chunks the ranges do not know to be seen whole (a causal block's
            # diagonal, a window's two edges), unless a bias or a score_mod covers them all
            partial = (~known.every[0, first : last + 1]).nonzero()[:, 0] + first  # hidden ones between included
            if mask.bias is not None or parts.score_mod is not None or clamp:
                p0, p1 = a, b
            elif len(partial):
                p0, p1 = int(chunks[int(partial[0]), 0]), int(chunks[int(partial[-1]), 1])
            else:
                p0 = p1 = a
            tile = mask.tile(r0, r1, p0, p1, dtype) if p1 > p0 else (None, None)  # (B|1, H|1, n|1, p) each
            score_mod = parts.score_mod
            idx = None if score_mod is None else mods.indices(B, H, (r0, r1), (a, b), q.device)
            for h0 in range(0, H, G) if heads is None else sorted({h // G * G for h in heads}):
                s = scores[: B * G * n * m].view(B, G, n, m)  # (B, G, n, m)
                _scores(q[:, h0 : h0 + G], k[:, h0 // G : h0 // G + 1], w_v, r0, r1, a, b, block_bytes, s)
                allowed, bias = (_heads(x, h0, G) for x in tile)  # (B|1, G|1, n|1, p) each
                if score_mod is not None and idx is not None:
                    b_idx, h_idx, q_idx, kv_idx = idx
                    s = mods.evaluate_score(  # (B, G, n, m)
                        score_mod, s, b_idx, h_idx[:, h0 : h0 + G], q_idx, kv_idx, protected=protected
                    )
                part = s[..., p0 - a : p1 - a]  # (B, G, n, p): a view
                if bias is not None:
                    part.add_(bias)
                if score_mod is not None or clamp:  # (then `part` is the whole block)
                    hidden = torch.isneginf(s)  # a score of -inf hides the key, as in the reference
                    if bool(hidden.any()):
                        allowed = ~hidden if allowed is None else allowed & ~hidden  # (B, G, n, m)
                if allowed is not None:
                    part.masked_fill_(~allowed, torch.finfo(dtype).min)  # exp() of it is 0 beside the row's largest
                live = _live(allowed, (p0, p1) == (a, b))
                sink = None if sinks is None else _heads(sinks[..., r0:r1, :] if sinks.shape[2] > 1 else sinks, h0, G)
                w = weights[: B * G * n * m].view(B, G, n, m)  # (B, G, n, m)
                found = _softmax(r0, r1, h0, a, s, w, live, sink, clamp)
                if clamp and allowed is not None:  # a row that NaN or +inf fills weighs 0 where it may not see
                    found.w.masked_fill_(~allowed if live is None else ~allowed & live, 0.0)  # (rows with no key:
                    # `keep` zeroes their results, and their weights stay a softmax's, which the entropy reads)
                if clamp and found.keep is not None:  # the sink's share of such a row is NaN: its weights carry
                    found = found._replace(keep=found.keep.nan_to_num(1.0))  # the NaN, 0 x 1 where it may not see
                yield found


def _row_blocks(
    mask: Mask, chunks: Tensor, start: int, stop: int, room: int
) -> Iterator[tuple[int, int, mods.Tiles, int, int]]:
    """The blocks of rows ``[r0, r1)`` of ``[start, stop)`` that see some key, as many rows each as fit ``room``
    (rows x keys of one head) over the keys they see, never fewer than one: a causal prompt's first rows see few keys
    and go many to a block. With what the mask's ranges say of them (``Mask.tiles``), and their first and last
    chunk seen."""
    r0, n = start, max(1, room // chunks.shape[0] // CHUNK)  # a first guess: rows that fit every key
    while r0 < stop:
        n, grown, fitted = min(n, stop - r0), 0, 0  # fitted: the most rows found to fit before growing
        while True:
            known = mask.tiles(torch.tensor([[r0, r0 + n]]), chunks)
            seen = known.some[0].nonzero()[:, 0]  # (chunks some row of the block may see,)
            keys = int(chunks[int(seen[-1]), 1] - chunks[int(seen[0]), 0]) if len(seen) else 0
            fits = max(1, room // max(keys, 1))
            if n > fits:
                n = max(fits, fitted)  # fewer rows see no more keys: this many fit (or as many as did)
            elif grown < 2 and 2 * n <= fits and r0 + n < stop:
                # half the room or less: more rows may fit (twice at most)
                fitted, n, grown = n, min(fits, stop - r0), grown + 1
            else:
                break
        if len(seen):
            yield r0, r0 + n, known, int(seen[0]), int(seen[-1])
        r0 += n
        n = max(1, room // (keys + n)) if keys else fits  # the next rows may see as many keys again as they are


def _heads(x: Tensor | None, h0: int, G: int) -> Tensor | None:
    """Heads ``[h0, h0 + G)`` of ``x`` broadcastable to ``(B, H, n, m)``: all of it where it has no head axis, or
    one to broadcast."""
    return x if x is None or x.dim() < 4 or x.shape[1] == 1 else x[:, h0 : h0 + G]


def _scores(q: Tensor, k: Tensor, w_v: Tensor | None, r0: int, r1: int, a: int, b: int, budget: int, out: Tensor):
    """Write the scores of queries ``[r0, r1)`` of ``q (B, G, Lq, D)`` (scaled already) against keys ``[a, b)`` of
    their one key/value head ``k (B, 1, Lk, D)``, before the score_mod, to ``out (B, G, n, m)``."""
    B, G, _, D = q.shape
    n, m = r1 - r0, b - a
    if w_v is None:  # the head's query heads as one matrix: one product
        qb = q[:, :, r0:r1].reshape(B, 1, G * n, D)  # (B, 1, G*n, D)
        torch.matmul(qb, k[:, :, a:b].transpose(-1, -2), out=out.view(B, 1, G * n, m))  # (B, 1, G*n, m)
        return
    step = max(1, budget // (B * G * n * D * q.element_size()))  # keys whose tanh features fit the budget
    for j0 in range(a, b, step):
        j1 = min(j0 + step, b)
        out[..., j0 - a : j1 - a] = additive_scores(q[:, :, r0:r1], k[:, :, j0:j1].expand(B, G, -1, -1), w_v)[0]


def _live(allowed: Tensor | None, whole: bool) -> Tensor | None:
    """Which rows see some key, ``(B|1, G|1, n|1, 1)``, or ``None`` when all do (``allowed`` covers the whole
    block, ``whole``, or some keys are seen by every row)."""
    if allowed is None or not whole:
        return None
    live = allowed.any(dim=-1, keepdim=True)  # (B|1, G|1, n|1, 1)
    return None if bool(live.all()) else live


def _softmax(
    r0: int,
    r1: int,
    h0: int,
    a: int,
    s: Tensor,
    w: Tensor,
    live: Tensor | None,
    sink: Tensor | None,
    clamp: bool = False,
) -> Block:
    """The block of masked scores ``s`` (hidden ones at ``finfo.min``), its softmax written to ``w``; ``clamp``:
    scores of -inf (from an infinite input) to ``finfo.min`` first, so that ``t`` stays finite."""
    m = s.shape[-1]
    whole = m // CHUNK
    maxima = s[..., : whole * CHUNK].unflatten(-1, (whole, CHUNK)).amax(dim=-1) if whole else None  # (B, G, n, c)
    largest = [x.amax(dim=-1, keepdim=True) for x in (maxima, s[..., whole * CHUNK :]) if x is not None and x.shape[-1]]
    top = largest[0] if len(largest) == 1 else torch.maximum(*largest)  # (B, G, n, 1): the row's largest score
    t = s.sub_(top)  # (B, G, n, m): 0 at the row's largest, so that its weights sum exactly and lose no digits
    if clamp:
        t.clamp_min_(torch.finfo(t.dtype).min)  # (NaN stays NaN)
    # PyTorch's fused kernel, into the reused buffer: a 4M-element block in 1.3 ms where exp() alone takes 2.5
    # (docs/benchmarks.md). torch.softmax has no out=; the private op's signature is checked against torch 2.13
    # (constraints.txt), and every statistics test fails if it moves.
    torch._softmax(t, -1, False, out=w)
    keep, lse = None, None
    if sink is not None:
        lse = w.amax(dim=-1, keepdim=True).log_().neg_()  # (B, G, n, 1): log sum_j exp t (the largest w: exp(-lse))
        keep = torch.sigmoid(top + lse - sink)  # (B, G, n, 1): the keys' share beside the sink's
    if live is not None:
        keep = live.to(w.dtype) if keep is None else keep * live
    return Block(r0, r1, h0, a, w, t, lse, True, keep, live, maxima)
