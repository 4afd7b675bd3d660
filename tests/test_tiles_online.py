"""The tile engine's eager implementation (attnkit.backends.tiles.online): memory linear in the length, forward and
backward. Its agreement with float64 is in test_agreement.py and test_mods.py."""

from __future__ import annotations

import torch

import attnkit
from attnkit.backends.tiles import online


def test_chunked_saves_nothing_of_size_lq_times_lk():
    """Forward and backward keep O(L) tensors: what autograd saves is never an Lq x Lk matrix."""
    L, D = 512, 16
    q, k, v = (torch.randn(1, 2, L, D, requires_grad=True) for _ in range(3))
    saved = []
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t)
    with hooks, online.settings(block_size=64):
        out = attnkit.scaled_dot_product_attention(q, k, v, valid_lens=torch.tensor([400]), backend="tiles:online")
    out.output.sum().backward()
    assert saved and max(saved) <= 2 * L * D
    with hooks:
        w_v = torch.randn(D, requires_grad=True)
        out = attnkit.additive_attention(q, k, v, w_v, backend="tiles:online")
    out.output.sum().backward()
    assert max(saved) <= 2 * L * D
