"""Small helpers shared by the backends."""

from __future__ import annotations

from torch import Tensor

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
