"""attnkit.d2l: the book's examples give the book's numbers, and the book's classes' weights load unchanged."""

from __future__ import annotations

import copy

import pytest
import torch

import attnkit
from attnkit import d2l
from attnkit.tools import (
    bench,
    book,  # the book's own code, the oracle
)

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


# --- the book's initial weights under the book's seed -----------------------------------------------------

# Each form of each class, the book's and attnkit's, with the same arguments (biases where the book allows them)
BOOK_FORMS = {
    "additive-explicit": (book.AdditiveAttention, d2l.AdditiveAttention, (2, 20, 8, 0.5)),
    "additive-inferred": (book.LazyAdditiveAttention, d2l.AdditiveAttention, (8, 0.5)),
    "multihead-explicit": (book.MultiHeadAttention, d2l.MultiHeadAttention, (2, 20, 4, 16, 4, 0.5, True)),
    "multihead-inferred": (book.LazyMultiHeadAttention, d2l.MultiHeadAttention, (16, 4, 0.5, True)),
}


def _first_call(cls, args, *, train, init_at_build):
    """Build under seed 0 and make the first call, as a notebook does; the inputs come from their own generator."""
    g = torch.Generator().manual_seed(1)
    queries, keys, values = (
        torch.randn(2, 5, 20, generator=g),
        torch.randn(2, 7, 2, generator=g),
        torch.randn(2, 7, 4, generator=g),
    )
    torch.manual_seed(0)
    module = cls(*args)
    if init_at_build:
        module.apply(book.init_seq2seq)  # as the book's encoders and decoders do in __init__
    module.train(train)
    out = module(queries, keys, values, torch.tensor([3, 7]))
    return module, out, torch.get_rng_state()


def _assert_same_parameters(ours, theirs):
    ours_sd, theirs_sd = ours.state_dict(), theirs.state_dict()
    assert list(ours_sd) == list(theirs_sd)
    for name, p in theirs_sd.items():
        assert torch.equal(ours_sd[name], p), name


@pytest.mark.parametrize("form", list(BOOK_FORMS))
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("init_at_build", [False, True], ids=["default_init", "init_seq2seq"])
def test_the_same_seed_gives_the_books_initial_weights(form, train, init_at_build):
    """Parameters are drawn from the generator in the book's order: built, then (lazy layers) at the first call in
    call order, with the dropout of a training call in between; init_seq2seq touches the layers the book's does."""
    theirs_cls, ours_cls, args = BOOK_FORMS[form]
    theirs, expected, theirs_rng = _first_call(theirs_cls, args, train=train, init_at_build=init_at_build)
    ours, out, ours_rng = _first_call(ours_cls, args, train=train, init_at_build=init_at_build)
    _assert_same_parameters(ours, theirs)
    assert torch.equal(ours_rng, theirs_rng)  # as many draws, so what the notebook does next is the same too
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)  # in training too: the same dropout
    for module in (theirs, ours):  # once built, every layer is an nn.Linear, in both
        torch.manual_seed(2)
        module.apply(book.init_seq2seq)
    _assert_same_parameters(ours, theirs)


# --- mistakes are a ValueError naming the argument, before any work ----------------------------------------

Q, K, V = torch.randn(2, 1, 20), torch.ones(2, 10, 2), torch.ones(2, 10, 4)


@pytest.mark.parametrize(
    ("make", "args", "message"),
    [
        (
            lambda: d2l.AdditiveAttention(2, 20, 8, 0.1),
            (torch.randn(2, 1, 21), K, V),
            r"queries must have 20 features .*got 21: queries \(2, 1, 21\)",
        ),
        (
            lambda: d2l.AdditiveAttention(2, 20, 8, 0.1),
            (Q, torch.ones(2, 10, 3), V),
            r"keys must have 2 features .*got 3: keys \(2, 10, 3\)",
        ),
        (
            lambda: d2l.AdditiveAttention(8, 0.1),
            (torch.randn(2, 1, 21), K, V),
            r"queries must have 20 features .*got 21: queries \(2, 1, 21\)",
        ),
        (
            lambda: d2l.MultiHeadAttention(2, 20, 4, 16, 4, 0.0),
            (Q, K, torch.ones(2, 10, 5)),
            r"values must have 4 features .*got 5: values \(2, 10, 5\)",
        ),
        (
            lambda: d2l.MultiHeadAttention(16, 4, 0.0),
            (Q, torch.ones(2, 10, 3), V),
            r"keys must have 2 features .*got 3: keys \(2, 10, 3\)",
        ),
        (
            lambda: d2l.DotProductAttention(0.0),
            (torch.ones(2, 1, 3), K, V),
            r"queries and keys must have the same feature size, got 3 and 2: queries \(2, 1, 3\), keys \(2, 10, 2\)",
        ),
    ],
    ids=["additive-queries", "additive-keys", "additive-inferred", "multihead-values", "multihead-inferred", "dot"],
)
def test_wrong_feature_sizes_are_a_value_error_naming_the_argument(make, args, message):
    module = make().eval()
    if isinstance(module, d2l.DotProductAttention):
        module(Q[..., :2], K, V)
    else:
        module(Q, K, V, None)  # the first call builds the lazy layers: later calls must match it
    with pytest.raises(ValueError, match=message):
        module(*args, None)


def _aten_ops(fn) -> list[str]:
    """The ATen operators that ``fn()`` runs."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return [e.name for e in prof.events() if e.name.startswith("aten::")]


@pytest.mark.parametrize(
    "make",
    [
        lambda: d2l.DotProductAttention(0.0),
        lambda: d2l.AdditiveAttention(8, 0.0),
        lambda: d2l.MultiHeadAttention(8, 2, 0.0),
    ],
    ids=["dot", "additive", "multihead"],
)
def test_inputs_with_heads_are_a_value_error_before_any_work(make):
    """The book's layers take (B, L, features); (B, H, L, d) used to fail inside, after attention had run."""
    module = make()
    q4, k4, v4 = torch.ones(2, 3, 4, 8), torch.ones(2, 3, 6, 8), torch.ones(2, 3, 6, 8)

    def call():
        with pytest.raises(ValueError, match=r"must be 3-dim.*queries \(2, 3, 4, 8\), keys \(2, 3, 6, 8\)"):
            module(q4, k4, v4, None)

    assert _aten_ops(call) == []
    if not isinstance(module, d2l.DotProductAttention):
        assert module.W_q.has_uninitialized_params()  # the failed call did not fix the input size


# --- .scores, and the cost of a call -------------------------------------------------------------------------

MATMULS = {"aten::bmm", "aten::baddbmm", "aten::mm", "aten::addmm"}


@pytest.mark.parametrize(
    "lens", [None, torch.tensor([2, 6]), torch.tensor([[1, 10], [3, 4]])], ids=["none", "1d", "2d"]
)
def test_a_call_runs_the_books_two_matmuls_and_scores_are_computed_when_read(lens):
    g = torch.Generator().manual_seed(0)
    queries, keys = torch.randn(2, 2, 3, generator=g), torch.randn(2, 10, 3, generator=g)
    attention = d2l.DotProductAttention(0.0)
    assert attention.scores is None
    ran = _aten_ops(lambda: attention(queries, keys, VALUES, lens))
    assert sum(op in MATMULS for op in ran) == 2  # scores and the weighted sum; none for .scores
    expected = torch.bmm(queries, keys.transpose(1, 2)) / 3**0.5
    torch.testing.assert_close(attention.scores, expected)
    assert attention.scores is attention.scores  # computed once
    attention(2 * queries, keys, VALUES, lens)
    torch.testing.assert_close(attention.scores, 2 * expected)  # the last call's


def test_scores_refuse_queries_modified_in_place_after_the_call():
    queries, keys = torch.randn(2, 1, 2), torch.ones(2, 10, 2)
    attention = d2l.DotProductAttention(0.0)
    attention(queries, keys, VALUES)
    queries.mul_(2)
    with pytest.raises(RuntimeError, match="modified in place"):
        _ = attention.scores


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_padding_holding_nan_or_inf_reaches_neither_the_output_nor_the_gradients(bad):
    q = torch.randn(3, 4, 6, requires_grad=True)
    kv = torch.randn(3, 5, 6)
    kv[0, 2:], kv[2, 4:] = bad, bad  # past valid_lens
    kv.requires_grad_()
    lens = torch.tensor([2, 5, 4])
    attention = d2l.DotProductAttention(0.0)
    out = attention(q, kv, kv, lens)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(q.grad).all() and torch.isfinite(kv.grad).all()
    assert (kv.grad[0, 2:] == 0).all()
    clean = kv.detach().nan_to_num(0.0, 0.0, 0.0)
    torch.testing.assert_close(out, attention(q, clean, clean, lens))


def test_the_bench_row_d2l_computes_the_books_attention():
    """``attnkit bench``'s ``d2l`` row times the drop-in on the ``book`` row's inputs and weights."""
    for mask in bench.MASKS:
        expected = bench.make_forward("mha", 2, 16, mask, "book", train=False)()
        got = bench.make_forward("mha", 2, 16, mask, "d2l", train=False)()
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-5, msg=mask)


def test_show_heatmaps_returns_nothing_so_a_notebook_shows_the_figure_once(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    path = tmp_path / "weights.png"
    try:
        assert d2l.show_heatmaps(torch.rand(1, 2, 3, 4), "Keys", "Queries", path=path) is None
    finally:
        plt.close("all")
    assert path.stat().st_size > 0  # still drawn and saved


@pytest.mark.parametrize(("B", "Lq"), [(0, 3), (2, 0)])
def test_empty_batches_and_query_lengths_through_the_books_multihead(B, Lq):
    mha = d2l.MultiHeadAttention(8, 2, 0.0)
    lens = None if B == 0 else torch.tensor([1, 2])
    out = mha(torch.randn(B, Lq, 8), torch.randn(B, 4, 8), torch.randn(B, 4, 8), lens)
    assert out.shape == (B, Lq, 8)
    assert d2l.transpose_output(d2l.transpose_qkv(torch.randn(B, Lq, 8), 2), 2).shape == (B, Lq, 8)


@pytest.mark.parametrize(
    ("valid_lens", "error", "match"),
    [
        ([3, 2], TypeError, "valid_lens must be a tensor of lengths, got list"),
        (torch.tensor(3), ValueError, r"valid_lens must have shape \(B,\) = \(2,\) or \(B, Lq\) = \(2, 3\), got \(\)"),
        (torch.tensor([3, 2, 1]), ValueError, r"got \(3,\)"),
    ],
)
def test_valid_lens_mistakes_in_the_books_multihead_name_the_argument(valid_lens, error, match):
    mha = d2l.MultiHeadAttention(8, 2, 0.0)  # lazy: a mistake must not make (or draw) its parameters
    with pytest.raises(error, match=match):
        mha(torch.randn(2, 3, 8), torch.randn(2, 4, 8), torch.randn(2, 4, 8), valid_lens)
    assert mha.W_q.has_uninitialized_params()


def test_the_books_layers_deep_copy_after_a_training_step():
    """attention_weights is for looking at: it holds no autograd graph, so copy.deepcopy (EMA, checkpoints) works."""
    x = torch.randn(2, 3, 8)
    for layer in (
        d2l.MultiHeadAttention(8, 2, 0.1),
        d2l.AdditiveAttention(8, 0.1),
        d2l.AdditiveAttention(8, 8, 8, 0.1),
    ):
        layer(x, x, x, torch.tensor([1, 3])).sum().backward()
        copied = copy.deepcopy(layer)
        weights = getattr(layer, "attention", layer).attention_weights
        assert weights.grad_fn is None
        torch.testing.assert_close(getattr(copied, "attention", copied).attention_weights, weights)


# --- mistakes in the functions and constructors are a ValueError/TypeError naming the argument -------------


@pytest.mark.parametrize(
    ("X", "valid_len", "match"),
    [
        (torch.rand(3), torch.tensor([1, 2, 3]), r"X must be \(N, L\) or \(N, L, \.\.\.\), got \(3,\)"),
        (torch.rand(2, 3), torch.tensor([1, 2, 3]), r"valid_len must have shape \(N,\) = \(2,\).*got valid_len \(3,\)"),
        (
            torch.rand(2, 3),
            torch.tensor([[1], [2]]),
            r"valid_len must have shape \(N,\) = \(2,\).*\(2, 1\), X \(2, 3\)",
        ),
        (torch.rand(2, 3), torch.tensor([1, 4]), r"valid_len may be at most the number of keys \(3\), got 4"),
    ],
    ids=["X-1-dim", "valid_len-too-long", "valid_len-2-dim", "valid_len-past-L"],
)
def test_sequence_mask_mistakes_are_a_value_error_naming_the_argument(X, valid_len, match):
    with pytest.raises(ValueError, match=match):
        d2l.sequence_mask(X, valid_len)


@pytest.mark.parametrize("fn", [d2l.transpose_qkv, d2l.transpose_output])
@pytest.mark.parametrize(
    ("num_heads", "error", "match"),
    [
        (0, ValueError, "num_heads must be positive, got 0"),
        (-2, ValueError, "num_heads must be positive, got -2"),
        (2.0, TypeError, "num_heads must be a whole number, got 2.0"),
    ],
)
def test_transpose_num_heads_must_be_a_positive_whole_number(fn, num_heads, error, match):
    with pytest.raises(error, match=match):
        fn(torch.zeros(4, 3, 8), num_heads)


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [
        (lambda: d2l.MultiHeadAttention(10, 0, 0.0), ValueError, "num_heads must be positive, got 0"),
        (lambda: d2l.MultiHeadAttention(10, -2, 0.0), ValueError, "num_heads must be positive, got -2"),
        (lambda: d2l.MultiHeadAttention(0, 2, 0.0), ValueError, "num_hiddens must be positive, got 0"),
        (lambda: d2l.MultiHeadAttention(16.0, 2, 0.0), TypeError, "num_hiddens must be a whole number, got 16.0"),
        (lambda: d2l.MultiHeadAttention(8, 8, -1, 16, 2, 0.0), ValueError, "value_size must be positive, got -1"),
        (lambda: d2l.MultiHeadAttention(8, 2, 1.0), ValueError, r"dropout must be in \[0, 1\), got 1.0"),
        (lambda: d2l.AdditiveAttention(-3, 0.0), ValueError, "num_hiddens must be positive, got -3"),
        (lambda: d2l.AdditiveAttention(0, 0.0), ValueError, "num_hiddens must be positive, got 0"),
        (lambda: d2l.AdditiveAttention(16.0, 0.0), TypeError, "num_hiddens must be a whole number, got 16.0"),
        (lambda: d2l.AdditiveAttention(8, 8, -3, 0.0), ValueError, "num_hiddens must be positive, got -3"),
        (lambda: d2l.AdditiveAttention(0, 8, 8, 0.0), ValueError, "key_size must be positive, got 0"),
        (lambda: d2l.AdditiveAttention(8, -0.1), ValueError, r"dropout must be in \[0, 1\), got -0.1"),
        (lambda: d2l.DotProductAttention(1.5), ValueError, r"dropout must be in \[0, 1\), got 1.5"),
        (lambda: d2l.DotProductAttention("0.1"), TypeError, "dropout must be a number in"),
    ],
)
def test_bad_sizes_and_dropout_are_refused_at_construction_without_drawing(make, error, match):
    before = torch.get_rng_state()
    with pytest.raises(error, match=match):
        make()
    assert torch.equal(torch.get_rng_state(), before)  # refused before any parameter was drawn


def test_out_of_range_valid_lens_in_the_books_multihead_are_reported_as_given():
    """Not in the head-repeated layout (B*H,): the user's (B,) tensor, before any parameter is drawn."""
    mha = d2l.MultiHeadAttention(16, 2, 0.0)
    q, k = torch.randn(2, 3, 8), torch.randn(2, 5, 8)
    with pytest.raises(ValueError, match=r"valid_lens may be at most the number of keys \(5\), got 9 in .*\[1, 9\]"):
        mha(q, k, k, torch.tensor([1, 9]))
    with pytest.raises(ValueError, match=r"valid_lens must not be negative, got -1"):
        mha(q, k, k, torch.tensor([-1, 2]))
    with pytest.raises(ValueError, match=r"valid_lens must hold whole numbers, got 1.5"):
        mha(q, k, k, torch.tensor([1.5, 2.0]))
    assert mha.W_q.has_uninitialized_params()


def test_show_heatmaps_figsize_is_the_whole_figure_as_in_the_book(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    try:
        plt.close("all")
        # the Transformer chapter: 4 x 4 heads, figsize=(7, 3.5)
        d2l.show_heatmaps(
            torch.rand(4, 4, 3, 5), "Keys", "Queries", titles=[f"Head {i}" for i in range(1, 5)], figsize=(7, 3.5)
        )
        assert tuple(plt.gcf().get_size_inches()) == pytest.approx((7.0, 3.5))
        plt.close("all")
        d2l.show_heatmaps(torch.rand(1, 1, 3, 5), "Keys", "Queries")  # the book's default: one 2.5 x 2.5 figure
        assert tuple(plt.gcf().get_size_inches()) == pytest.approx((2.5, 2.5))
    finally:
        plt.close("all")


def test_show_heatmaps_titles_must_have_one_per_column():
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    try:
        with pytest.raises(ValueError, match=r"titles must have one per column, 3 for matrices \(1, 3, 3, 3\), got 1"):
            d2l.show_heatmaps(torch.rand(1, 3, 3, 3), "k", "q", titles=["a"])
    finally:
        plt.close("all")
