"""Functional attention: validate, then dispatch.

``q`` may be ``(B, H, Lq, D)`` or ``(B, Lq, D)`` (one head; outputs then drop the head axis too), ``k``
``(B, Hkv, Lk, D)`` and ``v`` ``(B, Hkv, Lk, Dv)`` with ``Hkv`` dividing ``H`` (grouped-query attention: query
head ``h`` uses key/value head ``h // (H / Hkv)``). Masks follow :mod:`attnkit.masks`: ``True`` = may attend,
a row with nothing to attend to gives zeros. Inputs are never modified.
"""

from __future__ import annotations

import contextlib
import dataclasses
import numbers
from typing import Any, NamedTuple

import torch
from torch import Tensor

from attnkit import _compile, _context_parallel, dispatch, mods, trace, varlen
from attnkit._validate import check_qkv, check_same_kind, check_scale, describe
from attnkit._value_checks import checked, value_check
from attnkit.backends import reference
from attnkit.backends.common import no_gradient_from_empty_rows
from attnkit.backends.contract import Call, Unavailable
from attnkit.masks import Mask, compute_dtype
from attnkit.plan import Plan, plan_of

__all__ = ["AttentionOutput", "Masks", "additive_attention", "attention_weights", "scaled_dot_product_attention"]

# B batch, H heads, Hkv key/value heads, Lq/Lk query/key length, D head (or hidden) dim, Dv value head dim


class AttentionOutput(NamedTuple):
    """``output``: ``(B, H, Lq, Dv)`` (or ``(B, Lq, Dv)``); ``weights``: ``(B, H, Lq, Lk)`` (or ``(B, Lq, Lk)``),
    the probabilities before dropout, or ``None`` unless ``need_weights=True``."""

    output: Tensor
    weights: Tensor | None


class AttendResult(NamedTuple):
    """What :func:`attend` gives attnkit's layers: the :class:`AttentionOutput`'s two, and ``lse (B, H, Lq)``, each
    row's log-sum-exp of its scaled scores where the call asked for it and the backend had it at no cost (``None``
    otherwise): :func:`attnkit.stats.compute` then need not take the rows' sums again."""

    output: Tensor
    weights: Tensor | None
    lse: Tensor | None = None


class Masks(NamedTuple):
    """What a call says of who attends to whom, and of its scores: the masking arguments of
    :func:`scaled_dot_product_attention` as one value (attnkit's layers pass theirs on as it)."""

    valid_lens: Tensor | None = None
    attn_mask: Tensor | None = None
    is_causal: bool = False
    mask_mod: mods.MaskFn | None = None
    score_mod: mods.ScoreFn | None = None
    plan: Plan | None = None


def scaled_dot_product_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    valid_lens: Tensor | None = None,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    dropout_p: float = 0.0,
    need_weights: bool = False,
    backend: str = "auto",
    mask_mod: mods.MaskFn | None = None,
    score_mod: mods.ScoreFn | None = None,
    sinks: Tensor | None = None,
    plan: Plan | None = None,
) -> AttentionOutput:
    """``softmax(score_mod(q k^T * scale) + bias, masked) v``.

    Args:
        q: ``(B, H, Lq, D)`` or ``(B, Lq, D)``.
        k: ``(B, Hkv, Lk, D)`` or ``(B, Lk, D)``, same number of dims as ``q``.
        v: ``(B, Hkv, Lk, Dv)`` or ``(B, Lk, Dv)``.
        valid_lens: ``(B,)`` or ``(B, Lq)`` whole numbers in ``[0, Lk]``.
        attn_mask: boolean (``True`` = may attend) or float (added to the scores), broadcastable to
            ``(B, H, Lq, Lk)`` (to ``(B, Lq, Lk)`` for 3-dim inputs).
        is_causal: query ``i`` sees key ``j`` when ``j <= i + Lk - Lq``.
        scale: multiplies the scores; ``1 / sqrt(D)`` when ``None``.
        dropout_p: dropout on the weights (always applied when > 0; layers pass 0 in eval mode).
        need_weights: also return the weights (runs the reference backend).
        backend: ``"auto"`` or a backend's name: ``"reference"``, ``"sdpa"``, ``"decode"``, ``"tiles"``, ``"graph"``,
            ``"triton"``, or one of the tile engine's implementations, ``"tiles:kernel"``, ``"tiles:flex"``,
            ``"tiles:compiled"``, ``"tiles:online"`` (:mod:`attnkit.dispatch`; ``attnkit.available_backends()``
            lists the backends that run here).
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool``, True = may attend (FlexAttention's signature;
            built-ins in :mod:`attnkit.mods`); combines with the other masks (all must allow a pair).
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score``, on the scaled scores, before the float
            ``attn_mask`` is added; the tensors it closes over get gradients.
        sinks: ``(H,)`` (``(1,)`` for 3-dim inputs) attention-sink logits, one per query head:
            ``a[i, j] = exp(s_ij) / (exp(sinks[h]) + sum_j exp(s_ij))``; they get gradients.
        plan: the call's whole mask, planned once (:func:`attnkit.make_plan`, as FlexAttention's block mask) for
            every call that shares it: instead of ``mask_mod``, ``is_causal``, ``valid_lens`` and ``attn_mask``.

    Returns:
        :class:`AttentionOutput` ``(output, weights)``.

    Raises:
        ValueError, TypeError: naming the argument, with the shapes, for inputs that do not fit together (a
            ``plan`` made for other lengths, or given beside another mask).

    Example:
        >>> q, k, v = torch.ones(2, 1, 4), torch.ones(2, 3, 4), torch.arange(24.0).reshape(2, 3, 4)
        >>> out, w = scaled_dot_product_attention(q, k, v, valid_lens=torch.tensor([1, 2]), need_weights=True)
        >>> out
        tensor([[[ 0.,  1.,  2.,  3.]],
        <BLANKLINE>
                [[14., 15., 16., 17.]]])
        >>> w
        tensor([[[1.0000, 0.0000, 0.0000]],
        <BLANKLINE>
                [[0.5000, 0.5000, 0.0000]]])
    """
    masks = Masks(valid_lens, attn_mask, is_causal, mask_mod, score_mod, plan)
    out, weights, _ = attend(
        q, k, v, masks, scale=scale, sinks=sinks, dropout_p=dropout_p, need_weights=need_weights, backend=backend
    )
    return AttentionOutput(out, weights)


def additive_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    w_v: Tensor,
    *,
    valid_lens: Tensor | None = None,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    dropout_p: float = 0.0,
    need_weights: bool = False,
    backend: str = "auto",
    mask_mod: mods.MaskFn | None = None,
    score_mod: mods.ScoreFn | None = None,
    sinks: Tensor | None = None,
    plan: Plan | None = None,
) -> AttentionOutput:
    """Additive (Bahdanau) attention on already projected queries and keys: ``s[i, j] = w_v . tanh(q[i] + k[j])``.

    Args:
        q: ``(B, Lq, h)`` or ``(B, H, Lq, h)``, the projected queries ``W_q q``.
        k: ``(B, Lk, h)`` or ``(B, Hkv, Lk, h)``, the projected keys ``W_k k``.
        v: ``(B, Lk, Dv)`` or ``(B, Hkv, Lk, Dv)``.
        w_v: ``(h,)``.
        valid_lens, attn_mask, is_causal, dropout_p, need_weights, backend, mask_mod, score_mod, sinks, plan: as
            in :func:`scaled_dot_product_attention` (``score_mod`` gets the additive scores).

    Returns:
        :class:`AttentionOutput` ``(output, weights)``.

    Example:
        >>> q, k, v = torch.zeros(1, 1, 8), torch.ones(1, 4, 8), torch.arange(4.0).reshape(1, 4, 1)
        >>> additive_attention(q, k, v, torch.ones(8), valid_lens=torch.tensor([2])).output
        tensor([[[0.5000]]])
    """
    masks = Masks(valid_lens, attn_mask, is_causal, mask_mod, score_mod, plan)
    out, weights, _ = attend(
        q, k, v, masks, w_v=w_v, sinks=sinks, dropout_p=dropout_p, need_weights=need_weights, backend=backend
    )
    return AttentionOutput(out, weights)


def attention_weights(
    q: Tensor,
    k: Tensor,
    *,
    w_v: Tensor | None = None,
    valid_lens: Tensor | None = None,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    mask_mod: mods.MaskFn | None = None,
    score_mod: mods.ScoreFn | None = None,
    sinks: Tensor | None = None,
    plan: Plan | None = None,
) -> Tensor:
    """The attention weights alone, without the output: what :func:`attnkit.record_weights` keeps.

    Dot-product scoring, or additive scoring when ``w_v`` is given; the other arguments and the shapes are those of
    :func:`scaled_dot_product_attention`. Computed by the reference math; cheaper than ``need_weights=True``,
    which also computes the output.

    Returns:
        ``(B, H, Lq, Lk)`` (``(B, Lq, Lk)`` for 3-dim inputs), in ``q.dtype``.

    Example:
        >>> attention_weights(torch.ones(1, 2, 4), torch.ones(1, 3, 4), valid_lens=torch.tensor([2]))
        tensor([[[0.5000, 0.5000, 0.0000],
                 [0.5000, 0.5000, 0.0000]]])
    """
    if (runner := _context_parallel.active()) is not None:
        runner.refuse("attention_weights")
    masks = Masks(valid_lens, attn_mask, is_causal, mask_mod, score_mod, plan)
    if torch.compiler.is_compiling():  # the reference plans from values (which keys are dead): outside the graph
        return _weights_outside_graph(q, k, w_v=w_v, scale=scale, sinks=sinks, **masks._asdict())
    q, k, mask, w_v, scale, score_mod, sinks, three_d = scoring(q, k, masks, w_v=w_v, scale=scale, sinks=sinks)
    with _autocast_off(q):
        weights = reference.attention_weights(q, k, mask, w_v=w_v, scale=scale, score_mod=score_mod, sinks=sinks).to(
            q.dtype
        )  # (B, H, Lq, Lk)
    return weights.squeeze(1) if three_d else weights


_weights_outside_graph = _compile.outside_graph(attention_weights)


class Scoring(NamedTuple):
    """What decides a call's weights, validated: ``q (B, H, Lq, D)``, ``k (B, Hkv, Lk, D)`` (3-dim inputs given a
    head axis, ``three_d``), the combined mask, ``w_v``, the scale, the bound score_mod and the sinks."""

    q: Tensor
    k: Tensor
    mask: Mask
    w_v: Tensor | None
    scale: float
    score_mod: mods.ScoreFn | None
    sinks: Tensor | None
    three_d: bool


def scoring(
    q: Tensor,
    k: Tensor,
    masks: Masks,
    *,
    w_v: Tensor | None = None,
    scale: float | None = None,
    sinks: Tensor | None = None,
) -> Scoring:
    """Validate what decides the weights of a call (:func:`attention_weights`, :func:`attnkit.stats.parts`)."""
    q, k, w_v = _autocast(q, k, w_v)
    three_d = check_qkv(q, k, None)
    if w_v is not None:
        _check_w_v(q, w_v)
    scale = check_scale(q.shape[-1] ** -0.5 if scale is None else scale, compute_dtype(q.dtype))
    if three_d:
        q, k = q.unsqueeze(1), k.unsqueeze(1)  # (B, 1, L, D)
    mask = _build_mask(q, k, masks, three_d)
    score_mod, sinks = _check_mods(q, k, masks.score_mod, sinks)
    return Scoring(q, k, mask, w_v, scale, score_mod, sinks, three_d)


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    masks: Masks,
    *,
    w_v: Tensor | None = None,
    scale: float | None = None,
    sinks: Tensor | None = None,
    dropout_p: float = 0.0,
    need_weights: bool = False,
    backend: str = "auto",
    zeros_past: Tensor | None = None,
    need_lse: bool = False,
    lengths_made: bool = False,
) -> AttendResult:
    """:func:`scaled_dot_product_attention` (``w_v`` None) or :func:`additive_attention`, as attnkit's layers call
    it: the masks as one value, and what a layer knows of its keys and values beside.

    Args:
        zeros_past: ``(B,)`` lengths past which each example's keys and values are zeros (a
            :class:`~attnkit.KVCache`'s promise, which its ``update`` returns): the backends then need not read
            that band to know it holds nothing that could leak (:func:`attnkit.backends.common.zero_dead`).
        need_lse: also give each row's log-sum-exp where the chosen backend has it at no cost (a layer whose
            statistics are recorded: :func:`attnkit.record_stats`).
        lengths_made: ``valid_lens`` are those a :class:`~attnkit.KVCache`'s ``update`` returned (int64, in
            range as it makes them): not read again (a decode step's host sync; under compile, a check op).
    """
    q, k, v, w_v = _autocast(q, k, v, w_v)
    options: dict[str, Any] = {"w_v": w_v, "scale": scale, "sinks": sinks, "dropout_p": dropout_p}
    options["need_weights"] = need_weights
    options |= {"backend": backend, "zeros_past": zeros_past, "need_lse": need_lse, "lengths_made": lengths_made}
    runner = _context_parallel.active()
    if runner is not None:  # inside attnkit.distributed.context_parallel: q, k, v are this rank's shard
        ring = _outside_graph if torch.compiler.is_compiling() else runner.attend  # (collectives: outside the graph)
        return ring(q, k, v, masks, **options)  # type: ignore[no-any-return,unused-ignore]
    if torch.compiler.is_compiling() and (backend not in ("auto", "graph") or varlen.has_documents(masks.mask_mod)):
        # a backend named (it plans from values), or packed documents (one call of its own shapes per document):
        # run outside the graph (a graph break), as they run eagerly
        return _outside_graph(q, k, v, masks, **options)  # type: ignore[no-any-return,unused-ignore]
    three_d = check_qkv(q, k, v)
    if w_v is not None:
        _check_w_v(q, w_v)
        scale = 1.0
    elif scale is None:
        scale = q.shape[-1] ** -0.5
    if not isinstance(need_weights, bool):
        raise TypeError(f"need_weights must be a bool, got {need_weights!r}")
    scale = check_scale(scale, compute_dtype(q.dtype))
    if not isinstance(dropout_p, numbers.Real) or isinstance(dropout_p, bool):
        raise TypeError(f"dropout_p must be a number in [0, 1), got {dropout_p!r}")
    dropout_p = float(dropout_p)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if three_d:
        q, k, v = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)  # (B, 1, L, D)
    if w_v is None and isinstance(scale, float) and scale <= 0:
        # PyTorch's CPU kernels fill a causal mask's -inf before they scale (-inf * 0 is NaN, -inf * -1 is +inf):
        # every backend gets a positive scale, the sign going into the queries, exactly in any dtype (a product
        # q * scale rounds in bfloat16, and can overflow in float16)
        q, scale = (-q, -scale) if scale < 0 else (q * 0.0, 1.0)  # (B, H, Lq, D)
    mask = _build_mask(q, k, masks, three_d, from_cache=lengths_made)
    score_mod, sinks = _check_mods(q, k, masks.score_mod, sinks)
    call = Call(
        q,
        k,
        v,
        mask,
        w_v=w_v,
        scale=scale,
        dropout_p=dropout_p,
        need_weights=need_weights,
        score_mod=score_mod,
        sinks=sinks,
        zeros_past=zeros_past,
    )
    need_lse = need_lse and not three_d
    pieces = varlen.split(call)  # packed documents: one call per document, so that none reaches another
    with _autocast_off(q):
        if pieces is None:
            name, (out, weights, lse) = _run(backend, call, need_lse)
        else:
            ran = [None if p.call is None else _run_piece(backend, p, need_lse) for p in pieces]
            names = [r[0] for r in ran if r is not None]
            name = names[0] if names else "reference"
            out, weights, lse = varlen.assemble(call, pieces, [None if r is None else r[1] for r in ran])
    if three_d:
        out = out.squeeze(1)  # (B, Lq, Dv)
        weights = None if weights is None else weights.squeeze(1)  # (B, Lq, Lk)
    tracer = trace.active()
    if tracer is not None:
        trace.attention_steps(tracer, q, k, v, w_v, three_d, out, name, masks, sinks is not None)
    return AttendResult(out, weights, lse)


_outside_graph = _compile.outside_graph(attend)


def _run_piece(backend: str, piece: varlen.Piece, need_lse: bool) -> tuple[str, varlen.Result]:
    """:func:`_run` on one packed document's piece; a backend named that cannot run it says which piece."""
    assert piece.call is not None
    try:
        return _run(backend, piece.call, need_lse)
    except ValueError as error:
        r0, r1 = piece.rows
        raise ValueError(
            f"{error} (said of one packed document: queries [{r0}, {r1}) of examples [{piece.batch.start}, "
            f"{piece.batch.stop}); a call with a document mask runs as one call per document)"
        ) from None


def _run(backend: str, call: Call, need_lse: bool) -> tuple[str, varlen.Result]:
    """The engine's name and what it gave: output ``(B, H, Lq, Dv)``, weights ``(B, H, Lq, Lk)`` or ``None``, and
    each row's log-sum-exp ``(B, H, Lq)`` where asked for and the engine has it at no cost."""
    call = _planned(call)
    while True:
        chosen = dispatch.choose(backend, call)
        try:
            with_lse = getattr(chosen, "attention_with_lse", None) if need_lse else None
            found = None if with_lse is None else with_lse(call)  # ((B, H, Lq, Dv), (B, H, Lq)) or None
            if found is not None:
                result = varlen.Result(found[0], None, found[1])
            else:
                out, weights = chosen.attention(call)  # (B, H, Lq, Dv), (B, H, Lq, Lk) or None
                result = varlen.Result(out, weights, None)
        except Unavailable as missing:  # (a kernel whose build failed just now: choose again, it is known missing)
            if backend not in ("auto", "tiles"):
                raise ValueError(
                    f"backend={backend!r} cannot run this call: {chosen.NAME}: needs {missing} | "
                    + dispatch.all_reasons(call)
                ) from None
            continue
        dispatch.ran(chosen)
        out = no_gradient_from_empty_rows(call.mask, result.output)  # (B, H, Lq, Dv)
        return chosen.NAME, result._replace(output=out)


def _planned(call: Call) -> Call:
    """The call with its plan made (:func:`attnkit.plan.plan_of`: the tiles every engine of a mask_mod runs on, and
    the liveness every engine asks for): once, before it is dispatched. A mask the plan finds to be causal
    self-attention and nothing else, whatever its parts (a user's ``q_idx >= kv_idx``), becomes ``is_causal``,
    which PyTorch's fused kernels run (a plan of many blocks merges their results: 1.15-1.2x that call)."""
    mask = call.mask
    if mask.mask_mod is None or mask.traced:
        return call
    if not plan_of(mask).causal_throughout:
        return call
    causal = Mask.build(
        batch=mask.batch,
        heads=mask.heads,
        num_queries=mask.num_queries,
        num_keys=mask.num_keys,
        is_causal=True,
        device=mask.device,
    )
    return dataclasses.replace(call, mask=causal)


_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps", "hpu")


def _autocast(*tensors: Tensor | None) -> tuple:
    """Under ``torch.autocast``, attention runs in the autocast dtype, as PyTorch's own SDPA does: floating inputs
    other than float64 are cast to it (so projected queries and raw values, or a float32 ``w_v`` beside bfloat16
    queries, fit together). Outside autocast the inputs are returned as they are."""
    first = next((t for t in tensors if isinstance(t, Tensor)), None)
    if first is None or first.device.type not in _AUTOCAST_DEVICES:
        return tensors  # not tensors: check_qkv names the argument; a device autocast does not know
    device = first.device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(
        t.to(dtype) if isinstance(t, Tensor) and t.is_floating_point() and t.dtype != torch.float64 else t
        for t in tensors
    )


def _autocast_off(q: Tensor) -> contextlib.AbstractContextManager:
    """Backends choose their own compute dtypes (float32 for half precisions): autocast stays out of them."""
    if q.device.type not in _AUTOCAST_DEVICES or not torch.is_autocast_enabled(q.device.type):
        return contextlib.nullcontext()  # (entering torch.autocast is not free, and a decode step is short)
    return torch.autocast(q.device.type, enabled=False)


def _check_w_v(q: Tensor, w_v: Tensor) -> None:
    if not isinstance(w_v, Tensor):
        raise TypeError(f"w_v must be a tensor of shape (h,) = ({q.shape[-1]},), got {type(w_v).__name__}")
    if tuple(w_v.shape) != (q.shape[-1],):
        raise ValueError(
            f"w_v must have shape (h,) = ({q.shape[-1]},) to match the hidden size of q and k, "
            f"got {tuple(w_v.shape)}: q {tuple(q.shape)}, w_v {tuple(w_v.shape)}"
        )
    check_same_kind(("q", q), ("w_v", w_v))


def _check_mods(
    q: Tensor, k: Tensor, score_mod: mods.ScoreFn | None, sinks: Tensor | None
) -> tuple[mods.ScoreFn | None, Tensor | None]:
    """The score_mod bound to the call (a built-in) and the sinks checked: ``(H,)`` floating point, beside ``q``."""
    B, H, Lq, _ = q.shape
    mods.check_callable("score_mod", score_mod)
    if score_mod is not None:
        score_mod = mods.bind(score_mod, batch=B, heads=H, num_queries=Lq, num_keys=k.shape[2], device=q.device)
    if sinks is not None:
        if not isinstance(sinks, Tensor) or not sinks.is_floating_point():
            raise TypeError(f"sinks must be a floating point tensor of shape (H,) = ({H},), got {describe(sinks)}")
        if tuple(sinks.shape) != (H,):
            raise ValueError(f"sinks must have shape (H,) = ({H},), one logit per query head, got {tuple(sinks.shape)}")
        if sinks.device != q.device:
            raise ValueError(f"sinks is on {sinks.device} but the inputs are on {q.device}")
        sinks = checked(sinks, "finite", "sinks")
    return score_mod, sinks


@value_check("finite")
def _finite(x: Tensor, name: str, bound: int, what: str) -> None:
    lo, hi = x.aminmax() if x.numel() else (x.new_zeros(()), x.new_zeros(()))
    if not (bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))):
        raise ValueError(f"{name} must be finite, got {x.tolist()}")


def _build_mask(q: Tensor, k: Tensor, masks: Masks, three_d: bool, from_cache: bool = False) -> Mask:
    B, H, Lq, _ = q.shape
    if masks.plan is not None:
        return _planned_mask(masks, B, H, Lq, k.shape[2], q.device)
    return Mask.build(
        lengths_made=from_cache,
        batch=B,
        heads=H,
        num_queries=Lq,
        num_keys=k.shape[2],
        valid_lens=masks.valid_lens,
        attn_mask=masks.attn_mask,
        is_causal=masks.is_causal,
        mask_dims=3 if three_d else 4,
        device=q.device,
        mask_mod=masks.mask_mod,
    )


def _planned_mask(masks: Masks, B: int, H: int, Lq: int, Lk: int, device: torch.device) -> Mask:
    """The call's mask from the plan it was given (``plan=``): the plan's mask, with the plan as its tiles.

    Raises:
        TypeError: ``plan`` not a :class:`~attnkit.plan.Plan`. ValueError: given beside another mask, or made for
            other lengths, another device, or (a mask_mod that may read them) other examples or heads.
    """
    plan = masks.plan
    if not isinstance(plan, Plan) or plan.mask is None:
        raise TypeError(f"plan must be what attnkit.make_plan makes, got {describe(plan)}")
    given = [name for name in ("valid_lens", "attn_mask", "mask_mod") if getattr(masks, name) is not None]
    given += ["is_causal"] if masks.is_causal else []
    if given:
        raise ValueError(
            f"plan is the call's whole mask, and {', '.join(given)} was given beside it: make the plan with that "
            "mask (make_plan takes is_causal and a mask_mod, into which padding folds with mods.and_masks), or pass "
            "no plan"
        )
    made = plan.mask
    mask = Mask.build(
        batch=B,
        heads=H,
        num_queries=Lq,
        num_keys=Lk,
        is_causal=made.is_causal,
        mask_mod=made.mask_mod,
        device=device,
    )
    index_key = mask.index_key
    fits = (plan.num_queries, plan.num_keys) == (Lq, Lk) and (
        plan.key is not None and index_key is not None and plan.key[: len(index_key)] == index_key
        if plan.key is not None  # (made with batch and heads of 1, it promised the mask depends on neither)
        else made.batch in (1, B) and made.heads in (1, H) and made.device == device
    )
    if not fits:
        raise ValueError(
            f"plan was made for {made.num_queries} queries and {made.num_keys} keys, batch {made.batch}, heads "
            f"{made.heads}, on {made.device}; this call has {Lq} and {Lk}, batch {B}, heads {H}, on {device}"
        )
    mask.plan = plan
    mask.__dict__.setdefault("liveness", plan.liveness)  # (functools.cached_property keeps its value there)
    return mask
