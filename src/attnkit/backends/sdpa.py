"""PyTorch's fused kernels: ``torch.nn.functional.scaled_dot_product_attention``.

Dot-product scoring only, never returns weights. The parts of the :class:`~attnkit.masks.Mask` become the one
``attn_mask`` SDPA takes (a causal mask alone with ``Lq == Lk`` becomes ``is_causal=True``, the fastest path): a
``mask_mod`` is evaluated into it when that mask is small enough (:data:`DENSE_MASK_ELEMENTS`), and a score_mod
that is a bias (:class:`attnkit.mods.alibi`) is added to it. No sinks, no other score_mod.
Rows with nothing to attend to are given every key inside the kernel and zeroed afterwards, so that no
version of PyTorch can turn them into NaN, and their gradients are exactly zero.

A decode step on CPU runs as two matrix products instead (:func:`_few_queries` says when: at most
:data:`FEW_QUERIES` queries per key/value head, float32 or float64, no dropout, nothing that needs a gradient,
and keys and values whose memory has the positions last, as a :class:`~attnkit.KVCache` of 4096 positions or more
stores them): from memory, the two products take 0.6x-1.0x the time of PyTorch's CPU kernel over the usual
layout at 4096-8192 positions (``python benchmarks/decode.py --only layout``). The scores are ``(B, H, Lq, Lk)``
with ``Lq`` a handful, linear in the context as the fused kernel; only the keys up to the longest example's last
live one are read; dead rows are zeroed as above.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit import mods
from attnkit.backends.common import repeat_kv, zero_dead
from attnkit.backends.contract import DOT, Call, Supports
from attnkit.masks import Mask, softmax_with_mask

NAME = "sdpa"

# B batch, H heads, Hkv key/value heads, Lq/Lk query/key length, D head dim, Dv value head dim

# Padded batches (1-D valid_lens alone, or with causal self-attention) run one call per run of equal lengths, on
# the real keys only, once that skips at least 1/8 of the key work: at L=2048 with lengths uniform in [L/4, L] this
# takes 0.6-0.7x the time of the same batch without padding, where one masked call takes 0.9x (`attnkit bench`).
GROUP_BELOW = 0.875
# ... and when the work it skips outweighs the extra calls: one SDPA call costs about as much as this many
# multiply-adds of attention (measured on 2 CPU cores: a decode step of B=8 rows over 400 cached keys, lengths
# in [200, 400], runs 2x faster as one masked call; over 4096 keys, 1.25x faster one call per row).
CALL_COST_MACS = 2**17

# A call of at most this many queries per key/value head (grouped-query heads count each) is a decode step: two
# matrix products over positions-last keys and values (see the module docstring; `python benchmarks/decode.py
# --only layout` times them against SDPA's kernel).
FEW_QUERIES = 16
# The dtypes it runs in (a cache stores positions last only for these: attnkit.cache.stored).
DECODE_DTYPES = (torch.float32, torch.float64)

# `enable_gqa` arrived in PyTorch 2.5; before it, key/value heads are repeated here.
_HAS_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


# The largest mask a mask_mod is evaluated into (16M elements: 64 MiB once SDPA takes it as float).
DENSE_MASK_ELEMENTS = 2**24

SUPPORTS = Supports(
    scoring=frozenset({DOT}), weights=False, dense_mask_limit=DENSE_MASK_ELEMENTS, score_mod="bias", sinks=False
)


def attention(call: Call) -> tuple[Tensor, Tensor | None]:
    q, k, v, mask, scale, dropout_p = call.q, call.k, call.v, call.mask, call.scale, call.dropout_p
    H, Hkv = q.shape[1], k.shape[1]
    Lq, Lk = mask.num_queries, mask.num_keys
    score_bias = None
    if call.score_mod is not None:
        assert isinstance(call.score_mod, mods.ScoreMod)  # SUPPORTS: a bias
        B, H = q.shape[:2]
        score_bias = call.score_mod.bias(*mods.indices(B, H, (0, Lq), (0, Lk), q.device))  # (B|1, H|1, Lq, Lk)
    if _few_queries(call, score_bias):
        return _decode_step(q, k, v, mask, scale, score_bias), None
    gqa: dict[str, Any] = {}
    if H != Hkv:
        if _HAS_GQA:
            gqa = {"enable_gqa": True}
        else:
            k, v = repeat_kv(k, H), repeat_kv(v, H)  # (B, H, Lk, D), (B, H, Lk, Dv)
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        # positions last (a cache's memory), many queries: the fused kernel reads that layout several times
        # slower than a copy (`python benchmarks/decode.py --only layout`, prefill row)
        k, v = k.contiguous(), v.contiguous()  # (B, Hkv, Lk, D), (B, Hkv, Lk, Dv)
    lengths = None if score_bias is not None else _key_lengths(mask)
    if lengths and _worth_grouping(lengths, Lk, Lq, H * (q.shape[-1] + v.shape[-1])):
        return _by_length(q, k, v, lengths, mask.is_causal, scale, dropout_p, gqa), None
    only_causal = (
        mask.is_causal
        and mask.valid_lens is None
        and mask.bool_mask is None
        and mask.bias is None
        and mask.mask_mod is None
    )
    if score_bias is None and (mask.is_empty or (only_causal and Lq == Lk)):
        out = F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout_p, is_causal=mask.is_causal, scale=scale, **gqa
        )  # (B, H, Lq, Dv)
        return out, None

    q, k, v = zero_dead(q, k, v, mask)
    allowed, bias = _allowed_and_bias(mask, q.dtype, score_bias)  # (B|1, H|1, Lq|1, Lk) each, or None
    _, live_rows = mask.liveness  # (B|1, H|1, Lq) or None when every row sees some key
    if bias is None:
        attn_mask = allowed
    elif allowed is None:
        attn_mask = bias
    else:
        attn_mask = bias.masked_fill(~allowed, float("-inf"))  # (B|1, H|1, Lq, Lk)
    if live_rows is not None:
        # Dead rows see every (zeroed) key with no bias inside the kernel, then are zeroed: no version of
        # PyTorch can turn them into NaN, and neither the mask nor the queries there reach any gradient.
        assert attn_mask is not None  # a dead row needs a part that hides keys
        dead = ~live_rows[..., None]  # (B|1, H|1, Lq, 1)
        attn_mask = attn_mask | dead if attn_mask.dtype == torch.bool else attn_mask.masked_fill(dead, 0.0)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale, **gqa
    )  # (B, H, Lq, Dv)
    if live_rows is not None:
        out = out.masked_fill(~live_rows[..., None], 0.0)
    return out, None


def _allowed_and_bias(mask: Mask, dtype: torch.dtype, score_bias: Tensor | None) -> tuple[Tensor | None, ...]:
    """The mask as ``allowed`` and a float ``bias`` (the mask's and a bias score_mod's, summed), each
    ``(B|1, H|1, Lq|1, Lk)`` or ``None``."""
    allowed, bias = mask.full(dtype)
    if score_bias is not None:
        score_bias = score_bias.to(dtype)
        bias = score_bias if bias is None else bias + score_bias  # (B|1, H|1, Lq, Lk)
    return allowed, bias


def _few_queries(call: Call, score_bias: Tensor | None) -> bool:
    """A decode step the two matrix products run (see the module docstring): nothing here needs a gradient, since
    the softmax runs in place."""
    q, k, v, bias = call.q, call.k, call.v, call.mask.bias
    return (
        q.device.type == "cpu"
        and q.dtype in DECODE_DTYPES
        and call.dropout_p == 0.0
        and not (
            torch.is_grad_enabled()
            and any(t is not None and t.requires_grad for t in (q, k, v, bias, score_bias, call.sinks))
        )
        and k.stride(2) == 1
        and v.stride(2) == 1
        and q.shape[1] // k.shape[1] * q.shape[2] <= FEW_QUERIES
    )


def _decode_step(q: Tensor, k: Tensor, v: Tensor, mask: Mask, scale: float, score_bias: Tensor | None) -> Tensor:
    """Attention for a few queries over positions-last keys and values: scores, the masked softmax, the output:
    ``q (B, H, Lq, D)``, ``k (B, Hkv, Lk, D)``, ``v (B, Hkv, Lk, Dv)``, ``score_bias (B|1, H|1, Lq, Lk)`` or
    ``None`` -> ``(B, H, Lq, Dv)``.

    A group of query heads shares one product with its key/value head, so that each is read once. When only
    ``valid_lens`` and ``is_causal`` hide keys, the keys past the longest example's live prefix (a static cache's
    unused storage) are not read."""
    B, H, Lq, D = q.shape
    Hkv, Dv = k.shape[1], v.shape[3]
    q, k, v = zero_dead(q, k, v, mask)
    allowed, bias = _allowed_and_bias(mask, q.dtype, score_bias)  # (B|1, H|1, Lq|1, Lk) each, or None
    # valid_lens: is_causal alone hides no key of a decode step's last query (bottom right)
    counts = None if mask.valid_lens is None else mask.live_key_counts  # (B|1, 1, 1) or None
    if counts is not None and counts.numel() and not torch.compiler.is_compiling():  # (compiled: static shapes)
        n = max(1, int(counts.max()))
        k, v = k[:, :, :n], v[:, :, :n]  # (B, Hkv, n, D), (B, Hkv, n, Dv)
        allowed = None if allowed is None else allowed[..., :n]  # (B|1, H|1, Lq|1, n)
        bias = None if bias is None else bias[..., :n]  # (B|1, H|1, Lq|1, n)
    Lk, rows = k.shape[2], H // Hkv * Lq
    grouped = (q * scale).reshape(B * Hkv, rows, D)  # (B*Hkv, G*Lq, D): head h = kv * G + g
    # bmm on (B*Hkv)-batched views, not matmul on 4-D ones: 0.1 ms less a step over 4096 positions
    scores = torch.bmm(grouped, k.transpose(2, 3).flatten(0, 1)).view(B, H, Lq, Lk)  # (B, H, Lq, Lk)
    _, live_rows = mask.liveness  # (B|1, H|1, Lq) or None when every row sees some key
    weights = softmax_with_mask(scores, allowed, bias, inplace=True, empty_rows=live_rows is not None)
    out = torch.bmm(weights.view(B * Hkv, rows, Lk), v.flatten(0, 1))  # (B*Hkv, G*Lq, Dv)
    out = out.view(B, H, Lq, Dv)  # (B, H, Lq, Dv)
    # dead rows are zeros whatever their keys and values hold, as in the fused path
    return out if live_rows is None else out.masked_fill(~live_rows[..., None], 0.0)


def _key_lengths(mask: Mask) -> list[int] | None:
    """Each example's number of keys, when 1-D ``valid_lens`` is the whole mask (or that and causal
    self-attention); ``None`` otherwise."""
    if (
        mask.valid_lens is None
        or mask.valid_lens.shape[2] != 1
        or mask.bool_mask is not None
        or mask.bias is not None
        or mask.mask_mod is not None
    ):
        return None
    if mask.is_causal and mask.num_queries != mask.num_keys:
        return None
    return mask.valid_lens.view(-1).tolist()


def _worth_grouping(lengths: list[int], Lk: int, Lq: int, macs_per_pair: int) -> bool:
    """Whether one call per run of equal lengths beats one masked call: it skips enough of the keys, and the
    multiply-adds it skips pay for the calls it adds."""
    skipped = len(lengths) * Lk - sum(lengths)
    if max(lengths) == 0 or skipped < (1 - GROUP_BELOW) * len(lengths) * Lk:
        return False
    calls = 1 + sum(a != b for a, b in zip(lengths, lengths[1:], strict=False))
    return skipped * Lq * macs_per_pair >= (calls - 1) * CALL_COST_MACS


def _by_length(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    lengths: list[int],
    causal: bool,
    scale: float,
    dropout_p: float,
    gqa: dict[str, Any],
) -> Tensor:
    """Attention over each example's real keys only, one call per run of equal lengths.

    With ``causal`` (self-attention, ``Lq == Lk``), query ``i < n`` sees keys ``j <= i`` (a causal ``n x n`` call)
    and every query ``i >= n`` sees all ``n`` keys (an unmasked call). Examples with no key give zeros.
    """
    H, Lq = q.shape[1], q.shape[2]
    # Runs of consecutive examples of equal length, in batch order: the backward pass of `split` is one
    # concatenation, where slicing or gathering examples costs a full-size zeroed gradient each (profiled:
    # sorting the batch by length spent 20% of the time at L=2048 in index_select, scatter_add and fill).
    runs: list[list[int]] = []
    for n in lengths:
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    sizes = [count for _, count in runs]
    parts = []
    for (n, count), qg, kg, vg in zip(runs, q.split(sizes), k.split(sizes), v.split(sizes), strict=True):
        kg, vg = kg[:, :, :n], vg[:, :, :n]  # (b, Hkv, n, D), (b, Hkv, n, Dv): the real keys only
        if n == 0:
            part = qg.new_zeros(count, H, Lq, vg.shape[-1])  # (b, H, Lq, Dv): nothing to attend to
        elif causal and n < Lq:
            first = F.scaled_dot_product_attention(
                qg[:, :, :n], kg, vg, dropout_p=dropout_p, is_causal=True, scale=scale, **gqa
            )  # (b, H, n, Dv)
            rest = F.scaled_dot_product_attention(
                qg[:, :, n:], kg, vg, dropout_p=dropout_p, scale=scale, **gqa
            )  # (b, H, Lq - n, Dv)
            part = torch.cat([first, rest], dim=2)  # (b, H, Lq, Dv)
        else:
            part = F.scaled_dot_product_attention(
                qg, kg, vg, dropout_p=dropout_p, is_causal=causal, scale=scale, **gqa
            )  # (b, H, Lq, Dv)
        parts.append(part)
    return parts[0] if len(parts) == 1 else torch.cat(parts)  # (B, H, Lq, Dv)
