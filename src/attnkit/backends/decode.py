"""The decode step on CPU: a few queries over a :class:`~attnkit.KVCache`'s keys and values, as two matrix products.

A decode step reads the whole cache for a handful of queries, so its time is the time to read the cache. The
caches store long contexts with the positions as the last dimension in memory (:func:`storage`), which two
batched products (``q @ k^T``, then ``weights @ v``) stream on both cores: from memory, 0.6x-1.0x the time of
PyTorch's SDPA kernel over the usual layout at 4096-8192 positions (``python benchmarks/decode.py --only
layout``). The scores are ``(B, H, Lq, Lk)`` with ``Lq`` a handful, linear in the context as the fused kernel.

What it runs (``SUPPORTS``): dot-product scoring, at most ``FEW_QUERIES`` queries per key/value head
(grouped query heads share one product with their key/value head, so that each is read once), float32 or float64,
nothing that needs a gradient (the softmax runs in place), no dropout, no sinks, a score_mod only when it is a
bias (ALiBi). Dispatch prefers it for keys and values stored positions last (:mod:`attnkit.dispatch`).

When only ``valid_lens`` and ``is_causal`` hide keys, the keys past the longest example's live prefix (a static
cache's unused storage) are not read. Rows with no key to attend to give zeros, as on every backend.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from attnkit.backends import sdpa
from attnkit.backends.common import dense_mask, zero_dead
from attnkit.backends.contract import Call
from attnkit.masks import softmax_with_mask

NAME = "decode"

# B batch, H heads, Hkv key/value heads, G = H / Hkv, Lq/Lk query/key length, D head dim, Dv value head dim,
# C capacity (positions a cache stores per row)

# A call of at most this many queries per key/value head (grouped-query heads count each) is a decode step.
FEW_QUERIES = 16

# The dtypes it runs in (a cache stores positions last only for these: storage()).
DTYPES = frozenset({torch.float32, torch.float64})

# Caches of a capacity of at least this many positions per row are stored positions last on CPU, in DTYPES.
# `python benchmarks/decode.py --only layout` times one decode step's attention over keys and values from memory
# both ways: the two products over positions-last rows win from about 4096 positions at B=1 and lose at 512-2048
# (short rows cost more in per-head calls than they save in reading).
POSITIONS_LAST_FROM = 4096

# What sdpa runs, for a decode step only: it masks by filling (so a hidden score may overflow), in place
SUPPORTS = dataclasses.replace(
    sdpa.SUPPORTS,
    dropout=False,
    bias_grad=False,
    huge_scores=True,
    devices=frozenset({"cpu"}),
    dtypes=DTYPES,
    grad=False,
    max_queries=FEW_QUERIES,
)


def attention(call: Call) -> tuple[Tensor, Tensor | None]:
    """The output ``(B, H, Lq, Dv)`` of ``q (B, H, Lq, D)`` over ``k (B, Hkv, Lk, D)``, ``v (B, Hkv, Lk, Dv)``."""
    q, k, v, mask = call.q, call.k, call.v, call.mask
    B, H, Lq, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[3]
    q, k, v = zero_dead(q, k, v, mask, call.zeros_past)
    allowed, bias = dense_mask(call, q.dtype)  # (B|1, H|1, Lq|1, Lk) each, or None
    # valid_lens: is_causal alone hides no key of a decode step's last query (bottom right)
    counts = None if mask.valid_lens is None else mask.live_key_counts  # (B|1, 1, 1) or None
    if counts is not None and counts.numel() and not torch.compiler.is_compiling():  # (compiled: static shapes)
        n = max(1, int(counts.max()))
        k, v = k[:, :, :n], v[:, :, :n]  # (B, Hkv, n, D), (B, Hkv, n, Dv)
        allowed = None if allowed is None else allowed[..., :n]  # (B|1, H|1, Lq|1, n)
        bias = None if bias is None else bias[..., :n]  # (B|1, H|1, Lq|1, n)
    Lk, rows = k.shape[2], H // Hkv * Lq
    grouped = (q * call.scale).reshape(B * Hkv, rows, D)  # (B*Hkv, G*Lq, D): head h = kv * G + g
    # bmm on (B*Hkv)-batched views, not matmul on 4-D ones: 0.1 ms less a step over 4096 positions
    scores = torch.bmm(grouped, k.transpose(2, 3).flatten(0, 1)).view(B, H, Lq, Lk)  # (B, H, Lq, Lk)
    _, live_rows = mask.liveness  # (B|1, H|1, Lq) or None when every row sees some key
    weights = softmax_with_mask(scores, allowed, bias, inplace=True, empty_rows=live_rows is not None)
    out = torch.bmm(weights.view(B * Hkv, rows, Lk), v.flatten(0, 1))  # (B*Hkv, G*Lq, Dv)
    out = out.view(B, H, Lq, Dv)  # (B, H, Lq, Dv)
    # dead rows are zeros whatever their keys and values hold, as in the fused path
    return (out if live_rows is None else out.masked_fill(~live_rows[..., None], 0.0)), None


def positions_last(x: Tensor, capacity: int | None = None) -> Tensor:
    """A copy of ``x (B, Hkv, L, D)`` (zeros past ``L`` up to ``capacity`` positions), the same shape, whose memory
    is ``(B, Hkv, D, C)``: the positions are the last, contiguous dimension, the layout this backend reads."""
    B, Hkv, L, D = x.shape
    C = L if capacity is None else capacity
    rest = x.new_zeros((B, Hkv, D, C - L))  # (B, Hkv, D, C - L)
    # one new tensor (no copy into a view of zeros: an in-place write into it, through autograd, would then fail)
    return torch.cat([x.transpose(2, 3), rest], dim=3).transpose(2, 3)  # (B, Hkv, C, D) over (B, Hkv, D, C)


def is_positions_last(k: Tensor, v: Tensor) -> bool:
    """Whether keys and values ``(B, Hkv, L, D)`` are stored positions last (as :func:`storage` stores them)."""
    return k.stride(2) == 1 and v.stride(2) == 1


def storage(x: Tensor, capacity: int | None = None) -> Tensor:
    """``x (B, Hkv, L, D)`` as a cache should store it (zeros past ``L`` up to ``capacity``), a copy: positions last
    on CPU in ``DTYPES`` from a capacity of ``POSITIONS_LAST_FROM`` positions, which this backend reads
    fastest; otherwise the ``(B, Hkv, C, D)`` memory that PyTorch's fused kernels read (on CUDA they have their own
    decoding kernels), where ``x`` itself is returned when nothing is added."""
    B, Hkv, L, D = x.shape
    C = L if capacity is None else capacity
    if x.device.type in SUPPORTS.devices and x.dtype in DTYPES and C >= POSITIONS_LAST_FROM:  # type: ignore[operator]
        return positions_last(x, C)
    if C == L:
        return x  # the layout as it is: nothing to add (a CrossKVCache's projections, kept without a copy)
    return torch.cat([x, x.new_zeros((B, Hkv, C - L, D))], dim=2)  # (B, Hkv, C, D)
