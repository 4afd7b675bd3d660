"""Packed sequences: pack/unpack round trips, packed attention equals padded attention per example, and one
document's content never changes another document's output, bit for bit."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import mods
from attnkit.backends.tiles import online
from attnkit.packing import pack, unpack

# B batch, L padded length, N packed tokens, E features


def _batch(seed: int, lens: list[int], L: int, E: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(len(lens), L, E, generator=g, dtype=torch.float64), torch.tensor(lens)


def test_pack_unpack_round_trip_and_ids():
    x, lens = _batch(0, [2, 0, 4, 1], 4, E=3)
    p = pack(x, lens)
    assert p.data.shape == (1, 7, 3)
    assert p.document_ids.tolist() == [[0, 0, 2, 2, 2, 2, 3]]
    assert p.positions.tolist() == [[0, 1, 0, 1, 2, 3, 0]]
    back = unpack(p.data, p)
    keep = torch.arange(4) < lens[:, None]  # (B, L)
    assert torch.equal(back[keep], x[keep])
    assert torch.equal(back[~keep], torch.zeros_like(back[~keep]))


def test_unpack_is_differentiable_and_pack_passes_gradients_to_real_tokens_only():
    x, lens = _batch(1, [3, 1], 5)
    x.requires_grad_()
    p = pack(x, lens)
    unpack(p.data * 2, p).sum().backward()
    keep = torch.arange(5) < lens[:, None]
    assert torch.equal(x.grad[keep], torch.full_like(x.grad[keep], 2.0))
    assert torch.equal(x.grad[~keep], torch.zeros_like(x.grad[~keep]))


@pytest.mark.parametrize("backend", ["reference", "tiles:online", "sdpa"])
def test_packed_attention_equals_each_example_alone(backend):
    torch.manual_seed(0)
    mha = attnkit.MultiHeadAttention(16, 4, num_kv_heads=2, backend=backend).double()
    x, lens = _batch(2, [5, 17, 1, 9], 17)
    p = pack(x, lens)
    with online.settings(block_size=4):
        y = unpack(mha(p.data, p.data, p.data, is_causal=True, mask_mod=p.document()), p)  # (B, L, E)
    for b, n in enumerate(lens.tolist()):
        alone = mha(x[b : b + 1, :n], x[b : b + 1, :n], x[b : b + 1, :n], is_causal=True)  # (1, n, E)
        torch.testing.assert_close(y[b, :n], alone[0], rtol=0, atol=1e-12)


@pytest.mark.parametrize("backend", ["reference", "tiles:online", "sdpa"])
def test_changing_one_document_leaves_every_other_bit_for_bit(backend):
    """The packed row's other documents see nothing of the changed one: their outputs are the same bits, in float32
    (where rounding would show any leak), with documents spanning block boundaries."""
    torch.manual_seed(0)
    mha = attnkit.MultiHeadAttention(32, 4, backend=backend)
    lens = torch.tensor([37, 5, 64, 20])
    x = torch.randn(4, 64, 32)
    changed = x.clone()
    changed[1, :5] = torch.randn(5, 32) * 100  # a document of another scale altogether
    outs = []
    for batch in (x, changed):
        p = pack(batch, lens)
        with online.settings(block_size=16):
            outs.append(unpack(mha(p.data, p.data, p.data, is_causal=True, mask_mod=p.document()), p))
    for b in (0, 2, 3):
        assert torch.equal(outs[0][b], outs[1][b]), f"document {b} changed"
    assert not torch.equal(outs[0][1], outs[1][1])


def test_bad_inputs_name_the_argument():
    x = torch.randn(2, 4, 3)
    with pytest.raises(ValueError, match=r"valid_lens must have shape \(B,\) = \(2,\)"):
        pack(x, torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="at most the number of keys"):
        pack(x, torch.tensor([1, 5]))
    p = pack(x, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="must hold the 3 packed tokens"):
        unpack(torch.randn(1, 4, 3), p)
    q = torch.randn(1, 1, 5, 4)  # 5 positions, ids for 3
    with pytest.raises(ValueError, match=r"document: ids_q must have shape \(B, Lq\) = \(1, 5\), got \(1, 3\)"):
        attnkit.scaled_dot_product_attention(q, q, q, mask_mod=mods.document(p.document_ids))
