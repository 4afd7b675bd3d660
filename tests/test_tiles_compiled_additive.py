"""Additive scoring on the compiled backend against the float64 math of tests/mathref.py: outputs and every gradient
(q, k, v, w_v, sinks), in both of its forms (``exp``: tanh(q + k) from exp(2 q) and exp(2 k); ``tanh``: where the
queries' range is too wide for that, or not finite), with tiles of 8 so that small calls have hidden, full, partial
and padded tiles; float32 as accurate as chunked; NaN where no query may see; what ``auto`` picks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

import attnkit
import mathref
from agreement import bounds
from attnkit import dispatch, mods, plan
from attnkit.backends.tiles import compiled_steps
from mathref import max_err
from test_tiles_compiled import HKV, B, D, H, masking

# B batch, H heads, Hkv key/value heads, Lq/Lk query/key length, D features (h): test_compiled's sizes, whose
# masking() these tests share
OUT_TOL64, GRAD_TOL64 = bounds("tiles:compiled", torch.float64)


@pytest.fixture(autouse=True)
def _small_tiles(monkeypatch):
    monkeypatch.setattr(plan, "BLOCK", 8)


def _inputs(seed: int, Lq: int, Lk: int, spread: str = "narrow", dtype=torch.float64) -> list[torch.Tensor]:
    """q, k, v, w_v. ``spread``: "narrow" (the exp form), "wide" (one feature of the queries spans thousands: the
    tanh form), "far keys" (some keys saturate against every query: the exp form's clamp)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Lq, D, generator=g, dtype=torch.float64) * 2
    k, v = (torch.randn(B, HKV, Lk, D, generator=g, dtype=torch.float64) for _ in range(2))
    w_v = torch.randn(D, generator=g, dtype=torch.float64)
    if spread == "wide":
        q[..., 0] *= 1000
    elif spread == "far keys":
        k[..., ::2, 1] += 60  # beyond every query's reach in float32 and float64: tanh is 1 whatever the query
        k[..., 1::3, 2] -= 60
    return [t.to(dtype).requires_grad_() for t in (q, k, v, w_v)]


# each way of masking once, the spreads, the modifier and sinks in turn: make test's share of the search below
# (about 40 s in a clean clone, where Inductor's C++ cache is cold)
COVERING = [
    {"Lq": Lq, "shift": shift, "spread": spread, "mod": mod, "mask": mask, "sinks": sinks, "seed": seed}
    for seed, (Lq, shift, spread, mod, mask, sinks) in enumerate(
        [
            (5, 0, "narrow", "softcap", "none", True),
            (13, 3, "wide", "none", "causal", False),
            (20, -2, "far keys", "softcap", "window", False),
            (13, -2, "narrow", "none", "valid_lens", True),
            (20, 3, "wide", "softcap", "float mask", True),
        ]
    )
]


# Inductor's code for the tanh form (wide) with softcap, sinks and a bias (the exp form's: the float32 test below);
# the others' steps on aot_eager_decomp_partition (conftest.py at the root): make test-all runs all on Inductor
ON_INDUCTOR = {"float mask"}


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=[pytest.mark.inductor] if c["mask"] in ON_INDUCTOR else []) for c in COVERING],
    ids=[c["mask"] for c in COVERING],
)
def test_additive_on_compiled_equals_the_math_on_each_way_of_masking(case):
    _additive_equals_the_math(case)


@pytest.mark.slow
@hypothesis_settings(max_examples=25, deadline=None)
@given(
    case=st.fixed_dictionaries(
        {
            "Lq": st.sampled_from([5, 13, 20]),
            "shift": st.sampled_from([0, 3, -2]),  # Lk - Lq
            "spread": st.sampled_from(["narrow", "wide", "far keys"]),
            "mod": st.sampled_from(["none", "softcap"]),
            "mask": st.sampled_from(["none", "causal", "window", "valid_lens", "float mask"]),
            "sinks": st.booleans(),
            "seed": st.integers(0, 2**16),
        }
    )
)
def test_additive_on_compiled_equals_the_math_outputs_and_gradients(case):
    _additive_equals_the_math(case)


def _additive_equals_the_math(case: dict) -> None:
    Lq = case["Lq"]
    Lk = max(1, Lq + case["shift"])
    leaves = _inputs(case["seed"], Lq, Lk, case["spread"])
    names = ["q", "k", "v", "w_v"]
    g = torch.Generator().manual_seed(case["seed"])
    ours: dict = {}
    math: dict = {}
    if case["mod"] == "softcap":
        ours["score_mod"], math["score_mod"] = mods.softcap(2.0), mathref.softcap(2.0)
    masking(case, Lq, Lk, g, ours, math, leaves, names)
    q, k, v, w_v = leaves[:4]
    out = attnkit.additive_attention(q, k, v, w_v, backend="tiles:compiled", **ours).output
    want, _ = mathref.attention_mods(q, k, v, w_v=w_v, **math)
    mathref.assert_agrees(out, want, leaves, names, OUT_TOL64, GRAD_TOL64)


def test_the_forms_are_chosen_by_the_queries_range():
    q, k, _, _ = (t.detach() for t in _inputs(0, 10, 10))
    k = k.repeat_interleave(H // HKV, dim=1)  # (B, H, Lk, D), as the backend gives it
    assert compiled_steps.exp_form(q, k) is not None
    wide, _, _, _ = (t.detach() for t in _inputs(0, 10, 10, "wide"))
    assert compiled_steps.exp_form(wide, k) is None
    not_finite = q.clone()
    not_finite[0, 0, 3, 0] = float("inf")
    assert compiled_steps.exp_form(not_finite, k) is None
    # float32's exponents reach a narrower range than float64's
    assert compiled_steps.exp_form(q.float() * 10, k.float()) is None
    assert compiled_steps.exp_form(q * 10, k) is not None


@pytest.mark.parametrize("spread", [pytest.param("narrow", marks=pytest.mark.inductor), "wide", "far keys"])
def test_float32_is_as_accurate_as_chunked(spread):
    """Against the float64 math, in float32: no more than a few times chunked's error (its features are tanh's own),
    outputs and every gradient (Inductor's code in the exp form, where its sums are its own)."""
    leaves64 = _inputs(11, 40, 37, spread)
    q, k, v, w_v = leaves64
    want, _ = mathref.attention_mods(q, k, v, w_v=w_v, is_causal=True)
    dout = torch.randn_like(want)
    expected = torch.autograd.grad(want, leaves64, dout)
    errors = {}
    for backend in ("tiles:compiled", "tiles:online"):
        leaves = [t.detach().float().requires_grad_() for t in leaves64]
        out = attnkit.additive_attention(*leaves, is_causal=True, backend=backend).output
        got = torch.autograd.grad(out, leaves, dout.float())
        errors[backend] = [max_err(out, want)] + [max_err(a, b) for a, b in zip(got, expected, strict=True)]
    floor = 16 * torch.finfo(torch.float32).eps
    for name, ours, theirs in zip(
        ["out", "q", "k", "v", "w_v"], errors["tiles:compiled"], errors["tiles:online"], strict=True
    ):
        assert ours <= 4 * theirs + floor, (name, ours, theirs)


def test_an_infinite_query_is_the_tanh_forms_and_equals_the_math():
    q, k, v, w_v = _inputs(3, 12, 12)
    with torch.no_grad():
        q[0, 1, 4, 2] = float("inf")
        q[1, 0, 7, 5] = float("-inf")
    out = attnkit.additive_attention(q, k, v, w_v, is_causal=True, backend="tiles:compiled").output
    want, _ = mathref.attention_mods(q, k, v, w_v=w_v, is_causal=True)
    assert torch.isfinite(out).all()
    assert max_err(out, want) <= OUT_TOL64
    got = torch.autograd.grad(out.sum(), [k, v, w_v])
    expected = torch.autograd.grad(want.sum(), [k, v, w_v])
    for a, b in zip(got, expected, strict=True):
        assert max_err(a, b) <= GRAD_TOL64


@pytest.mark.parametrize("spread", ["narrow", pytest.param("wide", marks=pytest.mark.slow)])  # (15 s each, cold)
def test_nan_where_no_query_may_see_and_in_keys_the_score_mod_hides_reaches_nothing(spread):
    """NaN in the keys and values past each example's length, and in a key the score_mod hides from every query
    with -inf: outputs and gradients are those of the call with zeros there (the guard's steps are those of
    dot-product scoring, whose test runs them on Inductor: test_tiles_compiled.py)."""
    Lq = Lk = 20
    q, k, v, w_v = (t.detach() for t in _inputs(7, Lq, Lk, spread))
    lens = torch.tensor([20, 11])
    hidden_key = 5

    def hide(score, b, h, q_idx, kv_idx):
        return torch.where(kv_idx == hidden_key, float("-inf"), score)

    def run(k, v):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, w_v)]
        out = attnkit.additive_attention(*leaves, valid_lens=lens, score_mod=hide, backend="tiles:compiled").output
        out.backward(torch.ones_like(out))
        return [out.detach()] + [t.grad for t in leaves]

    unseen = [(1, slice(None), slice(11, None)), (slice(None), slice(None), hidden_key)]
    mathref.assert_unseen_nan_reaches_nothing(run, k, v, unseen, ["out", "dq", "dk", "dv", "dw_v"])


def test_auto_compiles_a_large_additive_call_with_a_block_of_queries(monkeypatch):
    q, k, v, w_v = (t.float() for t in _inputs(4, 20, 20))
    with dispatch.watch(implementations=True) as chosen:
        attnkit.additive_attention(q, k, v, w_v)
    assert chosen == ["reference"]  # small: compiling would not pay
    monkeypatch.setattr(dispatch, "ADDITIVE_CHUNK_ELEMENTS", 1)
    monkeypatch.setattr(dispatch, "ADDITIVE_FROM", B * H * 20 * 20 * D)
    monkeypatch.setattr(dispatch, "FEWEST_QUERIES", 8)
    with dispatch.watch(implementations=True) as chosen:
        out = attnkit.additive_attention(q, k, v, w_v, is_causal=True).output
    assert chosen == ["tiles:compiled"]
    want, _ = mathref.attention_mods(q, k, v, w_v=w_v, is_causal=True)
    assert max_err(out, want) <= 1e-5
    with dispatch.watch(implementations=True) as chosen:  # a decode step's few queries: chunked
        attnkit.additive_attention(q[:, :, :7], k.repeat(1, 1, 3, 1), v.repeat(1, 1, 3, 1), w_v)
    assert chosen == ["tiles:online"]


def test_the_exp_form_runs_where_the_queries_range_allows(monkeypatch):
    """The exp form is the one taken for usual inputs (every other test would pass on the tanh form alone)."""
    taken = []
    real = compiled_steps.exp_form

    def spy(q, k):
        found = real(q, k)
        taken.append(found is not None)
        return found

    monkeypatch.setattr(compiled_steps, "exp_form", spy)
    for spread in ("narrow", "far keys", "wide"):
        q, k, v, w_v = _inputs(2, 12, 9, spread)
        attnkit.additive_attention(q, k, v, w_v, is_causal=True, backend="tiles:compiled")
    assert taken == [True, True, False]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_queries_near_the_largest_number_are_not_overflowed(dtype):
    """A feature of the queries near the dtype's largest number, of a narrow range: its middle must not overflow
    (as (top + bottom) / 2 did, flipping tanh's sign), and keys of the other sign meet them at tanh(0)."""
    q, k, v, w_v = (t.detach() for t in _inputs(9, 10, 10))
    big = torch.finfo(dtype).max * 0.6  # (top + bottom overflows)
    q[..., 0] = big  # (a range of 0: the exp form; the dtype's spacing there is ~1e31 and more)
    k[..., 0] = torch.where(torch.arange(10) % 2 == 0, torch.tensor(-big, dtype=torch.float64), 0.0)
    leaves = [t.to(dtype).requires_grad_() for t in (q, k, v, w_v)]
    out = attnkit.additive_attention(*leaves, backend="tiles:compiled").output
    want, _ = mathref.attention_mods(*(t.double() for t in leaves[:3]), w_v=leaves[3].double())
    assert max_err(out, want) <= bounds("tiles:compiled", dtype)[0]


def test_no_queries():
    q, k, v, w_v = _inputs(5, 0, 12)
    out = attnkit.additive_attention(q, k, v, w_v, backend="tiles:compiled").output
    assert out.shape == (B, H, 0, D)
    out.sum().backward()
    assert (k.grad == 0).all() and (w_v.grad == 0).all()


@pytest.mark.parametrize("Lq, Lk", [(1, 1), (1, 12), (12, 1)])
def test_one_query_or_one_key(Lq, Lk):
    leaves = _inputs(5, Lq, Lk)
    out = attnkit.additive_attention(*leaves, backend="tiles:compiled").output
    want, _ = mathref.attention_mods(*leaves[:3], w_v=leaves[3])
    mathref.assert_agrees(out, want, leaves, ["q", "k", "v", "w_v"], OUT_TOL64, GRAD_TOL64)


def test_auto_sends_additive_calls_to_chunked_once_the_steps_failed_to_compile(monkeypatch):
    """Eagerly, the steps would hold every tile's features at once: chunked's blocks are the better fallback."""
    q, k, v, w_v = (t.float() for t in _inputs(4, 20, 20))
    monkeypatch.setattr(dispatch, "ADDITIVE_CHUNK_ELEMENTS", 1)
    monkeypatch.setattr(dispatch, "ADDITIVE_FROM", 1)
    monkeypatch.setattr(dispatch, "FEWEST_QUERIES", 8)
    monkeypatch.setattr(compiled_steps, "_FAILED", {(compiled_steps.COMPILER, compiled_steps._key(None))})
    with dispatch.watch(implementations=True) as chosen:
        attnkit.additive_attention(q, k, v, w_v)
    assert chosen == ["tiles:online"]
