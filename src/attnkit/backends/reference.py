"""The reference backend: the specification, written as plainly as the math.

For each batch element ``b`` and head ``h``, with ``allowed[i, j]`` the combined mask (valid_lens AND is_causal
AND the boolean attn_mask AND finite float bias AND ``mask_mod(b, h, i, j)``), ``bias[i, j]`` the float attn_mask
(0 when absent), ``mod(x) = score_mod(x, b, h, i, j)`` (the identity when absent) and ``sink`` the sink logit of
head ``h`` (``-inf`` when absent)::

    dot-product:  s[i, j] = mod(scale * (q[i] . k[j])) + bias[i, j]
    additive:     s[i, j] = mod(w_v . tanh(q[i] + k[j])) + bias[i, j]

    a[i, j] = exp(s[i, j]) / (exp(sink) + sum_{j' allowed} exp(s[i, j']))    for allowed j, else 0
              (a row with no allowed key is all zeros, so its output is zero, with or without a sink)

    out[i]  = sum_j dropout(a)[i, j] * v[j]

A score ``s[i, j]`` of ``-inf`` (from a score_mod, infinite inputs, or a product that overflows) hides key ``j``
from query ``i`` as the mask does: it joins the keys not allowed, so a row whose every allowed score is ``-inf``
is all zeros too. Where a row may not see, its weights are 0 also when NaN or ``+inf`` fills the row.

Keys that no query may attend to and queries that may attend to no key (under ``allowed``, the whole
combination) are zeroed first (:func:`~attnkit.backends.common.zero_dead`), so that what they hold, NaN
included, reaches neither the output nor a gradient: ``0 * NaN`` would. A float bias holds finite values or
``-inf`` (see :mod:`attnkit.masks` for the values beyond the compute dtype's range).

Query head ``h`` uses key/value head ``h // (H / Hkv)``. Computed in float32 for float16/bfloat16 inputs (in
float64 for float64), returned in the input dtype; ``weights`` are ``a`` before dropout. Holds the whole
``(B, H, Lq, Lk)`` scores (and ``(B, H, Lq, Lk, D)`` features for additive scoring): use it for weights and
for checking, not for long sequences.
"""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit import mods
from attnkit.backends.common import additive_scores, repeat_kv, zero_dead
from attnkit.backends.contract import Call, Supports, scores_bounded
from attnkit.masks import Mask, compute_dtype, softmax_with_mask

NAME = "reference"

# B batch, H heads, Hkv key/value heads, Lq/Lk query/key length, D head dim, Dv value head dim


SUPPORTS = Supports()  # everything: it is the specification


def attention(call: Call) -> tuple[Tensor, Tensor | None]:
    q, k, v, mask = call.q, call.k, call.v, call.mask
    H = q.shape[1]
    dtype = compute_dtype(q.dtype)
    q, k, v = zero_dead(q, k, v, mask, call.zeros_past)
    protected = None
    if call.score_mod is not None:
        protected = mods.protected_storages(call.score_mod, call.tensors_read(call.score_mod))
    weights, unseen, emptied = _weights(
        q, k, mask, w_v=call.w_v, scale=call.scale, score_mod=call.score_mod, sinks=call.sinks, protected=protected
    )  # (B, H, Lq, Lk) in `dtype`, (B, H, Lk) or None, (B, H, Lq) or None
    dropped = torch.nn.functional.dropout(weights, call.dropout_p) if call.dropout_p > 0 else weights
    vf = repeat_kv(v, H).to(dtype)  # (B, H, Lk, Dv)
    if unseen is not None:  # keys the score_mod hides from every query: nothing they hold reaches the output
        vf = torch.where(unseen[..., None], 0.0, vf)  # (B, H, Lk, Dv)
    out = dropped @ vf  # (B, H, Lq, Dv)
    if emptied is not None and out.requires_grad:  # rows the score_mod leaves no key: zeros, no gradient back
        out = torch.where(emptied[..., None], 0.0, out)  # (B, H, Lq, Dv)
    return out.to(q.dtype), (weights.to(q.dtype) if call.need_weights else None)


def attention_weights(
    q: Tensor,
    k: Tensor,
    mask: Mask,
    *,
    w_v: Tensor | None,
    scale: float,
    score_mod: mods.ScoreFn | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """The weights ``a`` alone (no output), ``(B, H, Lq, Lk)`` in the compute dtype: what recording needs.

    Without autograd, the scores are written once (scale folded into the matmul) and the softmax runs in place."""
    q, k, _ = zero_dead(q, k, k, mask)
    protected = None if score_mod is None else mods.protected_storages(score_mod)
    weights, _, _ = _weights(q, k, mask, w_v=w_v, scale=scale, score_mod=score_mod, sinks=sinks, protected=protected)
    return weights  # (B, H, Lq, Lk)


def _weights(
    q: Tensor,
    k: Tensor,
    mask: Mask,
    *,
    w_v: Tensor | None,
    scale: float,
    score_mod: mods.ScoreFn | None,
    sinks: Tensor | None,
    protected: frozenset[int] | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The weights ``(B, H, Lq, Lk)`` of queries and keys whose dead rows and keys are zeroed; the keys a
    score_mod hides from every query, ``(B, H, Lk)`` (or ``None``): keys no query may see, like the mask's dead
    ones, so they are scored again as zeros (``0 * NaN`` would reach ``dq`` through a hidden score) and the caller
    zeroes their values; and the rows a score_mod leaves with no key, ``(B, H, Lq)`` (or ``None``): zeros, whose
    output gradient the caller keeps from reaching anything (``0 * NaN`` again, in ``dv``)."""
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    dtype = compute_dtype(q.dtype)
    qf = q.to(dtype)  # (B, H, Lq, D)
    kf = repeat_kv(k, H).to(dtype)  # (B, H, Lk, D)
    grad = torch.is_grad_enabled() and (
        any(t is not None and t.requires_grad for t in (q, k, w_v, mask.bias, sinks)) or score_mod is not None
    )

    def scores_of(kf: Tensor) -> Tensor:
        if w_v is not None:
            return additive_scores(qf, kf, w_v.to(dtype))[0]  # (B, H, Lq, Lk)
        if grad:
            # In place on the fresh product, as every step up to the softmax: autograd keeps q and k, not it (the
            # book's code allocates here; d2l.MultiHeadAttention must cost no more: benchmarks/d2l_vs_book.py)
            return (qf @ kf.transpose(-2, -1)).mul_(scale)  # (B, H, Lq, Lk)
        q3, k3 = qf.reshape(B * H, Lq, D), kf.reshape(B * H, Lk, D)  # (B*H, L, D)
        out = torch.empty(B * H, Lq, Lk, dtype=dtype, device=q.device)
        torch.baddbmm(out, q3, k3.transpose(1, 2), beta=0, alpha=scale, out=out)  # (B*H, Lq, Lk)
        return out.view(B, H, Lq, Lk)

    scores = scores_of(kf)  # (B, H, Lq, Lk)
    allowed, bias = mask.full(dtype)
    empty_rows = mask.liveness[1] is not None  # some query may see no key
    unseen = emptied = None
    # no score can reach half the range (a bias stays within the other half): none is -inf, none need be looked for
    # (asked where a gradient or the softmax below would look)
    bounded = w_v is None and score_mod is None and (grad or sinks is None) and scores_bounded(q, k, scale, dtype)
    if score_mod is not None:
        idx = mods.indices(B, H, (0, Lq), (0, Lk), q.device)  # b (B,1,1,1), h (1,H,1,1), q_idx, kv_idx
        raw = scores
        scores = mods.evaluate_score(score_mod, raw, *idx, protected=protected)  # (B, H, Lq, Lk)
        hidden = torch.isneginf(scores.detach())  # a score_mod's -inf hides the key, as in FlexAttention
        if bool(hidden.any()):
            seen = ~hidden if allowed is None else allowed & ~hidden  # (B, H, Lq, Lk)
            unseen = ~seen.any(dim=-2)  # (B, H, Lk)
            unseen = unseen if bool(unseen.any()) else None
            allowed, emptied = _hidden_joins(allowed, hidden)  # (B, H, Lq, Lk), (B, H, Lq) or None
            if grad and (unseen is not None or emptied is not None):
                # keys no query sees and rows that see no key are scored again as zeros, hidden by the first
                # verdict whatever zeros score now: 0 * NaN would reach dq or dk through a hidden score
                if unseen is not None:
                    kf = torch.where(unseen[..., None], 0.0, kf)  # (B, H, Lk, D)
                if emptied is not None:
                    qf = torch.where(emptied[..., None], 0.0, qf)  # (B, H, Lq, D)
                raw = scores_of(kf)
                scores = mods.evaluate_score(score_mod, raw, *idx, protected=protected)  # (B, H, Lq, Lk)
            empty_rows = True
        if raw.requires_grad and allowed is not None:
            # as FlexAttention: hidden pairs pass no gradient back through the score_mod (one singular there,
            # 1 / (i - j) on a hidden diagonal, would give 0 * inf)
            hidden_pairs = ~allowed
            raw.register_hook(lambda g: None if g is None else g.masked_fill(hidden_pairs, 0.0))  # (gradcheck: None)
    elif grad and w_v is None and not bounded:  # (additive scores are sums of w_v's entries times tanh's: finite)
        # a score of -inf from the inputs (an infinite one, a product that overflows) hides its key too: a row it
        # leaves with none is zeros whose output gradient the caller keeps from reaching anything, and the sinks'
        # softmax must see such a pair as hidden (its 0 weight times a NaN from the row's other products)
        hidden = torch.isneginf(scores.detach())  # (B, H, Lq, Lk)
        if bool(hidden.any()):
            allowed, emptied = _hidden_joins(allowed, hidden)  # (B, H, Lq, Lk), (B, H, Lq) or None
            empty_rows = True
    if sinks is not None:
        return _softmax_with_sinks(scores, allowed, bias, mask.sink_logits(sinks.to(dtype))), unseen, emptied
    # a score of -inf (infinite inputs, or an overflow) hides its key as the mask does; the inputs' bound spares the
    # softmax its look at the scores
    finite = bounded or None  # (None: look)
    weights = softmax_with_mask(
        scores,
        allowed,
        bias,
        inplace=not grad,
        scratch=w_v is None and score_mod is None,
        empty_rows=empty_rows,
        finite=finite,
    )  # (B, H, Lq, Lk)
    return weights, unseen, emptied


def _hidden_joins(allowed: Tensor | None, hidden: Tensor) -> tuple[Tensor, Tensor | None]:
    """``allowed`` (broadcastable to ``(B, H, Lq, Lk)``, or ``None``) with the pairs ``hidden (B, H, Lq, Lk)``
    hides taken out, and the rows it leaves with no key, ``(B, H, Lq)``, or ``None`` where there are none."""
    allowed = ~hidden if allowed is None else allowed & ~hidden  # (B, H, Lq, Lk)
    emptied = ~allowed.any(dim=-1)  # (B, H, Lq)
    return allowed, (emptied if bool(emptied.any()) else None)


def _softmax_with_sinks(scores: Tensor, allowed: Tensor | None, bias: Tensor | None, sink: Tensor) -> Tensor:
    """The softmax over the allowed keys and one more logit, the sink, which takes its share and is dropped."""
    B, H, Lq, Lk = scores.shape
    if bias is not None:
        scores = scores + bias  # (B, H, Lq, Lk)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)  # exp() of it is 0 beside the sink
    logits = torch.cat([scores, sink.expand(B, H, Lq, 1)], dim=-1)  # (B, H, Lq, Lk + 1)
    weights = torch.softmax(logits, dim=-1)[..., :Lk]  # (B, H, Lq, Lk)
    return weights if allowed is None else weights.masked_fill(~allowed, 0.0)
