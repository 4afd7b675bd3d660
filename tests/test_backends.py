"""Every backend against the float64 math of tests/mathref.py, over awkward sizes and every masking."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import dispatch
from attnkit.backends.tiles import online
from cases import MASKINGS, SHAPES, make_inputs, make_masking
from mathref import attention as math_attention
from mathref import max_err

BACKENDS = ("reference", "sdpa", "tiles:online")

# float32: the output within 1e-5 of float64. Gradients sum up to Lq * H/Hkv terms (904 here), so their
# float32 error is measured against their size: 3e-5 * max(1, max|grad|). The chunked backward's dk, where the
# truth is 0 (Lk = 1), is the worst case seen: 1.6e-5.
OUT_TOL = 1e-5
GRAD_TOL = 3e-5


def _run(backend, q, k, v, kw, grad_out=None, block_size=64):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    with online.settings(block_size=block_size):  # several blocks and a partial last one at Lk=203, 257
        out, _ = attnkit.scaled_dot_product_attention(q, k, v, backend=backend, **kw)
    if grad_out is None:
        return out, None
    grads = torch.autograd.grad(out, (q, k, v), grad_out.to(out.dtype))
    return out, grads


@pytest.mark.parametrize(("Lq", "Lk", "D", "group"), SHAPES)
def test_float32_matches_float64_math(Lq, Lk, D, group):
    for index, masking in enumerate(MASKINGS):
        q, k, v, g = make_inputs(Lq, Lk, D, group, seed=1000 * index + Lq + Lk + D + group)
        kw = make_masking(masking, Lq, Lk, g)
        q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
        truth, _ = math_attention(q64, k64, v64, **kw)
        grad_out = torch.randn(truth.shape, generator=g, dtype=torch.float64)
        true_grads = torch.autograd.grad(truth, (q64, k64, v64), grad_out)
        for backend in BACKENDS:
            out, grads = _run(backend, q, k, v, kw, grad_out)
            assert out.dtype == torch.float32
            where = f"{backend}, {masking}, q {tuple(q.shape)} k {tuple(k.shape)}"
            assert max_err(out, truth) <= OUT_TOL, where
            for name, grad, true in zip("qkv", grads, true_grads, strict=True):
                tol = GRAD_TOL * max(1.0, true.abs().max().item())
                assert max_err(grad, true) <= tol, f"d{name}: {where}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("Lq", "Lk"), [(7, 203), (113, 257), (113, 1), (1, 257)])
@pytest.mark.parametrize("masking", MASKINGS)
def test_low_precision_error_at_most_twice_the_math_in_that_precision(dtype, Lq, Lk, masking):
    """Output and dq, dk, dv: each backend's error against float64 is at most twice that of the math computed in
    the same low precision from the same inputs (flash-attention's rule), plus the float32 tolerance (backends
    compute in float32; where the truth is exactly 0, as dk with one key, the low-precision math is exact too)."""
    q, k, v, g = make_inputs(Lq, Lk, 40, 2, seed=Lq * Lk + len(masking), dtype=dtype)
    kw = make_masking(masking, Lq, Lk, g)
    grad_out = torch.randn(*q.shape[:3], v.shape[-1], generator=g).to(dtype)
    leaves64 = [t.double().requires_grad_() for t in (q, k, v)]
    truth, _ = math_attention(*leaves64, **kw)  # float64 from the same low-precision inputs
    true_grads = torch.autograd.grad(truth, leaves64, grad_out.double())
    leaves_low = [t.clone().requires_grad_() for t in (q, k, v)]
    low, _ = math_attention(*leaves_low, dtype=dtype, **kw)
    low_grads = torch.autograd.grad(low, leaves_low, grad_out)
    floors = [OUT_TOL] + [GRAD_TOL * max(1.0, t.abs().max().item()) for t in true_grads]
    pairs = zip((low, *low_grads), (truth, *true_grads), floors, strict=True)
    allowed = [2 * max_err(x, t) + floor for x, t, floor in pairs]
    for backend in BACKENDS:
        out, grads = _run(backend, q, k, v, kw, grad_out)
        assert out.dtype == dtype and all(grad.dtype == dtype for grad in grads)
        results = zip(("out", "dq", "dk", "dv"), (out, *grads), (truth, *true_grads), allowed, strict=True)
        for name, x, true, limit in results:
            assert max_err(x, true) <= limit, f"{name}: {backend}, {masking}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_three_dim_inputs_are_one_head(backend):
    q, k, v, g = make_inputs(7, 203, 40, 1, seed=3, heads=False)
    kw = make_masking("valid_lens_2d+bool_mask+float_mask+causal", 7, 203, g, heads=False)
    truth, _ = math_attention(q.double(), k.double(), v.double(), **kw)
    out, _ = _run(backend, q, k, v, kw)
    assert out.shape == (2, 7, 43)
    assert max_err(out, truth) <= OUT_TOL


@pytest.mark.parametrize("Lq", [1, 7, 113])
def test_additive_matches_float64_math_for_reference_and_chunked(Lq):
    for index, masking in enumerate(MASKINGS):
        q, k, v, g = make_inputs(Lq, 203, 16, 1, seed=index, heads=False)
        w_v = torch.randn(16, generator=g)
        kw = make_masking(masking, Lq, 203, g, heads=False)
        leaves64 = [t.double().requires_grad_() for t in (q, k, v, w_v)]
        truth, true_w = math_attention(*leaves64[:3], w_v=leaves64[3], **kw)
        grad_out = torch.randn(truth.shape, generator=g, dtype=torch.float64)
        true_grads = torch.autograd.grad(truth, leaves64, grad_out)
        for backend in ("reference", "tiles:online"):
            leaves = [t.clone().requires_grad_() for t in (q, k, v, w_v)]
            # a 64 KiB budget makes blocks of 4 keys here: many blocks, a partial last one
            with online.settings(additive_block_bytes=2**16):
                out, weights = attnkit.additive_attention(
                    *leaves, backend=backend, need_weights=backend == "reference", **kw
                )
            grads = torch.autograd.grad(out, leaves, grad_out.float())
            where = f"{backend}, {masking}"
            assert max_err(out, truth) <= OUT_TOL, where
            if weights is not None:
                assert max_err(weights, true_w) <= OUT_TOL, where
            for name, grad, true in zip(("q", "k", "v", "w_v"), grads, true_grads, strict=True):
                tol = GRAD_TOL * max(1.0, true.abs().max().item())
                assert max_err(grad, true) <= tol, f"d{name}: {where}"


def test_weights_and_output_of_the_reference():
    q, k, v, g = make_inputs(7, 203, 40, 2, seed=11)
    kw = make_masking("valid_lens_1d+causal", 7, 203, g)
    truth, true_w = math_attention(q.double(), k.double(), v.double(), **kw)
    out, w = attnkit.scaled_dot_product_attention(q, k, v, need_weights=True, **kw)
    assert w is not None and w.shape == (2, 8, 7, 203)
    assert max_err(w, true_w) <= OUT_TOL
    assert max_err(out, truth) <= OUT_TOL


def test_gradcheck_reference_and_chunked_in_float64():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 3, 5, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, 6, 5, generator=g, dtype=torch.float64)
    v = torch.randn(2, 2, 6, 4, generator=g, dtype=torch.float64)
    bias = torch.randn(1, 4, 3, 6, generator=g, dtype=torch.float64)
    lens = torch.tensor([[2, 0, 6], [5, 4, 1]])  # a row with no key, and a row with all of them
    for backend in ("reference", "tiles:online"):
        with online.settings(block_size=4):

            def dot(q, k, v, backend=backend):
                return attnkit.scaled_dot_product_attention(
                    q, k, v, valid_lens=lens, attn_mask=bias, is_causal=True, backend=backend
                ).output

            assert torch.autograd.gradcheck(dot, [t.clone().requires_grad_() for t in (q, k, v)])


def test_gradcheck_additive_reference_and_chunked_in_float64():
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 3, 5, generator=g, dtype=torch.float64)
    k = torch.randn(2, 6, 5, generator=g, dtype=torch.float64)
    v = torch.randn(2, 6, 4, generator=g, dtype=torch.float64)
    w_v = torch.randn(5, generator=g, dtype=torch.float64)
    lens = torch.tensor([4, 0])
    for backend in ("reference", "tiles:online"):
        with online.settings(additive_block_bytes=8 * 2 * 3 * 5 * 4):  # blocks of 4 keys

            def additive(q, k, v, w_v, backend=backend):
                return attnkit.additive_attention(q, k, v, w_v, valid_lens=lens, backend=backend).output

            assert torch.autograd.gradcheck(additive, [t.clone().requires_grad_() for t in (q, k, v, w_v)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("how", ["valid_lens", "causal", "bool_mask", "float_mask"])
def test_fully_masked_rows_are_exactly_zero_and_finite(dtype, backend, how):
    q, k, v, g = make_inputs(5, 3, 8, 2, seed=5, dtype=dtype)
    if how == "valid_lens":
        kw = {"valid_lens": torch.tensor([0, 2])}  # example 0 has no key at all
        dead = torch.zeros(2, 8, 5, dtype=torch.bool)
        dead[0] = True
    elif how == "causal":
        kw = {"is_causal": True}  # Lq=5 > Lk=3: queries 0 and 1 see no key
        dead = torch.zeros(2, 8, 5, dtype=torch.bool)
        dead[:, :, :2] = True
    else:
        allowed = torch.rand(2, 8, 5, 3, generator=g) < 0.7
        allowed[:, :, 1] = False
        allowed[1, 3, 4] = False
        dead = ~allowed.any(-1)
        kw = {"attn_mask": allowed}
        if how == "float_mask":
            kw = {"attn_mask": torch.randn(2, 8, 5, 3, generator=g).masked_fill(~allowed, float("-inf"))}
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    need = backend == "reference"
    out, w = attnkit.scaled_dot_product_attention(*leaves, backend=backend, need_weights=need, **kw)
    out.backward(torch.ones_like(out))
    assert torch.isfinite(out).all()
    assert (out[dead] == 0).all()
    assert (out[~dead] != 0).any()
    if w is not None:
        assert (w[dead] == 0).all() and torch.isfinite(w).all()
    for leaf in leaves:
        assert torch.isfinite(leaf.grad).all()
    assert (leaves[0].grad[dead] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lens_dims", [1, 2])
def test_padding_never_leaks(backend, lens_dims):
    q, k, v, g = make_inputs(7, 203, 40, 2, seed=7)
    if lens_dims == 1:
        lens = torch.tensor([150, 37])
        longest = lens
    else:
        lens = torch.randint(1, 120, (2, 7), generator=g)
        longest = lens.amax(dim=1)
    dirty_k, dirty_v = k.clone(), v.clone()
    for b, n in enumerate(longest.tolist()):
        dirty_k[b, :, n:] = float("nan")
        dirty_v[b, :, n:] = float("nan")
    clean, clean_grads = _run(backend, q, k, v, {"valid_lens": lens}, torch.ones(2, 8, 7, 43))
    dirty, dirty_grads = _run(backend, q, dirty_k, dirty_v, {"valid_lens": lens}, torch.ones(2, 8, 7, 43))
    assert torch.isfinite(dirty).all()
    torch.testing.assert_close(dirty, clean, rtol=0, atol=0)
    for dirty_grad in dirty_grads:
        assert torch.isfinite(dirty_grad).all()
    torch.testing.assert_close(dirty_grads[0], clean_grads[0], rtol=0, atol=0)


def test_padding_never_leaks_into_additive_attention():
    q, k, v, g = make_inputs(7, 203, 16, 1, seed=8, heads=False)
    w_v = torch.randn(16, generator=g)
    lens = torch.tensor([150, 37])
    dirty_k, dirty_v = k.clone(), v.clone()
    dirty_k[1, 37:] = float("nan")
    dirty_v[1, 37:] = float("inf")
    for backend in ("reference", "tiles:online"):
        clean = attnkit.additive_attention(q, k, v, w_v, valid_lens=lens, backend=backend).output
        dirty = attnkit.additive_attention(q, dirty_k, dirty_v, w_v, valid_lens=lens, backend=backend).output
        torch.testing.assert_close(dirty, clean, rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_float_mask_adds_to_the_scores(backend):
    q, k, v, g = make_inputs(7, 9, 8, 1, seed=9)
    alibi = -torch.arange(9.0).abs().expand(7, 9)  # (Lq, Lk), broadcast over batch and heads
    truth, _ = math_attention(q.double(), k.double(), v.double(), attn_mask=alibi)
    out, _ = _run(backend, q, k, v, {"attn_mask": alibi})
    assert max_err(out, truth) <= OUT_TOL


def test_causal_is_aligned_bottom_right_for_decoding():
    """One new query against a cache of keys sees the whole cache."""
    q, k, v, _ = make_inputs(1, 203, 8, 1, seed=10)
    for backend in BACKENDS:
        causal, _ = _run(backend, q, k, v, {"is_causal": True})
        plain, _ = _run(backend, q, k, v, {})
        torch.testing.assert_close(causal, plain)


def test_dropout_weights_are_before_dropout():
    q, k, v, _ = make_inputs(7, 9, 8, 1, seed=12)
    torch.manual_seed(0)
    out, w = attnkit.scaled_dot_product_attention(q, k, v, dropout_p=0.5, need_weights=True)
    plain, w_plain = attnkit.scaled_dot_product_attention(q, k, v, need_weights=True)
    torch.testing.assert_close(w, w_plain)
    assert not torch.allclose(out, plain)
    sdpa_out, _ = attnkit.scaled_dot_product_attention(q, k, v, dropout_p=0.5, backend="sdpa")
    assert not torch.allclose(sdpa_out, plain)


def test_chunked_saves_nothing_of_size_lq_times_lk():
    """Forward and backward keep O(L) tensors: what autograd saves is never an Lq x Lk matrix."""
    L, D = 512, 16
    q, k, v = (torch.randn(1, 2, L, D, requires_grad=True) for _ in range(3))
    saved = []
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t)
    with hooks, online.settings(block_size=64):
        out = attnkit.scaled_dot_product_attention(q, k, v, valid_lens=torch.tensor([400]), backend="tiles:online")
    out.output.sum().backward()
    assert saved and max(saved) <= 2 * L * D
    with hooks:
        w_v = torch.randn(D, requires_grad=True)
        out = attnkit.additive_attention(q, k, v, w_v, backend="tiles:online")
    out.output.sum().backward()
    assert max(saved) <= 2 * L * D


@pytest.mark.parametrize("causal", [False, True])
def test_padded_batches_run_by_length_and_match_the_math(causal):
    """1-D valid_lens alone (or with causal self-attention): sdpa runs one call per length on the real keys."""
    q, k, v, g = make_inputs(57, 57, 16, 2, seed=13)
    q, k, v = torch.cat([q, q]), torch.cat([k, k]), torch.cat([v, v])  # B = 4
    kw = {"valid_lens": torch.tensor([57, 20, 0, 20]), "is_causal": causal}
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    truth, _ = math_attention(q64, k64, v64, **kw)
    grad_out = torch.randn(truth.shape, generator=g, dtype=torch.float64)
    true_grads = torch.autograd.grad(truth, (q64, k64, v64), grad_out)
    out, grads = _run("sdpa", q, k, v, kw, grad_out)
    assert max_err(out, truth) <= OUT_TOL
    assert (out[2] == 0).all()
    for grad, true in zip(grads, true_grads, strict=True):
        assert max_err(grad, true) <= GRAD_TOL * max(1.0, true.abs().max().item())


def test_padded_batches_group_only_when_the_skipped_work_pays_for_the_calls(monkeypatch):
    """One call per run of equal lengths skips the padding's work but adds calls: a decode step (one query) over
    a few hundred keys runs as one masked call, a batch of long padded rows as one call per length; both match."""
    from attnkit.backends import sdpa

    calls = []
    kernel = sdpa.fused  # every call of the fused kernel goes through it
    monkeypatch.setattr(sdpa, "fused", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    g = torch.Generator().manual_seed(5)
    for Lq, Lk, expected_calls in ((1, 400, 1), (512, 512, 8)):
        q = torch.randn(8, 4, Lq, 64, generator=g)
        k, v = torch.randn(8, 4, Lk, 64, generator=g), torch.randn(8, 4, Lk, 64, generator=g)
        lens = Lk // 2 + torch.arange(8) * (Lk // 16)  # (8,) distinct lengths in [Lk/2, Lk)
        calls.clear()
        out = attnkit.scaled_dot_product_attention(q, k, v, valid_lens=lens, backend="sdpa").output
        assert len(calls) == expected_calls, (Lq, Lk, len(calls))
        truth, _ = math_attention(q.double(), k.double(), v.double(), valid_lens=lens)
        assert max_err(out, truth) <= OUT_TOL


@pytest.mark.parametrize("masking", MASKINGS)
@pytest.mark.parametrize(("Lq", "group"), [(1, 1), (1, 4), (4, 4), (7, 2)])
def test_a_decode_step_over_a_cache_runs_as_two_products_and_matches_the_math(monkeypatch, masking, Lq, group):
    """A few queries over keys and values stored positions last (a KVCache's memory), without autograd: auto runs
    the decode backend (no call of the fused kernel), which matches float64 under every masking; with autograd the
    fused kernel runs, on a contiguous copy."""
    from attnkit.backends import sdpa
    from attnkit.backends.decode import positions_last

    calls = []
    kernel = sdpa.fused  # every call of the fused kernel goes through it
    monkeypatch.setattr(sdpa, "fused", lambda *a, **kw: calls.append(a) or kernel(*a, **kw))
    q, k, v, g = make_inputs(Lq, 203, 40, group, seed=Lq * group + len(masking))
    kw = make_masking(masking, Lq, 203, g)
    k, v = positions_last(k), positions_last(v)
    truth, _ = math_attention(q.double(), k.double(), v.double(), **kw)
    with torch.no_grad(), dispatch.watch(implementations=True) as ran:
        out = attnkit.scaled_dot_product_attention(q, k, v, **kw).output
    assert calls == [] and ran == ["decode"], masking
    assert max_err(out, truth) <= OUT_TOL, masking
    with dispatch.watch(implementations=True) as ran:
        out, _ = _run("auto", q, k, v, kw, torch.ones_like(truth))
    assert ran == ["sdpa"] and calls and all(t.stride(-1) == 1 for a in calls for t in a[1:3])
    assert max_err(out, truth) <= OUT_TOL, masking


def test_the_decode_step_leaves_to_the_fused_kernel_what_it_cannot_run(monkeypatch):
    """More queries per key/value head than FEW_QUERIES, bfloat16, dropout, a float mask or ALiBi slopes that
    need a gradient: auto runs the fused kernel (on a contiguous copy), and the results match float64 (gradients
    too); the decode backend named explicitly says why it cannot run them."""
    from attnkit import mods
    from attnkit.backends import decode, sdpa
    from attnkit.backends.decode import positions_last

    calls = []
    kernel = sdpa.fused  # every call of the fused kernel goes through it
    monkeypatch.setattr(sdpa, "fused", lambda *a, **kw: calls.append(a) or kernel(*a, **kw))
    g = torch.Generator().manual_seed(3)
    q, k, v = (
        torch.randn(2, 8, 5, 16, generator=g),
        torch.randn(2, 2, 40, 16, generator=g),
        torch.randn(2, 2, 40, 16, generator=g),
    )
    kp, vp = positions_last(k), positions_last(v)
    assert 4 * 5 > decode.FEW_QUERIES
    with torch.no_grad():  # 20 queries per key/value head
        with dispatch.watch(implementations=True) as ran:
            out = attnkit.scaled_dot_product_attention(q, kp, vp, is_causal=True).output
        assert ran == ["sdpa"] and len(calls) == 1 and all(t.stride(-1) == 1 for t in calls[0][1:3])
        assert max_err(out, math_attention(q.double(), k.double(), v.double(), is_causal=True)[0]) <= OUT_TOL
        with pytest.raises(ValueError, match=r"decode: .*at most 16 queries per key/value head \(this call has 20\)"):
            attnkit.scaled_dot_product_attention(q, kp, vp, is_causal=True, backend="decode")
        calls.clear()
        with dispatch.watch(implementations=True) as ran:
            half = attnkit.scaled_dot_product_attention(q[:, :, :1].bfloat16(), kp.bfloat16(), vp.bfloat16())
        assert ran == ["sdpa"] and len(calls) == 1 and torch.isfinite(half.output).all()
        with pytest.raises(ValueError, match=r"decode: .*float32 or float64 only \(the inputs are bfloat16\)"):
            attnkit.scaled_dot_product_attention(q[:, :, :1].bfloat16(), kp.bfloat16(), vp.bfloat16(), backend="decode")
    for grad_of in ("bias", "slopes"):
        calls.clear()
        bias = torch.randn(2, 8, 1, 40, generator=g, requires_grad=True)
        slopes = mods.alibi_slopes(8).requires_grad_()
        kw = {"attn_mask": bias} if grad_of == "bias" else {"score_mod": mods.alibi(slopes)}
        with dispatch.watch(implementations=True) as ran:
            out = attnkit.scaled_dot_product_attention(q[:, :, :1], kp, vp, **kw).output
        out.sum().backward()
        assert ran == ["sdpa"] and len(calls) == 1, grad_of
        assert (bias.grad if grad_of == "bias" else slopes.grad) is not None
        with pytest.raises(ValueError, match=r"decode: .*no autograd"):
            attnkit.scaled_dot_product_attention(q[:, :, :1], kp, vp, backend="decode", **kw)
        with (
            torch.no_grad(),
            dispatch.watch(implementations=True) as ran,
        ):  # the same call without autograd: the decode step
            calls.clear()
            again = attnkit.scaled_dot_product_attention(q[:, :, :1], kp, vp, **kw).output
        assert ran == ["decode"] and calls == [] and max_err(again, out) <= OUT_TOL


def test_a_decode_step_reads_the_keys_up_to_the_longest_live_row_only(monkeypatch):
    """Over a static cache's whole storage with valid_lens, the products run over the keys up to the longest
    row's length (not the unused storage), and match the math."""
    from attnkit.backends import decode
    from attnkit.backends.decode import positions_last

    widths = []
    bmm = torch.bmm
    monkeypatch.setattr(decode.torch, "bmm", lambda a, b: widths.append(b.shape) or bmm(a, b))
    g = torch.Generator().manual_seed(4)
    q = torch.randn(3, 4, 1, 8, generator=g)
    k, v = (
        positions_last(torch.randn(3, 2, 300, 8, generator=g)),
        positions_last(torch.randn(3, 2, 300, 8, generator=g)),
    )
    lens = torch.tensor([[17], [40], [3]])
    with torch.no_grad():
        out = attnkit.scaled_dot_product_attention(q, k, v, valid_lens=lens, backend="decode").output
    monkeypatch.setattr(decode.torch, "bmm", bmm)
    assert [tuple(w) for w in widths] == [(6, 8, 40), (6, 40, 8)]
    assert max_err(out, math_attention(q.double(), k.double(), v.double(), valid_lens=lens)[0]) <= OUT_TOL


@pytest.mark.parametrize("backend", ["tiles:online", "tiles:kernel", "tiles:compiled"])
def test_a_second_derivative_through_a_recomputing_backward_is_refused_not_wrong(backend):
    """A gradient penalty (create_graph=True) through a backend whose backward recomputes outside autograd: an error
    naming the backend and the reference, never a second derivative silently missing the attention's share (the
    compiled, triton and ring backwards share the same check)."""
    q, k, v, _ = make_inputs(7, 20, 8, 2, seed=0)
    q, v = q.requires_grad_(), v[..., :8]
    out = attnkit.scaled_dot_product_attention(q, k, v, is_causal=True, backend=backend).output
    with pytest.raises(
        RuntimeError, match=rf"the {backend} backend's backward cannot be differentiated again.*'reference'"
    ):
        torch.autograd.grad(out.sum(), q, create_graph=True)
    out = attnkit.scaled_dot_product_attention(q, k, v, is_causal=True, backend="reference").output
    (dq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    assert dq.requires_grad  # the reference differentiates twice


@pytest.mark.parametrize("backend", ["auto", "sdpa"])
def test_queries_whose_rows_are_not_contiguous_are_read_as_they_are(backend):
    """A transposed or strided q in a causal call under autograd (PyTorch's flash kernel through its own ops reads
    each row as contiguous: it gave outputs off by 1e36)."""
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(2, 2, 16, 33, generator=g), torch.randn(2, 2, 16, 33, generator=g)
    for q in (
        torch.randn(2, 2, 33, 16, generator=g).transpose(-1, -2),
        torch.randn(2, 2, 16, 66, generator=g)[..., ::2],
    ):
        leaf = q.clone().requires_grad_() if q.is_contiguous() else q.requires_grad_()
        out = attnkit.scaled_dot_product_attention(leaf, k, v, is_causal=True, backend=backend).output
        truth, _ = math_attention(q.double(), k.double(), v.double(), is_causal=True)
        assert max_err(out, truth) <= OUT_TOL


def test_torch_func_grad_of_a_causal_call_runs_on_the_fused_kernel():
    """torch.func.grad of a causal call (it raised: an autograd.Function needs setup_context under torch.func's
    transforms, and the guarded backward reads values): those calls keep PyTorch's own kernel (torch 2.13's
    ``torch._C._are_functorch_transforms_active``, which sdpa.fused reads: this test fails if it moves)."""
    assert torch._C._are_functorch_transforms_active() is False
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 9, 8, generator=g) for _ in range(3))

    def loss(q):
        return attnkit.scaled_dot_product_attention(q, k, v, is_causal=True).output.sum()

    found = torch.func.grad(loss)(q)
    leaf = q.clone().requires_grad_()
    out = attnkit.scaled_dot_product_attention(leaf, k, v, is_causal=True, backend="reference").output
    (expected,) = torch.autograd.grad(out.sum(), leaf)
    assert max_err(found, expected) <= GRAD_TOL
