"""Online softmax over blocks of keys: memory linear in sequence length, forward and backward.

The output is accumulated one block of keys at a time, with a running row maximum ``m``, a running normaliser
``l`` and a running unnormalised output ``acc`` (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022).
The backward pass is a custom :class:`torch.autograd.Function` that keeps only ``q, k, v``, the output and the
row log-sum-exp, and recomputes each block's scores. At most one ``Lq x block`` slice of scores (one
``Lq x block x D`` slice of features for additive scoring) is alive at a time, with its few same-sized
temporaries. Each block of keys is scored against the rows that may see it only, as the mask says from index
ranges alone (:meth:`attnkit.masks.Mask.tiles`): keys past the longest ``valid_lens``, the rows above a causal
diagonal, all but the band of a sliding window and all but one document of a packed row are never visited.

Modifiers: a ``mask_mod`` is evaluated on each block it does not know in full; a ``score_mod`` on each block's
scores, and again in the backward pass, through which the tensors it closes over get their gradients; ``sinks``
start each row's running sum.

Cannot: return weights, apply dropout, or differentiate a float ``attn_mask`` (:data:`SUPPORTS`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import numbers
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from attnkit import mods
from attnkit._checks import ranges
from attnkit.backends.common import additive_scores, repeat_kv, zero_dead
from attnkit.backends.contract import Call, Supports
from attnkit.masks import Mask, compute_dtype

NAME = "chunked"

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

# Which query rows each block of keys needs is worked out for blocks of this many rows (from index ranges only).
ROW_STEP = 64

# exp() of a score this far below its row's largest is taken as exp(EXP_FLOOR) = 1.8e-35: far below what float32 or
# float64 resolve beside the largest term (1), and 4-6x faster on CPUs, whose vector exp leaves its fast path for
# inputs that underflow (masked scores, filled with finfo.min, then are zeroed). benchmarks/flex.py, "window".
EXP_FLOOR = -80.0


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
    sinks = None if call.sinks is None else call.sinks.to(dtype)
    closed_over: tuple[Tensor, ...] = ()
    if call.score_mod is not None and torch.is_grad_enabled():
        closed_over = mods.grad_inputs(call.score_mod, _probe(q, dtype))
    scorer = Scorer(wf, scale, call.score_mod, B, H)
    watched = _Watched.of(mask, call.score_mod) if torch.is_grad_enabled() else None
    out = _OnlineSoftmax.apply(
        q.to(dtype), kf, vf, wf, sinks, mask, scorer, block, watched, *closed_over
    )  # (B, H, Lq, Dv)
    return out.to(q.dtype), None


def _probe(q: Tensor, dtype: torch.dtype) -> tuple[Tensor, ...]:
    """One score, of query 0 and key 0 of example 0 and head 0, to run a score_mod on once."""
    zero = torch.zeros((1, 1, 1, 1), dtype=torch.long, device=q.device)
    return (torch.zeros((1, 1, 1, 1), dtype=dtype, device=q.device), zero, zero, zero, zero)


@dataclass(frozen=True)
class Scorer:
    """How the scores of a block are made: ``scale * q . k`` (``w_v`` None) or ``w_v . tanh(q + k)``, then the
    ``score_mod``, called with the block's indices (``batch`` and ``heads`` for ``b`` and ``h``)."""

    w_v: Tensor | None
    scale: float
    score_mod: mods.ScoreFn | None = None
    batch: int = 1
    heads: int = 1

    def __call__(
        self, q: Tensor, k_blk: Tensor, rows: tuple[int, int], cols: tuple[int, int]
    ) -> tuple[Tensor, Tensor | None]:
        """Scores ``(B, H, n, blk)`` of queries ``rows`` against keys ``cols``, and the tanh features of additive
        scoring (for the backward pass)."""
        s, features = _scores(q, k_blk, self.w_v, self.scale)  # (B, H, n, blk)
        if self.score_mod is not None:
            s = mods.evaluate_score(self.score_mod, s, *self.indices(rows, cols, q.device))
        return s, features

    def indices(self, rows: tuple[int, int], cols: tuple[int, int], device: torch.device) -> tuple[Tensor, ...]:
        return mods.indices(self.batch, self.heads, rows, cols, device)


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
        watched: _Watched | None,
        *closed_over: Tensor,
    ) -> Tensor:
        sink_logits = None if sinks is None else _sink_logits(sinks, mask, q.shape)  # (B, H, Lq)
        state = RunningSoftmax.start(q, v.shape[-1], sink_logits)
        spans = key_blocks(mask, q.shape[2], (0, mask.num_keys), block)
        accumulate(state, q, k, v, mask, scorer, spans)
        out, lse = state.result()  # (B, H, Lq, Dv), (B, H, Lq)
        ctx.save_for_backward(q, k, v, w_v, sinks, out, lse, *closed_over)
        ctx.mask, ctx.scorer, ctx.spans, ctx.watched = mask, scorer, spans, watched
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        q, k, v, w_v, sinks, out, lse, *closed_over = ctx.saved_tensors
        if ctx.watched is not None:
            ctx.watched.check()
        mask: Mask = ctx.mask
        dout = dout.to(out.dtype)
        delta = (dout * out).sum(dim=-1)  # (B, H, Lq): sum_j p_ij dp_ij, the softmax Jacobian's row term
        grads = Grads(torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), _zeros_or_none(w_v))
        closed_grads = [torch.zeros_like(t) for t in closed_over]
        accumulate_grads(grads, q, k, v, mask, ctx.scorer, ctx.spans, lse, dout, delta, closed_over, closed_grads)
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[4]:
            # d lse / d sink = the sink's weight, exp(sink - lse); d out / d sink = -(sink's weight) * out
            weight = torch.exp(_sink_logits(sinks, mask, q.shape) - lse)  # (B, H, Lq)
            dsinks = -(weight * delta).sum(dim=(0, 2))  # (H,)
        return (grads.dq, grads.dk, grads.dv, grads.dw, dsinks, None, None, None, None, *closed_grads)


class _Watched:
    """The tensors the backward pass reads again through the mask and the modifiers (lengths, masks, a mask_mod's
    ids, what a score_mod closes over), with their versions at the forward pass: the recomputing backward would
    silently use new values if one were changed in place in between, where autograd raises."""

    def __init__(self, tensors: list[Tensor]) -> None:
        self.versions = [(t, t._version) for t in tensors]

    @classmethod
    def of(cls, mask: Mask, score_mod: mods.ScoreFn | None) -> _Watched:
        tensors = [t for t in (mask.valid_lens, mask.bool_mask, mask.bias) if t is not None]
        for fn in (mask.mask_mod, score_mod):
            if fn is not None:
                tensors += mods.read_tensors(fn)
        return cls(tensors)

    def check(self) -> None:
        for t, version in self.versions:
            if t._version != version:
                raise RuntimeError(
                    f"a tensor of shape {tuple(t.shape)} that this attention call reads (a mask, lengths, or what its "
                    f"mask_mod or score_mod closes over) was modified in place between the forward and the backward "
                    f"pass; the chunked backend reads it again to recompute: clone it before changing it"
                )


def _sink_logits(sinks: Tensor, mask: Mask, shape: torch.Size) -> Tensor:
    """Each row's sink logit (:meth:`Mask.sink_logits`), as the running softmax holds its rows: ``(B, H, Lq)``."""
    B, H, Lq, _ = shape
    return mask.sink_logits(sinks)[..., 0].expand(B, H, Lq)  # (B|1, H, Lq|1, 1) -> (B, H, Lq)


class BlockMask(Protocol):
    """What :func:`accumulate` needs of a mask (:class:`attnkit.masks.Mask` is one): ``tile`` gives ``allowed``
    and ``bias`` for the queries ``[r0, r1)`` and keys ``[j0, j1)``, each broadcastable to ``(B, H, n, blk)`` or
    ``None``; ``tiles`` says, from index ranges only, which blocks are hidden or visible in full; ``opaque``: some
    part is known only by looking at it (then a block whose mask allows nothing is skipped after all)."""

    def tile(
        self, r0: int, r1: int, j0: int, j1: int, dtype: torch.dtype = ..., *, every: bool = ...
    ) -> tuple[Tensor | None, Tensor | None]: ...

    def tiles(self, rows: Tensor, cols: Tensor) -> mods.Tiles: ...

    @property
    def opaque(self) -> bool: ...


class Span(NamedTuple):
    """One block of keys ``[j0, j1)`` and the rows ``[r0, r1)`` that may see some of it; ``every``: every one of
    these rows sees every one of these keys (no mask to build)."""

    j0: int
    j1: int
    r0: int
    r1: int
    every: bool


def key_blocks(mask: BlockMask, num_queries: int, cols: tuple[int, int], block: int) -> list[Span]:
    """The blocks of ``block`` keys in ``cols`` that some query may see, each with the span of rows that may see it
    (worked out for blocks of :data:`ROW_STEP` rows, from index ranges: nothing is evaluated). Causal attention
    skips the rows above the diagonal, a sliding window all but a band, packed documents all but one document."""
    plans = getattr(mask, "plans", None)  # a Mask keeps its plans: dispatch and the backend share one
    key = (num_queries, *cols, block)
    if plans is not None and key in plans:
        return plans[key]  # type: ignore[no-any-return]
    spans = _plan(mask, num_queries, cols, block)
    if plans is not None:
        plans[key] = spans
    return spans


def _plan(mask: BlockMask, num_queries: int, cols: tuple[int, int], block: int) -> list[Span]:
    rows = ranges(0, num_queries, ROW_STEP)  # (nq, 2)
    col_ranges = ranges(*cols, block)  # (nk, 2)
    if not len(rows) or not len(col_ranges):
        return []
    known = mask.tiles(rows, col_ranges)  # (nq, nk) each
    spans = []
    for c, (j0, j1) in enumerate(col_ranges.tolist()):
        seen = known.some[:, c].nonzero()[:, 0]  # the row blocks that may see some of these keys
        if not len(seen):
            continue
        first, last = int(seen[0]), int(seen[-1])
        every = bool(known.every[first : last + 1, c].all())
        spans.append(Span(j0, j1, int(rows[first, 0]), int(rows[last, 1]), every))
    return spans


class RunningSoftmax(NamedTuple):
    """The state of an online softmax over the rows of ``q``, updated in place block after block."""

    m: Tensor  # (B, H, Lq) running row max
    l: Tensor  # (B, H, Lq) running normaliser  # noqa: E741
    acc: Tensor  # (B, H, Lq, Dv) running unnormalised output

    @classmethod
    def start(cls, q: Tensor, dv: int, sink_logits: Tensor | None = None) -> RunningSoftmax:
        """Nothing summed yet; with ``sink_logits`` ``(B, H, Lq)``, the sink is summed first (its value is 0)."""
        B, H, Lq, _ = q.shape
        acc = q.new_zeros((B, H, Lq, dv))
        if sink_logits is not None:
            return cls(sink_logits.clone(), q.new_ones((B, H, Lq)), acc)
        return cls(q.new_full((B, H, Lq), torch.finfo(q.dtype).min), q.new_zeros((B, H, Lq)), acc)

    def rows(self, r0: int, r1: int) -> RunningSoftmax:
        """A view of rows ``[r0, r1)``; updating it updates this state."""
        return RunningSoftmax(self.m[:, :, r0:r1], self.l[:, :, r0:r1], self.acc[:, :, r0:r1])

    def result(self) -> tuple[Tensor, Tensor]:
        """The output ``(B, H, Lq, Dv)`` and the row log-sum-exp ``(B, H, Lq)``; both 0 in rows with no key (a row
        whose sum is NaN, from NaN in its own query, stays NaN, as in the reference: it is no row without keys)."""
        empty = self.l == 0  # (B, H, Lq): rows that summed no key
        l = self.l.clamp_min(torch.finfo(self.l.dtype).tiny)  # noqa: E741  (NaN stays NaN)
        out = torch.where(empty[..., None], 0.0, self.acc / l[..., None])  # (B, H, Lq, Dv)
        # 0 for empty rows keeps exp(s - lse) at exactly 0 there in the backward pass.
        lse = torch.where(empty, 0.0, self.m + torch.log(l))  # (B, H, Lq)
        return out, lse


class Grads(NamedTuple):
    """Gradient accumulators for :func:`accumulate_grads`, added to in place."""

    dq: Tensor  # (B, H, Lq, D)
    dk: Tensor  # (B, H, Lk, D)
    dv: Tensor  # (B, H, Lk, Dv)
    dw: Tensor | None  # (D,) for additive scoring


def accumulate(
    state: RunningSoftmax, q: Tensor, k: Tensor, v: Tensor, mask: BlockMask, scorer: Scorer, spans: list[Span]
) -> None:
    """Fold the key blocks ``spans`` of ``k, v`` into ``state``, each into the rows that may see it.

    Args:
        state: the running softmax of the rows of ``q``, updated in place.
        q: ``(B, H, Lq, D)``; k: ``(B, H, Lk, D)``; v: ``(B, H, Lk, Dv)``, in the compute dtype.
        mask: ``mask.tile(r0, r1, j0, j1)`` says which rows may see which keys of ``k``.
        scorer: makes a block's scores; spans: from :func:`key_blocks`.
    """
    for span in spans:
        seen = _block_mask(mask, span, q.dtype)
        if seen is None:
            continue  # a user's mask_mod or a boolean mask hides the whole block
        j0, j1, r0, r1, allowed, bias = seen
        rows = state.rows(r0, r1)  # (B, H, n, ...) views
        s, _ = scorer(q[:, :, r0:r1], k[:, :, j0:j1], (r0, r1), (j0, j1))  # (B, H, n, blk)
        allowed = _hidden_by_score(s, allowed, scorer)
        s = _masked(s, allowed, bias)
        m_new = torch.maximum(rows.m, s.amax(dim=-1))  # running row max
        alpha = torch.exp(rows.m - m_new)  # rescales what was summed so far
        p = s.sub_(m_new[..., None]).clamp_min_(EXP_FLOOR).exp_()  # (B, H, n, blk), in the scores' memory
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
    mask: BlockMask,
    scorer: Scorer,
    spans: list[Span],
    lse: Tensor,
    dout: Tensor,
    delta: Tensor,
    closed_over: Sequence[Tensor] = (),
    closed_grads: Sequence[Tensor] = (),
) -> None:
    """Add the gradients through the key blocks ``spans`` to ``grads``, recomputing each block's weights from
    ``lse``.

    Args:
        grads: ``dq (B, H, Lq, D)``, ``dk (B, H, Lk, D)``, ``dv (B, H, Lk, Dv)``, ``dw (D,)``, added to in place.
        q, k, v, mask, scorer, spans: as in :func:`accumulate`.
        lse: ``(B, H, Lq)``, the row log-sum-exp over *all* keys (from :meth:`RunningSoftmax.result`).
        dout: ``(B, H, Lq, Dv)``, the gradient of the output; delta: ``(B, H, Lq)``, ``(dout * out).sum(-1)``.
        closed_over: tensors the score_mod reads that need gradients; closed_grads: theirs, added to in place.
    """
    w_v, scale = scorer.w_v, scorer.scale
    for span in spans:
        seen = _block_mask(mask, span, q.dtype)
        if seen is None:
            continue
        j0, j1, r0, r1, allowed, bias = seen
        qr, dq_r, dout_r = q[:, :, r0:r1], grads.dq[:, :, r0:r1], dout[:, :, r0:r1]  # (B, H, n, D|Dv)
        kb, vb = k[:, :, j0:j1], v[:, :, j0:j1]  # (B, H, blk, D), (B, H, blk, Dv)
        raw, features = _scores(qr, kb, w_v, scale)  # (B, H, n, blk)
        modded = None
        if scorer.score_mod is not None:
            with torch.enable_grad():  # the score_mod's own graph, to take its gradient through
                raw = raw.detach().requires_grad_()
                modded = mods.evaluate_score(scorer.score_mod, raw, *scorer.indices((r0, r1), (j0, j1), q.device))
            s = modded.detach().clone()  # (B, H, n, blk), written to below
        else:
            s = raw
        allowed = _hidden_by_score(s, allowed, scorer)
        s = _masked(s, allowed, bias)
        p = s.sub_(lse[:, :, r0:r1, None]).clamp_min_(EXP_FLOOR).exp_()  # (B, H, n, blk): the weights again
        if allowed is not None:
            p = p.masked_fill_(~allowed, 0.0)
        grads.dv[:, :, j0:j1] += p.transpose(-2, -1) @ dout_r  # (B, H, blk, Dv)
        dp = dout_r @ vb.transpose(-2, -1)  # (B, H, n, blk)
        ds = p.mul_(dp.sub_(delta[:, :, r0:r1, None]))  # (B, H, n, blk): gradient of the (modified) scores
        if modded is not None:
            wanted = (raw, *closed_over)
            through = torch.autograd.grad(modded, wanted, ds, retain_graph=bool(closed_over), allow_unused=True)
            for acc, g in zip(closed_grads, through[1:], strict=True):
                if g is not None:
                    acc += g
            ds = through[0] if through[0] is not None else torch.zeros_like(ds)  # (B, H, n, blk)
            if allowed is not None:  # as FlexAttention: a score_mod singular where the mask hides (1 / (i - j) on
                ds = ds.masked_fill(~allowed, 0.0)  # the diagonal) gives 0 * inf there; hidden pairs have no gradient
        if w_v is None:
            dq_r += (ds @ kb) * scale  # (B, H, n, D)
            grads.dk[:, :, j0:j1] += (ds.transpose(-2, -1) @ qr) * scale  # (B, H, blk, D)
        else:
            assert features is not None and grads.dw is not None
            grads.dw.add_(torch.einsum("bhij,bhijd->d", ds, features))
            # d tanh = 1 - tanh^2, in place on the features slice to hold one slice only
            dpre = features.mul_(features).neg_().add_(1.0).mul_(ds[..., None]).mul_(w_v)  # (B,H,n,blk,D)
            dq_r += dpre.sum(dim=-2)  # (B, H, n, D)
            grads.dk[:, :, j0:j1] += dpre.sum(dim=-3)  # (B, H, blk, D)


def _block_mask(
    mask: BlockMask, span: Span, dtype: torch.dtype
) -> tuple[int, int, int, int, Tensor | None, Tensor | None] | None:
    """``(j0, j1, r0, r1, allowed, bias)`` of a span; when the mask is opaque (known only by looking), the rows
    narrowed to those that see some key of the block, and ``None`` when none does."""
    j0, j1, r0, r1, every = span
    allowed, bias = mask.tile(r0, r1, j0, j1, dtype, every=every)  # (B|1, H|1, n|1, blk) each, or None
    if allowed is None or not mask.opaque:
        return j0, j1, r0, r1, allowed, bias
    seen = allowed.any(dim=-1)  # (B|1, H|1, n|1)
    seen = seen.reshape(-1, seen.shape[-1]).any(dim=0)  # (n|1,): rows that see some key, in any example or head
    where = seen.nonzero()[:, 0]
    if not len(where):
        return None
    if allowed.shape[-2] == 1:  # the same for every row
        return j0, j1, r0, r1, allowed, bias
    a, z = int(where[0]), int(where[-1]) + 1
    allowed = allowed[..., a:z, :]  # (B|1, H|1, n', blk)
    bias = None if bias is None else bias[..., a:z, :]  # (B|1, H|1, n', blk)
    return j0, j1, r0 + a, r0 + z, allowed, bias


def _zeros_or_none(t: Tensor | None) -> Tensor | None:
    return None if t is None else torch.zeros_like(t)


def _scores(q: Tensor, k_blk: Tensor, w_v: Tensor | None, scale: float) -> tuple[Tensor, Tensor | None]:
    """Scores of one block, and for additive scoring the tanh features the backward pass needs."""
    if w_v is None:
        return (q @ k_blk.transpose(-2, -1)).mul_(scale), None  # (B, H, Lq, blk)
    return additive_scores(q, k_blk, w_v)  # (B, H, Lq, blk), (B, H, Lq, blk, D)


def _hidden_by_score(s: Tensor, allowed: Tensor | None, scorer: Scorer) -> Tensor | None:
    """A score_mod's ``-inf`` hides the key (FlexAttention's rule, and the reference's): it joins ``allowed``, so
    that a row it hides entirely gives zeros, whatever ``EXP_FLOOR`` makes of ``exp(-inf)``."""
    if scorer.score_mod is None:
        return allowed
    hidden = torch.isneginf(s)  # (B, H, n, blk)
    if not bool(hidden.any()):
        return allowed
    return ~hidden if allowed is None else allowed & ~hidden  # (B, H, n, blk)


def _masked(s: Tensor, allowed: Tensor | None, bias: Tensor | None) -> Tensor:
    """Add the bias and fill disallowed scores with the finite ``finfo.min`` (no ``inf - inf`` later), in place."""
    if bias is not None:
        s = s.add_(bias)
    if allowed is not None:
        s = s.masked_fill_(~allowed, torch.finfo(s.dtype).min)
    return s
