"""torch.compile without graph breaks (issue 26): attnkit's layers are traced whole (``fullgraph=True``), forward
and backward, for every mask, modifier, sinks, grouped-query heads and a static cache's decode step; compiled
equals eager (outputs and gradients, float64); errors are the eager ones; changing lengths under ``dynamic=True``
do not recompile; and the scoped blocks (record_weights, trace, watch) still see compiled calls."""

from __future__ import annotations

import re
from collections.abc import Callable

import pytest
import torch
import torch._dynamo.testing
from torch import nn

import attnkit
from attnkit import d2l, mods

# B batch, L length, E features

B, L, E = 2, 12, 16
TOL = 1e-10  # float64, the same math in another order


def _fresh() -> None:
    torch._dynamo.reset()


def _lens() -> torch.Tensor:
    return torch.tensor([L, 7])


def _table() -> torch.Tensor:
    return torch.randn(2 * L - 1, dtype=torch.float64, requires_grad=True)  # a learned relative-position bias


def cases() -> dict[str, Callable[[], tuple[nn.Module, dict]]]:
    """name -> a model (float64, weights drawn) and the keyword arguments of its call."""

    def mha(**kw: object) -> nn.Module:
        return attnkit.MultiHeadAttention(E, 4, num_kv_heads=2, **kw).double()

    def bias_mask() -> torch.Tensor:
        bias = torch.randn(B, 1, L, L, dtype=torch.float64)
        bias[:, :, :, -3:] = float("-inf")  # hidden keys, and the bias has a gradient
        return bias.requires_grad_()

    table = {}

    def learned(score, b, h, q_idx, kv_idx):
        return score + table["t"][q_idx - kv_idx + L - 1]

    def with_table() -> tuple[nn.Module, dict]:
        table["t"] = _table()
        return mha(), {"score_mod": learned, "is_causal": True}

    return {
        "no mask": lambda: (mha(), {}),
        "is_causal": lambda: (mha(), {"is_causal": True}),
        "valid_lens": lambda: (mha(), {"valid_lens": _lens()}),
        "valid_lens per query": lambda: (mha(), {"valid_lens": torch.randint(0, L + 1, (B, L))}),
        "causal + valid_lens": lambda: (mha(), {"is_causal": True, "valid_lens": _lens()}),
        "bool attn_mask": lambda: (mha(), {"attn_mask": torch.rand(L, L) > 0.3}),
        "float attn_mask with grad": lambda: (mha(), {"attn_mask": bias_mask()}),
        "sliding_window": lambda: (mha(), {"is_causal": True, "mask_mod": mods.sliding_window(4)}),
        "a user mask_mod": lambda: (mha(), {"mask_mod": lambda b, h, q, k: (q - k).abs() < 4}),
        "softcap": lambda: (mha(), {"is_causal": True, "score_mod": mods.softcap(2.0)}),
        "alibi": lambda: (mha(), {"is_causal": True, "score_mod": mods.alibi(mods.alibi_slopes(4).double())}),
        "alibi, learned slopes": lambda: (
            mha(),
            {"is_causal": True, "score_mod": mods.alibi(mods.alibi_slopes(4).double().requires_grad_())},
        ),
        "a learned bias table": with_table,
        "sinks": lambda: (mha(sinks=True), {"valid_lens": _lens()}),
        "additive": lambda: (attnkit.AdditiveAttention(8, query_size=E, key_size=E).double(), {"valid_lens": _lens()}),
        "d2l MultiHeadAttention": lambda: (d2l.MultiHeadAttention(E, 4, 0.0).double(), {"valid_lens": _lens()}),
        "d2l AdditiveAttention": lambda: (d2l.AdditiveAttention(E, E, 8, 0.0).double(), {"valid_lens": _lens()}),
    }


def _call(model: nn.Module, x: torch.Tensor, kw: dict) -> torch.Tensor:
    if isinstance(model, (d2l.MultiHeadAttention, d2l.AdditiveAttention)):
        return model(x, x, x, kw.get("valid_lens"))
    return model(x, x, x, **kw)


def _run(fn: Callable, model: nn.Module, kw: dict, x0: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    x = x0.clone().requires_grad_()
    out = fn(x)
    out.backward(torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out))
    tensors = [x, *model.parameters(), *(t for t in kw.values() if isinstance(t, torch.Tensor) and t.requires_grad)]
    grads = [t.grad.clone() if t.grad is not None else torch.zeros_like(t) for t in tensors]
    for t in tensors:
        t.grad = None
    return out.detach(), grads


# Inductor's code for every case is make test-all's: in a new environment its C++ cache is cold and each case's
# kernels take 5-8 s to build (128 s for the 17 cases against 32 s warm, measured), which make test spends on two:
# a mask_mod and sinks. (The unmasked case goes through the same fused call as the mask_mod's, the graph backend's,
# without a mask tensor; the README's and docs/guide/compile.md's examples, which make test runs as written, compile
# the layer on Inductor with valid_lens.) Every case runs on
# "aot_eager_decomp_partition" in make test: dynamo's whole graph, and AOTAutograd's forward and backward graphs
# with Inductor's decompositions and partitioner, run by torch's eager kernels (what Inductor's lowering then takes
# is torch's).
FAST = "aot_eager_decomp_partition"
# The other compile tests run on FAST in make test and on Inductor in make test-all.
BACKENDS = [FAST, pytest.param("inductor", marks=pytest.mark.slow)]
INDUCTOR_IN_MAKE_TEST = {"sliding_window", "sinks"}


@pytest.mark.parametrize(
    ("name", "backend"),
    [(name, FAST) for name in cases()]
    + [
        pytest.param(name, "inductor", marks=[] if name in INDUCTOR_IN_MAKE_TEST else [pytest.mark.slow])
        for name in cases()
    ],
)
def test_compiles_whole_and_equals_eager(name: str, backend: str) -> None:
    torch.manual_seed(0)
    model, kw = cases()[name]()
    x0 = torch.randn(B, L, E, dtype=torch.float64)
    eager_out, eager_grads = _run(lambda x: _call(model, x, kw), model, kw, x0)
    _fresh()
    # fullgraph=True: a graph break is an error that names its reason (torch._dynamo.explain would trace it again)
    compiled = torch.compile(lambda x: _call(model, x, kw), fullgraph=True, backend=backend)
    out, grads = _run(compiled, model, kw, x0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, eager_out, atol=TOL, rtol=0)
    for got, want in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(got, want, atol=TOL, rtol=0)


def test_no_leak_from_padding_under_compile() -> None:
    """NaN in the keys and values no query may see, in a query that sees no key and in that row's output gradient:
    the output and every gradient stay finite and equal the eager ones."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, 4, L, 8, dtype=torch.float64) for _ in range(3))
    lens = torch.tensor([L, 7])
    k[1, :, 7:], v[1, :, 7:] = float("nan"), float("nan")  # row 1's padding
    causal_lens = torch.tensor([[0] + [L] * (L - 1), [3] * L])  # (B, Lq): row 0's first query sees nothing
    q_nan = q.clone()
    q_nan[0, :, 0] = float("nan")

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        return attnkit.scaled_dot_product_attention(q, k, v, valid_lens=n).output

    _fresh()
    compiled = torch.compile(call, fullgraph=True)
    for n, queries in ((lens, q), (causal_lens, q_nan)):
        results = []
        dead = (n == 0).view(B, 1, -1, 1) if n.dim() == 2 else torch.zeros(B, 1, 1, 1, dtype=torch.bool)
        grad = torch.ones(B, 4, L, 8, dtype=torch.float64).masked_fill(dead, float("nan"))  # (B, H, L, Dv)
        for fn in (call, compiled):
            leaves = [t.clone().requires_grad_() for t in (queries, k, v)]
            out = fn(*leaves, n)
            out.backward(grad)
            results.append([out, *(t.grad for t in leaves)])
        for got, want in zip(*results, strict=True):
            assert torch.isfinite(got).all()
            torch.testing.assert_close(got, want, atol=TOL, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_static_cache_decode_step_compiles_whole(backend: str) -> None:
    torch.manual_seed(0)
    model = attnkit.MultiHeadAttention(E, 4, num_kv_heads=2).double().eval()
    prompt = torch.randn(B, 5, E, dtype=torch.float64)
    lens = torch.tensor([5, 3])
    eager_cache, cache = attnkit.KVCache(max_len=32), attnkit.KVCache(max_len=32)
    with torch.no_grad():
        model(prompt, prompt, prompt, lens, is_causal=True, cache=eager_cache)
        model(prompt, prompt, prompt, lens, is_causal=True, cache=cache)
        _fresh()
        step = torch.compile(lambda x, c: model(x, x, x, is_causal=True, cache=c), fullgraph=True, backend=backend)
        for _ in range(4):
            token = torch.randn(B, 1, E, dtype=torch.float64)
            torch.testing.assert_close(
                step(token, cache), model(token, token, token, is_causal=True, cache=eager_cache)
            )
        torch.testing.assert_close(cache.lengths, eager_cache.lengths)
        # a full static cache is the eager error, raised as the compiled step runs
        full = attnkit.KVCache(max_len=6)
        model(prompt, prompt, prompt, lens, is_causal=True, cache=full)
        step(token, full)
        with pytest.raises(ValueError, match=r"this static cache holds max_len=6 positions per row; a row already"):
            step(token, full)


def _eager_error(fn: Callable, *args: object) -> str:
    with pytest.raises((ValueError, TypeError)) as caught:
        fn(*args)
    return str(caught.value)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "what",
    ["valid_lens too long", "negative valid_lens", "NaN in a float attn_mask", "infinite sinks"],
)
def test_value_errors_are_the_eager_ones(what: str, backend: str) -> None:
    """Checks that read values run inside the compiled code (``attnkit::check_values``): the same error and message,
    under ``fullgraph=True`` too."""
    torch.manual_seed(0)
    model = attnkit.MultiHeadAttention(E, 4, sinks=what == "infinite sinks")
    x = torch.randn(B, L, E)
    kw: dict = {}
    if what == "valid_lens too long":
        kw = {"valid_lens": torch.tensor([L, L + 1])}
    elif what == "negative valid_lens":
        kw = {"valid_lens": torch.tensor([-1, 3])}
    elif what == "NaN in a float attn_mask":
        kw = {"attn_mask": torch.zeros(L, L).index_fill_(1, torch.tensor([2]), float("nan"))}
    else:
        kw = {}
    good = {"valid_lens": torch.tensor([L, 3])} if "valid_lens" in what else {"attn_mask": torch.zeros(L, L)}
    if what == "infinite sinks":
        good = {}
    _fresh()
    compiled = torch.compile(lambda x, kw: model(x, x, x, **kw), fullgraph=True, backend=backend)
    compiled(x, good)  # compiled once on good values
    if what == "infinite sinks":
        with torch.no_grad():
            model.sinks.fill_(float("inf"))
    message = _eager_error(lambda: model(x, x, x, **kw))
    with pytest.raises((ValueError, TypeError)) as caught:
        compiled(x, kw)
    assert str(caught.value) == message


def test_shape_errors_are_the_eager_ones() -> None:
    """A mistake seen while tracing: ``torch.compile`` (the default) raises the eager error itself; under
    ``fullgraph=True`` PyTorch reports any error raised while tracing as its own (``Unsupported``, "Observed
    exception"), with the eager message in it."""
    model = attnkit.MultiHeadAttention(E, 4)
    x = torch.randn(B, L, E)
    bad = torch.tensor([L, 3, 1])  # three lengths for two rows
    message = _eager_error(lambda: model(x, x, x, bad))
    _fresh()
    with pytest.raises(ValueError) as caught:
        torch.compile(lambda x: model(x, x, x, bad))(x)
    assert str(caught.value) == message
    _fresh()
    with pytest.raises(Exception, match=re.escape(message[:60])):
        torch.compile(lambda x: model(x, x, x, bad), fullgraph=True)(x)


def test_dynamic_lengths_compile_once() -> None:
    """``dynamic=True``: one graph for the lengths of a prefill or a training step (PyTorch specialises lengths 0 and
    1, and at most 16 queries per key/value head, a decode step's size, is a graph of its own)."""
    torch.manual_seed(0)
    model = attnkit.MultiHeadAttention(E, 4, num_kv_heads=2, query_size=E, key_size=E, value_size=E)
    counter = torch._dynamo.testing.CompileCounter()
    _fresh()
    compiled = torch.compile(lambda x, n: model(x, x, x, n, is_causal=True), backend=counter, dynamic=True)
    for length in (9, 17, 33, 50):
        x = torch.randn(B, length, E, requires_grad=True)
        n = torch.tensor([length, length - 2])
        out = compiled(x, n)
        out.sum().backward()
        torch.testing.assert_close(out, model(x, x, x, n, is_causal=True), atol=1e-5, rtol=1e-5)
    assert counter.frame_count == 1


def test_record_weights_sees_compiled_calls() -> None:
    """A recording opened around a compiled model records it (dynamo compiles the model again, reading the
    recording's state, while a block is open anywhere), and the model goes back to its one graph after."""
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("attn", attnkit.MultiHeadAttention(E, 4))
    attn = model.attn
    x = torch.randn(B, L, E)
    lens = _lens()
    counter = torch._dynamo.testing.CompileCounter()
    _fresh()
    compiled = torch.compile(lambda x: attn(x, x, x, lens), backend=counter)
    compiled(x)
    with attnkit.record_weights(model) as rec:
        compiled(x)
    torch.testing.assert_close(rec["attn"], _weights(model, x, lens))
    with attnkit.dispatch.watch(implementations=True) as ran:
        compiled(x)
    assert ran == ["graph"]
    frames = counter.frame_count
    compiled(x)  # no block open: the first graph again
    assert counter.frame_count == frames


def _weights(model: nn.Module, x: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    with attnkit.record_weights(model) as rec:
        model.attn(x, x, x, lens)
    return rec["attn"]


def test_named_backend_runs_outside_the_graph() -> None:
    """A backend named explicitly plans from values: it runs as eagerly, outside the graph (a graph break)."""
    torch.manual_seed(0)
    model = attnkit.MultiHeadAttention(E, 4, backend="tiles:online")
    x = torch.randn(B, L, E)
    _fresh()
    explained = torch._dynamo.explain(lambda x: model(x, x, x, _lens()))(x)
    assert explained.graph_break_count >= 1
    with attnkit.dispatch.watch(implementations=True) as ran:
        out = torch.compile(lambda x: model(x, x, x, _lens()))(x)
    assert "tiles:online" in ran
    torch.testing.assert_close(out, model(x, x, x, _lens()))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lengths", [[12, 12, 12], [12, 11, 12], [12, 7, 0], [5, 5, 9]])
def test_custom_ops_pass_opcheck(causal: bool, lengths: list[int]) -> None:
    """``attnkit::attention_by_length`` (its fake shapes and strides, its registered autograd, both of its plans:
    runs of equal lengths, and one masked call) and ``attnkit::check_values``, by PyTorch's own checker."""
    from attnkit._value_checks import _check_values
    from attnkit.backends import graph_ops

    torch.manual_seed(0)
    q = torch.randn(3, 4, 12, 8, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(3, 2, 12, 8, dtype=torch.float64, requires_grad=True) for _ in range(2))
    lens = torch.tensor(lengths)
    torch.library.opcheck(graph_ops._attention, (q, k, v, lens, causal, 0.3))
    torch.library.opcheck(_check_values, (lens, "lengths", "valid_lens", 12, "the number of keys"))
    out = graph_ops.attention(q, k, v, lens, causal, 0.3)
    want = attnkit.scaled_dot_product_attention(q, k, v, valid_lens=lens, is_causal=causal, scale=0.3).output
    torch.testing.assert_close(out, want, atol=TOL, rtol=0)
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    for got, expected in zip(grads, torch.autograd.grad(want.sum(), (q, k, v)), strict=True):
        torch.testing.assert_close(got, expected, atol=TOL, rtol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_static_cache_chunks_of_any_size_compile_whole(backend: str) -> None:
    """The room check takes the call's new positions as a tensor: a symbolic size under ``dynamic=True``."""
    torch.manual_seed(0)
    model = attnkit.MultiHeadAttention(E, 4, query_size=E, key_size=E, value_size=E).double().eval()
    eager_cache, cache = attnkit.KVCache(max_len=40), attnkit.KVCache(max_len=40)
    _fresh()
    step = torch.compile(
        lambda x, c: model(x, x, x, is_causal=True, cache=c), fullgraph=True, dynamic=True, backend=backend
    )
    with torch.no_grad():
        for chunk in (5, 3, 4):
            x = torch.randn(B, chunk, E, dtype=torch.float64)
            torch.testing.assert_close(step(x, cache), model(x, x, x, is_causal=True, cache=eager_cache))


def test_huge_float_mask_under_compile_is_shifted_as_eagerly() -> None:
    """A float mask's range is unknown while tracing: every row is shifted and clamped, as eagerly past 16."""
    torch.manual_seed(0)
    scores = torch.randn(1, 2, 4, dtype=torch.float64)
    bias = torch.tensor([[0.0, 0.0, -1e300, -1e300], [-1e300] * 4], dtype=torch.float64)

    def softmax(s: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return attnkit.masked_softmax(s, attn_mask=b)

    _fresh()
    got = torch.compile(softmax, fullgraph=True)(scores, bias)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, softmax(scores, bias), atol=TOL, rtol=0)
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 5, 8)
    big = torch.randn(4, 5) * 1e6

    def weights(q: torch.Tensor, k: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return attnkit.functional.attention_weights(q, k, attn_mask=b)

    torch.testing.assert_close(torch.compile(weights)(q, k, big), weights(q, k, big))


def test_lengths_given_with_zeros_past_are_still_checked() -> None:
    """Only a KVCache's own lengths skip the check: ``zeros_past`` from a caller does not vouch for them."""
    q, k = torch.randn(2, 1, 8), torch.randn(2, 5, 8)
    with pytest.raises(ValueError, match="valid_lens must not be negative"):
        d2l.DotProductAttention(0.0)(q, k, k, torch.tensor([-1, 3]), zeros_past=torch.tensor([5, 5]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_modifiers_made_inside_the_compiled_function(backend: str) -> None:
    """A mask_mod and a score_mod written inside the compiled code (a learned bias read from ``self``): whole."""
    torch.manual_seed(0)

    class Biased(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = attnkit.MultiHeadAttention(E, 4, query_size=E, key_size=E, value_size=E).double()
            self.table = nn.Parameter(torch.randn(2 * L - 1, dtype=torch.float64))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            def bias(score, b, h, q_idx, kv_idx):
                return score + self.table[q_idx - kv_idx + L - 1]

            return self.attn(x, x, x, mask_mod=lambda b, h, q, k: (q - k).abs() < 4, score_mod=bias)

    model = Biased()
    x0 = torch.randn(B, L, E, dtype=torch.float64)
    eager_out, eager_grads = _run(model, model, {}, x0)
    _fresh()
    out, grads = _run(torch.compile(model, fullgraph=True, backend=backend), model, {}, x0)
    torch.testing.assert_close(out, eager_out, atol=TOL, rtol=0)
    for got, want in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(got, want, atol=TOL, rtol=0)


def test_book_layer_with_a_cache_compiles_whole() -> None:
    torch.manual_seed(0)
    book = d2l.MultiHeadAttention(E, 4, 0.0).double().eval()
    prompt, lens = torch.randn(B, 5, E, dtype=torch.float64), torch.tensor([5, 3])
    eager_cache, cache = attnkit.KVCache(max_len=16), attnkit.KVCache(max_len=16)
    with torch.no_grad():
        book(prompt, prompt, prompt, lens, cache=eager_cache)
        book(prompt, prompt, prompt, lens, cache=cache)
        _fresh()
        step = torch.compile(lambda x, c: book(x, x, x, None, cache=c), fullgraph=True)
        for _ in range(3):
            token = torch.randn(B, 1, E, dtype=torch.float64)
            torch.testing.assert_close(step(token, cache), book(token, token, token, None, cache=eager_cache))


def test_float_mask_lengths_compile_once() -> None:
    torch.manual_seed(0)
    model = attnkit.MultiHeadAttention(E, 4, query_size=E, key_size=E, value_size=E)
    counter = torch._dynamo.testing.CompileCounter()
    _fresh()
    compiled = torch.compile(lambda x, m: model(x, x, x, attn_mask=m), backend=counter, dynamic=True)
    for length in (17, 33, 50):  # (past a decode step's 16 queries per key/value head)
        x, bias = torch.randn(B, length, E), torch.randn(length, length)
        torch.testing.assert_close(compiled(x, bias), model(x, x, x, attn_mask=bias), atol=1e-5, rtol=1e-5)
    assert counter.frame_count == 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_trace_after_a_recording_sees_every_step(backend: str) -> None:
    """A graph compiled while a recording was open is not reused by a trace (dynamo guards on the kinds open)."""
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("attn", attnkit.MultiHeadAttention(E, 4, query_size=E, key_size=E, value_size=E))
    x = torch.randn(B, L, E)
    compiled = torch.compile(lambda x: model.attn(x, x, x), backend=backend)
    _fresh()
    compiled(x)
    with attnkit.record_weights(model):
        compiled(x)
    with attnkit.trace.trace_shapes(model) as eager_trace:
        model.attn(x, x, x)
    with attnkit.trace.trace_shapes(model) as traced:
        compiled(x)
    assert [(s.module, s.step) for s in traced.steps] == [(s.module, s.step) for s in eager_trace.steps]


@pytest.mark.parametrize(("batch", "queries"), [(0, 12), (2, 0), (0, 0)])
def test_empty_shapes_compile_whole(batch: int, queries: int) -> None:
    """No example or no query: the eager shapes, compiled whole (sizes named, never -1, in the graph backend)."""
    q = torch.randn(batch, 4, queries, 8, dtype=torch.float64)
    k, v = torch.randn(batch, 2, 12, 8, dtype=torch.float64), torch.randn(batch, 2, 12, 8, dtype=torch.float64)
    lens = torch.full((batch,), 7)

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
        return attnkit.scaled_dot_product_attention(q, k, v, valid_lens=n, score_mod=mods.softcap(2.0)).output

    _fresh()
    got = torch.compile(call, fullgraph=True)(q, k, v, lens)
    assert got.shape == call(q, k, v, lens).shape == (batch, 4, queries, 8)
    out = attnkit.scaled_dot_product_attention(q, k, v, valid_lens=lens, backend="graph").output
    assert out.shape == (batch, 4, queries, 8)
