"""The online softmax over blocks of keys (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022), in torch ops:
what the tile engine's pure-torch implementation runs (:mod:`attnkit.backends.tiles.online`), what ring attention
runs on each rank's blocks (:mod:`attnkit.distributed`), and the exact backward a fused kernel hands over to where its
own would meet ``0 * inf`` (:func:`exact_grads`).

Blocks of keys come with the rows that may see them (:func:`attnkit.plan.key_blocks`, from index ranges alone).
:func:`accumulate` folds each block into a :class:`RunningSoftmax` (a running row maximum ``m``, normaliser ``l``
and unnormalised output ``acc``), and :func:`accumulate_grads` adds each block's gradients, recomputing its weights
from the row log-sum-exp. Only one ``rows x block`` slice of scores (``rows x block x D`` features for additive
scoring) is alive at a time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from attnkit import mods
from attnkit.backends.common import additive_scores, repeat_kv
from attnkit.backends.contract import scores_bounded
from attnkit.plan import Span, key_blocks

__all__ = [
    "EXP_FLOOR",
    "BlockMask",
    "Grads",
    "LogSumExp",
    "RunningSoftmax",
    "Scorer",
    "accumulate",
    "accumulate_grads",
    "exact_grads",
]

# B batch, H heads, Lq/Lk query/key length, D head dim, Dv value head dim, blk keys in one block, n rows of a span

# Keys of a block in :func:`exact_grads`.
EXACT_BLOCK = 128

# exp() of a score this far below its row's largest is taken as exp(EXP_FLOOR) = 1.8e-35: far below what float32 or
# float64 resolve beside the largest term (1), and 4-6x faster on CPUs, whose vector exp leaves its fast path for
# inputs that underflow (masked scores, filled with finfo.min, then are zeroed). benchmarks/flex.py, "window".
EXP_FLOOR = -80.0


@dataclass(frozen=True)
class Scorer:
    """How the scores of a block are made: ``scale * q . k`` (``w_v`` None) or ``w_v . tanh(q + k)``, then the
    ``score_mod``, called with the block's indices (``batch`` and ``heads`` for ``b`` and ``h``); ``protected``:
    the memory the score_mod reads from outside, never written to (:func:`attnkit.mods.evaluate.protected_storages`)."""

    w_v: Tensor | None
    scale: float
    score_mod: mods.ScoreFn | None = None
    batch: int = 1
    heads: int = 1
    protected: frozenset[int] | None = frozenset()
    finite: bool = False  # no score can be infinite (the inputs' bound): blocks need no look for -inf

    def __call__(
        self, q: Tensor, k_blk: Tensor, rows: tuple[int, int], cols: tuple[int, int]
    ) -> tuple[Tensor, Tensor | None]:
        """Scores ``(B, H, n, blk)`` of queries ``rows`` against keys ``cols``, and the tanh features of additive
        scoring (for the backward pass)."""
        s, features = _scores(q, k_blk, self.w_v, self.scale)  # (B, H, n, blk)
        if self.score_mod is not None:
            s = mods.evaluate_score(
                self.score_mod, s, *self.indices(rows, cols, q.device), protected=self.protected
            )  # (B, H, n, blk)
        return s, features

    def indices(self, rows: tuple[int, int], cols: tuple[int, int], device: torch.device) -> tuple[Tensor, ...]:
        return mods.indices(self.batch, self.heads, rows, cols, device)


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


# Every row's log-sum-exp within this of 0: one term holds it (:meth:`LogSumExp.folded`), rounded by at most half an
# ulp of 2^8 (2^-16 in float32, below the 3e-5 the engines declare for a gradient), and each block of the backward
# pass is spared a subtraction.
FOLD = 2.0**8


class LogSumExp(NamedTuple):
    """Each row's log-sum-exp as two terms, ``top + rest``: its running maximum (a score, or the sink's logit) and
    the log of its normaliser; both 0 in a row that summed nothing. The backward pass subtracts one, then the other,
    from a block's scores: their float sum can lose ``rest``, as in a row whose scores are all about -1e30 in
    float32, and weights made from the sum would then be up to ``Lk`` times too large. ``rest`` ``None``: the sum is
    ``top`` (:meth:`folded`)."""

    top: Tensor  # (B, H, Lq)
    rest: Tensor | None  # (B, H, Lq)

    def total(self) -> Tensor:
        """The log-sum-exp ``(B, H, Lq)`` as one tensor (a float may round ``rest`` away)."""
        return self.top if self.rest is None else self.top + self.rest

    def folded(self) -> LogSumExp:
        """The two terms as one where every row's sum lies within ``FOLD`` of 0 (NaN rows aside), else as they are."""
        total = self.total()  # (B, H, Lq)
        return LogSumExp(total, None) if not bool((total.abs() >= FOLD).any()) else self

    def rows(self, r0: int, r1: int) -> LogSumExp:
        """Rows ``[r0, r1)``."""
        return LogSumExp(self.top[:, :, r0:r1], None if self.rest is None else self.rest[:, :, r0:r1])

    def weights(self, s: Tensor) -> Tensor:
        """``exp(s - lse)`` of scores ``s (B, H, n, blk)`` of these rows, in ``s``'s memory (at least
        ``exp(EXP_FLOOR)``: the caller zeroes hidden pairs)."""
        s = s.sub_(self.top[..., None])
        if self.rest is not None:
            s = s.sub_(self.rest[..., None])
        return s.clamp_min_(EXP_FLOOR).exp_()


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

    def result(self) -> tuple[Tensor, LogSumExp]:
        """The output ``(B, H, Lq, Dv)`` and the row log-sum-exp; both 0 in rows with no key (a row whose sum is
        NaN, from NaN in its own query, stays NaN, as in the reference: it is no row without keys)."""
        empty = self.l == 0  # (B, H, Lq): rows that summed no key
        l = self.l.clamp_min(torch.finfo(self.l.dtype).tiny)  # noqa: E741  (NaN stays NaN)
        out = torch.where(empty[..., None], 0.0, self.acc / l[..., None])  # (B, H, Lq, Dv)
        # 0 for empty rows keeps exp(s - lse) at exactly 0 there in the backward pass.
        lse = LogSumExp(torch.where(empty, 0.0, self.m), torch.where(empty, 0.0, torch.log(l)))  # (B, H, Lq) each
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
    mask: BlockMask,
    scorer: Scorer,
    spans: list[Span],
    saw_key: Tensor | None = None,
) -> None:
    """Fold the key blocks ``spans`` of ``k, v`` into ``state``, each into the rows that may see it.

    Args:
        state: the running softmax of the rows of ``q``, updated in place.
        q: ``(B, H, Lq, D)``; k: ``(B, H, Lk, D)``; v: ``(B, H, Lk, Dv)``, in the compute dtype.
        mask: ``mask.tile(r0, r1, j0, j1)`` says which rows may see which keys of ``k``.
        scorer: makes a block's scores; spans: from :func:`attnkit.plan.key_blocks`.
        saw_key: ``(B, H, Lq)`` booleans, where given: set in the rows that see some key (one whose score is not
            ``-inf``), in place (with sinks, ``state`` cannot tell a row that saw no key from one whose keys'
            weights underflowed).
    """
    for span in spans:
        seen = _block_mask(mask, span, q.dtype)
        if seen is None:
            continue  # a user's mask_mod or a boolean mask hides the whole block
        j0, j1, r0, r1, allowed, bias = seen
        rows = state.rows(r0, r1)  # (B, H, n, ...) views
        s, _ = scorer(q[:, :, r0:r1], k[:, :, j0:j1], (r0, r1), (j0, j1))  # (B, H, n, blk)
        allowed, unseen = _hidden_by_score(s, allowed, scorer)
        if saw_key is not None:
            rows_saw = saw_key[:, :, r0:r1]  # (B, H, n) view
            if allowed is None:
                rows_saw.fill_(True)
            else:
                rows_saw |= allowed.any(dim=-1)  # (B|1, H|1, n|1), broadcast
        vb = v[:, :, j0:j1]  # (B, H, blk, Dv)
        if unseen is not None:  # keys the score_mod hides from every query: their values never reach the output
            vb = torch.where(unseen[..., None], 0.0, vb)  # (B, H, blk, Dv)
        s = _masked(s, allowed, bias)
        m_new = torch.maximum(rows.m, s.amax(dim=-1))  # running row max
        alpha = torch.exp(rows.m - m_new)  # rescales what was summed so far
        p = s.sub_(m_new[..., None]).clamp_min_(EXP_FLOOR).exp_()  # (B, H, n, blk), in the scores' memory
        if allowed is not None:
            p = p.masked_fill_(~allowed, 0.0)  # exactly 0, also in rows with nothing allowed yet
        rows.l.mul_(alpha).add_(p.sum(dim=-1))  # running normaliser
        rows.acc.mul_(alpha[..., None]).add_(p @ vb)  # running unnormalised output
        rows.m.copy_(m_new)


def accumulate_grads(
    grads: Grads,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: BlockMask,
    scorer: Scorer,
    spans: list[Span],
    lse: LogSumExp,
    dout: Tensor,
    delta: Tensor,
    closed_over: Sequence[Tensor] = (),
    closed_grads: Sequence[Tensor] = (),
    emptied: Tensor | None = None,
) -> None:
    """Add the gradients through the key blocks ``spans`` to ``grads``, recomputing each block's weights from
    ``lse``.

    Args:
        grads: ``dq (B, H, Lq, D)``, ``dk (B, H, Lk, D)``, ``dv (B, H, Lk, Dv)``, ``dw (D,)``, added to in place.
        q, k, v, mask, scorer, spans: as in :func:`accumulate`.
        lse: the row log-sum-exp over *all* keys (from :meth:`RunningSoftmax.result`).
        dout: ``(B, H, Lq, Dv)``, the gradient of the output; delta: ``(B, H, Lq)``, ``(dout * out).sum(-1)``.
        closed_over: tensors the score_mod reads that need gradients; closed_grads: theirs, added to in place.
        emptied: ``(B, H, Lq)``, the rows the forward found with no key (a score's ``-inf`` hid every one): hidden
            here whatever their scores are now (the caller zeroes their queries and output gradients).
    """
    w_v, scale = scorer.w_v, scorer.scale
    # dout . v of a pair a row may not see could overflow (a huge value another row sees), and so could the row's
    # delta (|out| <= max|v|): its weight 0 times it would be NaN in that row's dq and in dk. Where the inputs bound
    # every such product (one read of each), no block need be looked at.
    guard = not scores_bounded(dout, v, 1.0, dout.dtype)
    for span in spans:
        seen = _block_mask(mask, span, q.dtype)
        if seen is None:
            continue
        j0, j1, r0, r1, allowed, bias = seen
        if emptied is not None:
            gone = emptied[:, :, r0:r1, None]  # (B, H, n, 1)
            allowed = ~gone if allowed is None else allowed & ~gone  # (B, H, n, blk|1)
        qr, dq_r, dout_r = q[:, :, r0:r1], grads.dq[:, :, r0:r1], dout[:, :, r0:r1]  # (B, H, n, D|Dv)
        kb, vb = k[:, :, j0:j1], v[:, :, j0:j1]  # (B, H, blk, D), (B, H, blk, Dv)
        raw, features = _scores(qr, kb, w_v, scale)  # (B, H, n, blk)
        modded = None
        if scorer.score_mod is not None:
            with torch.enable_grad():  # the score_mod's own graph, to take its gradient through
                raw = raw.detach().requires_grad_()
                # a copy to modify: a score_mod may write into its input (the reference allows it), not into a leaf
                modded = mods.evaluate_score(
                    scorer.score_mod, raw.clone(), *scorer.indices((r0, r1), (j0, j1), q.device)
                )  # (B, H, n, blk)
            s = modded.detach().clone()  # (B, H, n, blk), written to below
        else:
            s = raw
        allowed, unseen = _hidden_by_score(s, allowed, scorer)
        if unseen is not None:  # keys the score_mod hides from every query: nothing of them reaches a gradient
            kb = torch.where(unseen[..., None], 0.0, kb)  # (B, H, blk, D)
            vb = torch.where(unseen[..., None], 0.0, vb)  # (B, H, blk, Dv)
            if features is not None:
                features = features.masked_fill(unseen[..., None, :, None], 0.0)  # (B, H, n, blk, D)
        s = _masked(s, allowed, bias)
        p = lse.rows(r0, r1).weights(s)  # (B, H, n, blk): the weights again
        if allowed is not None:
            p = p.masked_fill_(~allowed, 0.0)
        grads.dv[:, :, j0:j1] += p.transpose(-2, -1) @ dout_r  # (B, H, blk, Dv)
        dp = dout_r @ vb.transpose(-2, -1)  # (B, H, n, blk)
        ds = p.mul_(dp.sub_(delta[:, :, r0:r1, None]))  # (B, H, n, blk): gradient of the (modified) scores
        if guard and allowed is not None:
            ds = ds.masked_fill_(~allowed, 0.0)  # a hidden pair's weight is 0, and so is its gradient (not 0 * inf)
        if modded is not None and not modded.requires_grad:
            ds = torch.zeros_like(ds)  # a score_mod whose result depends on nothing that needs a gradient (a table)
        elif modded is not None:
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


def _scores(q: Tensor, k_blk: Tensor, w_v: Tensor | None, scale: float) -> tuple[Tensor, Tensor | None]:
    """Scores of one block, and for additive scoring the tanh features the backward pass needs."""
    if w_v is None:
        return (q @ k_blk.transpose(-2, -1)).mul_(scale), None  # (B, H, Lq, blk)
    return additive_scores(q, k_blk, w_v)  # (B, H, Lq, blk), (B, H, Lq, blk, D)


def _hidden_by_score(s: Tensor, allowed: Tensor | None, scorer: Scorer) -> tuple[Tensor | None, Tensor | None]:
    """A score of ``-inf`` hides the key (FlexAttention's rule for a score_mod's, and the reference's for any): it
    joins ``allowed``, so that a row it hides entirely gives zeros, whatever ``EXP_FLOOR`` makes of ``exp(-inf)``.
    Also returns the keys of the block a score_mod leaves unseen by every row, ``(B|1, H|1, blk)``, or ``None``: no
    other row sees them (the block's rows are all that may), so they are keys no query may see, zeroed as the
    mask's dead keys are (as the reference does, only for a score_mod's ``-inf``)."""
    if scorer.score_mod is None and (scorer.finite or not s.numel() or bool(s.detach().amin() > float("-inf"))):
        return allowed, None  # (one read of the block where the inputs do not bound the scores; NaN: look)
    hidden = torch.isneginf(s)  # (B, H, n, blk)
    if not bool(hidden.any()):
        return allowed, None
    allowed = ~hidden if allowed is None else allowed & ~hidden  # (B, H, n, blk)
    if scorer.score_mod is None:
        return allowed, None
    unseen = ~allowed.any(dim=-2)  # (B, H, blk)
    return allowed, (unseen if bool(unseen.any()) else None)


def _masked(s: Tensor, allowed: Tensor | None, bias: Tensor | None) -> Tensor:
    """Add the bias and fill disallowed scores with the finite ``finfo.min`` (no ``inf - inf`` later), in place."""
    if bias is not None:
        s = s.add_(bias)
    if allowed is not None:
        s = s.masked_fill_(~allowed, torch.finfo(s.dtype).min)
    return s


def exact_grads(
    q: Tensor, k: Tensor, v: Tensor, mask: BlockMask, scorer: Scorer, lse: Tensor, out: Tensor, dout: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """The gradients of dot-product attention through this engine's backward, block by block, given the forward's
    output and row log-sum-exp: what a fused kernel's backward hands over where it would meet ``0 * inf`` at a pair
    a row may not see (:func:`attnkit.backends.common.kernel_backward_safe`).

    Args:
        q: ``(B, H, Lq, D)``; k: ``(B, Hkv, Lk, D)``; v: ``(B, Hkv, Lk, Dv)``, in the compute dtype.
        mask, scorer: the scores the forward computed (:func:`accumulate`); lse: ``(B, H, Lq)``, over them.
        out, dout: ``(B, H, Lq, Dv)``, the forward's output and its gradient.

    Returns:
        ``dq (B, H, Lq, D)``, ``dk (B, Hkv, Lk, D)``, ``dv (B, Hkv, Lk, Dv)``.
    """
    B, H, Lq, _ = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    kf, vf = repeat_kv(k, H), repeat_kv(v, H)  # (B, H, Lk, D), (B, H, Lk, Dv)
    grads = Grads(torch.zeros_like(q), torch.zeros_like(kf), torch.zeros_like(vf), None)
    delta = (dout * out).sum(dim=-1)  # (B, H, Lq): sum_j p_ij dp_ij, the softmax Jacobian's row term
    spans = key_blocks(mask, Lq, (0, Lk), EXACT_BLOCK)
    accumulate_grads(grads, q, kf, vf, mask, scorer, spans, LogSumExp(lse, None), dout, delta)
    dk = grads.dk.unflatten(1, (Hkv, H // Hkv)).sum(dim=2)  # (B, Hkv, Lk, D): each group's heads summed
    dv = grads.dv.unflatten(1, (Hkv, H // Hkv)).sum(dim=2)  # (B, Hkv, Lk, Dv)
    return grads.dq, dk, dv
