"""Modifiers (mask_mod, score_mod, sinks) against the float64 math of tests/mathref.py.

Every built-in of attnkit.mods and user-written functions (a relative-position bias table closed over, as a
leaf, as a tensor computed from a parameter, as an nn.Module; a mask with modular arithmetic), on awkward sizes,
crossed with valid_lens, attn_mask and is_causal: outputs and every gradient (q, k, v, sinks, ALiBi slopes, the
table's parameter). Then NaN where no query may see, a random search, block skipping, errors, and
FlexAttention-style functions that only run element by element.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import pytest
import torch
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

import attnkit
import mathref
from agreement import Run, assert_agrees, bounds
from attnkit import csrc, dispatch, mods, plan
from attnkit.backends.tiles import online
from attnkit.functional import attention_weights
from attnkit.masks import Mask
from mathref import max_err

# B batch, H heads, Hkv key/value heads, Lq/Lk query/key length, D head dim, Dv value head dim

B, H, D, DV = 2, 4, 7, 5

# float64 against float64 math: only the order of the sums differs (the bounds every engine declares)
OUT_TOL64, GRAD_TOL64 = bounds("reference", torch.float64)

# Each call runs on every backend that can run it (a backend that cannot says so: that combination is skipped).
# compiled compiles a graph per score_mod, dtype and kind of mask (seconds each, many minutes over this file's
# matrix): it runs the matrix in `make test-all` (the *_compiled tests); tests/test_tiles_compiled.py has cases of
# its own.
BACKENDS = tuple(b for b in attnkit.available_backends(implementations=True) if b != "tiles:compiled")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The tensors here are tiny: intra-op threads only add synchronisation, which on a busy 2-core machine made
    this file take about 60 s instead of 11 s (pytest --durations, with and without)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ------------------------------------------------------------------------------------------------ modifiers


class Spec(NamedTuple):
    """A modifier to test: ``data(Lq, Lk, g)`` makes its tensors in float64 (the floating ones are parameters:
    they get gradients); ``ours(data, Lq, Lk)`` and ``math(data, Lq, Lk)`` give the keyword arguments of
    attnkit and of mathref.attention_mods, built from the same tensors."""

    data: Callable[[int, int, torch.Generator], dict[str, torch.Tensor]]
    ours: Callable[[dict, int, int], dict]
    math: Callable[[dict, int, int], dict]


def _doc_ids(L, g, docs=3):
    """(B, L) sorted document ids, different per example."""
    return torch.sort(torch.randint(0, docs, (B, L), generator=g), dim=1).values


def _no_data(Lq, Lk, g):
    return {}


def _docs(Lq, Lk, g):
    return {"ids_q": _doc_ids(Lq, g), "ids_k": _doc_ids(Lk, g)}


def _prefix(Lq, Lk, g):
    return {"prefix_lens": torch.tensor([min(Lk, 5), 0])}  # the second example: causal only


def _slopes(Lq, Lk, g):
    return {"slopes": mods.alibi_slopes(H).double() * (1 + torch.rand(H, generator=g, dtype=torch.float64))}


def _table(Lq, Lk, g):
    return {"table": torch.randn(H, Lq + Lk - 1, generator=g, dtype=torch.float64)}


def _sinks(Lq, Lk, g):
    return {"sinks": torch.randn(H, generator=g, dtype=torch.float64)}


def _merge(*makers):
    def data(Lq, Lk, g):
        return {name: t for make in makers for name, t in make(Lq, Lk, g).items()}

    return data


def user_mask(b, h, q_idx, kv_idx):
    """A user's mask_mod: modular arithmetic on raw indices, different per head (dead keys for some heads only)."""
    return (q_idx + 2 * kv_idx + h) % 3 != 0


def _relative(table, Lk):
    """A user's score_mod: a learned relative-position bias, table[h, q_idx - kv_idx + Lk - 1], closed over."""

    def score_mod(score, b, h, q_idx, kv_idx):
        return score + table[h, q_idx - kv_idx + Lk - 1]

    return score_mod


class RelativeBias(torch.nn.Module):
    """The same bias as an nn.Module whose forward is a score_mod (its parameter found through the module)."""

    def __init__(self, table, num_keys):
        super().__init__()
        self.table, self.num_keys = table, num_keys

    def forward(self, score, b, h, q_idx, kv_idx):
        return score + self.table[h, q_idx - kv_idx + self.num_keys - 1]


SPECS = {
    "sliding_window": Spec(
        _no_data,
        lambda d, Lq, Lk: {"mask_mod": mods.sliding_window(5)},
        lambda d, Lq, Lk: {"mask_mod": mathref.sliding_window(5, Lq, Lk)},
    ),
    "document": Spec(
        _docs,
        lambda d, Lq, Lk: {"mask_mod": mods.document(d["ids_q"], d["ids_k"])},
        lambda d, Lq, Lk: {"mask_mod": mathref.document(d["ids_q"], d["ids_k"])},
    ),
    "prefix_lm": Spec(
        _prefix,
        lambda d, Lq, Lk: {"mask_mod": mods.prefix_lm(d["prefix_lens"])},
        lambda d, Lq, Lk: {"mask_mod": mathref.prefix_lm(d["prefix_lens"], Lq, Lk)},
    ),
    "and_masks": Spec(
        _docs,
        lambda d, Lq, Lk: {"mask_mod": mods.and_masks(mods.sliding_window(9), mods.document(d["ids_q"], d["ids_k"]))},
        lambda d, Lq, Lk: {
            "mask_mod": mathref.and_masks(mathref.sliding_window(9, Lq, Lk), mathref.document(d["ids_q"], d["ids_k"]))
        },
    ),
    "or_masks": Spec(
        _prefix,
        lambda d, Lq, Lk: {"mask_mod": mods.or_masks(mods.prefix_lm(d["prefix_lens"]), mods.sliding_window(3))},
        lambda d, Lq, Lk: {
            "mask_mod": mathref.or_masks(mathref.prefix_lm(d["prefix_lens"], Lq, Lk), mathref.sliding_window(3, Lq, Lk))
        },
    ),
    "user_mask": Spec(_no_data, lambda d, Lq, Lk: {"mask_mod": user_mask}, lambda d, Lq, Lk: {"mask_mod": user_mask}),
    "and_masks(user, sliding_window)": Spec(
        _no_data,
        lambda d, Lq, Lk: {"mask_mod": mods.and_masks(user_mask, mods.sliding_window(11))},
        lambda d, Lq, Lk: {"mask_mod": mathref.and_masks(user_mask, mathref.sliding_window(11, Lq, Lk))},
    ),
    "alibi": Spec(
        _slopes,
        lambda d, Lq, Lk: {"score_mod": mods.alibi(d["slopes"])},
        lambda d, Lq, Lk: {"score_mod": mathref.alibi(d["slopes"], Lq, Lk)},
    ),
    "softcap": Spec(
        _no_data,
        lambda d, Lq, Lk: {"score_mod": mods.softcap(1.5)},
        lambda d, Lq, Lk: {"score_mod": mathref.softcap(1.5)},
    ),
    "relative_table": Spec(
        _table,
        lambda d, Lq, Lk: {"score_mod": _relative(d["table"], Lk)},
        lambda d, Lq, Lk: {"score_mod": _relative(d["table"], Lk)},
    ),
    "relative_table_from_parameter": Spec(  # closes over a non-leaf computed from the parameter
        _table,
        lambda d, Lq, Lk: {"score_mod": _relative(2 * torch.tanh(d["table"]), Lk)},
        lambda d, Lq, Lk: {"score_mod": _relative(2 * torch.tanh(d["table"]), Lk)},
    ),
    "relative_table_module": Spec(
        _table,
        lambda d, Lq, Lk: {"score_mod": RelativeBias(d["table"], Lk)},
        lambda d, Lq, Lk: {"score_mod": _relative(d["table"], Lk)},
    ),
    "sinks": Spec(_sinks, lambda d, Lq, Lk: {"sinks": d["sinks"]}, lambda d, Lq, Lk: {"sinks": d["sinks"]}),
    "alibi+sliding_window+sinks": Spec(
        _merge(_slopes, _sinks),
        lambda d, Lq, Lk: {
            "mask_mod": mods.sliding_window(7),
            "score_mod": mods.alibi(d["slopes"]),
            "sinks": d["sinks"],
        },
        lambda d, Lq, Lk: {
            "mask_mod": mathref.sliding_window(7, Lq, Lk),
            "score_mod": mathref.alibi(d["slopes"], Lq, Lk),
            "sinks": d["sinks"],
        },
    ),
    "softcap+document+sinks": Spec(
        _merge(_docs, _sinks),
        lambda d, Lq, Lk: {
            "mask_mod": mods.document(d["ids_q"], d["ids_k"]),
            "score_mod": mods.softcap(1.5),
            "sinks": d["sinks"],
        },
        lambda d, Lq, Lk: {
            "mask_mod": mathref.document(d["ids_q"], d["ids_k"]),
            "score_mod": mathref.softcap(1.5),
            "sinks": d["sinks"],
        },
    ),
    "user_mask+relative_table+sinks": Spec(
        _merge(_table, _sinks),
        lambda d, Lq, Lk: {"mask_mod": user_mask, "score_mod": _relative(d["table"], Lk), "sinks": d["sinks"]},
        lambda d, Lq, Lk: {"mask_mod": user_mask, "score_mod": _relative(d["table"], Lk), "sinks": d["sinks"]},
    ),
}

# Lq != Lk both ways, lengths that are not multiples of the block, GQA H/Hkv = 1, 2, 4, blocks of 16 and 7 keys.
# Most leave some rows with no key: 1-D lengths [Lk // 3, 0], 2-D lengths drawn from [0, Lk], causal with
# Lq > Lk, and the masks above on top.
CASES = [
    (23, 37, 2, 16, "none"),
    (37, 23, 4, 7, "causal"),
    (40, 40, 2, 7, "causal"),
    (1, 37, 4, 16, "valid_lens_1d"),
    (23, 37, 2, 7, "valid_lens_1d"),
    (37, 23, 2, 16, "valid_lens_2d+bool_mask"),
    (23, 37, 4, 7, "float_mask+causal"),
    (13, 13, 1, 16, "valid_lens_2d+causal"),
    (40, 40, 4, 7, "valid_lens_2d+bool_mask+causal"),
    (7, 203, 2, 16, "float_mask_offset"),
    (113, 203, 4, 16, "valid_lens_2d+causal"),
]


def _masking(name, Lq, Lk, g, dtype):
    kw = {}
    parts = name.split("+")
    if "valid_lens_1d" in parts:
        kw["valid_lens"] = torch.tensor([max(1, Lk // 3), 0])
    if "valid_lens_2d" in parts:
        kw["valid_lens"] = torch.randint(0, Lk + 1, (B, Lq), generator=g)
    if "bool_mask" in parts:
        kw["attn_mask"] = torch.rand(B, 1, Lq, Lk, generator=g) < 0.8
    if "float_mask" in parts or "float_mask_offset" in parts:  # added after the score_mod, -inf: may not attend
        bias = torch.randn(1, H, Lq, Lk, generator=g)
        if "float_mask_offset" in parts:  # large: attnkit shifts each row by its largest visible bias
            bias = bias + 1e4
        kw["attn_mask"] = bias.masked_fill(torch.rand(1, H, Lq, Lk, generator=g) < 0.2, float("-inf")).to(dtype)
    if "causal" in parts:
        kw["is_causal"] = True
    return kw


def _inputs(Lq, Lk, group, g, dtype):
    """q, k, v rounded to dtype (and held in float64: the truth is computed from the rounded values)."""
    q = torch.randn(B, H, Lq, D, generator=g)
    k = torch.randn(B, H // group, Lk, D, generator=g)
    v = torch.randn(B, H // group, Lk, DV, generator=g)
    return tuple(t.to(dtype).double() for t in (q, k, v))


def _leaves(tensors, dtype):
    return [t.detach().to(dtype).requires_grad_() for t in tensors]


def _parameters(data, dtype):
    """Fresh copies of the data in dtype; the floating ones as parameters (leaves that require grad)."""
    return {n: torch.nn.Parameter(t.detach().to(dtype)) if t.is_floating_point() else t for n, t in data.items()}


def run_ours(backend, qkv, data, spec, masking, *, dtype, block, grad_out, need_weights=False, fn=None):
    """attnkit's output and gradients, or None when ``backend`` says it cannot run the call."""
    Lq, Lk = qkv[0].shape[-2], qkv[1].shape[-2]
    leaves = _leaves(qkv, dtype)
    params = _parameters(data, dtype)
    kw = spec.ours(params, Lq, Lk)
    try:
        with online.settings(block_size=block):
            out, weights = (fn or attnkit.scaled_dot_product_attention)(
                *leaves, backend=backend, need_weights=need_weights, **masking, **kw
            )
    except ValueError as error:
        if f"backend={backend!r} cannot run this call" in str(error):
            return None
        raise
    floating = [n for n, t in params.items() if t.is_floating_point()]
    grads = torch.autograd.grad(out, [*leaves, *(params[n] for n in floating)], grad_out.to(out.dtype))
    return Run(out, weights, grads, ("q", "k", "v", *floating))


def run_math(qkv, data, spec, masking, *, grad_out, dtype=torch.float64, **extra):
    Lq, Lk = qkv[0].shape[-2], qkv[1].shape[-2]
    leaves = _leaves(qkv, dtype)
    params = _parameters(data, dtype)
    out, weights = mathref.attention_mods(*leaves, **masking, **spec.math(params, Lq, Lk), dtype=dtype, **extra)
    floating = [n for n, t in params.items() if t.is_floating_point()]
    grads = torch.autograd.grad(out, [*leaves, *(params[n] for n in floating)], grad_out.to(out.dtype))
    return Run(out, weights, grads, ("q", "k", "v", *floating))


def assert_close_to_math(ours, truth, dtype, where, engine):
    """``engine``'s run within the accuracy it declares of the math's (tests/agreement.py)."""
    assert_agrees(engine, ours, truth, dtype, where)


def _allowed(spec, data, masking, B_, H_, Lq, Lk):
    """(B, H, Lq, Lk) bool, from the definitions in mathref."""
    allowed = mathref.allowed_mask(B_, H_, Lq, Lk, **masking)
    mask_mod = spec.math(data, Lq, Lk).get("mask_mod")
    if mask_mod is not None:
        allowed &= mathref.mask_from_mod(mask_mod, B_, H_, Lq, Lk)
    return allowed


@pytest.mark.parametrize("name", list(SPECS))
def test_modifiers_match_float64_math(name):
    """Outputs (weights for the reference) and the gradients of q, k, v and of every parameter the modifier reads,
    on every backend that runs the call, over CASES; rows with no key give exactly zero."""
    _modifiers_match_float64_math(name, BACKENDS)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SPECS))
def test_modifiers_match_float64_math_compiled(name):
    _modifiers_match_float64_math(name, ("tiles:compiled",))


def _modifiers_match_float64_math(name, backends):
    spec = SPECS[name]
    ran = dict.fromkeys(backends, 0)
    for index, (Lq, Lk, group, block, masking_name) in enumerate(CASES):
        for dtype in (torch.float64, torch.float32):
            g = torch.Generator().manual_seed(100 * index + len(name))
            qkv = _inputs(Lq, Lk, group, g, dtype)
            data = spec.data(Lq, Lk, g)
            data = {n: t.to(dtype).double() if t.is_floating_point() else t for n, t in data.items()}
            masking = _masking(masking_name, Lq, Lk, g, dtype)
            grad_out = torch.randn(B, H, Lq, DV, generator=g, dtype=torch.float64).to(dtype).double()
            truth = run_math(qkv, data, spec, masking, grad_out=grad_out)
            dead_rows = ~_allowed(spec, data, masking, B, H, Lq, Lk).any(dim=-1)  # (B, H, Lq)
            for backend in backends:
                ours = run_ours(
                    backend,
                    qkv,
                    data,
                    spec,
                    masking,
                    dtype=dtype,
                    block=block,
                    grad_out=grad_out,
                    need_weights=backend == "reference",
                )
                if ours is None:
                    continue
                ran[backend] += 1
                where = f"{backend}, {name}, {masking_name}, Lq={Lq} Lk={Lk} H/Hkv={group} block={block} {dtype}"
                assert_close_to_math(ours, truth, dtype, where, backend)
                assert not ours.out.masked_select(dead_rows[..., None]).any(), f"rows with no key: {where}"
    if "tiles:online" in backends:
        assert ran["reference"] == ran["tiles:online"] == 2 * len(CASES)  # they run every modifier
    else:
        assert all(count > 0 for count in ran.values()), ran


@pytest.mark.parametrize("backend", ("reference", "tiles:online"))
@pytest.mark.parametrize("name", ["alibi+sliding_window+sinks", "user_mask+relative_table+sinks", "prefix_lm"])
def test_three_dim_inputs_are_one_head(name, backend):
    """(B, L, D) inputs: h is 0, sinks are (1,)."""
    spec = SPECS[name]
    g = torch.Generator().manual_seed(7)
    Lq, Lk = 19, 30
    q, k, v = (torch.randn(B, L, n, generator=g, dtype=torch.float64) for L, n in ((Lq, D), (Lk, D), (Lk, DV)))
    data = {n: (t[:1] if n in ("slopes", "sinks", "table") else t) for n, t in spec.data(Lq, Lk, g).items()}
    masking = {"valid_lens": torch.tensor([Lk, 4]), "is_causal": True}
    grad_out = torch.randn(B, Lq, DV, generator=g, dtype=torch.float64)
    truth = run_math((q, k, v), data, spec, masking, grad_out=grad_out)
    ours = run_ours(backend, (q, k, v), data, spec, masking, dtype=torch.float64, block=8, grad_out=grad_out)
    assert ours.out.shape == (B, Lq, DV)
    assert_close_to_math(ours, truth, torch.float64, f"{backend}, {name}, 3-dim", backend)


@pytest.mark.parametrize(
    "backend", ("reference", "tiles:online", pytest.param("tiles:compiled", marks=pytest.mark.slow))
)
@pytest.mark.parametrize("name", ["alibi+sliding_window+sinks", "softcap+document+sinks", "relative_table_module"])
def test_additive_scoring_takes_the_modifiers(name, backend):
    """score_mod on the additive scores w_v . tanh(q + k); gradients to w_v too."""
    spec = SPECS[name]
    Lq, Lk = 11, 26
    g = torch.Generator().manual_seed(3)
    qkv = _inputs(Lq, Lk, 2, g, torch.float64)
    data = {**spec.data(Lq, Lk, g), "w_v": torch.randn(D, generator=g, dtype=torch.float64)}
    masking = {"valid_lens": torch.randint(0, Lk + 1, (B, Lq), generator=g)}
    grad_out = torch.randn(B, H, Lq, DV, generator=g, dtype=torch.float64)
    with_w_v = Spec(
        spec.data,
        lambda d, Lq, Lk: {**spec.ours(d, Lq, Lk), "w_v": d["w_v"]},
        lambda d, Lq, Lk: {**spec.math(d, Lq, Lk), "w_v": d["w_v"]},
    )

    def additive(q, k, v, *, w_v, **kw):
        return attnkit.additive_attention(q, k, v, w_v, **kw)

    truth = run_math(qkv, data, with_w_v, masking, grad_out=grad_out)
    ours = run_ours(backend, qkv, data, with_w_v, masking, dtype=torch.float64, block=5, grad_out=grad_out, fn=additive)
    with online.settings(additive_block_bytes=4 * 5 * B * H * Lq * D):  # blocks of 5 keys
        blocked = run_ours(
            backend, qkv, data, with_w_v, masking, dtype=torch.float64, block=5, grad_out=grad_out, fn=additive
        )
    assert_close_to_math(ours, truth, torch.float64, f"{backend}, {name}, additive", backend)
    assert_close_to_math(blocked, truth, torch.float64, f"{backend}, {name}, additive, blocks of 5", backend)


def test_attention_weights_take_the_modifiers():
    spec = SPECS["alibi+sliding_window+sinks"]
    Lq, Lk = 9, 14
    g = torch.Generator().manual_seed(5)
    q, k, _ = _inputs(Lq, Lk, 1, g, torch.float64)
    data = spec.data(Lq, Lk, g)
    _, true_w = mathref.attention_mods(q, k, k, is_causal=True, **spec.math(data, Lq, Lk))
    w = attention_weights(q, k, is_causal=True, **spec.ours(data, Lq, Lk))
    assert max_err(w, true_w) <= OUT_TOL64


@pytest.mark.parametrize("backend", ("reference", "tiles:online"))
@pytest.mark.parametrize("which", ["document", "prefix_lm"])
@pytest.mark.parametrize("with_lens", [False, True])
def test_one_row_of_ids_or_lengths_for_the_whole_batch(with_lens, which, backend):
    """document(ids) with ids (1, L) and ids_k None (self-attention), prefix_lm with lengths (1,): one row for
    every example of the batch (alone, and beside per-example valid_lens)."""
    L = 29
    g = torch.Generator().manual_seed(11)
    if which == "document":
        ids = torch.tensor([[0] * 10 + [1] * 3 + [2] * 16])  # (1, L)
        ours, math = mods.document(ids), mathref.document(ids)
    else:
        lens = torch.tensor([6])  # (1,)
        ours, math = mods.prefix_lm(lens), mathref.prefix_lm(lens.expand(B), L, L)
    q, k, v = _inputs(L, L, 2, g, torch.float64)
    spec = Spec(_no_data, lambda d, Lq, Lk: {"mask_mod": ours}, lambda d, Lq, Lk: {"mask_mod": math})
    grad_out = torch.randn(B, H, L, DV, generator=g, dtype=torch.float64)
    masking = {"is_causal": True, **({"valid_lens": torch.tensor([L, 20])} if with_lens else {})}
    truth = run_math((q, k, v), {}, spec, masking, grad_out=grad_out)
    ours = run_ours(backend, (q, k, v), {}, spec, masking, dtype=torch.float64, block=4, grad_out=grad_out)
    assert_close_to_math(ours, truth, torch.float64, f"{backend}, {which} with one row for the batch", backend)


@pytest.mark.parametrize("backend", ("reference", "tiles:online"))
def test_rows_with_no_key_give_zeros_and_zero_gradients_with_and_without_sinks(backend):
    """Rows hidden by a mask_mod alone (a window with Lq > Lk leaves the first rows before every key; a query in a
    document that has no key): output 0, weights 0, and their queries, the sinks and the parameters get zero
    gradient from them."""
    Lq, Lk = 12, 6
    g = torch.Generator().manual_seed(2)
    q = torch.randn(B, H, Lq, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, 2, Lk, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, 2, Lk, DV, generator=g, dtype=torch.float64)
    ids_q = torch.tensor([[0] * 10 + [5] * 2, [0] * 12])  # document 5 has no key
    ids_k = torch.zeros(B, Lk, dtype=torch.long)
    mask = mods.and_masks(mods.sliding_window(3), mods.document(ids_q, ids_k))
    dead = torch.zeros(B, H, Lq, dtype=torch.bool)
    dead[:, :, : Lq - Lk] = True  # p = i - 6 < 0: before every key
    dead[0, :, 10:] = True
    allowed = mathref.mask_from_mod(
        mathref.and_masks(mathref.sliding_window(3, Lq, Lk), mathref.document(ids_q, ids_k)), B, H, Lq, Lk
    )
    assert torch.equal(dead, ~allowed.any(dim=-1))
    for with_sinks in (False, True):
        sinks = torch.randn(H, generator=g, dtype=torch.float64).requires_grad_() if with_sinks else None
        slopes = mods.alibi_slopes(H).double().requires_grad_()
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with online.settings(block_size=4):
            out = attnkit.scaled_dot_product_attention(
                *leaves, mask_mod=mask, score_mod=mods.alibi(slopes), sinks=sinks, backend=backend
            ).output
        weights = attention_weights(q, k, mask_mod=mask, score_mod=mods.alibi(slopes), sinks=sinks)
        assert torch.equal(out[dead], torch.zeros_like(out[dead]))
        assert not weights[dead].any()
        # a gradient that reads only the dead rows: nothing flows anywhere
        grad_out = torch.randn(out.shape, generator=g, dtype=torch.float64) * dead[..., None]
        params = [*leaves, slopes] + ([sinks] if with_sinks else [])
        grads = torch.autograd.grad(out, params, grad_out)
        for name, grad in zip(("q", "k", "v", "slopes", "sinks"), grads, strict=False):
            assert torch.isfinite(grad).all() and not grad.any(), f"d{name}, sinks={with_sinks}"


# ------------------------------------------------------------------------------------------ NaN poisoning


def _dead_positions(allowed, Hkv):
    """Keys (per key/value head) no query may see, query rows that may see no key: (B, Hkv, Lk), (B, H, Lq)."""
    H_ = allowed.shape[1]
    dead_keys = ~allowed.any(dim=2).unflatten(1, (Hkv, H_ // Hkv)).any(dim=2)  # (B, Hkv, Lk)
    dead_rows = ~allowed.any(dim=3)  # (B, H, Lq)
    return dead_keys, dead_rows


def _poisoned(qkv, dead_keys, dead_rows):
    q, k, v = qkv
    nan = float("nan")
    return (
        q.masked_fill(dead_rows[..., None], nan),
        k.masked_fill(dead_keys[..., None], nan),
        v.masked_fill(dead_keys[..., None], nan),
    )


@pytest.mark.parametrize("name", list(SPECS))
def test_nan_where_no_query_may_see_never_leaks(name):
    """NaN in every key and value no query may see (under all the masks and the mask_mod together) and in every
    query that may see no key: on every backend, outputs and all gradients (q, k, v, sinks, slopes, tables) equal
    those of the clean inputs bit for bit, and the poisoned positions get zero gradients. Mask.liveness says the
    same as the math."""
    _nan_never_leaks(name, BACKENDS)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SPECS))
def test_nan_where_no_query_may_see_never_leaks_compiled(name):
    _nan_never_leaks(name, ("tiles:compiled",))


def _nan_never_leaks(name, backends):
    spec = SPECS[name]
    ran = 0
    for index, (Lq, Lk, group, block, masking_name) in enumerate(CASES):
        g = torch.Generator().manual_seed(7 * index + 1)
        qkv = _inputs(Lq, Lk, group, g, torch.float32)
        data = spec.data(Lq, Lk, g)
        masking = _masking(masking_name, Lq, Lk, g, torch.float32)
        allowed = _allowed(spec, data, masking, B, H, Lq, Lk)
        dead_keys, dead_rows = _dead_positions(allowed, H // group)
        built = Mask.build(
            batch=B,
            heads=H,
            num_queries=Lq,
            num_keys=Lk,
            device=torch.device("cpu"),
            mask_mod=spec.ours(data, Lq, Lk).get("mask_mod"),
            **masking,
        )
        live_keys, live_rows = built.liveness
        assert torch.equal(
            live_rows.expand(B, H, Lq) if live_rows is not None else torch.ones(B, H, Lq, dtype=torch.bool),
            ~dead_rows,
        )
        assert torch.equal(
            live_keys.expand(B, H, Lk) if live_keys is not None else torch.ones(B, H, Lk, dtype=torch.bool),
            allowed.any(dim=2),
        )
        if not (dead_keys.any() or dead_rows.any()):
            continue
        grad_out = torch.randn(B, H, Lq, DV, generator=g)
        kwargs = {"dtype": torch.float32, "block": block, "grad_out": grad_out}
        dirty_qkv = _poisoned(qkv, dead_keys, dead_rows)
        for backend in backends:
            clean = run_ours(backend, qkv, data, spec, masking, **kwargs)
            if clean is None:
                continue
            dirty = run_ours(backend, dirty_qkv, data, spec, masking, **kwargs)
            ran += 1
            where = f"{backend}, {name}, {masking_name}, Lq={Lq} Lk={Lk}"
            assert torch.isfinite(dirty.out).all(), where
            torch.testing.assert_close(dirty.out, clean.out, rtol=0, atol=0, msg=where)
            deads = {"q": dead_rows, "k": dead_keys, "v": dead_keys}
            for grad_name, grad, clean_grad in zip(clean.names, dirty.grads, clean.grads, strict=True):
                assert torch.isfinite(grad).all(), f"d{grad_name}: {where}"
                torch.testing.assert_close(grad, clean_grad, rtol=0, atol=0, msg=f"d{grad_name}: {where}")
                if grad_name in deads:
                    dead = deads[grad_name][..., None]
                    assert not grad.masked_select(dead).any(), f"d{grad_name} poisoned: {where}"
    assert ran


# ------------------------------------------------------------------------------------------ random search


@st.composite
def modified_calls(draw):
    """Random sizes, a built-in mask_mod (or a user's, or two combined with and_masks/or_masks), a score_mod,
    sinks or not, causal or not, valid_lens none/1-D/2-D, a block size."""
    B_ = draw(st.integers(1, 2))
    Hkv = draw(st.integers(1, 2))
    H_ = Hkv * draw(st.sampled_from([1, 2, 4]))
    Lq, Lk = draw(st.integers(1, 33)), draw(st.integers(1, 50))
    D_, Dv = draw(st.integers(1, 9)), draw(st.integers(1, 6))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))

    def one_mask():
        kind = draw(st.sampled_from(["sliding_window", "document", "prefix_lm", "user"]))
        if kind == "sliding_window":
            w = draw(st.integers(1, Lk + 2))
            return mods.sliding_window(w), mathref.sliding_window(w, Lq, Lk)
        if kind == "document":
            docs = draw(st.integers(1, 4))
            ids_q = torch.sort(torch.randint(0, docs, (B_, Lq), generator=g), dim=1).values
            ids_k = torch.sort(torch.randint(0, docs, (B_, Lk), generator=g), dim=1).values
            return mods.document(ids_q, ids_k), mathref.document(ids_q, ids_k)
        if kind == "prefix_lm":
            lens = torch.randint(0, Lk + 1, (B_,), generator=g)
            return mods.prefix_lm(lens), mathref.prefix_lm(lens, Lq, Lk)
        period = draw(st.integers(2, 5))

        def user(b, h, q_idx, kv_idx):
            return (q_idx * 3 + kv_idx + h + b) % period != 0

        return user, user

    ours, math = {}, {}
    combine = draw(st.sampled_from(["none", "one", "and", "or"]))
    if combine == "one":
        ours["mask_mod"], math["mask_mod"] = one_mask()
    elif combine != "none":
        (a, ma), (b, mb) = one_mask(), one_mask()
        both = (mods.and_masks, mathref.and_masks) if combine == "and" else (mods.or_masks, mathref.or_masks)
        ours["mask_mod"], math["mask_mod"] = both[0](a, b), both[1](ma, mb)
    params = {}
    score = draw(st.sampled_from(["none", "alibi", "softcap", "table"]))
    if score == "alibi":
        params["slopes"] = torch.rand(H_, generator=g, dtype=torch.float64)
    elif score == "softcap":
        cap = draw(st.floats(0.25, 8.0))
        ours["score_mod"], math["score_mod"] = mods.softcap(cap), mathref.softcap(cap)
    elif score == "table":
        params["table"] = torch.randn(H_, Lq + Lk - 1, generator=g, dtype=torch.float64)
    if draw(st.booleans()):
        params["sinks"] = torch.randn(H_, generator=g, dtype=torch.float64) * 2
    masking = {"is_causal": draw(st.booleans())}
    lens_kind = draw(st.sampled_from(["none", "1d", "2d"]))
    if lens_kind != "none":
        masking["valid_lens"] = torch.randint(0, Lk + 1, (B_,) if lens_kind == "1d" else (B_, Lq), generator=g)
    qkv = (
        torch.randn(B_, H_, Lq, D_, generator=g, dtype=torch.float64),
        torch.randn(B_, Hkv, Lk, D_, generator=g, dtype=torch.float64),
        torch.randn(B_, Hkv, Lk, Dv, generator=g, dtype=torch.float64),
    )
    grad_out = torch.randn(B_, H_, Lq, Dv, generator=g, dtype=torch.float64)
    block = draw(st.integers(1, 40))
    return qkv, ours, math, params, masking, grad_out, block


def _with_params(fixed, params, Lq, Lk, library):
    """The fixed modifiers, and those built around the parameters (fresh leaves for each run)."""
    kw = dict(fixed)
    if "slopes" in params:
        slopes = params["slopes"]
        kw["score_mod"] = mods.alibi(slopes) if library == "ours" else mathref.alibi(slopes, Lq, Lk)
    if "table" in params:
        kw["score_mod"] = _relative(params["table"], Lk)
    if "sinks" in params:
        kw["sinks"] = params["sinks"]
    return kw


@hypothesis_settings(max_examples=60, deadline=None, derandomize=True)
@given(modified_calls())
def test_chunked_agrees_with_the_math_on_random_modifiers(call):
    qkv, ours_fixed, math_fixed, params, masking, grad_out, block = call
    spec = Spec(
        lambda *_: params,
        lambda d, Lq, Lk: _with_params(ours_fixed, d, Lq, Lk, "ours"),
        lambda d, Lq, Lk: _with_params(math_fixed, d, Lq, Lk, "math"),
    )
    truth = run_math(qkv, params, spec, masking, grad_out=grad_out)
    for backend in ("tiles:online", "reference"):
        ours = run_ours(backend, qkv, params, spec, masking, dtype=torch.float64, block=block, grad_out=grad_out)
        assert_close_to_math(ours, truth, torch.float64, f"{backend}, block={block}", backend)


# ------------------------------------------------------------------------------------------ block skipping


@dataclass
class Visits:
    """A score_mod that changes nothing and writes down the index ranges of every block it is called on."""

    blocks: list[tuple[int, int, int, int]] = field(default_factory=list)

    def __call__(self, score, b, h, q_idx, kv_idx):
        self.blocks.append((int(q_idx.min()), int(q_idx.max()), int(kv_idx.min()), int(kv_idx.max())))
        return score

    @property
    def elements(self):
        return sum((r1 - r0 + 1) * (j1 - j0 + 1) for r0, r1, j0, j1 in self.blocks)


def _visit(L_q, L_k, block, **kw):
    visits = Visits()
    q = torch.randn(1, 1, L_q, 4)
    k, v = torch.randn(1, 1, L_k, 4), torch.randn(1, 1, L_k, 4)
    with torch.no_grad(), online.settings(block_size=block):
        attnkit.scaled_dot_product_attention(q, k, v, backend="tiles:online", score_mod=visits, **kw)
    return visits


def _expected_spans(L_q, L_k, block, visible):
    """For each block of keys, the row span the plan should give: the blocks of ROW_STEP rows holding a row that
    may see one of its keys (``visible`` (Lq, Lk) bool, from the definition)."""
    step, spans = plan.ROW_STEP, []
    for j0 in range(0, L_k, block):
        j1 = min(j0 + block, L_k)
        rows = visible[:, j0:j1].any(dim=1).nonzero()[:, 0]
        if len(rows):
            first, last = int(rows[0]) // step * step, min(L_q, (int(rows[-1]) // step + 1) * step)
            spans.append((j0, j1, first, last))
    return spans


def _plan(L_q, L_k, block, **kw):
    mask = Mask.build(batch=1, heads=1, num_queries=L_q, num_keys=L_k, **kw)
    return [(s.j0, s.j1, s.r0, s.r1) for s in plan.key_blocks(mask, L_q, (0, L_k), block)]


def test_sliding_window_visits_only_the_band():
    L, window, block = 1024, 64, 64
    visible = mathref.mask_from_mod(mathref.sliding_window(window, L, L), 1, 1, L, L)[0, 0]
    assert _plan(L, L, block, mask_mod=mods.sliding_window(window)) == _expected_spans(L, L, block, visible)
    visits = _visit(L, L, block, mask_mod=mods.sliding_window(window))
    for r0, r1, j0, j1 in visits.blocks:  # each block scored holds a pair in the band
        assert visible[r0 : r1 + 1, j0 : j1 + 1].any(), (r0, r1, j0, j1)
    assert visits.elements <= 2 * L * (window + block)  # the band and its rounding, not L * L
    # bottom-right aligned, Lq < Lk: the band sits at the last keys
    Lq = 300
    visible = mathref.mask_from_mod(mathref.sliding_window(window, Lq, L), 1, 1, Lq, L)[0, 0]
    assert _plan(Lq, L, block, mask_mod=mods.sliding_window(window)) == _expected_spans(Lq, L, block, visible)


def test_document_mask_visits_only_same_document_blocks():
    L, block = 1024, 64
    lengths = [200, 300, 124, 400]
    ids = torch.repeat_interleave(torch.arange(4), torch.tensor(lengths))[None]  # (1, L)
    visible = ids[0, :, None] == ids[0, None, :]  # (L, L)
    assert _plan(L, L, block, mask_mod=mods.document(ids)) == _expected_spans(L, L, block, visible)
    visits = _visit(L, L, block, mask_mod=mods.document(ids))
    for r0, r1, j0, j1 in visits.blocks:
        assert visible[r0 : r1 + 1, j0 : j1 + 1].any(), (r0, r1, j0, j1)
    assert visits.elements <= L * L // 2
    # with is_causal, the upper triangle of each document goes too
    causal_visits = _visit(L, L, block, mask_mod=mods.document(ids), is_causal=True)
    assert causal_visits.elements < visits.elements * 0.7


def test_causal_skips_the_upper_triangle():
    block = 64
    for L_q, L_k in ((1024, 1024), (512, 1024), (1024, 512)):
        visible = torch.ones(L_q, L_k).tril(L_k - L_q).bool()  # j <= i + Lk - Lq
        assert _plan(L_q, L_k, block, is_causal=True) == _expected_spans(L_q, L_k, block, visible)
        visits = _visit(L_q, L_k, block, is_causal=True)
        for r0, r1, j0, j1 in visits.blocks:
            assert visible[r0 : r1 + 1, j0 : j1 + 1].any(), (L_q, L_k, r0, r1, j0, j1)
        # the visible triangle, and at most a block of keys by a block of rows more along the diagonal
        assert visits.elements <= visible.sum() + L_k * (plan.ROW_STEP + block), (L_q, L_k)
        assert visits.elements < 0.8 * L_q * L_k


def test_a_user_mask_mod_is_evaluated_per_block_and_its_hidden_blocks_are_skipped():
    """A user's function says nothing from index ranges: it is evaluated on each block (as blocks, not element by
    element), and the blocks of keys where it allows nothing are never scored."""
    L, block = 512, 32
    calls = []

    def stripes(b, h, q_idx, kv_idx):  # keys [0, 40), [128, 168), ...: blocks [64, 128), [192, 256), ... hidden
        calls.append(q_idx.numel() * kv_idx.numel())
        return (kv_idx % 128 < 40) & (q_idx >= 0)

    visits = _visit(L, L, block, mask_mod=stripes)
    visible = mathref.mask_from_mod(stripes, 1, 1, L, L)[0, 0]
    assert visits.blocks and all(visible[r0 : r1 + 1, j0 : j1 + 1].any() for r0, r1, j0, j1 in visits.blocks)
    scored_keys = {j for _, _, j0, j1 in visits.blocks for j in range(j0, j1 + 1)}
    assert scored_keys == {j for j in range(L) if j % 128 < 64}  # the blocks holding a visible key
    assert max(calls) > 1  # called on blocks, not element by element


def test_a_user_mask_mod_inside_and_masks_still_skips_its_hidden_blocks():
    L, block = 512, 32

    def stripes(b, h, q_idx, kv_idx):
        return (kv_idx % 128 < 40) & (q_idx >= 0)

    alone = _visit(L, L, block, mask_mod=stripes)
    combined = _visit(L, L, block, mask_mod=mods.and_masks(stripes))
    assert combined.elements == alone.elements


# ------------------------------------------------------------------------------------------------- errors


def _q_k_v(Lq=5, Lk=6):
    g = torch.Generator().manual_seed(0)
    return torch.randn(B, H, Lq, D, generator=g), torch.randn(B, 2, Lk, D, generator=g), torch.randn(B, 2, Lk, DV)


ERRORS = {
    "sinks (H+1,)": (lambda: {"sinks": torch.zeros(H + 1)}, ValueError, ["sinks", "(H,) = (4,)", "(5,)"]),
    "sinks (1, H)": (lambda: {"sinks": torch.zeros(1, H)}, ValueError, ["sinks", "(1, 4)"]),
    "sinks integer": (lambda: {"sinks": torch.zeros(H, dtype=torch.long)}, TypeError, ["sinks", "floating", "int64"]),
    "sinks list": (lambda: {"sinks": [0.0] * H}, TypeError, ["sinks", "list"]),
    "sinks NaN": (lambda: {"sinks": torch.full((H,), float("nan"))}, ValueError, ["sinks", "finite"]),
    "slopes (H+1,)": (
        lambda: {"score_mod": mods.alibi(torch.ones(H + 1))},
        ValueError,
        ["alibi", "slopes", "(H,) = (4,)", "(5,)"],
    ),
    "slopes (1, H)": (lambda: {"score_mod": mods.alibi(torch.ones(1, H))}, TypeError, ["alibi", "slopes", "(1, 4)"]),
    "slopes integer": (
        lambda: {"score_mod": mods.alibi(torch.ones(H, dtype=torch.long))},
        TypeError,
        ["alibi", "slopes", "floating"],
    ),
    "ids_q wrong length": (
        lambda: {"mask_mod": mods.document(torch.zeros(B, 4, dtype=torch.long), torch.zeros(B, 6, dtype=torch.long))},
        ValueError,
        ["document", "ids_q", "(B, Lq) = (2, 5)", "(2, 4)"],
    ),
    "ids_k wrong batch": (
        lambda: {"mask_mod": mods.document(torch.zeros(B, 5, dtype=torch.long), torch.zeros(3, 6, dtype=torch.long))},
        ValueError,
        ["document", "ids_k", "(B, Lk) = (2, 6)", "(3, 6)"],
    ),
    "ids_k None with Lq != Lk": (
        lambda: {"mask_mod": mods.document(torch.zeros(B, 5, dtype=torch.long))},
        ValueError,
        ["ids_q, as ids_k is None", "(2, 6)"],
    ),
    "ids float": (lambda: {"mask_mod": mods.document(torch.zeros(B, 5))}, TypeError, ["document", "ids_q", "integer"]),
    "ids 1-D": (
        lambda: {"mask_mod": mods.document(torch.zeros(5, dtype=torch.long))},
        ValueError,
        ["document", "ids_q", "(B, L)", "(5,)"],
    ),
    "prefix_lens (B, 1)": (
        lambda: {"mask_mod": mods.prefix_lm(torch.ones(B, 1, dtype=torch.long))},
        ValueError,
        ["prefix_lm", "prefix_lens", "(B,)", "(2, 1)"],
    ),
    "prefix_lens wrong batch": (
        lambda: {"mask_mod": mods.prefix_lm(torch.ones(3, dtype=torch.long))},
        ValueError,
        ["prefix_lens", "(B,) = (2,)", "(3,)"],
    ),
    "prefix_lens bool": (
        lambda: {"mask_mod": mods.prefix_lm(torch.ones(B, dtype=torch.bool))},
        TypeError,
        ["prefix_lens", "whole numbers"],
    ),
    "prefix_lens past Lk": (
        lambda: {"mask_mod": mods.prefix_lm(torch.tensor([7, 1]))},
        ValueError,
        ["prefix_lens", "at most", "6"],
    ),
    "prefix_lens negative": (
        lambda: {"mask_mod": mods.prefix_lm(torch.tensor([-1, 1]))},
        ValueError,
        ["prefix_lens", "negative"],
    ),
    "mask_mod not callable": (lambda: {"mask_mod": 3}, TypeError, ["mask_mod", "function", "int"]),
    "score_mod not callable": (lambda: {"score_mod": "alibi"}, TypeError, ["score_mod", "function", "str"]),
    "mask_mod returns float": (
        lambda: {"mask_mod": lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx).float()},
        TypeError,
        ["mask_mod", "boolean", "float32"],
    ),
    "mask_mod returns a Python bool": (
        lambda: {"mask_mod": lambda b, h, q_idx, kv_idx: True},
        ValueError,
        ["mask_mod", "tensor", "bool"],
    ),
    "score_mod returns integers": (
        lambda: {"score_mod": lambda s, b, h, q_idx, kv_idx: (s > 0).long()},
        TypeError,
        ["score_mod", "floating", "int64"],
    ),
    "score_mod returns None": (
        lambda: {"score_mod": lambda s, b, h, q_idx, kv_idx: None},
        ValueError,
        ["score_mod", "broadcasts", "NoneType"],
    ),
}


@pytest.mark.parametrize("backend", ("reference", "tiles:online"))
@pytest.mark.parametrize("case", list(ERRORS))
def test_mistakes_are_named(case, backend):
    make, error, fragments = ERRORS[case]
    with pytest.raises(error) as raised:
        attnkit.scaled_dot_product_attention(*_q_k_v(), backend=backend, **make())
    for fragment in fragments:
        assert fragment in str(raised.value), (fragment, str(raised.value))


@pytest.mark.parametrize(
    ("make", "error", "fragments"),
    [
        (lambda: mods.sliding_window(0), ValueError, ["window", "at least 1", "0"]),
        (lambda: mods.sliding_window(2.5), TypeError, ["window", "whole number", "2.5"]),
        (lambda: mods.softcap(0), ValueError, ["softcap", "cap", "positive"]),
        (lambda: mods.softcap(float("inf")), ValueError, ["softcap", "cap", "inf"]),
        (lambda: mods.softcap(float("nan")), ValueError, ["softcap", "cap", "nan"]),
        (lambda: mods.and_masks(), ValueError, ["and_masks", "at least one"]),
        (lambda: mods.or_masks(mods.sliding_window(2), 3), TypeError, ["or_masks", "mask_mod", "int"]),
        (lambda: mods.alibi_slopes(0), ValueError, ["num_heads", "at least 1"]),
    ],
)
def test_built_ins_check_their_arguments(make, error, fragments):
    with pytest.raises(error) as raised:
        make()
    for fragment in fragments:
        assert fragment in str(raised.value), (fragment, str(raised.value))


@pytest.mark.parametrize("which", ["score_mod", "mask_mod"])
def test_a_modifier_returning_the_wrong_shape_is_named(which):
    if which == "score_mod":
        kw = {"score_mod": lambda s, b, h, q_idx, kv_idx: s[..., None].expand(*s.shape, 2)}
    else:
        kw = {"mask_mod": lambda b, h, q_idx, kv_idx: (q_idx >= kv_idx)[..., None].expand(*q_idx.shape, 2)}
    with pytest.raises((ValueError, TypeError), match=which):
        attnkit.scaled_dot_product_attention(*_q_k_v(), backend="reference", **kw)


# --------------------------------------------------------------------------- element-by-element functions


def _elementwise_mask(b, h, q_idx, kv_idx):
    """Written for one element: torch.stack needs equal shapes, so on broadcasting blocks it raises."""
    pair = torch.stack([q_idx, kv_idx])  # (2,) for one element
    return (pair[0] - pair[1] + h) % 4 != 3


def _elementwise_score(table, Lk):
    def score_mod(score, b, h, q_idx, kv_idx):
        bias = table[h, q_idx - kv_idx + Lk - 1].reshape(())  # one element only
        return torch.where(score > 0, score + bias, score * 0.5)

    return score_mod


@pytest.mark.parametrize("backend", ("reference", "tiles:online"))
def test_functions_written_for_one_element_run_through_vmap(backend):
    Lq, Lk = 6, 9
    g = torch.Generator().manual_seed(13)
    b, h, q_idx, kv_idx = (torch.arange(n).view(*([1] * i), n, *([1] * (3 - i))) for i, n in enumerate((B, H, Lq, Lk)))
    table = torch.randn(H, Lq + Lk - 1, generator=g, dtype=torch.float64)
    with pytest.raises(RuntimeError):  # they do not take blocks: the fallback is what runs them
        _elementwise_mask(b, h, q_idx, kv_idx)
    with pytest.raises(RuntimeError):
        _elementwise_score(table, Lk)(torch.zeros(B, H, Lq, Lk), b, h, q_idx, kv_idx)
    qkv = _inputs(Lq, Lk, 2, g, torch.float64)
    data = {"table": table, "sinks": torch.randn(H, generator=g, dtype=torch.float64)}

    def kw(d, Lq, Lk):
        return {"mask_mod": _elementwise_mask, "score_mod": _elementwise_score(d["table"], Lk), "sinks": d["sinks"]}

    spec = Spec(lambda *_: data, kw, kw)
    masking = {"valid_lens": torch.tensor([Lk, 5]), "is_causal": True}
    grad_out = torch.randn(B, H, Lq, DV, generator=g, dtype=torch.float64)
    truth = run_math(qkv, data, spec, masking, grad_out=grad_out, elementwise=True)
    ours = run_ours(backend, qkv, data, spec, masking, dtype=torch.float64, block=4, grad_out=grad_out)
    assert_close_to_math(ours, truth, torch.float64, f"{backend}, element by element", backend)


@pytest.mark.parametrize("backend", ("reference", "tiles:online"))
def test_flex_style_minus_inf_score_mod_masks(backend):
    """FlexAttention's idiom: a score_mod that returns -inf where a query may not attend."""
    Lq, Lk = 7, 12
    q, k, v = _q_k_v(Lq, Lk)
    flex_causal = attnkit.scaled_dot_product_attention(
        q, k, v, backend=backend, score_mod=lambda s, b, h, q_idx, kv_idx: torch.where(q_idx >= kv_idx, s, -torch.inf)
    ).output
    masked = attnkit.scaled_dot_product_attention(
        q, k, v, backend=backend, mask_mod=lambda b, h, q_idx, kv_idx: q_idx >= kv_idx
    ).output
    torch.testing.assert_close(flex_causal, masked, rtol=0, atol=1e-6)


def test_a_row_the_score_mod_gives_only_minus_inf_is_zero_in_every_backend():
    Lq, Lk = 7, 12
    q, k, v = _q_k_v(Lq, Lk)

    def hide_first_rows(s, b, h, q_idx, kv_idx):
        return torch.where(q_idx >= 2, s, -torch.inf)

    outs = {
        backend: attnkit.scaled_dot_product_attention(q, k, v, backend=backend, score_mod=hide_first_rows).output
        for backend in ("tiles:online", "reference")
    }
    for backend, out in outs.items():
        assert torch.isfinite(out).all(), backend
        assert not out[:, :, :2].any(), backend
    torch.testing.assert_close(outs["reference"], outs["tiles:online"], rtol=0, atol=1e-6)


# --------------------------------------------------------------------------------------------- the rest


def test_alibi_slopes_are_the_papers():
    assert torch.equal(mods.alibi_slopes(8), torch.tensor([2.0**-k for k in range(1, 9)]))
    # 6 heads: the 4 of 4 heads (2^-2, 2^-4, ...), then every other one of 8 heads (2^-1, 2^-3)
    assert torch.equal(mods.alibi_slopes(6), torch.tensor([2.0**-2, 2.0**-4, 2.0**-6, 2.0**-8, 2.0**-1, 2.0**-3]))
    assert torch.equal(mods.alibi_slopes(1), torch.tensor([2.0**-8]))


def test_a_score_mod_reading_a_parameter_and_a_tensor_made_from_it():
    Lq, Lk = 9, 11
    g = torch.Generator().manual_seed(1)
    qkv = _inputs(Lq, Lk, 2, g, torch.float64)

    def kw(d, Lq, Lk):
        scaled = 2 * d["table"]  # a non-leaf made from the parameter, closed over beside it

        def score_mod(score, b, h, q_idx, kv_idx):
            rel = q_idx - kv_idx + Lk - 1
            return score + scaled[h, rel] + d["table"][h, rel]

        return {"score_mod": score_mod}

    data = {"table": torch.randn(H, Lq + Lk - 1, generator=g, dtype=torch.float64)}
    spec = Spec(lambda *_: data, kw, kw)
    grad_out = torch.randn(B, H, Lq, DV, generator=g, dtype=torch.float64)
    truth = run_math(qkv, data, spec, {}, grad_out=grad_out)
    ours = run_ours("tiles:online", qkv, data, spec, {}, dtype=torch.float64, block=4, grad_out=grad_out)
    assert_close_to_math(ours, truth, torch.float64, "tiles:online, table and 2 * table", "tiles:online")


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("alibi", "tiles:kernel"),
        ("softcap", "tiles:kernel"),
        ("sinks", "tiles:kernel"),
        ("relative_table", "tiles:online"),
    ],
)
def test_the_default_backend_honours_the_modifiers(name, expected):
    """backend='auto' picks one that runs the modifiers (softcap, ALiBi and sinks in float32 go to the tile engine's
    C++ kernel, or where it cannot be built softcap and sinks to its eager steps and ALiBi to sdpa, which takes it as
    a bias; a table of the caller's at this size (below DISTANCE_FROM: not traced) goes to the eager steps), and the
    result is the math's."""
    if expected == "tiles:kernel" and csrc.ensure("flash") is not None:
        expected = {"alibi": "sdpa", "softcap": "tiles:online", "sinks": "tiles:online"}[name]
    spec = SPECS[name]
    Lq, Lk = 9, 9
    g = torch.Generator().manual_seed(4)
    qkv = _inputs(Lq, Lk, 2, g, torch.float32)
    data = spec.data(Lq, Lk, g)
    grad_out = torch.randn(B, H, Lq, DV, generator=g, dtype=torch.float64)
    truth = run_math(qkv, data, spec, {}, grad_out=grad_out)
    with dispatch.watch(implementations=True) as ran:
        ours = run_ours("auto", qkv, data, spec, {}, dtype=torch.float32, block=4, grad_out=grad_out)
    assert ran == [expected]
    assert_close_to_math(ours, truth, torch.float32, f"auto, {name}", expected)


def test_no_input_or_parameter_is_modified():
    spec = SPECS["alibi+sliding_window+sinks"]
    Lq, Lk = 10, 15
    g = torch.Generator().manual_seed(9)
    q, k, v = (t.float().requires_grad_() for t in _inputs(Lq, Lk, 2, g, torch.float32))
    data = {n: t.float().requires_grad_() for n, t in spec.data(Lq, Lk, g).items()}
    lens = torch.tensor([Lk, 3])
    tensors = [q, k, v, lens, *data.values()]
    before = [(t.detach().clone(), t._version) for t in tensors]
    for backend in ("reference", "tiles:online"):
        with online.settings(block_size=4):
            out = attnkit.scaled_dot_product_attention(
                q, k, v, valid_lens=lens, backend=backend, **spec.ours(data, Lq, Lk)
            ).output
        out.sum().backward()
    for t, (value, version) in zip(tensors, before, strict=True):
        assert t._version == version and torch.equal(t.detach(), value)


def test_a_subclass_of_mask_mod_that_is_no_dataclass_is_bound_and_aligned():
    class Causal(mods.MaskMod):
        def __call__(self, b, h, q_idx, kv_idx):
            return kv_idx <= q_idx + self.offset

    q, k, v = (torch.randn(1, 2, n, 8, dtype=torch.float64) for n in (3, 7, 7))
    ours = attnkit.scaled_dot_product_attention(q, k, v, mask_mod=Causal(), backend="tiles:online").output
    want = attnkit.scaled_dot_product_attention(q, k, v, is_causal=True, backend="reference").output
    assert max_err(ours, want) <= OUT_TOL64


@pytest.mark.parametrize("backend", ("reference", "tiles:online"))
def test_nan_in_a_live_query_stays_nan_and_is_not_taken_for_an_empty_row(backend):
    """Zeros are for rows with no key; a NaN that a row may see is the caller's, and shows (as in the spec)."""
    q, k, v = (torch.randn(1, 1, n, 4) for n in (3, 5, 5))
    q[0, 0, 1, 2] = float("nan")
    out = attnkit.scaled_dot_product_attention(q, k, v, mask_mod=mods.sliding_window(5), backend=backend).output
    assert torch.isnan(out[0, 0, 1]).all() and not torch.isnan(out[0, 0, [0, 2]]).any()


@pytest.mark.parametrize("backend", ("reference", "tiles:online"))
def test_a_score_mod_singular_where_the_mask_hides_gives_finite_gradients(backend):
    """As FlexAttention: hidden pairs pass no gradient back through the score_mod (1 / (i - j) on the diagonal,
    which the mask hides, would give 0 * inf)."""
    q = torch.randn(1, 1, 6, 4, dtype=torch.float64, requires_grad=True)
    out = attnkit.scaled_dot_product_attention(
        q, q, q, mask_mod=lambda b, h, i, j: i > j, score_mod=lambda s, b, h, i, j: s / (i - j), backend=backend
    ).output
    (grad,) = torch.autograd.grad(out.sum(), q)
    assert torch.isfinite(out).all() and torch.isfinite(grad).all()


def test_chunked_refuses_a_backward_after_what_the_mask_reads_changed_in_place():
    lens = torch.tensor([8])
    q = torch.randn(1, 2, 16, 4, requires_grad=True)
    out = attnkit.scaled_dot_product_attention(q, q, q, mask_mod=mods.prefix_lm(lens), backend="tiles:online").output
    lens[0] = 2  # a reused buffer, refilled before the backward pass
    with pytest.raises(RuntimeError, match="modified in place between the forward and the backward"):
        out.sum().backward()


@pytest.mark.parametrize("backend", ["reference", "sdpa", "tiles:online"])
def test_document_ids_refilled_before_the_backward_change_nothing(backend):
    """Packed documents run as one call per document (attnkit.varlen), split where the forward pass found the
    boundaries: the backward pass never reads the ids again, so refilling them cannot change the gradient."""
    ids = torch.tensor([[0] * 8 + [1] * 8])
    q = torch.randn(1, 2, 16, 4, dtype=torch.float64, requires_grad=True)
    out = attnkit.scaled_dot_product_attention(q, q, q, mask_mod=mods.document(ids), backend=backend).output
    ids[0] = torch.tensor([0] * 2 + [1] * 14)
    (grad,) = torch.autograd.grad(out.sum(), q)
    halves = [attnkit.scaled_dot_product_attention(x, x, x).output for x in (q[:, :, :8], q[:, :, 8:])]
    (want,) = torch.autograd.grad(torch.cat(halves, dim=2).sum(), q)
    assert max_err(grad, want) <= OUT_TOL64


@pytest.mark.parametrize("backend", ("reference", "sdpa", "tiles:online"))
def test_modifier_results_that_only_broadcast_are_taken(backend):
    """PyTorch's noop_mask returns a 0-dim True; a bias may ignore the score: both broadcast to the block."""
    q = torch.randn(1, 2, 5, 4, dtype=torch.float64)
    everything = attnkit.scaled_dot_product_attention(q, q, q, backend=backend).output
    noop = attnkit.scaled_dot_product_attention(
        q, q, q, mask_mod=lambda b, h, i, j: torch.ones((), dtype=torch.bool), backend=backend
    ).output
    assert max_err(noop, everything) <= OUT_TOL64
    if backend != "sdpa":
        bias = attnkit.scaled_dot_product_attention(
            q, q, q, score_mod=lambda s, b, h, i, j: -(i - j).abs().double(), backend=backend
        ).output
        want = attnkit.scaled_dot_product_attention(
            q, q, q, score_mod=lambda s, b, h, i, j: s * 0 - (i - j).abs(), backend="reference"
        ).output
        assert max_err(bias, want) <= OUT_TOL64


def test_a_score_mod_given_as_a_mask_mod_is_named():
    q = torch.randn(1, 1, 3, 4)
    with pytest.raises(TypeError, match="alibi is a score_mod: pass it as score_mod="):
        attnkit.scaled_dot_product_attention(q, q, q, mask_mod=mods.alibi(torch.ones(1)))
    with pytest.raises(TypeError, match="sliding_window is a mask_mod: pass it as mask_mod="):
        attnkit.scaled_dot_product_attention(q, q, q, score_mod=mods.sliding_window(2))
    with pytest.raises(TypeError, match="and_masks: every argument must be a mask_mod"):
        mods.and_masks(mods.softcap(2.0))


def test_sizes_take_numpy_and_tensor_numbers_and_refuse_absurd_ones():
    import numpy as np

    assert mods.sliding_window(np.int64(4)).window == 4
    assert mods.softcap(np.float32(5.0)).cap == 5.0 and mods.softcap(torch.tensor(5.0)).cap == 5.0
    with pytest.raises(ValueError, match="window must be at most 2\\*\\*62"):
        mods.sliding_window(10**30)


def test_sinks_cannot_be_dropped_silently():
    with pytest.raises(ValueError, match="no attention sinks"):
        attnkit.MultiHeadAttention(8, 2, sinks=True).to_torch()
    with pytest.raises(TypeError, match=r"DotProductAttention\(sinks=H\) takes the number of heads"):
        attnkit.DotProductAttention(sinks=True)


@pytest.mark.parametrize("backend", ("reference", "sdpa", "tiles:online"))
@pytest.mark.parametrize(
    "make", [lambda: mods.document(torch.zeros(0, 3, dtype=torch.long)), lambda: mods.prefix_lm(torch.zeros(0))]
)
def test_an_empty_batch_with_a_per_example_mask_mod(backend, make):
    q = torch.randn(0, 1, 3, 4)
    out = attnkit.scaled_dot_product_attention(q, q, q, mask_mod=make(), backend=backend).output
    assert out.shape == (0, 1, 3, 4)


def test_gradcheck_of_the_reference_with_a_score_mod_and_a_causal_mask():
    """torch.autograd.gradcheck passes the reference's hidden-pair hook no gradient for some of its probes (it
    raised AttributeError on None)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 5, 3, dtype=torch.float64, generator=g).requires_grad_() for _ in range(3))
    table = torch.randn(2, 10, dtype=torch.float64, generator=g).requires_grad_()

    def run(q, k, v, table):
        def score_mod(s, b, h, q_idx, kv_idx):
            return 5 * torch.tanh(s / 5) + table[h, q_idx - kv_idx + 5]

        out = attnkit.scaled_dot_product_attention(q, k, v, score_mod=score_mod, is_causal=True, backend="reference")
        return out.output

    assert torch.autograd.gradcheck(run, (q, k, v, table))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_softcaps_compiled_form_is_cap_tanh_to_a_few_roundings_everywhere(dtype):
    """The form of softcap the compiled backend runs works out tanh from expm1: it is cap * tanh(score / cap) within
    a few roundings of the cap over scores from tiny to huge, exact at 0, +-inf and NaN, and so is its gradient."""
    g = torch.Generator().manual_seed(0)
    scores = torch.cat(
        [torch.randn(20000, generator=g) * 40, torch.randn(2000, generator=g) * 1e-4, torch.tensor([1e30, -1e30])]
    ).to(dtype)
    for cap in (2.0, 30.0, 50.0):
        x = scores.clone().requires_grad_()
        x64 = scores.double().requires_grad_()
        ours = mods.softcap(cap).compiled()(x, *(None,) * 4)
        want = torch.tanh(x64 / cap) * cap
        (grad,) = torch.autograd.grad(ours.sum(), x)
        (want_grad,) = torch.autograd.grad(want.sum(), x64)
        eps = torch.finfo(dtype).eps
        assert max_err(ours, want) <= 8 * eps * cap
        small = slice(20000, 22000)  # near 0: within a few roundings of the score itself
        assert ((ours[small].double() - want[small]).abs() <= 4 * eps * want[small].abs()).all()
        assert max_err(grad, want_grad) <= 8 * eps
    fast = mods.softcap(30.0).compiled()
    special = fast(torch.tensor([0.0, float("inf"), float("-inf"), float("nan")], dtype=dtype), 0, 0, 0, 0)
    assert special[:3].tolist() == [0.0, 30.0, -30.0] and special[3].isnan()
    tiny = mods.softcap(torch.finfo(dtype).tiny).compiled()  # 2 / cap overflows: not 0 * inf at a score of 0
    assert tiny(torch.tensor([0.0, 1.0, -1.0], dtype=dtype), 0, 0, 0, 0).tolist() == [0.0, tiny.cap, -tiny.cap]
