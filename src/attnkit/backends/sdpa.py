"""PyTorch's fused kernels: ``torch.nn.functional.scaled_dot_product_attention``.

Dot-product scoring only, never returns weights. The parts of the :class:`~attnkit.masks.Mask` become the one
``attn_mask`` SDPA takes (a causal mask alone with ``Lq == Lk`` becomes ``is_causal=True``, the fastest path): a
``mask_mod`` is evaluated into it when that mask is small enough (``DENSE_MASK_ELEMENTS``), and a score_mod
that is a bias (:class:`attnkit.mods.alibi`) is added to it. No sinks, no other score_mod.
Rows with nothing to attend to are given every key inside the kernel and zeroed afterwards, so that no
version of PyTorch can turn them into NaN, and their gradients are exactly zero.

A decode step over a :class:`~attnkit.KVCache`'s positions-last memory has a backend of its own
(:mod:`attnkit.backends.decode`); given that memory with many queries, SDPA runs on a contiguous copy.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit.backends.common import dense_mask, repeat_kv, zero_dead
from attnkit.backends.contract import DOT, Call, Supports
from attnkit.masks import Mask

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

# `enable_gqa` arrived in PyTorch 2.5; before it, key/value heads are repeated here.
_HAS_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


# The largest mask a mask_mod is evaluated into (16M elements: 64 MiB once SDPA takes it as float).
DENSE_MASK_ELEMENTS = 2**24

SUPPORTS = Supports(
    scoring=frozenset({DOT}),
    weights=False,
    dense_mask_limit=DENSE_MASK_ELEMENTS,
    score_mod="bias",
    sinks=False,
    huge_scores=False,  # the kernels add the mask: a hidden score at +inf gives NaN (finite but huge content)
)


def attention_with_lse(call: Call) -> tuple[Tensor, Tensor] | None:
    """The output and each row's log-sum-exp of its scaled scores, ``(B, H, Lq)`` in float32 (float64 for
    float64), from PyTorch's fused CPU kernel, which computes both anyway: for a call this backend runs through that
    kernel without a mask (none, or causal with ``Lq == Lk``), on the CPU, in float32 or float64, without dropout
    or gradients; ``None`` for any other (:func:`attnkit.stats.compute` then takes the row sums itself). The kernel
    is the one ``scaled_dot_product_attention`` runs for these calls, so the output is the same (called directly, it
    does not consult ``torch.nn.attention.sdpa_kernel``'s choice: under ``record_stats`` only)."""
    q, k, v, mask = call.q, call.k, call.v, call.mask
    if not (mask.is_empty or mask.is_plain_causal) or call.score_mod is not None or call.dropout_p or call.needs_grad:
        return None
    if q.device.type != "cpu" or q.dtype not in (torch.float32, torch.float64) or not q.numel() or not k.numel():
        return None
    if q.shape[-1] != v.shape[-1] or not _HAS_GQA:  # the kernel takes one head size; GQA as SDPA's
        return None
    if q.stride(-1) != 1:  # SDPA takes another kernel for such queries (5e-7 apart): the output would change
        return None
    # the kernel reads each row of k and v as contiguous (a positions-last cache's keys would give a wrong output,
    # not an error); attention() copies them so too
    k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (k, v))  # (B, Hkv, Lk, D|Dv) each
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    out, lse = flash(q, k, v, 0.0, mask.is_causal, scale=call.scale)[:2]
    return out, lse  # (B, H, Lq, Dv), (B, H, Lq)


def attention(call: Call) -> tuple[Tensor, Tensor | None]:
    out, _ = _attention(call)  # (B, H, Lq, Dv)
    if call.q.device.type != "cpu":
        return out, None
    # PyTorch's CPU kernel gives zeros to a query row that holds NaN (its largest score, NaN, reads as a row with no
    # key); the reference and the math give NaN, which says where the input went wrong. One read of the queries.
    nan_rows = call.q.detach().sum(dim=-1).isnan()  # (B, H, Lq): those, and finite rows whose sum overflows
    if not bool(nan_rows.any()):
        return out, None
    nan_rows = nan_rows & call.q.detach().isnan().any(dim=-1)  # (B, H, Lq): NaN itself (a reviewer's finding)
    live_rows = call.mask.liveness[1]  # (B|1, H|1, Lq) or None: a row that sees no key is zeros, NaN or not
    if live_rows is not None:
        nan_rows = nan_rows & live_rows  # (B, H, Lq)
    return out.masked_fill(nan_rows[..., None], float("nan")), None


def _attention(call: Call) -> tuple[Tensor, Tensor | None]:
    q, k, v, mask, scale, dropout_p = call.q, call.k, call.v, call.mask, call.scale, call.dropout_p
    H, Hkv = q.shape[1], k.shape[1]
    Lq, Lk = mask.num_queries, mask.num_keys
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
    lengths = None if call.score_mod is not None else _key_lengths(mask)
    if lengths and worth_grouping(lengths, Lk, Lq, H * (q.shape[-1] + v.shape[-1])):
        return _by_length(q, k, v, lengths, mask.is_causal, scale, dropout_p, gqa), None
    if call.score_mod is None and (mask.is_empty or mask.is_plain_causal):
        out = F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout_p, is_causal=mask.is_causal, scale=scale, **gqa
        )  # (B, H, Lq, Dv)
        return out, None

    q, k, v = zero_dead(q, k, v, mask, call.zeros_past)
    allowed, bias = dense_mask(call, q.dtype)  # (B|1, H|1, Lq|1, Lk) each, or None
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


def worth_grouping(lengths: list[int], Lk: int, Lq: int, macs_per_pair: int) -> bool:
    """Whether one call per run of equal lengths beats one masked call: it skips enough of the keys, and the
    multiply-adds it skips pay for the calls it adds."""
    skipped = len(lengths) * Lk - sum(lengths)
    if max(lengths) == 0 or skipped < (1 - GROUP_BELOW) * len(lengths) * Lk:
        return False
    calls = 1 + sum(a != b for a, b in zip(lengths, lengths[1:], strict=False))
    return skipped * Lq * macs_per_pair >= (calls - 1) * CALL_COST_MACS


def equal_runs(lengths: list[int]) -> list[tuple[int, int]]:
    """``(length, examples)`` for each run of consecutive examples of equal length, in batch order: the backward pass
    of a split is one concatenation, where slicing or gathering examples costs a full-size zeroed gradient each
    (profiled: sorting the batch by length spent 20% of the time at L=2048 in index_select, scatter_add and fill)."""
    runs: list[list[int]] = []
    for n in lengths:
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    return [(n, count) for n, count in runs]


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
    runs = equal_runs(lengths)
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
