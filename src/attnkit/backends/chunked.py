"""Online softmax over blocks of keys: memory linear in sequence length, forward and backward.

The output is accumulated one block of keys at a time, with a running row maximum ``m``, a running normaliser
``l`` and a running unnormalised output ``acc`` (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022).
The backward pass is a custom :class:`torch.autograd.Function` that keeps only ``q, k, v``, the output and the
row log-sum-exp, and recomputes each block's scores. At most one ``Lq x block`` slice of scores (one
``Lq x block x D`` slice of features for additive scoring) is alive at a time, with its few same-sized
temporaries. Keys past the longest ``valid_lens`` are never visited.

Cannot: return weights, apply dropout, or differentiate a float ``attn_mask``; see :func:`why_not`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from attnkit.backends.common import additive_scores, repeat_kv, zero_dead_keys
from attnkit.masks import Mask, compute_dtype

NAME = "chunked"

# B batch, H heads, Lq/Lk query/key length, D head dim, Dv value head dim, blk keys in one block


@dataclass
class Settings:
    """``block_size``: keys per block for dot-product scoring. ``additive_block_bytes``: the budget of one
    ``(B, H, Lq, blk, D)`` float32 feature slice, which sets the block for additive scoring."""

    block_size: int = 256
    additive_block_bytes: int = 64 * 2**20


SETTINGS = Settings()


@contextlib.contextmanager
def settings(*, block_size: int | None = None, additive_block_bytes: int | None = None) -> Iterator[Settings]:
    """Change the block sizes inside a ``with`` block.

    Example:
        >>> with settings(block_size=64) as s:
        ...     s.block_size
        64
    """
    global SETTINGS
    old = SETTINGS
    new = Settings(
        block_size=old.block_size if block_size is None else block_size,
        additive_block_bytes=old.additive_block_bytes if additive_block_bytes is None else additive_block_bytes,
    )
    if new.block_size < 1 or new.additive_block_bytes < 1:
        raise ValueError(f"block sizes must be positive, got {new}")
    SETTINGS = new
    try:
        yield new
    finally:
        SETTINGS = old


def available() -> list[str]:
    return []


def why_not(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Mask,
    *,
    w_v: Tensor | None,
    scale: float,
    dropout_p: float,
    need_weights: bool,
) -> list[str]:
    reasons = available()
    if need_weights:
        reasons.append("never returns weights (need_weights=True)")
    if dropout_p > 0:
        reasons.append(f"no dropout (dropout_p={dropout_p})")
    if mask.bias is not None and mask.bias.requires_grad and torch.is_grad_enabled():
        reasons.append("does not differentiate a float attn_mask that requires grad")
    return reasons


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Mask,
    *,
    w_v: Tensor | None,
    scale: float,
    dropout_p: float,
    need_weights: bool,
) -> tuple[Tensor, Tensor | None]:
    B, H, Lq, D = q.shape
    dtype = compute_dtype(q.dtype)
    if w_v is None:
        block = SETTINGS.block_size
    else:
        block = max(1, SETTINGS.additive_block_bytes // (4 * B * H * max(Lq, 1) * D))
    k, v = zero_dead_keys(k, v, mask)
    # Repeating key/value heads outside the Function lets autograd sum their gradients back per group.
    kf = repeat_kv(k, H).to(dtype)  # (B, H, Lk, D)
    vf = repeat_kv(v, H).to(dtype)  # (B, H, Lk, Dv)
    wf = None if w_v is None else w_v.to(dtype)
    out = _OnlineSoftmax.apply(q.to(dtype), kf, vf, wf, mask, scale, block)  # (B, H, Lq, Dv)
    return out.to(q.dtype), None


class _OnlineSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx, q: Tensor, k: Tensor, v: Tensor, w_v: Tensor | None, mask: Mask, scale: float, block: int
    ) -> Tensor:
        B, H, Lq, _ = q.shape
        Dv = v.shape[-1]
        lowest = torch.finfo(q.dtype).min
        m = q.new_full((B, H, Lq), lowest)  # running row max
        l = q.new_zeros((B, H, Lq))  # running normaliser  # noqa: E741
        acc = q.new_zeros((B, H, Lq, Dv))  # running unnormalised output
        for j0, j1 in _blocks(mask.longest_key_prefix(), block):
            s, _ = _scores(q, k[:, :, j0:j1], w_v, scale)  # (B, H, Lq, blk)
            allowed, s = _apply_mask(s, mask, j0, j1)
            m_new = torch.maximum(m, s.amax(dim=-1))  # running row max
            alpha = torch.exp(m - m_new)  # rescales what was summed so far
            p = torch.exp(s - m_new[..., None])  # (B, H, Lq, blk)
            if allowed is not None:
                p = p.masked_fill(~allowed, 0.0)  # exactly 0, also in rows with nothing allowed yet
            l = alpha * l + p.sum(dim=-1)  # noqa: E741
            acc = alpha[..., None] * acc + p @ v[:, :, j0:j1]  # (B, H, Lq, Dv)
            m = m_new
        live = l > 0  # (B, H, Lq): rows with at least one key
        out = torch.where(live[..., None], acc / l.clamp_min(torch.finfo(l.dtype).tiny)[..., None], 0.0)
        # log-sum-exp per row; 0 for dead rows keeps exp(s - lse) at exactly 0 there in the backward pass.
        lse = torch.where(live, m + torch.log(l.clamp_min(torch.finfo(l.dtype).tiny)), 0.0)  # (B, H, Lq)
        ctx.save_for_backward(q, k, v, w_v, out, lse)
        ctx.mask, ctx.scale, ctx.block = mask, scale, block
        return out

    @staticmethod
    def backward(ctx, dout: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        q, k, v, w_v, out, lse = ctx.saved_tensors
        mask: Mask = ctx.mask
        dout = dout.to(out.dtype)
        delta = (dout * out).sum(dim=-1)  # (B, H, Lq): sum_j p_ij dp_ij, the softmax Jacobian's row term
        dq = torch.zeros_like(q)
        dk = torch.zeros_like(k)
        dv = torch.zeros_like(v)
        dw = None if w_v is None else torch.zeros_like(w_v)
        for j0, j1 in _blocks(mask.longest_key_prefix(), ctx.block):
            kb, vb = k[:, :, j0:j1], v[:, :, j0:j1]  # (B, H, blk, D), (B, H, blk, Dv)
            s, features = _scores(q, kb, w_v, ctx.scale)  # (B, H, Lq, blk)
            allowed, s = _apply_mask(s, mask, j0, j1)
            p = torch.exp(s - lse[..., None])  # (B, H, Lq, blk): the softmax weights again
            if allowed is not None:
                p = p.masked_fill(~allowed, 0.0)
            dv[:, :, j0:j1] = p.transpose(-2, -1) @ dout  # (B, H, blk, Dv)
            dp = dout @ vb.transpose(-2, -1)  # (B, H, Lq, blk)
            ds = p.mul_(dp.sub_(delta[..., None]))  # (B, H, Lq, blk): gradient of the scores
            if w_v is None:
                dq += (ds @ kb) * ctx.scale  # (B, H, Lq, D)
                dk[:, :, j0:j1] = (ds.transpose(-2, -1) @ q) * ctx.scale  # (B, H, blk, D)
            else:
                assert features is not None and dw is not None
                dw += torch.einsum("bhij,bhijd->d", ds, features)
                # d tanh = 1 - tanh^2, in place on the features slice to hold one slice only
                dpre = features.mul_(features).neg_().add_(1.0).mul_(ds[..., None]).mul_(w_v)  # (B,H,Lq,blk,D)
                dq += dpre.sum(dim=-2)  # (B, H, Lq, D)
                dk[:, :, j0:j1] = dpre.sum(dim=-3)  # (B, H, blk, D)
        return dq, dk, dv, dw, None, None, None


def _blocks(n: int, block: int) -> Iterator[tuple[int, int]]:
    for j0 in range(0, n, block):
        yield j0, min(j0 + block, n)


def _scores(q: Tensor, k_blk: Tensor, w_v: Tensor | None, scale: float) -> tuple[Tensor, Tensor | None]:
    """Scores of one block, and for additive scoring the tanh features the backward pass needs."""
    if w_v is None:
        return (q @ k_blk.transpose(-2, -1)).mul_(scale), None  # (B, H, Lq, blk)
    return additive_scores(q, k_blk, w_v)  # (B, H, Lq, blk), (B, H, Lq, blk, D)


def _apply_mask(s: Tensor, mask: Mask, j0: int, j1: int) -> tuple[Tensor | None, Tensor]:
    """Add the bias and fill disallowed scores with the finite ``finfo.min`` (no ``inf - inf`` later)."""
    allowed, bias = mask.block(j0, j1, s.dtype)
    if bias is not None:
        s = s.add_(bias)
    if allowed is not None:
        s = s.masked_fill_(~allowed, torch.finfo(s.dtype).min)
    return allowed, s
