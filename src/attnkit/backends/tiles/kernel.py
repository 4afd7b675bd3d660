"""The tile engine's C++ kernel (``tiles:kernel``, ``attnkit/csrc/flash.cpp``): flash attention on the CPU in float32
(bfloat16's products in bfloat16 where the CPU has AVX512-BF16: :func:`bf16_products`, its inputs then read as they
are: ``_as_they_are``), forward and backward, with
every mask, sinks, and two score_mods built in: soft-capping (:class:`attnkit.mods.softcap`, as FlashAttention's own
``softcap``) and a bias on the distance, ``score + f(b, h, q_idx - kv_idx)`` (ALiBi, a learned table of relative-
position biases, T5-like buckets: proved from the function's graph by ``attnkit.mods.relative``). The bias is
evaluated once per call at each distance the plan's tiles hold, where autograd records, and read by the kernel as one
vector per (example, head); its gradient comes back as one, summed in float64, and autograd takes it to what the
function reads.

The tiles are those of the call's plan (:class:`attnkit.plan.Plan`): hidden tiles are never touched, runs of visible
keys go in spans of up to ``SPAN`` keys without a mask, and partly visible ones with the mask's ``allowed`` and
``bias`` tiles (:meth:`attnkit.masks.Mask.tile`). A row's output and log-sum-exp come from one pass over its spans,
each tile's scores kept in cache from the product that makes them to the products that read them (where compiled steps
write each step's tile to memory: :mod:`attnkit.backends.tiles.compiled`); the backward pass recomputes each span's
weights from the log-sum-exp, as FlashAttention's does. That sum holds ``m + log l`` in one float32: a call that
records a gradient and has a row whose log-sum-exp lies ``FAR_LSE`` or more from 0 runs again on the online softmax
(:mod:`attnkit.backends.tiles.online`), which keeps the two apart.

Built ahead of time by ``pip install``, or on first use (:func:`attnkit.csrc.ensure`: said once, then cached); where it
cannot be built, the tile engine runs these calls in torch ops and the warning says so once (choosing an
implementation builds nothing: ``SUPPORTS`` asks :func:`attnkit.csrc.known`). ``ATTNKIT_FLASH_KERNEL=0`` in the
environment keeps it off.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

import torch
from torch import Tensor

from attnkit import csrc, mods
from attnkit.backends.common import Watched, first_order_only, repeat_kv, row_sinks, sinks_grad, zero_dead
from attnkit.backends.contract import DOT, Call, Supports, Unavailable, scores_bounded
from attnkit.backends.tiles import online
from attnkit.masks import Mask, all_finite
from attnkit.plan import FULL, Rows, plan_of

NAME = "tiles:kernel"

# Keys of a span: one product and one pass of the kernel (512 measured 5-10% faster than 256 at L=8192, as PyTorch's
# own CPU kernel's 512 keys a block).
SPAN = 512

# The kernel runs a call's blocks of queries in groups whose masks hold at most this many bytes (a block that holds
# more is a group of its own): one group, one kernel call, for most masks (a window's: 4 MiB at L=8192), whose masks
# are kept from the forward for the backward; a mask that is new tensors of H L^2 bytes (a mask_mod of h and the
# positions) runs in several, made again in the backward, a group at a time, so that memory stays linear in L.
KEEP_BYTES = 32 * 2**20


def missing(call: Call) -> str | None:
    """What the kernel lacks here, as far as is known without building it (:func:`attnkit.csrc.known`)."""
    return csrc.known("flash")


SUPPORTS = Supports(
    scoring=frozenset({DOT}),
    weights=False,
    dropout=False,
    bias_grad=False,
    score_mod="kernel",
    devices=frozenset({"cpu"}),
    # (bfloat16's products in bfloat16 where the CPU has its dot products, float32 sums; float16 in float32)
    dtypes=frozenset({torch.float32, torch.bfloat16, torch.float16}),
    opaque_modifiers=False,
    missing=missing,
)

# B batch, H heads, Lq/Lk query/key length, D head dim, Dv value head dim, n a block's queries, c a span's keys


# A row's log-sum-exp at least this far from 0: float32 rounds m + log(l), from which the kernel's backward makes the
# row's weights, by up to 2^-8 there (0.4% of every weight), and by more further out: where every score is about
# -1e30 (a finite bias used as a mask) log(l) is lost and the weights come out up to Lk times too large. Closer to 0
# that rounding is at most half an ulp of the row's largest score, which the forward's scores carry too.
FAR_LSE = 2.0**16


def attention(call: Call) -> tuple[Tensor, Tensor | None]:
    out, lse = _run(call)
    if call.needs_grad and bool((lse.detach().abs() >= FAR_LSE).logical_and_(lse.detach() > -math.inf).any()):
        return online.attention(call)  # (rare: again on the online softmax, which keeps m and log l apart)
    return out.to(call.q.dtype), None


def attention_with_lse(call: Call) -> tuple[Tensor, Tensor] | None:
    """The output and each row's log-sum-exp of its (modified) scores ``(B, H, Lq)`` in float32, which the forward
    computes anyway, with gradients to both (:func:`attnkit.flex_attention`'s ``lse``); ``-inf`` for a row with no
    key."""
    out, lse = _run(call)
    return out.to(call.q.dtype), lse


def bf16_products() -> bool:
    """Whether the kernel computes bfloat16 inputs' products in bfloat16 here (the CPU's AVX512-BF16 dot products,
    float32 sums; else in float32). Builds the kernel if it is not built; False where it cannot be."""
    return csrc.ensure("flash") is None and bool(torch.ops.attnkit_flash.bf16_products())


def _run(call: Call) -> tuple[Tensor, Tensor]:
    reason = csrc.ensure("flash")  # (built the first time here: said once)
    if reason is not None:
        raise Unavailable(reason)
    q, k, v, mask = call.q, call.k, call.v, call.mask
    H = q.shape[1]
    plan = plan_of(mask)  # first: looking at the tiles, it learns which keys and rows are live (zero_dead's question)
    q, k, v = zero_dead(q, k, v, mask, call.zeros_past)
    # The softmax and every sum in float32, the output rounded once. bfloat16's products run on the CPU's bfloat16
    # dot products where it has them (`low`; the weights and their gradients rounded to bfloat16 for the products
    # that read them, as FlashAttention's), float16's in float32.
    low = q.dtype == torch.bfloat16
    # Some key or value may not be finite (one read of each key/value head, before repeat_kv): the kernel's products
    # then skip the pairs a row may not see, so that none reaches a row that may not see it (0 * inf is NaN)
    guard = not (all_finite(k) and all_finite(v))
    if not _as_they_are(low, guard):  # float32 copies, linear in L (the gradients go back through them)
        q, k, v = q.float(), k.float(), v.float()  # (B, H|Hkv, L, D|Dv) each
    cap, rel, d0 = 0.0, None, 0  # (SUPPORTS: softcap, a bias on the distance, or none)
    if isinstance(call.score_mod, mods.softcap):
        cap = call.score_mod.cap
    elif call.score_mod is not None:
        d0, d1 = plan.distances()
        # (B|1, H|1, R), evaluated here where autograd records: its gradient reaches what the function reads
        rel = mods.distance_bias(call.score_mod, batch=q.shape[0], heads=H, distances=(d0, d1), device=q.device)
        rel = rel.float()  # (B|1, H|1, R), as the kernel takes it
    watched = Watched.of(call) if call.needs_grad else None
    out, lse = _Flash.apply(q, k, v, call.sinks, rel, mask, cap, d0, call.scale, guard, low, watched)
    return out, lse  # (B, H, Lq, Dv), (B, H, Lq)


def _as_they_are(low: bool, guard: bool) -> bool:
    """Whether the kernel reads bfloat16 inputs as they are, without float32 copies, and writes the output in
    bfloat16 (``low``: the inputs are bfloat16): where its products run in bfloat16 and none of them skips pairs
    (``guard``'s products read float32 values)."""
    return low and not guard and bf16_products()


def _spans(mask: Mask, rows: Rows) -> tuple[list[tuple[int, int]], list[Tensor | None], list[Tensor | None]]:
    """The spans of keys a block of queries sees, ``(first key, end)``, and each one's ``allowed`` (bool) and
    ``bias`` (float32) tiles as ``(B|1, H|1, n, c)`` views, or ``None`` (every pair visible, no bias)."""
    r0, r1, n = rows.r0, rows.r1, rows.r1 - rows.r0
    found: list[tuple[int, int]] = []
    allowed: list[Tensor | None] = []
    bias: list[Tensor | None] = []
    for run in rows.runs:
        for j0 in range(run.j0, run.j1, SPAN):
            j1 = min(j0 + SPAN, run.j1)
            a, b = plan_of(mask).tile(mask, r0, r1, j0, j1, torch.float32, every=run.kind == FULL)  # (B|1, H|1, n|1, c)
            found.append((j0, j1))
            allowed.append(None if a is None else _four(a, n, j1 - j0))
            bias.append(None if b is None else _four(b, n, j1 - j0))
    return found, allowed, bias


def _four(t: Tensor, n: int, c: int) -> Tensor:
    """``t``, broadcastable to ``(B, H, n, c)``, as a ``(B|1, H|1, n, c)`` view."""
    t = t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))  # (B|1, H|1, n|1, c|1)
    return t.expand(*t.shape[:2], n, c)


# a block of queries, its spans of keys (first, end), and each span's allowed and bias (:func:`_spans`)
_Block = tuple[Rows, list[tuple[int, int]], list[Tensor | None], list[Tensor | None]]


@dataclasses.dataclass
class _Group:
    """Consecutive blocks of queries, as the kernel takes them: block ``x``'s rows ``rows[x]`` (first, end), its
    spans of keys ``spans[starts[x]:starts[x + 1]]`` (first, end), and each span's ``allowed`` and ``bias``."""

    rows: Tensor  # (NB, 2) int64
    starts: Tensor  # (NB + 1,) int64
    spans: Tensor  # (T, 2) int64
    allowed: list[Tensor | None]
    bias: list[Tensor | None]
    nbytes: int  # what its masks hold

    def plan(self) -> tuple[Tensor, Tensor, Tensor, list[Tensor | None], list[Tensor | None]]:
        """The kernel's arguments ``rows, starts, spans, allowed, bias``."""
        return self.rows, self.starts, self.spans, self.allowed, self.bias


def _groups(mask: Mask) -> Iterator[_Group]:
    """The plan's blocks (:attr:`attnkit.plan.Plan.rows`) in groups whose masks hold at most ``KEEP_BYTES``
    (a block whose masks are larger is a group of its own), made a group at a time."""
    blocks: list[_Block] = []
    size = 0
    for block in plan_of(mask).rows:
        found, allowed, bias = _spans(mask, block)
        nbytes = sum(t.numel() * t.element_size() for t in (*allowed, *bias) if t is not None)
        if blocks and size + nbytes > KEEP_BYTES:
            yield _group(blocks, size)
            blocks, size = [], 0
        blocks.append((block, found, allowed, bias))
        size += nbytes
    if blocks:
        yield _group(blocks, size)


def _group(blocks: list[_Block], nbytes: int) -> _Group:
    """Blocks of queries, each with its spans and their masks (:func:`_spans`), as one group."""
    starts = [0]
    for _, found, _, _ in blocks:
        starts.append(starts[-1] + len(found))
    return _Group(
        torch.tensor([(block.r0, block.r1) for block, *_ in blocks], dtype=torch.long).reshape(-1, 2),  # (NB, 2)
        torch.tensor(starts, dtype=torch.long),  # (NB + 1,)
        torch.tensor([span for _, found, _, _ in blocks for span in found], dtype=torch.long).reshape(-1, 2),  # (T, 2)
        [a for _, _, allowed, _ in blocks for a in allowed],
        [b for _, _, _, bias in blocks for b in bias],
        nbytes,
    )


def _no_gradient_from_rows_without_keys(
    dout: Tensor,
    live: Tensor,
    lse: Tensor,
    sinks: Tensor | None,
    rel: Tensor | None,
    mask: Mask,
    q: Tensor,
    k: Tensor,
    scale: float,
) -> Tensor:
    """``dout (B, H, Lq, Dv)`` zeroed in the rows that summed no key (a distance bias's ``-inf``, a score that
    overflows to ``-inf``; the mask's empty rows are zeroed before, by the caller): their outputs are zeros, and NaN in
    their output gradient would reach ``dv`` through their zero weights. Without sinks such a row's ``lse`` is
    ``-inf`` (``live`` False). With sinks it is the row's sink logit exactly, where a key can be hidden at all; a
    live row's lse is too only where every key's weight underflows beside the sink, and its output gradient then
    moves nothing above float32's smallest numbers."""
    emptied = ~live  # (B, H, Lq)
    if sinks is not None:
        can_hide = (rel is not None and bool(torch.isneginf(rel).any())) or not scores_bounded(q, k, scale, q.dtype)
        if can_hide:
            emptied = emptied | (lse == row_sinks(sinks, mask, q.shape, torch.float32))  # (B, H, Lq)
    if not bool(emptied.any()):
        return dout
    return dout.masked_fill(emptied[..., None], 0.0)  # (B, H, Lq, Dv)


class _Flash(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        sinks: Tensor | None,
        rel: Tensor | None,
        mask: Mask,
        cap: float,
        d0: int,
        scale: float,
        guard: bool,
        low: bool,
        watched: Watched | None,
    ) -> tuple[Tensor, Tensor]:
        B, H, Lq, _ = q.shape
        q, kv = q.contiguous(), (k, v)  # (kept as they come: one key/value head per group, until the backward)
        # each query head's key/value head (the backward sums the groups' gradients in float32, then rounds them)
        k, v = repeat_kv(k, H).contiguous(), repeat_kv(v, H).contiguous()  # (B, H, Lk, D|Dv)
        sink = None if sinks is None else row_sinks(sinks, mask, q.shape, torch.float32).contiguous()  # (B, H, Lq)
        # every row is in a block of the plan, which writes it (a call has at least one key: checked when it is made);
        # the output in the inputs' dtype (float32, or bfloat16 read as it is), lse in float32
        out = q.new_empty((B, H, Lq, v.shape[-1]))  # (B, H, Lq, Dv)
        lse = q.new_empty((B, H, Lq), dtype=torch.float32)  # (B, H, Lq)
        rel = None if rel is None else rel.detach().contiguous()  # (B|1, H|1, R)
        first: _Group | None = None  # the first group, while it is the only one (a later one drops it)
        for count, group in enumerate(_groups(mask)):
            torch.ops.attnkit_flash.forward(q, k, v, *group.plan(), sink, rel, d0, scale, cap, guard, low, out, lse)
            first = group if count == 0 else None
        # bfloat16's products (where the CPU has them): the backward sums each row's delta from the weights it
        # recomputes and reads no output, which is not saved then, so that a caller may change it in place
        products_low = low and bf16_products()
        ctx.save_for_backward(q, *kv, sinks, rel, None if products_low else out, lse)
        ctx.mask, ctx.cap, ctx.d0, ctx.scale, ctx.watched, ctx.guard, ctx.low = (
            mask,
            cap,
            d0,
            scale,
            watched,
            guard,
            products_low,
        )
        # the masks, kept for the backward when they are one group within KEEP_BYTES, else made again
        keep = first is not None and first.nbytes <= KEEP_BYTES and any(ctx.needs_input_grad)
        ctx.groups = [first] if keep else None
        ctx.set_materialize_grads(False)  # (an lse no one used has no gradient: None, not zeros to carry through)
        return out, lse

    @staticmethod
    def backward(ctx, dout: Tensor | None, dlse: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        first_order_only(NAME)
        q, k, v, sinks, rel, out, lse = ctx.saved_tensors
        B, H = q.shape[:2]
        Hkv = k.shape[1]
        k, v = repeat_kv(k, H).contiguous(), repeat_kv(v, H).contiguous()  # (B, Hkv, Lk, D|Dv) -> (B, H, Lk, D|Dv)
        if ctx.watched is not None:
            ctx.watched.check(NAME)
        mask: Mask = ctx.mask
        shape = (*q.shape[:3], v.shape[-1])  # out's (B, H, Lq, Dv), in q's dtype
        dout = q.new_zeros(shape) if dout is None else dout.to(q.dtype)  # (B, H, Lq, Dv)
        Dv = v.shape[-1]
        live = lse > -math.inf  # (B, H, Lq): a row with no key has no weight to pass dlse to
        dout = _no_gradient_from_rows_without_keys(dout, live, lse, sinks, rel, mask, q, k, ctx.scale)
        # bfloat16's products: the kernel sums each row's delta from the weights it recomputes, -dlse to start with
        # (flash.cpp), and gives the deltas back for the sinks' gradient
        low = ctx.low
        dl = None if dlse is None or not low else torch.where(live, dlse.float(), 0.0).contiguous()  # (B, H, Lq)
        rowsum = q.new_zeros((B, H, q.shape[2]) if low else (0, 0, 0), dtype=torch.float32)  # (B, H, Lq)
        if dlse is not None and not low:
            # d lse_i / d s_ij = p_ij: the softmax's backward ds = p (dp - delta) with delta - dlse in place of delta,
            # which the kernel, taking delta = dout . out, gets from a column of ones in out beside -dlse in dout
            # (and a column of zeros in v, so that dp is unchanged)
            g = torch.where(live, dlse.to(out.dtype), 0.0)[..., None]  # (B, H, Lq, 1)
            out = torch.cat([out, torch.ones_like(g)], dim=-1)  # (B, H, Lq, Dv + 1)
            dout = torch.cat([dout, -g], dim=-1)  # (B, H, Lq, Dv + 1)
            v = torch.cat([v, v.new_zeros((*v.shape[:-1], 1))], dim=-1)  # (B, H, Lk, Dv + 1)
        dout = dout.contiguous()
        out = dout if out is None else out  # (unsaved where the kernel does not read it: any tensor of its shape)
        # (in float32 whatever the inputs' dtype: summed over tiles; autograd rounds them to the inputs')
        dq = torch.empty_like(q, dtype=torch.float32)  # (B, H, Lq, D): every row written, as out's
        dk = torch.zeros_like(k, dtype=torch.float32)  # (B, H, Lk, D): added to by every block
        dv = torch.zeros_like(v, dtype=torch.float32)  # (B, H, Lk, Dv)
        drel = q.new_zeros((B, H, 0 if rel is None else rel.shape[-1]), dtype=torch.float64)  # (B, H, R)
        args = (rel, ctx.d0, ctx.scale, ctx.cap, ctx.guard, low, dl, dq, dk, dv, drel, rowsum)
        for group in ctx.groups or _groups(mask):  # dq (B, H, Lq, D) written; dk, dv, drel added to
            torch.ops.attnkit_flash.backward(q, k, v, out, dout, lse, *group.plan(), *args)
        dsinks = None
        dv = dv[..., :Dv]  # (B, H, Lk, Dv): the column of zeros' gradient dropped
        if sinks is not None and ctx.needs_input_grad[3]:
            # (B, H, Lq): sum_j p_ij dp_ij (- dlse), the softmax Jacobian's row term
            delta = rowsum if low else (dout * out).sum(dim=-1)
            dsinks = sinks_grad(sinks, mask, lse, delta)
        drel_ = None
        if rel is not None and ctx.needs_input_grad[4]:
            broadcast = [d for d in (0, 1) if rel.shape[d] == 1]
            drel_ = (drel.sum(broadcast, keepdim=True) if broadcast else drel).to(rel.dtype)  # (B|1, H|1, R)
        if Hkv != H:  # each group's gradients summed in float32
            groups = (Hkv, H // Hkv)
            dk = dk.unflatten(1, groups).sum(dim=2)  # (B, Hkv, Lk, D)
            dv = dv.unflatten(1, groups).sum(dim=2)  # (B, Hkv, Lk, Dv)
        dq, dk, dv = dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)
        return dq, dk, dv, dsinks, drel_, None, None, None, None, None, None, None
