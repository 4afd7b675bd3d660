"""What a query may not see never reaches it, nor its gradient: a huge value, or a query that holds NaN, reaches only
the rows and keys that meet it (in the output and in dq, dk, dv), on every backend and on auto, against the same
call without it."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import mods
from mathref import allowed_mask
from mathref import sliding_window as math_window

B = 1
# (H, Hkv, Lq, Lk, D, Dv): self-attention, grouped heads with values of another size, more keys than queries
SHAPES = [(2, 2, 40, 40, 8, 8), (4, 2, 40, 40, 8, 12), (2, 1, 30, 40, 12, 8)]


def _grid(Lq, Lk):
    return torch.arange(Lq)[:, None], torch.arange(Lk)[None, :]


def _cases(H, Lq, Lk):
    """``(name, the call's masking, the same as an (Lq, Lk) boolean mask, True = may attend)``."""
    window = math_window(3, Lq, Lk)(0, 0, *_grid(Lq, Lk))  # (Lq, Lk)
    causal = allowed_mask(1, 1, Lq, Lk, is_causal=True)[0, 0]  # (Lq, Lk)
    yield "window", {"mask_mod": mods.sliding_window(3)}, window
    yield "window + causal", {"mask_mod": mods.sliding_window(3), "is_causal": True}, window & causal
    yield "causal", {"is_causal": True}, causal
    yield "boolean", {"attn_mask": window}, window
    yield "causal + sinks", {"is_causal": True, "sinks": torch.zeros(H)}, causal


def _backends():
    return ["auto", *(b for b in attnkit.available_backends("cpu", implementations=True) if b != "decode")]


def _run(backend, q, k, v, kw, dout):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    try:
        out = attnkit.scaled_dot_product_attention(*leaves, backend=backend, **kw).output
    except ValueError as error:
        assert backend != "auto" and "cannot run this call" in str(error), error
        return None
    out.backward(dout)
    return out.detach(), *(t.grad for t in leaves)


def _same(a, b):
    """Finite and equal within the dtype's rounding (a backend may take another path, in another order, once some
    value is huge): float32's 1e-5, bfloat16's and float16's 1/64 (a few of their units in the last place)."""
    tol = 1e-5 if a.dtype in (torch.float32, torch.float64) else 2**-6
    return bool(torch.isfinite(a).all()) and torch.allclose(a.float(), b.float(), rtol=tol, atol=tol)


def _inputs(seed, H, Hkv, Lq, Lk, D, Dv):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Lq, D, generator=g)
    k, v = torch.randn(B, Hkv, Lk, D, generator=g), torch.randn(B, Hkv, Lk, Dv, generator=g)
    return q, k, v, torch.randn(B, H, Lq, Dv, generator=g)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "H{}/{} Lq{} Lk{} D{} Dv{}".format(*s))
def test_a_huge_value_reaches_only_the_rows_that_see_its_key(shape):
    """Value 3e38 at key 17 of every key/value head: dout . v overflows for every row, but only the rows that may
    see key 17 (and the keys those rows see, through dk) may differ from the same call without it; dv never depends
    on v."""
    H, Hkv, Lq, Lk, D, Dv = shape
    q, k, v, dout = _inputs(1, *shape)
    huge = v.clone()
    huge[:, :, 17] = 3e38
    for name, kw, allowed in _cases(H, Lq, Lk):
        rows = allowed[:, 17]  # (Lq,): the rows that see key 17
        keys = allowed[rows].any(dim=0)  # (Lk,): the keys those rows see
        for backend in _backends():
            clean, found = _run(backend, q, k, v, kw, dout), _run(backend, q, k, huge, kw, dout)
            if clean is None:
                continue
            (out0, dq0, dk0, dv0), (out1, dq1, dk1, dv1) = clean, found
            where = f"{name}, {backend}"
            assert _same(out1[:, :, ~rows], out0[:, :, ~rows]), where
            assert _same(dq1[:, :, ~rows], dq0[:, :, ~rows]), f"dq: {where}"
            assert _same(dk1[:, :, ~keys], dk0[:, :, ~keys]), f"dk: {where}"
            assert _same(dv1, dv0), f"dv: {where}"


@pytest.mark.parametrize("shape", [*SHAPES, (2, 2, 8, 8, 8, 8)], ids=lambda s: "H{}/{} Lq{} Lk{} D{} Dv{}".format(*s))
def test_a_query_that_holds_nan_reaches_only_itself_and_the_keys_it_sees(shape):
    """Query 5 of head 0 holds NaN and its output gradient is 0: its output is NaN (it sees some key), no other
    output or dq changes, and dv stays as it is past the keys query 5 may see (its weights there are 0, not
    exp(-inf - NaN))."""
    H, Hkv, Lq, Lk, D, Dv = shape
    q, k, v, dout = _inputs(2, *shape)
    bad = q.clone()
    bad[:, 0, 5, 0] = float("nan")
    dout[:, 0, 5] = 0.0
    others = torch.ones(Lq, dtype=torch.bool)
    others[5] = False
    for name, kw, allowed in _cases(H, Lq, Lk):
        unseen = ~allowed[5]  # (Lk,): the keys query 5 may not see
        for backend in _backends():
            clean, found = _run(backend, q, k, v, kw, dout), _run(backend, bad, k, v, kw, dout)
            if clean is None:
                continue
            (out0, dq0, _, dv0), (out1, dq1, _, dv1) = clean, found
            where = f"{name}, {backend}"
            if allowed[5].any():
                assert out1[:, 0, 5].isnan().all(), where
            assert _same(out1[:, :, others], out0[:, :, others]) and _same(out1[:, 1:], out0[:, 1:]), where
            assert _same(dq1[:, :, others], dq0[:, :, others]), f"dq: {where}"
            assert _same(dv1[:, :, unseen], dv0[:, :, unseen]), f"dv: {where}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_in_16_bits_a_value_near_the_largest_reaches_only_the_rows_that_see_its_key(dtype):
    """As above, with the dtype's own near-largest value (3e38 in bfloat16, 6e4 in float16), where the fused kernel's
    backward makes dout . v overflow (tester's finding: every row's dq was not finite on auto, sdpa and graph)."""
    H, Hkv, Lq, Lk, D, Dv = SHAPES[0]
    q, k, v, dout = (t.to(dtype) for t in _inputs(3, *SHAPES[0]))
    huge = v.clone()
    huge[:, :, 17] = 3e38 if dtype == torch.bfloat16 else 6e4
    for name, kw, allowed in _cases(H, Lq, Lk):
        if "sinks" in kw:
            kw = {**kw, "sinks": kw["sinks"].to(dtype)}
        rows = allowed[:, 17]  # (Lq,): the rows that see key 17
        keys = allowed[rows].any(dim=0)  # (Lk,): the keys those rows see
        for backend in _backends():
            clean, found = _run(backend, q, k, v, kw, dout), _run(backend, q, k, huge, kw, dout)
            if clean is None:
                continue
            (out0, dq0, dk0, dv0), (out1, dq1, dk1, dv1) = clean, found
            where = f"{name}, {backend}, {dtype}"
            assert _same(out1[:, :, ~rows], out0[:, :, ~rows]), where
            assert _same(dq1[:, :, ~rows], dq0[:, :, ~rows]), f"dq: {where}"
            assert _same(dk1[:, :, ~keys], dk0[:, :, ~keys]), f"dk: {where}"
            assert _same(dv1, dv0), f"dv: {where}"
