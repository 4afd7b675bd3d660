"""Small helpers shared by the backends."""

from __future__ import annotations

import torch
from torch import Tensor

from attnkit.masks import Mask

# B batch, H heads, Hkv key/value heads, L length, D head dim


def repeat_kv(x: Tensor, heads: int) -> Tensor:
    """Give each of ``heads`` query heads its key/value head: head ``h`` uses ``h // (heads // Hkv)``.

    The same grouping as ``torch.nn.functional.scaled_dot_product_attention(enable_gqa=True)``.
    """
    group = heads // x.shape[1]
    return x if group == 1 else x.repeat_interleave(group, dim=1)  # (B, Hkv, L, D) -> (B, H, L, D)


def additive_scores(q: Tensor, k: Tensor, w_v: Tensor) -> tuple[Tensor, Tensor]:
    """Bahdanau scores ``s[i, j] = w_v . tanh(q[i] + k[j])`` and the ``tanh`` features they came from."""
    pre = q[..., :, None, :] + k[..., None, :, :]  # (B, H, Lq, Lk, D)
    # In place when autograd does not need `pre`: the largest tensor of additive attention, held once.
    features = pre.tanh() if pre.requires_grad else pre.tanh_()  # (B, H, Lq, Lk, D)
    return features @ w_v, features  # (B, H, Lq, Lk), (B, H, Lq, Lk, D)


def zero_dead_keys(k: Tensor, v: Tensor, mask: Mask) -> tuple[Tensor, Tensor]:
    """Zero the keys and values no query may see (padding), so that whatever they hold, NaN included, never
    reaches the output or the gradients. Returns new tensors; the inputs are left as they were.

    Every backend that reads past ``valid_lens`` calls this first; one that never reads there need not.
    """
    live = mask.live_keys()  # (B|1, H|1, Lk, 1) or None
    if live is None or bool(live.all()):
        return k, v
    Hkv = k.shape[1]
    if live.shape[1] not in (1, Hkv):
        # a per-query-head mask with grouped key/value heads: a key/value head is live if any of its group is
        live = live.unflatten(1, (Hkv, -1)).any(dim=2)  # (B|1, Hkv, Lk, 1)
    zero = torch.zeros((), dtype=k.dtype, device=k.device)
    return torch.where(live, k, zero), torch.where(live, v, zero)
