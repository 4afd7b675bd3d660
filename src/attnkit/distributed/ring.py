"""Ring attention: exact attention over a sequence split across the ranks of a ``torch.distributed`` group.

Each rank holds a shard of the queries, keys and values along the sequence (:mod:`attnkit.distributed.sequence`
says which positions). The key/value block of every rank travels once around the ring: at step ``s`` rank ``r``
holds the block of rank ``r - s``, folds it into its queries' online softmax (the running max, normaliser and
output of :mod:`attnkit.backends.tiles.online`, in float32 or float64), and meanwhile sends that block on to rank
``r + 1`` and receives the next from rank ``r - 1``. ``W`` ranks, ``W - 1`` sends per forward::

    step 0      step 1      step 2          rank r holds block (r - step) mod W
    r0: kv0     r0: kv2     r0: kv1
    r1: kv1     r1: kv0     r1: kv2
    r2: kv2     r2: kv1     r2: kv0

The backward pass goes round the same ring: blocks travel again, each rank adds its queries' share of the
block's gradient to a gradient buffer that travels with the block and arrives home after the last step. No
rank ever holds more than two key/value blocks and three gradient blocks, and within a block scores are computed
``tiles.online.current_settings().block_size`` keys at a time, so memory per rank is linear in ``L / W``.

Masks: ``valid_lens``, ``is_causal`` and a ``mask_mod`` (:mod:`attnkit.mods`: ``sliding_window``, ``document``,
``prefix_lm``, their combinations, or a function of the caller's), all in *whole-sequence* positions: a mask_mod
gets ``q_idx`` in ``[0, Lq)`` and ``kv_idx`` in ``[0, Lk)``, wherever the positions live, so ``document(ids)``
takes the whole sequence's ``(B, L)`` ids, the same tensor on every rank, and a built-in is aligned to the whole
lengths (bottom right, as :func:`attnkit.scaled_dot_product_attention`).

A ``score_mod`` (``softcap``, ``alibi``, a function of the caller's) also sees whole-sequence ``q_idx`` and
``kv_idx``; the ring takes no gradient of what it reads, so one that reads a tensor needing a gradient is refused.

Only (query, key) pairs that the masks may allow are scored. A step whose queries and keys the masks keep apart
(a causal block above the diagonal, a sliding window's far blocks, another document) is skipped whole: a built-in
says so from position ranges alone (:meth:`attnkit.mods.MaskMod.tiles`). Inside a step, the online softmax's block
plan skips the blocks the masks hide and evaluates a mask_mod only on blocks it does not know in full. A
caller's own mask_mod says nothing from ranges: every step is visited and its blocks evaluated (those it hides
entirely are not scored). With ``is_causal`` and the zig-zag layout every rank scores about the same number of
pairs (see :mod:`attnkit.distributed.sequence`).

What masked positions hold never reaches a result, as in the single-process backends: keys no query may see
(under all the masks together) are zeroed before they travel, and query rows that may see no key give zero
output and zero gradients, NaN in them included.

This module holds the ring math and its autograd; the ranks agree on the call before the first exchange in
:mod:`attnkit.distributed.agree`, and each step is planned in :mod:`attnkit.distributed.plan`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
from torch import Tensor

from attnkit import mods
from attnkit.backends.common import first_order_only, repeat_kv
from attnkit.backends.tiles.softmax import Grads, LogSumExp, RunningSoftmax, Scorer, accumulate, accumulate_grads
from attnkit.distributed import comm
from attnkit.distributed.agree import Request, agree
from attnkit.distributed.plan import Plan, StepMask, seen_keys, step_span
from attnkit.distributed.sequence import length, positions
from attnkit.masks import compute_dtype
from attnkit.plan import key_blocks

__all__ = ["RingAttention", "ring_attention"]

# B batch, H heads, Hkv key/value heads, D head dim, Dv value head dim, W ranks
# Lq/Lk whole-sequence lengths, Lq_r/Lk_r the positions this rank holds, Lb the key positions of one block

_KV, _DKV = 0, 1  # message tags: key/value blocks, their gradients


def ring_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group: object | None = None,
    valid_lens: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    layout: str = "contiguous",
    timeout: float | timedelta | None = None,
    mask_mod: mods.MaskFn | None = None,
    score_mod: mods.ScoreFn | None = None,
) -> Tensor:
    """This rank's shard of ``softmax(score_mod(q k^T * scale), masked) v`` over the whole sequence.

    Every rank of ``group`` calls it at the same time with its own shard; the shards are the pieces that
    :func:`~attnkit.distributed.shard_sequence` with the same ``layout`` gives (any ``L >= W``; when ``W`` does
    not divide ``L`` the first pieces are one position longer).

    Args:
        q: ``(B, H, Lq_r, D)``, this rank's queries.
        k: ``(B, Hkv, Lk_r, D)``, this rank's keys; ``Hkv`` divides ``H`` (grouped-query attention).
        v: ``(B, Hkv, Lk_r, Dv)``, this rank's values.
        group: a ``torch.distributed`` process group; the default group when ``None``.
        valid_lens: ``(B,)`` whole numbers in ``[0, Lk]``, *global* positions: every query of example ``b`` sees
            the keys at sequence positions below ``valid_lens[b]``. The same tensor on every rank.
        is_causal: query position ``i`` sees key position ``j`` when ``j <= i + Lk - Lq`` (as
            :func:`attnkit.scaled_dot_product_attention`), in global positions.
        scale: multiplies the scores; ``1 / sqrt(D)`` when ``None``.
        layout: ``"contiguous"`` or ``"zigzag"`` (balanced work with ``is_causal``).
        timeout: seconds (or a ``timedelta``) any one wait for another rank may take;
            ``attnkit.distributed.comm.DEFAULT_TIMEOUT`` (5 minutes) when ``None``.
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool``, True = may attend (:mod:`attnkit.mods`), with
            ``q_idx``, ``kv_idx`` *global* positions; combined with the other masks (all must allow a pair). A
            built-in is bound to the whole lengths ``Lq, Lk`` and lets steps and blocks it hides be skipped (a
            sliding window of ``w`` scores on the order of ``L * w`` pairs, not ``L^2 / 2``); ``document(ids)``
            takes the whole sequence's ``(B, L)`` ids. The same mask_mod on every rank (built-ins are compared; a
            function cannot be).
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score`` (:mod:`attnkit.mods`: ``softcap``,
            ``alibi``, or a function of the caller's), with ``q_idx``, ``kv_idx`` *global* positions. The same on
            every rank; one that reads a tensor needing a gradient is refused (the ring takes no gradient of it).

    Returns:
        ``(B, H, Lq_r, Dv)`` in the dtype of ``q``; differentiable in ``q, k, v`` (the backward pass runs the
        same ring, so every rank must also call ``backward``).

    Raises:
        ValueError, TypeError: on every rank, before any block is exchanged, when this rank's inputs do not fit
            together or the ranks disagree on shapes, dtypes or options; the message names the rank and what
            differs.
        RingError: when another rank fails, dies or stays silent for ``timeout``; the message names the step.

    Example:
        On each of the ranks (``torchrun --nproc-per-node 4 examples/ring_attention.py``)::

            q, k, v = (shard_sequence(x, layout="zigzag") for x in (q_all, k_all, v_all))
            out = ring_attention(q, k, v, is_causal=True, layout="zigzag")  # (B, H, L_r, Dv)
            out_all = gather_sequence(out, layout="zigzag")  # (B, H, L, Dv) on every rank

        A packed sequence (``ids`` ``(B, L)``, the whole sequence's, on every rank) with a sliding window::

            mask_mod = mods.and_masks(mods.document(ids), mods.sliding_window(4096))
            out = ring_attention(q, k, v, is_causal=True, layout="zigzag", mask_mod=mask_mod)
    """
    request = Request(q, k, v, valid_lens, is_causal, scale, layout, mask_mod, score_mod)
    plan = agree(comm.Ring(group), request, timeout, refused=None)
    return RingAttention.apply(q, k, v, plan)


# --- the ring ------------------------------------------------------------------------------------------------


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, plan: Plan) -> Tensor:  # type: ignore[override]
        qf = _zero_dead_rows(q.to(compute_dtype(q.dtype)), plan)  # (B, H, Lq_r, D)
        packed = _pack(k, v, plan)  # (B, Hkv, Lk_r, D + Dv)
        live_keys = None
        if plan.mask_mod is not None and not bool(packed.isfinite().all()):
            # Only a key that holds NaN or inf needs to be known unseen: a finite one adds exactly 0 to every sum.
            live_keys = seen_keys(plan, q.device)  # (B, H, Lk_r)
            packed = _zero_unseen(packed, live_keys)
        state = RunningSoftmax.start(qf, v.shape[-1])
        for _, src, kv in _around(plan, packed, "forward"):
            _forward_block(state, qf, kv, src, plan)
        out, lse = state.result()  # (B, H, Lq_r, Dv), (B, H, Lq_r) x 2
        lse = lse.folded()  # (B, H, Lq_r) and (B, H, Lq_r) or None
        # Rows that summed no key (a mask_mod may leave any row empty): exactly 0, as every allowed key adds a
        # positive weight to the normaliser; NaN (a live row's NaN query) is not 0 and stays live.
        # rows a mask_mod, a score_mod's -inf or a score that overflows to -inf hides from every key: dead, as rows
        # past valid_lens
        live_rows = state.l != 0  # (B, H, Lq_r)
        ctx.save_for_backward(q, k, v, out, *lse)
        ctx.plan, ctx.live_keys, ctx.live_rows = plan, live_keys, live_rows
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        first_order_only("ring")
        q, k, v, out, top, rest = ctx.saved_tensors
        lse = LogSumExp(top, rest)  # (B, H, Lq_r) x 2
        plan: Plan = ctx.plan
        ring = plan.ring
        # (B, H, Lq_r, D|Dv): a dead row's output gradient, NaN included, reaches nothing (its output is zeros)
        qf, dout = (_zero_dead_rows(t.to(out.dtype), plan, ctx.live_rows) for t in (q, dout))
        delta = (dout * out).sum(dim=-1)  # (B, H, Lq_r): sum_j p_ij dp_ij, the softmax Jacobian's row term
        dq = torch.zeros_like(qf)  # (B, H, Lq_r, D)
        # rows that summed no key stay hidden whatever their zeroed queries score now (a score_mod that hides by value)
        emptied = None if bool(ctx.live_rows.all()) else ~ctx.live_rows  # (B, H, Lq_r) or None
        pending: tuple[list, Tensor, Tensor] | None = None  # the gradient exchange under way: works, sent, received
        for step, src, kv in _around(plan, _pack(k, v, plan, ctx.live_keys), "backward"):
            part = kv.new_zeros(kv.shape, dtype=out.dtype)  # (B, Hkv, Lb, D + Dv): this rank's share of dk, dv
            _backward_block(dq, part, qf, kv, src, plan, lse, dout, delta, emptied)
            if pending is not None:  # what the previous ranks summed for this block so far
                comm.wait(pending[0], plan.timeout, _gradient_step(plan, step - 1), ring.parts())
                part += pending[2]
                pending = None  # the buffers sent and received: free before the next is made
            if ring.size == 1:
                pending = ([], part, part)
            else:
                incoming = _block_buffer(plan, kv, (src - 1) % ring.size, out.dtype)  # (B, Hkv, Lb', D + Dv)
                sending = ring.start(part, incoming, _DKV, timeout=plan.timeout, step=_gradient_step(plan, step))
                pending = (sending, part, incoming)
        assert pending is not None
        works, _, mine = pending  # (B, Hkv, Lk_r, D + Dv): the gradient of this rank's own block, home at last
        comm.wait(works, plan.timeout, _gradient_step(plan, ring.size - 1), ring.parts())
        D = k.shape[-1]
        dk, dv = mine[..., :D], mine[..., D:]  # (B, Hkv, Lk_r, D), (B, Hkv, Lk_r, Dv)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None


def _around(plan: Plan, kv: Tensor, phase: str) -> Iterator[tuple[int, int, Tensor]]:
    """Yield ``(step, src, block)`` for the ``W`` blocks in ring order, exchanging the next block while the
    caller computes with this one: ``W - 1`` sends of one packed key/value tensor each."""
    ring = plan.ring
    W = ring.size
    for step in range(W):
        src = (ring.rank - step) % W  # whose block this is
        works: list = []
        where = (
            f"ring_attention {phase}, step {step + 1} of {W - 1}: sending rank {src}'s keys and values to rank "
            f"{(ring.rank + 1) % W}, receiving rank {(src - 1) % W}'s from rank {(ring.rank - 1) % W}"
        )
        if step < W - 1:
            nxt = _block_buffer(plan, kv, (src - 1) % W, kv.dtype)  # (B, Hkv, Lb', D + Dv)
            works = ring.start(kv, nxt, _KV, timeout=plan.timeout, step=where)
        yield step, src, kv
        if works:
            comm.wait(works, plan.timeout, where, ring.parts())
            kv = nxt


def _gradient_step(plan: Plan, step: int) -> str:
    ring = plan.ring
    return (
        f"ring_attention backward, gradient step {step + 1} of {ring.size}: sending the key/value gradients of "
        f"rank {(ring.rank - step) % ring.size} to rank {(ring.rank + 1) % ring.size}, receiving those of rank "
        f"{(ring.rank - step - 1) % ring.size} from rank {(ring.rank - 1) % ring.size}"
    )


def _zero_dead_rows(q: Tensor, plan: Plan, live: Tensor | None = None) -> Tensor:
    """``q`` (the queries, or the output's gradient) with the rows that may see no key zeroed (an example with
    ``valid_lens`` 0, a causal query before the first key, and with ``live`` ``(B, H, Lq_r)`` given, the rows it
    calls dead: those that summed no key in the forward pass), so that what they hold, NaN included, never reaches
    ``dk`` or ``dv`` through ``0 * NaN``; their own outputs and gradients are zero anyway. (In the forward pass
    such a row is harmless: its scores are all replaced by the fill value and its weights are exactly 0.)"""
    if live is not None:
        live = live[..., None]  # (B, H, Lq_r, 1)
    if plan.valid_lens is not None:
        lens = (plan.valid_lens > 0).view(-1, 1, 1, 1)  # (B, 1, 1, 1)
        live = lens if live is None else live & lens
    if plan.is_causal and plan.offset < 0:
        rows = positions(plan.q_ranges[plan.ring.rank], q.device) + plan.offset >= 0  # (Lq_r,)
        live = rows.view(1, 1, -1, 1) if live is None else live & rows.view(1, 1, -1, 1)  # (B|1, H|1, Lq_r, 1)
    if live is None or bool(live.all()):
        return q
    return torch.where(live, q, torch.zeros((), dtype=q.dtype, device=q.device))  # (B, H, Lq_r, D)


def _pack(k: Tensor, v: Tensor, plan: Plan, live: Tensor | None = None) -> Tensor:
    """This rank's keys and values as one tensor, so each step is one send; keys no query sees are zeroed (past
    ``valid_lens``, and with ``live`` ``(B, H, Lk_r)`` given, those it calls dead), so that whatever padding
    holds (NaN included) never reaches the output or the gradients."""
    kv = torch.cat([k, v], dim=-1)  # (B, Hkv, Lk_r, D + Dv)
    if plan.valid_lens is not None:
        keys = positions(plan.k_ranges[plan.ring.rank], k.device)  # (Lk_r,)
        dead = keys >= plan.valid_lens[:, None]  # (B, Lk_r)
        kv = kv.masked_fill_(dead[:, None, :, None], 0.0)
    return kv if live is None else _zero_unseen(kv, live)


def _zero_unseen(kv: Tensor, live: Tensor) -> Tensor:
    """``kv`` ``(B, Hkv, Lk_r, D + Dv)``, with the keys that ``live`` ``(B, H, Lk_r)`` calls unseen through every
    query head of their group zeroed, in place."""
    live = live.unflatten(1, (kv.shape[1], -1)).any(dim=2)  # (B, Hkv, Lk_r)
    return kv.masked_fill_(~live[..., None], 0.0)


def _forward_block(state: RunningSoftmax, q: Tensor, kv: Tensor, src: int, plan: Plan) -> None:
    span = step_span(plan, src)
    if span is None:
        return  # no query of this rank sees any key of this block
    (r0, r1), (c0, c1) = span
    kb, vb = _split(kv, q, c0, c1)  # (B, H, Lb', D), (B, H, Lb', Dv)
    mask = StepMask(plan, plan.q_ranges[plan.ring.rank], plan.k_ranges[src], (r0, r1), (c0, c1), q.device)
    spans = key_blocks(mask, r1 - r0, (0, c1 - c0), plan.block)
    accumulate(state.rows(r0, r1), q[:, :, r0:r1], kb, vb, mask, _scorer(plan, mask), spans)


def _backward_block(
    dq: Tensor,
    part: Tensor,
    q: Tensor,
    kv: Tensor,
    src: int,
    plan: Plan,
    lse: LogSumExp,
    dout: Tensor,
    delta: Tensor,
    emptied: Tensor | None,
) -> None:
    """Add this rank's gradients through block ``src`` to ``dq`` and to ``part`` (``dk, dv`` packed); ``emptied``:
    ``(B, H, Lq_r)``, the rows that summed no key in the forward, or ``None``."""
    span = step_span(plan, src)
    if span is None:
        return
    (r0, r1), (c0, c1) = span
    H, D = q.shape[1], q.shape[-1]
    Hkv = kv.shape[1]
    kb, vb = _split(kv, q, c0, c1)  # (B, H, Lb', D), (B, H, Lb', Dv)
    dk, dv = part[:, :, c0:c1, :D], part[:, :, c0:c1, D:]  # (B, Hkv, Lb', D), (B, Hkv, Lb', Dv)
    if Hkv != H:  # gradients per query head first, summed per key/value head below
        dk, dv = torch.zeros_like(kb), torch.zeros_like(vb)  # (B, H, Lb', D), (B, H, Lb', Dv)
    rows = slice(r0, r1)
    mask = StepMask(plan, plan.q_ranges[plan.ring.rank], plan.k_ranges[src], (r0, r1), (c0, c1), q.device)
    grads = Grads(dq[:, :, rows], dk, dv, None)
    spans = key_blocks(mask, r1 - r0, (0, c1 - c0), plan.block)
    accumulate_grads(
        grads,
        q[:, :, rows],
        kb,
        vb,
        mask,
        _scorer(plan, mask),
        spans,
        lse.rows(r0, r1),
        dout[:, :, rows],
        delta[:, :, rows],
        emptied=None if emptied is None else emptied[:, :, rows],
    )
    if Hkv != H:
        part[:, :, c0:c1, :D] += dk.unflatten(1, (Hkv, H // Hkv)).sum(dim=2)  # (B, Hkv, Lb', D)
        part[:, :, c0:c1, D:] += dv.unflatten(1, (Hkv, H // Hkv)).sum(dim=2)  # (B, Hkv, Lb', Dv)


@dataclass(frozen=True, kw_only=True)
class _StepScorer(Scorer):
    """A :class:`Scorer` whose score_mod sees whole-sequence positions: this step's query and key positions."""

    q_pos: Tensor  # (Lq',): the whole-sequence position of each of the step's query rows
    k_pos: Tensor  # (Lb',): the same for its keys

    def indices(self, rows: tuple[int, int], cols: tuple[int, int], device: torch.device) -> tuple[Tensor, ...]:
        b, h, _, _ = mods.indices(self.batch, self.heads, (0, 0), (0, 0), device)  # (B, 1, 1, 1), (1, H, 1, 1)
        q_idx = self.q_pos[rows[0] : rows[1]].view(1, 1, -1, 1)  # (1, 1, n, 1)
        kv_idx = self.k_pos[cols[0] : cols[1]].view(1, 1, 1, -1)  # (1, 1, 1, m)
        return b, h, q_idx, kv_idx


def _scorer(plan: Plan, mask: StepMask) -> Scorer:
    """How a step scores: ``scale * q . k``, then the agreed score_mod at whole-sequence positions."""
    if plan.score_mod is None:
        return Scorer(None, plan.scale)
    return _StepScorer(
        w_v=None,
        scale=plan.scale,
        score_mod=plan.score_mod,
        batch=plan.batch,
        heads=plan.heads,
        protected=plan.score_protected,
        q_pos=mask.queries.view(-1),
        k_pos=mask.keys.view(-1),
    )


def _split(kv: Tensor, q: Tensor, c0: int, c1: int) -> tuple[Tensor, Tensor]:
    """Keys and values ``[c0, c1)`` of a packed block, one per query head, in the compute dtype of ``q``."""
    D = q.shape[-1]
    block = kv[:, :, c0:c1].to(q.dtype)  # (B, Hkv, Lb', D + Dv)
    return repeat_kv(block[..., :D], q.shape[1]), repeat_kv(block[..., D:], q.shape[1])  # (B, H, Lb', D|Dv)


def _block_buffer(plan: Plan, like: Tensor, src: int, dtype: torch.dtype) -> Tensor:
    """An empty ``(B, Hkv, Lk_src, D + Dv)`` tensor to receive rank ``src``'s block (or its gradient) into."""
    B, Hkv, _, features = like.shape
    return like.new_empty((B, Hkv, length(plan.k_ranges[src]), features), dtype=dtype)  # (B, Hkv, Lk_src, D + Dv)
