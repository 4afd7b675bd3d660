"""The tile engine in torch ops, eagerly (``tiles:online``): the online softmax over blocks of keys
(:mod:`attnkit.backends.tiles.softmax`), memory linear in the sequence length, forward and backward, on any device and
dtype, with every modifier and additive scoring.

The output is accumulated one block of keys at a time, with a running row maximum ``m``, a running normaliser ``l`` and
a running unnormalised output ``acc`` (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022). The backward pass is
a custom :class:`torch.autograd.Function` that keeps only ``q, k, v``, the output and the row log-sum-exp, and
recomputes each block's scores. At most one ``Lq x block`` slice of scores (one ``Lq x block x D`` slice of features for
additive scoring) is alive at a time, with its few same-sized temporaries. Each block of keys is scored against the rows
that may see it only, as the plan's spans say from index ranges alone (:meth:`attnkit.plan.Plan.spans`): keys past the
longest ``valid_lens``, the rows above a causal diagonal, all but the band of a sliding window and all but one document
of a packed row are never visited.

Modifiers: a ``mask_mod`` is evaluated on each block it does not know in full; a ``score_mod`` on each block's scores,
and again in the backward pass, through which the tensors it closes over get their gradients; ``sinks`` start each row's
running sum.

Cannot: return weights, apply dropout, or differentiate a float ``attn_mask`` (``SUPPORTS``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass

import torch
from torch import Tensor

from attnkit import mods
from attnkit.backends.common import Watched, first_order_only, probe, repeat_kv, row_sinks, sinks_grad, zero_dead
from attnkit.backends.contract import Call, Supports, scores_bounded
from attnkit.backends.tiles.softmax import Grads, LogSumExp, RunningSoftmax, Scorer, accumulate, accumulate_grads
from attnkit.masks import Mask, compute_dtype
from attnkit.plan import Span, plan_of

NAME = "tiles:online"

# B batch, H heads, Lq/Lk query/key length, D head dim, Dv value head dim, blk keys in one block


@dataclass(frozen=True)
class Settings:
    """``block_size``: keys per block for dot-product scoring. ``additive_block_bytes``: the budget of one
    ``(B, H, Lq, blk, D)`` float32 feature slice, which sets the block for additive scoring."""

    block_size: int = 128
    additive_block_bytes: int = 64 * 2**20


# The settings() blocks open in this thread or task, outermost first: each one's overrides, by identity. Blocks may
# close in any order (contextlib.ExitStack, generators): each removes its own, the others stay in force.
# A block's overrides are cleared when it closes, so an asyncio task made inside it, which holds a copy of the
# tuple, falls back to the settings outside it.
_OVERRIDES: ContextVar[tuple[dict[str, int], ...]] = ContextVar("attnkit_online_settings", default=())


def current_settings() -> Settings:
    """The settings in force in this thread or task: the defaults, overridden by each open settings() block."""
    current = Settings()
    for overrides in _OVERRIDES.get():
        if overrides:
            current = dataclasses.replace(current, **overrides)
    return current


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


SUPPORTS = Supports(weights=False, dropout=False, bias_grad=False, opaque_modifiers=False)


def attention(call: Call) -> tuple[Tensor, Tensor | None]:
    args, closed_over = _prepared(call)
    out = _OnlineSoftmax.apply(*args, *closed_over)  # (B, H, Lq, Dv)
    return out.to(call.q.dtype), None


def attention_with_lse(call: Call) -> tuple[Tensor, Tensor] | None:
    """The output and each row's log-sum-exp of its (modified) scores, ``(B, H, Lq)`` in the compute dtype, which
    the forward computes anyway (``-inf`` for a row with no key): for a call that needs no gradient (``None``
    otherwise)."""
    if call.needs_grad:
        return None
    (q, k, v, _, sinks, mask, scorer, block, _), _ = _prepared(call)
    out, lse, _, empty = _forward(q, k, v, sinks, mask, scorer, block)  # (B, H, Lq, Dv), (B, H, Lq) x 3
    return out.to(call.q.dtype), lse.total().masked_fill(empty, -math.inf)


def _prepared(call: Call) -> tuple[tuple, tuple[Tensor, ...]]:
    """The Function's arguments ``(q, k, v, w_v, sinks, mask, scorer, block, watched)`` in the compute dtype, and
    the tensors the score_mod reads that need gradients."""
    q, k, v, mask, w_v, scale = call.q, call.k, call.v, call.mask, call.w_v, call.scale
    B, H, Lq, D = q.shape
    dtype = compute_dtype(q.dtype)
    if w_v is None:
        block = current_settings().block_size
    else:
        block = max(1, current_settings().additive_block_bytes // (4 * max(B * H * Lq * D, 1)))
    q, k, v = zero_dead(q, k, v, mask, call.zeros_past)
    # Repeating key/value heads outside the Function lets autograd sum their gradients back per group.
    kf = repeat_kv(k, H).to(dtype)  # (B, H, Lk, D)
    vf = repeat_kv(v, H).to(dtype)  # (B, H, Lk, Dv)
    wf = None if w_v is None else w_v.to(dtype)
    sinks = None if call.sinks is None else call.sinks.to(dtype)
    qf = q.to(dtype)  # (B, H, Lq, D)
    closed_over: tuple[Tensor, ...] = ()
    protected: frozenset[int] | None = frozenset()
    if call.score_mod is not None:
        read = call.tensors_read(call.score_mod)
        if torch.is_grad_enabled():
            closed_over = mods.grad_inputs(call.score_mod, probe(dtype, q.device), read or ())
        protected = mods.protected_storages(call.score_mod, read)
    # where the inputs bound every score below half the range (a bias stays within the other half), no block need
    # be looked at for the -inf that hides a key
    finite = w_v is None and scores_bounded(q, k, scale, dtype)
    scorer = Scorer(wf, scale, call.score_mod, B, H, protected, finite)
    inputs = (qf, kf, vf, wf, sinks, *closed_over)
    backward = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs)
    watched = Watched.of(call) if backward else None
    return (qf, kf, vf, wf, sinks, mask, scorer, block, watched), closed_over


def _forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    sinks: Tensor | None,
    mask: Mask,
    scorer: Scorer,
    block: int,
    saw_key: Tensor | None = None,
) -> tuple[Tensor, LogSumExp, list[Span], Tensor]:
    """The output ``(B, H, Lq, Dv)``, each row's log-sum-exp (two terms, 0 in a row with no key), the spans of
    keys visited, and which rows summed nothing ``(B, H, Lq)`` (no key, nor a sink); ``saw_key``: as
    :func:`~attnkit.backends.tiles.softmax.accumulate`'s."""
    sink_logits = None if sinks is None else row_sinks(sinks, mask, q.shape, q.dtype)  # (B, H, Lq)
    state = RunningSoftmax.start(q, v.shape[-1], sink_logits)
    spans = plan_of(mask).spans(mask, (0, mask.num_keys), block)
    accumulate(state, q, k, v, mask, scorer, spans, saw_key)
    out, lse = state.result()  # (B, H, Lq, Dv), (B, H, Lq) x 2
    return out, lse.folded(), spans, state.l == 0


class _OnlineSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        w_v: Tensor | None,
        sinks: Tensor | None,
        mask: Mask,
        scorer: Scorer,
        block: int,
        watched: Watched | None,
        *closed_over: Tensor,
    ) -> Tensor:
        # which rows see some key, where a score can hide one (a score_mod's or an infinite input's -inf): a row left
        # with none is zeros, and its output gradient must reach nothing (the mask's empty rows: functional's rule)
        saw_key = None
        if any(ctx.needs_input_grad) and (scorer.score_mod is not None or not scorer.finite):
            saw_key = torch.zeros(q.shape[:3], dtype=torch.bool, device=q.device)  # (B, H, Lq)
        out, lse, spans, _ = _forward(q, k, v, sinks, mask, scorer, block, saw_key)  # (B, H, Lq, Dv), (B, H, Lq) x 2
        ctx.emptied = None if saw_key is None or bool(saw_key.all()) else ~saw_key  # (B, H, Lq) or None
        ctx.save_for_backward(q, k, v, w_v, sinks, out, *lse, *closed_over)
        ctx.mask, ctx.scorer, ctx.spans, ctx.watched = mask, scorer, spans, watched
        return out

    @staticmethod
    def backward(ctx, dout: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        first_order_only(NAME)
        q, k, v, w_v, sinks, out, top, rest, *closed_over = ctx.saved_tensors
        lse = LogSumExp(top, rest)  # (B, H, Lq) x 2
        if ctx.watched is not None:
            ctx.watched.check(NAME)
        mask: Mask = ctx.mask
        dout = dout.to(out.dtype)
        if ctx.emptied is not None:  # their queries too: 0 * NaN would reach dk through their hidden scores
            dout = dout.masked_fill(ctx.emptied[..., None], 0.0)  # (B, H, Lq, Dv)
            q = q.masked_fill(ctx.emptied[..., None], 0.0)  # (B, H, Lq, D)
        delta = (dout * out).sum(dim=-1)  # (B, H, Lq): sum_j p_ij dp_ij, the softmax Jacobian's row term
        grads = Grads(torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), _zeros_or_none(w_v))
        closed_grads = [torch.zeros_like(t) for t in closed_over]
        accumulate_grads(
            grads, q, k, v, mask, ctx.scorer, ctx.spans, lse, dout, delta, closed_over, closed_grads, ctx.emptied
        )
        dsinks = sinks_grad(sinks, mask, lse, delta) if sinks is not None and ctx.needs_input_grad[4] else None
        return (grads.dq, grads.dk, grads.dv, grads.dw, dsinks, None, None, None, None, *closed_grads)


def _zeros_or_none(t: Tensor | None) -> Tensor | None:
    return None if t is None else torch.zeros_like(t)
