"""The triton backend (additive attention as Triton kernels) against the float64 math of tests/mathref.py.

Without a GPU its kernels run in Triton's interpreter on CPU tensors: the root conftest.py sets ``TRITON_INTERPRET=1``
before triton is first imported, and ``interpreted`` lets the backend take CPU calls, with tiles of 16 x 16 keys and
4 features so that small calls have several query and key blocks, partial ones and padded features (D=7). On CUDA
the ``gpu`` tests run the compiled kernels at the default tiles, against the math and against ``chunked``.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

import attnkit
import mathref
from attnkit import dispatch, mods
from attnkit.backends import triton as triton_backend
from mathref import max_err

if os.environ.get("CI"):  # CI installs the triton extra: missing there is a failure, not a skip
    import triton  # noqa: F401
else:
    pytest.importorskip("triton")

# B batch, H heads, Hkv key/value heads, Lq/Lk query/key length, D features (h), Dv value head dim
B, H, HKV, D, DV = 2, 4, 2, 7, 20  # Dv > 16: two blocks of value columns' padding
SMALL = {"BM": 16, "BN": 16, "BD": 4}
INTERPRETED = pytest.mark.skipif(
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") != "1",
    reason="the interpreter runs where no GPU is (a GPU runs the compiled kernels: the gpu tests)",
)


def _take_cpu_calls(mp: pytest.MonkeyPatch) -> None:
    """The backend takes CPU calls, run in Triton's interpreter with small tiles."""
    mp.setattr(triton_backend, "SUPPORTS", dataclasses.replace(triton_backend.SUPPORTS, devices=None))
    mp.setattr(triton_backend, "BLOCKS", SMALL)


@pytest.fixture
def interpreted(monkeypatch):
    _take_cpu_calls(monkeypatch)


def _inputs(seed: int, Lq: int, Lk: int, dtype=torch.float64, heads: int = H, kv_heads: int = HKV):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, heads, Lq, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, kv_heads, Lk, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, kv_heads, Lk, DV, generator=g, dtype=torch.float64)
    w_v = torch.randn(D, generator=g, dtype=torch.float64)
    return [t.to(dtype).requires_grad_() for t in (q, k, v, w_v)], g


def _masks(kind: str, Lq: int, Lk: int, g: torch.Generator) -> dict:
    kw: dict = {"is_causal": "causal" in kind}
    if "lens (B,)" in kind:
        kw["valid_lens"] = torch.tensor([0, max(1, Lk // 2)])  # an example that sees nothing
    elif "lens (B, Lq)" in kind:
        kw["valid_lens"] = torch.randint(0, Lk + 1, (B, Lq), generator=g)
    return kw


KINDS = ["none", "causal", "lens (B,)", "lens (B, Lq)", "causal, lens (B,)", "causal, lens (B, Lq)"]


@INTERPRETED
@hypothesis_settings(max_examples=8, deadline=None)
@given(
    case=st.fixed_dictionaries(
        {
            "Lq": st.sampled_from([1, 9, 21, 33]),
            "Lk": st.sampled_from([1, 13, 21, 40]),
            "kind": st.sampled_from(KINDS),
            "group": st.sampled_from([1, 2, 4]),  # H / Hkv
            "seed": st.integers(0, 2**16),
        }
    )
)
def test_triton_equals_the_math_outputs_and_every_gradient(case):
    with pytest.MonkeyPatch.context() as mp:  # (hypothesis runs a function-scoped fixture once for all examples)
        _take_cpu_calls(mp)
        Lq, Lk = case["Lq"], case["Lk"]
        leaves, g = _inputs(case["seed"], Lq, Lk, kv_heads=H // case["group"])
        kw = _masks(case["kind"], Lq, Lk, g)
        with dispatch.watch() as ran:
            out = attnkit.additive_attention(*leaves, backend="triton", **kw).output
        assert ran == ["triton"]
        q, k, v, w_v = leaves
        want, _ = mathref.attention(q, k, v, w_v=w_v, **kw)
        mathref.assert_agrees(out, want, leaves, ["q", "k", "v", "w_v"], 1e-12, 1e-11)


@INTERPRETED
@pytest.mark.parametrize("kind", KINDS)
def test_every_mask_kind_with_grouped_heads(interpreted, kind):
    """Each masking once with fixed sizes: 2 query blocks over 3 key blocks, the last of each partial."""
    leaves, g = _inputs(len(kind), 21, 40)
    kw = _masks(kind, 21, 40, g)
    out = attnkit.additive_attention(*leaves, backend="triton", **kw).output
    want, _ = mathref.attention(*leaves[:3], w_v=leaves[3], **kw)
    mathref.assert_agrees(out, want, leaves, ["q", "k", "v", "w_v"], 1e-12, 1e-11)


@INTERPRETED
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_low_precision_error_at_most_twice_the_math_in_that_precision(interpreted, dtype):
    """Output and every gradient against float64 from the same inputs: at most twice the error of the math computed
    in that precision (flash-attention's rule), plus one rounding of the result to the dtype (sums run in float32:
    w_v's gradient sums B x H x Lq x Lk terms, and only its last rounding is the dtype's)."""
    leaves, g = _inputs(3, 21, 40, dtype=dtype)
    kw = _masks("causal, lens (B, Lq)", 21, 40, g)
    grad_out = torch.randn(B, H, 21, DV, generator=g).to(dtype)
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    truth, _ = mathref.attention(*leaves64[:3], w_v=leaves64[3], **kw)
    true_grads = torch.autograd.grad(truth, leaves64, grad_out.double())
    low_leaves = [t.detach().clone().requires_grad_() for t in leaves]
    low, _ = mathref.attention(*low_leaves[:3], w_v=low_leaves[3], dtype=dtype, **kw)
    low_grads = torch.autograd.grad(low, low_leaves, grad_out)
    out = attnkit.additive_attention(*leaves, backend="triton", **kw).output
    grads = torch.autograd.grad(out, leaves, grad_out)
    assert out.dtype == dtype and all(gr.dtype == dtype for gr in grads)
    eps = torch.finfo(dtype).eps
    named = zip(["out", "dq", "dk", "dv", "dw_v"], (out, *grads), (low, *low_grads), (truth, *true_grads), strict=True)
    for name, got, in_dtype, true in named:
        limit = 2 * max_err(in_dtype, true) + eps * max(1.0, true.abs().max().item())
        assert max_err(got, true) <= limit, name


@INTERPRETED
def test_nan_where_no_query_may_see_reaches_nothing(interpreted):
    leaves, _ = _inputs(5, 9, 21)
    q, k, v, w_v = leaves
    lens = torch.tensor([4, 21])

    def run(k2, v2):
        k2, v2 = k2.detach().requires_grad_(), v2.detach().requires_grad_()
        out = attnkit.additive_attention(q, k2, v2, w_v, valid_lens=lens, backend="triton").output
        return [out, *torch.autograd.grad(out.sum(), [q, k2, v2, w_v])]

    unseen = [(0, slice(None), slice(4, None))]  # example 0's keys and values past its length
    mathref.assert_unseen_nan_reaches_nothing(run, k, v, unseen, ["out", "dq", "dk", "dv", "dw_v"], tol=1e-12)


@INTERPRETED
def test_rows_that_see_no_key_give_zeros_and_no_gradient(interpreted):
    """Causal with more queries than keys (bottom right: the first Lq - Lk rows see nothing), and a length of 0."""
    leaves, _ = _inputs(7, 21, 5)
    out = attnkit.additive_attention(*leaves, is_causal=True, valid_lens=torch.tensor([0, 5]), backend="triton")
    assert torch.equal(out.output[0], torch.zeros_like(out.output[0]))
    assert torch.equal(out.output[1, :, :16], torch.zeros_like(out.output[1, :, :16]))
    dq = torch.autograd.grad(out.output.sum(), leaves[0])[0]
    assert torch.equal(dq[0], torch.zeros_like(dq[0])) and torch.isfinite(dq).all()


@INTERPRETED
def test_empty_calls(interpreted):
    leaves, _ = _inputs(0, 0, 4)
    out = attnkit.additive_attention(*leaves, backend="triton").output
    assert out.shape == (B, H, 0, DV)
    grads = torch.autograd.grad(out.sum(), leaves, allow_unused=True)
    assert all(gr is None or not gr.any() for gr in grads)


@INTERPRETED
def test_the_book_layer_and_three_dim_inputs_run_on_it(interpreted):
    """``(B, L, D)`` inputs (no head axis) and the book's AdditiveAttention layer, as users call them."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, 6, generator=g, dtype=torch.float64) for n in (5, 11, 11))
    w_v = torch.randn(6, generator=g, dtype=torch.float64)
    lens = torch.tensor([3, 11])
    out = attnkit.additive_attention(q, k, v, w_v, valid_lens=lens, backend="triton").output
    want, _ = mathref.attention(q, k, v, w_v=w_v, valid_lens=lens)
    assert out.shape == (2, 5, 6) and max_err(out, want) <= 1e-12


def test_what_it_refuses_each_by_name():
    q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 5, 4), torch.randn(1, 2, 5, 4)
    w_v = torch.randn(4)
    refused = {
        "attn_mask": ({"attn_mask": torch.ones(3, 5, dtype=torch.bool)}, "no attn_mask"),
        "mask_mod": ({"mask_mod": mods.sliding_window(2)}, "no mask_mod"),
        "score_mod": ({"score_mod": mods.softcap(5.0)}, "no score_mod"),
        "sinks": ({"sinks": torch.zeros(2)}, "no sinks"),
        "weights": ({"need_weights": True}, "never returns weights"),
        "dropout": ({"dropout_p": 0.5}, "no dropout"),
    }
    for name, (kw, reason) in refused.items():
        with pytest.raises(ValueError, match=reason):
            attnkit.additive_attention(q, k, v, w_v, backend="triton", **kw)
        assert name
    with pytest.raises(ValueError, match=r"triton: .*additive scoring only"):
        attnkit.scaled_dot_product_attention(q, k, v, backend="triton")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"triton: runs on cuda only"):
            attnkit.additive_attention(q, k, v, w_v, backend="triton")


def test_auto_does_not_choose_it_until_measured_on_a_gpu():
    """Issue 28: its speed against chunked is measured on a GPU first; until then auto never picks it (additive
    calls small and large: the policy for additive scoring does not depend on the device)."""
    for L, D_ in ((5, 4), (300, 64)):
        q, k, v = torch.randn(1, 2, L, D_), torch.randn(1, 2, L, D_), torch.randn(1, 2, L, D_)
        assert "triton" not in dispatch._preferences(_call(q, k, v, torch.randn(D_))), L


def _call(q, k, v, w_v):
    from attnkit.backends.contract import Call
    from attnkit.masks import Mask

    mask = Mask.build(batch=q.shape[0], heads=q.shape[1], num_queries=q.shape[2], num_keys=k.shape[2])
    return Call(q, k, v, mask, w_v=w_v)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["none", "causal, lens (B, Lq)"])
def test_on_cuda_equals_the_math_within_the_dtype(dtype, kind):
    """The compiled kernels at the default tiles, head size 64, several blocks each way."""
    g = torch.Generator().manual_seed(1)
    Lq, Lk = 200, 333
    q64, k64, v64 = (
        torch.randn(B, h, n, 64, generator=g, dtype=torch.float64) for h, n in ((H, Lq), (HKV, Lk), (HKV, Lk))
    )
    w64 = torch.randn(64, generator=g, dtype=torch.float64) / 8
    kw = _masks(kind, Lq, Lk, g)
    leaves = [t.to(dtype).cuda().requires_grad_() for t in (q64, k64, v64, w64)]
    kw_cuda = {name: value.cuda() if isinstance(value, torch.Tensor) else value for name, value in kw.items()}
    out = attnkit.additive_attention(*leaves, backend="triton", **kw_cuda).output
    grad_out = torch.randn(out.shape, generator=g).to(dtype)
    grads = torch.autograd.grad(out, leaves, grad_out.cuda())
    leaves64 = [t.detach().cpu().double().requires_grad_() for t in leaves]
    truth, _ = mathref.attention(*leaves64[:3], w_v=leaves64[3], **kw)
    true_grads = torch.autograd.grad(truth, leaves64, grad_out.double())
    low_leaves = [t.detach().cpu().requires_grad_() for t in leaves]
    low, _ = mathref.attention(*low_leaves[:3], w_v=low_leaves[3], dtype=dtype, **kw)
    low_grads = torch.autograd.grad(low, low_leaves, grad_out)
    eps = torch.finfo(dtype).eps
    named = zip(["out", "dq", "dk", "dv", "dw_v"], (out, *grads), (low, *low_grads), (truth, *true_grads), strict=True)
    for name, got, in_dtype, true in named:
        limit = 2 * max_err(in_dtype, true) + eps * max(1.0, true.abs().max().item())
        assert max_err(got.cpu(), true) <= limit, name
