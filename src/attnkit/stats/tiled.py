"""The statistics of a call whose rows' log-sum-exp the forward gave (:mod:`attnkit.stats`): each weight is then
``exp(score - lse)`` on its own, so the scores are taken a tile of keys at a time, each tile reduced while it is in
cache. In float32 a C++ kernel reduces each tile (:mod:`attnkit.stats.kernel`, ``tile.cpp``): each row's weights,
sums, column sums and top-k so far while the row is in cache. Otherwise torch ops do the same, and the top-k search
reads the kept weights again, a few chunks a row.

Why a second path: without ``lse`` a row's softmax needs the whole row first, and at 32k tokens a block of whole
rows is 128 rows x 32,768 keys, a product the BLAS computes at ~100 GFLOPS on this machine; a tile of 512 rows x
1,024 keys in a buffer that stays in cache runs at ~170 (``docs/benchmarks.md``). PyTorch's fused CPU kernel
returns ``lse`` with the output (:func:`attnkit.backends.sdpa.attention_with_lse`), so the forward pays nothing.

Taken for the calls that kernel runs: dot-product scoring without a mask or with a causal one (``Lq == Lk``), no
score_mod, no sinks, the default positions, float32 or float64 (:func:`supports`). ``lse`` is the kernel's, rounded
in its own order: each row's weights sum to 1 within a few units in the last place of the scores' size, and its
top-k, entropy, sink weight and mean distance are those of its weights over the row's own sum (the softmax of this
pass's scores, as near float64 as a float32 softmax); the column sums add the weights as they are (each row's
share off by at most ``MASS_TOLERANCE``, about 1e-5 in float32). Where some row's sum is further from 1 than
``MASS_TOLERANCE`` (scores of ~1e30, or NaN), the whole-row path takes the call instead.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from attnkit.stats import kernel
from attnkit.stats.blocks import CHUNK, Parts
from attnkit.stats.reduce import Sums, chunk_topk, windows

__all__ = ["KEPT_BYTES", "MASS_TOLERANCE", "MIN_KEYS", "ROWS", "TILE", "compute", "fused", "supports"]

# B batch, H heads, Hkv key/value heads, G = H // Hkv, Lq/Lk query/key length, D head dim, n rows of each head in a
# tile, r = G * n rows of a tile, w keys of a tile, c chunks of CHUNK keys, k the top-k

# Keys a tile, and rows a tile (a key/value head's query heads' rows, as one product): 2 MiB of float32 scores,
# each core's half in its own cache.
TILE = 1024
ROWS = 512
# The weights a row block keeps for its top-k search, at most (never less than one tile): 512 rows x 32,768 keys
# of float32. Longer rows keep theirs a group of tiles at a time, and each group's k best chunks join the best so
# far; at 16 MiB (4 groups at 32k) those merges cost ~13% of the pass (measured), hence the larger budget.
KEPT_BYTES = 64 * 2**20
# Without the tile kernel (float64, or where it cannot be built), rows of fewer keys take the whole-row path
# (attnkit.stats.compute's policy): whole rows of 16,384 keys or fewer make tall enough products, and its fused
# softmax is faster than exp() here; at 16k the two tie, at 32k tiles run ~20% faster, below 8k 0-20% slower
# (docs/benchmarks.md). The kernel's tiles run 2-3.5x faster than whole rows from 1,024 keys up: it takes all.
MIN_KEYS = 16384
# How far from 1 a row's weights may sum (the kernel's log-sum-exp against this pass's scores, each rounded in its
# own order: ~1e-6 in float32 for scores of tens); past it the call takes the whole-row path.
MASS_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-12}
# exp() of log(tiny) or less (a subnormal or 0) takes PyTorch's slow path on the CPU (10-35x, measured), and so
# does log(tiny) itself; one above it does not. A tile's scores below this under the row's log-sum-exp (hidden keys'
# -inf, weights below 3.2e-38 in float32) are clamped to it, and the weights that are not 0 taken one by one.
_LOWEST = {dtype: math.log(torch.finfo(dtype).tiny) + 1.0 for dtype in (torch.float32, torch.float64)}


def supports(parts: Parts) -> bool:
    """Whether this path computes ``parts``' statistics (see the module docstring)."""
    q, k, mask, lse = parts.q, parts.k, parts.mask, parts.lse
    if lse is None or parts.w_v is not None or parts.score_mod is not None or parts.sinks is not None:
        return False
    if parts.query_positions is not None or parts.key_positions is not None:
        return False
    B, H, Lq, _ = q.shape
    return (
        (mask.is_empty or mask.is_plain_causal)
        and q.dtype in (torch.float32, torch.float64)
        and k.dtype == q.dtype
        and lse.dtype == q.dtype
        and tuple(lse.shape) == (B, H, Lq)
        and Lq > 0
        and k.shape[2] > 0
        and bool(torch.isfinite(lse).all())  # (a row of -inf sees no key: exp(score - lse) would be NaN there)
    )


def fused(parts: Parts) -> bool:
    """Whether the tile kernel (:mod:`attnkit.stats.kernel`) takes ``parts``' tiles: float32 on the CPU, where it
    runs."""
    return parts.q.dtype == torch.float32 and parts.q.device.type == "cpu" and kernel.available()


def compute(parts: Parts, sums: Sums, sink_keys: int) -> bool:
    """Fill ``sums`` with the statistics of ``parts`` (which :func:`supports`), a tile at a time. False, and
    ``sums`` to be thrown away, where some row's weights do not sum to 1 within ``MASS_TOLERANCE``: scores so
    large that this pass's rounding and the kernel's part ways, or NaN (the whole-row path, whose rows sum to 1 by
    construction, then takes the call)."""
    if fused(parts):
        try:
            return _compute(parts, sums, sink_keys, True)
        except RuntimeError as error:  # the kernel, built, fails to run here: said once, then torch ops
            kernel.failed(error)
            sums.clear()
    return _compute(parts, sums, sink_keys, False)


def _compute(parts: Parts, sums: Sums, sink_keys: int, by_kernel: bool) -> bool:
    """:func:`compute`, each tile by the kernel or by torch ops."""
    assert parts.lse is not None
    q, lse = parts.q.detach(), parts.lse.detach()
    B, H, Lq, D = q.shape
    Hkv, Lk = parts.k.shape[1], parts.k.shape[2]
    G = H // Hkv
    causal = parts.mask.is_causal
    k = parts.k.detach().to(memory_format=torch.contiguous_format, copy=True).mul_(parts.scale)  # (B, Hkv, Lk, D)
    n = min(max(1, ROWS // G), Lq)
    width = min(TILE, -(-Lk // CHUNK) * CHUNK)  # keys of every tile but a row block's last
    # tiles whose weights are kept at once: the top-k search reads them, then the next ones take their place (the
    # kernel keeps each row's top-k as it goes, and no weights)
    group = 0 if by_kernel else min(max(1, KEPT_BYTES // (G * n * width * q.element_size())), -(-Lk // width))
    # reused buffers: one tile's scores, and the weights of a row block's last tiles, tile after tile
    scores = q.new_empty(G * n * width)  # (r * w,)
    store = q.new_empty(G * n * group * width)  # (group * r * w,)
    maxima = q.new_empty(G * n * group * width // CHUNK)  # (r * c,)
    for b in range(B):
        for h in range(Hkv):
            heads = slice(h * G, (h + 1) * G)
            for r0 in range(0, Lq, n):
                r1 = min(r0 + n, Lq)
                seen = min(Lk, r1 + Lk - Lq) if causal else Lk  # the keys some row of the block sees
                block = _Block(q[b, heads], k[b, h], lse[b, heads], b, heads, r0, r1, seen, causal, sink_keys)
                if by_kernel:
                    done = _fused_rows(block, sums, scores, width)
                else:
                    done = _rows(block, sums, (scores, store, maxima), width, group)
                if not done:
                    return False
    return True


class _Block(NamedTuple):
    """The rows ``[r0, r1)`` of the query heads ``heads`` of example ``b``: ``q (G, Lq, D)``, their key/value head's
    keys ``k (Lk, D)`` (scaled), ``lse (G, Lq)``, over the keys ``[0, seen)`` (:func:`compute`)."""

    q: Tensor
    k: Tensor
    lse: Tensor
    b: int
    heads: slice
    r0: int
    r1: int
    seen: int
    causal: bool
    sink_keys: int

    def operands(self) -> tuple[Tensor, Tensor, Tensor]:
        """Its ``r = G * n`` rows, head after head: their queries ``(r, D)``, ``-lse`` ``(r,)`` and positions
        ``i + Lk - Lq`` ``(r,)``."""
        G, Lq, D = self.q.shape
        Lk = self.k.shape[0]
        rows = G * (self.r1 - self.r0)
        qb = self.q[:, self.r0 : self.r1].reshape(rows, D)  # (r, D)
        shift = self.lse[:, self.r0 : self.r1].reshape(rows).neg()  # (r,)
        qpos = torch.arange(self.r0 + Lk - Lq, self.r1 + Lk - Lq, device=self.q.device).repeat(G)  # (r,)
        return qb, shift, qpos


def _fused_rows(block: _Block, sums: Sums, scores: Tensor, width: int) -> bool:
    """:func:`_rows` with each tile reduced by the kernel (``tile.cpp``), which keeps each row's top-k as it goes, in
    a heap on the score."""
    q, k, _, b, heads, r0, r1, seen, causal, sink_keys = block
    n = r1 - r0
    rows = q.shape[0] * n
    device = k.device
    qb, shift, qpos = block.operands()  # (r, D), (r,), (r,)
    found = torch.zeros(4, rows, dtype=torch.float64, device=device)  # (4, r): see _rows
    topk = sums.values.shape[-1]
    top = (  # each row's top-k so far, a heap on the score (tile.cpp)
        torch.full((rows, topk), float("-inf"), device=device),  # (r, k): scores
        torch.zeros(rows, topk, device=device),  # (r, k): weights
        torch.full((rows, topk), -1, dtype=torch.long, device=device),  # (r, k): keys
    )
    for a in range(0, seen, width):
        real = min(width, seen - a)  # keys of the tile some row sees
        t = scores[: rows * real].view(rows, real)  # (r, real)
        torch.mm(qb, k[a : a + real].T, out=t)  # (r, real)
        kernel.tile(t, shift, qpos, a, real, causal, sink_keys, n, found, sums.column[b, heads, a : a + real], top)
    order = top[0].sort(dim=-1, descending=True).indices  # (r, k): the heaps' keys, largest first
    values, indices = top[1].gather(-1, order), top[2].gather(-1, order)  # (r, k) each
    return _store(sums, b, heads, r0, r1, found.float(), values, indices)


def _store(sums: Sums, b: int, heads: slice, r0: int, r1: int, found: Tensor, values: Tensor, indices: Tensor) -> bool:
    """Store the rows ``[r0, r1)`` of ``heads`` of example ``b``: their sums ``found (4, r)`` (see :func:`_rows`),
    top-k ``values`` and keys ``indices (r, k)``, descending; False, storing nothing, where some row's weights do
    not sum to 1 within ``MASS_TOLERANCE`` or its entropy is not finite (NaN)."""
    entropy, mass, sink, distance = found  # (r,) each
    if not bool(((mass - 1).abs() <= MASS_TOLERANCE[found.dtype]).all() and torch.isfinite(entropy).all()):
        return False
    n = r1 - r0
    G = mass.shape[0] // n
    # Each row's weights over its own sum: the weights are exp(score - lse) with this pass's scores and the kernel's
    # lse, each rounded in its own order (5-7x a float32 softmax's error on the largest weights, D = 96); over the
    # row's sum they are the softmax of this pass's scores. Entropy of w / m: -sum(w log w) / m + log m.
    sums.entropy[b, heads, r0:r1] = (mass.log() - entropy / mass).view(G, n)
    sums.distance[b, heads, r0:r1] = (distance / mass).view(G, n)  # its definition's division
    sums.sink[b, heads, r0:r1] = (sink / mass).view(G, n)
    sums.values[b, heads, r0:r1] = (values / mass[:, None].to(values.dtype)).view(G, n, -1)
    sums.indices[b, heads, r0:r1] = torch.where(values > 0, indices, -1).view(G, n, -1)
    return True


def _rows(block: _Block, sums: Sums, buffers: tuple[Tensor, Tensor, Tensor], width: int, group: int) -> bool:
    """The statistics of ``block`` into ``sums``, ``width`` keys a tile and ``group`` tiles' weights kept at once;
    False where its rows' weights do not sum to 1 (:func:`compute`)."""
    q, k, _, b, heads, r0, r1, seen, causal, sink_keys = block
    G, Lq, _ = q.shape
    Lk = k.shape[0]
    n = r1 - r0
    rows = G * n
    dtype, device = q.dtype, q.device
    scores, store, maxima = buffers
    maxima = maxima[: rows * group * width // CHUNK].view(rows, -1)  # (r, c): the kept tiles' chunks
    qb, shift, qpos = block.operands()  # (r, D), (r,), (r,)
    lowest = r0 + Lk - Lq  # the rows' positions: i + Lk - Lq
    # per row: sum_j w log w, sum_j w (1 within MASS_TOLERANCE), the sink's weight, sum_j w |pos(i) - j|
    found = torch.zeros(4, rows, dtype=dtype, device=device)  # (4, r)
    ones = torch.ones(G, 1, n, dtype=dtype, device=device)  # (G, 1, n)
    offsets: list[int] = []  # where each kept tile starts in store
    widths: list[int] = []  # its keys
    first = 0  # the first key of the kept tiles
    kept: _Chunks | None = None  # the chunks of the tiles before them that may hold the k largest
    topk = sums.values.shape[-1]
    for a in range(0, seen, width):
        if len(offsets) == group:  # the store is full: the k largest of its tiles, beside those before
            kept = _keep(kept, store, maxima[:, : sum(widths) // CHUNK], offsets, widths, first, topk)
            offsets, widths, first = [], [], a
        wide = min(width, -(-(seen - a) // CHUNK) * CHUNK)  # a multiple of CHUNK, past the last key at most
        real = min(wide, Lk - a)  # keys that exist (the rest pad the last chunk)
        offsets.append(len(offsets) * rows * width)
        widths.append(wide)
        t = scores[: rows * wide].view(rows, wide)  # (r, w)
        if real == wide:
            torch.mm(qb, k[a : a + wide].T, out=t)  # (r, w)
        else:
            t[:, :real] = qb @ k[a : a + real].T  # (r, real)
        c0 = (a - first) // CHUNK
        w = store[offsets[-1] : offsets[-1] + rows * wide].view(rows, wide)  # (r, w)
        _reduce(t, w, maxima[:, c0 : c0 + wide // CHUNK], found, shift, qpos, lowest, a, real, causal, sink_keys, n)
        column = torch.bmm(ones, w.view(G, n, wide))[:, 0, :real]  # (G, real): a product reads w faster than a sum
        sums.column[b, heads, a : a + real] += column
    kept = _keep(kept, store, maxima[:, : sum(widths) // CHUNK], offsets, widths, first, topk)
    values, indices = _topk(kept, topk)  # (r, k) each
    return _store(sums, b, heads, r0, r1, found, values, indices)


def _reduce(
    t: Tensor,
    w: Tensor,
    maxima: Tensor,
    found: Tensor,
    shift: Tensor,
    qpos: Tensor,
    lowest: int,
    a: int,
    real: int,
    causal: bool,
    sink_keys: int,
    n: int,
) -> None:
    """One tile as torch ops: ``t (r, w)`` the scores of keys ``[a, a + w)``, of which ``[a, a + real)`` exist, for
    rows at ``qpos (r,)`` (``n`` of each head, from ``lowest``); write the weights to ``w (r, w)`` and each chunk's
    largest score to ``maxima (r, w / CHUNK)`` (for :func:`_keep`), and add each row's sums to ``found (4, r)``
    (``tile.cpp`` adds the same sums, reading each row once, and keeps no weights)."""
    rows, wide = t.shape
    dtype, device = t.dtype, t.device
    highest = lowest + n - 1
    reach = max(n, CHUNK)  # keys nearer than this to some row have their distances taken key by key
    if real < wide:
        t[:, real:] = float("-inf")
    kpos = torch.arange(a, a + wide, device=device)  # (w,)
    diagonal = causal and a + wide - 1 > lowest  # some key past some row's position
    if diagonal:
        t.masked_fill_(kpos[None, :] > qpos[:, None], float("-inf"))  # (r, w)
    hides = diagonal or real < wide  # some key hidden, or past the last one
    torch.amax(t.view(rows, wide // CHUNK, CHUNK), dim=-1, out=maxima)
    t.add_(shift[:, None])  # (r, w): log w
    low = _LOWEST[dtype]  # exp() at or below log(tiny) takes PyTorch's slow path: not on a whole tile
    if hides or float(t.amin()) < low:
        under = t < low  # (r, w): hidden keys (-inf) and weights near or past the smallest normal number
        tiny = under & (t > float("-inf"))  # (r, w): of those, the weights that are subnormal or round to 0
        exact = t[tiny] if bool(tiny.any()) else None  # (u,): their exp() alone on the slow path
        torch.exp(t.clamp_min_(low), out=w)
        w.masked_fill_(under, 0.0)  # (t stays finite there: their terms are 0 x t)
        if exact is not None:
            w[tiny], t[tiny] = exact.exp(), exact
    else:
        torch.exp(t, out=w)
    entropy, mass, sink, distance = found  # (r,) each: views
    entropy += torch.linalg.vecdot(w, t)  # (r,)
    row_mass = w.sum(dim=-1)  # (r,)
    mass += row_mass
    if a < sink_keys:
        sink += w[:, : sink_keys - a].sum(dim=-1)  # (r,)
    if a + wide > lowest - reach and a <= highest + reach:  # near some row: key by key, exactly
        distance += torch.linalg.vecdot(w, (qpos[:, None] - kpos[None, :]).abs_().to(dtype))  # (r,)
    else:  # one product with the keys' positions from the lowest row's: its rounding is small beside reach
        moment = w @ (kpos - lowest).to(dtype)  # (r,)
        far = (qpos - lowest).to(dtype) * row_mass - moment  # (r,): the keys before every row
        distance += far if a < lowest else far.neg_()


class _Chunks(NamedTuple):
    """The chunks of a row block that may hold each row's k largest weights, of the tiles seen so far: their
    weights ``values (r, j, CHUNK)``, largest scores ``maxima (r, j)`` and numbers ``ids (r, j)`` (key ``ids *
    CHUNK`` first), ``j <= k``: the k chunks of largest maxima hold the k largest weights (``_topk`` in
    :mod:`attnkit.stats.reduce`), and so do the k of largest maxima among those kept and a new tile's."""

    values: Tensor
    maxima: Tensor
    ids: Tensor


def _keep(
    kept: _Chunks | None, store: Tensor, maxima: Tensor, offsets: list[int], widths: list[int], first: int, k: int
) -> _Chunks:
    """``kept`` and the kept tiles in ``store`` (tile ``i`` at ``offsets[i]``, ``(r, widths[i])``, the first of
    them at key ``first``; ``maxima (r, c)`` each of their chunks' largest score), narrowed to the k chunks of
    largest maxima."""
    rows, c = maxima.shape
    chosen = maxima.topk(min(k, c), dim=-1, sorted=False).indices  # (r, j): chunks of the kept tiles
    per_tile = widths[0] // CHUNK
    tile = chosen // per_tile  # (r, j)
    starts_of = torch.tensor(offsets, device=store.device)[tile]  # (r, j)
    width_of = torch.tensor(widths, device=store.device)[tile]  # (r, j)
    row = torch.arange(rows, device=store.device).view(rows, 1)  # (r, 1)
    starts = starts_of + row * width_of + chosen % per_tile * CHUNK  # (r, j): where each chosen chunk starts
    values = windows(store, starts, CHUNK, 1)  # (r, j, CHUNK)
    found = _Chunks(values, maxima.gather(-1, chosen), chosen + first // CHUNK)  # (r, j, CHUNK), (r, j), (r, j)
    if kept is None:
        return found
    both = _Chunks(*(torch.cat(pair, dim=1) for pair in zip(kept, found, strict=True)))  # (r, j', ...) each
    if both.ids.shape[1] <= k:
        return both
    chosen = both.maxima.topk(k, dim=-1, sorted=False).indices  # (r, k)
    j = both.ids.shape[1]
    starts = torch.arange(0, rows * j * CHUNK, j * CHUNK, device=store.device).view(rows, 1) + chosen * CHUNK
    values = windows(both.values, starts, CHUNK, 1)  # (r, k, CHUNK)
    return _Chunks(values, both.maxima.gather(-1, chosen), both.ids.gather(-1, chosen))  # (r, k, ...) each


def _topk(kept: _Chunks, k: int) -> tuple[Tensor, Tensor]:
    """The ``k`` largest weights of each row in the chunks ``kept``, descending, and their keys (0 and -1 past a
    row's chunks)."""
    rows, j, _ = kept.values.shape
    if j == k:  # as many chunks as values wanted: narrowed further by strided groups (reduce.chunk_topk)
        starts = torch.arange(0, rows * j * CHUNK, CHUNK, device=kept.ids.device).view(rows, j)  # (r, k)
        return chunk_topk(kept.values, kept.ids, starts, k)  # (r, k) each
    flat = kept.values.reshape(rows, j * CHUNK)  # (r, j*CHUNK): fewer chunks than k, every value a candidate
    top = flat.topk(min(k, j * CHUNK), dim=-1)  # (r, <=k) each
    indices = kept.ids.gather(-1, top.indices // CHUNK) * CHUNK + top.indices % CHUNK  # (r, <=k)
    pad = k - top.values.shape[1]
    values = torch.nn.functional.pad(top.values, (0, pad))  # (r, k)
    return values, torch.nn.functional.pad(indices, (0, pad), value=-1)  # (r, k) each
