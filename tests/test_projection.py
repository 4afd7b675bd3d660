"""The layers' projections at decode sizes (attnkit._projection): stacked self-attention projections and the
two-halves product for a few rows give the modules' results, and step aside for anything that observes the
modules (hooks, wrappers, autograd)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import attnkit
from attnkit import _projection

# B batch, L length, E features

TOL = {"atol": 1e-5, "rtol": 1e-5}  # float32 products of <= 512 terms, summed in other orders


@pytest.mark.parametrize("rows", [1, 2, 3, 16, 17, 40])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_equals_the_module(rows: int, bias: bool) -> None:
    torch.manual_seed(0)
    m = nn.Linear(512, 384, bias=bias)
    x = torch.randn(rows, 1, 512)  # (B, L, E)
    with torch.no_grad():
        torch.testing.assert_close(_projection.linear(x, m), m(x), **TOL)


def test_stacked_equals_the_modules_and_follows_parameter_changes() -> None:
    torch.manual_seed(0)
    owner = nn.Module()
    ms = (nn.Linear(64, 64), nn.Linear(64, 16, bias=False), nn.Linear(64, 16))
    x = torch.randn(2, 1, 64)  # (B, L, E)
    with torch.no_grad():
        for change in (
            lambda: None,
            lambda: ms[0].weight.add_(1.0),  # an optimizer step: in place
            lambda: setattr(ms[2], "weight", nn.Parameter(torch.randn(16, 64))),  # replaced
        ):
            change()
            got = _projection.stacked(x, ms, owner)
            for g, m in zip(got, ms, strict=True):
                torch.testing.assert_close(g, m(x), **TOL)
    owner_ms = nn.ModuleList(ms).double()  # `.to()` swaps the parameters' data
    with torch.no_grad():
        got = _projection.stacked(x.double(), tuple(owner_ms), owner)
    assert all(g.dtype == torch.float64 for g in got)
    torch.testing.assert_close(got[1], owner_ms[1](x.double()))


def test_hooks_wrappers_and_autograd_call_the_modules() -> None:
    torch.manual_seed(0)
    mha = attnkit.MultiHeadAttention(32, 4).eval()
    x = torch.randn(1, 1, 32)  # (B, L, E)
    seen = []
    handle = mha.W_k.register_forward_hook(lambda m, i, o: seen.append(o.shape))
    with torch.no_grad():
        mha(x, x, x)
    assert seen == [torch.Size([1, 1, 32])]
    handle.remove()

    class Scaled(nn.Linear):  # a LoRA-like wrapper: its forward must run
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return 2 * super().forward(x)

    plain = attnkit.MultiHeadAttention(32, 4).eval()
    plain.load_state_dict(mha.state_dict())
    wrapped = Scaled(32, 32, bias=False)
    wrapped.load_state_dict(mha.W_v.state_dict())
    mha.W_v = wrapped
    with torch.no_grad():
        assert not torch.allclose(mha(x, x, x), plain(x, x, x))

    out = plain(x, x, x)  # autograd: every weight gets its gradient through the modules
    out.sum().backward()
    assert all(p.grad is not None for p in plain.parameters())


def test_self_attention_decode_equals_separate_projections() -> None:
    """The same input passed three times (one object, or the same slice written three times) takes the stacked
    product; the result equals the layer fed three different-object copies (separate products)."""
    torch.manual_seed(0)
    mha = attnkit.MultiHeadAttention(64, 4).eval()
    x = torch.randn(2, 9, 64)  # (B, L, E)
    with torch.no_grad():
        t = 5
        stacked = mha(x[:, t : t + 1], x[:, t : t + 1], x[:, t : t + 1])
        separate = mha(x[:, t : t + 1], x[:, t : t + 1].clone(), x[:, t : t + 1].clone())
    torch.testing.assert_close(stacked, separate, **TOL)
    assert _projection.same(x[:, t : t + 1], x[:, t : t + 1])
    assert not _projection.same(x[:, t : t + 1], x[:, t + 1 : t + 2])


def test_a_write_through_data_between_generations_is_seen() -> None:
    """The stacked weights live on the KVCache, one generation: an EMA-style update through ``.data`` (which
    PyTorch does not count as a change) between two generations, with a new cache or after reset(), is used."""
    torch.manual_seed(0)
    mha = attnkit.MultiHeadAttention(32, 4).eval()
    x = torch.randn(2, 5, 32)  # (B, L, E)
    for fresh in (lambda c: attnkit.KVCache(), lambda c: c.reset() or c):
        cache = attnkit.KVCache()
        with torch.no_grad():
            mha(x, x, x, is_causal=True, cache=cache)
            for p in mha.parameters():
                p.data.mul_(0.5).add_(0.1)  # the EMA update
            cache = fresh(cache)
            got = mha(x, x, x, is_causal=True, cache=cache)
            torch.testing.assert_close(got, mha(x, x, x.clone(), is_causal=True), **TOL)
