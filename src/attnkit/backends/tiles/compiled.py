"""The tile engine in torch ops, compiled (``tiles:compiled``): the online softmax of
:mod:`attnkit.backends.tiles.online`, one tile at a time, each tile's step compiled by ``torch.compile`` (Inductor's
C++ code on CPU), forward and backward: for score_mods the C++ kernel does not run (a function of the caller's that
is no bias on the distance) and additive scoring, in calls large enough to repay compiling.

The tiles are those of the call's plan (:class:`attnkit.plan.Plan`: ``BLOCK`` queries x ``BLOCK`` keys, hidden tiles
never touched, the mask built only on partly visible ones). A step scores its tile, applies the ``score_mod`` and the
mask, and folds the tile into the running softmax of its queries; the backward step recomputes the tile's weights from
each row's log-sum-exp and takes the score_mod's derivative with ``torch.func.vjp``, all in one compiled function, so
that a ``score_mod`` such as ``softcap`` costs one fused pass over the tile, not one per operation. The tensors a
score_mod closes over that require grad (a learned table of biases) get their gradients from one more compiled function
per tile, ``sum(score_mod(scores) * dscores)``, differentiated by autograd.

Additive scoring runs on the same tiles, its ``(B, H, n, c, D)`` features fused into the sums that read them and never
stored; where the queries' range allows (:func:`~attnkit.backends.tiles.compiled_steps.exp_form`), ``tanh(q + k)`` is
worked out from ``exp(2 q)`` and ``exp(2 k)``, made once per call, as ``1 - 2 / (exp(2 q) exp(2 k) + 1)``: a product and
a reciprocal per feature instead of a ``tanh``, forward and backward.

Compiling a step takes seconds, once per score_mod and shape; :mod:`attnkit.dispatch` sends a call here only when it is
large enough to repay that (``dispatch.COMPILE_FROM``, ``dispatch.ADDITIVE_FROM``), and never one whose steps failed to
compile before (they would run eagerly, every tile's features held: :func:`missing`). A score_mod is first run once,
eagerly, on a real tile, where a function that raises or returns the wrong shape or dtype gets the errors of
:func:`attnkit.mods.evaluate.evaluate_score`. If compiling then fails, the same steps run eagerly, with one warning.

Cannot: weights, dropout, gradients to a float ``attn_mask``, modifiers whose tensors it cannot find under autograd:
``SUPPORTS``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit import mods
from attnkit import plan as plans
from attnkit.backends.common import Watched, first_order_only, probe, repeat_kv, row_sinks, sinks_grad, zero_dead
from attnkit.backends.contract import ADDITIVE, DOT, Call, Supports
from attnkit.backends.tiles import compiled_steps as steps
from attnkit.backends.tiles.softmax import LogSumExp, RunningSoftmax
from attnkit.masks import Mask, all_finite, compute_dtype

NAME = "tiles:compiled"

# B batch, H heads, Lq/Lk query/key length, D head dim, Dv value head dim, n a tile's queries, m a tile's keys


ScoreFn = steps.ScoreFn  # score_mod(score, b, h, q_idx, kv_idx)


def attention(call: Call) -> tuple[Tensor, Tensor | None]:
    q, k, v, mask = call.q, call.k, call.v, call.mask
    B, H, Lq, D = q.shape
    dtype = compute_dtype(q.dtype)
    plans.plan_of(mask)  # first: looking at the tiles, it learns which keys and rows are live (zero_dead's question)
    q, k, v = zero_dead(q, k, v, mask, call.zeros_past)
    qf = q.to(dtype)  # (B, H, Lq, D)
    kf = repeat_kv(k, H).to(dtype)  # (B, H, Lk, D): repeated outside the Function, autograd sums the groups back
    vf = repeat_kv(v, H).to(dtype)  # (B, H, Lk, Dv)
    w = None if call.w_v is None else call.w_v.to(dtype)  # (D,)
    sinks = None if call.sinks is None else call.sinks.to(dtype)
    score_mod = call.score_mod
    step_mod = _step_form(score_mod)
    closed_over: tuple[Tensor, ...] = ()
    if score_mod is not None and torch.is_grad_enabled():  # (one that takes single scores only: missing refused it)
        read = call.tensors_read(score_mod)
        closed_over = mods.grad_inputs(score_mod, probe(dtype, q.device), read or ())
    watched = Watched.of(call) if call.needs_grad else None
    out = _Compiled.apply(qf, kf, vf, w, sinks, mask, step_mod, call.scale, watched, *closed_over)  # (B, H, Lq, Dv)
    return out.to(q.dtype), None


def missing(call: Call) -> str | None:
    """Why these steps would not pay here: its score_mod's steps failed to compile before (eagerly, a step holds a
    whole tile's features and temporaries), or its score_mod takes single scores only (:func:`takes_blocks`)."""
    if steps.failed(_step_form(call.score_mod)):
        return "its steps compiled (they failed to, for this score_mod, and would run eagerly: 'tiles:online' runs it)"
    if not takes_blocks(call):
        name = steps.name(call.score_mod)
        return f"a score_mod that takes blocks of scores ({name} takes single scores only: 'tiles:online' runs it)"
    return None


def _step_form(score_mod: ScoreFn | None) -> ScoreFn | None:
    """The score_mod as the steps run it: a built-in's form for compiled code (softcap's is faster)."""
    return score_mod.compiled() if isinstance(score_mod, mods.ScoreMod) else score_mod


SUPPORTS = Supports(
    scoring=frozenset({DOT, ADDITIVE}),
    weights=False,
    dropout=False,
    bias_grad=False,
    devices=frozenset({"cpu"}),
    dtypes=frozenset({torch.float32, torch.float64}),
    opaque_modifiers=False,
    missing=missing,
)


def takes_blocks(call: Call) -> bool:
    """Whether the call's score_mod takes blocks of scores, as the compiled steps call it (False: it runs element by
    element only, as ``tiles:online`` runs it). It is run once, eagerly, on the first visible tile, so that a function
    that raises or returns the wrong shape or dtype is told in attnkit's words, not from inside the compiler
    (:func:`missing` asks, once a call).

    Raises:
        TypeError, ValueError: naming the function and what it raised or returned.
    """
    score_mod, mask = call.score_mod, call.mask
    if score_mod is None:
        return True
    B, H = call.q.shape[:2]
    q, k = call.q.detach(), repeat_kv(call.k.detach(), H)  # (B, H, Lq, D), (B, H, Lk, D)
    for rows in plans.plan_of(mask).rows:
        for run in rows.runs:
            r0, r1, j0, j1 = rows.r0, rows.r1, run.j0, min(run.j1, run.j0 + plans.BLOCK)
            if call.w_v is None:
                scores = (q[:, :, r0:r1] @ k[:, :, j0:j1].transpose(-2, -1)) * call.scale  # (B, H, n, c)
            else:
                scores = _additive_probe(q[:, :, r0:r1], k[:, :, j0:j1], call.w_v.detach())  # (B, H, n, c)
            idx = mods.indices(B, H, (r0, r1), (j0, j1), q.device)
            try:  # as a compiled step calls it
                out = score_mod(scores.clone(), *idx)
                if isinstance(out, Tensor) and out.is_floating_point() and _broadcasts(out.shape, scores.shape):
                    return True
            except Exception:
                pass
            name = steps.name(score_mod)
            try:  # attnkit's words for what is wrong; or it runs element by element, and is no function of blocks
                mods.evaluate_score(score_mod, scores, *idx, protected=None)
            except Exception as error:
                if type(error) in (TypeError, ValueError):  # attnkit's own words about what it returned
                    raise type(error)(f"score_mod {name}: {error}") from error
                raise ValueError(
                    f"score_mod {name} raised {type(error).__name__} on a block of scores of shape "
                    f"{tuple(scores.shape)}: {error}"
                ) from error
            return False
    return True


def _additive_probe(q: Tensor, k: Tensor, w: Tensor) -> Tensor:
    """Additive scores ``(B, H, n, c)`` of ``q (B, H, n, D)`` and ``k (B, H, c, D)``, a feature at a time (the
    ``(B, H, n, c, D)`` features of a whole tile would be a large tensor)."""
    scores = q.new_zeros((*q.shape[:3], k.shape[2]))  # (B, H, n, c)
    for d in range(q.shape[-1]):
        scores += torch.tanh(q[..., d, None] + k[..., None, :, d]) * w[d]  # (B, H, n, c)
    return scores


def _broadcasts(shape: torch.Size, target: torch.Size) -> bool:
    try:
        return torch.broadcast_shapes(shape, target) == target
    except RuntimeError:
        return False


class _Grid:
    """The tiles of a call, from its plan (:class:`attnkit.plan.Plan`), each made ``BLOCK x BLOCK``: tensors are
    laid out a block of positions at a time (:func:`_blocked`), so that every tile is a contiguous block of the same
    shape and strides whatever the lengths (a shape or stride is one more compile); a tile at the end of the queries
    or keys is padded with zeros, hidden by its mask, and its indices repeat the last one."""

    def __init__(self, mask: Mask, B: int, H: int, device: torch.device) -> None:
        self.mask = mask
        self.b, self.h, _, _ = mods.indices(B, H, (0, 1), (0, 1), device)  # (B, 1, 1, 1), (1, H, 1, 1)
        self.q_idx = _padded_range(mask.num_queries, device).view(-1, 1, 1, plans.BLOCK, 1)  # (nq, 1, 1, BLOCK, 1)
        self.kv_idx = _padded_range(mask.num_keys, device).view(-1, 1, 1, 1, plans.BLOCK)  # (nk, 1, 1, 1, BLOCK)

    def blocks(self) -> list[tuple[int, int, list[tuple[int, int, bool]]]]:
        """Each block of queries ``(r0, r1)`` and its tiles of keys ``(j0, j1, every)`` (``every``: every pair is
        visible, no mask to build); all start at multiples of ``BLOCK``."""
        out = []
        for rows in plans.plan_of(self.mask).rows:
            row_tiles = []
            for run in rows.runs:
                for j0 in range(run.j0, run.j1, plans.BLOCK):
                    row_tiles.append((j0, min(j0 + plans.BLOCK, run.j1), run.kind == plans.FULL))
            out.append((rows.r0, rows.r1, row_tiles))
        return out

    def indices(self, r0: int, j0: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``b, h, q_idx (1, 1, BLOCK, 1), kv_idx (1, 1, 1, BLOCK)`` of the tile at ``(r0, j0)``."""
        return self.b, self.h, self.q_idx[r0 // plans.BLOCK], self.kv_idx[j0 // plans.BLOCK]

    def masks(
        self, r0: int, r1: int, j0: int, j1: int, every: bool, dtype: torch.dtype
    ) -> tuple[Tensor | None, Tensor | None]:
        """``allowed`` and ``bias`` of a tile, each a new ``(B|1, H|1, BLOCK, BLOCK)`` tensor or ``None``."""
        allowed, bias = self.mask.tile(r0, r1, j0, j1, dtype, every=every)  # (B|1, H|1, n|1, c) each, or None
        n, c = r1 - r0, j1 - j0
        if allowed is None and (n < plans.BLOCK or c < plans.BLOCK):
            allowed = torch.ones((), dtype=torch.bool, device=self.q_idx.device)
        return (
            None if allowed is None else _fitted(allowed, n, c, False),
            None if bias is None else _fitted(bias, n, c, 0.0),
        )


def _padded_range(length: int, device: torch.device) -> Tensor:
    """``0 .. length - 1``, then ``length - 1`` up to a multiple of ``BLOCK`` (0 for no length)."""
    padded = -(-length // plans.BLOCK) * plans.BLOCK
    return torch.arange(padded, device=device).clamp_max(max(length - 1, 0))  # (padded,)


def _fitted(t: Tensor, n: int, c: int, fill: float | bool) -> Tensor:
    """A tile's ``allowed`` or ``bias`` (broadcastable to ``(B, H, n, c)``) as a new ``(B|1, H|1, BLOCK, BLOCK)``
    tensor, ``fill`` past ``n`` rows and ``c`` keys."""
    t = t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))  # (B|1, H|1, n|1, c|1)
    out = t.new_full((*t.shape[:2], plans.BLOCK, plans.BLOCK), fill)  # (B|1, H|1, BLOCK, BLOCK)
    out[..., :n, :c] = t
    return out


def _blocked(t: Tensor) -> Tensor:
    """``t (B, H, L, ...)`` as ``(nb, B, H, BLOCK, ...)``, zeros past ``L``: block ``i`` holds positions
    ``[i * BLOCK, (i + 1) * BLOCK)``, contiguous."""
    B, H, L = t.shape[:3]
    nb = -(-L // plans.BLOCK)
    pad = t.new_zeros((B, H, nb * plans.BLOCK - L, *t.shape[3:]))
    t = torch.cat([t, pad], dim=2)  # (B, H, nb * BLOCK, ...)
    return t.view(B, H, nb, plans.BLOCK, *t.shape[3:]).movedim(2, 0).contiguous()  # (nb, B, H, BLOCK, ...)


def _unblocked(t: Tensor, length: int) -> Tensor:
    """The inverse of :func:`_blocked`: ``(nb, B, H, BLOCK, ...)`` as ``(B, H, length, ...)``."""
    nb, B, H = t.shape[:3]
    t = t.movedim(0, 2).reshape(B, H, nb * plans.BLOCK, *t.shape[4:])  # (B, H, nb * BLOCK, ...)
    return t[:, :, :length]


def _forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    w: Tensor | None,
    sinks: Tensor | None,
    mask: Mask,
    score_mod: ScoreFn | None,
    scale: float,
    exp: bool,
    guard: bool,
) -> tuple[Tensor, LogSumExp, Tensor]:
    """The output ``(B, H, Lq, Dv)``, each row's log-sum-exp and which rows saw some key ``(B, H, Lq)``, of
    ``q (B, H, Lq, D)`` over ``k (B, H, Lk, D)`` and ``v (B, H, Lk, Dv)``, tile by tile; ``w (D,)`` for additive
    scoring, ``exp`` its form, ``guard``: some key or value is not finite
    (:func:`~attnkit.backends.tiles.compiled_steps._forward_step`)."""
    B, H, Lq, _ = q.shape
    Dv, T = v.shape[-1], plans.BLOCK
    out = q.new_zeros((B, H, Lq, Dv))  # (B, H, Lq, Dv)
    sink = None if sinks is None else row_sinks(sinks, mask, q.shape, q.dtype)  # (B, H, Lq)
    # 0 in rows that see no key; the sink's logit where there is one (no keys at all: no block of queries below)
    top = q.new_zeros((B, H, Lq)) if sink is None else sink.clone()  # (B, H, Lq)
    rest = q.new_zeros((B, H, Lq))  # (B, H, Lq)
    saw = torch.zeros((B, H, Lq), dtype=torch.bool, device=q.device)  # (B, H, Lq)
    grid = _Grid(mask, B, H, q.device)
    qs, ks, vs = _blocked(q), _blocked(k), _blocked(v)  # (nq, B, H, T, D), (nk, B, H, T, D), (nk, B, H, T, Dv)
    for r0, r1, row_tiles in grid.blocks():
        n = r1 - r0
        m = q.new_full((B, H, T), float("-inf"))  # (B, H, T) running row max
        l = q.new_zeros((B, H, T))  # noqa: E741  running normaliser
        if sink is not None:  # the sink first (its value is 0)
            m[:, :, :n], l[:, :, :n] = sink[:, :, r0:r1], 1.0
        acc = q.new_zeros((B, H, T, Dv))  # (B, H, T, Dv) running unnormalised output
        saw_key = torch.zeros((B, H, T), dtype=torch.bool, device=q.device)  # (B, H, T)
        for j0, j1, every in row_tiles:
            allowed, bias = grid.masks(r0, r1, j0, j1, every, q.dtype)  # (B|1, H|1, T, T) each, or None
            idx = grid.indices(r0, j0)
            kb, vb = ks[j0 // T], vs[j0 // T]  # (B, H, T, D), (B, H, T, Dv)
            args = (qs[r0 // T], kb, vb, w, m, l, acc, saw_key, idx, allowed, bias, scale, exp, guard)
            m, l, acc, saw_key = steps.run("forward", score_mod, *args)  # noqa: E741
        state = RunningSoftmax(m[:, :, :n], l[:, :, :n], acc[:, :, :n])  # (B, H, n), (B, H, n), (B, H, n, Dv)
        found, lse = state.result()  # (B, H, n, Dv), (B, H, n) x 2: 0s where nothing summed
        assert lse.rest is not None  # (result() keeps the two terms apart)
        out[:, :, r0:r1], top[:, :, r0:r1], rest[:, :, r0:r1] = found, lse.top, lse.rest
        saw[:, :, r0:r1] = saw_key[:, :, :n]
    return out, LogSumExp(top, rest), saw


class _Compiled(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        w: Tensor | None,
        sinks: Tensor | None,
        mask: Mask,
        score_mod: ScoreFn | None,
        scale: float,
        watched: Watched | None,
        *closed_over: Tensor,
    ) -> Tensor:
        guard = not (all_finite(k) and all_finite(v))  # one read of each: the steps then keep them from hidden rows
        found = None if w is None else steps.exp_form(q, k)  # additive, shifted and clamped: (B, H, L, D) each
        if found is not None:
            q, k = found
        out, lse, saw = _forward(q, k, v, w, sinks, mask, score_mod, scale, found is not None, guard)
        # rows that saw no key (the mask's, a score_mod's -inf) are zeros: their output gradient must reach nothing
        ctx.emptied = None if not any(ctx.needs_input_grad) or bool(saw.all()) else ~saw  # (B, H, Lq) or None
        ctx.save_for_backward(q, k, v, w, sinks, out, *lse, *closed_over)
        ctx.mask, ctx.score_mod, ctx.scale, ctx.watched, ctx.guard = mask, score_mod, scale, watched, guard
        ctx.exp = found is not None
        return out

    @staticmethod
    def backward(ctx, dout: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        first_order_only(NAME)
        q, k, v, w, sinks, out, top, rest, *closed_over = ctx.saved_tensors  # q, k in the exp form where ctx.exp
        lse = LogSumExp(top, rest)  # (B, H, Lq) x 2
        if ctx.watched is not None:
            ctx.watched.check(NAME)
        mask: Mask = ctx.mask
        score_mod, scale = ctx.score_mod, ctx.scale
        B, H, Lq, _ = q.shape
        dout = dout.to(out.dtype)
        gones = None
        if ctx.emptied is not None:  # their queries too, hidden below: 0 * NaN would reach dk through their scores
            dout = dout.masked_fill(ctx.emptied[..., None], 0.0)  # (B, H, Lq, Dv)
            q = q.masked_fill(ctx.emptied[..., None], 0.0)  # (B, H, Lq, D)
            gones = _blocked(ctx.emptied)  # (nq, B, H, T)
        delta = (dout * out).sum(dim=-1)  # (B, H, Lq): sum_j p_ij dp_ij, the softmax Jacobian's row term
        closed_grads = [torch.zeros_like(t) for t in closed_over]
        keep = bool(closed_over)
        grid, guard = _Grid(mask, B, H, q.device), ctx.guard
        T = plans.BLOCK
        qs, ks, vs, douts = _blocked(q), _blocked(k), _blocked(v), _blocked(dout)  # (nq|nk, B, H, T, D|Dv)
        tops, rests, deltas = _blocked(top), _blocked(rest), _blocked(delta)  # (nq, B, H, T)
        dqs, dks, dvs = torch.zeros_like(qs), torch.zeros_like(ks), torch.zeros_like(vs)  # as qs, ks, vs
        wanted = w is not None and ctx.needs_input_grad[3]
        dws = torch.zeros_like(qs) if wanted else None  # (nq, B, H, T, D): each query's share of dw
        for r0, r1, row_tiles in grid.blocks():
            i = r0 // T
            for j0, j1, every in row_tiles:
                allowed, bias = grid.masks(r0, r1, j0, j1, every, q.dtype)  # (B|1, H|1, T, T) or None
                if gones is not None:  # rows the forward found with no key, whatever their scores are now
                    gone = gones[i][..., None].expand(B, H, T, T)  # (B, H, T, T)
                    allowed = ~gone if allowed is None else allowed & ~gone  # (B, H, T, T)
                idx = grid.indices(r0, j0)
                j = j0 // T
                args = (
                    qs[i],
                    ks[j],
                    vs[j],
                    w,
                    douts[i],
                    (tops[i], rests[i]),
                    deltas[i],
                    idx,
                    allowed,
                    bias,
                    scale,
                    ctx.exp,
                )
                g = steps.run("backward", score_mod, *args, guard, keep)
                dqs[i] += g[0]  # (B, H, T, D)
                dks[j] += g[1]  # (B, H, T, D)
                dvs[j] += g[2]  # (B, H, T, Dv)
                if dws is not None:
                    dws[i] += g[3]  # (B, H, T, D)
                if keep:
                    through = steps.closure_grads(score_mod, g[4], g[5], idx, closed_over)
                    for total, part in zip(closed_grads, through, strict=True):
                        if part is not None:
                            total += part
        dq, dk, dv = _unblocked(dqs, Lq), _unblocked(dks, k.shape[2]), _unblocked(dvs, v.shape[2])
        dw = None if dws is None else dws.sum(dim=(0, 1, 2, 3))  # (D,): padded rows hold 0
        dsinks = sinks_grad(sinks, mask, lse, delta) if sinks is not None and ctx.needs_input_grad[4] else None
        return (dq, dk, dv, dw, dsinks, None, None, None, None, *closed_grads)
