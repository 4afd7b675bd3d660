"""Property-based tests: all backends agree, padding never leaks, no input is ever modified."""

from __future__ import annotations

import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import attnkit
from attnkit import csrc
from attnkit.backends import decode
from attnkit.backends.decode import positions_last
from attnkit.backends.tiles import online
from mathref import allowed_mask, max_err
from mathref import attention as math_attention

BACKENDS = ("reference", "sdpa", "tiles:online")
# and, in the tests of every backend, attnkit's own C++ kernel where it builds here (float32 calls)
NATIVE = ("tiles:kernel",) if csrc.ensure("flash") is None else ()


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
    mask_kind = draw(st.sampled_from(["none", "bool", "float", "float_-inf", "float_offset"]))
    if mask_kind != "none":
        shape = draw(st.sampled_from([(Lq, Lk), (B, 1, Lq, Lk), (1, H, 1, Lk), (B, H, Lq, Lk)]))
        if mask_kind == "bool":
            kw["attn_mask"] = torch.rand(shape, generator=g) < draw(st.floats(0.0, 1.0))
        else:
            kw["attn_mask"] = torch.randn(shape, generator=g)
        if mask_kind == "float_offset":  # large biases, shifted per row before the scores are added
            kw["attn_mask"] = kw["attn_mask"] + draw(st.sampled_from([-1e4, 1e4, 3e4]))
        if mask_kind == "float_-inf":  # -inf where a query may not attend
            hidden = torch.rand(shape, generator=g) < draw(st.floats(0.0, 1.0))
            kw["attn_mask"] = kw["attn_mask"].masked_fill(hidden, float("-inf"))
    kw["is_causal"] = draw(st.booleans())
    # the keys' and values' memory: (B, Hkv, L, D), or positions last (a long KVCache's; few queries then run
    # sdpa's decode step)
    layout = draw(st.sampled_from([torch.Tensor.contiguous, positions_last]))
    block = draw(st.integers(1, 80))
    return q, layout(k), layout(v), kw, block, layout


@settings(max_examples=150, deadline=None)
@given(calls())
def test_all_backends_agree_with_the_math(call):
    q, k, v, kw, block, _ = call
    truth, _ = math_attention(q.double(), k.double(), v.double(), **kw)
    for backend in (*BACKENDS, *NATIVE, "decode") if _a_decode_step(q, k) else (*BACKENDS, *NATIVE):
        with online.settings(block_size=block):
            out, _ = attnkit.scaled_dot_product_attention(q, k, v, backend=backend, **kw)
        assert max_err(out, truth) <= 1e-5, backend


def _a_decode_step(q, k):
    """Whether the decode backend runs this call (without autograd): few enough queries per key/value head."""
    return q.shape[1] // k.shape[1] * q.shape[2] <= decode.FEW_QUERIES


def _dead_positions(q, k, kw):
    """Keys (per key/value head) that no query may see, and query rows that may see no key, under all the mask
    parts together, from the definitions in mathref: ``(B, Hkv, Lk)`` and ``(B, H, Lq)`` bool."""
    B, H, Lq, _ = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    allowed = allowed_mask(B, H, Lq, Lk, **kw)  # (B, H, Lq, Lk)
    dead_keys = ~allowed.any(dim=2).unflatten(1, (Hkv, H // Hkv)).any(dim=2)  # (B, Hkv, Lk)
    dead_rows = ~allowed.any(dim=3)  # (B, H, Lq)
    return dead_keys, dead_rows


def _poisoned(q, k, v, dead_keys, dead_rows, layout):
    nan = float("nan")
    k2, v2 = (layout(t.masked_fill(dead_keys[..., None], nan)) for t in (k, v))  # in the layout drawn
    return q.masked_fill(dead_rows[..., None], nan), k2, v2


def _forward_backward(fn, tensors, grad_out):
    leaves = [t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*leaves)
    grads = torch.autograd.grad(out, leaves, grad_out)
    return out, grads


@settings(max_examples=150, deadline=None)
@given(calls(), st.booleans())
def test_nan_where_no_query_may_see_never_leaks(call, additive):
    """NaN in every key and value no query may see, in every query that may see no key and in its output's
    gradient, under any combination of valid_lens, boolean or float (-inf) mask and causal: outputs, weights and all
    gradients stay finite, equal those of clean inputs exactly, and the poisoned positions get zero gradients, in
    every backend."""
    q, k, v, kw, block, layout = call
    dead_keys, dead_rows = _dead_positions(q, k, kw)
    assume(bool(dead_keys.any() or dead_rows.any()))
    dirty = _poisoned(q, k, v, dead_keys, dead_rows, layout)
    grad_out = torch.randn(*q.shape[:3], v.shape[-1])
    dirty_grad_out = grad_out.masked_fill(dead_rows[..., None], float("nan"))  # (B, H, Lq, Dv)
    w_v = torch.randn(q.shape[-1])
    for backend in ("reference", "tiles:online") if additive else (*BACKENDS, *NATIVE):

        def fn(q_, k_, v_, backend=backend):
            if additive:
                return attnkit.additive_attention(q_, k_, v_, w_v, backend=backend, **kw).output
            return attnkit.scaled_dot_product_attention(q_, k_, v_, backend=backend, **kw).output

        with online.settings(block_size=block, additive_block_bytes=4 * block * q.numel()):
            clean_out, clean_grads = _forward_backward(fn, (q, k, v), grad_out)
            out, grads = _forward_backward(fn, dirty, dirty_grad_out)
        where = f"{backend}, additive={additive}"
        assert torch.isfinite(out).all(), where
        torch.testing.assert_close(out, clean_out, rtol=0, atol=0, msg=where)
        for name, grad, clean, dead in zip("qkv", grads, clean_grads, (dead_rows, dead_keys, dead_keys), strict=True):
            assert torch.isfinite(grad).all(), f"d{name}: {where}"
            torch.testing.assert_close(grad, clean, rtol=0, atol=0, msg=f"d{name}: {where}")
            assert not grad.masked_select(dead[..., None]).any(), f"d{name} at poisoned positions: {where}"
        with torch.no_grad():  # inference: the paths that run without autograd (the decode backend's, with auto)
            clean_out, out = fn(q, k, v), fn(*dirty)
        assert torch.isfinite(out).all(), f"{where}, no grad"
        torch.testing.assert_close(out, clean_out, rtol=0, atol=0, msg=f"{where}, no grad")
    if not additive and _a_decode_step(q, k):
        with torch.no_grad():
            clean_out = attnkit.scaled_dot_product_attention(q, k, v, backend="decode", **kw).output
            out = attnkit.scaled_dot_product_attention(*dirty, backend="decode", **kw).output
        assert torch.isfinite(out).all(), "decode"
        torch.testing.assert_close(out, clean_out, rtol=0, atol=0, msg="decode")
    weights = attnkit.scaled_dot_product_attention(*dirty, need_weights=True, **kw).weights
    assert weights is not None and torch.isfinite(weights).all()
    assert not weights.masked_select(dead_rows[..., None]).any()  # rows with no key: zero weights


def _with_minus_infinity(q, k, keys, d=0):
    """``q`` and ``k`` where every query's scores of the keys ``keys`` (bool, ``(B, Hkv, Lk)``) are ``-inf``: those
    keys hold ``-inf`` in dimension ``d``, every query a positive number there (a key infinite in its data)."""
    q, k = q.clone(), k.clone()
    q[..., d] = q[..., d].abs() + 0.5
    k[..., d] = k[..., d].masked_fill(keys, float("-inf"))
    return q, k


@settings(max_examples=100, deadline=None)
@given(calls(), st.floats(0.0, 1.0), st.integers(0, 2**31 - 1))
def test_a_score_of_minus_infinity_hides_its_key_in_every_backend(call, share, seed):
    """A key whose score is -inf (an infinite input, not a mask) weighs 0 in every backend and in the weights, as a
    mask would hide it: a row that sees only such keys gives zeros (a tester's finding: the reference and decode
    backends put its weight on keys it may not see, the chunked one on the -inf keys)."""
    q, k, v, kw, block, layout = call
    g = torch.Generator().manual_seed(seed)
    q, k = _with_minus_infinity(q, k.contiguous(), torch.rand(k.shape[:3], generator=g) < share)
    k = layout(k)
    truth, truth_w = math_attention(q.double(), k.double(), v.double(), **kw)
    assert torch.isfinite(truth).all()
    _every_backend_agrees(q, k, v, kw, block, truth, truth_w)


def test_a_product_that_overflows_before_the_scale_never_puts_weight_on_hidden_keys():
    """q . k of -4e38 is -inf in float32 before the default scale (1/8) brings it back in range (-5e37). A backend
    that takes the product first hides the key; one that scales first (PyTorch's kernel, decode) sees it: either is
    an answer of the arithmetic, but no backend may put causal row 0's weight on the keys it may not see (a
    reviewer's finding: the reference's bound was on the scaled score, and it did)."""
    q, k = torch.full((1, 2, 6, 64), 2.5e18), torch.randn(1, 2, 6, 64)
    k[:, :, 0] = -2.5e18
    v = torch.randn(1, 2, 6, 3)
    truth, _ = math_attention(q.double(), k.double(), v.double(), is_causal=True)  # float64: no overflow
    for backend in (*BACKENDS, "graph", "decode", *NATIVE):
        with torch.no_grad():
            out = attnkit.scaled_dot_product_attention(q, k, v, is_causal=True, backend=backend).output
        assert max_err(out[:, :, 1:], truth[:, :, 1:]) <= 1e-5, backend
        row = out[:, :, 0]  # (1, 2, 3): v[0] (seen) or 0 (hidden), nothing else
        assert max_err(row, v[:, :, 0]) <= 1e-6 or not row.any(), (backend, row)
    weights = attnkit.scaled_dot_product_attention(q, k, v, is_causal=True, need_weights=True).weights
    assert not weights[:, :, 0, 1:].any()


def _every_backend_agrees(q, k, v, kw, block, truth, truth_w):
    ran = []
    for backend in (*BACKENDS, "graph", "decode", *NATIVE):
        if backend == "decode" and not _a_decode_step(q, k):
            continue
        try:
            with online.settings(block_size=block), torch.no_grad():
                out, _ = attnkit.scaled_dot_product_attention(q, k, v, backend=backend, **kw)
        except ValueError as refused:  # sdpa and graph add the mask as -inf: they refuse what may overflow
            assert "overflow" in str(refused), (backend, str(refused))
            continue
        assert max_err(out, truth) <= 1e-5, backend
        ran.append(backend)
    assert {"reference", "tiles:online"} <= set(ran)
    weights = attnkit.scaled_dot_product_attention(q, k, v, need_weights=True, **kw).weights
    assert max_err(weights, truth_w) <= 1e-5


@settings(max_examples=60, deadline=None)
@given(calls(), st.integers(0, 2**31 - 1))
def test_a_query_that_holds_nan_gives_its_row_nan_in_every_backend(call, seed):
    """NaN in a query that sees some key makes its row of the output NaN, as in the math, and no other row; the
    weights are NaN where it may see and 0 where it may not (a tester's finding: PyTorch's CPU kernel gives such a
    row zeros, a result that hides where the input went wrong)."""
    q, k, v, kw, block, _ = call
    _, dead_rows = _dead_positions(q, k, kw)
    live = (~dead_rows).nonzero()
    assume(len(live) > 0)
    b, h, i = live[torch.randint(len(live), (1,), generator=torch.Generator().manual_seed(seed))].squeeze(0).tolist()
    q = q.clone()
    q[b, h, i, 0] = float("nan")
    truth, _ = math_attention(q.double(), k.double(), v.double(), **kw)
    bad = torch.zeros(q.shape[:3], dtype=torch.bool)
    bad[b, h, i] = True
    for backend in (*BACKENDS, "graph", "decode", *NATIVE):
        if backend == "decode" and not _a_decode_step(q, k):
            continue
        with online.settings(block_size=block), torch.no_grad():
            out, _ = attnkit.scaled_dot_product_attention(q, k, v, backend=backend, **kw)
        assert out[b, h, i].isnan().all(), backend
        assert max_err(out[~bad], truth[~bad]) <= 1e-5, backend
    weights = attnkit.scaled_dot_product_attention(q, k, v, need_weights=True, **kw).weights
    allowed = allowed_mask(*q.shape[:3], k.shape[2], **kw)[b, h, i]  # (Lk,)
    assert weights[b, h, i][allowed].isnan().all() and not weights[b, h, i][~allowed].any()


def _snapshot(tensors):
    return [(t, t.detach().clone(), t._version) for t in tensors if isinstance(t, torch.Tensor)]


def _assert_untouched(snapshot):
    for t, before, version in snapshot:
        assert t._version == version
        assert torch.equal(t.detach(), before)


@settings(max_examples=40, deadline=None)
@given(calls())
def test_no_input_is_modified(call):
    q, k, v, kw, block, _ = call
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    w_v = torch.randn(q.shape[-1], requires_grad=True)
    snapshot = _snapshot([q, k, v, w_v, *kw.values()])
    for backend in BACKENDS:
        with online.settings(block_size=block):
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
