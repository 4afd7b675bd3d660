"""Masks: sequence_mask, causal_mask, masked_softmax (the book's function done right)."""

from __future__ import annotations

import pytest
import torch

from attnkit import causal_mask, masked_softmax, sequence_mask


def test_masked_softmax_book_example_1d_valid_lens():
    scores = torch.rand(2, 2, 4)
    w = masked_softmax(scores, torch.tensor([2, 3]))
    assert (w[0, :, 2:] == 0).all() and (w[0, :, :2] > 0).all()
    assert (w[1, :, 3:] == 0).all() and (w[1, :, :3] > 0).all()
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 2))
    torch.testing.assert_close(w[0, :, :2], torch.softmax(scores[0, :, :2], -1))


def test_masked_softmax_book_example_2d_valid_lens():
    scores = torch.rand(2, 2, 4)
    w = masked_softmax(scores, torch.tensor([[1, 3], [2, 4]]))
    for b, lens in enumerate([[1, 3], [2, 4]]):
        for i, n in enumerate(lens):
            assert (w[b, i, n:] == 0).all()
            torch.testing.assert_close(w[b, i, :n], torch.softmax(scores[b, i, :n], -1))


def test_masked_softmax_accepts_whole_number_floats_like_the_book():
    scores = torch.rand(2, 2, 4)
    torch.testing.assert_close(
        masked_softmax(scores, torch.tensor([2.0, 3.0])), masked_softmax(scores, torch.tensor([2, 3]))
    )


def test_masked_softmax_row_with_no_key_is_zero_with_zero_finite_gradient():
    scores = torch.randn(2, 3, 4, requires_grad=True)
    w = masked_softmax(scores, torch.tensor([0, 4]))
    assert (w[0] == 0).all()
    torch.testing.assert_close(w[1].sum(-1), torch.ones(3))
    (w * torch.randn(2, 3, 4)).sum().backward()
    assert torch.isfinite(scores.grad).all()
    assert (scores.grad[0] == 0).all()


def test_masked_softmax_does_not_write_into_a_leaf_that_requires_grad():
    """The book's version writes -1e6 into X and fails on such a leaf."""
    x = torch.rand(2, 2, 4, requires_grad=True)
    before, version = x.detach().clone(), x._version
    w = masked_softmax(x, torch.tensor([2, 3]))
    w.sum().backward()
    assert x._version == version
    torch.testing.assert_close(x.detach(), before, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_masked_softmax_computes_half_precisions_in_float32(dtype):
    scores = torch.randn(2, 3, 40) * 10
    w = masked_softmax(scores.to(dtype), torch.tensor([30, 0]))
    assert w.dtype == dtype
    truth = masked_softmax(scores.to(dtype).float(), torch.tensor([30, 0]))
    # only the final rounding to the low precision: one unit in the last place (absolute below the normals)
    torch.testing.assert_close(w.float(), truth, rtol=torch.finfo(dtype).eps, atol=torch.finfo(dtype).tiny)
    assert (w[1] == 0).all()


def test_masked_softmax_combines_valid_lens_causal_bool_mask_and_bias():
    scores = torch.randn(2, 4, 3, 5)
    bias = torch.randn(4, 3, 5)
    allowed = torch.rand(2, 4, 3, 5) < 0.7
    lens = torch.tensor([4, 2])
    w = masked_softmax(scores + bias, lens, attn_mask=allowed, is_causal=True)
    expect_allowed = allowed & (torch.arange(5) < lens.view(2, 1, 1, 1)) & causal_mask(3, 5)
    assert (w[~expect_allowed] == 0).all()
    w2 = masked_softmax(scores, lens, attn_mask=bias.masked_fill(~expect_allowed, float("-inf")))
    torch.testing.assert_close(w, w2)


def test_masked_softmax_fill_is_finfo_min_not_minus_1e6():
    """Scores far below -1e6 still get their share; the book's -1e6 fill would give them nothing."""
    scores = torch.tensor([[[-3e6, -3e6, 0.0]]])
    w = masked_softmax(scores, torch.tensor([2]))
    torch.testing.assert_close(w, torch.tensor([[[0.5, 0.5, 0.0]]]))


def test_sequence_mask_1d_and_2d():
    assert sequence_mask(torch.tensor([1, 3]), 4).tolist() == [[True, False, False, False], [True, True, True, False]]
    m = sequence_mask(torch.tensor([[0, 2]]), 3)
    assert m.shape == (1, 2, 3) and m.tolist() == [[[False, False, False], [True, True, False]]]


def test_causal_mask_is_aligned_bottom_right():
    assert causal_mask(4, 4).equal(torch.ones(4, 4, dtype=torch.bool).tril())
    assert causal_mask(2, 4).tolist() == [[True, True, True, False], [True, True, True, True]]
    assert causal_mask(4, 2).tolist() == [[False, False], [False, False], [True, False], [True, True]]
    assert causal_mask(1, 5).all()
