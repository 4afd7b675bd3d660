"""PyTorch's fused CPU flash kernel, one block of queries at a time, over only the keys the mask lets it see.

A plan (:func:`plan`) classifies each tile of ``BLOCK`` queries x ``BLOCK`` keys as hidden, visible in full or
partly visible: from index ranges for the built-in masks (:meth:`attnkit.masks.Mask.tiles`: ``valid_lens``,
``is_causal``, sliding windows, prefixes), and for what only looking can tell (a user's ``mask_mod``, a boolean
``attn_mask``) by evaluating the mask once per tile, as FlexAttention's block mask does. Each block of queries then
runs the kernel (``torch.ops.aten._scaled_dot_product_flash_attention_for_cpu``, which also returns each row's
log-sum-exp) once per run of neighbouring tiles of one kind: visible runs without a mask, partly visible ones with
that run's mask as a float ``-inf`` bias, evaluated again there. Hidden tiles are never touched. The runs' results
are merged by their log-sum-exps in the compute dtype (float32, float64 for float64), the sinks as one more term.

The backward pass runs the kernel's backward op on the same runs: given the whole row's output and log-sum-exp, it
returns exact partial gradients for a subset of keys (checked against float64 in tests/test_tiles.py).

Cannot: additive scoring, weights, dropout, score_mods, gradients to a float ``attn_mask``, values of another head
size than the queries', scores a hidden pair could overflow with (the mask is added as ``-inf``): :data:`SUPPORTS`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from attnkit._checks import ranges
from attnkit.backends.common import Watched, zero_dead
from attnkit.backends.contract import DOT, Call, Supports
from attnkit.masks import Mask

NAME = "tiles"

# B batch, H heads, Hkv key/value heads, Lq/Lk query/key length, D head dim, n a block's queries, m a run's keys

# Queries and keys of one tile. 256 x 256: the kernel's own blocks (its q/kv split sizes) fit in a tile many times,
# and a causal or windowed mask leaves few partly visible tiles (docs/benchmarks.md, "Flexible attention").
BLOCK = 256

SUPPORTS = Supports(
    scoring=frozenset({DOT}),
    weights=False,
    dropout=False,
    bias_grad=False,
    score_mod="none",
    devices=frozenset({"cpu"}),
    dtypes=frozenset({torch.float32, torch.float64}),
    huge_scores=False,
    opaque_modifiers=False,
    value_dim=False,
)

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class Run(NamedTuple):
    """Keys ``[j0, j1)`` seen by a block of queries: every pair visible (``full``), or some (a mask to build)."""

    j0: int
    j1: int
    full: bool


class Rows(NamedTuple):
    """A block of queries ``[r0, r1)`` and its runs of keys, in order."""

    r0: int
    r1: int
    runs: tuple[Run, ...]


def plan(mask: Mask) -> list[Rows]:
    """The blocks of queries and the runs of keys each sees (kept on the mask: the backward pass reuses it)."""
    key = ("tiles", BLOCK)
    if key not in mask.plans:
        mask.plans[key] = _plan(mask)
    return mask.plans[key]  # type: ignore[return-value]


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
            full = every[r][c]
            if runs and runs[-1].j1 == j0 and runs[-1].full == full:
                runs[-1] = Run(runs[-1].j0, j1, full)
            else:
                runs.append(Run(j0, j1, full))
        plans.append(Rows(r0, r1, tuple(runs)))
    return plans


def attention(call: Call) -> tuple[Tensor, Tensor | None]:
    q, k, v = _inputs(call)
    watched = Watched.of(call) if call.needs_grad else None  # what the backward pass reads again
    out = _Tiles.apply(q, k, v, call.sinks, call.mask, call.scale, watched)  # (B, H, Lq, D)
    return out, None


def attention_with_lse(call: Call) -> tuple[Tensor, Tensor] | None:
    """The output and each row's log-sum-exp, which the runs' merge computes anyway; ``None`` under autograd."""
    if call.needs_grad:
        return None
    q, k, v = _inputs(call)
    return _forward(q, k, v, call.sinks, call.mask, call.scale)


def _inputs(call: Call) -> tuple[Tensor, Tensor, Tensor]:
    plan(call.mask)  # first: looking at the tiles, it learns which keys and rows are live (zero_dead's question)
    q, k, v = zero_dead(call.q, call.k, call.v, call.mask, call.zeros_past)
    # the kernel reads each row of q, k and v as contiguous (a positions-last cache's keys would give a wrong output)
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    return q, k, v


def _forward(q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, mask: Mask, scale: float) -> tuple[Tensor, Tensor]:
    B, H, Lq, D = q.shape
    out = q.new_zeros((B, H, Lq, v.shape[-1]))  # (B, H, Lq, D)
    lse = q.new_zeros((B, H, Lq))  # (B, H, Lq): 0 in rows that see no key (and no sink)
    sink = None if sinks is None else mask.sink_logits(sinks.to(q.dtype))[..., 0]  # (B|1, H, Lq|1)
    for rows in plan(mask):
        r0, r1 = rows.r0, rows.r1
        row_sink = None if sink is None else sink[..., r0:r1] if sink.shape[-1] != 1 else sink  # (B|1, H, n|1)
        if not rows.runs:
            if row_sink is not None:
                lse[:, :, r0:r1] = row_sink  # the sink alone: weights 0, output 0
            continue
        qb = q[:, :, r0:r1]  # (B, H, n, D)
        parts = [_run_forward(qb, k, v, mask, scale, r0, r1, run) for run in rows.runs]
        o, l = _merge(parts, row_sink)  # noqa: E741  (B, H, n, D), (B, H, n)
        out[:, :, r0:r1], lse[:, :, r0:r1] = o, l
    return out, lse


def _run_forward(
    qb: Tensor, k: Tensor, v: Tensor, mask: Mask, scale: float, r0: int, r1: int, run: Run
) -> tuple[Tensor, Tensor]:
    """The kernel on one run: its output ``(B, H, n, D)`` and log-sum-exp ``(B, H, n)``, ``-inf`` in rows that see
    none of its keys (where the kernel gives 0)."""
    km, vm = k[:, :, run.j0 : run.j1], v[:, :, run.j0 : run.j1]  # (B, Hkv, m, D) each
    if run.full and mask.bias is None:
        o, l = _flash(qb, km, vm, 0.0, False, scale=scale)[:2]  # noqa: E741
        return o, l
    bias, seen = _run_mask(mask, r0, r1, run, qb.dtype)  # (B|1, H|1, n, m), (B|1, H|1, n) or None
    o, l = _flash(qb, km, vm, 0.0, False, attn_mask=bias, scale=scale)[:2]  # noqa: E741
    if seen is not None:
        l = torch.where(seen, l, float("-inf"))  # noqa: E741  (B, H, n)
    return o, l


def _run_mask(mask: Mask, r0: int, r1: int, run: Run, dtype: torch.dtype) -> tuple[Tensor, Tensor | None]:
    """A run's mask as the float bias the kernel adds (``-inf`` where hidden), ``(B|1, H|1, n, m)``, and which rows
    see some of its keys (``None``: all of them)."""
    allowed, bias = mask.tile(r0, r1, run.j0, run.j1, dtype, every=run.full)  # (B|1, H|1, n|1, m) each, or None
    n, m = r1 - r0, run.j1 - run.j0
    bias = torch.zeros((), dtype=dtype, device=mask.device) if bias is None else bias
    filled = bias if allowed is None else torch.where(allowed, bias, float("-inf"))  # (B|1, H|1, n|1, m)
    filled = filled.reshape((1,) * (4 - filled.dim()) + tuple(filled.shape))  # (B|1, H|1, n|1, m|1)
    filled = filled.expand(*filled.shape[:2], n, m)  # (B|1, H|1, n, m)
    if allowed is None:
        return filled, None
    seen = allowed.any(dim=-1)  # (B|1, H|1, n|1)
    return filled, seen.reshape((1,) * (3 - seen.dim()) + tuple(seen.shape))


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
        weight = torch.exp(run_lse - safe)[..., None]  # (B, H, n, 1); 0 where the run sees nothing
        term = torch.where(weight > 0, o * weight, 0.0)  # (B, H, n, D)
        out = term if out is None else out.add_(term)
    assert out is not None
    return out, safe


class _Tiles(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx, q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, mask: Mask, scale: float, watched: Watched | None
    ) -> Tensor:
        out, lse = _forward(q, k, v, sinks, mask, scale)
        ctx.save_for_backward(q, k, v, sinks, out, lse)
        ctx.mask, ctx.scale, ctx.watched = mask, scale, watched
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        q, k, v, sinks, out, lse = ctx.saved_tensors
        if ctx.watched is not None:
            ctx.watched.check(NAME)
        mask: Mask = ctx.mask
        dout = dout.to(out.dtype).contiguous()
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for rows in plan(mask):
            r0, r1 = rows.r0, rows.r1
            qb, ob, lb, db = q[:, :, r0:r1], out[:, :, r0:r1], lse[:, :, r0:r1], dout[:, :, r0:r1]
            for run in rows.runs:
                km, vm = k[:, :, run.j0 : run.j1], v[:, :, run.j0 : run.j1]  # (B, Hkv, m, D)
                bias = None
                if not (run.full and mask.bias is None):
                    bias, _ = _run_mask(mask, r0, r1, run, q.dtype)  # (B|1, H|1, n, m)
                g = _flash_backward(db, qb, km, vm, ob, lb, 0.0, False, attn_mask=bias, scale=ctx.scale)
                dq[:, :, r0:r1] += g[0]  # (B, H, n, D)
                dk[:, :, run.j0 : run.j1] += g[1]  # (B, Hkv, m, D)
                dv[:, :, run.j0 : run.j1] += g[2]  # (B, Hkv, m, D)
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            # d lse / d sink = the sink's weight, exp(sink - lse); d out / d sink = -(sink's weight) * out
            sink = mask.sink_logits(sinks.to(q.dtype))[..., 0]  # (B|1, H, Lq|1)
            delta = (dout * out).sum(dim=-1)  # (B, H, Lq)
            dsinks = -(torch.exp(sink - lse) * delta).sum(dim=(0, 2)).to(sinks.dtype)  # (H,)
        return dq, dk, dv, dsinks, None, None, None
