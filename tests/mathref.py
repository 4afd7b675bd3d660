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


def attention(q, k, v, *, valid_lens=None, attn_mask=None, is_causal=False, scale=None, w_v=None, dtype=torch.float64):
    """Output and weights, computed entirely in `dtype`. Accepts 3-dim (head-less) inputs too."""
    three_d = q.dim() == 3
    if three_d:
        q, k, v = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)
    B, H, Lq, D = q.shape
    Lk = k.shape[2]
    group = H // k.shape[1]
    q, k, v = q.to(dtype), k.to(dtype).repeat_interleave(group, 1), v.to(dtype).repeat_interleave(group, 1)
    if w_v is None:
        scale = D**-0.5 if scale is None else scale
        scores = q @ k.transpose(-1, -2) * scale
    else:
        scores = torch.tanh(q.unsqueeze(3) + k.unsqueeze(2)) @ w_v.to(dtype)
    allowed = allowed_mask(
        B, H, Lq, Lk, valid_lens=valid_lens, attn_mask=attn_mask, is_causal=is_causal, three_d=three_d
    )
    if attn_mask is not None and attn_mask.is_floating_point():
        bias = attn_mask.unsqueeze(1) if three_d and attn_mask.dim() == 3 else attn_mask
        scores = scores + torch.where(torch.isneginf(bias), 0, bias).to(dtype)
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
