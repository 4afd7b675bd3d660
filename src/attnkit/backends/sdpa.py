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

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit.backends.common import (
    dense_mask,
    first_order_only,
    kernel_backward_safe,
    nan_rows_stay_nan,
    repeat_kv,
    zero_dead,
)
from attnkit.backends.contract import DOT, Call, Supports, scores_bounded
from attnkit.backends.tiles.softmax import Scorer, exact_grads
from attnkit.masks import Mask, compute_dtype
from attnkit.mods import ScoreFn

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

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


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
    if q.shape[-1] != v.shape[-1]:  # the kernel takes one head size
        return None
    if q.stride(-1) != 1:  # SDPA takes another kernel for such queries (5e-7 apart): the output would change
        return None
    # the kernel reads each row of k and v as contiguous (a positions-last cache's keys would give a wrong output,
    # not an error); attention() copies them so too
    k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (k, v))  # (B, Hkv, Lk, D|Dv) each
    out, lse = _flash(q, k, v, 0.0, mask.is_causal, scale=call.scale)[:2]
    return out, lse  # (B, H, Lq, Dv), (B, H, Lq)


def attention(call: Call) -> tuple[Tensor, Tensor | None]:
    out, _ = _attention(call)  # (B, H, Lq, Dv)
    if call.q.device.type != "cpu":
        return out, None
    return nan_rows_stay_nan(call, _no_gradient_from_overflowed_rows(call, out)), None


# keys scored at a time by _no_gradient_from_overflowed_rows
_ROWS_CHECK_BLOCK = 1024


def _no_gradient_from_overflowed_rows(call: Call, out: Tensor) -> Tensor:
    """``out (B, H, Lq, Dv)``, its rows whose every score overflows to ``-inf`` (finite inputs near the dtype's
    largest number) passing no gradient back: they see no key and are zeros, and NaN in their output gradient would
    reach ``dq``, ``dk`` and ``dv`` through PyTorch's backward (the mask's empty rows: functional's rule). Only where
    autograd records and the inputs do not bound the scores (one read of each): then the scores again, a block of
    keys at a time. A row whose visible keys overflow while a hidden one does not is not found."""
    if not (torch.is_grad_enabled() and out.requires_grad) or torch.compiler.is_compiling():
        return out
    q, k, scale = call.q.detach(), call.k.detach(), call.scale
    dtype = compute_dtype(q.dtype)
    if call.score_mod is not None or scores_bounded(q, k, scale, dtype):
        return out
    qf, kf = q.to(dtype), repeat_kv(k, q.shape[1]).to(dtype)  # (B, H, Lq, D), (B, H, Lk, D)
    empty = torch.ones(q.shape[:3], dtype=torch.bool, device=q.device)  # (B, H, Lq)
    for j0 in range(0, kf.shape[2], _ROWS_CHECK_BLOCK):
        s = (qf @ kf[:, :, j0 : j0 + _ROWS_CHECK_BLOCK].transpose(-2, -1)) * scale  # (B, H, Lq, blk)
        empty &= torch.isneginf(s).all(dim=-1)
    if not bool(empty.any()):
        return out
    return torch.where(empty[..., None], torch.zeros((), dtype=out.dtype, device=out.device), out)


def _attention(call: Call) -> tuple[Tensor, Tensor | None]:
    q, k, v, mask, scale, dropout_p = call.q, call.k, call.v, call.mask, call.scale, call.dropout_p
    H = q.shape[1]
    Lq, Lk = mask.num_queries, mask.num_keys
    if k.stride(-1) != 1 or v.stride(-1) != 1:
        # positions last (a cache's memory), many queries: the fused kernel reads that layout several times
        # slower than a copy (`python benchmarks/decode.py --only layout`, prefill row)
        k, v = k.contiguous(), v.contiguous()  # (B, Hkv, Lk, D), (B, Hkv, Lk, Dv)
    lengths = None if call.score_mod is not None else _key_lengths(mask)
    if lengths and worth_grouping(lengths, Lk, Lq, H * (q.shape[-1] + v.shape[-1])):
        return _by_length(q, k, v, lengths, mask.is_causal, scale, dropout_p), None
    if call.score_mod is None and (mask.is_empty or mask.is_plain_causal):
        out = fused(q, k, v, is_causal=mask.is_causal, scale=scale, dropout_p=dropout_p, mask=mask)  # (B, H, Lq, Dv)
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
    out = fused(
        q, k, v, attn_mask=attn_mask, scale=scale, dropout_p=dropout_p, mask=mask, score_mod=call.score_mod
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
            first = fused(qg[:, :, :n], kg, vg, is_causal=True, scale=scale, dropout_p=dropout_p)  # (b, H, n, Dv)
            rest = fused(qg[:, :, n:], kg, vg, scale=scale, dropout_p=dropout_p)  # (b, H, Lq - n, Dv)
            part = torch.cat([first, rest], dim=2)  # (b, H, Lq, Dv)
        else:
            part = fused(qg, kg, vg, is_causal=causal, scale=scale, dropout_p=dropout_p)  # (b, H, Lq, Dv)
        parts.append(part)
    return parts[0] if len(parts) == 1 else torch.cat(parts)  # (B, H, Lq, Dv)


def fused(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float,
    dropout_p: float = 0.0,
    mask: Mask | None = None,
    score_mod: ScoreFn | None = None,
) -> Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` of ``q (B, H, Lq, D)``, ``k (B, Hkv, Lk, D)``,
    ``v (B, Hkv, Lk, Dv)``: ``(B, H, Lq, Dv)``. Where autograd records a CPU call that hides some pairs (causal, or a
    mask), PyTorch's flash kernel through its own forward and backward ops (:class:`_Guarded`): its backward would
    meet ``0 * inf`` at a hidden pair where a query is not finite or ``dout . v`` overflows, and hands over to the
    online softmax's exact one there. ``mask`` (and ``score_mod``, a bias) say what ``attn_mask`` and ``is_causal``
    mean, for that one (``None``: made from them)."""
    hides = is_causal or attn_mask is not None
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    if (
        hides
        and grad
        # (torch.func's transforms, per-sample gradients among them, need PyTorch's own batching rules: the guarded
        # backward reads values. A private name of torch 2.13's, tested in tests/test_sdpa.py)
        and not torch._C._are_functorch_transforms_active()
        and not dropout_p
        and q.device.type == "cpu"
        and (attn_mask is None or not attn_mask.requires_grad)
        and q.numel()  # (the kernel's op, called on no example or no query, crashes the process: torch 2.13)
        and k.numel()
    ):
        if q.dtype in _KERNEL_DTYPES:
            return _Guarded.apply(q, k, v, attn_mask, is_causal, scale, mask, score_mod)  # type: ignore[no-any-return]
        # 16 bits: in float32, as every engine computes (the kernel's own 16-bit sums lost up to twice the 16-bit
        # math's error, in dv), the result rounded once
        up = [t.float() for t in (q, k, v)]  # (B, H|Hkv, L, D|Dv) each
        bias = attn_mask.float() if attn_mask is not None and attn_mask.is_floating_point() else attn_mask
        out = _Guarded.apply(*up, bias, is_causal, scale, mask, score_mod)  # (B, H, Lq, Dv)
        return out.to(q.dtype)  # type: ignore[no-any-return]
    gqa = {"enable_gqa": True} if q.shape[1] != k.shape[1] else {}
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **gqa
    )  # (B, H, Lq, Dv)


# The dtypes :class:`_Guarded` runs as they are: PyTorch's flash kernel takes 16-bit inputs too, but its sums in 16
# bits doubled the low-precision math's error (a float mask's scores; dv, tests/test_agreement.py): 16-bit calls run
# it in float32.
_KERNEL_DTYPES = frozenset({torch.float32, torch.float64})


class _Guarded(torch.autograd.Function):
    """PyTorch's CPU flash kernel, forward and backward (what ``scaled_dot_product_attention`` runs there: the same
    bits), the queries, keys and values padded with zero features to one head size (the kernel takes one; a zero
    feature changes no score), a boolean mask made the float one the kernel takes."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        attn_mask: Tensor | None,
        is_causal: bool,
        scale: float,
        mask: Mask | None,
        score_mod: ScoreFn | None,
    ) -> Tensor:
        D, Dv = q.shape[-1], v.shape[-1]
        width = max(D, Dv)
        qp, kp = (F.pad(t, (0, width - D)) if width > D else t for t in (q, k))  # (B, H|Hkv, L, width)
        vp = F.pad(v, (0, width - Dv)) if width > Dv else v  # (B, Hkv, Lk, width)
        # the kernel reads each row of q, k and v as contiguous (a transposed q gave outputs off by 1e36)
        qp, kp, vp = (t if t.stride(-1) == 1 else t.contiguous() for t in (qp, kp, vp))
        kernel_mask = attn_mask
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            zero = torch.zeros((), dtype=q.dtype, device=q.device)
            kernel_mask = zero.masked_fill(~attn_mask, float("-inf"))  # (B|1, H|1, Lq, Lk)
        out, lse = _flash(qp, kp, vp, 0.0, is_causal, attn_mask=kernel_mask, scale=scale)[:2]
        ctx.save_for_backward(qp, kp, vp, out, lse, kernel_mask, attn_mask)
        ctx.is_causal, ctx.scale, ctx.mask, ctx.score_mod, ctx.dims = is_causal, scale, mask, score_mod, (D, Dv)
        return out[..., :Dv] if width > Dv else out  # (B, H, Lq, Dv)

    @staticmethod
    def backward(ctx, dout: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        first_order_only(NAME)
        qp, kp, vp, out, lse, kernel_mask, attn_mask = ctx.saved_tensors
        D, Dv = ctx.dims
        width = qp.shape[-1]
        dout = dout.to(out.dtype)
        dout = F.pad(dout, (0, width - Dv)) if width > Dv else dout.contiguous()  # (B, H, Lq, width)
        if kernel_backward_safe(qp, vp, dout):
            grads = _flash_backward(
                dout, qp, kp, vp, out, lse, 0.0, ctx.is_causal, attn_mask=kernel_mask, scale=ctx.scale
            )[:3]
        else:  # the kernel's backward would meet 0 * inf at a pair a row may not see
            grads = exact_backward(
                qp, kp, vp, out, lse, dout, attn_mask, ctx.is_causal, ctx.scale, mask=ctx.mask, score_mod=ctx.score_mod
            )
        dq, dk, dv = grads
        return dq[..., :D], dk[..., :D], dv[..., :Dv], None, None, None, None, None


def exact_backward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    dout: Tensor,
    attn_mask: Tensor | None,
    is_causal: bool,
    scale: float,
    *,
    mask: Mask | None = None,
    score_mod: ScoreFn | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``dq, dk, dv`` of a call of PyTorch's flash kernel (``q (B, H, Lq, D)``, ``k, v (B, Hkv, Lk, D)``, its output
    and row log-sum-exp ``out``, ``lse``, the output's gradient ``dout``) through
    :func:`attnkit.backends.tiles.softmax.exact_grads`, which never multiplies a pair a row may not see: where
    :func:`~attnkit.backends.common.kernel_backward_safe` says the kernel's own backward would. In the compute dtype,
    returned in the inputs'. ``mask`` and ``score_mod``: what ``attn_mask`` and ``is_causal`` mean (``None``: a mask
    made from them)."""
    B, H, Lq, _ = q.shape
    if mask is None:
        mask = Mask.build(
            batch=B,
            heads=H,
            num_queries=Lq,
            num_keys=k.shape[2],
            attn_mask=attn_mask,
            is_causal=is_causal,
            device=q.device,
        )
    dtype = compute_dtype(q.dtype)
    scorer = Scorer(None, scale, score_mod, B, H)
    qf, kf, vf = q.to(dtype), k.to(dtype), v.to(dtype)
    found = exact_grads(qf, kf, vf, mask, scorer, lse, out.to(dtype), dout.to(dtype))
    dq, dk, dv = (g.to(q.dtype) for g in found)
    return dq, dk, dv
