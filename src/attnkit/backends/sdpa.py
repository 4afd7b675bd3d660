"""PyTorch's fused kernels: ``torch.nn.functional.scaled_dot_product_attention``.

Dot-product scoring only, never returns weights. The parts of the :class:`~attnkit.masks.Mask` become the one
``attn_mask`` SDPA takes (a causal mask alone with ``Lq == Lk`` becomes ``is_causal=True``, the fastest path).
Rows with nothing to attend to are given every key inside the kernel and zeroed afterwards, so that no
version of PyTorch can turn them into NaN, and their gradients are exactly zero.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import Tensor

from attnkit.backends.common import repeat_kv
from attnkit.masks import Mask

NAME = "sdpa"

# B batch, H heads, Hkv key/value heads, Lq/Lk query/key length, D head dim, Dv value head dim

# `enable_gqa` arrived in PyTorch 2.5; before it, key/value heads are repeated here.
_HAS_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


def available() -> list[str]:
    return []


def why_not(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Mask,
    *,
    w_v: Tensor | None,
    scale: float,
    dropout_p: float,
    need_weights: bool,
) -> list[str]:
    reasons = available()
    if w_v is not None:
        reasons.append("dot-product scoring only (this call is additive)")
    if need_weights:
        reasons.append("never returns weights (need_weights=True)")
    return reasons


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Mask,
    *,
    w_v: Tensor | None,
    scale: float,
    dropout_p: float,
    need_weights: bool,
) -> tuple[Tensor, Tensor | None]:
    H, Hkv = q.shape[1], k.shape[1]
    gqa: dict[str, Any] = {}
    if H != Hkv:
        if _HAS_GQA:
            gqa = {"enable_gqa": True}
        else:
            k, v = repeat_kv(k, H), repeat_kv(v, H)  # (B, H, Lk, D), (B, H, Lk, Dv)
    Lq, Lk = mask.num_queries, mask.num_keys
    only_causal = mask.is_causal and mask.valid_lens is None and mask.bool_mask is None and mask.bias is None
    if mask.is_empty or (only_causal and Lq == Lk):
        out = F.scaled_dot_product_attention(
            q, k, v, dropout_p=dropout_p, is_causal=mask.is_causal, scale=scale, **gqa
        )  # (B, H, Lq, Dv)
        return out, None

    allowed, bias = mask.full(q.dtype)  # (B|1, H|1, Lq|1, Lk) each, or None
    live_rows = None
    if allowed is not None:
        live_rows = allowed.any(dim=-1, keepdim=True)  # (B|1, H|1, Lq|1, 1)
        if bool(live_rows.all()):
            live_rows = None
        else:
            allowed = allowed | ~live_rows  # dead rows see every (zeroed) key, then are zeroed below
    if bias is None:
        attn_mask = allowed
    elif allowed is None:
        attn_mask = bias
    else:
        attn_mask = bias.masked_fill(~allowed, float("-inf"))  # (B|1, H|1, Lq, Lk)
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale, **gqa
    )  # (B, H, Lq, Dv)
    if live_rows is not None:
        out = out.masked_fill(~live_rows, 0.0)
    return out, None
