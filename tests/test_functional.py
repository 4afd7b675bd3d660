"""attnkit.functional: what the entry points promise whatever backend runs the call."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import d2l, mods
from mathref import attention as math_attention
from mathref import document as math_document
from mathref import max_err

OUT_TOL, GRAD_TOL = 1e-5, 3e-5


def _causal_cases(H: int, L: int):
    """Causal self-attention given four ways; each with the float64 math it means."""
    ids = torch.tensor([[0] * (L // 3) + [1] * (L - L // 3)])
    same_document = math_document(ids)
    yield "is_causal", {"is_causal": True}, None
    yield "mask_mod j <= i", {"mask_mod": lambda b, h, i, j: j <= i}, None
    yield "is_causal and sinks", {"is_causal": True, "sinks": torch.linspace(-1.0, 1.0, H)}, None
    yield "causal packed documents", {"is_causal": True, "mask_mod": mods.document(ids)}, same_document


def _math(q, k, v, scale, kw, mask_mod):
    """The float64 math of a causal call (with a sink logit per head where given)."""
    q64, k64, v64 = (t.double() for t in (q, k, v))
    L = q.shape[2]
    allowed = torch.ones(L, L, dtype=torch.bool).tril()  # (L, L)
    if mask_mod is not None:
        i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
        allowed = allowed & mask_mod(torch.zeros(()).long(), torch.zeros(()).long(), i, j)
    scores = (q64 @ k64.transpose(-1, -2)) * scale  # (B, H, L, L)
    scores = scores.masked_fill(~allowed, float("-inf"))
    sinks = kw.get("sinks")
    if sinks is not None:
        sink = sinks.double().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)  # (B, H, L, 1)
        return (torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]) @ v64
    return math_attention(q64, k64, v64, attn_mask=allowed, scale=scale)[0]


@pytest.mark.parametrize("scale", [0.0, -0.0, -0.5, -3.0])
@pytest.mark.parametrize("L", [8, 64, 300])
def test_a_scale_of_zero_or_below_keeps_a_causal_mask_causal(scale, L):
    """A scale is any finite real: 0 scores every visible key alike, a negative one turns the scores round. PyTorch's
    CPU kernels fill a causal mask's -inf before they scale (-inf * 0 is NaN, -inf * -1 is +inf): every backend that
    can run the call, and auto, agree with the math, with no NaN."""
    B, H, D = 1, 2, 16
    g = torch.Generator().manual_seed(L)
    q, k, v = (torch.randn(B, H, L, D, generator=g) for _ in range(3))
    for name, kw, mask_mod in _causal_cases(H, L):
        truth = _math(q, k, v, scale, kw, mask_mod)
        for backend in ["auto", *attnkit.available_backends("cpu", implementations=True)]:
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            try:
                out = attnkit.scaled_dot_product_attention(*leaves, scale=scale, backend=backend, **kw).output
            except ValueError as error:
                assert backend != "auto" and "cannot run this call" in str(error)
                continue
            where = f"{name}, scale {scale}, L {L}, {backend}"
            assert torch.isfinite(out).all(), where
            assert max_err(out, truth) <= OUT_TOL, where
            if backend not in ("decode",):
                out.sum().backward()
                assert all(torch.isfinite(t.grad).all() for t in leaves), where


@pytest.mark.parametrize("backend", ["aot_eager_decomp_partition", pytest.param("inductor", marks=pytest.mark.slow)])
def test_a_default_scale_compiles_with_dynamic_shapes(backend):
    """Under torch.compile(dynamic=True) the default scale 1/sqrt(D) is a symbolic number: it is used as it is (a
    positive, finite scale from a shape), not read on the host (math.isfinite on it failed, naming nothing): the
    failure was dynamo's tracing, which both backends run; Inductor's lowering of the symbolic scale in make test-all
    (its C++ adds 5 s cold)."""
    torch._dynamo.reset()
    q, k, v = (torch.randn(2, 2, 8, 16) for _ in range(3))

    def call(q, k, v):
        return attnkit.scaled_dot_product_attention(q, k, v, is_causal=True).output

    compiled = torch.compile(call, fullgraph=True, dynamic=True, backend=backend)
    assert max_err(compiled(q, k, v), call(q, k, v)) <= OUT_TOL
    layer = attnkit.DotProductAttention(dropout=0.0)
    compiled_layer = torch.compile(layer, fullgraph=True, dynamic=True, backend=backend)
    assert max_err(compiled_layer(q[:, 0], k[:, 0], v[:, 0]), layer(q[:, 0], k[:, 0], v[:, 0])) <= OUT_TOL
    book = d2l.DotProductAttention(dropout=0.0)
    compiled_book = torch.compile(book, fullgraph=True, dynamic=True, backend=backend)
    assert max_err(compiled_book(q[:, 0], k[:, 0], v[:, 0]), book(q[:, 0], k[:, 0], v[:, 0])) <= OUT_TOL


def test_a_scale_the_dtype_cannot_hold_names_the_argument():
    q = torch.randn(1, 1, 2, 4)
    with pytest.raises(ValueError, match="scale must be finite in float32"):
        attnkit.scaled_dot_product_attention(q, q, q, scale=1e300)
    with pytest.raises(ValueError, match="scale must be finite, got nan"):
        attnkit.scaled_dot_product_attention(q, q, q, scale=float("nan"))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_negative_scale_is_as_accurate_as_its_positive_in_low_precision(dtype):
    """The sign goes into the queries exactly (-q), never as a product q * scale that rounds in 16 bits or
    overflows in float16: scale -0.3 is as near float64 as scale 0.3, and float16 queries of 3e4 with scale -4 are
    finite."""
    g = torch.Generator().manual_seed(16)
    q, k, v = (torch.randn(1, 2, 64, 32, generator=g).mul(4).to(dtype) for _ in range(3))
    for backend in ("auto", "reference"):
        errors = {}
        for scale in (0.3, -0.3):
            out = attnkit.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, backend=backend).output
            errors[scale] = max_err(out, _math(q, k, v, scale, {}, None))
        assert errors[-0.3] <= 1.25 * errors[0.3] + 1e-6, (backend, errors)
    if dtype == torch.float16:
        big = (q.float().sign() * 3e4).to(dtype)
        for backend in ("auto", "reference"):
            out = attnkit.scaled_dot_product_attention(big, k, v, is_causal=True, scale=-4.0, backend=backend).output
            assert max_err(out, _math(big, k, v, -4.0, {}, None)) <= 1e-2, backend


@pytest.mark.parametrize("scale", [-1, 0])
def test_a_whole_number_scale_under_compile_keeps_a_causal_mask_causal(scale):
    """A scale given as an int (or any real that is not a float) is a float by the time it is checked, under
    torch.compile as eagerly: its sign goes into the queries there too (NaN in 126 of 128 rows before)."""
    torch._dynamo.reset()
    q, k, v = (torch.randn(1, 2, 64, 8) for _ in range(3))

    def call(q, k, v):
        return attnkit.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale).output

    out = torch.compile(call, fullgraph=True)(q, k, v)
    assert torch.isfinite(out).all() and max_err(out, _math(q, k, v, float(scale), {}, None)) <= OUT_TOL
