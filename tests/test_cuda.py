"""Every backend a device offers, the layers with a cache, and the statistics, run on that device against the
float64 math on the host: ``cpu`` here at small sizes (which keeps these tests honest where no GPU is), ``cuda`` as
``gpu`` tests (issue 28: the suite on a lent GPU)."""

from __future__ import annotations

import pytest
import torch

import attnkit
import mathref
from agreement import bounds
from attnkit import dispatch, mods
from attnkit.backends.tiles import online
from cases import make_masking
from mathref import max_err

# B batch, H heads, Hkv key/value heads, Lq/Lk query/key length, D head dim, Dv value head dim
DEVICES = [
    pytest.param("cpu"),
    pytest.param(
        "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
    ),
]
MASKINGS = ("none", "valid_lens_2d+causal", "bool_mask+float_mask", "window")
SKIPPED_ON_CPU = {"tiles:compiled"}  # compiles seconds per shape; tests/test_tiles_compiled*.py cover it on CPU
OUT_TOL, GRAD_TOL = bounds("sdpa", torch.float32)  # float32 against float64, as every engine declares


def _kwargs(masking: str, Lq: int, Lk: int, g: torch.Generator, device: str) -> tuple[dict, dict]:
    """attnkit's keyword arguments on the device, and the math's on the host."""
    if masking == "window":
        return {"mask_mod": mods.sliding_window(3)}, {"mask_mod": mathref.sliding_window(3, Lq, Lk)}
    kw = make_masking(masking, Lq, Lk, g)
    return {n: t.to(device) if isinstance(t, torch.Tensor) else t for n, t in kw.items()}, kw


def _run(backend: str, leaves: list[torch.Tensor], w_v: bool, kw: dict, grad_out: torch.Tensor):
    """Output and gradients, or None when the backend refuses the call (then without autograd, forward only)."""
    fn = attnkit.additive_attention if w_v else attnkit.scaled_dot_product_attention
    inputs = [t.detach().clone().requires_grad_() for t in leaves]
    try:
        with online.settings(block_size=8):
            out = fn(*inputs, backend=backend, **kw).output
        return out, torch.autograd.grad(out, inputs, grad_out)
    except ValueError as e:
        if "cannot run this call" not in str(e):
            raise
    try:
        with torch.no_grad():
            return fn(*leaves, backend=backend, **kw).output, None
    except ValueError as e:
        if "cannot run this call" not in str(e):
            raise
        return None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scoring", ["dot", "additive"])
def test_every_backend_of_the_device_matches_the_float64_math(device, scoring):
    g = torch.Generator().manual_seed(0)
    B, H, Hkv, Lq, Lk, D = 2, 8, 2, 9, 21, 8  # (B and H: those make_masking builds masks for)
    q = torch.randn(B, H, Lq, D, generator=g)
    k, v = torch.randn(B, Hkv, Lk, D, generator=g), torch.randn(B, Hkv, Lk, D + 3, generator=g)
    leaves = [q, k, v] + ([torch.randn(D, generator=g)] if scoring == "additive" else [])
    ran: dict[str, int] = {}
    for masking in MASKINGS:
        kw, math_kw = _kwargs(masking, Lq, Lk, g, device)
        leaves64 = [t.double().requires_grad_() for t in leaves]
        if "mask_mod" in math_kw:
            truth, _ = mathref.attention_mods(*leaves64[:3], w_v=leaves64[3] if len(leaves) > 3 else None, **math_kw)
        else:
            truth, _ = mathref.attention(*leaves64[:3], w_v=leaves64[3] if len(leaves) > 3 else None, **math_kw)
        grad_out = torch.randn(truth.shape, generator=g, dtype=torch.float64)
        true_grads = torch.autograd.grad(truth, leaves64, grad_out)
        for backend in dispatch.available_backends(device, implementations=True):
            if device == "cpu" and backend in SKIPPED_ON_CPU:
                continue
            on_device = [t.to(device) for t in leaves]
            found = _run(backend, on_device, scoring == "additive", kw, grad_out.float().to(device))
            if found is None:
                continue
            out, grads = found
            ran[backend] = ran.get(backend, 0) + 1
            where = f"{backend} on {device}, {masking}"
            assert out.device.type == device and max_err(out.cpu(), truth) <= OUT_TOL, where
            for name, grad, true in zip("qkvw", grads or (), true_grads, strict=False):
                assert max_err(grad.cpu(), true) <= GRAD_TOL * max(1.0, true.abs().max().item()), f"d{name}: {where}"
    expected = {"reference", "tiles:online", "graph"} | ({"sdpa"} if scoring == "dot" else set())
    if device == "cuda":
        expected |= {"tiles:flex"} if scoring == "dot" else {"triton"}
    assert expected <= set(ran), ran


@pytest.mark.parametrize("device", DEVICES)
def test_decoding_through_a_static_cache_equals_the_full_forward(device):
    torch.manual_seed(0)
    mha = attnkit.MultiHeadAttention(32, 4, num_kv_heads=2, query_size=32, key_size=32, value_size=32).to(device)
    seq = torch.randn(2, 40, 32, device=device)  # (B, L, E)
    cache = attnkit.KVCache(max_len=64)
    with torch.no_grad():
        want = mha(seq, seq, seq, is_causal=True)  # (B, L, E)
        first = mha(seq[:, :31], seq[:, :31], seq[:, :31], is_causal=True, cache=cache)  # (B, 31, E)
        steps = [mha(x, x, x, is_causal=True, cache=cache) for x in seq[:, 31:].split(1, dim=1)]
    assert max_err(torch.cat([first, *steps], dim=1).cpu(), want.cpu()) <= OUT_TOL


@pytest.mark.parametrize("device", DEVICES)
def test_statistics_on_the_device_equal_those_of_the_recorded_weights(device):
    torch.manual_seed(0)
    mha = attnkit.MultiHeadAttention(32, 4, query_size=32, key_size=32, value_size=32).to(device)
    x = torch.randn(2, 50, 32, device=device)  # (B, L, E)
    lens = torch.tensor([50, 23], device=device)
    with torch.no_grad(), attnkit.record_stats(mha, topk=4) as rec, attnkit.record_weights(mha) as weights:
        mha(x, x, x, lens, is_causal=True)
    found, w = rec[""], weights[""].double().cpu()  # (B, H, Lq, Lk)
    assert found.topk_values.device.type == device
    assert max_err(found.topk_values.cpu(), w.topk(4, dim=-1).values) <= 1e-5
    entropy = -(w * torch.where(w > 0, w.log(), 0.0)).sum(-1)  # (B, H, Lq)
    assert max_err(found.entropy.cpu(), entropy) <= 1e-4
    assert max_err(found.column_sum.cpu(), w.sum(-2)) <= 1e-4
