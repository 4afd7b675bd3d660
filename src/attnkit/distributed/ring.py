"""Ring attention: exact attention over a sequence split across the ranks of a ``torch.distributed`` group.

Each rank holds a shard of the queries, keys and values along the sequence (:mod:`attnkit.distributed.sequence`
says which positions). The key/value block of every rank travels once around the ring: at step ``s`` rank ``r``
holds the block of rank ``r - s``, folds it into its queries' online softmax (the running max, normaliser and
output of :mod:`attnkit.backends.chunked`, in float32 or float64), and meanwhile sends that block on to rank
``r + 1`` and receives the next from rank ``r - 1``. ``W`` ranks, ``W - 1`` sends per forward::

    step 0      step 1      step 2          rank r holds block (r - step) mod W
    r0: kv0     r0: kv2     r0: kv1
    r1: kv1     r1: kv0     r1: kv2
    r2: kv2     r2: kv1     r2: kv0

The backward pass goes round the same ring: blocks travel again, each rank adds its queries' share of the
block's gradient to a gradient buffer that travels with the block and arrives home after the last step. No
rank ever holds more than two key/value blocks and three gradient blocks, and within a block scores are computed
``chunked.current_settings().block_size`` keys at a time, so memory per rank is linear in ``L / W``.

Only (query, key) pairs that the masks allow are scored: with ``is_causal`` and the zig-zag layout every rank
scores about the same number of pairs (see :mod:`attnkit.distributed.sequence`).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
from torch import Tensor

from attnkit import mods
from attnkit.backends import chunked
from attnkit.backends.chunked import Grads, RunningSoftmax, Scorer, accumulate, accumulate_grads, key_blocks
from attnkit.backends.common import repeat_kv
from attnkit.distributed import comm
from attnkit.distributed.sequence import LAYOUTS, check_layout, length, positions, segments
from attnkit.functional import check_qkv, check_scale
from attnkit.masks import as_lengths, compute_dtype, short

__all__ = ["ring_attention"]

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
) -> Tensor:
    """This rank's shard of ``softmax(q k^T * scale, masked) v`` over the whole sequence.

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
            :data:`~attnkit.distributed.comm.DEFAULT_TIMEOUT` (5 minutes) when ``None``.

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
    """
    plan = _agree(comm.Ring(group), q, k, v, valid_lens, is_causal, scale, layout, timeout, refused=None)
    return _RingAttention.apply(q, k, v, plan)


# --- agreeing before the first exchange --------------------------------------------------------------------

# Everything one rank says about its call; the _AGREED fields must be equal on every rank.
_FIELDS = ("B", "H", "Hkv", "D", "Dv", "Lq_r", "Lk_r", "dtype", "is_causal", "layout", "scale", "lens", "grad")
_AGREED = {
    "B": "the batch size",
    "H": "the number of query heads",
    "Hkv": "the number of key/value heads",
    "D": "the head dim",
    "Dv": "the value head dim",
    "dtype": "the dtype",
    "is_causal": "is_causal",
    "layout": "the layout",
    "scale": "the scale",
    "lens": "valid_lens",
    "grad": "whether gradients are needed",
}


@dataclass(frozen=True)
class _Plan:
    """What every rank agreed on, and where this rank's positions are."""

    ring: comm.Ring
    timeout: timedelta  # for every wait on another rank
    q_ranges: list[list[tuple[int, int]]]  # per rank: the [start, stop) query positions it holds
    k_ranges: list[list[tuple[int, int]]]  # per rank: the same for keys and values
    offset: int  # Lk - Lq: query i sees key j <= i + offset when causal
    is_causal: bool
    valid_lens: Tensor | None  # (B,) int64
    key_limit: int  # no query sees a key at or past this position (max valid_lens, or Lk)
    scale: float
    block: int  # keys scored at a time inside a block


def _agree(
    ring: comm.Ring,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    valid_lens: Tensor | None,
    is_causal: bool,
    scale: float | None,
    layout: str,
    timeout: float | timedelta | None,
    *,
    refused: str | None,
) -> _Plan:
    """Check this rank's inputs, all-gather what each rank holds, and check that the ranks agree.

    A rank whose own inputs are wrong still joins the all-gather (flagged), so that every rank raises at once
    instead of the others waiting for blocks that never come. ``refused`` is a caller's reason to refuse this
    rank's call (:class:`RingMultiHeadAttention`'s), raised as a ``ValueError`` in the same way.
    """
    error: Exception | None = None
    mine: dict[str, int] | None = None
    wait = comm.DEFAULT_TIMEOUT
    try:
        wait = comm.as_timeout(timeout)
        if refused is not None:
            raise ValueError(refused)
        mine = _describe(q, k, v, valid_lens, is_causal, scale, layout)
    except Exception as e:  # noqa: BLE001 - every rank must hear of it; gather_checked raises it here
        error = e
    rows = comm.gather_checked(
        None if mine is None else [mine[f] for f in _FIELDS],
        error,
        size=len(_FIELDS),
        who="ring_attention",
        group=ring.group,
        timeout=wait,
        device=q.device if isinstance(q, Tensor) else torch.device("cpu"),
    )
    assert mine is not None  # gather_checked raised otherwise
    theirs = [dict(zip(_FIELDS, row, strict=True)) for row in rows]
    for r, other in enumerate(theirs):
        for field, what in _AGREED.items():
            if other[field] != mine[field]:
                raise ValueError(
                    f"ring_attention: rank {r} and rank {ring.rank} disagree on {what}: "
                    f"rank {r} has {_show(field, other)}, rank {ring.rank} has {_show(field, mine, valid_lens)}"
                )
    num_queries = sum(t["Lq_r"] for t in theirs)
    num_keys = sum(t["Lk_r"] for t in theirs)
    layout_name = LAYOUTS[mine["layout"]]
    q_ranges = segments(num_queries, ring.size, layout_name)
    k_ranges = segments(num_keys, ring.size, layout_name)
    for r, other in enumerate(theirs):
        for name, n, ranges, total in (
            ("queries", "Lq_r", q_ranges, num_queries),
            ("keys", "Lk_r", k_ranges, num_keys),
        ):
            expected = length(ranges[r])
            if other[n] != expected:
                raise ValueError(
                    f"ring_attention: rank {r} holds {other[n]} {name}, but the {layout_name} split of {total} "
                    f"positions over {ring.size} ranks gives it {expected} (shard with shard_sequence(layout="
                    f"{layout_name!r})); ranks hold {[t[n] for t in theirs]}"
                )
    lens = None
    key_limit = num_keys
    if valid_lens is not None:
        lens = as_lengths(valid_lens, "valid_lens", num_keys)  # now that Lk is known: at most Lk
        key_limit = int(lens.max()) if lens.numel() else 0
    return _Plan(
        ring=ring,
        timeout=wait,
        q_ranges=q_ranges,
        k_ranges=k_ranges,
        offset=num_keys - num_queries,
        is_causal=is_causal,
        valid_lens=lens,
        key_limit=key_limit,
        scale=_from_bits(mine["scale"]),
        block=chunked.current_settings().block_size,
    )


def _describe(
    q: Tensor, k: Tensor, v: Tensor, valid_lens: Tensor | None, is_causal: bool, scale: float | None, layout: str
) -> dict[str, int]:
    """This rank's call as integers, after the checks that need no other rank."""
    if check_qkv(q, k, v):
        raise ValueError(
            f"ring_attention takes (B, H, L_r, D) inputs, got 3 dims: q {tuple(q.shape)}, k {tuple(k.shape)}, "
            f"v {tuple(v.shape)}; add a head axis with q.unsqueeze(1)"
        )
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {is_causal!r}")
    check_layout(layout)
    B, H, Lq_r, D = q.shape
    Hkv, Lk_r, Dv = k.shape[1], k.shape[2], v.shape[3]
    scale = check_scale(D**-0.5 if scale is None else scale)  # the rule of the single-process functions
    lens_hash = 0
    if valid_lens is not None:
        if not isinstance(valid_lens, Tensor) or valid_lens.shape != (B,):
            shape = tuple(valid_lens.shape) if isinstance(valid_lens, Tensor) else type(valid_lens).__name__
            raise ValueError(
                f"ring_attention takes valid_lens of shape (B,) = ({B},), in global positions, got {shape}"
            )
        lens = as_lengths(valid_lens, "valid_lens", 2**62, q.device)  # the upper bound is checked once Lk is known
        lens_hash = hash(tuple(lens.tolist()))  # the same tensor on every rank: compare a digest, not B values
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    return {
        "B": B,
        "H": H,
        "Hkv": Hkv,
        "D": D,
        "Dv": Dv,
        "Lq_r": Lq_r,
        "Lk_r": Lk_r,
        "dtype": comm.dtype_code(q.dtype),
        "is_causal": int(is_causal),
        "layout": LAYOUTS.index(layout),
        "scale": _to_bits(scale),
        "lens": lens_hash,
        "grad": int(needs_grad),
    }


def _show(field: str, f: dict[str, int], valid_lens: Tensor | None = None) -> str:
    """One rank's value of ``field``, as the user would write it (only a digest of another rank's
    ``valid_lens`` travels: this rank's own are shown when given)."""
    if field in ("B", "H", "Hkv", "D", "Dv"):
        return f"q {(f['B'], f['H'], f['Lq_r'], f['D'])}, k {(f['B'], f['Hkv'], f['Lk_r'], f['D'])}, v " + str(
            (f["B"], f["Hkv"], f["Lk_r"], f["Dv"])
        )
    if field == "dtype":
        return comm.dtype_name(f["dtype"])
    if field == "layout":
        return repr(LAYOUTS[f["layout"]])
    if field == "scale":
        return repr(_from_bits(f["scale"]))
    if field == "is_causal" or field == "grad":
        return str(bool(f[field]))
    if f["lens"] == 0:
        return "no valid_lens"
    return "other values" if valid_lens is None else short(valid_lens)


def _to_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _from_bits(n: int) -> float:
    return struct.unpack("<d", struct.pack("<q", n))[0]


# --- the ring ------------------------------------------------------------------------------------------------


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, plan: _Plan) -> Tensor:  # type: ignore[override]
        qf = _zero_dead_rows(q.to(compute_dtype(q.dtype)), plan)  # (B, H, Lq_r, D)
        state = RunningSoftmax.start(qf, v.shape[-1])
        for _, src, kv in _around(plan, _pack(k, v, plan), "forward"):
            _forward_block(state, qf, kv, src, plan)
        out, lse = state.result()  # (B, H, Lq_r, Dv), (B, H, Lq_r)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan = plan
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        plan: _Plan = ctx.plan
        ring = plan.ring
        qf, dout = _zero_dead_rows(q.to(out.dtype), plan), dout.to(out.dtype)  # (B, H, Lq_r, D), (B, H, Lq_r, Dv)
        delta = (dout * out).sum(dim=-1)  # (B, H, Lq_r): sum_j p_ij dp_ij, the softmax Jacobian's row term
        dq = torch.zeros_like(qf)  # (B, H, Lq_r, D)
        pending: tuple[list, Tensor, Tensor] | None = None  # the gradient exchange under way: works, sent, received
        for step, src, kv in _around(plan, _pack(k, v, plan), "backward"):
            part = kv.new_zeros(kv.shape, dtype=out.dtype)  # (B, Hkv, Lb, D + Dv): this rank's share of dk, dv
            _backward_block(dq, part, qf, kv, src, plan, lse, dout, delta)
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


def _around(plan: _Plan, kv: Tensor, phase: str) -> Iterator[tuple[int, int, Tensor]]:
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


def _gradient_step(plan: _Plan, step: int) -> str:
    ring = plan.ring
    return (
        f"ring_attention backward, gradient step {step + 1} of {ring.size}: sending the key/value gradients of "
        f"rank {(ring.rank - step) % ring.size} to rank {(ring.rank + 1) % ring.size}, receiving those of rank "
        f"{(ring.rank - step - 1) % ring.size} from rank {(ring.rank - 1) % ring.size}"
    )


def _zero_dead_rows(q: Tensor, plan: _Plan) -> Tensor:
    """``q`` with the queries that may see no key zeroed (an example with ``valid_lens`` 0, or a causal query
    before the first key), so that what they hold, NaN included, never reaches ``dk`` through ``0 * NaN``; their
    own outputs and gradients are zero anyway."""
    live: Tensor | None = None
    if plan.valid_lens is not None:
        live = (plan.valid_lens > 0).view(-1, 1, 1, 1)  # (B, 1, 1, 1)
    if plan.is_causal and plan.offset < 0:
        rows = positions(plan.q_ranges[plan.ring.rank], q.device) + plan.offset >= 0  # (Lq_r,)
        live = rows.view(1, 1, -1, 1) if live is None else live & rows.view(1, 1, -1, 1)  # (B|1, 1, Lq_r, 1)
    if live is None or bool(live.all()):
        return q
    return torch.where(live, q, torch.zeros((), dtype=q.dtype, device=q.device))  # (B, H, Lq_r, D)


def _pack(k: Tensor, v: Tensor, plan: _Plan) -> Tensor:
    """This rank's keys and values as one tensor, so each step is one send; keys no query sees are zeroed, so
    that whatever padding holds (NaN included) never reaches the output or the gradients."""
    kv = torch.cat([k, v], dim=-1)  # (B, Hkv, Lk_r, D + Dv)
    if plan.valid_lens is not None:
        keys = positions(plan.k_ranges[plan.ring.rank], k.device)  # (Lk_r,)
        dead = keys >= plan.valid_lens[:, None]  # (B, Lk_r)
        kv = kv.masked_fill_(dead[:, None, :, None], 0.0)
    return kv


def _forward_block(state: RunningSoftmax, q: Tensor, kv: Tensor, src: int, plan: _Plan) -> None:
    span = _span(plan, src)
    if span is None:
        return  # no query of this rank sees any key of this block
    (r0, r1), (c0, c1) = span
    kb, vb = _split(kv, q, c0, c1)  # (B, H, Lb', D), (B, H, Lb', Dv)
    mask = _StepMask(plan, r0, r1, src, c0, c1, q.device)
    spans = key_blocks(mask, r1 - r0, (0, c1 - c0), plan.block)
    accumulate(state.rows(r0, r1), q[:, :, r0:r1], kb, vb, mask, Scorer(None, plan.scale), spans)


def _backward_block(
    dq: Tensor,
    part: Tensor,
    q: Tensor,
    kv: Tensor,
    src: int,
    plan: _Plan,
    lse: Tensor,
    dout: Tensor,
    delta: Tensor,
) -> None:
    """Add this rank's gradients through block ``src`` to ``dq`` and to ``part`` (``dk, dv`` packed)."""
    span = _span(plan, src)
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
    mask = _StepMask(plan, r0, r1, src, c0, c1, q.device)
    grads = Grads(dq[:, :, rows], dk, dv, None)
    spans = key_blocks(mask, r1 - r0, (0, c1 - c0), plan.block)
    accumulate_grads(
        grads,
        q[:, :, rows],
        kb,
        vb,
        mask,
        Scorer(None, plan.scale),
        spans,
        lse[:, :, rows],
        dout[:, :, rows],
        delta[:, :, rows],
    )
    if Hkv != H:
        part[:, :, c0:c1, :D] += dk.unflatten(1, (Hkv, H // Hkv)).sum(dim=2)  # (B, Hkv, Lb', D)
        part[:, :, c0:c1, D:] += dv.unflatten(1, (Hkv, H // Hkv)).sum(dim=2)  # (B, Hkv, Lb', Dv)


def _split(kv: Tensor, q: Tensor, c0: int, c1: int) -> tuple[Tensor, Tensor]:
    """Keys and values ``[c0, c1)`` of a packed block, one per query head, in the compute dtype of ``q``."""
    D = q.shape[-1]
    block = kv[:, :, c0:c1].to(q.dtype)  # (B, Hkv, Lb', D + Dv)
    return repeat_kv(block[..., :D], q.shape[1]), repeat_kv(block[..., D:], q.shape[1])  # (B, H, Lb', D|Dv)


def _span(plan: _Plan, src: int) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """The rows of this rank's queries and the columns of block ``src`` that hold every allowed pair, or
    ``None`` when the masks allow none. With the zig-zag layout and a causal mask this is half the block on
    every step but the first, which is what balances the work."""
    rows: list[int] = []
    cols: list[int] = []
    qa = 0
    for q0, q1 in plan.q_ranges[plan.ring.rank]:
        ka = 0
        for k0, k1 in plan.k_ranges[src]:
            last, first_row = min(k1, plan.key_limit), q0  # keys [k0, last) are seen by queries [first_row, q1)
            if plan.is_causal:
                last = min(last, q1 + plan.offset)  # the last query, q1 - 1, sees keys up to q1 - 1 + offset
                first_row = max(q0, k0 - plan.offset)  # queries before k0 - offset see none of them
            if k0 < last and first_row < q1:
                rows += [qa + first_row - q0, qa + q1 - q0]
                cols += [ka, ka + last - k0]
            ka += k1 - k0
        qa += q1 - q0
    return ((min(rows), max(rows)), (min(cols), max(cols))) if rows else None


class _StepMask:
    """Which of queries ``[r0, r1)`` of this rank may see which keys ``[c0, c1)`` of block ``src``, by their
    positions in the whole sequence, with ``tile`` and ``tiles`` as :class:`attnkit.masks.Mask` (in indices
    local to these rows and keys)."""

    opaque = False  # the index ranges say everything

    def __init__(self, plan: _Plan, r0: int, r1: int, src: int, c0: int, c1: int, device: torch.device) -> None:
        self.valid_lens = None if plan.valid_lens is None else plan.valid_lens.view(-1, 1, 1, 1)  # (B, 1, 1, 1)
        self.queries = positions(plan.q_ranges[plan.ring.rank], device)[r0:r1, None]  # (Lq', 1)
        self.keys = positions(plan.k_ranges[src], device)[c0:c1]  # (Lb',)
        self.is_causal, self.offset = plan.is_causal, plan.offset
        # on the host, to plan blocks without waiting for the device; positions ascend in both layouts
        self.host_queries = positions(plan.q_ranges[plan.ring.rank])[r0:r1]  # (Lq',)
        self.host_keys = positions(plan.k_ranges[src])[c0:c1]  # (Lb',)
        self.host_lens = None if plan.valid_lens is None else plan.valid_lens.detach().cpu()  # (B,)

    def tiles(self, rows: Tensor, cols: Tensor) -> mods.Tiles:
        p0, p1 = self.host_queries[rows[:, 0]][:, None], self.host_queries[rows[:, 1] - 1][:, None]  # (nq, 1)
        k0, k1 = self.host_keys[cols[:, 0]][None], self.host_keys[cols[:, 1] - 1][None]  # (1, nk)
        known = mods.Tiles(
            torch.ones(len(rows), len(cols), dtype=torch.bool), torch.ones(len(rows), len(cols), dtype=torch.bool)
        )
        if self.host_lens is not None and self.host_lens.numel():
            known = known & mods.Tiles(some=k0 < self.host_lens.max(), every=k1 < self.host_lens.min())
        if self.is_causal:
            known = known & mods.Tiles(some=k0 <= p1 + self.offset, every=k1 <= p0 + self.offset)
        return known

    def tile(
        self, r0: int, r1: int, j0: int, j1: int, dtype: torch.dtype = torch.float32, *, every: bool = False
    ) -> tuple[Tensor | None, Tensor | None]:
        if every:
            return None, None
        keys = self.keys[j0:j1]  # (blk,)
        allowed = None if self.valid_lens is None else keys < self.valid_lens  # (B, 1, 1, blk)
        if self.is_causal:
            causal = keys <= self.queries[r0:r1] + self.offset  # (n, blk)
            allowed = causal if allowed is None else allowed & causal  # (B, 1, n, blk)
        return allowed, None


def _block_buffer(plan: _Plan, like: Tensor, src: int, dtype: torch.dtype) -> Tensor:
    """An empty ``(B, Hkv, Lk_src, D + Dv)`` tensor to receive rank ``src``'s block (or its gradient) into."""
    B, Hkv, _, features = like.shape
    return like.new_empty((B, Hkv, length(plan.k_ranges[src]), features), dtype=dtype)  # (B, Hkv, Lk_src, D + Dv)
