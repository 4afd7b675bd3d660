"""The decode engine (attnkit.backends.decode): a few queries over a cache's positions-last keys and values, as two
batched products, without autograd; what it leaves to PyTorch's fused kernel; how much of a static cache it reads.
Its agreement with float64 under every masking is in test_agreement.py too."""

from __future__ import annotations

import pytest
import torch

import attnkit
from agreement import bounds
from attnkit import dispatch
from cases import MASKINGS, make_inputs, make_masking
from mathref import attention as math_attention
from mathref import max_err

OUT_TOL, GRAD_TOL = bounds("decode", torch.float32)


def _run(backend, q, k, v, kw, grad_out=None):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, _ = attnkit.scaled_dot_product_attention(q, k, v, backend=backend, **kw)
    if grad_out is None:
        return out, None
    grads = torch.autograd.grad(out, (q, k, v), grad_out.to(out.dtype))
    return out, grads


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
