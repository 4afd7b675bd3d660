"""The attention math written out independently of attnkit, for tests to compare against.

Masks here are built from their definitions (not with attnkit.masks), in whatever dtype is asked: float64
for the truth, or a low precision for "the reference computed in that precision" (no upcasting), which sets
the tolerance for low-precision backends (flash-attention's rule: at most twice that error).
"""

from __future__ import annotations

import torch
from torch import Tensor

# B batch, H heads, Hkv key/value heads, Lq/Lk query/key length, D head dim, Dv value head dim


def allowed_mask(B, H, Lq, Lk, *, valid_lens=None, attn_mask=None, is_causal=False, three_d=False):
    """(B, H, Lq, Lk) bool: True where query i may attend to key j."""
    allowed = torch.ones(B, H, Lq, Lk, dtype=torch.bool)
    if valid_lens is not None:
        vl = valid_lens.long()
        for b in range(B):
            for i in range(Lq):
                n = int(vl[b] if vl.dim() == 1 else vl[b, i])
                allowed[b, :, i, n:] = False
    if is_causal:
        for i in range(Lq):
            allowed[:, :, i, max(0, i + Lk - Lq + 1) :] = False
    if attn_mask is not None:
        m = attn_mask
        if three_d and m.dim() == 3:
            m = m.unsqueeze(1)
        if m.dtype == torch.bool:
            allowed &= m
        else:
            allowed &= ~torch.isneginf(m)
    return allowed


def _scores(q, k, v, w_v, scale, dtype):
    """Heads added to 3-dim inputs, key/value heads repeated, all in `dtype`; and the raw scores (B, H, Lq, Lk):
    scale * q . k, or w_v . tanh(q + k) when w_v is given."""
    three_d = q.dim() == 3
    if three_d:
        q, k, v = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)
    H, D = q.shape[1], q.shape[-1]
    group = H // k.shape[1]
    q, k, v = q.to(dtype), k.to(dtype).repeat_interleave(group, 1), v.to(dtype).repeat_interleave(group, 1)
    if w_v is None:
        scale = D**-0.5 if scale is None else scale
        scores = q @ k.transpose(-1, -2) * scale
    else:
        scores = torch.tanh(q.unsqueeze(3) + k.unsqueeze(2)) @ w_v.to(dtype)
    return three_d, q, k, v, scores


def attention(q, k, v, *, valid_lens=None, attn_mask=None, is_causal=False, scale=None, w_v=None, dtype=torch.float64):
    """Output and weights, computed entirely in `dtype`. Accepts 3-dim (head-less) inputs too."""
    three_d, q, k, v, scores = _scores(q, k, v, w_v, scale, dtype)
    B, H, Lq, Lk = scores.shape
    allowed = allowed_mask(
        B, H, Lq, Lk, valid_lens=valid_lens, attn_mask=attn_mask, is_causal=is_causal, three_d=three_d
    )
    if attn_mask is not None and attn_mask.is_floating_point():
        bias = attn_mask.unsqueeze(1) if three_d and attn_mask.dim() == 3 else attn_mask
        scores = scores + torch.where(torch.isneginf(bias), 0, bias).to(dtype)
    allowed = allowed & ~torch.isneginf(scores)  # a score of -inf (an infinite input) hides its key, as a mask does
    scores = scores.masked_fill(~allowed, float("-inf"))
    live = allowed.any(dim=-1, keepdim=True)
    # rows with no key: softmax of zeros, then dropped, so neither values nor gradients see NaN
    weights = torch.where(live, torch.softmax(torch.where(live, scores, 0.0), dim=-1), 0.0)
    out = weights @ v
    if three_d:
        return out.squeeze(1), weights.squeeze(1)
    return out, weights


def max_err(a: Tensor, b: Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


# ------------------------------------------------------------------------------------------------- modifiers
#
# mask_mod(b, h, q_idx, kv_idx) -> bool and score_mod(score, b, h, q_idx, kv_idx) -> score take raw indices, as
# FlexAttention's. The built-ins below are written from their definitions, aligned to the bottom right: query i
# stands at key position p = i + Lk - Lq, so they are made for one (Lq, Lk).


def sliding_window(window, Lq, Lk):
    """Key j visible from position p when 0 <= p - j < window."""

    def mask_mod(b, h, i, j):
        distance = i + (Lk - Lq) - j
        return (distance >= 0) & (distance < window)

    return mask_mod


def document(ids_q, ids_k=None):
    """Query i sees key j when both belong to one document; ids (B|1, L) integers."""
    ids_k = ids_q if ids_k is None else ids_k

    def mask_mod(b, h, i, j):
        bq = b if ids_q.shape[0] > 1 else torch.zeros_like(b)
        bk = b if ids_k.shape[0] > 1 else torch.zeros_like(b)
        return ids_q[bq, i] == ids_k[bk, j]

    return mask_mod


def prefix_lm(prefix_lens, Lq, Lk):
    """Key j visible from position p when j < prefix_lens[b] or j <= p."""

    def mask_mod(b, h, i, j):
        return (j < prefix_lens[b]) | (j <= i + (Lk - Lq))

    return mask_mod


def and_masks(*mask_mods):
    def mask_mod(b, h, i, j):
        result = mask_mods[0](b, h, i, j)
        for m in mask_mods[1:]:
            result = result & m(b, h, i, j)
        return result

    return mask_mod


def or_masks(*mask_mods):
    def mask_mod(b, h, i, j):
        result = mask_mods[0](b, h, i, j)
        for m in mask_mods[1:]:
            result = result | m(b, h, i, j)
        return result

    return mask_mod


def alibi(slopes, Lq, Lk):
    """Adds -slopes[h] * |p - j|."""

    def score_mod(score, b, h, i, j):
        return score - slopes[h] * (i + (Lk - Lq) - j).abs()

    return score_mod


def softcap(cap):
    """cap * tanh(score / cap)."""

    def score_mod(score, b, h, i, j):
        return cap * torch.tanh(score / cap)

    return score_mod


def _index_grids(B, H, Lq, Lk):
    """Index tensors that broadcast to (B, H, Lq, Lk)."""
    return (
        torch.arange(B).view(B, 1, 1, 1),
        torch.arange(H).view(1, H, 1, 1),
        torch.arange(Lq).view(1, 1, Lq, 1),
        torch.arange(Lk).view(1, 1, 1, Lk),
    )


def mask_from_mod(mask_mod, B, H, Lq, Lk, *, elementwise=False):
    """(B, H, Lq, Lk) bool: mask_mod at every (b, h, i, j); elementwise=True calls it once per element, with
    0-dim index tensors (for functions written for one element only)."""
    if not elementwise:
        return mask_mod(*_index_grids(B, H, Lq, Lk)).expand(B, H, Lq, Lk).clone()
    out = torch.zeros(B, H, Lq, Lk, dtype=torch.bool)
    for b in range(B):
        for h in range(H):
            for i in range(Lq):
                for j in range(Lk):
                    out[b, h, i, j] = bool(mask_mod(torch.tensor(b), torch.tensor(h), torch.tensor(i), torch.tensor(j)))
    return out


def scores_from_mod(score_mod, scores, *, elementwise=False):
    """score_mod at every element of scores (B, H, Lq, Lk); differentiable through what it reads."""
    B, H, Lq, Lk = scores.shape
    if not elementwise:
        return score_mod(scores, *_index_grids(B, H, Lq, Lk)).expand(B, H, Lq, Lk)
    rows = []
    for b in range(B):
        for h in range(H):
            for i in range(Lq):
                for j in range(Lk):
                    idx = (torch.tensor(b), torch.tensor(h), torch.tensor(i), torch.tensor(j))
                    rows.append(score_mod(scores[b, h, i, j], *idx))
    return torch.stack(rows).view(B, H, Lq, Lk)


def attention_mods(
    q,
    k,
    v,
    *,
    valid_lens=None,
    attn_mask=None,
    is_causal=False,
    scale=None,
    w_v=None,
    mask_mod=None,
    score_mod=None,
    sinks=None,
    elementwise=False,
    dtype=torch.float64,
):
    """attention() with modifiers, entirely in `dtype`, written from the definitions:

        s[i, j] = score_mod(scale * q[i] . k[j]) + bias[i, j]     (or score_mod(w_v . tanh(q[i] + k[j])) + bias)
        a[i, j] = exp(s[i, j]) / (exp(sink_h) + sum_{j' allowed} exp(s[i, j']))   allowed j, else 0
        a row with no allowed key is all zeros (with or without a sink)

    `allowed` is valid_lens AND is_causal AND attn_mask AND mask_mod AND s[i, j] > -inf. Returns output and
    weights; 3-dim inputs are one head (sinks then (1,)).
    """
    three_d, q, k, v, scores = _scores(q, k, v, w_v, scale, dtype)
    B, H, Lq, Lk = scores.shape
    if score_mod is not None:
        scores = scores_from_mod(score_mod, scores, elementwise=elementwise).to(dtype)
    allowed = allowed_mask(
        B, H, Lq, Lk, valid_lens=valid_lens, attn_mask=attn_mask, is_causal=is_causal, three_d=three_d
    )
    if mask_mod is not None:
        allowed = allowed & mask_from_mod(mask_mod, B, H, Lq, Lk, elementwise=elementwise)
    if attn_mask is not None and attn_mask.is_floating_point():
        bias = attn_mask.unsqueeze(1) if three_d and attn_mask.dim() == 3 else attn_mask
        scores = scores + torch.where(torch.isneginf(bias), 0, bias).to(dtype)
    allowed = allowed & ~torch.isneginf(scores)  # a score of -inf (an infinite input) hides its key, as a mask does
    live = allowed.any(dim=-1, keepdim=True)  # (B, H, Lq, 1)
    # scores of dead rows and hidden keys replaced by finite values before exp: no NaN in values or gradients
    scores = torch.where(allowed, scores, torch.finfo(dtype).min)
    row_max = scores.amax(dim=-1, keepdim=True)  # (B, H, Lq, 1)
    if sinks is not None:
        sink = sinks.to(dtype).view(1, H, 1, 1)
        row_max = torch.maximum(row_max, sink)
    row_max = torch.where(live, row_max, 0.0).detach()  # any finite shift; the value does not change
    e = torch.where(allowed, torch.exp(scores - row_max), 0.0)  # (B, H, Lq, Lk)
    total = e.sum(dim=-1, keepdim=True)
    if sinks is not None:
        total = total + torch.exp(sink - row_max)
    weights = torch.where(live, e / torch.where(live, total, 1.0), 0.0)
    out = weights @ v
    if three_d:
        return out.squeeze(1), weights.squeeze(1)
    return out, weights


def assert_agrees(out: Tensor, want: Tensor, leaves, names, out_tol: float, grad_tol: float) -> None:
    """``out`` within ``out_tol`` of ``want`` (the math's), and the gradient of every leaf through each, for one
    random output gradient, within ``grad_tol`` (``names``: the leaves', for the message)."""
    assert max_err(out, want) <= out_tol
    dout = torch.randn_like(out)
    got, expected = torch.autograd.grad(out, leaves, dout), torch.autograd.grad(want, leaves, dout)
    for name, a, b in zip(names, got, expected, strict=True):
        assert max_err(a, b) <= grad_tol, name


def assert_unseen_nan_reaches_nothing(
    run, k: Tensor, v: Tensor, unseen, names, tol: float = 1e-12, zeros_run=None
) -> None:
    """``run(k, v)`` gives ``[out, *gradients]`` (``names``: theirs, k's and v's ``"dk"`` and ``"dv"``). With NaN in
    ``k`` and ``v`` at each index of ``unseen`` (places no query may see), every result is finite and equal to the
    run with zeros there (by ``zeros_run``, where given: the same call made another way), and k's and v's gradients
    are compared outside those places."""

    def filled(value: float) -> tuple[Tensor, Tensor]:
        k2, v2 = k.clone(), v.clone()
        for where in unseen:
            k2[where], v2[where] = value, value
        return k2, v2

    got, want = run(*filled(float("nan"))), (zeros_run or run)(*filled(0.0))
    for name, a, b in zip(names, got, want, strict=True):
        if name in ("dk", "dv"):  # no gradient to what no query sees: zero there, whatever it held
            a, b = a.clone(), b.clone()
            for where in unseen:
                a[where], b[where] = 0.0, 0.0
        assert torch.isfinite(a).all(), name
        assert max_err(a, b) <= tol, name
