"""What a query may not see never reaches it, nor its gradient: a huge value, or a query that holds NaN, reaches only
the rows and keys that meet it (in the output and in dq, dk, dv), on every backend and on auto."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit import mods
from mathref import allowed_mask

B, H, L, D = 1, 2, 40, 8


def _window_mask(b, h, i, j):
    return (i - j >= 0) & (i - j < 3)


# name, the call's masking, the same as a (Lq, Lk) boolean mask (True = may attend)
CASES = [
    ("window", {"mask_mod": mods.sliding_window(3)}, lambda: _window_mask(0, 0, *_grid())),
    ("window + causal", {"mask_mod": mods.sliding_window(3), "is_causal": True}, lambda: _window_mask(0, 0, *_grid())),
    ("causal", {"is_causal": True}, lambda: allowed_mask(1, 1, L, L, is_causal=True)[0, 0]),
    (
        "boolean",
        {"attn_mask": _window_mask(0, 0, *torch.meshgrid(torch.arange(L), torch.arange(L), indexing="ij"))},
        lambda: _window_mask(0, 0, *_grid()),
    ),
    (
        "causal + sinks",
        {"is_causal": True, "sinks": torch.zeros(H)},
        lambda: allowed_mask(1, 1, L, L, is_causal=True)[0, 0],
    ),
]


def _grid():
    return torch.arange(L)[:, None], torch.arange(L)[None, :]


def _backends():
    return ["auto", *(b for b in attnkit.available_backends("cpu") if b not in ("decode",))]


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
    """Finite and equal within float32's rounding (a backend may take another path, in another order, once some
    value is huge)."""
    return bool(torch.isfinite(a).all()) and torch.allclose(a, b, rtol=1e-5, atol=1e-5)


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, L, D, generator=g) for _ in range(3))
    return q, k, v, torch.randn(B, H, L, D, generator=g)


@pytest.mark.parametrize(("name", "kw", "allowed"), CASES, ids=[c[0] for c in CASES])
def test_a_huge_value_reaches_only_the_rows_that_see_its_key(name, kw, allowed):
    """Value 3e38 at key 17: dout . v overflows for every row, but only the rows that may see key 17 (and the keys
    those rows see, through dk) may differ from the same call without it; dv never depends on v."""
    allowed = allowed()  # (L, L)
    q, k, v, dout = _inputs(1)
    huge = v.clone()
    huge[:, :, 17] = 3e38
    rows = allowed[:, 17]  # (L,): the rows that see key 17
    keys = allowed[rows].any(dim=0)  # (L,): the keys those rows see
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


@pytest.mark.parametrize(("name", "kw", "allowed"), CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("length", [8, 40])
def test_a_query_that_holds_nan_reaches_only_itself_and_the_keys_it_sees(name, kw, allowed, length):
    """Query 5 holds NaN and its output gradient is 0: its output is NaN (it sees some key), no other output or dq
    changes, and dv stays as it is past the keys query 5 may see (its weights there are 0, not exp(-inf - NaN))."""
    global L
    saved, L = L, length
    try:
        mask = allowed()  # (L, L)
        kw = {key: (_window_mask(0, 0, *_grid()) if key == "attn_mask" else value) for key, value in kw.items()}
        q, k, v, dout = _inputs(2)
        bad = q.clone()
        bad[:, 0, 5, 0] = float("nan")
        dout[:, 0, 5] = 0.0
        unseen = ~mask[5]  # (L,): the keys query 5 may not see
        others = torch.ones(L, dtype=torch.bool)
        others[5] = False
        for backend in _backends():
            clean, found = _run(backend, q, k, v, kw, dout), _run(backend, bad, k, v, kw, dout)
            if clean is None:
                continue
            (out0, dq0, _, dv0), (out1, dq1, _, dv1) = clean, found
            where = f"{name}, L={L}, {backend}"
            assert out1[:, 0, 5].isnan().all(), where
            assert _same(out1[:, :, others], out0[:, :, others]) and _same(out1[:, 1], out0[:, 1]), where
            assert _same(dq1[:, :, others], dq0[:, :, others]), f"dq: {where}"
            assert _same(dv1[:, :, unseen], dv0[:, :, unseen]), f"dv: {where}"
    finally:
        L = saved
