"""Online softmax over blocks of keys: memory linear in sequence length, forward and backward.

The output is accumulated one block of keys at a time, with a running row maximum ``m``, a running normaliser
``l`` and a running unnormalised output ``acc`` (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022).
The backward pass is a custom :class:`torch.autograd.Function` that keeps only ``q, k, v``, the output and the
row log-sum-exp, and recomputes each block's scores. At most one ``Lq x block`` slice of scores (one
``Lq x block x D`` slice of features for additive scoring) is alive at a time, with its few same-sized
temporaries. Keys past the longest ``valid_lens`` are never visited.

Cannot: return weights, apply dropout, or differentiate a float ``attn_mask`` (:data:`SUPPORTS`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import numbers
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from attnkit.backends.common import additive_scores, repeat_kv, zero_dead
from attnkit.backends.contract import Call, Supports
from attnkit.masks import Mask, compute_dtype

NAME = "chunked"

# B batch, H heads, Lq/Lk query/key length, D head dim, Dv value head dim, blk keys in one block


@dataclass(frozen=True)
class Settings:
    """``block_size``: keys per block for dot-product scoring. ``additive_block_bytes``: the budget of one
    ``(B, H, Lq, blk, D)`` float32 feature slice, which sets the block for additive scoring."""

    block_size: int = 256
    additive_block_bytes: int = 64 * 2**20


# The settings() blocks open in this thread or task, outermost first: each one's overrides, by identity. Blocks may
# close in any order (contextlib.ExitStack, generators): each removes its own, the others stay in force.
# A block's overrides are cleared when it closes, so an asyncio task made inside it, which holds a copy of the
# tuple, falls back to the settings outside it.
_OVERRIDES: ContextVar[tuple[dict[str, int], ...]] = ContextVar("attnkit_chunked_settings", default=())


def current_settings() -> Settings:
    """The settings in force in this thread or task: the defaults, overridden by each open settings() block."""
    current = Settings()
    for overrides in _OVERRIDES.get():
        if overrides:
            current = dataclasses.replace(current, **overrides)
    return current


def __getattr__(name: str) -> Settings:
    # ``chunked.SETTINGS`` reads current_settings(): it used to be a module global, and callers may still read it.
    if name == "SETTINGS":
        return current_settings()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@contextlib.contextmanager
def settings(*, block_size: int | None = None, additive_block_bytes: int | None = None) -> Iterator[Settings]:
    """Change the block sizes inside a ``with`` block, for the thread or asyncio task that opens it (blocks nest and
    may close in any order; on exit, even after an exception, this block's changes are gone and the others stay).

    Example:
        >>> with settings(block_size=64) as s:
        ...     s.block_size
        64
    """
    overrides = {
        name: value
        for name, value in (("block_size", block_size), ("additive_block_bytes", additive_block_bytes))
        if value is not None
    }
    for name, value in overrides.items():
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be a whole number, got {value!r}")
        if value < 1:
            raise ValueError(f"{name} must be positive, got {value}")
        overrides[name] = int(value)
    _OVERRIDES.set((*_OVERRIDES.get(), overrides))
    try:
        yield current_settings()
    finally:
        _OVERRIDES.set(tuple(o for o in _OVERRIDES.get() if o is not overrides))
        overrides.clear()  # closed: copies of the tuple held elsewhere no longer apply it


SUPPORTS = Supports(weights=False, dropout=False, bias_grad=False)


def attention(call: Call) -> tuple[Tensor, Tensor | None]:
    q, k, v, mask, w_v, scale = call.q, call.k, call.v, call.mask, call.w_v, call.scale
    B, H, Lq, D = q.shape
    dtype = compute_dtype(q.dtype)
    if w_v is None:
        block = current_settings().block_size
    else:
        block = max(1, current_settings().additive_block_bytes // (4 * max(B * H * Lq * D, 1)))
    q, k, v = zero_dead(q, k, v, mask)
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
        state = RunningSoftmax.start(q, v.shape[-1])
        accumulate(state, q, k, v, w_v, mask, scale, (0, mask.longest_key_prefix()), block)
        out, lse = state.result()  # (B, H, Lq, Dv), (B, H, Lq)
        ctx.save_for_backward(q, k, v, w_v, out, lse)
        ctx.mask, ctx.scale, ctx.block = mask, scale, block
        return out

    @staticmethod
    def backward(ctx, dout: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        q, k, v, w_v, out, lse = ctx.saved_tensors
        mask: Mask = ctx.mask
        dout = dout.to(out.dtype)
        delta = (dout * out).sum(dim=-1)  # (B, H, Lq): sum_j p_ij dp_ij, the softmax Jacobian's row term
        grads = Grads(torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), _zeros_or_none(w_v))
        cols = (0, mask.longest_key_prefix())
        accumulate_grads(grads, q, k, v, w_v, mask, ctx.scale, cols, ctx.block, lse, dout, delta)
        return grads.dq, grads.dk, grads.dv, grads.dw, None, None, None


class BlockMask(Protocol):
    """What :func:`accumulate` needs of a mask (:class:`attnkit.masks.Mask` is one): ``allowed`` and ``bias``
    for the keys ``[j0, j1)``, each broadcastable to ``(B, H, Lq, j1 - j0)`` or ``None``; and the first row that
    may see key ``j0`` or any later one (0 unless causal)."""

    def block(self, j0: int, j1: int, dtype: torch.dtype = ...) -> tuple[Tensor | None, Tensor | None]: ...

    def first_row(self, j0: int) -> int: ...


class RunningSoftmax(NamedTuple):
    """The state of an online softmax over the rows of ``q``, updated in place block after block."""

    m: Tensor  # (B, H, Lq) running row max
    l: Tensor  # (B, H, Lq) running normaliser  # noqa: E741
    acc: Tensor  # (B, H, Lq, Dv) running unnormalised output

    @classmethod
    def start(cls, q: Tensor, dv: int) -> RunningSoftmax:
        B, H, Lq, _ = q.shape
        return cls(
            q.new_full((B, H, Lq), torch.finfo(q.dtype).min), q.new_zeros((B, H, Lq)), q.new_zeros((B, H, Lq, dv))
        )

    def rows(self, r0: int, r1: int) -> RunningSoftmax:
        """A view of rows ``[r0, r1)``; updating it updates this state."""
        return RunningSoftmax(self.m[:, :, r0:r1], self.l[:, :, r0:r1], self.acc[:, :, r0:r1])

    def result(self) -> tuple[Tensor, Tensor]:
        """The output ``(B, H, Lq, Dv)`` and the row log-sum-exp ``(B, H, Lq)``; both 0 in rows with no key."""
        live = self.l > 0  # (B, H, Lq): rows with at least one key
        l = self.l.clamp_min(torch.finfo(self.l.dtype).tiny)  # noqa: E741
        out = torch.where(live[..., None], self.acc / l[..., None], 0.0)  # (B, H, Lq, Dv)
        # 0 for dead rows keeps exp(s - lse) at exactly 0 there in the backward pass.
        lse = torch.where(live, self.m + torch.log(l), 0.0)  # (B, H, Lq)
        return out, lse


class Grads(NamedTuple):
    """Gradient accumulators for :func:`accumulate_grads`, added to in place."""

    dq: Tensor  # (B, H, Lq, D)
    dk: Tensor  # (B, H, Lk, D)
    dv: Tensor  # (B, H, Lk, Dv)
    dw: Tensor | None  # (D,) for additive scoring


def accumulate(
    state: RunningSoftmax,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    w_v: Tensor | None,
    mask: BlockMask,
    scale: float,
    cols: tuple[int, int],
    block: int,
) -> None:
    """Fold the keys ``cols = (j0, j1)`` of ``k, v`` into ``state``, ``block`` keys at a time.

    Args:
        state: the running softmax of the rows of ``q``, updated in place.
        q: ``(B, H, Lq, D)``; k: ``(B, H, Lk, D)``; v: ``(B, H, Lk, Dv)``, in the compute dtype.
        w_v: ``(D,)`` for additive scoring, ``None`` for dot products (then scaled by ``scale``).
        mask: ``mask.block(j0, j1)`` says which of these rows may see keys ``[j0, j1)`` of ``k``.
        cols: the ``[j0, j1)`` range of keys to fold in; block: keys scored at a time.
    """
    Lq = q.shape[2]
    for j0, j1 in _blocks(cols, block):
        r0 = mask.first_row(j0)  # rows above it see none of these keys (causal): not scored
        if r0 >= Lq:
            continue
        rows = state.rows(r0, Lq)  # (B, H, Lq', ...) views, Lq' = Lq - r0
        s, _ = _scores(q[:, :, r0:], k[:, :, j0:j1], w_v, scale)  # (B, H, Lq', blk)
        allowed, s = _apply_mask(s, mask, j0, j1, r0)
        m_new = torch.maximum(rows.m, s.amax(dim=-1))  # running row max
        alpha = torch.exp(rows.m - m_new)  # rescales what was summed so far
        p = s.sub_(m_new[..., None]).exp_()  # (B, H, Lq', blk), in the scores' memory
        if allowed is not None:
            p = p.masked_fill_(~allowed, 0.0)  # exactly 0, also in rows with nothing allowed yet
        rows.l.mul_(alpha).add_(p.sum(dim=-1))  # running normaliser
        rows.acc.mul_(alpha[..., None]).add_(p @ v[:, :, j0:j1])  # running unnormalised output
        rows.m.copy_(m_new)


def accumulate_grads(
    grads: Grads,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    w_v: Tensor | None,
    mask: BlockMask,
    scale: float,
    cols: tuple[int, int],
    block: int,
    lse: Tensor,
    dout: Tensor,
    delta: Tensor,
) -> None:
    """Add the gradients through the keys ``cols`` to ``grads``, recomputing each block's weights from ``lse``.

    Args:
        grads: ``dq (B, H, Lq, D)``, ``dk (B, H, Lk, D)``, ``dv (B, H, Lk, Dv)``, ``dw (D,)``, added to in place.
        q, k, v, w_v, mask, scale, cols, block: as in :func:`accumulate`.
        lse: ``(B, H, Lq)``, the row log-sum-exp over *all* keys (from :meth:`RunningSoftmax.result`).
        dout: ``(B, H, Lq, Dv)``, the gradient of the output; delta: ``(B, H, Lq)``, ``(dout * out).sum(-1)``.
    """
    Lq = q.shape[2]
    for j0, j1 in _blocks(cols, block):
        r0 = mask.first_row(j0)  # rows above it see none of these keys (causal): no gradient through them
        if r0 >= Lq:
            continue
        qr, dq_r, dout_r = q[:, :, r0:], grads.dq[:, :, r0:], dout[:, :, r0:]  # (B, H, Lq', D|Dv)
        kb, vb = k[:, :, j0:j1], v[:, :, j0:j1]  # (B, H, blk, D), (B, H, blk, Dv)
        s, features = _scores(qr, kb, w_v, scale)  # (B, H, Lq', blk)
        allowed, s = _apply_mask(s, mask, j0, j1, r0)
        p = s.sub_(lse[:, :, r0:, None]).exp_()  # (B, H, Lq', blk): the softmax weights again, in the scores' memory
        if allowed is not None:
            p = p.masked_fill_(~allowed, 0.0)
        grads.dv[:, :, j0:j1] += p.transpose(-2, -1) @ dout_r  # (B, H, blk, Dv)
        dp = dout_r @ vb.transpose(-2, -1)  # (B, H, Lq', blk)
        ds = p.mul_(dp.sub_(delta[:, :, r0:, None]))  # (B, H, Lq', blk): gradient of the scores
        if w_v is None:
            dq_r += (ds @ kb) * scale  # (B, H, Lq', D)
            grads.dk[:, :, j0:j1] += (ds.transpose(-2, -1) @ qr) * scale  # (B, H, blk, D)
        else:
            assert features is not None and grads.dw is not None
            grads.dw.add_(torch.einsum("bhij,bhijd->d", ds, features))
            # d tanh = 1 - tanh^2, in place on the features slice to hold one slice only
            dpre = features.mul_(features).neg_().add_(1.0).mul_(ds[..., None]).mul_(w_v)  # (B,H,Lq',blk,D)
            dq_r += dpre.sum(dim=-2)  # (B, H, Lq', D)
            grads.dk[:, :, j0:j1] += dpre.sum(dim=-3)  # (B, H, blk, D)


def _from_row(part: Tensor | None, r0: int) -> Tensor | None:
    """The rows from ``r0`` on of a mask part broadcastable to ``(B, H, Lq, blk)`` (a row axis of 1 broadcasts)."""
    return part if part is None or r0 == 0 or part.shape[-2] == 1 else part[..., r0:, :]


def _zeros_or_none(t: Tensor | None) -> Tensor | None:
    return None if t is None else torch.zeros_like(t)


def _blocks(cols: tuple[int, int], block: int) -> Iterator[tuple[int, int]]:
    start, stop = cols
    for j0 in range(start, stop, block):
        yield j0, min(j0 + block, stop)


def _scores(q: Tensor, k_blk: Tensor, w_v: Tensor | None, scale: float) -> tuple[Tensor, Tensor | None]:
    """Scores of one block, and for additive scoring the tanh features the backward pass needs."""
    if w_v is None:
        return (q @ k_blk.transpose(-2, -1)).mul_(scale), None  # (B, H, Lq, blk)
    return additive_scores(q, k_blk, w_v)  # (B, H, Lq, blk), (B, H, Lq, blk, D)


def _apply_mask(s: Tensor, mask: BlockMask, j0: int, j1: int, r0: int) -> tuple[Tensor | None, Tensor]:
    """Add the bias and fill disallowed scores with the finite ``finfo.min`` (no ``inf - inf`` later); ``s``
    holds the rows from ``r0`` on."""
    allowed, bias = (_from_row(part, r0) for part in mask.block(j0, j1, s.dtype))
    if bias is not None:
        s = s.add_(bias)
    if allowed is not None:
        s = s.masked_fill_(~allowed, torch.finfo(s.dtype).min)
    return allowed, s
