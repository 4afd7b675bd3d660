"""The compiled backend (the online softmax's steps compiled by torch.compile, one tile at a time) against the float64
math of tests/mathref.py: outputs and every gradient (q, k, v, sinks, what a score_mod closes over), with tiles of 8
so that small calls have hidden, full, partial and padded tiles; NaN where no query may see; a score_mod that raises
or returns the wrong thing; a compiler that fails; and what ``auto`` picks.

Each new score_mod, shape and flag is one more compile (seconds): the cases share a few score_mods and sizes."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

import attnkit
import mathref
from agreement import bounds
from attnkit import csrc, dispatch, mods, plan
from attnkit.backends.tiles import compiled_steps
from mathref import max_err

# B batch, H heads, Hkv key/value heads, Lq/Lk query/key length, D head dim

B, H, HKV, D = 2, 4, 2, 8
OUT_TOL64, GRAD_TOL64 = bounds("tiles:compiled", torch.float64)
SOFTCAP = mods.softcap(2.0)  # a small cap, so that the cap bends most scores


@pytest.fixture(autouse=True)
def _small_tiles(monkeypatch):
    monkeypatch.setattr(plan, "BLOCK", 8)


def _table(length: int) -> tuple[torch.Tensor, object, object]:
    """A learned bias per distance, as attnkit's score_mod and mathref's."""
    table = torch.randn(2 * length - 1, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    table.requires_grad_()

    def relative(score, b, h, q_idx, kv_idx):
        return score + table[q_idx - kv_idx + length - 1]

    return table, relative, relative


def _inputs(seed: int, Lq: int, Lk: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Lq, D, generator=g, dtype=torch.float64) * 2
    k, v = (torch.randn(B, HKV, Lk, D, generator=g, dtype=torch.float64) for _ in range(2))
    return [t.requires_grad_() for t in (q, k, v)]


def _agree(ours: dict, math: dict, leaves: list[torch.Tensor], names: list[str]) -> None:
    q, k, v = leaves[:3]
    out = attnkit.scaled_dot_product_attention(q, k, v, backend="tiles:compiled", **ours).output
    want, _ = mathref.attention_mods(q, k, v, **math)
    mathref.assert_agrees(out, want, leaves, names, OUT_TOL64, GRAD_TOL64)


# each way of masking once, the modifiers and sinks in turn: make test's share of the search below (which
# compiles about 12 variants, 50 s in a clean clone, where Inductor's C++ cache is cold)
COVERING = [
    {"Lq": Lq, "shift": shift, "mod": mod, "mask": mask, "sinks": sinks, "seed": seed}
    for seed, (Lq, shift, mod, mask, sinks) in enumerate(
        [
            (5, 0, "softcap", "none", True),
            (13, 3, "table", "causal", False),
            (20, -2, "softcap", "window", False),
            (13, -2, "table", "user stripes", True),
            (20, 3, "softcap", "valid_lens", True),
            (5, 3, "table", "float mask", False),
        ]
    )
]


# Inductor's code for two of them (the closure step's graphs, softcap's, sinks, a mask per example; a bias: in
# test_tiles_compiled_additive.py), the others' steps on aot_eager_decomp_partition (conftest.py at the root): make
# test-all runs all on Inductor
ON_INDUCTOR = {"causal", "valid_lens"}


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=[pytest.mark.inductor] if c["mask"] in ON_INDUCTOR else []) for c in COVERING],
    ids=[c["mask"] for c in COVERING],
)
def test_compiled_equals_the_math_on_each_way_of_masking(case):
    _compiled_equals_the_math(case)


@pytest.mark.slow
@hypothesis_settings(max_examples=25, deadline=None)
@given(
    case=st.fixed_dictionaries(
        {
            "Lq": st.sampled_from([5, 13, 20]),
            "shift": st.sampled_from([0, 3, -2]),  # Lk - Lq
            "mod": st.sampled_from(["softcap", "table"]),
            "mask": st.sampled_from(["none", "causal", "window", "user stripes", "valid_lens", "float mask"]),
            "sinks": st.booleans(),
            "seed": st.integers(0, 2**16),
        }
    )
)
def test_compiled_equals_the_math_outputs_and_gradients(case):
    _compiled_equals_the_math(case)


def _compiled_equals_the_math(case: dict) -> None:
    Lq = case["Lq"]
    Lk = max(1, Lq + case["shift"])
    leaves = _inputs(case["seed"], Lq, Lk)
    names = ["q", "k", "v"]
    g = torch.Generator().manual_seed(case["seed"])
    if case["mod"] == "softcap":
        ours = {"score_mod": SOFTCAP}
        math = {"score_mod": mathref.softcap(2.0)}
    else:
        table, relative, math_relative = _table(max(Lq, Lk))
        ours, math = {"score_mod": relative}, {"score_mod": math_relative}
        leaves.append(table)
        names.append("table")
    masking(case, Lq, Lk, g, ours, math, leaves, names)
    _agree(ours, math, leaves, names)


def masking(
    case: dict, Lq: int, Lk: int, g: torch.Generator, ours: dict, math: dict, leaves: list, names: list
) -> None:
    """Add ``case["mask"]`` and ``case["sinks"]`` to the keyword arguments of attnkit's call and of mathref's, and
    the sinks to the leaves whose gradients are compared."""
    if case["mask"] == "causal":
        ours["is_causal"] = math["is_causal"] = True
    elif case["mask"] == "window":
        ours["mask_mod"], math["mask_mod"] = mods.sliding_window(4), mathref.sliding_window(4, Lq, Lk)
    elif case["mask"] == "user stripes":
        ours["mask_mod"] = math["mask_mod"] = lambda b, h, i, j: (j // 3) % 2 == 0
    elif case["mask"] == "valid_lens":
        ours["valid_lens"] = math["valid_lens"] = torch.randint(0, Lk + 1, (B,), generator=g)
    elif case["mask"] == "float mask":
        ours["attn_mask"] = math["attn_mask"] = torch.randn(B, 1, Lq, Lk, generator=g, dtype=torch.float64)
    if case["sinks"]:
        ours["sinks"] = math["sinks"] = torch.randn(H, generator=g, dtype=torch.float64).requires_grad_()
        leaves.append(ours["sinks"])
        names.append("sinks")


@pytest.mark.inductor
def test_nan_where_no_query_may_see_and_in_keys_the_score_mod_hides_reaches_nothing(monkeypatch):
    """NaN in the keys and values past each example's length (no query may see them), and in a key the score_mod
    hides from every query with -inf: outputs and gradients of Inductor's steps are those of the call with zeros
    there (its steps run by aot_eager_decomp_partition: Inductor compiles only the steps that guard against keys that
    are not finite)."""
    Lq = Lk = 20
    q, k, v = (t.detach() for t in _inputs(7, Lq, Lk))
    lens = torch.tensor([20, 11])
    hidden_key = 5

    def hide(score, b, h, q_idx, kv_idx):
        return torch.where(kv_idx == hidden_key, float("-inf"), torch.tanh(score))

    def run(q, k, v):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attnkit.scaled_dot_product_attention(
            *leaves, valid_lens=lens, is_causal=True, score_mod=hide, backend="tiles:compiled"
        ).output
        out.backward(torch.ones_like(out))
        return [out.detach()] + [t.grad for t in leaves]

    def run_eagerly(k, v):
        with monkeypatch.context() as patched:
            patched.setattr(compiled_steps, "COMPILER", "aot_eager_decomp_partition")
            return run(q, k, v)

    unseen = [(1, slice(None), slice(11, None)), (slice(None), slice(None), hidden_key)]
    mathref.assert_unseen_nan_reaches_nothing(
        lambda k, v: run(q, k, v), k, v, unseen, ["out", "dq", "dk", "dv"], zeros_run=run_eagerly
    )


def test_a_score_mod_that_raises_or_returns_the_wrong_shape_is_one_error_naming_it():
    q, k, v = _inputs(0, 12, 12)

    def broken(score, b, h, q_idx, kv_idx):
        raise KeyError("no such table")

    def wrong_shape(score, b, h, q_idx, kv_idx):
        return score[..., :2]

    def wrong_dtype(score, b, h, q_idx, kv_idx):
        return score > 0

    with pytest.raises(ValueError, match=r"score_mod .*broken.* raised KeyError"):
        attnkit.scaled_dot_product_attention(q, k, v, score_mod=broken, backend="tiles:compiled")
    with pytest.raises(ValueError, match=r"score_mod .*wrong_shape.*broadcasts"):
        attnkit.scaled_dot_product_attention(q, k, v, score_mod=wrong_shape, backend="tiles:compiled")
    with pytest.raises(TypeError, match=r"score_mod .*wrong_dtype.*floating point"):
        attnkit.scaled_dot_product_attention(q, k, v, score_mod=wrong_dtype, backend="tiles:compiled")


def test_a_score_mod_of_single_scores_is_refused_by_name_and_auto_sends_it_to_the_eager_steps(monkeypatch):
    q, k, v = _inputs(1, 12, 12)

    def scalar_only(score, b, h, q_idx, kv_idx):
        return score.reshape(()) * 2  # one score at a time only (as FlexAttention's functions may be written)

    with pytest.raises(
        ValueError,
        match="tiles:compiled: needs a score_mod that takes blocks of scores .*scalar_only "
        "takes single scores only: 'tiles:online' runs it",
    ):
        attnkit.scaled_dot_product_attention(q, k, v, score_mod=scalar_only, backend="tiles:compiled")
    monkeypatch.setattr(dispatch, "COMPILE_FROM", 1)
    with dispatch.watch(implementations=True) as chosen:
        out = attnkit.scaled_dot_product_attention(q, k, v, score_mod=scalar_only).output
    assert chosen == ["tiles:online"]
    want, _ = mathref.attention_mods(q, k, v, score_mod=lambda s, b, h, i, j: s * 2)
    assert max_err(out, want) <= OUT_TOL64


def test_an_error_in_a_later_tile_names_the_score_mod():
    q, k, v = _inputs(5, 30, 30)
    table = torch.zeros(10, dtype=torch.float64)  # too short for the later tiles' distances

    def short_table(score, b, h, q_idx, kv_idx):
        return score + table[(q_idx - kv_idx).abs()]

    with pytest.raises(ValueError, match="score_mod .*short_table raised IndexError"):
        attnkit.scaled_dot_product_attention(q, k, v, score_mod=short_table, backend="tiles:compiled")


def test_a_query_that_holds_nan_puts_nan_only_in_the_gradients_of_keys_it_may_see():
    """Row 5 (causal) holds NaN and its output gradient is 0: dv stays finite past key 5, as the reference's (the
    weights of hidden keys are 0 exactly, not exp(-inf - NaN); the steps made them NaN)."""
    Lq = Lk = 20
    q, k, v = (t.detach() for t in _inputs(7, Lq, Lk))
    q[:, 0, 5, 0] = float("nan")
    for backend in ("tiles:compiled", "reference"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attnkit.scaled_dot_product_attention(
            *leaves, is_causal=True, score_mod=lambda s, b, h, i, j: torch.tanh(s), backend=backend
        ).output
        dout = torch.ones_like(out)
        dout[:, :, 5] = 0.0
        out.backward(dout)
        assert torch.isfinite(leaves[2].grad[:, :, 6:]).all(), backend


def test_one_graph_a_variant_whatever_the_lengths_and_layouts():
    """Tiles are contiguous blocks of one shape and strides (tensors are laid out a block at a time), and each
    variant has code of its own: other lengths, a transposed query, an expanded output gradient compile nothing
    more, and dynamo's limit of graphs per code object is never met (checked on torch 2.13: it counts graphs in
    torch._dynamo.utils.counters)."""
    counters = torch._dynamo.utils.counters

    def graphs() -> int:
        return int(counters["stats"]["unique_graphs"])

    def halved(score, b, h, q_idx, kv_idx):  # code of this test's own: its graphs are compiled here
        return score * 0.5

    def call(L: int, transposed: bool = False) -> None:
        q, k, v = _inputs(L, L, L)
        if transposed:
            q = q.detach().transpose(-1, -2).contiguous().transpose(-1, -2).requires_grad_()  # other strides
        out = attnkit.scaled_dot_product_attention(q, k, v, score_mod=halved, is_causal=True, backend="tiles:compiled")
        out.output.sum().backward()  # an expanded output gradient

    start = graphs()
    call(20)
    before = graphs()
    assert before > start  # (the counter counts)
    for L in (21, 28, 36, 45):
        call(L)
    call(28, transposed=True)
    assert graphs() == before


def test_partials_and_closures_of_other_numbers_are_other_score_mods():
    def scaled(factor, score, b, h, q_idx, kv_idx):
        return score * factor

    def capped(cap):
        return lambda score, b, h, q_idx, kv_idx: torch.tanh(score / cap) * cap

    keys = {
        compiled_steps._key(functools.partial(scaled, 2.0)),
        compiled_steps._key(functools.partial(scaled, 3.0)),
        compiled_steps._key(functools.partial(torch.add)),
        compiled_steps._key(capped(2.0)),
        compiled_steps._key(capped(3.0)),
        compiled_steps._key(mods.softcap(2.0)),
        compiled_steps._key(mods.softcap(3.0)),
    }
    assert len(keys) == 7
    assert compiled_steps._key(capped(2.0)) == compiled_steps._key(capped(2.0))  # the same graphs, not compiled again


def test_a_failing_compiler_falls_back_to_the_same_steps_eagerly_with_one_warning(monkeypatch):
    q, k, v = _inputs(2, 13, 13)

    def doubled(score, b, h, q_idx, kv_idx):
        return score * 2

    def broken_compiler(step, key, args):
        def fail(*a):
            raise RuntimeError("C++ compile error: no compiler here\nmany lines of generated code")

        return fail

    monkeypatch.setattr(compiled_steps, "_compiled", broken_compiler)
    compiled_steps._FAILED.discard((compiled_steps.COMPILER, compiled_steps._key(doubled)))
    with pytest.warns(RuntimeWarning, match="doubled cannot be compiled.*C\\+\\+ compile error") as caught:
        out = attnkit.scaled_dot_product_attention(
            q, k, v, score_mod=doubled, is_causal=True, backend="tiles:compiled"
        ).output
        out.sum().backward()
    assert len([w for w in caught if issubclass(w.category, RuntimeWarning)]) == 1
    want, _ = mathref.attention_mods(q, k, v, score_mod=doubled, is_causal=True)
    assert max_err(out, want) <= OUT_TOL64
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    mathref.attention_mods(q2, k2, v2, score_mod=doubled, is_causal=True)[0].sum().backward()
    for a, b in zip((q.grad, k.grad, v.grad), (q2.grad, k2.grad, v2.grad), strict=True):
        assert max_err(a, b) <= GRAD_TOL64


def test_a_failure_compiling_the_closure_steps_backward_falls_back_with_one_warning(monkeypatch):
    """AOTAutograd compiles the closure step's backward at its first use, inside autograd.grad: a failure there runs
    the step eagerly too."""

    class Broken(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            raise RuntimeError("C++ compile error in the backward graph")

    def compiled_but_broken(step, key, args):
        real = compiled_steps._STEPS[step]
        return (lambda *a: Broken.apply(real(*a))) if step == "closure" else real

    monkeypatch.setattr(compiled_steps, "_compiled", compiled_but_broken)
    q, k, v = _inputs(6, 13, 13)
    table, relative, math_relative = _table(13)
    compiled_steps._FAILED.discard((compiled_steps.COMPILER, compiled_steps._key(relative)))
    with pytest.warns(RuntimeWarning, match="relative cannot be compiled.*C\\+\\+ compile error in the backward"):
        out = attnkit.scaled_dot_product_attention(q, k, v, score_mod=relative, backend="tiles:compiled").output
        (got,) = torch.autograd.grad(out.sum(), [table])
    want, _ = mathref.attention_mods(q, k, v, score_mod=math_relative)
    (expected,) = torch.autograd.grad(want.sum(), [table])
    assert max_err(got, expected) <= GRAD_TOL64


def test_auto_compiles_a_large_call_with_a_score_mod_that_is_not_a_bias(monkeypatch):
    q, k, v = (t.float() for t in _inputs(4, 20, 20))
    cases = {"softcap": mods.softcap(30.0), "alibi": mods.alibi(mods.alibi_slopes(H))}
    for name, score_mod in cases.items():
        with dispatch.watch(implementations=True) as chosen:
            attnkit.scaled_dot_product_attention(q, k, v, score_mod=score_mod, is_causal=True)
        assert chosen[0] != "tiles:compiled", name  # small: compiling would not pay
    monkeypatch.setattr(dispatch, "COMPILE_FROM", B * H * 20 * 20)
    monkeypatch.setattr(dispatch, "FEWEST_QUERIES", 8)
    with dispatch.watch(
        implementations=True
    ) as chosen:  # float64: softcap's float32 calls go to the flash kernel, where it builds
        attnkit.scaled_dot_product_attention(q.double(), k.double(), v.double(), score_mod=cases["softcap"])
    assert chosen == ["tiles:compiled"]
    with dispatch.watch(implementations=True) as chosen:
        attnkit.scaled_dot_product_attention(q, k, v, score_mod=cases["softcap"], is_causal=True)
    assert chosen == ["tiles:kernel" if csrc.ensure("flash") is None else "tiles:compiled"]
    few = q[:, :, :7]  # a decode step's few queries would be padded to a block of queries: not worth it
    with dispatch.watch(implementations=True) as chosen:
        attnkit.scaled_dot_product_attention(
            few, k.repeat(1, 1, 3, 1), v.repeat(1, 1, 3, 1), score_mod=cases["softcap"]
        )
    assert chosen != ["tiles:compiled"]
    slopes = mods.alibi_slopes(H).requires_grad_()
    kernel = (
        csrc.ensure("flash") is None
    )  # float32 ALiBi goes to the flash kernel (with its slopes' gradient), where built
    for dtype in (torch.float64, torch.float32):
        x = (t.to(dtype) for t in (q, k, v))
        with dispatch.watch(implementations=True) as chosen:  # a bias PyTorch's fused kernel takes (dense, small)
            attnkit.scaled_dot_product_attention(*x, score_mod=cases["alibi"], is_causal=True)
        assert chosen == ["tiles:kernel" if kernel and dtype == torch.float32 else "sdpa"], dtype
        x = (t.to(dtype) for t in (q, k, v))
        with dispatch.watch(implementations=True) as chosen:  # ... unless its slopes need a gradient
            attnkit.scaled_dot_product_attention(*x, score_mod=mods.alibi(slopes.to(dtype)), is_causal=True)
        assert chosen == ["tiles:kernel" if kernel and dtype == torch.float32 else "tiles:compiled"], dtype


def test_inside_a_callers_torch_compile_with_a_causal_mask():
    """The tiles' plan runs outside the caller's graph (traced, its causal test met symbolic booleans and Inductor
    failed); the steps are traced into it as they are."""
    q, k, v = (t.detach() for t in _inputs(8, 20, 20))

    def model(q, k, v):
        return attnkit.scaled_dot_product_attention(
            q, k, v, is_causal=True, score_mod=SOFTCAP, backend="tiles:compiled"
        ).output

    out = torch.compile(model)(q, k, v)
    want, _ = mathref.attention_mods(q, k, v, is_causal=True, score_mod=mathref.softcap(2.0))
    assert max_err(out, want) <= OUT_TOL64


def test_softcap_runs_in_its_compiled_form():
    """The steps run softcap's form for compiled code (expm1, faster there), not tanh: its graphs are the ones kept."""
    q, k, v = _inputs(12, 13, 13)
    attnkit.scaled_dot_product_attention(q, k, v, score_mod=SOFTCAP, backend="tiles:compiled").output.sum().backward()
    keys = {key[1] for key in compiled_steps._KEPT}
    assert compiled_steps._key(SOFTCAP.compiled()) in keys
    assert compiled_steps._key(SOFTCAP) not in keys


@pytest.mark.inductor
def test_the_tests_marked_inductor_give_the_steps_to_inductor():
    """conftest.py at the root: Inductor for the tests marked ``inductor`` (and every test in make test-all)."""
    assert compiled_steps.COMPILER == "inductor"


def test_the_other_tests_give_the_steps_to_aot_eager_in_make_test():
    import os

    want = "inductor" if os.environ.get("ATTNKIT_TESTS_ON_INDUCTOR") else "aot_eager_decomp_partition"
    assert compiled_steps.COMPILER == want
