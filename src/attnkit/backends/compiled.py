"""Score modifiers through compiled blocks: the online softmax of :mod:`attnkit.backends.chunked`, one tile at a
time, each tile's step compiled by ``torch.compile`` (Inductor's C++ code on CPU), forward and backward.

The tiles are those of :mod:`attnkit.backends.tiles`' plan (``BLOCK`` queries x ``BLOCK`` keys, hidden tiles never
touched, the mask built only on partly visible ones). A step scores its tile, applies the ``score_mod`` and the
mask, and folds the tile into the running softmax of its queries; the backward step recomputes the tile's weights
from each row's log-sum-exp and takes the score_mod's derivative with ``torch.func.vjp``, all in one compiled
function, so that a ``score_mod`` such as ``softcap`` costs one fused pass over the tile, not one per operation.
The tensors a score_mod closes over that require grad (a learned table of biases) get their gradients from one more
compiled function per tile, ``sum(score_mod(scores) * dscores)``, differentiated by autograd.

Compiling a step takes seconds, once per score_mod and shape; :mod:`attnkit.dispatch` sends a call here only when
it is large enough to repay that (:data:`COMPILE_FROM`). A score_mod is first run once, eagerly, on a real tile,
where a function that raises or returns the wrong shape or dtype gets the errors of
:func:`attnkit.mods.evaluate_score`. If compiling then fails, the same steps run eagerly, with one warning.

Cannot: additive scoring, weights, dropout, gradients to a float ``attn_mask``, modifiers whose tensors it cannot
find under autograd: :data:`SUPPORTS`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit import mods
from attnkit.backends import chunked, tiles
from attnkit.backends import compiled_steps as steps
from attnkit.backends.common import Watched, repeat_kv, zero_dead
from attnkit.backends.contract import DOT, Call, Supports
from attnkit.masks import Mask, compute_dtype

NAME = "compiled"

# B batch, H heads, Lq/Lk query/key length, D head dim, Dv value head dim, n a tile's queries, m a tile's keys

# A score_mod that is not a bias goes here from this many scores per call (B * H * Lq * Lk): compiling the steps
# takes about 4 s forward and 5 s backward here, which chunked's time at H=8, L=8192 (4.6 s a call) repays at once;
# smaller calls stay on chunked unless this backend is named.
COMPILE_FROM = 2**27

SUPPORTS = Supports(
    scoring=frozenset({DOT}),
    weights=False,
    dropout=False,
    bias_grad=False,
    devices=frozenset({"cpu"}),
    dtypes=frozenset({torch.float32, torch.float64}),
    opaque_modifiers=False,
)

ScoreFn = steps.ScoreFn


def attention(call: Call) -> tuple[Tensor, Tensor | None]:
    q, k, v, mask = call.q, call.k, call.v, call.mask
    B, H, Lq, D = q.shape
    dtype = compute_dtype(q.dtype)
    tiles.plan(mask)  # first: looking at the tiles, it learns which keys and rows are live (zero_dead's question)
    q, k, v = zero_dead(q, k, v, mask, call.zeros_past)
    qf = q.to(dtype)  # (B, H, Lq, D)
    kf = repeat_kv(k, H).to(dtype)  # (B, H, Lk, D): repeated outside the Function, autograd sums the groups back
    vf = repeat_kv(v, H).to(dtype)  # (B, H, Lk, Dv)
    sinks = None if call.sinks is None else call.sinks.to(dtype)
    score_mod = call.score_mod
    closed_over: tuple[Tensor, ...] = ()
    if score_mod is not None:
        if not _check_score_mod(score_mod, qf, kf, mask, call.scale):
            steps.warn_once(score_mod, "it takes single scores only, not blocks")
            return chunked.attention(call)
        if torch.is_grad_enabled():
            read = call.tensors_read(score_mod)
            closed_over = mods.grad_inputs(score_mod, _probe(qf), read or ())
    watched = Watched.of(call) if call.needs_grad else None
    out = _Compiled.apply(qf, kf, vf, sinks, mask, score_mod, call.scale, watched, *closed_over)  # (B, H, Lq, Dv)
    return out.to(q.dtype), None


def _probe(q: Tensor) -> tuple[Tensor, ...]:
    """One score, of query 0 and key 0 of example 0 and head 0, to run a score_mod on once."""
    zero = torch.zeros((1, 1, 1, 1), dtype=torch.long, device=q.device)
    return (torch.zeros((1, 1, 1, 1), dtype=q.dtype, device=q.device), zero, zero, zero, zero)


def _check_score_mod(score_mod: ScoreFn, q: Tensor, k: Tensor, mask: Mask, scale: float) -> bool:
    """Run the score_mod once, eagerly, on the first visible tile, so that a function that raises or returns the
    wrong shape or dtype is told in attnkit's words, not from inside the compiler. Returns whether it takes blocks
    of scores (False: it runs element by element only, as ``chunked`` runs it).

    Raises:
        TypeError, ValueError: naming the function and what it raised or returned.
    """
    for rows in tiles.plan(mask):
        for run in rows.runs:
            r0, r1, j0, j1 = rows.r0, rows.r1, run.j0, min(run.j1, run.j0 + tiles.BLOCK)
            scores = (q[:, :, r0:r1] @ k[:, :, j0:j1].transpose(-2, -1)) * scale  # (B, H, n, m)
            idx = mods.indices(q.shape[0], q.shape[1], (r0, r1), (j0, j1), q.device)
            name = steps.name(score_mod)
            try:
                mods.evaluate_score(score_mod, scores.clone(), *idx, protected=None)
            except (TypeError, ValueError) as error:
                raise type(error)(f"score_mod {name}: {error}") from error
            except Exception as error:
                raise ValueError(
                    f"score_mod {name} raised {type(error).__name__} on a block of scores of shape "
                    f"{tuple(scores.shape)}: {error}"
                ) from error
            try:
                out = score_mod(scores, *idx)  # as a compiled step calls it
            except Exception:
                return False
            return isinstance(out, Tensor) and _broadcasts(out.shape, scores.shape)
    return True


def _broadcasts(shape: torch.Size, target: torch.Size) -> bool:
    try:
        return torch.broadcast_shapes(shape, target) == target
    except RuntimeError:
        return False


BLOCK = tiles.BLOCK


class _Grid:
    """The tiles of a call, from the plan of :mod:`~attnkit.backends.tiles`, each made ``BLOCK x BLOCK``: a tile at
    the end of the queries or keys is padded with zeros, hidden by its mask, and its indices repeat the last one,
    so that the compiled steps see one shape (a shape is one more compile)."""

    def __init__(self, mask: Mask, B: int, H: int, device: torch.device) -> None:
        self.mask = mask
        Lq, Lk = mask.num_queries, mask.num_keys
        self.b, self.h, _, _ = mods.indices(B, H, (0, 1), (0, 1), device)  # (B, 1, 1, 1), (1, H, 1, 1)
        self.q_idx = _padded_range(Lq, device).view(1, 1, -1, 1)  # (1, 1, Lq + pad, 1)
        self.kv_idx = _padded_range(Lk, device).view(1, 1, 1, -1)  # (1, 1, 1, Lk + pad)

    def blocks(self) -> list[tuple[int, int, list[tuple[int, int, bool]]]]:
        """Each block of queries ``(r0, r1)`` and its tiles of keys ``(j0, j1, every)`` (``every``: every pair is
        visible, no mask to build)."""
        out = []
        for rows in tiles.plan(self.mask):
            steps = []
            for run in rows.runs:
                for j0 in range(run.j0, run.j1, BLOCK):
                    steps.append((j0, min(j0 + BLOCK, run.j1), run.kind == tiles.FULL))
            out.append((rows.r0, rows.r1, steps))
        return out

    def indices(self, r0: int, j0: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``b, h, q_idx (1, 1, BLOCK, 1), kv_idx (1, 1, 1, BLOCK)`` of the tile at ``(r0, j0)``."""
        return self.b, self.h, self.q_idx[:, :, r0 : r0 + BLOCK], self.kv_idx[..., j0 : j0 + BLOCK]

    def masks(
        self, r0: int, r1: int, j0: int, j1: int, every: bool, dtype: torch.dtype
    ) -> tuple[Tensor | None, Tensor | None]:
        """``allowed`` and ``bias`` of a tile, each ``(B|1, H|1, BLOCK, BLOCK)`` or ``None``."""
        allowed, bias = self.mask.tile(r0, r1, j0, j1, dtype, every=every)  # (B|1, H|1, n|1, m) each, or None
        n, m = r1 - r0, j1 - j0
        if allowed is None and (n < BLOCK or m < BLOCK):
            allowed = torch.ones((), dtype=torch.bool, device=self.q_idx.device)
        return (
            None if allowed is None else _fitted(allowed, n, m, False),
            None if bias is None else _fitted(bias, n, m, 0.0),
        )


def _padded_range(length: int, device: torch.device) -> Tensor:
    """``0 .. length - 1``, then ``length - 1`` up to a multiple of ``BLOCK`` (0 for no length)."""
    padded = -(-length // BLOCK) * BLOCK
    return torch.arange(padded, device=device).clamp_max(max(length - 1, 0))  # (padded,)


def _fitted(t: Tensor, n: int, m: int, fill: float | bool) -> Tensor:
    """A tile's ``allowed`` or ``bias`` (broadcastable to ``(B, H, n, m)``) as a new ``(B|1, H|1, BLOCK, BLOCK)``
    tensor, ``fill`` past ``n`` rows and ``m`` keys."""
    t = t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))  # (B|1, H|1, n|1, m|1)
    out = t.new_full((*t.shape[:2], BLOCK, BLOCK), fill)  # (B|1, H|1, BLOCK, BLOCK)
    out[..., :n, :m] = t
    return out


def _padded(t: Tensor, n: int) -> Tensor:
    """``t (B, H, n, ...)`` with zeros up to ``BLOCK`` along dim 2."""
    if n == BLOCK:
        return t
    return torch.cat([t, t.new_zeros((*t.shape[:2], BLOCK - n, *t.shape[3:]))], dim=2)  # (B, H, BLOCK, ...)


def _not_finite(k: Tensor, v: Tensor) -> bool:
    """Some key or value is not finite (one read of each): the steps then keep it from rows that do not see it."""
    return not (bool(torch.isfinite(k).all()) and bool(torch.isfinite(v).all()))


def _forward(
    q: Tensor, k: Tensor, v: Tensor, sinks: Tensor | None, mask: Mask, score_mod: ScoreFn | None, scale: float
) -> tuple[Tensor, Tensor]:
    B, H, Lq, _ = q.shape
    Dv = v.shape[-1]
    out = q.new_zeros((B, H, Lq, Dv))  # (B, H, Lq, Dv)
    sink = None if sinks is None else mask.sink_logits(sinks)[..., 0].expand(B, H, Lq)  # (B, H, Lq)
    # 0 in rows that see no key; the sink's logit where there is one (no keys at all: no block of queries below)
    lse = q.new_zeros((B, H, Lq)) if sink is None else sink.clone()  # (B, H, Lq)
    grid = _Grid(mask, B, H, q.device)
    guard = _not_finite(k, v)
    for r0, r1, row_tiles in grid.blocks():
        n = r1 - r0
        m = q.new_full((B, H, BLOCK), float("-inf"))  # (B, H, BLOCK) running row max
        l = q.new_zeros((B, H, BLOCK))  # noqa: E741  running normaliser
        if sink is not None:  # the sink first (its value is 0)
            m[:, :, :n], l[:, :, :n] = sink[:, :, r0:r1], 1.0
        acc = q.new_zeros((B, H, BLOCK, Dv))  # (B, H, BLOCK, Dv) running unnormalised output
        qb = _padded(q[:, :, r0:r1], n)  # (B, H, BLOCK, D)
        for j0, j1, every in row_tiles:
            kb, vb = _padded(k[:, :, j0:j1], j1 - j0), _padded(v[:, :, j0:j1], j1 - j0)  # (B, H, BLOCK, D|Dv)
            allowed, bias = grid.masks(r0, r1, j0, j1, every, q.dtype)  # (B|1, H|1, BLOCK, BLOCK) each, or None
            idx = grid.indices(r0, j0)
            m, l, acc = steps.run("forward", score_mod, qb, kb, vb, m, l, acc, idx, allowed, bias, scale, guard)  # noqa: E741
        m, l, acc = m[:, :, :n], l[:, :, :n], acc[:, :, :n]  # noqa: E741  (B, H, n), (B, H, n, Dv)
        empty = l == 0  # (B, H, n): rows that summed nothing
        out[:, :, r0:r1] = torch.where(empty[..., None], 0.0, acc / l.clamp_min(torch.finfo(l.dtype).tiny)[..., None])
        lse[:, :, r0:r1] = torch.where(empty, 0.0, m + torch.log(l))
    return out, lse


class _Compiled(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        sinks: Tensor | None,
        mask: Mask,
        score_mod: ScoreFn | None,
        scale: float,
        watched: Watched | None,
        *closed_over: Tensor,
    ) -> Tensor:
        out, lse = _forward(q, k, v, sinks, mask, score_mod, scale)
        ctx.save_for_backward(q, k, v, sinks, out, lse, *closed_over)
        ctx.mask, ctx.score_mod, ctx.scale, ctx.watched = mask, score_mod, scale, watched
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        q, k, v, sinks, out, lse, *closed_over = ctx.saved_tensors
        if ctx.watched is not None:
            ctx.watched.check(NAME)
        mask: Mask = ctx.mask
        score_mod, scale = ctx.score_mod, ctx.scale
        B, H, Lq, _ = q.shape
        dout = dout.to(out.dtype)
        delta = (dout * out).sum(dim=-1)  # (B, H, Lq): sum_j p_ij dp_ij, the softmax Jacobian's row term
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        closed_grads = [torch.zeros_like(t) for t in closed_over]
        keep = bool(closed_over)
        grid = _Grid(mask, B, H, q.device)
        guard = _not_finite(k, v)
        for r0, r1, row_tiles in grid.blocks():
            n = r1 - r0
            qb, db = _padded(q[:, :, r0:r1], n), _padded(dout[:, :, r0:r1], n)  # (B, H, BLOCK, D|Dv)
            lb, eb = _padded(lse[:, :, r0:r1], n), _padded(delta[:, :, r0:r1], n)  # (B, H, BLOCK)
            for j0, j1, every in row_tiles:
                kb, vb = _padded(k[:, :, j0:j1], j1 - j0), _padded(v[:, :, j0:j1], j1 - j0)  # (B, H, BLOCK, D|Dv)
                allowed, bias = grid.masks(r0, r1, j0, j1, every, q.dtype)  # (B|1, H|1, BLOCK, BLOCK) or None
                idx = grid.indices(r0, j0)
                g = steps.run("backward", score_mod, qb, kb, vb, db, lb, eb, idx, allowed, bias, scale, guard, keep)
                dq[:, :, r0:r1] += g[0][:, :, :n]  # (B, H, n, D)
                dk[:, :, j0:j1] += g[1][:, :, : j1 - j0]  # (B, H, m, D)
                dv[:, :, j0:j1] += g[2][:, :, : j1 - j0]  # (B, H, m, Dv)
                if keep:
                    with torch.enable_grad():
                        term = steps.run("closure", score_mod, g[3], g[4], idx)
                    through = torch.autograd.grad(term, closed_over, allow_unused=True)
                    for total, part in zip(closed_grads, through, strict=True):
                        if part is not None:
                            total += part
        dsinks = None
        if sinks is not None and ctx.needs_input_grad[3]:
            # d lse / d sink = the sink's weight, exp(sink - lse); d out / d sink = -(sink's weight) * out
            weight = torch.exp(mask.sink_logits(sinks)[..., 0].expand(B, H, Lq) - lse)  # (B, H, Lq)
            dsinks = -(weight * delta).sum(dim=(0, 2))  # (H,)
        return (dq, dk, dv, dsinks, None, None, None, None, *closed_grads)
