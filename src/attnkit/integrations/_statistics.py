"""What torch's attention APIs return beside the output, on attnkit's engines: each row's log-sum-exp (with its
gradient) and its largest modified score, for :func:`attnkit.flex_attention` and :func:`attnkit.varlen_attn`."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from attnkit import mods

__all__ = ["with_statistics"]

# B batch, H heads, Hkv key/value heads, Lq/Lk query/key length, D head dim, Dv value head dim, n a block's rows


def with_statistics(
    q: Tensor, k: Tensor, v: Tensor, masks: Any, scale: float | None, *, lse: bool, max_scores: bool
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """:func:`attnkit.functional.attend`'s output ``(B, H, Lq, Dv)``, with each row's log-sum-exp (with gradients)
    and largest modified score (detached), ``(B, H, Lq)`` each where asked (``None`` otherwise): the log-sum-exp
    from the engine where it has it (the C++ kernel, with its gradient; the online softmax without one), else from
    the scores a block of rows at a time; ``-inf`` for a row that sees no key."""
    from attnkit.functional import attend

    out, _, found = attend(q, k, v, masks, scale=scale, need_lse=lse)
    need = lse and found is None
    largest = None
    if need or max_scores:
        sums, largest = _row_statistics(q, k, masks, scale, sums=need, tops=max_scores)
        found = sums if need else found
    return out, found if lse else None, largest if max_scores else None


# Rows of scores taken at a time by _row_statistics: ~64 MiB of float32 scores in a block, whatever the length.
_STAT_ELEMENTS = 2**24


def _row_statistics(
    q: Tensor, k: Tensor, masks: Any, scale: float | None, *, sums: bool, tops: bool
) -> tuple[Tensor | None, Tensor | None]:
    """Each row's log-sum-exp ``(B, H, Lq)`` (where ``sums``; with gradients to q, k and what the score_mod reads,
    each block of rows recomputed in the backward, so that memory stays that of one block) and largest modified
    score ``(B, H, Lq)`` (where ``tops``; detached), from the scores a block of rows at a time, by the reference's
    rule: a hidden pair and a ``-inf`` score are no key (``-inf`` for a row without one), NaN where a row may see
    stays NaN. Keys no query may see and queries that see no key are zeroed first, as every engine does (what they
    hold reaches no gradient); a non-finite key that some queries see and others do not reaches the others' query
    gradients here (``0 * NaN`` in the backward's product: this path's limit, the engines' own lse has none)."""
    from torch.utils.checkpoint import checkpoint

    from attnkit.backends.common import repeat_kv, zero_dead
    from attnkit.functional import scoring

    q4, k4, mask, _, scale_, score_mod, _, _ = scoring(q, k, masks, scale=scale)
    q4, k4, _ = zero_dead(q4, k4, k4, mask)  # (B, H, Lq, D), (B, Hkv, Lk, D): the dead ones zeroed
    B, H, Lq, _ = q4.shape
    dtype = torch.float64 if q4.dtype == torch.float64 else torch.float32
    kf = repeat_kv(k4, H).to(dtype)  # (B, H, Lk, D)
    Lk = kf.shape[2]

    def scores(q_rows: Tensor, keys: Tensor, r0: int, r1: int) -> Tensor:
        s = (q_rows.to(dtype) @ keys.transpose(-2, -1)) * scale_  # (B, H, n, Lk)
        if score_mod is not None:
            b, h, qi, ki = mods.indices(B, H, (r0, r1), (0, Lk), s.device)
            s = mods.apply_score(score_mod, s, b, h, qi, ki).expand_as(s)  # (B, H, n, Lk)
        allowed, bias = mask.tile(r0, r1, 0, Lk, dtype, every=False)  # (B|1, H|1, n|1, Lk) | None each
        if bias is not None:
            s = s + bias
        hidden = s == -math.inf
        if allowed is not None:
            hidden = hidden | ~allowed
        return s.masked_fill(hidden, -math.inf)  # (B, H, n, Lk)

    def row_sums(q_rows: Tensor, keys: Tensor, r0: int, r1: int) -> Tensor:
        return torch.logsumexp(scores(q_rows, keys, r0, r1), dim=-1)  # (B, H, n)

    step = max(1, _STAT_ELEMENTS // max(1, B * H * Lk))
    found, largest = [], []
    grad = sums and torch.is_grad_enabled() and (q4.requires_grad or kf.requires_grad or _reads_grad(score_mod))
    for r0 in range(0, Lq, step):
        r1 = min(Lq, r0 + step)
        if tops or (sums and not grad):
            with torch.no_grad():
                s = scores(q4[:, :, r0:r1], kf, r0, r1)  # (B, H, n, Lk)
                if tops:
                    largest.append(s.amax(dim=-1))  # (B, H, n)
                if sums and not grad:
                    found.append(torch.logsumexp(s, dim=-1))  # (B, H, n)
        if grad:
            found.append(checkpoint(row_sums, q4[:, :, r0:r1], kf, r0, r1, use_reentrant=False))  # (B, H, n)
    none = q4.new_empty((B, H, 0), dtype=dtype)  # (B, H, 0): no query, no block
    return (torch.cat([none, *found], dim=-1) if sums else None), (
        torch.cat([none, *largest], dim=-1) if tops else None
    )


def _reads_grad(score_mod: Any) -> bool:
    """Whether a score_mod reads a tensor that needs a gradient (or cannot be looked into: taken to)."""
    if score_mod is None:
        return False
    try:
        return any(t.requires_grad for t in mods.read_tensors(score_mod))
    except mods.Uninspectable:
        return True
