"""The graph backend: what runs under ``torch.compile``, written so that dynamo traces it whole.

Every other backend plans from the values of the call (which keys are dead, which tiles are empty, how long each
packed document is) and reads them on the host: under ``torch.compile`` each read is a graph break. This one reads
no value. It is the reference's math (:mod:`attnkit.backends.reference`, the spec) on the whole
``(B, H, Lq, Lk)`` at once, each step a tensor operation that Inductor can fuse:

* the combined mask ``allowed`` is built in the graph, the ``mask_mod`` evaluated on broadcasting indices;
* the keys no query may see and the queries that see no key are zeroed (``torch.where``, never a branch), so that
  what they hold, NaN included, reaches no output and no gradient;
* dot-product calls without a ``score_mod`` or sinks go through ``torch.nn.functional.scaled_dot_product_attention``
  (PyTorch's fused kernels, which Inductor keeps), a dead row seeing every zeroed key and then zeroed, as in
  :mod:`attnkit.backends.sdpa`; the rest are scored, modified, masked and normalised in the compute dtype.

``attnkit.dispatch`` chooses it for every call while ``torch.compile`` traces; eagerly it runs only when named
(``backend="graph"``), which is how the tests hold it to the reference. Memory is that of the reference: the whole
scores (the fused kernel's path needs only the mask). A packed-documents ``mask_mod`` (:func:`attnkit.mods.document`)
is not run here: each document would be its own shapes (``attnkit.functional`` runs that call outside the graph).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit import mods
from attnkit.backends import decode, graph_ops
from attnkit.backends.common import additive_scores, repeat_kv
from attnkit.backends.contract import Call, Supports
from attnkit.masks import Mask, compute_dtype

NAME = "graph"

# B batch, H heads, Hkv key/value heads, Lq/Lk query/key length, D head dim, Dv value head dim

SUPPORTS = Supports(
    # the fused kernel adds the mask as -inf: a hidden score at +inf would give NaN; the dispatcher cannot ask while
    # dynamo traces (the bound reads values), so under compile this is documented, not checked
    huge_scores=False,
)


def attention(call: Call) -> tuple[Tensor, Tensor | None]:
    q, k, v, mask = call.q, call.k, call.v, call.mask
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    dtype = compute_dtype(q.dtype)
    allowed = _allowed(mask)  # (B|1, H|1, Lq|1, Lk) bool, or None: every pair
    bias, shift = (None, None) if mask.bias is None else _shifted_bias(mask.bias, allowed, dtype)
    fused = call.w_v is None and call.score_mod is None and call.sinks is None and not call.need_weights
    if fused and call.queries_per_kv_head > decode.FEW_QUERIES:
        lens = mask.valid_lens  # (B, 1, 1 | Lq, 1) or None
        lengths_alone = mask.bool_mask is None and mask.bias is None and mask.mask_mod is None and not call.dropout_p
        padded = lens is not None and lens.shape[2] == 1 and lengths_alone  # a padded batch: lengths (B,) alone
        if padded and graph_ops.takes(q, call.k, call.v, mask.is_causal):
            assert lens is not None
            out = graph_ops.attention(q, call.k, call.v, lens.view(B), mask.is_causal, call.scale)  # (B, H, Lq, Dv)
        else:
            out = _fused(call, allowed, bias)  # (B, H, Lq, Dv)
        return _nan_rows(q, allowed, out), None
    # a KVCache's call (zeros past each row's length, its mask a prefix of each row): the keys need no zeroing, only
    # the rows that see nothing (their outputs), so a decode step does not copy the cache
    cached = call.zeros_past is not None and mask.bool_mask is None and mask.bias is None and mask.mask_mod is None
    q, k, v = _zero_dead(q, k, v, allowed, rows_only=cached)
    if call.w_v is None and call.score_mod is None:  # products per key/value head: no copy of keys per query head
        qf, kf, vf = q.to(dtype), k.to(dtype), v.to(dtype)  # (B, H, Lq, D), (B, Hkv, Lk, D|Dv)
    else:
        qf, kf, vf = q.to(dtype), repeat_kv(k, H).to(dtype), repeat_kv(v, H).to(dtype)  # (B, H, L, D|Dv)
    Hk = kf.shape[1]

    def scores_of(kf: Tensor) -> Tensor:
        if call.w_v is not None:
            return additive_scores(qf, kf, call.w_v.to(dtype))[0]  # (B, H, Lq, Lk)
        grouped = qf.reshape(B, Hk, H // Hk * Lq, D)  # (B, Hk, H/Hk * Lq, D): a group's queries against its keys
        return ((grouped @ kf.transpose(-2, -1)) * call.scale).view(B, H, Lq, Lk)  # (B, H, Lq, Lk)

    scores = scores_of(kf)  # (B, H, Lq, Lk)
    if call.score_mod is not None:
        idx = mods.indices(B, H, (0, Lq), (0, mask.num_keys), q.device)  # b, h, q_idx, kv_idx, broadcasting
        with torch.no_grad():  # which pairs the score_mod hides (-inf), whatever the keys hold
            hidden = torch.isneginf(_modified(call.score_mod, scores.detach(), idx))  # (B, H, Lq, Lk)
        seen = ~hidden if allowed is None else allowed & ~hidden  # (B, H, Lq, Lk)
        unseen = ~seen.any(dim=-2, keepdim=True)  # (B, H, 1, Lk): keys the score_mod hides from every query
        emptied = ~seen.any(dim=-1, keepdim=True)  # (B, H, Lq, 1): rows it leaves no key
        kf = torch.where(unseen.transpose(-2, -1), 0.0, kf)  # (B, H, Lk, D): scored again as zeros (0 * NaN)
        vf = torch.where(unseen.transpose(-2, -1), 0.0, vf)  # (B, H, Lk, Dv)
        qf = torch.where(emptied, 0.0, qf)  # (B, H, Lq, D): so are those rows' queries
        raw = scores_of(kf)  # (B, H, Lq, Lk)
        # as FlexAttention: hidden pairs pass no gradient back through the score_mod (1 / (i - j) on a hidden
        # diagonal would give 0 * inf): where() selects, so what reaches `raw` there is exactly 0
        safe = raw if allowed is None else torch.where(allowed, raw, raw.detach())
        scores = _modified(call.score_mod, safe, idx)  # (B, H, Lq, Lk)
        allowed = seen
    if bias is not None:
        scores = scores + bias  # (B, H, Lq, Lk)
    # a score of -inf (infinite inputs, an overflow) hides its key as the mask does, the reference's rule: looked
    # at everywhere (no branch on values), which Inductor fuses into the softmax
    finite = ~torch.isneginf(scores)  # (B, H, Lq, Lk)
    seen = finite if allowed is None else allowed & finite  # (B, H, Lq, Lk)
    fill = torch.finfo(dtype).min  # exp() of it is 0 beside any visible score (and beside the sink)
    scores = scores.masked_fill(~seen, fill)
    if call.sinks is not None:
        sink = call.sinks.to(dtype).view(1, H, 1, 1)  # (1, H, 1, 1)
        if shift is not None:  # the softmax with the sink is what it was before the bias's shift
            sink = sink - shift.to(dtype)  # (B|1, H, Lq, 1)
        sink = sink.expand(B, H, Lq, 1)  # (B, H, Lq, 1)
        scores = torch.cat([scores, sink], dim=-1)  # (B, H, Lq, Lk + 1)
        weights = torch.softmax(scores, dim=-1)[..., :-1]  # (B, H, Lq, Lk): the sink takes its share, dropped
    else:
        weights = torch.softmax(scores, dim=-1)  # (B, H, Lq, Lk)
    weights = weights.masked_fill(~seen, 0.0)  # a row that sees no key: zeros
    dropped = F.dropout(weights, call.dropout_p) if call.dropout_p > 0 else weights
    grouped = dropped.reshape(B, Hk, H // Hk * Lq, Lk)  # (B, Hk, H/Hk * Lq, Lk)
    out = (grouped @ vf).view(B, H, Lq, vf.shape[-1])  # (B, H, Lq, Dv)
    # rows that see nothing: zeros whatever the keys they did not see hold, and their output gradient, NaN
    # included, passes back to nothing (a reviewer's finding: it filled dv under torch.compile)
    out = torch.where(seen.any(dim=-1, keepdim=True), out, 0.0)  # (B, H, Lq, Dv)
    return out.to(q.dtype), (weights.to(q.dtype) if call.need_weights else None)


def _nan_rows(q: Tensor, allowed: Tensor | None, out: Tensor) -> Tensor:
    """``out (B, H, Lq, Dv)`` NaN in the rows whose query holds NaN and sees some key, as in the reference: PyTorch's
    CPU kernel gives them zeros (as :mod:`attnkit.backends.sdpa` says). No branch on values: one ``where``."""
    bad = q.detach().isnan().any(dim=-1, keepdim=True)  # (B, H, Lq, 1)
    if allowed is not None:
        bad = bad & allowed.any(dim=-1, keepdim=True)  # (B, H, Lq, 1): a row that sees no key is zeros
    return torch.where(bad, float("nan"), out)  # (B, H, Lq, Dv)


def _fused(call: Call, allowed: Tensor | None, bias: Tensor | None) -> Tensor:
    """PyTorch's fused kernel on the mask as one ``attn_mask``: dead keys, values and rows zeroed first, a dead row
    given every (zeroed) key inside the kernel and zeroed after, so that no version of PyTorch can turn it into
    NaN and no gradient reaches it (as :mod:`attnkit.backends.sdpa`)."""
    q, k, v, mask = call.q, call.k, call.v, call.mask
    H, Hkv = q.shape[1], k.shape[1]
    gqa: dict[str, Any] = {"enable_gqa": True} if H != Hkv else {}
    # (the kernel's op, called on no example or no query, crashes the process: torch 2.13)
    guarded = call.needs_grad and not call.dropout_p and k.numel() > 0
    if bias is None and mask.is_plain_causal:
        if guarded and graph_ops.fuses(q):  # a backward that never meets 0 * inf where a row may not see
            return graph_ops.fused(q, k, v, None, True, call.scale)  # (B, H, Lq, Dv)
        return F.scaled_dot_product_attention(
            q, k, v, dropout_p=call.dropout_p, is_causal=True, scale=call.scale, **gqa
        )  # (B, H, Lq, Dv)
    if allowed is None and bias is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=call.dropout_p, scale=call.scale, **gqa)
    if allowed is None:  # a float mask that hides nothing
        allowed = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=q.device)
    q, k, v = _zero_dead(q, k, v, allowed)
    live_rows = allowed.any(dim=-1, keepdim=True)  # (B|1, H|1, Lq|1, 1)
    if bias is None:
        attn_mask = allowed | ~live_rows  # (B|1, H|1, Lq|1, Lk): a dead row sees every (zeroed) key
    else:
        attn_mask = bias.masked_fill(~allowed, float("-inf")).masked_fill(~live_rows, 0.0)  # (B|1, H|1, Lq, Lk)
    if attn_mask.dtype != torch.bool:
        attn_mask = attn_mask.to(q.dtype)
    if guarded and graph_ops.fuses(q) and not attn_mask.requires_grad:
        out = graph_ops.fused(q, k, v, attn_mask, False, call.scale)  # (B, H, Lq, Dv)
    else:
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=call.dropout_p, scale=call.scale, **gqa
        )  # (B, H, Lq, Dv)
    return out.masked_fill(~live_rows, 0.0)


def _allowed(mask: Mask) -> Tensor | None:
    """The combined mask (:meth:`~attnkit.masks.Mask.allowed_tile` over the whole call), ``(B|1, H|1, Lq|1, Lk)``
    bool (True = may attend), or ``None`` when every pair is allowed. A float mask's ``-inf`` hides the pair."""
    allowed = mask.allowed_tile(0, mask.num_queries, 0, mask.num_keys)
    if allowed is None:
        return None
    return allowed.reshape((1,) * (4 - allowed.dim()) + tuple(allowed.shape))  # 4 dims


def _shifted_bias(bias: Tensor, allowed: Tensor | None, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """The float mask less each row's largest visible value (the softmax is the same; a score beside a bias of
    1e4 keeps its bits), its finite values clamped to half the compute dtype's range, ``-inf`` kept: in ``dtype``,
    ``(B|1, H|1, Lq, Lk)``; and that shift, ``(B|1, H|1, Lq, 1)``, by which the sinks are shifted too."""
    work = torch.promote_types(torch.promote_types(bias.dtype, dtype), torch.float32)
    b = bias.to(work)  # (B|1, H|1, Lq, Lk)
    visible = b if allowed is None else b.masked_fill(~allowed, float("-inf"))
    shift = visible.amax(dim=-1, keepdim=True).detach()  # (B|1, H|1, Lq, 1): the softmax does not depend on it
    shift = shift.masked_fill(torch.isneginf(shift), 0.0)  # a row that sees nothing: no shift
    limit = torch.finfo(dtype).max / 2
    b = b - shift
    return torch.where(torch.isneginf(b), b, b.clamp(-limit, limit)).to(dtype), shift


def _zero_dead(
    q: Tensor, k: Tensor, v: Tensor, allowed: Tensor | None, *, rows_only: bool = False
) -> tuple[Tensor, Tensor, Tensor]:
    """Queries that see no key, keys and values no query sees: zeros (new tensors; the inputs are not written).
    ``rows_only``: the queries alone (a KVCache's call: what its live rows do not see are zeros)."""
    if allowed is None:
        return q, k, v
    if rows_only:
        return torch.where(allowed.any(dim=-1, keepdim=True), q, 0.0), k, v
    Hkv = k.shape[1]
    live_rows = allowed.any(dim=-1, keepdim=True)  # (B|1, H|1, Lq|1, 1)
    live_keys = allowed.any(dim=-2)  # (B|1, H|1, Lk)
    if live_keys.shape[1] not in (1, Hkv):  # per query head, grouped key/value heads: live if any of its group is
        live_keys = live_keys.unflatten(1, (Hkv, -1)).any(dim=2)  # (B|1, Hkv, Lk)
    live_keys = live_keys[..., None]  # (B|1, Hkv|1, Lk, 1)
    return torch.where(live_rows, q, 0.0), torch.where(live_keys, k, 0.0), torch.where(live_keys, v, 0.0)


def _modified(score_mod: mods.ScoreFn, scores: Tensor, idx: tuple) -> Tensor:
    """The score_mod on the whole scores, in their dtype and shape (a result that broadcasts is expanded)."""
    return mods.apply_score(score_mod, scores, *idx).expand(scores.shape)
