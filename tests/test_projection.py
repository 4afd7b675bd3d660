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


class _Ongoing:
    is_empty = False


def test_stacked_equals_the_modules_and_follows_parameter_changes() -> None:
    torch.manual_seed(0)
    stacked = _projection.Stacked()
    generation = _Ongoing()  # a cache in the middle of a generation: only parameter changes rebuild the weights
    ms = (nn.Linear(64, 64), nn.Linear(64, 16, bias=False), nn.Linear(64, 16))
    x = torch.randn(2, 1, 64)  # (B, L, E)
    with torch.no_grad():
        for change in (
            lambda: None,
            lambda: ms[0].weight.add_(1.0),  # an optimizer step: in place
            lambda: setattr(ms[2], "weight", nn.Parameter(torch.randn(16, 64))),  # replaced
        ):
            change()
            got = stacked(x, ms, cache=generation)
            for g, m in zip(got, ms, strict=True):
                torch.testing.assert_close(g, m(x), **TOL)
    owner_ms = nn.ModuleList(ms).double()  # `.to()` swaps the parameters' data
    with torch.no_grad():
        got = stacked(x.double(), tuple(owner_ms), cache=generation)
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
    """The stacked weights are made again at each generation (a call that finds its KVCache empty): an EMA-style
    update through ``.data`` (which PyTorch does not count as a change) between two generations, with a new cache
    or after reset(), is used."""
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


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("decoding", [False, True], ids=["call", "decode step"])
def test_global_module_hooks_see_every_projection_with_and_without_grad(grad: bool, decoding: bool) -> None:
    """A global forward hook and pre-hook (torch.nn.modules.module.register_module_forward_hook: profilers,
    quantisers, LoRA tooling) see the four Linear calls of a MultiHeadAttention forward whatever the grad mode,
    on a plain call and on a decode step over a KVCache (the stacked fast path)."""
    from torch.nn.modules import module as torch_module

    torch.manual_seed(0)
    mha = attnkit.MultiHeadAttention(32, 4).eval()
    x = torch.randn(2, 3, 32)  # (B, L, E)
    cache = attnkit.KVCache() if decoding else None
    with torch.no_grad():
        if cache is not None:
            mha(x, x, x, is_causal=True, cache=cache)  # the prefill, unhooked
    before, after = [], []
    pre = torch_module.register_module_forward_pre_hook(
        lambda m, i: before.append(m) if isinstance(m, nn.Linear) else None
    )
    post = torch_module.register_module_forward_hook(
        lambda m, i, o: after.append(m) if isinstance(m, nn.Linear) else None
    )
    try:
        with torch.set_grad_enabled(grad):
            step = x[:, :1]
            mha(step, step, step, is_causal=True, cache=cache)
    finally:
        pre.remove()
        post.remove()
    projections = [mha.W_q, mha.W_k, mha.W_v, mha.W_o]
    assert sorted(map(id, before)) == sorted(map(id, projections))
    assert sorted(map(id, after)) == sorted(map(id, projections))


def test_the_global_hook_check_is_the_torch_function_it_was_written_against() -> None:
    """_projection reads torch.nn.modules.module._has_any_global_hook (private; checked against torch 2.13): if it
    moves, the fast path would call every module (safe, slower); this test says so instead."""
    from torch.nn.modules import module as torch_module

    assert _projection._has_global_hook is torch_module._has_any_global_hook
    handle = torch_module.register_module_forward_hook(lambda m, i, o: None)
    try:
        assert _projection._has_global_hook()
    finally:
        handle.remove()
    assert not _projection._has_global_hook()


def test_the_stacked_weights_are_not_copied_or_saved_with_the_layer() -> None:
    """What a decode step derives from the parameters stays with the layer that made it: a deep copy or a pickled
    layer starts without it (and makes its own from its own parameters)."""
    import copy
    import io
    import pickle

    torch.manual_seed(0)
    mha = attnkit.MultiHeadAttention(32, 4, query_size=32, key_size=32, value_size=32).eval()
    x = torch.randn(2, 1, 32)  # (B, L, E)
    cache = attnkit.KVCache()  # held: the stacked weights last as long as a cache they serve
    with torch.no_grad():
        mha(x, x, x, cache=cache)
    assert mha._stacked._kept is not None
    for other in (copy.deepcopy(mha), pickle.loads(pickle.dumps(mha))):
        assert other._stacked._kept is None
        with torch.no_grad():
            torch.testing.assert_close(other(x, x, x, cache=attnkit.KVCache()), mha(x, x, x), **TOL)
    buffer = io.BytesIO()
    torch.save(mha, buffer)
    assert len(buffer.getvalue()) < 2 * sum(p.nbytes for p in mha.parameters()) + 10_000


def test_the_stacked_weights_go_with_the_cache_and_with_a_conversion() -> None:
    """A layer does not keep its decode steps' stacked weights past the caches they served (they used to live on
    the cache), nor across .to()/.double() (they would be of the old dtype or device)."""
    import gc

    torch.manual_seed(0)
    mha = attnkit.MultiHeadAttention(32, 4, query_size=32, key_size=32, value_size=32).eval()
    x = torch.randn(2, 1, 32)  # (B, L, E)
    cache = attnkit.KVCache()
    with torch.no_grad():
        mha(x, x, x, cache=cache)
        assert mha._stacked._kept is not None
        del cache
        gc.collect()
        assert mha._stacked._kept is None
        cache = attnkit.KVCache()
        mha(x, x, x, cache=cache)
        mha.double()
        assert mha._stacked._kept is None
        torch.testing.assert_close(
            mha(x.double(), x.double(), x.double(), cache=attnkit.KVCache()), mha(x.double(), x.double(), x.double())
        )


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_a_forward_replaced_on_a_projection_runs_in_every_mode(grad: bool) -> None:
    """accelerate's add_hook_to_module replaces an instance's forward: the fast path (no grad) must call it too."""
    torch.manual_seed(0)
    mha = attnkit.MultiHeadAttention(32, 4, query_size=32, key_size=32, value_size=32).eval()
    x = torch.randn(2, 1, 32)  # (B, L, E)
    called = []
    for name in ("W_q", "W_k", "W_v", "W_o"):
        module = getattr(mha, name)
        module.forward = lambda t, m=module, n=name: called.append(n) or nn.Linear.forward(m, t)
    with torch.set_grad_enabled(grad):
        mha(x, x, x, cache=attnkit.KVCache())
    assert sorted(called) == ["W_k", "W_o", "W_q", "W_v"]
