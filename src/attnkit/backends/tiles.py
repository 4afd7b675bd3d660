"""PyTorch's fused CPU flash kernel, one block of queries at a time, over only the keys the mask lets it see.

A plan (:func:`plan`) classifies each tile of ``BLOCK`` queries x ``BLOCK`` keys as hidden, visible in full or
partly visible: from index ranges for the built-in masks (:meth:`attnkit.masks.Mask.tiles`: ``valid_lens``,
``is_causal``, sliding windows, prefixes), and for what only looking can tell (a user's ``mask_mod``, a boolean
``attn_mask``) by evaluating the mask once per tile, as FlexAttention's block mask does. A partly visible tile on the
diagonal whose mask is exactly causal is marked so, and a mask that is causal self-attention throughout, whatever its
parts, runs as one causal call (:func:`schedule`). Each block of queries then runs the kernel
(``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu``, which also returns each row's log-sum-exp) once per
run of neighbouring tiles of one kind: visible runs without a mask, causal tiles with the kernel's ``is_causal``,
partly visible runs with that run's mask as a float ``-inf`` bias, evaluated again there. Hidden tiles are never
touched. The runs' results are merged by their log-sum-exps in the compute dtype (float32, float64 for float64), the
sinks as one more term.

A score_mod that is a bias (ALiBi) is added as the kernel's float mask. Where it splits into a part for each key and
a part for each query (:meth:`attnkit.mods.ScoreMod.split_bias`: ALiBi off the diagonal), the kernel reads one row of
it broadcast over the queries, and the part for each query, which changes no weight, is taken out of the run's
log-sum-exp; elsewhere the bias is built over the tile.

The backward pass runs the kernel's backward op on the same runs: given the whole row's output and log-sum-exp, it
returns exact partial gradients for a subset of keys (checked against float64 in tests/test_tiles.py).

Cannot: additive scoring, weights, dropout, score_mods other than a bias or gradients to what they read, gradients to
a float ``attn_mask``, values of another head size than the queries', scores a hidden pair could overflow with (the
mask is added as ``-inf``): ``SUPPORTS``.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import threading
from typing import NamedTuple

import torch
from torch import Tensor

from attnkit import _compile, mods
from attnkit._validate import ranges
from attnkit.backends.common import (
    Watched,
    bias_of,
    first_order_only,
    kernel_backward_safe,
    nan_rows_stay_nan,
    sinks_grad,
    zero_dead,
)
from attnkit.backends.contract import DOT, Call, Supports
from attnkit.backends.online import Scorer, exact_grads
from attnkit.masks import Mask
from attnkit.mods import ScoreMod

NAME = "tiles"

# B batch, H heads, Hkv key/value heads, Lq/Lk query/key length, D head dim, n a block's queries, m a run's keys

# Queries and keys of one tile. 256 x 256: the kernel's own blocks (its q/kv split sizes) fit in a tile many times,
# and a causal or windowed mask leaves few partly visible tiles (docs/benchmarks.md, "Flexible attention").
BLOCK = 256

# Plans kept for masks that are functions of the indices alone (Mask.index_key), the last used ones, and the
# booleans of their masked runs' masks each keeps (16 MiB): a model's layers and steps plan and look once.
KEPT_PLANS = 8
KEPT_MASK_ELEMENTS = 2**24

SUPPORTS = Supports(
    scoring=frozenset({DOT}),
    weights=False,
    dropout=False,
    bias_grad=False,
    score_mod="bias",
    score_mod_grad=False,
    devices=frozenset({"cpu"}),
    dtypes=frozenset({torch.float32, torch.float64}),
    huge_scores=False,
    opaque_modifiers=False,
    value_dim=False,
)

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


# What a run of keys is to a block of queries: every pair visible; a square tile on the diagonal whose mask is
# exactly causal (the kernel's own ``is_causal``, which skips the hidden half); some pairs visible (a float mask).
FULL, CAUSAL, MASKED = "full", "causal", "masked"


class Run(NamedTuple):
    """Keys ``[j0, j1)`` seen by a block of queries, and how (``FULL``, ``CAUSAL`` or ``MASKED``)."""

    j0: int
    j1: int
    kind: str


class Rows(NamedTuple):
    """A block of queries ``[r0, r1)`` and its runs of keys, in order."""

    r0: int
    r1: int
    runs: tuple[Run, ...]


@dataclasses.dataclass
class _Kept:
    """A plan kept for the masks of one :attr:`~attnkit.masks.Mask.index_key`: its blocks, the liveness, and the
    masked runs' masks as found (``(r0, j0, j1)`` -> allowed ``(B|1, H|1, n|1, m)``), within a budget."""

    rows: list[Rows]
    liveness: tuple[Tensor | None, Tensor | None]
    masks: dict[tuple[int, int, int], Tensor] = dataclasses.field(default_factory=dict)
    elements: int = 0


_KEPT: collections.OrderedDict[tuple[object, ...], _Kept] = collections.OrderedDict()  # the last used last
_KEPT_LOCK = threading.Lock()


@_compile.outside_graph  # (Python lists of ranges from the mask's values: under a caller's torch.compile, traced,
# the causal tile's test met symbolic booleans and Inductor failed; run as it is, it costs a graph break)
def plan(mask: Mask) -> list[Rows]:
    """The blocks of queries and the runs of keys each sees: kept on the mask (the backward pass reuses it), and for
    a mask that is a function of the indices alone, for the calls after (every layer, every step)."""
    key = ("tiles", BLOCK)
    if key in mask.plans:
        return mask.plans[key]  # type: ignore[return-value]
    # (a plan made under inference mode holds inference tensors, which a later call under autograd may not save:
    # kept only from calls outside it)
    index_key = None if torch.is_inference_mode_enabled() else mask.index_key
    if index_key is None:
        mask.plans[key] = _plan(mask)
        return mask.plans[key]  # type: ignore[return-value]
    kept_key = (index_key, BLOCK)
    with _KEPT_LOCK:
        kept = _KEPT.get(kept_key)
        if kept is not None:
            _KEPT.move_to_end(kept_key)
    if kept is None:
        rows = _plan(mask)
        kept = _Kept(rows, mask.liveness)
        with _KEPT_LOCK:
            _KEPT[kept_key] = kept
            while len(_KEPT) > KEPT_PLANS:
                _KEPT.popitem(last=False)
    mask.__dict__.setdefault("liveness", kept.liveness)  # (functools.cached_property keeps its value there)
    mask.plans[key], mask.plans[("tiles kept", BLOCK)] = kept.rows, kept
    return kept.rows


def schedule(mask: Mask, *, biased: bool) -> list[Rows]:
    """The plan to run: a mask that is causal self-attention and nothing else, whatever its parts (a user's
    ``q_idx >= kv_idx``, or that and ``is_causal``), is one causal call of the kernel over every query, as SDPA's
    ``is_causal`` (a plan of many blocks merges their results: 1.15-1.2x that call). With a score bias
    (``biased``), visible runs are cut where they cross the diagonal: a bias splits on either side of it
    (:meth:`~attnkit.mods.ScoreMod.split_bias`), and is built over a tile or two only where they cross it."""
    rows = plan(mask)
    if biased:
        return [Rows(r.r0, r.r1, tuple(_cut_at_diagonal(r, mask))) for r in rows]
    if not _causal_throughout(rows, mask):
        return rows
    return [Rows(0, mask.num_queries, (Run(0, mask.num_keys, CAUSAL),))]


def causal_throughout(mask: Mask) -> bool:
    """Whether ``mask`` is causal self-attention and nothing else, whatever its parts: :func:`schedule` runs it as
    one causal call of the kernel (what ``auto`` leaves here rather than on ``flash``)."""
    return _causal_throughout(plan(mask), mask)


def _cut_at_diagonal(rows: Rows, mask: Mask) -> list[Run]:
    """The runs of a block of queries, its visible runs cut at the edges of the tiles that hold the keys on the
    diagonal of its queries (``p + Lk - Lq`` for ``p`` in ``[r0, r1)``)."""
    offset = mask.num_keys - mask.num_queries
    first = (rows.r0 + offset) // BLOCK * BLOCK  # the diagonal's tiles: keys [first, last)
    last = -(-(rows.r1 + offset) // BLOCK) * BLOCK
    runs = []
    for run in rows.runs:
        cuts = sorted({run.j0, run.j1} | {c for c in (first, last) if run.kind == FULL and run.j0 < c < run.j1})
        runs += [Run(a, z, run.kind) for a, z in itertools.pairwise(cuts)]
    return runs


def _plan(mask: Mask) -> list[Rows]:
    rows, cols = ranges(0, mask.num_queries, BLOCK), ranges(0, mask.num_keys, BLOCK)  # (nq, 2), (nk, 2)
    if not len(rows) or not len(cols):
        return []
    known = mask.classify(rows, cols)  # (nq, nk) each
    some, every = known.some.tolist(), known.every.tolist()  # (lists: indexing a tensor per tile is slow)
    plans = []
    for r, (r0, r1) in enumerate(rows.tolist()):
        runs: list[Run] = []
        for c, (j0, j1) in enumerate(cols.tolist()):
            if not some[r][c]:
                continue
            kind = FULL if every[r][c] else CAUSAL if _causal_tile(mask, r0, r1, j0, j1) else MASKED
            if runs and runs[-1].j1 == j0 and runs[-1].kind == kind != CAUSAL:
                runs[-1] = Run(runs[-1].j0, j1, kind)
            else:
                runs.append(Run(j0, j1, kind))
        plans.append(Rows(r0, r1, tuple(runs)))
    return plans


def _causal_tile(mask: Mask, r0: int, r1: int, j0: int, j1: int) -> bool:
    """Whether the tile is square, on the diagonal of the call (query ``p`` beside key ``p + Lk - Lq``), and its
    mask exactly causal there: what the kernel's ``is_causal`` hides in a square call. Looked at once a plan."""
    if j0 - r0 != mask.num_keys - mask.num_queries or j1 - j0 != r1 - r0 or mask.bias is not None:
        return False
    allowed = mask.allowed_tile(r0, r1, j0, j1)  # (B|1, H|1, n|1, m) or None
    if allowed is None:
        return False
    n = r1 - r0
    lower = torch.ones(n, n, dtype=torch.bool, device=allowed.device).tril()  # (n, n)
    return bool((allowed == lower).all())


def _causal_throughout(rows: list[Rows], mask: Mask) -> bool:
    """Every block of queries sees the keys before its tile on the diagonal in full, that tile as causal, nothing
    after it: the whole mask is causal self-attention."""
    if mask.num_queries != mask.num_keys or mask.bias is not None:  # (the kernel's causal call adds no bias)
        return False
    for r in rows:
        runs = ((Run(0, r.r0, FULL),) if r.r0 else ()) + (Run(r.r0, r.r1, CAUSAL),)
        if r.runs != runs and not (r.r1 - r.r0 == 1 and r.runs == (Run(0, r.r1, FULL),)):  # (a last tile 1 x 1)
            return False
    return True


def attention(call: Call) -> tuple[Tensor, Tensor | None]:
    q, k, v = _inputs(call)
    watched = Watched.of(call) if call.needs_grad else None  # what the backward pass reads again
    out = _Tiles.apply(q, k, v, call.sinks, call.mask, call.scale, _bias_mod(call), watched)  # (B, H, Lq, D)
    return nan_rows_stay_nan(call, out), None


def attention_with_lse(call: Call) -> tuple[Tensor, Tensor] | None:
    """The output and each row's log-sum-exp, which the runs' merge computes anyway; ``None`` under autograd."""
    if call.needs_grad:
        return None
    q, k, v = _inputs(call)
    return _forward(q, k, v, call.sinks, call.mask, call.scale, _bias_mod(call))


def _bias_mod(call: Call) -> ScoreMod | None:
    """The call's score_mod, a bias (SUPPORTS refuses the others), or ``None``."""
    assert call.score_mod is None or isinstance(call.score_mod, ScoreMod)
    return call.score_mod


def _inputs(call: Call) -> tuple[Tensor, Tensor, Tensor]:
    plan(call.mask)  # first: looking at the tiles, it learns which keys and rows are live (zero_dead's question)
    q, k, v = zero_dead(call.q, call.k, call.v, call.mask, call.zeros_past)
    # the kernel reads each row of q, k and v as contiguous (a positions-last cache's keys would give a wrong output)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    return q, k, v


class _Args(NamedTuple):
    """What the kernel takes for one run, and what to make of its log-sum-exp."""

    attn_mask: Tensor | None  # (B|1, H|1, n, m) float, -inf where hidden; None: none
    causal: bool  # the kernel's is_causal
    seen: Tensor | None  # (B|1, H|1, n): the rows that see some of the run's keys; None: every row
    shift: Tensor | None  # (1, H, n): a part of the score bias the same over a row, left out of the mask (the
    # kernel's log-sum-exp lacks it; the output does not depend on it); None: none


def _run_args(mask: Mask, score_mod: ScoreMod | None, batch: int, rows: Rows, run: Run, dtype: torch.dtype) -> _Args:
    r0, r1 = rows.r0, rows.r1
    plain = run.kind == FULL and mask.bias is None
    if score_mod is None:
        if plain:
            return _Args(None, False, None, None)
        if run.kind == CAUSAL:
            return _Args(None, True, None, None)
        bias, seen = _run_mask(mask, r0, r1, run, dtype)  # (B|1, H|1, n, m), (B|1, H|1, n) or None
        return _Args(bias, False, seen, None)
    heads, n, m = mask.heads, r1 - r0, run.j1 - run.j0
    if plain:
        split = score_mod.split_bias(heads, (r0, r1), (run.j0, run.j1), mask.device)  # (H, m), (H, n) or None
        if split is not None:
            by_key = split[0].to(dtype)[None, :, None, :].expand(1, heads, n, m)  # (1, H, n, m), one row read
            return _Args(by_key, False, None, split[1].to(dtype)[None])
    bias, seen = _run_mask(mask, r0, r1, run, dtype)  # (B|1, H|1, n, m), (B|1, H|1, n) or None
    idx = mods.indices(batch, heads, (r0, r1), (run.j0, run.j1), mask.device)
    return _Args(bias + bias_of(score_mod, idx, dtype), False, seen, None)  # (B|1, H, n, m)


def _forward(
    q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, mask: Mask, scale: float, score_mod: ScoreMod | None
) -> tuple[Tensor, Tensor]:
    B, H, Lq, D = q.shape
    out = q.new_zeros((B, H, Lq, v.shape[-1]))  # (B, H, Lq, D)
    lse = q.new_zeros((B, H, Lq))  # (B, H, Lq): 0 in rows that see no key (and no sink)
    sink = None if sinks is None else mask.sink_logits(sinks.to(q.dtype))[..., 0]  # (B|1, H, Lq|1)
    for rows in schedule(mask, biased=score_mod is not None):
        r0, r1 = rows.r0, rows.r1
        row_sink = None if sink is None else sink[..., r0:r1] if sink.shape[-1] != 1 else sink  # (B|1, H, n|1)
        if not rows.runs:
            if row_sink is not None:
                lse[:, :, r0:r1] = row_sink  # the sink alone: weights 0, output 0
            continue
        qb = q[:, :, r0:r1]  # (B, H, n, D)
        parts = [
            _run_forward(qb, k, v, scale, _run_args(mask, score_mod, B, rows, run, q.dtype), run) for run in rows.runs
        ]
        o, l = _merge(parts, row_sink)  # noqa: E741  (B, H, n, D), (B, H, n)
        out[:, :, r0:r1], lse[:, :, r0:r1] = o, l
    return out, lse


def _run_forward(qb: Tensor, k: Tensor, v: Tensor, scale: float, args: _Args, run: Run) -> tuple[Tensor, Tensor]:
    """The kernel on one run: its output ``(B, H, n, D)`` and log-sum-exp ``(B, H, n)``, ``-inf`` in rows that see
    none of its keys (where the kernel gives 0)."""
    km, vm = k[:, :, run.j0 : run.j1], v[:, :, run.j0 : run.j1]  # (B, Hkv, m, D) each
    o, l = _flash(qb, km, vm, 0.0, args.causal, attn_mask=args.attn_mask, scale=scale)[:2]  # noqa: E741
    if args.shift is not None:
        l = l + args.shift  # noqa: E741  (B, H, n): the kernel saw each score less the shift
    if args.seen is not None:
        l = torch.where(args.seen, l, float("-inf"))  # noqa: E741  (B, H, n)
    return o, l


def _run_mask(mask: Mask, r0: int, r1: int, run: Run, dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
    """A run's mask as the float bias the kernel adds (``-inf`` where hidden), ``(B|1, H|1, n, m)``, and which rows
    see some of its keys (``None``: all of them)."""
    allowed, bias = tile(mask, r0, r1, run.j0, run.j1, dtype, every=run.kind == FULL)  # (B|1, H|1, n|1, m)|None
    n, m = r1 - r0, run.j1 - run.j0
    bias = torch.zeros((), dtype=dtype, device=mask.device) if bias is None else bias
    filled = bias if allowed is None else torch.where(allowed, bias, float("-inf"))  # (B|1, H|1, n|1, m)
    filled = filled.reshape((1,) * (4 - filled.dim()) + tuple(filled.shape))  # (B|1, H|1, n|1, m|1)
    filled = filled.expand(*filled.shape[:2], n, m)  # (B|1, H|1, n, m)
    if allowed is None:
        return filled, None
    seen = allowed.any(dim=-1)  # (B|1, H|1, n|1)
    return filled, seen.reshape((1,) * (3 - seen.dim()) + tuple(seen.shape))


def tile(
    mask: Mask, r0: int, r1: int, j0: int, j1: int, dtype: torch.dtype, *, every: bool
) -> tuple[Tensor | None, Tensor | None]:
    """``mask.tile(...)`` (:meth:`~attnkit.masks.Mask.tile`): the ``allowed`` and ``bias`` of queries ``[r0, r1)``
    and keys ``[j0, j1)``, each ``(B|1, H|1, n|1, m)`` or ``None``; for a mask whose plan is kept (a function of the
    indices alone), its ``allowed`` kept with the plan within the plan's budget, for the calls after."""
    kept: _Kept | None = mask.plans.get(("tiles kept", BLOCK))  # type: ignore[assignment]
    if kept is not None and not every and (r0, j0, j1) in kept.masks:
        return kept.masks[(r0, j0, j1)], None  # (B|1, H|1, n|1, m); a kept mask has no bias
    allowed, bias = mask.tile(r0, r1, j0, j1, dtype, every=every)  # (B|1, H|1, n|1, m) | None each
    if (
        kept is not None
        and allowed is not None
        and not torch.is_inference_mode_enabled()  # (inference tensors: as plan's)
        and bias is None
        and kept.elements + allowed.numel() <= KEPT_MASK_ELEMENTS
    ):
        kept.masks[(r0, j0, j1)] = allowed
        kept.elements += allowed.numel()
    return allowed, bias


def _merge(parts: list[tuple[Tensor, Tensor]], sink: Tensor | None) -> tuple[Tensor, Tensor]:
    """The runs' outputs ``(B, H, n, D)`` and log-sum-exps ``(B, H, n)`` as one: ``out = sum_r exp(lse_r - lse)
    out_r``, ``lse = log(exp(sink) + sum_r exp(lse_r))``; rows that see nothing get 0 and 0 (the sink's log-sum-exp
    where there is one)."""
    if len(parts) == 1 and sink is None:
        o, l = parts[0]  # noqa: E741
        empty = torch.isneginf(l)  # (B, H, n)
        if bool(empty.any()):
            return o.masked_fill(empty[..., None], 0.0), l.masked_fill(empty, 0.0)
        return o, l
    lses = torch.stack([part[1] for part in parts])  # (R, B, H, n)
    terms = lses if sink is None else torch.cat([lses, sink.expand_as(lses[0])[None]])  # (R|R+1, B, H, n)
    total = torch.logsumexp(terms, dim=0)  # (B, H, n); -inf where nothing is seen
    empty = torch.isneginf(total)
    safe = total.masked_fill(empty, 0.0)  # (B, H, n)
    out = None
    for (o, _), run_lse in zip(parts, lses, strict=True):
        weight = torch.exp(run_lse - safe)[..., None]  # (B, H, n, 1); 0 where the run sees nothing, NaN in a NaN row
        term = torch.where(weight == 0, 0.0, o * weight)  # (B, H, n, D): a NaN row stays NaN (not zeros)
        out = term if out is None else out.add_(term)
    assert out is not None
    return out, safe


class _Tiles(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        sinks: Tensor | None,
        mask: Mask,
        scale: float,
        score_mod: ScoreMod | None,
        watched: Watched | None,
    ) -> Tensor:
        out, lse = _forward(q, k, v, sinks, mask, scale, score_mod)
        ctx.save_for_backward(q, k, v, sinks, out, lse)
        ctx.mask, ctx.scale, ctx.score_mod, ctx.watched = mask, scale, score_mod, watched
        return out

    @staticmethod
    def backward(ctx, dout: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        first_order_only(NAME)
        q, k, v, sinks, out, lse = ctx.saved_tensors
        if ctx.watched is not None:
            ctx.watched.check(NAME)
        mask: Mask = ctx.mask
        dout = dout.to(out.dtype).contiguous()
        if not kernel_backward_safe(q, v, dout):  # the kernel's backward would meet 0 * inf where a row may not see
            scorer = Scorer(None, ctx.scale, ctx.score_mod, q.shape[0], q.shape[1])
            dq, dk, dv = exact_grads(q, k, v, mask, scorer, lse, out, dout)
            return dq, dk, dv, _sinks_grad(ctx, sinks, mask, lse, dout, out), None, None, None, None
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for rows in schedule(mask, biased=ctx.score_mod is not None):
            r0, r1 = rows.r0, rows.r1
            qb, ob, lb, db = q[:, :, r0:r1], out[:, :, r0:r1], lse[:, :, r0:r1], dout[:, :, r0:r1]
            for run in rows.runs:
                km, vm = k[:, :, run.j0 : run.j1], v[:, :, run.j0 : run.j1]  # (B, Hkv, m, D)
                args = _run_args(mask, ctx.score_mod, q.shape[0], rows, run, q.dtype)
                run_lse = lb if args.shift is None else lb - args.shift  # (B, H, n): as the kernel sees the run
                g = _flash_backward(
                    db, qb, km, vm, ob, run_lse, 0.0, args.causal, attn_mask=args.attn_mask, scale=ctx.scale
                )
                dq[:, :, r0:r1] += g[0]  # (B, H, n, D)
                dk[:, :, run.j0 : run.j1] += g[1]  # (B, Hkv, m, D)
                dv[:, :, run.j0 : run.j1] += g[2]  # (B, Hkv, m, D)
        return dq, dk, dv, _sinks_grad(ctx, sinks, mask, lse, dout, out), None, None, None, None


def _sinks_grad(ctx: object, sinks: Tensor | None, mask: Mask, lse: Tensor, dout: Tensor, out: Tensor) -> Tensor | None:
    if sinks is None or not ctx.needs_input_grad[3]:  # type: ignore[attr-defined]
        return None
    return sinks_grad(sinks, mask, lse, (dout * out).sum(dim=-1))  # (H,)
