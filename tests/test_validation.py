"""Every user mistake raises ValueError/TypeError whose message names the argument and shows the values and shapes
(STYLE.md section 7), before any backend runs."""

from __future__ import annotations

import re

import pytest
import torch

import attnkit
from attnkit import dispatch, mods

# B batch, H heads, Hkv key/value heads, Lq/Lk query/key length, D head dim
B, H, HKV, LQ, LK, D = 2, 4, 2, 3, 5, 8
BACKENDS = ("reference", "sdpa", "tiles:online")


def has(*parts: str) -> str:
    """A `match=` pattern that requires every part, literally, in any order."""
    return "(?s)" + "".join(f"(?=.*{re.escape(p)})" for p in parts)


def dot(q, k, v, **kw):
    return attnkit.scaled_dot_product_attention(q, k, v, **kw)


def additive(q, k, v, **kw):
    tensor = isinstance(q, torch.Tensor)
    dtype = q.dtype if tensor and q.is_floating_point() else torch.float32
    w_v = torch.ones(D, dtype=dtype, device=q.device if tensor else None)
    return attnkit.additive_attention(q, k, v, w_v, **kw)


FUNCTIONS = pytest.mark.parametrize("attend", [dot, additive], ids=["sdpa", "additive"])


def qkv3(lq=LQ, lk=LK, dtype=torch.float32):
    return torch.randn(B, lq, D, dtype=dtype), torch.randn(B, lk, D, dtype=dtype), torch.randn(B, lk, D, dtype=dtype)


def qkv4(lq=LQ, lk=LK):
    return torch.randn(B, H, lq, D), torch.randn(B, HKV, lk, D), torch.randn(B, HKV, lk, D)


def shapes(q, k, v, names="qkv"):
    return [f"{n} {tuple(t.shape)}" for n, t in zip("qkv", (q, k, v), strict=True) if n in names]


# --- q, k, v shapes -------------------------------------------------------------------------------------------

SHAPE_CASES = {
    "batch": ((2, 3, D), (3, 5, D), (2, 5, D), ["batch sizes differ", "q has 2", "k has 3", "v has 2"]),
    "batch_v": ((2, 3, D), (2, 5, D), (1, 5, D), ["batch sizes differ", "v has 1"]),
    "features": ((2, 3, D), (2, 5, 6), (2, 5, D), ["q and k must have the same feature size", f"{D} and 6"], "qk"),
    "heads_not_multiple": ((2, 4, 3, D), (2, 3, 5, D), (2, 3, 5, D), ["4 heads of q", "3 heads of k and v"]),
    "zero_kv_heads": ((2, 4, 3, D), (2, 0, 5, D), (2, 0, 5, D), ["4 heads of q", "0 heads of k and v"]),
    "kv_heads_differ": ((2, 4, 3, D), (2, 2, 5, D), (2, 1, 5, D), ["k has 2 heads but v has 1"]),
    "q4_k3": ((2, 4, 3, D), (2, 5, D), (2, 5, D), ["q, k and v must have the same number of dims"]),
    "q4_v3": ((2, 4, 3, D), (2, 2, 5, D), (2, 5, D), ["q, k and v must have the same number of dims"]),
    "q3_k4": ((2, 3, D), (2, 1, 5, D), (2, 1, 5, D), ["q, k and v must have the same number of dims"]),
    "q2": ((3, D), (5, D), (5, D), ["q must be (B, H, Lq, D) or (B, Lq, D)", "got 2 dims"]),
    "q5": ((2, 1, 4, 3, D), (2, 1, 2, 5, D), (2, 1, 2, 5, D), ["q must be (B, H, Lq, D) or (B, Lq, D)", "5 dims"]),
    "zero_keys": ((2, 3, D), (2, 0, D), (2, 0, D), ["k must have at least one position"]),
    "zero_features": ((2, 3, 0), (2, 5, 0), (2, 5, 4), ["q must have at least one feature (D >= 1)"]),
}


@FUNCTIONS
@pytest.mark.parametrize("case", SHAPE_CASES)
def test_qkv_that_do_not_fit_name_the_problem_and_show_all_shapes(attend, case):
    q_shape, k_shape, v_shape, parts, *names = SHAPE_CASES[case]
    q, k, v = torch.randn(q_shape), torch.randn(k_shape), torch.randn(v_shape)
    with (
        dispatch.watch(implementations=True) as ran,
        pytest.raises(ValueError, match=has(*parts, *shapes(q, k, v, *names))),
    ):
        attend(q, k, v)
    assert ran == []


@FUNCTIONS
@pytest.mark.parametrize("backend", ("auto", *BACKENDS))
@pytest.mark.parametrize("heads", [(), (2,)], ids=["3d", "4d"])
def test_keys_and_values_of_different_lengths_are_refused_by_every_backend(attend, backend, heads):
    # torch 2.13's CPU SDPA silently accepts this for 4-dim inputs (q (2, 2, 3, 8), k (2, 2, 6, 8), v (2, 2, 5, 8)).
    q, k, v = torch.randn(2, *heads, 3, D), torch.randn(2, *heads, 6, D), torch.randn(2, *heads, 5, D)
    if attend is additive and backend == "sdpa":
        backend = "auto"  # sdpa refuses additive scoring, tested below
    with (
        dispatch.watch(implementations=True) as ran,
        pytest.raises(ValueError, match=has("k has 6 positions but v has 5", *shapes(q, k, v, "kv"))),
    ):
        attend(q, k, v, backend=backend)
    assert ran == []


def test_keys_and_values_message_matches_the_style_guide_example():
    q, k, v = torch.randn(2, 3, 100), torch.randn(2, 6, 100), torch.randn(2, 5, 100)
    with pytest.raises(ValueError, match=re.escape("k has 6 positions but v has 5: k (2, 6, 100), v (2, 5, 100)")):
        attnkit.scaled_dot_product_attention(q, k, v, backend="sdpa")


# --- dtypes, non-tensors, devices -----------------------------------------------------------------------------


@FUNCTIONS
@pytest.mark.parametrize("which", ["k", "v"])
def test_mixed_dtypes_are_a_type_error_naming_both(attend, which):
    q, k, v = qkv3()
    args = {"q": q, "k": k, "v": v, which: (k if which == "k" else v).double()}
    with pytest.raises(
        TypeError, match=has(f"q and {which} must have the same dtype", "torch.float32", "torch.float64")
    ):
        attend(**args)


@FUNCTIONS
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_non_floating_inputs_are_a_type_error(attend, which):
    q, k, v = qkv3()
    args = {"q": q, "k": k, "v": v}
    args[which] = torch.ones_like(args[which], dtype=torch.int64)
    with pytest.raises(TypeError, match=has(f"{which} must be floating point", "torch.int64")):
        attend(**args)


@FUNCTIONS
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_non_tensor_inputs_are_a_type_error(attend, which):
    q, k, v = qkv3()
    args = {"q": q, "k": k, "v": v}
    args[which] = args[which].tolist()
    with pytest.raises(TypeError, match=has(f"{which} must be a tensor", "list")):
        attend(**args)


@FUNCTIONS
@pytest.mark.parametrize("which", ["k", "v"])
def test_inputs_on_different_devices_raise_before_any_computation(attend, which):
    q, k, v = qkv3()
    args = {"q": q, "k": k, "v": v, which: torch.empty((B, LK, D), device="meta")}
    with (
        dispatch.watch(implementations=True) as ran,
        pytest.raises(ValueError, match=has(f"q and {which}", "same device", "cpu", "meta")),
    ):
        attend(**args)
    assert ran == []


@FUNCTIONS
def test_valid_lens_on_another_device_raises_naming_both_devices(attend):
    q, k, v = qkv3()
    valid_lens = torch.tensor([1, 2], device="meta")
    with dispatch.watch(implementations=True) as ran, pytest.raises(ValueError, match=has("valid_lens", "meta", "cpu")):
        attend(q, k, v, valid_lens=valid_lens)
    assert ran == []


@FUNCTIONS
def test_inputs_on_another_device_than_valid_lens_raise_naming_both_devices(attend):
    q, k, v = (t.to("meta") for t in qkv3())
    with dispatch.watch(implementations=True) as ran, pytest.raises(ValueError, match=has("valid_lens", "meta", "cpu")):
        attend(q, k, v, valid_lens=torch.tensor([1, 2]))
    assert ran == []


@FUNCTIONS
def test_attn_mask_on_another_device_raises_naming_both_devices(attend):
    q, k, v = qkv3()
    attn_mask = torch.ones(LQ, LK, dtype=torch.bool, device="meta")
    with dispatch.watch(implementations=True) as ran, pytest.raises(ValueError, match=has("attn_mask", "meta", "cpu")):
        attend(q, k, v, attn_mask=attn_mask)
    assert ran == []


def test_valid_lens_on_another_device_than_scores_raises_in_masked_softmax():
    with pytest.raises(ValueError, match=has("valid_lens", "meta", "cpu")):
        attnkit.masked_softmax(torch.zeros(B, LQ, LK), torch.tensor([1, 2], device="meta"))


# --- valid_lens -----------------------------------------------------------------------------------------------

BAD_LENS_SHAPES = {
    "B+1": ((B + 1,), [f"(B,) = ({B},)", f"(B, Lq) = ({B}, {LQ})", f"got ({B + 1},)"]),
    "Lq+1": ((B, LQ + 1), [f"(B,) = ({B},)", f"(B, Lq) = ({B}, {LQ})", f"got ({B}, {LQ + 1})"]),
    "3d": ((B, LQ, 1), [f"(B,) = ({B},)", f"(B, Lq) = ({B}, {LQ})", f"got ({B}, {LQ}, 1)"]),
    "0d": ((), [f"(B,) = ({B},)", f"(B, Lq) = ({B}, {LQ})", "got ()"]),
}


@FUNCTIONS
@pytest.mark.parametrize("case", BAD_LENS_SHAPES)
def test_valid_lens_of_the_wrong_shape(attend, case):
    shape, parts = BAD_LENS_SHAPES[case]
    q, k, v = qkv3()
    with pytest.raises(ValueError, match=has("valid_lens must have shape", *parts)):
        attend(q, k, v, valid_lens=torch.ones(shape, dtype=torch.long))


@pytest.mark.parametrize("case", BAD_LENS_SHAPES)
def test_valid_lens_of_the_wrong_shape_in_masked_softmax(case):
    shape, parts = BAD_LENS_SHAPES[case]
    with pytest.raises(ValueError, match=has("valid_lens must have shape", *parts)):
        attnkit.masked_softmax(torch.zeros(B, LQ, LK), torch.ones(shape, dtype=torch.long))


BAD_LENS_VALUES = {
    "negative": (torch.tensor([-1, 2]), ["valid_lens must not be negative", "-1", "[-1, 2]"]),
    "negative_2d": (torch.tensor([[1, 2, 3], [0, -4, 1]]), ["valid_lens must not be negative", "-4", "(2, 3)"]),
    "fractional": (torch.tensor([2.5, 1.0]), ["valid_lens must hold whole numbers", "2.5"]),
    "too_long": (torch.tensor([LK + 1, 2]), [f"at most the number of keys ({LK})", f"got {LK + 1}"]),
    "nan": (torch.tensor([float("nan"), 1.0]), ["valid_lens must hold whole numbers", "nan"]),
}


def _call_with_lens(target, valid_lens):
    if target == "sequence_mask":
        return attnkit.sequence_mask(valid_lens, LK)
    if target == "masked_softmax":
        return attnkit.masked_softmax(torch.zeros(B, LQ, LK), valid_lens)
    q, k, v = qkv3()
    return (dot if target == "sdpa" else additive)(q, k, v, valid_lens=valid_lens)


LENS_TARGETS = pytest.mark.parametrize("target", ["sdpa", "additive", "masked_softmax", "sequence_mask"])


@LENS_TARGETS
@pytest.mark.parametrize("case", BAD_LENS_VALUES)
def test_valid_lens_with_bad_values(target, case):
    valid_lens, parts = BAD_LENS_VALUES[case]
    with pytest.raises(ValueError, match=has(*parts)):
        _call_with_lens(target, valid_lens)


@LENS_TARGETS
def test_valid_lens_of_bool_dtype_is_a_type_error(target):
    with pytest.raises(TypeError, match=has("valid_lens", "whole numbers", "torch.bool")):
        _call_with_lens(target, torch.tensor([True, False]))


@LENS_TARGETS
def test_valid_lens_that_is_not_a_tensor_is_a_type_error(target):
    with pytest.raises(TypeError, match=has("valid_lens must be a tensor", "list")):
        _call_with_lens(target, [1, 2])


def test_sequence_mask_valid_lens_with_three_dims():
    with pytest.raises(ValueError, match=has("valid_lens must have shape (B,) or (B, Lq)", "got (2, 3, 1)")):
        attnkit.sequence_mask(torch.ones(2, 3, 1, dtype=torch.long), LK)


# --- attn_mask, is_causal -------------------------------------------------------------------------------------

BAD_MASKS_4D = [(B, H, LQ, LK + 1), (B + 1, 1, 1, LK), (B, HKV, LQ, LK), (1, B, H, LQ, LK), (LQ + 1, LK)]
BAD_MASKS_3D = [(B, 1, LQ, LK), (1, 1, LQ, LK), (B + 1, LQ, LK), (LQ, LK + 1)]


@FUNCTIONS
@pytest.mark.parametrize("mask_shape", BAD_MASKS_4D, ids=str)
def test_attn_mask_not_broadcastable_to_4d_inputs(attend, mask_shape):
    q, k, v = qkv4()
    target = f"(B, H, Lq, Lk) = {(B, H, LQ, LK)}"
    with pytest.raises(ValueError, match=has(f"attn_mask of shape {mask_shape}", "not broadcastable", target)):
        attend(q, k, v, attn_mask=torch.ones(mask_shape, dtype=torch.bool))


@FUNCTIONS
@pytest.mark.parametrize("mask_shape", BAD_MASKS_3D, ids=str)
def test_attn_mask_not_broadcastable_to_3d_inputs(attend, mask_shape):
    q, k, v = qkv3()
    target = f"(B, Lq, Lk) = {(B, LQ, LK)}"
    with pytest.raises(ValueError, match=has(f"attn_mask of shape {mask_shape}", "not broadcastable", target)):
        attend(q, k, v, attn_mask=torch.ones(mask_shape, dtype=torch.bool))


@pytest.mark.parametrize("mask_shape", [(B, 1, LQ, LK), (LQ, LK + 1)], ids=str)
def test_attn_mask_not_broadcastable_in_masked_softmax(mask_shape):
    target = f"(B, Lq, Lk) = {(B, LQ, LK)}"
    with pytest.raises(ValueError, match=has(f"attn_mask of shape {mask_shape}", "not broadcastable", target)):
        attnkit.masked_softmax(torch.zeros(B, LQ, LK), attn_mask=torch.ones(mask_shape, dtype=torch.bool))


@FUNCTIONS
@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8, torch.int32])
def test_integer_attn_mask_is_a_type_error(attend, dtype):
    q, k, v = qkv3()
    with pytest.raises(TypeError, match=has("attn_mask must be boolean", "floating point", str(dtype))):
        attend(q, k, v, attn_mask=torch.ones(LQ, LK, dtype=dtype))


def test_integer_attn_mask_is_a_type_error_in_masked_softmax():
    with pytest.raises(TypeError, match=has("attn_mask must be boolean", "torch.int64")):
        attnkit.masked_softmax(torch.zeros(B, LQ, LK), attn_mask=torch.ones(LQ, LK, dtype=torch.int64))


@FUNCTIONS
def test_attn_mask_that_is_not_a_tensor_is_a_type_error(attend):
    q, k, v = qkv3()
    with pytest.raises(TypeError, match=has("attn_mask must be a tensor", "list")):
        attend(q, k, v, attn_mask=[[True] * LK] * LQ)


@FUNCTIONS
@pytest.mark.parametrize("is_causal", [1, "yes", None])
def test_is_causal_must_be_a_bool(attend, is_causal):
    q, k, v = qkv3()
    with pytest.raises(TypeError, match=has("is_causal must be a bool", repr(is_causal))):
        attend(q, k, v, is_causal=is_causal)


# --- masked_softmax scores ------------------------------------------------------------------------------------


@pytest.mark.parametrize("scores", [torch.zeros(B, LQ, LK, dtype=torch.int64), [[0.0] * LK]], ids=["int", "list"])
def test_masked_softmax_scores_must_be_a_floating_tensor(scores):
    shown = "torch.int64" if isinstance(scores, torch.Tensor) else "list"
    with pytest.raises(TypeError, match=has("scores must be a floating point tensor", shown)):
        attnkit.masked_softmax(scores)


@pytest.mark.parametrize("shape", [(LQ, LK), (1, B, H, LQ, LK)], ids=str)
def test_masked_softmax_scores_must_have_3_or_4_dims(shape):
    with pytest.raises(ValueError, match=has("scores must be (B, Lq, Lk) or (B, H, Lq, Lk)", str(shape))):
        attnkit.masked_softmax(torch.zeros(shape))


# --- additive w_v ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("w_shape", [(D + 1,), (1, D), (), (D, D)], ids=str)
def test_additive_w_v_of_the_wrong_shape(w_shape):
    q, k, v = qkv3()
    with pytest.raises(ValueError, match=has("w_v must have shape (h,)", f"({D},)", f"got {w_shape}", "q (2, 3, 8)")):
        attnkit.additive_attention(q, k, v, torch.ones(w_shape))


def test_additive_w_v_of_another_dtype_is_a_type_error():
    q, k, v = qkv3()
    with pytest.raises(TypeError, match=has("q and w_v must have the same dtype", "torch.float32", "torch.float64")):
        attnkit.additive_attention(q, k, v, torch.ones(D, dtype=torch.float64))


def test_additive_w_v_on_another_device_raises_before_any_computation():
    q, k, v = qkv3()
    with (
        dispatch.watch(implementations=True) as ran,
        pytest.raises(ValueError, match=has("q and w_v", "same device", "cpu", "meta")),
    ):
        attnkit.additive_attention(q, k, v, torch.ones(D, device="meta"))
    assert ran == []


def test_additive_w_v_that_is_not_a_tensor_is_a_type_error():
    q, k, v = qkv3()
    with pytest.raises(TypeError, match=has("w_v must be a tensor", f"({D},)", "list")):
        attnkit.additive_attention(q, k, v, [1.0] * D)


# --- dropout_p and backend ------------------------------------------------------------------------------------


@FUNCTIONS
@pytest.mark.parametrize("dropout_p", [-0.1, 1.0, 1.5, float("nan")])
def test_dropout_p_outside_zero_one(attend, dropout_p):
    q, k, v = qkv3()
    with pytest.raises(ValueError, match=has("dropout_p must be in [0, 1)", f"got {dropout_p}")):
        attend(q, k, v, dropout_p=dropout_p)


@FUNCTIONS
@pytest.mark.parametrize("backend", ["flash_attn", "Reference", ""])
def test_unknown_backend_lists_the_valid_names(attend, backend):
    q, k, v = qkv3()
    with (
        dispatch.watch(implementations=True) as ran,
        pytest.raises(ValueError, match=has("backend must be", "'auto'", *BACKENDS, repr(backend))),
    ):
        attend(q, k, v, backend=backend)
    assert ran == []


REFUSALS = {
    "chunked_weights": (dot, "tiles:online", {"need_weights": True}, "never returns weights (need_weights=True)"),
    "sdpa_weights": (dot, "sdpa", {"need_weights": True}, "never returns weights (need_weights=True)"),
    "chunked_dropout": (dot, "tiles:online", {"dropout_p": 0.5}, "no dropout (dropout_p=0.5)"),
    "sdpa_additive": (additive, "sdpa", {}, "dot-product scoring only (this call is additive)"),
    "chunked_additive_weights": (additive, "tiles:online", {"need_weights": True}, "never returns weights"),
    "chunked_bias_grad": (
        dot,
        "tiles:online",
        {"attn_mask": torch.zeros(LQ, LK, requires_grad=True)},
        "does not differentiate a float attn_mask that requires grad",
    ),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_named_backend_that_cannot_run_the_call_lists_every_backends_reason_and_never_falls_back(case):
    attend, backend, kw, reason = REFUSALS[case]
    q, k, v = qkv3()
    parts = [f"backend={backend!r} cannot run this call", f"{backend}: {reason}", "reference: can run it", *BACKENDS]
    with dispatch.watch(implementations=True) as ran, pytest.raises(ValueError, match=has(*parts)):
        attend(q, k, v, backend=backend, **kw)
    assert ran == []


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"need_weights": "no"}, "need_weights must be a bool, got 'no'"),
        ({"dropout_p": "0.1"}, "dropout_p must be a number in [0, 1), got '0.1'"),
        ({"scale": "x"}, "scale must be a number, got 'x'"),
    ],
)
def test_options_of_the_wrong_type_name_the_argument(kwargs, match):
    q, k, v = torch.randn(2, 3, 8), torch.randn(2, 4, 8), torch.randn(2, 4, 8)
    with pytest.raises(TypeError, match=re.escape(match)):
        attnkit.scaled_dot_product_attention(q, k, v, **kwargs)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf")])
def test_a_scale_that_is_not_finite_is_a_value_error(scale):
    q, k, v = qkv3()
    with (
        dispatch.watch(implementations=True) as ran,
        pytest.raises(ValueError, match=re.escape(f"scale must be finite, got {scale}")),
    ):
        attnkit.scaled_dot_product_attention(q, k, v, scale=scale)
    with pytest.raises(ValueError, match="scale must be finite"):
        attnkit.functional.attention_weights(q, k, scale=scale)
    assert ran == []


def test_any_real_number_is_a_scale():
    np = pytest.importorskip("numpy")
    q, k, v = qkv3()
    expected = attnkit.scaled_dot_product_attention(q, k, v, scale=0.5).output
    for scale in (np.float32(0.5), np.float64(0.5), np.float16(0.5), __import__("fractions").Fraction(1, 2)):
        out = attnkit.scaled_dot_product_attention(q, k, v, scale=scale).output
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert attnkit.scaled_dot_product_attention(q, k, v, scale=2).output.shape == (B, LQ, D)
    with pytest.raises(TypeError, match="scale must be a number, got True"):
        attnkit.scaled_dot_product_attention(q, k, v, scale=True)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("batch", "queries", "lens_shape"),
    [(0, 3, (0,)), (0, 3, (0, 3)), (2, 0, (2, 0)), (2, 0, (2,)), (0, 3, None), (2, 0, None)],
)
@pytest.mark.parametrize("is_causal", [False, True])
def test_empty_batches_and_query_lengths_give_the_empty_result(backend, batch, queries, lens_shape, is_causal):
    q = torch.randn(batch, H, queries, D, requires_grad=True)
    k = torch.randn(batch, HKV, LK, D, requires_grad=True)
    v = torch.randn(batch, HKV, LK, D + 1, requires_grad=True)
    lens = None if lens_shape is None else torch.zeros(lens_shape, dtype=torch.long)
    out = attnkit.scaled_dot_product_attention(q, k, v, valid_lens=lens, is_causal=is_causal, backend=backend).output
    assert out.shape == (batch, H, queries, D + 1)
    out.sum().backward()
    assert q.grad.shape == q.shape and not k.grad.any() and not v.grad.any()
    if backend == "reference":
        w = attnkit.scaled_dot_product_attention(q, k, v, valid_lens=lens, need_weights=True).weights
        assert w.shape == (batch, H, queries, LK)
    if backend != "sdpa":
        w_v = torch.randn(D)
        assert attnkit.additive_attention(q, k, v, w_v, valid_lens=lens, backend=backend).output.shape == out.shape


def test_additive_chunked_with_an_empty_batch_gives_the_empty_result():
    q, k = torch.randn(0, 3, 4, requires_grad=True), torch.randn(0, 5, 4)
    out = attnkit.additive_attention(q, k, k, torch.randn(4), backend="tiles:online").output
    assert out.shape == (0, 3, 4)
    layer = attnkit.AdditiveAttention(4, query_size=4, key_size=4, backend="tiles:online")
    assert layer(q, k, k).shape == (0, 3, 4)


def test_a_layer_given_a_mask_that_is_not_a_tensor_names_it():
    mha = attnkit.MultiHeadAttention(8, 2)
    x = torch.randn(2, 3, 8)
    with pytest.raises(TypeError, match="attn_mask must be a tensor, got list"):
        mha(x, x, x, attn_mask=[[True] * 3] * 3)


# --- wrong error types found by adversarial testing (issue 22, finding f) -----------------------------------


def test_record_weights_of_something_that_is_not_a_module_is_a_type_error_naming_it():
    with pytest.raises(TypeError, match=has("record_weights", "torch.nn.Module", "str")), attnkit.record_weights("x"):
        pass


@pytest.mark.parametrize("layer", [attnkit.MultiHeadAttention, attnkit.DotProductAttention, attnkit.AdditiveAttention])
def test_a_dropout_that_is_not_a_number_is_a_type_error_naming_dropout(layer):
    sizes = {attnkit.MultiHeadAttention: (8, 2), attnkit.DotProductAttention: (), attnkit.AdditiveAttention: (8,)}
    with pytest.raises(TypeError, match=has("dropout", "'0.1'")):
        layer(*sizes[layer], dropout="0.1")


@pytest.mark.parametrize("book", [False, True], ids=["attnkit", "d2l"])
@pytest.mark.parametrize("kind", ["multihead", "additive"])
def test_inputs_of_another_dtype_than_the_layers_weights_are_a_type_error_naming_both(kind, book):
    """A float32 layer given float64 inputs failed with a matmul RuntimeError (finding f)."""
    from attnkit import d2l

    if kind == "multihead":
        layer = d2l.MultiHeadAttention(8, 2, 0.0) if book else attnkit.MultiHeadAttention(8, 2)
    else:
        layer = d2l.AdditiveAttention(8, 0.0) if book else attnkit.AdditiveAttention(8)
    x = torch.randn(2, 3, 8, dtype=torch.float64)
    for _ in range(2):  # before its sizes are inferred, and after (a float32 call in between)
        with pytest.raises(TypeError, match=has("queries", "torch.float64", "torch.float32")):
            layer(x, x, x, None)
        layer(x.float(), x.float(), x.float(), None)


@pytest.mark.parametrize(("sizes", "error"), [((-1, 3), ValueError), ((2, -4), ValueError), ((2.0, 3), TypeError)])
def test_causal_mask_of_a_bad_size_names_it(sizes, error):
    """A negative size was a RuntimeError from torch.arange (finding f)."""
    with pytest.raises(error, match="num_queries|num_keys"):
        attnkit.causal_mask(*sizes)


@pytest.mark.parametrize("which", ["mask_mod", "score_mod"])
def test_a_modifier_with_the_wrong_number_of_parameters_is_a_type_error_naming_its_signature(which):
    q = torch.randn(1, 1, 3, 4)
    wrong = {"mask_mod": lambda b, h, q_idx: q_idx >= 0, "score_mod": lambda s, b, h: s}[which]
    signature = {"mask_mod": "mask_mod(b, h, q_idx, kv_idx)", "score_mod": "score_mod(score, b, h, q_idx, kv_idx)"}
    with pytest.raises(TypeError, match=has(which, signature[which], "3 parameters")):
        attnkit.scaled_dot_product_attention(q, q, q, **{which: wrong})


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_alibi_slopes_that_are_not_finite_are_refused_as_sinks_are(bad):
    """NaN ALiBi slopes were accepted (NaN sinks are refused): finding i."""
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match="alibi: slopes must be finite"):
        attnkit.scaled_dot_product_attention(q, q, q, score_mod=mods.alibi(torch.tensor([0.5, bad])))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_scale_beyond_the_compute_dtype_is_refused(dtype):
    """scale=1e300 is finite in Python but infinite in float32, where the scores are computed: it gave NaN
    (finding i). float64 inputs compute in float64, where it is a scale like any other."""
    q = torch.randn(1, 2, 3, 4, dtype=dtype)
    with pytest.raises(ValueError, match=has("scale", "1e+300", "float32")):
        attnkit.scaled_dot_product_attention(q, q, q, scale=1e300)
    out = attnkit.scaled_dot_product_attention(q.double(), q.double(), q.double(), scale=1e300).output
    assert torch.isfinite(out).all()


def test_alibi_slopes_whose_bias_would_overflow_are_refused():
    """A finite slope times a distance could overflow to -inf on sdpa and decode, hiding a key whose NaN value
    then reached the output (reference and chunked zero such keys; the bias is never allowed to get there)."""
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match="alibi: slopes times the farthest distance"):
        attnkit.scaled_dot_product_attention(q, q, q, score_mod=mods.alibi(torch.tensor([1e38, 0.5])))


@pytest.mark.parametrize("backend", ["sdpaa", 3])
def test_a_layer_given_a_backend_that_does_not_exist_says_so_when_it_is_made(backend):
    """It used to be accepted and fail at the first forward (after a KVCache had been written to)."""
    error = TypeError if not isinstance(backend, str) else ValueError
    with pytest.raises(error, match="backend must be 'auto' or one of"):
        attnkit.MultiHeadAttention(8, 2, backend=backend)


def test_a_function_of_the_wrong_arity_inside_and_masks_is_said_when_it_is_combined():
    with pytest.raises(TypeError, match=has("mask_mod must take 4 parameters", "3 parameters")):
        mods.and_masks(mods.sliding_window(2), lambda b, h, q_idx: q_idx >= 0)
