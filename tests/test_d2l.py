"""attnkit.d2l: the book's examples give the book's numbers, and the book's classes' weights load unchanged."""

from __future__ import annotations

import pytest
import torch

import attnkit
import book
from attnkit import d2l

VALUES = torch.arange(40, dtype=torch.float32).reshape(1, 10, 4).repeat(2, 1, 1)
BOOK_OUTPUT = torch.tensor([[[2.0, 3.0, 4.0, 5.0]], [[10.0, 11.0, 12.0, 13.0]]])


def _book_weights(w):
    assert w.shape == (2, 1, 10)
    torch.testing.assert_close(w[0, 0, :2], torch.full((2,), 0.5))
    torch.testing.assert_close(w[1, 0, :6], torch.full((6,), 1 / 6))
    assert (w[0, 0, 2:] == 0).all() and (w[1, 0, 6:] == 0).all()


def test_book_additive_attention_example():
    torch.manual_seed(0)
    queries, keys = torch.normal(0, 1, (2, 1, 20)), torch.ones((2, 10, 2))
    attention = d2l.AdditiveAttention(key_size=2, query_size=20, num_hiddens=8, dropout=0.1).eval()
    out = attention(queries, keys, VALUES, torch.tensor([2, 6]))
    torch.testing.assert_close(out, BOOK_OUTPUT)
    _book_weights(attention.attention_weights)


def test_book_dot_product_attention_example():
    torch.manual_seed(0)
    queries, keys = torch.normal(0, 1, (2, 1, 2)), torch.ones((2, 10, 2))
    attention = d2l.DotProductAttention(0.5).eval()
    out = attention(queries, keys, VALUES, torch.tensor([2, 6]))
    torch.testing.assert_close(out, BOOK_OUTPUT)
    _book_weights(attention.attention_weights)
    torch.testing.assert_close(attention.scores, torch.bmm(queries, keys.transpose(1, 2)) / 2**0.5)


def test_book_multihead_attention_example():
    attention = d2l.MultiHeadAttention(100, 100, 100, 100, 5, 0.5).eval()
    X, Y = torch.ones((2, 4, 100)), torch.ones((2, 6, 100))
    assert attention(X, Y, Y, torch.tensor([3, 2])).shape == (2, 4, 100)
    assert attention.attention.attention_weights.shape == (10, 4, 6)


def test_transpose_qkv_and_transpose_output():
    X = torch.randn(2, 3, 8)
    assert d2l.transpose_qkv(X, 2).shape == (4, 3, 4)
    assert torch.equal(d2l.transpose_qkv(X, 2), book.transpose_qkv(X, 2))
    assert torch.equal(d2l.transpose_output(d2l.transpose_qkv(X, 2), 2), X)
    with pytest.raises(ValueError, match=r"num_heads=3, got \(2, 3, 8\)"):
        d2l.transpose_qkv(X, 3)


def test_sequence_mask_returns_a_new_tensor():
    X = torch.tensor([[1, 2, 3], [4, 5, 6]])
    out = d2l.sequence_mask(X, torch.tensor([1, 2]))
    assert out.tolist() == [[1, 0, 0], [4, 5, 0]]
    assert X.tolist() == [[1, 2, 3], [4, 5, 6]]
    assert d2l.sequence_mask(torch.ones(2, 3, 2), torch.tensor([1, 2]), value=-1).tolist()[0] == [
        [1, 1],
        [-1, -1],
        [-1, -1],
    ]


def test_masked_softmax_matches_the_book_and_zeroes_rows_the_book_makes_uniform():
    X = torch.rand(2, 3, 4)
    for lens in (torch.tensor([2, 3]), torch.tensor([[1, 3, 4], [2, 4, 1]])):
        torch.testing.assert_close(d2l.masked_softmax(X, lens), book.masked_softmax(X.clone(), lens))
    ours = d2l.masked_softmax(X, torch.tensor([0, 3]))
    theirs = book.masked_softmax(X.clone(), torch.tensor([0, 3]))
    torch.testing.assert_close(theirs[0], torch.full((3, 4), 0.25))  # the book: uniform over padding
    assert (ours[0] == 0).all()


def _cases():
    """(queries, keys, values, valid_lens) for self- and cross-attention, 1-D and 2-D valid_lens."""
    g = torch.Generator().manual_seed(0)
    q_self = torch.randn(3, 5, 12, generator=g)
    q, k, v = torch.randn(3, 5, 12, generator=g), torch.randn(3, 7, 9, generator=g), torch.randn(3, 7, 6, generator=g)
    return {
        "self-1d": (q_self, q_self, q_self, torch.tensor([5, 2, 3])),
        "self-2d": (q_self, q_self, q_self, torch.randint(1, 6, (3, 5), generator=g)),
        "cross-1d": (q, k, v, torch.tensor([7, 1, 4])),
        "cross-2d": (q, k, v, torch.randint(1, 8, (3, 5), generator=g)),
        "cross-none": (q, k, v, None),
    }


@pytest.mark.parametrize("case", list(_cases()))
@pytest.mark.parametrize("bias", [False, True])
def test_multihead_equals_the_book_with_the_same_weights(case, bias):
    queries, keys, values, lens = _cases()[case]
    sizes = (keys.shape[-1], queries.shape[-1], values.shape[-1], 16, 4, 0.0)
    theirs = book.MultiHeadAttention(*sizes, bias=bias).eval()
    if bias:
        for p in theirs.parameters():
            torch.nn.init.normal_(p)
    expected = theirs(queries, keys, values, lens)
    ours = d2l.MultiHeadAttention(*sizes, bias=bias).eval()
    ours.load_state_dict(theirs.state_dict())
    torch.testing.assert_close(ours(queries, keys, values, lens), expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(ours.attention.attention_weights, theirs.attention.attention_weights, rtol=0, atol=1e-5)
    modern = attnkit.MultiHeadAttention(
        16, 4, query_size=queries.shape[-1], key_size=keys.shape[-1], value_size=values.shape[-1], bias=bias
    ).eval()
    modern.load_state_dict(theirs.state_dict())
    torch.testing.assert_close(modern(queries, keys, values, lens), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("case", list(_cases()))
def test_additive_and_dot_product_equal_the_book_with_the_same_weights(case):
    queries, keys, values, lens = _cases()[case]
    theirs = book.AdditiveAttention(keys.shape[-1], queries.shape[-1], 8, 0.0).eval()
    expected = theirs(queries, keys, values, lens)
    ours = d2l.AdditiveAttention(keys.shape[-1], queries.shape[-1], 8, 0.0).eval()
    ours.load_state_dict(theirs.state_dict())
    torch.testing.assert_close(ours(queries, keys, values, lens), expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(ours.attention_weights, theirs.attention_weights, rtol=0, atol=1e-5)
    modern = attnkit.AdditiveAttention(8, query_size=queries.shape[-1], key_size=keys.shape[-1]).eval()
    modern.load_state_dict(theirs.state_dict())
    torch.testing.assert_close(modern(queries, keys, values, lens), expected, rtol=0, atol=1e-5)
    if queries.shape[-1] == keys.shape[-1]:
        expected = book.DotProductAttention(0.0)(queries, keys, values, lens)
        torch.testing.assert_close(
            d2l.DotProductAttention(0.0)(queries, keys, values, lens), expected, atol=1e-5, rtol=0
        )
        got = attnkit.DotProductAttention()(queries, keys, values, lens)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def test_newer_size_inferring_forms():
    additive = d2l.AdditiveAttention(8, 0.1).eval()
    out = additive(torch.randn(2, 1, 20), torch.ones(2, 10, 2), VALUES, torch.tensor([2, 6]))
    torch.testing.assert_close(out, BOOK_OUTPUT)
    assert set(additive.state_dict()) == {"W_k.weight", "W_q.weight", "w_v.weight"}
    mha = d2l.MultiHeadAttention(100, 5, 0.5).eval()
    assert mha(torch.ones(2, 4, 100), torch.ones(2, 6, 100), torch.ones(2, 6, 100), torch.tensor([3, 2])).shape == (
        2,
        4,
        100,
    )
    assert set(mha.state_dict()) == {"W_q.weight", "W_k.weight", "W_v.weight", "W_o.weight"}
    assert d2l.MultiHeadAttention(100, 5, 0.5, bias=True).W_o.bias is not None
    assert d2l.MultiHeadAttention(100, 100, 100, 100, 5, 0.5, True).W_o.bias is not None


def test_wrong_constructor_arguments_say_both_signatures():
    with pytest.raises(TypeError, match=r"AdditiveAttention\(key_size, query_size, num_hiddens, dropout\)"):
        d2l.AdditiveAttention(8)
    with pytest.raises(TypeError, match="MultiHeadAttention"):
        d2l.MultiHeadAttention(100, 5, 0.5, nonsense=1)


def test_rows_with_no_key_are_zero_and_padding_never_leaks():
    mha = d2l.MultiHeadAttention(4, 4, 4, 8, 2, 0.0).eval()
    x = torch.randn(2, 3, 4)
    dirty = x.clone()
    dirty[1, 2:] = float("nan")
    out = mha(x, dirty, dirty, torch.tensor([3, 2]))
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, mha(x, x, x, torch.tensor([3, 2])))
    dot = d2l.DotProductAttention(0.0)
    assert (dot(x, x, x, torch.tensor([0, 3]))[0] == 0).all()
