"""Every engine that runs here against the float64 math of tests/mathref.py (tests/agreement.py: each held to the
accuracy it declares), over awkward sizes crossed with every way of masking, in float32, float64 and low precision,
dot-product and additive scoring. Modifiers (mask_mod, score_mod, sinks) cross the same engines in test_mods.py.

``make test`` runs the sizes in pairs (every pair of values of Lq, Lk, D and H/Hkv at least once) and the compiled
tiles on one of them, beside their own cases in test_tiles_compiled.py; ``make test-all`` runs the whole product
on every engine."""

from __future__ import annotations

import itertools

import pytest
import torch

import attnkit
from agreement import ENGINES_HERE, Run, assert_agrees, has_autograd, run
from attnkit.backends.tiles import online
from cases import DIMS, GROUPS, LK, LQ, MASKINGS, SHAPES, make_inputs, make_masking
from mathref import attention as math_attention

# tiles:compiled compiles its steps per shape (seconds each): a few shapes in make test, all in make test-all
EAGER = tuple(e for e in ENGINES_HERE if e != "tiles:compiled")
COMPILED = ("tiles:compiled",) if "tiles:compiled" in ENGINES_HERE else ()


def _pairwise(*values: tuple) -> list[tuple]:
    """A few tuples of the product in which every pair of values of any two positions occurs (greedy)."""
    wanted = {
        (i, a, j, b) for i, j in itertools.combinations(range(len(values)), 2) for a in values[i] for b in values[j]
    }
    chosen = []
    for candidate in itertools.product(*values):
        covers = {(i, candidate[i], j, candidate[j]) for i, j in itertools.combinations(range(len(values)), 2)}
        if covers & wanted:
            chosen.append(candidate)
            wanted -= covers
        if not wanted:
            break
    return chosen


PAIRS = _pairwise(LQ, LK, DIMS, GROUPS)
assert set(PAIRS) <= set(SHAPES) and len(PAIRS) < len(SHAPES)


def _dot(q, k, v, kw, block):
    def call(backend, need_weights):
        with online.settings(block_size=block):  # several blocks and a partial last one at Lk=203, 257
            return attnkit.scaled_dot_product_attention(q, k, v, backend=backend, need_weights=need_weights, **kw)

    return call


def _truth(q, k, v, kw, grad_out, dtype=torch.float64):
    leaves = [t.detach().to(dtype).clone().requires_grad_() for t in (q, k, v)]
    out, weights = math_attention(*leaves, dtype=dtype, **kw)
    return Run(out, weights, torch.autograd.grad(out, leaves, grad_out.to(dtype)), ("q", "k", "v"))


def _agree(engines, Lq, Lk, D, group, *, dtype=torch.float32, maskings=MASKINGS, ran=None):
    for index, masking in enumerate(maskings):
        q, k, v, g = make_inputs(Lq, Lk, D, group, seed=1000 * index + Lq + Lk + D + group, dtype=dtype)
        kw = make_masking(masking, Lq, Lk, g)
        grad_out = torch.randn(*q.shape[:3], v.shape[-1], generator=g, dtype=torch.float64)
        truth = _truth(q.double(), k.double(), v.double(), kw, grad_out)
        low = _truth(q, k, v, kw, grad_out, dtype=dtype) if dtype in (torch.bfloat16, torch.float16) else None
        for engine in engines:
            leaves = [t.clone().requires_grad_(has_autograd(engine)) for t in (q, k, v)]
            need = engine == "reference"
            ours = run(engine, leaves, "qkv", _dot(*leaves, kw, block=64), grad_out, need_weights=need)
            if ours is None:
                continue
            where = f"{masking}, q {tuple(q.shape)} k {tuple(k.shape)} {dtype}"
            assert_agrees(engine, ours, truth, dtype, where, low=low)
            if ran is not None:
                ran[engine] = ran.get(engine, 0) + 1


@pytest.mark.parametrize(("Lq", "Lk", "D", "group"), PAIRS)
def test_every_engine_agrees_with_float64_math(Lq, Lk, D, group):
    _agree(EAGER, Lq, Lk, D, group)


@pytest.mark.slow
@pytest.mark.parametrize(("Lq", "Lk", "D", "group"), sorted(set(SHAPES) - set(PAIRS)))
def test_every_engine_agrees_with_float64_math_on_every_size(Lq, Lk, D, group):
    _agree(EAGER + COMPILED, Lq, Lk, D, group)


@pytest.mark.inductor  # at the engine's own tile size, Inductor's code (conftest.py at the root)
@pytest.mark.parametrize(
    ("Lq", "Lk", "D", "group"),
    [  # (each about 12 s in a clean clone: one in make test, beside test_tiles_compiled.py's cases)
        (113, 257, 40, 8),
        pytest.param(1, 203, 40, 8, marks=pytest.mark.slow),
        pytest.param(113, 257, 8, 2, marks=pytest.mark.slow),
        pytest.param(7, 1, 64, 1, marks=pytest.mark.slow),
    ],
)
def test_the_compiled_tiles_agree_with_float64_math(Lq, Lk, D, group):
    if not COMPILED:
        pytest.skip("tiles:compiled does not run here")
    _agree(COMPILED, Lq, Lk, D, group)


def test_every_engine_here_ran_and_each_call_ran_on_several():
    """The matrix tests something of every engine that runs here (an engine that refused every call would pass it
    empty): each runs some of it, decode (a few queries, no autograd) included."""
    ran: dict[str, int] = {}
    for Lq, Lk, D, group in [(1, 203, 40, 8), (7, 257, 64, 2), (113, 203, 8, 1)]:
        _agree(
            EAGER, Lq, Lk, D, group, maskings=("none", "valid_lens_1d+causal", "bool_mask+float_mask+causal"), ran=ran
        )
    assert set(ran) == set(EAGER), ran
    assert ran["reference"] == 9 and ran["tiles:online"] == 9, ran  # they run everything


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("Lq", "Lk"), [(7, 203), (113, 257), (113, 1), (1, 257)])
def test_low_precision_error_at_most_what_each_engine_declares(dtype, Lq, Lk):
    """Output and dq, dk, dv: each engine's error against float64 is at most its declared multiple (2x,
    flash-attention's rule) of that of the math computed in the same low precision from the same inputs, plus the
    float32 bounds (engines compute in float32)."""
    _agree(EAGER, Lq, Lk, 40, 2, dtype=dtype)


@pytest.mark.parametrize("engine", EAGER)
def test_three_dim_inputs_are_one_head(engine):
    q, k, v, g = make_inputs(7, 203, 40, 1, seed=3, heads=False)
    kw = make_masking("valid_lens_2d+bool_mask+float_mask+causal", 7, 203, g, heads=False)
    grad_out = torch.randn(2, 7, 43, generator=g, dtype=torch.float64)
    truth = _truth(q.double(), k.double(), v.double(), kw, grad_out)
    leaves = [t.clone().requires_grad_(has_autograd(engine)) for t in (q, k, v)]
    ours = run(engine, leaves, "qkv", _dot(*leaves, kw, block=64), grad_out)
    if ours is None:
        assert engine == "decode", f"{engine} runs three-dim inputs"  # 7 queries a head, with autograd
        return
    assert ours.out.shape == (2, 7, 43)
    assert_agrees(engine, ours, truth, torch.float32, "three dims")


@pytest.mark.parametrize("Lq", [1, 7, 113])
def test_additive_scoring_agrees_with_float64_math(Lq):
    ran = []
    for index, masking in enumerate(MASKINGS):
        q, k, v, g = make_inputs(Lq, 203, 16, 1, seed=index, heads=False)
        w_v = torch.randn(16, generator=g)
        kw = make_masking(masking, Lq, 203, g, heads=False)
        leaves64 = [t.double().requires_grad_() for t in (q, k, v, w_v)]
        out, weights = math_attention(*leaves64[:3], w_v=leaves64[3], **kw)
        grad_out = torch.randn(out.shape, generator=g, dtype=torch.float64)
        truth = Run(out, weights, torch.autograd.grad(out, leaves64, grad_out), ("q", "k", "v", "w_v"))
        for engine in EAGER:
            leaves = [t.clone().requires_grad_() for t in (q, k, v, w_v)]

            def call(backend, need_weights, leaves=leaves, kw=kw):
                # a 64 KiB budget makes blocks of 4 keys here: many blocks, a partial last one
                with online.settings(additive_block_bytes=2**16):
                    return attnkit.additive_attention(*leaves, backend=backend, need_weights=need_weights, **kw)

            ours = run(engine, leaves, ("q", "k", "v", "w_v"), call, grad_out, need_weights=engine == "reference")
            if ours is not None:
                ran.append(engine)
                assert_agrees(engine, ours, truth, torch.float32, f"additive, {masking}")
    assert {"reference", "tiles:online"} <= set(ran)


def test_gradcheck_reference_and_the_online_tiles_in_float64():
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


def test_gradcheck_additive_reference_and_the_online_tiles_in_float64():
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
