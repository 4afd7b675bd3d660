"""Property-based tests: all backends agree, padding never leaks, no input is ever modified."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit
from attnkit.backends import chunked
from mathref import attention as math_attention
from mathref import max_err

BACKENDS = ("reference", "sdpa", "chunked")


@st.composite
def calls(draw):
    """Random shapes and any combination of valid_lens (1-D or 2-D), bool or float mask, causal."""
    B = draw(st.integers(1, 3))
    Hkv = draw(st.integers(1, 3))
    H = Hkv * draw(st.sampled_from([1, 2, 4]))
    Lq, Lk = draw(st.integers(1, 40)), draw(st.integers(1, 70))
    D, Dv = draw(st.integers(1, 24)), draw(st.integers(1, 24))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(B, H, Lq, D, generator=g), torch.randn(B, Hkv, Lk, D, generator=g)
    v = torch.randn(B, Hkv, Lk, Dv, generator=g)
    kw = {}
    lens_kind = draw(st.sampled_from(["none", "1d", "2d"]))
    if lens_kind == "1d":
        kw["valid_lens"] = torch.randint(0, Lk + 1, (B,), generator=g)
    elif lens_kind == "2d":
        kw["valid_lens"] = torch.randint(0, Lk + 1, (B, Lq), generator=g)
    mask_kind = draw(st.sampled_from(["none", "bool", "float"]))
    if mask_kind != "none":
        shape = draw(st.sampled_from([(Lq, Lk), (B, 1, Lq, Lk), (1, H, 1, Lk), (B, H, Lq, Lk)]))
        if mask_kind == "bool":
            kw["attn_mask"] = torch.rand(shape, generator=g) < draw(st.floats(0.0, 1.0))
        else:
            kw["attn_mask"] = torch.randn(shape, generator=g)
    kw["is_causal"] = draw(st.booleans())
    block = draw(st.integers(1, 80))
    return q, k, v, kw, block


@settings(max_examples=150, deadline=None)
@given(calls())
def test_all_backends_agree_with_the_math(call):
    q, k, v, kw, block = call
    truth, _ = math_attention(q.double(), k.double(), v.double(), **kw)
    for backend in BACKENDS:
        with chunked.settings(block_size=block):
            out, _ = attnkit.scaled_dot_product_attention(q, k, v, backend=backend, **kw)
        assert max_err(out, truth) <= 1e-5, backend


@settings(max_examples=60, deadline=None)
@given(calls())
def test_padding_content_never_leaks(call):
    q, k, v, kw, block = call
    lens = kw.get("valid_lens")
    if lens is None:
        return
    longest = lens if lens.dim() == 1 else lens.amax(dim=1)
    dirty_k, dirty_v = k.clone(), v.clone()
    for b, n in enumerate(longest.tolist()):
        dirty_k[b, :, n:] = float("nan")
        dirty_v[b, :, n:] = float("nan")
    for backend in BACKENDS:
        with chunked.settings(block_size=block):
            clean = attnkit.scaled_dot_product_attention(q, k, v, backend=backend, **kw).output
            dirty = attnkit.scaled_dot_product_attention(q, dirty_k, dirty_v, backend=backend, **kw).output
        assert torch.isfinite(dirty).all(), backend
        torch.testing.assert_close(dirty, clean, rtol=0, atol=0)


def _snapshot(tensors):
    return [(t, t.detach().clone(), t._version) for t in tensors if isinstance(t, torch.Tensor)]


def _assert_untouched(snapshot):
    for t, before, version in snapshot:
        assert t._version == version
        assert torch.equal(t.detach(), before)


@settings(max_examples=40, deadline=None)
@given(calls())
def test_no_input_is_modified(call):
    q, k, v, kw, block = call
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    w_v = torch.randn(q.shape[-1], requires_grad=True)
    snapshot = _snapshot([q, k, v, w_v, *kw.values()])
    for backend in BACKENDS:
        with chunked.settings(block_size=block):
            out = attnkit.scaled_dot_product_attention(q, k, v, backend=backend, **kw).output
            out.sum().backward()
            if backend != "sdpa":
                attnkit.additive_attention(q, k, v, w_v, backend=backend, **kw).output.sum().backward()
    attnkit.scaled_dot_product_attention(q, k, v, need_weights=True, dropout_p=0.3, **kw)
    scores = q @ k.transpose(-1, -2).repeat_interleave(q.shape[1] // k.shape[1], 1)
    scores_snapshot = _snapshot([scores])
    attnkit.masked_softmax(scores, **kw).sum().backward()
    if "valid_lens" in kw:
        attnkit.sequence_mask(kw["valid_lens"], k.shape[2])
    _assert_untouched(snapshot)
    _assert_untouched(scores_snapshot)
