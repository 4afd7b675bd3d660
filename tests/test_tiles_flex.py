"""The flex backend: PyTorch's FlexAttention on CUDA. Its mapping of attnkit's masks and modifiers (valid_lens,
bottom-right causal, bool and float masks, mask_mod, score_mod, GQA, dead rows) is checked on CPU by running
FlexAttention eagerly, forward only (PyTorch has no CPU backward for it); forward, backward and the choice of
``auto`` on CUDA are ``gpu`` tests, skipped without CUDA."""

from __future__ import annotations

import warnings

import pytest
import torch
from tests.mathref import max_err

import attnkit
from attnkit import dispatch, mods
from attnkit.backends.contract import Call
from attnkit.backends.tiles import flex
from attnkit.masks import Mask

# B batch, H heads, Hkv key/value heads, Lq/Lk query/key length, D head dim

pytestmark = pytest.mark.skipif(flex._flex is None, reason="this PyTorch has no flex_attention")

B, H, HKV, LQ, LK, D = 2, 4, 2, 37, 53, 16
G = torch.Generator().manual_seed(0)
IDS_Q = torch.randint(0, 3, (B, LQ), generator=G).sort().values
IDS_K = torch.randint(0, 3, (B, LK), generator=G).sort().values

CASES = {
    "causal": dict(is_causal=True),
    "window": dict(mask_mod=mods.sliding_window(9)),
    "documents, causal": dict(mask_mod=mods.document(IDS_Q, IDS_K), is_causal=True),
    "softcap, 2-D valid_lens with empty rows": dict(
        score_mod=mods.softcap(2.0), valid_lens=torch.randint(0, 5, (B, LQ), generator=G)
    ),
    "alibi, bool and float masks": dict(
        score_mod=mods.alibi(mods.alibi_slopes(H)),
        attn_mask=torch.rand(B, 1, LQ, LK, generator=G) > 0.2,
    ),
    "float mask with -inf, prefix_lm": dict(
        attn_mask=torch.randn(B, 1, LQ, LK, generator=G).masked_fill(
            torch.rand(B, 1, LQ, LK, generator=G) > 0.7, -torch.inf
        ),
        mask_mod=mods.prefix_lm(torch.tensor([4, 9])),
    ),
}


def _inputs(device: str = "cpu", dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, H, LQ, D, generator=g, dtype=dtype)
    k = torch.randn(B, HKV, LK, D, generator=g, dtype=dtype)
    v = torch.randn(B, HKV, LK, 8, generator=g, dtype=dtype)
    return tuple(t.to(device) for t in (q, k, v))


def _moved(kw: dict, device: str) -> dict:
    def move(x):
        if isinstance(x, torch.Tensor):
            return x.to(device)
        if isinstance(x, mods.document):
            return mods.document(x.ids_q.to(device), None if x.ids_k is None else x.ids_k.to(device))
        if isinstance(x, mods.prefix_lm):
            return mods.prefix_lm(x.prefix_lens.to(device))
        if isinstance(x, mods.alibi):
            return mods.alibi(x.slopes.to(device))
        return x

    return {name: move(x) for name, x in kw.items()}


def _reference(q, k, v, kw):
    wide = {n: (x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x) for n, x in kw.items()}
    return attnkit.scaled_dot_product_attention(q.double(), k.double(), v.double(), backend="reference", **wide).output


@pytest.mark.parametrize("name", list(CASES))
def test_the_mapping_to_flex_attention_matches_the_reference_on_cpu(name):
    """FlexAttention run eagerly on CPU with the mask function and score function attnkit builds for the call."""
    kw = CASES[name]
    q, k, v = _inputs()
    mask = Mask.build(
        batch=B,
        heads=H,
        num_queries=LQ,
        num_keys=LK,
        valid_lens=kw.get("valid_lens"),
        attn_mask=kw.get("attn_mask"),
        is_causal=kw.get("is_causal", False),
        mask_mod=kw.get("mask_mod"),
        device=q.device,
    )
    score_mod = kw.get("score_mod")
    if score_mod is not None:
        score_mod = mods.bind(score_mod, batch=B, heads=H, num_queries=LQ, num_keys=LK, device=q.device)
    call = Call(q, k, v, mask, scale=D**-0.5, score_mod=score_mod)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # FlexAttention warns that it runs uncompiled
        out = flex.run(call, compiled=False)
    assert max_err(out, _reference(q, k, v, kw)) <= 2e-6


def test_flex_is_declared_cuda_only_and_named_on_cpu_lists_the_reason():
    q, k, v = _inputs()
    assert "on cuda only" in dispatch.describe_backends()["tiles:flex"]
    with pytest.raises(ValueError, match=r"flex: runs on cuda only \(the inputs are on cpu\)"):
        attnkit.scaled_dot_product_attention(q, k, v, mask_mod=mods.sliding_window(4), backend="tiles:flex")
    with dispatch.watch(implementations=True) as ran:
        attnkit.scaled_dot_product_attention(q, k, v, mask_mod=mods.sliding_window(4))
    assert ran != ["tiles:flex"]


CUDA = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("name", [pytest.param(n, marks=CUDA) for n in CASES])
def test_flex_on_cuda_forward_and_backward_match_the_reference(name):
    kw = _moved(CASES[name], "cuda")
    q, k, v = (t.requires_grad_() for t in _inputs("cuda"))
    with dispatch.watch(implementations=True) as ran:
        out = attnkit.scaled_dot_product_attention(q, k, v, **kw).output
    assert ran == ["tiles:flex"]
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = _reference(q64, k64, v64, kw)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    assert max_err(out, ref) <= 2e-5
    for g, rg in zip(grads, ref_grads, strict=True):
        assert max_err(g, rg) <= 1e-4
