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

Masks: ``valid_lens``, ``is_causal`` and a ``mask_mod`` (:mod:`attnkit.mods`: ``sliding_window``, ``document``,
``prefix_lm``, their combinations, or a function of the caller's), all in *whole-sequence* positions: a mask_mod
gets ``q_idx`` in ``[0, Lq)`` and ``kv_idx`` in ``[0, Lk)``, wherever the positions live, so ``document(ids)``
takes the whole sequence's ``(B, L)`` ids, the same tensor on every rank, and a built-in is aligned to the whole
lengths (bottom right, as :func:`attnkit.scaled_dot_product_attention`).

Only (query, key) pairs that the masks may allow are scored. A step whose queries and keys the masks keep apart
(a causal block above the diagonal, a sliding window's far blocks, another document) is skipped whole: a built-in
says so from position ranges alone (:meth:`attnkit.mods.MaskMod.tiles`). Inside a step, the chunked backend's
block plan skips the blocks the masks hide and evaluates a mask_mod only on blocks it does not know in full. A
caller's own mask_mod says nothing from ranges: every step is visited and its blocks evaluated (those it hides
entirely are not scored). With ``is_causal`` and the zig-zag layout every rank scores about the same number of
pairs (see :mod:`attnkit.distributed.sequence`).

What masked positions hold never reaches a result, as in the single-process backends: keys no query may see
(under all the masks together) are zeroed before they travel, and query rows that may see no key give zero
output and zero gradients, NaN in them included.
"""

from __future__ import annotations

import dataclasses
import functools
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import NamedTuple

import torch
from torch import Tensor

from attnkit import mods
from attnkit._checks import as_lengths, ranges, short
from attnkit.backends import chunked
from attnkit.backends.common import repeat_kv
from attnkit.backends.online import Grads, RunningSoftmax, Scorer, accumulate, accumulate_grads, key_blocks
from attnkit.distributed import comm
from attnkit.distributed.sequence import LAYOUTS, check_layout, length, positions, segments
from attnkit.functional import check_qkv, check_scale
from attnkit.masks import LIVENESS_BLOCK_ELEMENTS, LIVENESS_ROWS, compute_dtype

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
    mask_mod: mods.MaskFn | None = None,
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
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool``, True = may attend (:mod:`attnkit.mods`), with
            ``q_idx``, ``kv_idx`` *global* positions; combined with the other masks (all must allow a pair). A
            built-in is bound to the whole lengths ``Lq, Lk`` and lets steps and blocks it hides be skipped (a
            sliding window of ``w`` scores on the order of ``L * w`` pairs, not ``L^2 / 2``); ``document(ids)``
            takes the whole sequence's ``(B, L)`` ids. The same mask_mod on every rank (built-ins are compared; a
            function cannot be).

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
    request = Request(q, k, v, valid_lens, is_causal, scale, layout, mask_mod)
    plan = _agree(comm.Ring(group), request, timeout, refused=None)
    return _RingAttention.apply(q, k, v, plan)


class Request(NamedTuple):
    """One rank's call, as given: checked by :func:`_agree` against itself and the other ranks."""

    q: Tensor
    k: Tensor
    v: Tensor
    valid_lens: Tensor | None
    is_causal: bool
    scale: float | None
    layout: str
    mask_mod: mods.MaskFn | None = None


# --- agreeing before the first exchange --------------------------------------------------------------------

# Everything one rank says about its call; the _AGREED fields must be equal on every rank.
_FIELDS = (
    "B",
    "H",
    "Hkv",
    "D",
    "Dv",
    "Lq_r",
    "Lk_r",
    "dtype",
    "is_causal",
    "layout",
    "scale",
    "lens",
    "grad",
    "mask_mod",
)
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
    "mask_mod": "the mask_mod",
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
    mask_mod: mods.MaskFn | None = None  # a built-in bound to the whole lengths; q_idx, kv_idx global positions
    batch: int = 1  # B and H: the mask_mod's b and h
    heads: int = 1

    @property
    def num_queries(self) -> int:
        return sum(length(r) for r in self.q_ranges)

    @functools.cached_property
    def host_lens(self) -> Tensor | None:
        """``valid_lens`` on the host, to plan blocks without waiting for the device."""
        return None if self.valid_lens is None else self.valid_lens.detach().cpu()  # (B,)

    def tiles(self, rows: Tensor, cols: Tensor) -> mods.Tiles:
        """What the masks say, from the ranges alone, of the blocks of query positions ``rows`` ``(nq, 2)`` and key
        positions ``cols`` ``(nk, 2)`` (``[start, stop)`` in the whole sequence, CPU int64); see
        :class:`attnkit.mods.Tiles`."""
        p0, p1 = rows[:, :1], rows[:, 1:] - 1  # (nq, 1): first and last query position
        k0, k1 = cols[None, :, 0], cols[None, :, 1] - 1  # (1, nk): first and last key position
        known = mods.Tiles(
            torch.ones(len(rows), len(cols), dtype=torch.bool), torch.ones(len(rows), len(cols), dtype=torch.bool)
        )
        lens = self.host_lens
        if lens is not None and lens.numel():
            known = known & mods.Tiles(some=k0 < lens.max(), every=k1 < lens.min())
        if self.is_causal:
            known = known & mods.Tiles(some=k0 <= p1 + self.offset, every=k1 <= p0 + self.offset)
        if isinstance(self.mask_mod, mods.MaskMod):
            known = known & self.mask_mod.tiles(rows, cols)
        elif self.mask_mod is not None:  # a caller's function says nothing until it is evaluated
            known = known & mods.Tiles.unknown(len(rows), len(cols))
        return known


def _agree(ring: comm.Ring, request: Request, timeout: float | timedelta | None, *, refused: str | None) -> _Plan:
    """Check this rank's inputs, all-gather what each rank holds, and check that the ranks agree.

    A rank whose own inputs are wrong still joins the all-gather (flagged), so that every rank raises at once
    instead of the others waiting for blocks that never come. ``refused`` is a caller's reason to refuse this
    rank's call (:class:`RingMultiHeadAttention`'s), raised as a ``ValueError`` in the same way.
    """
    q, valid_lens, is_causal, mask_mod = request.q, request.valid_lens, request.is_causal, request.mask_mod
    error: Exception | None = None
    mine: dict[str, int] | None = None
    wait = comm.DEFAULT_TIMEOUT
    try:
        wait = comm.as_timeout(timeout)
        if refused is not None:
            raise ValueError(refused)
        mine = _describe(request)
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
                hint = ""
                if field == "mask_mod":
                    hint = " (a mask_mod sees whole-sequence positions: give every rank the same one)"
                raise ValueError(
                    f"ring_attention: rank {r} and rank {ring.rank} disagree on {what}: rank {r} has "
                    f"{_show(field, other)}, rank {ring.rank} has {_show(field, mine, valid_lens, mask_mod)}{hint}"
                )
    num_queries = sum(t["Lq_r"] for t in theirs)
    num_keys = sum(t["Lk_r"] for t in theirs)
    layout_name = LAYOUTS[mine["layout"]]
    q_ranges = segments(num_queries, ring.size, layout_name)
    k_ranges = segments(num_keys, ring.size, layout_name)
    for r, other in enumerate(theirs):
        for name, n, held, total in (
            ("queries", "Lq_r", q_ranges, num_queries),
            ("keys", "Lk_r", k_ranges, num_keys),
        ):
            expected = length(held[r])
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
    bound = None
    if mask_mod is not None:  # every rank agreed on its digest, so every rank binds it alike (or raises alike)
        try:
            bound = mods.bind(
                mask_mod,
                batch=mine["B"],
                heads=mine["H"],
                num_queries=num_queries,
                num_keys=num_keys,
                device=q.device,
            )
        except ValueError as e:
            raise ValueError(
                f"ring_attention on rank {ring.rank}: {e} (a mask_mod sees the whole sequence, {num_queries} "
                f"queries and {num_keys} keys, not one rank's shard)"
            ) from e
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
        mask_mod=bound,
        batch=mine["B"],
        heads=mine["H"],
    )


def _describe(request: Request) -> dict[str, int]:
    """This rank's call as integers, after the checks that need no other rank."""
    q, k, v, valid_lens, is_causal, scale, layout, mask_mod = request
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
    mods.check_callable("mask_mod", mask_mod)
    if isinstance(mask_mod, mods.MaskMod):
        for t in mask_mod.tensors():
            if t.device != q.device:
                raise ValueError(f"mask_mod {_mod_name(mask_mod)} holds a tensor on {t.device}, but q is on {q.device}")
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
        "mask_mod": _mod_digest(mask_mod),
    }


def _mod_digest(mask_mod: mods.MaskFn | None) -> int:
    """0: no mask_mod; 1: a function of the caller's (nothing to compare across processes); else a checksum of a
    built-in's kind, numbers and tensors (shapes and values), the same in every process."""
    if mask_mod is None:
        return 0
    if not isinstance(mask_mod, mods.MaskMod):
        return 1
    sums = [_checksum(t) for t in mask_mod.tensors()]
    return 2 + zlib.crc32(f"{_mod_name(mask_mod)} {sums}".encode())


def _checksum(t: Tensor) -> int:
    """A weighted sum of the 16-bit folds of a tensor's values: equal tensors give equal sums on any device, and
    no partial sum can overflow (below 2^32 a term, fewer than 2^31 terms)."""
    x = t.detach().flatten()  # (n,)
    x = x.double().view(torch.int64) if x.is_floating_point() else x.long()  # (n,) values or bit patterns
    x = (x ^ (x >> 16) ^ (x >> 32) ^ (x >> 48)) & 0xFFFF  # (n,)
    weights = torch.arange(x.numel(), device=x.device) % 65521 + 1  # (n,)
    return int((x * weights).sum())


def _mod_name(mask_mod: mods.MaskFn) -> str:
    """A built-in as the user would write it, tensors by their shapes: ``sliding_window(window=4)``."""
    if not dataclasses.is_dataclass(mask_mod):
        return getattr(mask_mod, "__name__", type(mask_mod).__name__)
    name, parts = type(mask_mod).__name__, []
    for field in dataclasses.fields(mask_mod):
        value = getattr(mask_mod, field.name)
        if field.name == "offset" or value is None:
            continue
        if field.name == "every_one":  # and_masks / or_masks
            name = "and_masks" if value else "or_masks"
        elif isinstance(value, Tensor):
            parts.append(f"{field.name} of shape {tuple(value.shape)}")
        elif isinstance(value, tuple):
            parts += [_mod_name(m) for m in value]
        else:
            parts.append(f"{field.name}={value!r}")
    return f"{name}({', '.join(parts)})"


def _show(field: str, f: dict[str, int], valid_lens: Tensor | None = None, mask_mod: mods.MaskFn | None = None) -> str:
    """One rank's value of ``field``, as the user would write it (only a digest of another rank's
    ``valid_lens`` and ``mask_mod`` travels: this rank's own are shown when given)."""
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
    if field == "mask_mod":
        if f[field] < 2:
            return ("no mask_mod", "a mask_mod function")[f[field]]
        return "another built-in mask_mod" if mask_mod is None else _mod_name(mask_mod)
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
        packed = _pack(k, v, plan)  # (B, Hkv, Lk_r, D + Dv)
        live_keys = None
        if plan.mask_mod is not None and not bool(packed.isfinite().all()):
            # Only a key that holds NaN or inf needs to be known unseen: a finite one adds exactly 0 to every sum.
            live_keys = _live_keys(plan, q.device)  # (B, H, Lk_r)
            packed = _zero_unseen(packed, live_keys)
        state = RunningSoftmax.start(qf, v.shape[-1])
        for _, src, kv in _around(plan, packed, "forward"):
            _forward_block(state, qf, kv, src, plan)
        out, lse = state.result()  # (B, H, Lq_r, Dv), (B, H, Lq_r)
        # Rows that summed no key (a mask_mod may leave any row empty): exactly 0, as every allowed key adds a
        # positive weight to the normaliser; NaN (a live row's NaN query) is not 0 and stays live.
        live_rows = None if plan.mask_mod is None else state.l != 0  # (B, H, Lq_r)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.plan, ctx.live_keys, ctx.live_rows = plan, live_keys, live_rows
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        plan: _Plan = ctx.plan
        ring = plan.ring
        qf, dout = _zero_dead_rows(q.to(out.dtype), plan, ctx.live_rows), dout.to(out.dtype)  # (B, H, Lq_r, D|Dv)
        delta = (dout * out).sum(dim=-1)  # (B, H, Lq_r): sum_j p_ij dp_ij, the softmax Jacobian's row term
        dq = torch.zeros_like(qf)  # (B, H, Lq_r, D)
        pending: tuple[list, Tensor, Tensor] | None = None  # the gradient exchange under way: works, sent, received
        for step, src, kv in _around(plan, _pack(k, v, plan, ctx.live_keys), "backward"):
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


def _zero_dead_rows(q: Tensor, plan: _Plan, live: Tensor | None = None) -> Tensor:
    """``q`` with the queries that may see no key zeroed (an example with ``valid_lens`` 0, a causal query
    before the first key, and with ``live`` ``(B, H, Lq_r)`` given, the rows it calls dead: those that summed no
    key in the forward pass), so that what they hold, NaN included, never reaches ``dk`` through ``0 * NaN``;
    their own outputs and gradients are zero anyway. (In the forward pass such a row is harmless: its scores are
    all replaced by the fill value and its weights are exactly 0.)"""
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


def _pack(k: Tensor, v: Tensor, plan: _Plan, live: Tensor | None = None) -> Tensor:
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


def _live_keys(plan: _Plan, device: torch.device) -> Tensor:
    """Which of this rank's keys some query of the whole sequence may see, ``(B, H, Lk_r)`` bool, under all the
    masks together (a mask_mod can leave a key unseen: a window ending before it, a document without queries).
    Asked only when a key holds NaN or inf (a finite key no query sees adds exactly 0 to every sum).

    Scanned in tiles of at most :data:`~attnkit.masks.LIVENESS_BLOCK_ELEMENTS` booleans, skipping the tiles the
    masks' ranges hide, evaluating none they show in full, and none whose keys are already known to be seen: for a
    built-in this is the band or the documents, for a caller's function typically one tile of rows per key tile.
    """
    mine = plan.k_ranges[plan.ring.rank]
    Lq, Lk_r, B, H = plan.num_queries, length(mine), plan.batch, plan.heads
    live = torch.zeros(B, H, Lk_r, dtype=torch.bool, device=device)  # (B, H, Lk_r)
    if not live.numel():
        return live
    mask = _StepMask(plan, [(0, Lq)], mine, (0, Lq), (0, Lk_r), device)
    row_step = min(Lq, LIVENESS_ROWS)
    col_step = max(1, min(LIVENESS_ROWS, LIVENESS_BLOCK_ELEMENTS // (B * H * row_step)))
    rows, cols = ranges(0, Lq, row_step), ranges(0, Lk_r, col_step)  # (nq, 2), (nk, 2)
    known = mask.tiles(rows, cols)
    done = known.every.any(dim=0)  # (nk,): key tiles some row tile sees in full
    for c in done.nonzero()[:, 0].tolist():
        live[..., cols[c, 0] : cols[c, 1]] = True
    for r, c in (known.some & ~known.every).nonzero().tolist():
        if done[c]:
            continue
        (r0, r1), (j0, j1) = rows[r].tolist(), cols[c].tolist()
        allowed, _ = mask.tile(r0, r1, j0, j1)
        assert allowed is not None  # a mask_mod is given
        live[..., j0:j1] |= allowed.any(dim=-2)  # (B|1, H|1, blk) into (B, H, blk)
        done[c] = bool(live[..., j0:j1].all())
    return live


def _forward_block(state: RunningSoftmax, q: Tensor, kv: Tensor, src: int, plan: _Plan) -> None:
    span = _span(plan, src)
    if span is None:
        return  # no query of this rank sees any key of this block
    (r0, r1), (c0, c1) = span
    kb, vb = _split(kv, q, c0, c1)  # (B, H, Lb', D), (B, H, Lb', Dv)
    mask = _StepMask(plan, plan.q_ranges[plan.ring.rank], plan.k_ranges[src], (r0, r1), (c0, c1), q.device)
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
    mask = _StepMask(plan, plan.q_ranges[plan.ring.rank], plan.k_ranges[src], (r0, r1), (c0, c1), q.device)
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
    ``None`` when the masks allow none (the step is skipped). With the zig-zag layout and a causal mask this is
    half the block on every step but the first, which is what balances the work; a built-in mask_mod narrows it
    further (:func:`_narrow`)."""
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
            box = ((first_row, q1), (k0, last)) if k0 < last and first_row < q1 else None
            if box is not None and isinstance(plan.mask_mod, mods.MaskMod):
                box = _narrow(plan, *box)
            if box is not None:
                (a, b), (c, d) = box  # whole-sequence positions
                rows += [qa + a - q0, qa + b - q0]
                cols += [ka + c - k0, ka + d - k0]
            ka += k1 - k0
        qa += q1 - q0
    return ((min(rows), max(rows)), (min(cols), max(cols))) if rows else None


# _narrow looks at a rectangle of positions in at most this many pieces a side: exact for small rectangles, within a
# 1/64th of each side for long ones (the block plan inside the step skips the rest)
_GRID = 64


def _narrow(
    plan: _Plan, rows: tuple[int, int], cols: tuple[int, int]
) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """The part of the rectangle of query positions ``rows`` and key positions ``cols`` (``[start, stop)``) that
    the masks' tiles do not hide, or ``None`` when they hide all of it (a sliding window's far blocks, another
    document): one call of :meth:`_Plan.tiles` on a grid of :data:`_GRID` pieces a side."""
    row_pieces = ranges(*rows, -(-(rows[1] - rows[0]) // _GRID))  # (nr, 2), nr <= _GRID
    col_pieces = ranges(*cols, -(-(cols[1] - cols[0]) // _GRID))  # (nc, 2), nc <= _GRID
    some = plan.tiles(row_pieces, col_pieces).some  # (nr, nc)
    seen_rows, seen_cols = some.any(dim=1).nonzero()[:, 0], some.any(dim=0).nonzero()[:, 0]
    if not len(seen_rows):
        return None
    first_row, last_row, first_col, last_col = (
        int(i) for i in (seen_rows[0], seen_rows[-1], seen_cols[0], seen_cols[-1])
    )
    return (
        (int(row_pieces[first_row, 0]), int(row_pieces[last_row, 1])),
        (int(col_pieces[first_col, 0]), int(col_pieces[last_col, 1])),
    )


class _StepMask:
    """Which of queries ``rows = [r0, r1)`` of ``queries`` may see which of keys ``cols = [c0, c1)`` of ``keys``
    (each a list of ``[start, stop)`` ranges of whole-sequence positions, as :func:`segments` gives), with
    ``tile`` and ``tiles`` as :class:`attnkit.masks.Mask` (in indices local to these rows and keys)."""

    def __init__(
        self,
        plan: _Plan,
        queries: list[tuple[int, int]],
        keys: list[tuple[int, int]],
        rows: tuple[int, int],
        cols: tuple[int, int],
        device: torch.device,
    ) -> None:
        (r0, r1), (c0, c1) = rows, cols
        self.plan = plan
        self.valid_lens = None if plan.valid_lens is None else plan.valid_lens.view(-1, 1, 1, 1)  # (B, 1, 1, 1)
        self.queries = positions(queries, device)[r0:r1, None]  # (Lq', 1)
        self.keys = positions(keys, device)[c0:c1]  # (Lb',)
        # on the host, to plan blocks without waiting for the device; positions ascend in both layouts
        self.host_queries = positions(queries)[r0:r1]  # (Lq',)
        self.host_keys = positions(keys)[c0:c1]  # (Lb',)
        # a caller's mask_mod (alone, or inside and_masks/or_masks) says nothing of a block until it is evaluated:
        # the chunked backend then narrows the block to the rows that see a key, and skips it when none does
        mod = plan.mask_mod
        self.opaque = mod is not None and (not isinstance(mod, mods.MaskMod) or mod.opaque)
        if plan.mask_mod is not None:
            self.b = torch.arange(plan.batch, device=device).view(-1, 1, 1, 1)  # (B, 1, 1, 1)
            self.h = torch.arange(plan.heads, device=device).view(1, -1, 1, 1)  # (1, H, 1, 1)

    def tiles(self, rows: Tensor, cols: Tensor) -> mods.Tiles:
        # Local rows [a, z) hold positions from the first to the last one's: with the zig-zag layout a superset (the
        # gap between a rank's two chunks), of which "hidden" and "visible in full" hold all the more.
        first, last = self.host_queries[rows[:, 0]], self.host_queries[rows[:, 1] - 1]  # (nq,) each
        k_first, k_last = self.host_keys[cols[:, 0]], self.host_keys[cols[:, 1] - 1]  # (nk,) each
        return self.plan.tiles(
            torch.stack([first, last + 1], dim=1),
            torch.stack([k_first, k_last + 1], dim=1),  # (nq, 2), (nk, 2)
        )

    def tile(
        self, r0: int, r1: int, j0: int, j1: int, dtype: torch.dtype = torch.float32, *, every: bool = False
    ) -> tuple[Tensor | None, Tensor | None]:
        if every:
            return None, None
        keys = self.keys[j0:j1]  # (blk,)
        plan = self.plan
        allowed = None if self.valid_lens is None else keys < self.valid_lens  # (B, 1, 1, blk)
        if plan.is_causal:
            causal = keys <= self.queries[r0:r1] + plan.offset  # (n, blk)
            allowed = causal if allowed is None else allowed & causal  # (B, 1, n, blk)
        if plan.mask_mod is not None:
            q_idx = self.queries[r0:r1].view(1, 1, -1, 1)  # (1, 1, n, 1)
            kv_idx = keys.view(1, 1, 1, -1)  # (1, 1, 1, blk)
            by_mod = mods.evaluate_mask(plan.mask_mod, self.b, self.h, q_idx, kv_idx)  # broadcastable to (B, H, n, blk)
            allowed = by_mod if allowed is None else allowed & by_mod  # (B|1, H|1, n, blk)
        return allowed, None


def _block_buffer(plan: _Plan, like: Tensor, src: int, dtype: torch.dtype) -> Tensor:
    """An empty ``(B, Hkv, Lk_src, D + Dv)`` tensor to receive rank ``src``'s block (or its gradient) into."""
    B, Hkv, _, features = like.shape
    return like.new_empty((B, Hkv, length(plan.k_ranges[src]), features), dtype=dtype)  # (B, Hkv, Lk_src, D + Dv)
