"""Masks: sequence_mask, causal_mask, masked_softmax (the book's function done right)."""

from __future__ import annotations

import warnings

import pytest
import torch

import attnkit
from attnkit import causal_mask, masked_softmax, sequence_mask
from attnkit.masks import FloatMaskWarning, Mask


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


# --- the one combined mask: liveness, float-mask rules ---------------------------------------------------------


def _dead_example():
    """The issue's example: key 1 is hidden only by the combination of 2-D valid_lens and causal."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 2, 4, generator=g) for _ in range(3))
    k[:, :, 1], v[:, :, 1] = float("nan"), float("nan")
    return q, k, v


@pytest.mark.parametrize("backend", ["reference", "sdpa", "tiles:online"])
@pytest.mark.parametrize(
    "kw",
    [
        {"valid_lens": torch.tensor([[2, 1]]), "is_causal": True},
        {"attn_mask": torch.tensor([[True, True], [True, False]]), "is_causal": True},
        {"attn_mask": torch.tensor([[0.0, 0.5], [0.0, float("-inf")]]), "is_causal": True},
        {"valid_lens": torch.tensor([[2, 1]]), "attn_mask": torch.tensor([[True, False], [True, True]])},
    ],
    ids=["2d_valid_lens+causal", "bool+causal", "float_-inf+causal", "2d_valid_lens+bool"],
)
def test_a_key_hidden_only_by_a_combination_of_mask_parts_never_leaks(backend, kw):
    q, k, v = _dead_example()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attnkit.scaled_dot_product_attention(*leaves, backend=backend, **kw).output
    out.sum().backward()
    assert torch.isfinite(out).all()
    for leaf in leaves:
        assert torch.isfinite(leaf.grad).all()
    assert (leaves[1].grad[:, :, 1] == 0).all() and (leaves[2].grad[:, :, 1] == 0).all()
    clean = attnkit.scaled_dot_product_attention(q, k.nan_to_num(0.0), v.nan_to_num(0.0), backend=backend, **kw)
    torch.testing.assert_close(out, clean.output, rtol=0, atol=0)


def test_liveness_comes_from_the_combined_mask():
    mask = Mask.build(batch=1, heads=1, num_queries=2, num_keys=2, valid_lens=torch.tensor([[2, 1]]), is_causal=True)
    keys, rows = mask.liveness
    assert keys.tolist() == [[[True, False]]] and rows is None
    lens = torch.tensor([[0, 3, 1]])  # row 0 sees nothing
    keys, rows = Mask.build(batch=1, heads=1, num_queries=3, num_keys=4, valid_lens=lens).liveness
    assert keys.tolist() == [[[True, True, True, False]]] and rows.tolist() == [[[False, True, True]]]
    causal_only = Mask.build(batch=1, heads=1, num_queries=4, num_keys=2, is_causal=True)
    keys, rows = causal_only.liveness
    assert keys is None and rows.tolist() == [[[False, False, True, True]]]


@pytest.mark.parametrize("backend", ["reference", "sdpa", "tiles:online"])
@pytest.mark.parametrize(
    ("mask_dtype", "input_dtype", "fill"),
    [
        (torch.float64, torch.float32, -1e300),
        (torch.float32, torch.float16, torch.finfo(torch.float32).min),
        (torch.float32, torch.bfloat16, torch.finfo(torch.float32).min),
        (torch.float16, torch.float16, -20.0),  # masks as narrow as, or narrower than, the inputs
        (torch.float16, torch.float32, 100.0),
        (torch.float32, torch.float64, 100.0),
        (torch.float32, torch.float64, -1e30),
        (torch.float16, torch.float16, torch.finfo(torch.float16).min),
    ],
)
def test_a_finite_bias_never_becomes_minus_infinity(backend, mask_dtype, input_dtype, fill):
    """-inf only where the mask says -inf: a row whose whole bias is one huge finite number is a live row with the
    weights of no bias at all (softmax is shift-invariant), never NaN, never zeros, in every backend."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 3, 8, generator=g).to(input_dtype) for _ in range(3))
    bias = torch.zeros(3, 3, dtype=mask_dtype)
    bias[0] = fill
    out = attnkit.scaled_dot_product_attention(q, k, v, attn_mask=bias, backend=backend).output
    assert torch.isfinite(out).all()
    tol = {"atol": 2 * torch.finfo(input_dtype).eps, "rtol": 2 * torch.finfo(input_dtype).eps}  # a rounding or two
    plain = attnkit.scaled_dot_product_attention(q, k, v, backend=backend).output
    torch.testing.assert_close(out, plain, **tol)
    if fill > -20:
        return  # a bias that raises one key above the others gives it the weight: the math, not a mask
    bias[1, 1] = fill  # one hugely negative bias beside finite ones: that key gets no weight (exp(-20) < eps)
    out = attnkit.scaled_dot_product_attention(q, k, v, attn_mask=bias, backend=backend).output
    hidden = torch.tensor([[True, True, True], [True, False, True], [True, True, True]])
    torch.testing.assert_close(out, attnkit.scaled_dot_product_attention(q, k, v, attn_mask=hidden).output, **tol)


@pytest.mark.parametrize("backend", ["reference", "sdpa", "tiles:online"])
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_plus_infinity_or_nan_in_a_float_mask_is_a_value_error(backend, bad):
    q = k = v = torch.randn(1, 1, 2, 4)
    bias = torch.zeros(2, 2)
    bias[0, 1] = bad
    name = "NaN" if bad != bad else r"\+inf"
    with pytest.raises(ValueError, match=rf"attn_mask holds {name} \(first at index \(0, 1\) of shape \(2, 2\)\)"):
        attnkit.scaled_dot_product_attention(q, k, v, attn_mask=bias, backend=backend)
    with pytest.raises(ValueError, match=f"attn_mask holds {name}"):
        attnkit.masked_softmax(torch.zeros(1, 2, 2), attn_mask=bias)


def test_a_float_mask_of_zeros_and_ones_warns_once_naming_the_fix():
    q = k = v = torch.randn(1, 1, 3, 4)
    mask01 = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(3):
            attnkit.scaled_dot_product_attention(q, k, v, attn_mask=mask01)
    found = [w for w in caught if issubclass(w.category, FloatMaskWarning)]
    assert len(found) == 1
    assert "masks nothing" in str(found[0].message) and "attn_mask.bool()" in str(found[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FloatMaskWarning)
        for bias in (torch.zeros(3, 3), torch.ones(3, 3), mask01 * 0.5, mask01.masked_fill(mask01 == 0, float("-inf"))):
            attnkit.scaled_dot_product_attention(q, k, v, attn_mask=bias)  # real biases: no warning


@pytest.mark.parametrize("backend", ["reference", "sdpa", "tiles:online"])
@pytest.mark.parametrize(
    ("input_dtype", "offset", "tol"),
    [
        (torch.float64, 1e4, 1e-9),
        (torch.float32, 1e4, 1e-5),
        (torch.float32, 1e30, 1e-5),
        (torch.float64, 1e300, 1e-9),
        (torch.bfloat16, 1e4, 2e-2),
        (torch.float16, 3e4, 4e-3),
    ],
)
def test_a_large_bias_never_swamps_the_scores_nor_the_gradients(backend, input_dtype, offset, tol):
    """A bias of b + c on every key a row may see is the bias b (softmax is shift-invariant), outputs and gradients,
    however large c: the row is shifted by its largest visible bias before the scores are added (float64 mask,
    so b + c still holds b where the offset leaves it room; else row-constant)."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 2, 5, 8, generator=g, dtype=torch.float64).to(input_dtype) for _ in range(3))
    b = torch.randn(5, 5, generator=g, dtype=torch.float64).round(decimals=2)
    if offset > 1e12:
        b = torch.zeros_like(b)  # float64 keeps nothing of b beside 1e30 or 1e300: a row-constant bias
    hidden = torch.tensor([[True, True, False, True, True]]).expand(5, 5)
    b = b.masked_fill(~hidden, float("-inf"))
    lens = torch.tensor([[5, 4, 0, 3, 5], [2, 5, 5, 1, 4]])

    def run(bias):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attnkit.scaled_dot_product_attention(*leaves, attn_mask=bias, valid_lens=lens, backend=backend).output
        grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
        return out, grads

    out, grads = run(b + offset)
    want, want_grads = run(b)
    torch.testing.assert_close(out, want, atol=tol, rtol=tol)
    for grad, want_grad in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(grad, want_grad, atol=4 * tol, rtol=4 * tol)


@pytest.mark.parametrize("backend", ["reference", "sdpa", "tiles:online"])
def test_causal_rows_before_the_first_key_are_zero_whatever_their_queries_hold(backend):
    """Lq = 5 > Lk = 3 with is_causal: queries 0 and 1 see no key. NaN in them reaches no output, weight or gradient."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 2, 5, 4, generator=g)
    q[:, :, :2] = float("nan")
    k, v = torch.randn(2, 2, 3, 4, generator=g), torch.randn(2, 2, 3, 4, generator=g)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    need = backend == "reference"
    out, w = attnkit.scaled_dot_product_attention(*leaves, is_causal=True, backend=backend, need_weights=need)
    out.sum().backward()
    assert torch.isfinite(out).all() and (out[:, :, :2] == 0).all()
    assert w is None or (torch.isfinite(w).all() and (w[:, :, :2] == 0).all())
    for leaf in leaves:
        assert torch.isfinite(leaf.grad).all()
    mha = attnkit.MultiHeadAttention(8, 2)
    x = torch.randn(2, 5, 8)
    x[:, :2] = float("nan")
    with attnkit.record_weights(mha) as rec:
        y = mha(x, torch.randn(2, 3, 8), torch.randn(2, 3, 8), is_causal=True)
    assert torch.isfinite(rec[""]).all() and torch.isfinite(y[:, 2:]).all()
