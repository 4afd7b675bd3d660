"""Which backend runs: the auto policy, explicit choices, and what runs here."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import attnkit
from attnkit import dispatch, mods

# the tile engine's implementations that run on the CPU (its kernel where it builds)
ENGINES_ON_CPU = [
    name
    for name, engine in dispatch.ENGINES.items()
    if name.startswith("tiles:") and "cpu" in (engine.SUPPORTS.devices or {"cpu"})
]


def _qkv(B=2, H=4, Lq=5, Lk=6, D=8, heads=True):
    if heads:
        return torch.randn(B, H, Lq, D), torch.randn(B, H, Lk, D), torch.randn(B, H, Lk, D)
    return torch.randn(B, Lq, D), torch.randn(B, Lk, D), torch.randn(B, Lk, D)


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        ({}, "sdpa"),
        ({"valid_lens": torch.tensor([2, 3]), "is_causal": True}, "sdpa"),
        ({"need_weights": True}, "reference"),
        ({"dropout_p": 0.1}, "sdpa"),
    ],
)
def test_auto_for_dot_product(kwargs, expected):
    with dispatch.watch(implementations=True) as ran:
        attnkit.scaled_dot_product_attention(*_qkv(Lq=17), **kwargs)
    assert ran == [expected]


def test_auto_gives_a_masked_call_of_a_few_queries_to_the_decode_step():
    """sdpa's kernels add a mask as -inf, so it would first read every key again to bound the hidden scores; a call
    of at most 16 queries per key/value head with a mask runs the decode step, which masks by filling, instead
    (with autograd, or unmasked, sdpa)."""
    q, k, v = _qkv(Lq=5)
    lens = torch.tensor([2, 3])
    with dispatch.watch(implementations=True) as ran:
        attnkit.scaled_dot_product_attention(q, k, v, valid_lens=lens)
        attnkit.scaled_dot_product_attention(q, k, v)
        attnkit.scaled_dot_product_attention(q.requires_grad_(), k, v, valid_lens=lens)
    assert ran == ["decode", "sdpa", "sdpa"]


def test_auto_for_additive_small_is_reference_and_large_is_the_tile_engine():
    q, k, v = _qkv(heads=False)
    with dispatch.watch(implementations=True) as ran:
        attnkit.additive_attention(q, k, v, torch.randn(8))
    assert ran == ["reference"]
    q, k, v = _qkv(B=2, Lq=256, Lk=256, D=64, heads=False)  # 2*256*256*64 = 2**23 feature elements
    with dispatch.watch(implementations=True) as ran:
        attnkit.additive_attention(q, k, v, torch.randn(64))
        attnkit.additive_attention(q, k, v, torch.randn(64), dropout_p=0.1)  # the tile engine has no dropout
    assert ran == ["tiles:online", "reference"]


def test_auto_gives_alibi_to_the_tile_engine_where_sdpa_would_hold_a_large_dense_bias():
    """ALiBi as SDPA's ``(H, Lq, Lk)`` bias below DENSE_BIAS_FROM elements, on the tile engine from it (float64 here,
    where the C++ kernel does not run; reviewer's finding: every size went to the dense bias, 1.2x the time and 3x
    the memory at L=1024)."""
    slopes = mods.alibi_slopes(8).double()
    with dispatch.watch(implementations=True) as ran:
        for L in (64, 512):  # 8 * 64 * 64 = 2**15 elements; 8 * 512 * 512 = 2**21
            q, k, v = (torch.randn(1, 8, L, 16, dtype=torch.float64) for _ in range(3))
            attnkit.scaled_dot_product_attention(q, k, v, is_causal=True, score_mod=mods.alibi(slopes))
    assert 8 * 64 * 64 < dispatch.DENSE_BIAS_FROM <= 8 * 512 * 512
    assert ran == ["sdpa", "tiles:online"]


def test_auto_gives_large_bfloat16_calls_to_the_kernel_where_the_cpu_has_bfloat16_dot_products(monkeypatch):
    """bfloat16 from BF16_KERNEL_FROM scores on: the C++ kernel, whose products run on AVX512-BF16 (SDPA computes
    bfloat16 in float32 here); below it, or on a CPU without them, SDPA; never a decode step's few queries."""
    monkeypatch.setattr(dispatch, "BF16_KERNEL_FROM", 4 * 300 * 300)
    monkeypatch.setattr(dispatch, "_bf16_dot_products", lambda: True)
    q, k, v = (torch.randn(1, 4, 300, 16).bfloat16() for _ in range(3))
    with dispatch.watch(implementations=True) as ran:
        attnkit.scaled_dot_product_attention(q, k, v, is_causal=True)
        attnkit.scaled_dot_product_attention(q[:, :, :299], k, v)  # below the threshold
        attnkit.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
        monkeypatch.setattr(dispatch, "_bf16_dot_products", lambda: False)
        attnkit.scaled_dot_product_attention(q, k, v, is_causal=True)
    expected = "tiles:kernel" if dispatch.ENGINES["tiles:kernel"].missing(None) is None else "tiles:online"
    assert ran == [expected, "sdpa", "sdpa", "sdpa"]


def test_the_tile_engine_named_runs_its_kernel_where_it_can():
    """backend='tiles': the policy's reasons among its implementations, then the first that can run the call (the
    C++ kernel in float32 on the CPU where it builds; reviewer's finding: the eager steps always ran)."""
    from attnkit import csrc

    expected = "tiles:kernel" if csrc.ensure("flash") is None else "tiles:online"
    with dispatch.watch(implementations=True) as ran:
        attnkit.scaled_dot_product_attention(*_qkv(Lq=40, Lk=40), is_causal=True, backend="tiles")
        attnkit.scaled_dot_product_attention(*(t.double() for t in _qkv(Lq=40, Lk=40)), backend="tiles")
    assert ran == [expected, "tiles:online"]


def test_explicit_backend_runs_as_named():
    """A backend named runs the call; the tile engine named runs it on one of its implementations; an
    implementation named runs it."""
    for name in [*attnkit.available_backends("cpu"), *ENGINES_ON_CPU]:
        with dispatch.watch(implementations=True) as ran:
            attnkit.scaled_dot_product_attention(*_qkv(), backend=name)
        assert ran == [name] if name != "tiles" else len(ran) == 1 and ran[0].startswith("tiles:")


def test_a_backend_the_tile_engine_took_in_says_what_replaced_it():
    for old, new in dispatch.REPLACED.items():
        with pytest.raises(ValueError, match=rf"backend='{old}' is now part of the tile engine: backend='{new}'"):
            attnkit.scaled_dot_product_attention(*_qkv(), backend=old)


def test_explicit_backend_never_falls_back_and_lists_every_reason():
    with pytest.raises(ValueError) as info, dispatch.watch(implementations=True) as ran:
        attnkit.scaled_dot_product_attention(*_qkv(), backend="tiles:online", need_weights=True, dropout_p=0.2)
    message = str(info.value)
    assert "backend='tiles:online' cannot run this call" in message
    assert "tiles:online: never returns weights (need_weights=True); no dropout (dropout_p=0.2)" in message
    assert "sdpa: never returns weights (need_weights=True)" in message
    assert "reference: can run it" in message
    assert ran == []


def test_sdpa_refuses_additive():
    q, k, v = _qkv(heads=False)
    with pytest.raises(ValueError, match="sdpa: dot-product scoring only"):
        attnkit.additive_attention(q, k, v, torch.randn(8), backend="sdpa")


def test_the_tile_engine_refuses_a_float_mask_that_requires_grad():
    bias = torch.zeros(5, 6, requires_grad=True)
    with pytest.raises(ValueError, match="tiles:online: does not differentiate a float attn_mask"):
        attnkit.scaled_dot_product_attention(*_qkv(), attn_mask=bias, backend="tiles:online")
    with dispatch.watch(implementations=True) as ran:
        out = attnkit.scaled_dot_product_attention(*_qkv(), attn_mask=bias).output
    out.sum().backward()
    assert ran == ["sdpa"] and bias.grad is not None


def test_watch_records_nothing_outside_its_block():
    with dispatch.watch(implementations=True) as ran:
        pass
    attnkit.scaled_dot_product_attention(*_qkv())
    assert ran == []


@pytest.mark.parametrize("name", [*attnkit.available_backends("cpu"), *ENGINES_ON_CPU])
def test_each_backend_runs_what_it_declares_and_refuses_the_rest(name):
    """SUPPORTS is data dispatch reads: it must match what the engine does. Each capability declared runs when
    the engine is named (the tile engine's on one of its implementations); each one not declared is refused with a
    ValueError, never run or fallen back from."""
    supports = dispatch.BACKENDS[name].SUPPORTS if name in dispatch.BACKENDS else dispatch.ENGINES[name].SUPPORTS
    q, k, v = _qkv(heads=False)
    bias = torch.zeros(5, 6, requires_grad=True)
    attend = attnkit.scaled_dot_product_attention
    plain = attend(q, k, v, backend="reference").output

    def weights():
        assert attend(q, k, v, backend=name, need_weights=True).weights is not None

    def dropout():
        torch.manual_seed(0)
        out = attend(q, k, v, backend=name, dropout_p=0.5).output
        assert (out - plain).abs().max() > 1e-2  # applied, not ignored (rounding differs by 1e-6)

    def bias_grad():
        attend(q, k, v, backend=name, attn_mask=bias).output.sum().backward()
        assert bias.grad is not None

    def applied(**modifier):  # the modifier changes the output: run, not ignored
        assert (attend(q, k, v, backend=name, **modifier).output - plain).abs().max() > 1e-3

    long = torch.randn(1, 4097, 8)  # 4097^2 pairs: over sdpa's dense-mask limit
    seventeen = torch.randn(2, 17, 8)  # 17 queries, one head: more than a decode step's

    def huge_hidden_scores():  # key 5 is finite but huge and hidden: its scores overflow, the others' do not
        hidden = torch.ones(5, 6, dtype=torch.bool)
        hidden[:, 5] = False
        huge = torch.cat([k[:, :5], torch.full_like(k[:, :1], 3e38)], dim=1)  # (2, 6, 8)
        out = attend(q.abs(), huge, v, backend=name, attn_mask=hidden).output
        assert torch.isfinite(out).all()

    def autograd():
        leaf = q.clone().requires_grad_()
        attend(leaf, k, v, backend=name).output.sum().backward()
        assert leaf.grad is not None

    calls = {
        "additive scoring": lambda: attnkit.additive_attention(q, k, v, torch.randn(8), backend=name),
        "dot-product scoring": lambda: attend(q, k, v, backend=name),
        "weights": weights,
        "dropout": dropout,
        "bias grad": bias_grad,
        "mask_mod": lambda: applied(mask_mod=mods.sliding_window(2)),
        "score_mod": lambda: applied(score_mod=mods.softcap(0.5)),
        "score_mod that is a bias": lambda: applied(score_mod=mods.alibi(torch.ones(1))),
        "score_mod of the caller's": lambda: applied(score_mod=lambda s, b, h, q_idx, kv_idx: s * 0.5),
        "score_mod on the distance": lambda: applied(
            score_mod=lambda s, b, h, q_idx, kv_idx: s - (q_idx - kv_idx) ** 2
        ),
        "sinks": lambda: applied(sinks=torch.full((1,), 2.0)),
        "a long mask_mod": lambda: attend(long, long, long, backend=name, mask_mod=mods.sliding_window(2)),
        "autograd": autograd,
        "17 queries per key/value head": lambda: attend(seventeen, k, v, backend=name),
        "bfloat16": lambda: attend(q.bfloat16(), k.bfloat16(), v.bfloat16(), backend=name),
        "huge hidden scores": huge_hidden_scores,
    }
    declared = {
        "additive scoring": "additive" in supports.scoring,
        "dot-product scoring": "dot-product" in supports.scoring,
        "weights": supports.weights,
        "dropout": supports.dropout,
        "bias grad": supports.bias_grad,
        "mask_mod": supports.mask_mod,
        "score_mod": supports.score_mod in ("any", "kernel"),  # (the call's score_mod is softcap)
        "score_mod that is a bias": supports.score_mod in ("any", "bias", "kernel"),  # (ALiBi: on the distance)
        "score_mod of the caller's": supports.score_mod == "any",
        "score_mod on the distance": supports.score_mod in ("any", "kernel"),
        "sinks": supports.sinks,
        "a long mask_mod": supports.mask_mod and (supports.dense_mask_limit or 2**30) >= 4097**2,
        "autograd": supports.grad,
        "17 queries per key/value head": (supports.max_queries or 17) >= 17,
        "bfloat16": supports.dtypes is None or torch.bfloat16 in supports.dtypes,
        "huge hidden scores": supports.huge_scores,
    }
    for what, run in calls.items():
        with dispatch.watch(implementations=True) as ran:
            if declared[what]:
                run()
            else:
                with pytest.raises(ValueError, match=f"backend='{name}' cannot run this call"):
                    run()
        if name == "tiles" and declared[what]:  # one of its implementations
            assert len(ran) == 1 and ran[0].startswith("tiles:"), what
        else:
            assert ran == ([name] if declared[what] else []), what
    assert dispatch.describe_backends()[name] == supports.describe()


def test_the_call_names_every_backend_in_its_docstring():
    """``backend=``'s documented names are the dispatcher's (the list had fallen behind: no flash, compiled,
    triton or graph)."""
    doc = attnkit.scaled_dot_product_attention.__doc__ or ""
    documented = doc[doc.index("backend:") : doc.index("mask_mod:")]
    assert [name for name in dispatch.BACKENDS if f'``"{name}"``' not in documented] == []


def test_a_kernel_is_not_built_to_explain_a_call_it_could_not_run_anyway(monkeypatch):
    """An engine's ``missing`` (which looks into the call) is asked last, only for a call nothing else refuses:
    explaining a float64 call sent to ``tiles:kernel`` asks nothing; and it builds nothing (the kernel is built when
    it first runs a call)."""
    from attnkit.backends.tiles import kernel

    asked = []
    supports = dataclasses.replace(kernel.SUPPORTS, missing=lambda call: asked.append(1) or None)
    monkeypatch.setattr(kernel, "SUPPORTS", supports)
    q = torch.randn(1, 2, 5, 4, dtype=torch.float64)
    with pytest.raises(
        ValueError, match=r"tiles:kernel: bfloat16 or float16 or float32 only \(the inputs are float64\)"
    ):
        attnkit.scaled_dot_product_attention(q, q, q, backend="tiles:kernel")
    assert asked == []
    attnkit.scaled_dot_product_attention(q.float(), q.float(), q.float(), backend="tiles:kernel")
    assert asked  # a call it can run asks


def test_a_refusal_names_the_engine_asked_for_first_and_survives_a_score_mod_that_raises():
    """backend='sdpa' with a score_mod that takes single scores only: the message starts with sdpa's own reason, and
    an engine whose question runs the function (tiles:compiled) reports what it raised as its reason (reviewer's
    finding: the function's error came out instead of the refusal)."""

    def single(score, b, h, q_idx, kv_idx):
        return score * float(h)  # a Python number of an index: one element at a time only

    with pytest.raises(ValueError) as refused:
        attnkit.scaled_dot_product_attention(*_qkv(Lq=300, Lk=300), score_mod=single, backend="sdpa")
    message = str(refused.value)
    assert message.startswith("backend='sdpa' cannot run this call: sdpa: a score_mod only when it is a bias")
    assert "tiles:online: can run it" in message
    with pytest.raises(ValueError, match="decode: .*under torch.no_grad"):
        attnkit.scaled_dot_product_attention(*_qkv(Lq=1, Lk=300), score_mod=single, backend="decode")
