"""The graph backend's custom op: padded batches through PyTorch's fused CPU kernel, planned from the lengths' values.

A padded batch (``valid_lens (B,)``, with or without causal self-attention) runs eagerly as one fused call per run of
examples of equal length, on their real keys only (:func:`attnkit.backends.sdpa.attention`: 0.6-0.7x the time of
one masked call at L=2048). That plan reads the lengths on the host, which dynamo cannot trace; as the custom op
``attnkit::attention_by_length`` it runs inside the compiled graph, its plan made each time the graph runs. Its
autograd is registered: the backward is the kernel's own (``_scaled_dot_product_flash_attention_for_cpu_backward``)
on each run, from the output and log-sum-exp the forward kept, so nothing is computed twice; its fake (meta)
implementation gives the shapes to the compiler.

Exact as the reference: keys past an example's length are never read (NaN there reaches nothing), an example of no
key gives zeros, and their gradients are exactly zero. When runs would not repay their calls (lengths alike, or
many examples of distinct lengths: :func:`attnkit.backends.sdpa.worth_grouping`), one masked call, the padding and
the rows that see nothing zeroed first.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit.backends import sdpa
from attnkit.backends.common import kernel_backward_safe, zero_dead
from attnkit.masks import Mask

__all__ = ["attention", "fused", "fuses", "takes"]

NAME = "attnkit::attention_by_length"

# B batch, H heads, Hkv key/value heads, Lq/Lk query/key length, D head dim (values' too), n an example's length

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def takes(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> bool:
    """Whether the op runs this call's inputs: on the CPU, float32 or float64, one head size, causal only over as
    many queries as keys (the caller checks the mask is lengths ``(B,)`` alone and there is no modifier)."""
    return (
        q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.float64)
        and q.shape[-1] == v.shape[-1]
        and (not causal or q.shape[2] == k.shape[2])
    )


def attention(q: Tensor, k: Tensor, v: Tensor, lens: Tensor, causal: bool, scale: float) -> Tensor:
    """``q (B, H, Lq, D)``, ``k``/``v (B, Hkv, Lk, D)``, ``lens (B,)`` long in ``[0, Lk]``: ``(B, H, Lq, D)``, a view
    of the op's ``(B, Lq, H, D)`` (the kernel's own layout: a layer then merges the heads without a copy)."""
    return _attention(q, k, v, lens, causal, scale)[0].transpose(1, 2)


def _plan(lens: Tensor, Lq: int, Lk: int, macs_per_pair: int) -> list[tuple[int, int]] | None:
    """Runs ``(length, examples)`` in batch order, or ``None`` for one masked call (:mod:`attnkit.backends.sdpa`'s
    rule: grouping pays when it skips enough keys for its extra calls)."""
    lengths = lens.tolist()
    if not lengths or not sdpa.worth_grouping(lengths, Lk, Lq, macs_per_pair):
        return None
    return sdpa.equal_runs(lengths)


def _pieces(Lq: int, n: int, causal: bool) -> list[tuple[int, int, bool]]:
    """The kernel calls of an example of ``n`` keys: ``(first row, last row + 1, causal)``; with ``causal``, rows
    ``[0, n)`` causal over the ``n`` keys and rows ``[n, Lq)`` seeing all of them."""
    if causal and n < Lq:
        return [(0, n, True), (n, Lq, False)]
    return [(0, Lq, causal)]


class _Masked(NamedTuple):
    """One masked call over the whole batch: the inputs with what no query sees zeroed, the float mask, and which
    rows see some key ``(B, 1, Lq, 1)`` and which keys some query sees ``(B, 1, Lk, 1)``."""

    q: Tensor  # (B, H, Lq, D)
    k: Tensor  # (B, Hkv, Lk, D)
    v: Tensor  # (B, Hkv, Lk, D)
    mask: Tensor  # (B, 1, Lq, Lk): 0 or -inf; a row that sees nothing sees every (zeroed) key
    live_rows: Tensor  # (B, 1, Lq, 1)
    live_keys: Tensor  # (B, 1, Lk, 1)


def _masked(q: Tensor, k: Tensor, v: Tensor, lens: Tensor, causal: bool) -> _Masked:
    Lq, Lk = q.shape[2], k.shape[2]
    n = lens.view(-1, 1, 1, 1)  # (B, 1, 1, 1)
    keys = torch.arange(Lk, device=q.device)  # (Lk,)
    allowed = keys < n  # (B, 1, 1, Lk)
    if causal:
        rows = torch.arange(Lq, device=q.device)[:, None]  # (Lq, 1)
        allowed = allowed & (keys <= rows + (Lk - Lq))  # (B, 1, Lq, Lk)
    allowed = allowed.expand(-1, 1, Lq, Lk)  # (B, 1, Lq, Lk)
    live_rows = allowed.any(dim=-1, keepdim=True)  # (B, 1, Lq, 1)
    live_keys = (keys < n).transpose(-2, -1)  # (B, 1, Lk, 1)
    mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(~(allowed | ~live_rows), -torch.inf)
    zq, zk, zv = torch.where(live_rows, q, 0.0), torch.where(live_keys, k, 0.0), torch.where(live_keys, v, 0.0)
    return _Masked(zq, zk, zv, mask, live_rows, live_keys)


@torch.library.custom_op(NAME, mutates_args=())
def _attention(q: Tensor, k: Tensor, v: Tensor, lens: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))  # (the kernel reads rows whole)
    blhd, lse = _empty_results(q, v)  # (B, Lq, H, D), (B, H, Lq)
    out = blhd.transpose(1, 2)  # (B, H, Lq, D), a view: written in place
    plan = _plan(lens, Lq, Lk, H * 2 * D)
    if plan is None:
        m = _masked(q, k, v, lens, causal)
        found, found_lse = _flash(m.q, m.k, m.v, 0.0, False, attn_mask=m.mask, scale=scale)[:2]
        out.copy_(found.masked_fill(~m.live_rows, 0.0))
        lse.copy_(found_lse)
        return blhd, lse
    b0 = 0
    for n, count in plan:
        rows = slice(b0, b0 + count)
        kb, vb = k[rows, :, :n], v[rows, :, :n]  # (b, Hkv, n, D): the real keys only
        if n == 0:
            out[rows], lse[rows] = 0.0, -torch.inf  # nothing to attend to
        for r0, r1, c in _pieces(Lq, n, causal) if n else []:
            out[rows, :, r0:r1], lse[rows, :, r0:r1] = _flash(q[rows, :, r0:r1], kb, vb, 0.0, c, scale=scale)[:2]
        b0 += count
    return blhd, lse


@_attention.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, lens: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    return _empty_results(q, v)


def _empty_results(q: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """The op's results, contiguous, in the op and its fake alike: the output ``(B, Lq, H, Dv)`` and the
    log-sum-exp ``(B, H, Lq)``."""
    B, H, Lq, _ = q.shape
    return q.new_empty(B, Lq, H, v.shape[-1]), q.new_empty(B, H, Lq, dtype=_lse_dtype(q))


@torch.library.custom_op(NAME + "_backward", mutates_args=())
def _attention_backward(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, lens: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    q, k, v, grad = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v, grad))
    if not kernel_backward_safe(q, v, grad):  # the kernel's backward would meet 0 * inf at a pair a row may not see
        mask = Mask.build(batch=B, heads=H, num_queries=Lq, num_keys=Lk, valid_lens=lens, is_causal=causal)
        q, k, v = zero_dead(q, k, v, mask)
        found = sdpa.exact_backward(q, k, v, out, lse, grad, None, causal, scale, mask=mask)
        return tuple(g.contiguous() for g in found)  # type: ignore[return-value]
    plan = _plan(lens, Lq, Lk, H * 2 * D)
    if plan is None:
        m = _masked(q, k, v, lens, causal)
        grad = grad.masked_fill(~m.live_rows, 0.0)  # the rows zeroed after the kernel pass nothing back
        dq, dk, dv = _flash_backward(grad, m.q, m.k, m.v, out, lse, 0.0, False, attn_mask=m.mask, scale=scale)
        dq = dq.masked_fill(~m.live_rows, 0.0)  # (B, H, Lq, D)
        dk, dv = dk.masked_fill(~m.live_keys, 0.0), dv.masked_fill(~m.live_keys, 0.0)  # (B, Hkv, Lk, D) each
        return dq.contiguous(), dk.contiguous(), dv.contiguous()
    dqs, dks, dvs, b0 = [], [], [], 0
    for n, count in plan:
        rows = slice(b0, b0 + count)
        qb, kb, vb = q[rows], k[rows, :, :n], v[rows, :, :n]  # (b, H|Hkv, L|n, D)
        dq, dk, dv = torch.zeros_like(qb), torch.zeros_like(k[rows]), torch.zeros_like(v[rows])  # (b, ., L, D)
        for r0, r1, c in _pieces(Lq, n, causal) if n else []:
            part = slice(r0, r1)
            g_q, g_k, g_v = _flash_backward(
                grad[rows, :, part], qb[:, :, part], kb, vb, out[rows, :, part], lse[rows, :, part], 0.0, c, scale=scale
            )  # (b, H, r, D), (b, Hkv, n, D) twice
            dq[:, :, part] = g_q
            dk[:, :, :n] += g_k
            dv[:, :, :n] += g_v
        dqs.append(dq)
        dks.append(dk)
        dvs.append(dv)
        b0 += count
    return torch.cat(dqs).contiguous(), torch.cat(dks).contiguous(), torch.cat(dvs).contiguous()  # as the fake


@_attention_backward.register_fake
def _(
    grad: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, lens: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)  # contiguous, as the op's


def _register_autograd(name: str, backward: Callable[..., tuple[Tensor, Tensor, Tensor]]) -> None:
    """The autograd of an op ``(q, k, v, what_masks, causal, scale) -> (out (B, Lq, H, Dv), lse)``, whose gradients
    the op ``backward(grad, q, k, v, out, lse, what_masks, causal, scale)`` computes (the view it returns is
    ``(B, H, Lq, Dv)`` as a view of ``(B, Lq, H, Dv)``: the gradient arrives so, and goes back that way)."""

    def setup(ctx: object, inputs: tuple, output: tuple) -> None:
        q, k, v, masks, causal, scale = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, masks)  # type: ignore[attr-defined]
        ctx.causal, ctx.scale = causal, scale  # type: ignore[attr-defined]

    def grads(ctx: object, grad: Tensor, grad_lse: Tensor | None) -> tuple:
        q, k, v, out, lse, masks = ctx.saved_tensors  # type: ignore[attr-defined]
        grad, out = grad.transpose(1, 2), out.transpose(1, 2)  # (B, H, Lq, D) views of (B, Lq, H, D)
        dq, dk, dv = backward(grad, q, k, v, out, lse, masks, ctx.causal, ctx.scale)  # type: ignore[attr-defined]
        return dq, dk, dv, None, None, None

    torch.library.register_autograd(name, grads, setup_context=setup)


_register_autograd(NAME, _attention_backward)


def _lse_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


# ------------------------------------------------------------------ one fused call, with the guarded backward


@torch.library.custom_op("attnkit::fused_attention", mutates_args=())
def _fused(
    q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    qp, kp, vp, kernel_mask = _padded(q, k, v, attn_mask)  # (B, H|Hkv, L, width) each
    blhd, lse = _empty_results(q, v)  # (B, Lq, H, Dv), (B, H, Lq)
    out, found_lse = _flash(qp, kp, vp, 0.0, causal, attn_mask=kernel_mask, scale=scale)[:2]
    blhd.transpose(1, 2).copy_(out[..., : v.shape[-1]])
    lse.copy_(found_lse)
    return blhd, lse


@_fused.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    return _empty_results(q, v)


def _padded(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """The kernel's operands: ``q``, ``k`` and ``v`` contiguous rows of one head size (zero features added: they
    change no score), a boolean mask as the float one it takes."""
    width = max(q.shape[-1], v.shape[-1])
    q, k, v = (F.pad(t, (0, width - t.shape[-1])) if t.shape[-1] < width else t for t in (q, k, v))
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))  # (the kernel reads rows whole)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros((), dtype=q.dtype, device=q.device).masked_fill(~attn_mask, -torch.inf)
    return q, k, v, attn_mask


@torch.library.custom_op("attnkit::fused_attention_backward", mutates_args=())
def _fused_backward(
    grad: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    attn_mask: Tensor | None,
    causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    D, Dv = q.shape[-1], v.shape[-1]
    qp, kp, vp, kernel_mask = _padded(q, k, v, attn_mask)  # (B, H|Hkv, L, width) each
    width = qp.shape[-1]
    grad, out = (F.pad(t, (0, width - Dv)) if width > Dv else t.contiguous() for t in (grad, out))  # (B, H, Lq, w)
    if kernel_backward_safe(qp, vp, grad):
        found = _flash_backward(grad, qp, kp, vp, out, lse, 0.0, causal, attn_mask=kernel_mask, scale=scale)[:3]
    else:  # the kernel's backward would meet 0 * inf at a pair a row may not see
        found = sdpa.exact_backward(qp, kp, vp, out, lse, grad, attn_mask, causal, scale)
    dq, dk, dv = found
    return dq[..., :D].contiguous(), dk[..., :D].contiguous(), dv[..., :Dv].contiguous()


@_fused_backward.register_fake
def _(
    grad: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    attn_mask: Tensor | None,
    causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)  # contiguous, as the op's


_register_autograd("attnkit::fused_attention", _fused_backward)


_LOW = (torch.bfloat16, torch.float16)


def fuses(q: Tensor) -> bool:
    """Whether :func:`fused` runs these inputs: on the CPU, float32 or float64, or 16 bits computed in float32 (any
    head sizes, any lengths)."""
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.float64, *_LOW) and q.numel() > 0


def fused(q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, causal: bool, scale: float) -> Tensor:
    """PyTorch's CPU flash kernel on ``q (B, H, Lq, D)``, ``k (B, Hkv, Lk, D)``, ``v (B, Hkv, Lk, Dv)`` with
    ``attn_mask`` (bool or float, broadcastable to ``(B, H, Lq, Lk)``) and ``causal`` (``Lq == Lk``), as the custom
    op ``attnkit::fused_attention``, whose
    backward reads values (:func:`~attnkit.backends.common.kernel_backward_safe`) and hands over to
    :func:`attnkit.backends.sdpa.exact_backward` where the kernel's would meet ``0 * inf`` at a hidden pair: what
    ``scaled_dot_product_attention`` cannot do inside a compiled graph. ``(B, H, Lq, Dv)``, a view. 16-bit inputs
    run in float32, the result rounded once (the kernel's own 16-bit sums lost twice the 16-bit math's error)."""
    if q.dtype in _LOW:
        low = q.dtype
        bias = attn_mask.float() if attn_mask is not None and attn_mask.is_floating_point() else attn_mask
        return fused(q.float(), k.float(), v.float(), bias, causal, scale).to(low)  # (B, H, Lq, Dv)
    return _fused(q, k, v, attn_mask, causal, scale)[0].transpose(1, 2)
