"""The tile engine on CUDA (``tiles:flex``): PyTorch's FlexAttention (``torch.nn.attention.flex_attention``), compiled
block-sparse kernels.

The mask's parts (``valid_lens``, ``is_causal`` aligned to the bottom right, a boolean ``attn_mask``, the ``mask_mod``)
come as one mask function (:meth:`attnkit.masks.Mask.as_mask_mod`), from which FlexAttention builds its block mask;
the ``score_mod`` is handed over as it is, and a float ``attn_mask`` is added to the scores inside it. Rows with
nothing to attend to give zeros (FlexAttention's own rule), and dead keys, values and queries are zeroed first as in
every backend.

CUDA only: on CPU, PyTorch 2.13's FlexAttention has no backward pass and is slow unless compiled, where the engine's
other implementations run the same calls (``SUPPORTS``). No weights, dropout, additive scoring, sinks, or gradients
to a float ``attn_mask``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from attnkit.backends.common import zero_dead
from attnkit.backends.contract import DOT, Call, Supports

NAME = "tiles:flex"

# B batch, H heads, Hkv key/value heads, Lq/Lk query/key length, D head dim, Dv value head dim

_flex: Any
try:
    from torch.nn.attention import flex_attention as _flex
except ImportError:  # torch < 2.5
    _flex = None
# torch's function itself, taken at import: under attnkit.patch_flex_attention the module's name runs attnkit's
_FLEX_ATTENTION: Any = None if _flex is None else _flex.flex_attention

SUPPORTS = Supports(
    scoring=frozenset({DOT}),
    weights=False,
    dropout=False,
    bias_grad=False,
    sinks=False,
    devices=frozenset({"cuda"}) if _flex is not None else frozenset(),
)


def attention(call: Call) -> tuple[Tensor, Tensor | None]:
    return run(call, compiled=True), None


def run(call: Call, *, compiled: bool) -> Tensor:
    """The output ``(B, H, Lq, Dv)`` through ``flex_attention``; ``compiled=False`` runs it eagerly (slow, and on
    CPU forward only: what the CPU tests check the mapping with)."""
    if _flex is None:
        raise RuntimeError("this PyTorch has no torch.nn.attention.flex_attention")
    q, k, v, mask = call.q, call.k, call.v, call.mask
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    q, k, v = zero_dead(q, k, v, mask, call.zeros_past)
    mask_fn = mask.as_mask_mod()
    block_mask = None
    if mask_fn is not None:
        block_mask = _flex.create_block_mask(mask_fn, B, H, Lq, Lk, device=q.device)
    score_fn = _score_function(call.score_mod, mask.full(q.dtype)[1])
    flex = _compiled() if compiled else _FLEX_ATTENTION
    out = flex(
        q, k, v, score_mod=score_fn, block_mask=block_mask, scale=call.scale, enable_gqa=k.shape[1] != H
    )  # (B, H, Lq, Dv)
    _, live_rows = mask.liveness  # (B|1, H|1, Lq) or None
    return out if live_rows is None else out.masked_fill(~live_rows[..., None], 0.0)


@functools.cache
def _compiled() -> Callable[..., Tensor]:
    assert _FLEX_ATTENTION is not None
    return torch.compile(_FLEX_ATTENTION)


def _score_function(score_mod: Any, bias: Tensor | None) -> Callable[..., Tensor] | None:
    """The user's score_mod, then the float ``attn_mask`` (``bias``, shifted and clamped as the Mask gives it;
    ``-inf`` where it masks, which the block mask also hides) added."""
    if bias is None:
        return score_mod
    B, H, Lq, Lk = bias.shape[0], bias.shape[1], bias.shape[2], bias.shape[3]

    def with_bias(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        if score_mod is not None:
            score = score_mod(score, b, h, q_idx, kv_idx)
        return score + bias[b if B > 1 else 0, h if H > 1 else 0, q_idx if Lq > 1 else 0, kv_idx if Lk > 1 else 0]

    return with_bias
