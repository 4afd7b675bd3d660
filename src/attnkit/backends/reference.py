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
from attnkit.backends.contract import Call, Supports
from attnkit.masks import Mask, compute_dtype, softmax_with_mask

NAME = "reference"

# B batch, H heads, Hkv key/value heads, Lq/Lk query/key length, D head dim, Dv value head dim


SUPPORTS = Supports()  # everything: it is the specification


def attention(call: Call) -> tuple[Tensor, Tensor | None]:
    q, k, v, mask = call.q, call.k, call.v, call.mask
    H = q.shape[1]
    dtype = compute_dtype(q.dtype)
    q, k, v = zero_dead(q, k, v, mask, call.zeros_past)
    weights = attention_weights(
        q, k, mask, w_v=call.w_v, scale=call.scale, score_mod=call.score_mod, sinks=call.sinks, zeroed=True
    )  # (B, H, Lq, Lk) in `dtype`
    dropped = torch.nn.functional.dropout(weights, call.dropout_p) if call.dropout_p > 0 else weights
    out = dropped @ repeat_kv(v, H).to(dtype)  # (B, H, Lq, Dv)
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
    zeroed: bool = False,
) -> Tensor:
    """The weights ``a`` alone (no output), ``(B, H, Lq, Lk)`` in the compute dtype: what recording needs
    (``zeroed``: the caller has zeroed the dead queries and keys already).

    Without autograd, the scores are written once (scale folded into the matmul) and the softmax runs in place."""
    if not zeroed:
        q, k, _ = zero_dead(q, k, k, mask)
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    dtype = compute_dtype(q.dtype)
    qf = q.to(dtype)  # (B, H, Lq, D)
    kf = repeat_kv(k, H).to(dtype)  # (B, H, Lk, D)
    grad = torch.is_grad_enabled() and (
        any(t is not None and t.requires_grad for t in (q, k, w_v, mask.bias, sinks)) or score_mod is not None
    )
    if w_v is not None:
        scores, _ = additive_scores(qf, kf, w_v.to(dtype))  # (B, H, Lq, Lk)
    elif grad:
        scores = qf @ kf.transpose(-2, -1)  # (B, H, Lq, Lk)
        # In place on the fresh product, as every step up to the softmax: autograd keeps q and k, not it (the
        # book's code allocates here; d2l.MultiHeadAttention must cost no more: benchmarks/d2l_vs_book.py)
        scores.mul_(scale)
    else:
        q3, k3 = qf.reshape(B * H, Lq, D), kf.reshape(B * H, Lk, D)  # (B*H, L, D)
        scores = torch.empty(B * H, Lq, Lk, dtype=dtype, device=q.device)
        torch.baddbmm(scores, q3, k3.transpose(1, 2), beta=0, alpha=scale, out=scores)  # (B*H, Lq, Lk)
        scores = scores.view(B, H, Lq, Lk)
    allowed, bias = mask.full(dtype)
    empty_rows = mask.liveness[1] is not None  # some query may see no key
    if score_mod is not None:
        idx = mods.indices(B, H, (0, Lq), (0, Lk), q.device)  # b (B,1,1,1), h (1,H,1,1), q_idx, kv_idx
        raw = scores
        scores = mods.evaluate_score(score_mod, scores, *idx)  # (B, H, Lq, Lk)
        hidden = torch.isneginf(scores.detach())  # a score_mod's -inf hides the key, as in FlexAttention
        if bool(hidden.any()):
            allowed = ~hidden if allowed is None else allowed & ~hidden  # (B, H, Lq, Lk)
            empty_rows = True
        if raw.requires_grad and allowed is not None:
            # as FlexAttention: hidden pairs pass no gradient back through the score_mod (one singular there,
            # 1 / (i - j) on a hidden diagonal, would give 0 * inf)
            hidden_pairs = ~allowed
            raw.register_hook(lambda g: g.masked_fill(hidden_pairs, 0.0))
    if sinks is not None:
        return _softmax_with_sinks(scores, allowed, bias, mask.sink_logits(sinks.to(dtype)))
    return softmax_with_mask(
        scores, allowed, bias, inplace=not grad, scratch=w_v is None and score_mod is None, empty_rows=empty_rows
    )  # (B, H, Lq, Lk)


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
