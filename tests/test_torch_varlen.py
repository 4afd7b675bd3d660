"""attnkit.varlen_attn: torch's varlen_attn signature and semantics on the CPU, forward and backward; each sequence's
result equal to that sequence alone and to float64 math; windows, grouped heads, seqused_k, a paged cache; bad input.

PyTorch's cases are the client: ``test/test_varlen_attention.py`` (pytorch/pytorch at
20160c6e19fa4c0091c0e6cc1baaa22d5407f7f3): causal or not, ``scale`` None or 0.1, sequence lengths in multiples of
64, and batch invariance (the sequences permuted, each result unchanged), kept as parameters at this machine's sizes.
"""

from __future__ import annotations

import math

import pytest
import torch

import attnkit
from mathref import max_err

# T packed tokens, H heads, Hkv key/value heads, D head dim


def packed(lengths_q, lengths_k=None, H=4, Hkv=4, D=16, dtype=torch.float32, seed=0):
    lengths_k = lengths_q if lengths_k is None else lengths_k
    g = torch.Generator().manual_seed(seed)

    def make(T, heads):
        return torch.randn(T, heads, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_()

    q, k, v = make(sum(lengths_q), H), make(sum(lengths_k), Hkv), make(sum(lengths_k), Hkv)
    cu_q = torch.tensor([0, *torch.tensor(lengths_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lengths_k).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu_q, cu_k


def one_sequence(q, k, v, left, right, scale=None):
    """float64 math for one sequence ``(n, H, D)`` over ``(m, Hkv, D)``: output ``(n, H, Dv)``, lse ``(H, n)``."""
    n, H, D = q.shape
    m, Hkv = k.shape[0], k.shape[1]
    q, k, v = (t.double().transpose(0, 1) for t in (q, k, v))  # (H|Hkv, n|m, D)
    k, v = k.repeat_interleave(H // Hkv, 0), v.repeat_interleave(H // Hkv, 0)
    s = (q @ k.transpose(-2, -1)) * (D**-0.5 if scale is None else scale)  # (H, n, m)
    d = torch.arange(m)[None, :] - (torch.arange(n)[:, None] + m - n)  # (n, m) key minus the query's position
    seen = torch.ones(n, m, dtype=torch.bool)
    if right >= 0:
        seen &= d <= right
    if left >= 0:
        seen &= d >= -left
    s = s.masked_fill(~seen, -math.inf)
    lse = torch.logsumexp(s, dim=-1)  # (H, n)
    live = torch.isfinite(lse)[..., None]
    p = torch.where(live & seen, torch.exp(s - torch.where(live, lse[..., None], 0.0)), 0.0)
    return (p @ v).transpose(0, 1), lse


def check_against_math(q, k, v, cu_q, cu_k, window, *, scale=None, enable_gqa=False, atol=2e-5):
    Aux = pytest.importorskip("torch.nn.attention.varlen").AuxRequest
    lengths_q, lengths_k = cu_q.diff().tolist(), cu_k.diff().tolist()
    out, lse = attnkit.varlen_attn(
        q,
        k,
        v,
        cu_q,
        cu_k,
        max(lengths_q),
        max(lengths_k),
        return_aux=Aux(lse=True),
        scale=scale,
        window_size=window,
        enable_gqa=enable_gqa,
    )
    assert out.shape == (q.shape[0], q.shape[1], v.shape[-1]) and lse.shape == (q.shape[1], q.shape[0])
    pieces = [
        one_sequence(a, b, c, *window, scale=scale)
        for a, b, c in zip(q.split(lengths_q), k.split(lengths_k), v.split(lengths_k), strict=True)
    ]
    want = torch.cat([p[0] for p in pieces])
    want_lse = torch.cat([p[1] for p in pieces], dim=1)
    assert max_err(out, want) <= atol
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    live = torch.isfinite(want_lse)
    assert max_err(lse[live], want_lse[live]) <= atol
    dout, dlse = torch.randn_like(want), torch.randn_like(want_lse)
    got = torch.autograd.grad((out, lse), (q, k, v), (dout.to(out.dtype), dlse.float()))
    expected = torch.autograd.grad((want, torch.where(live, want_lse, 0.0)), (q, k, v), (dout, dlse))
    for name, a, b in zip("qkv", got, expected, strict=True):
        assert max_err(a, b) <= atol * max(1.0, b.abs().max().item()), name


@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (63, 0), (20, 30), (-1, 5)], ids=str)
@pytest.mark.parametrize("scale", [None, 0.1], ids=str)
def test_each_sequence_equals_float64_math_forward_and_backward(window, scale):
    q, k, v, cu_q, cu_k = packed([64, 192, 128, 1])
    check_against_math(q, k, v, cu_q, cu_k, window, scale=scale)


def test_queries_and_keys_of_other_lengths_align_to_the_bottom_right_with_grouped_heads():
    q, k, v, cu_q, cu_k = packed([5, 64, 0, 30], [70, 64, 9, 0], H=4, Hkv=2)
    check_against_math(q, k, v, cu_q, cu_k, (-1, 0), enable_gqa=True)
    check_against_math(q, k, v, cu_q, cu_k, (16, 0), enable_gqa=True)


@pytest.mark.parametrize("is_causal", [False, True])
def test_permuting_the_sequences_leaves_each_result_unchanged(is_causal):
    """PyTorch's batch invariance: a sequence's result does not depend on what is packed beside it."""
    lengths = [64, 128, 192, 64]
    q, k, v, cu, _ = packed(lengths, seed=5)
    window = (-1, 0) if is_causal else (-1, -1)
    out = attnkit.varlen_attn(q, k, v, cu, cu, 192, 192, window_size=window)
    order = [2, 0, 3, 1]
    pieces = [t.split(lengths) for t in (q, k, v)]
    moved = [torch.cat([p[i] for i in order]) for p in pieces]
    cu2 = torch.tensor([0, *torch.tensor([lengths[i] for i in order]).cumsum(0).tolist()], dtype=torch.int32)
    out2 = attnkit.varlen_attn(*moved, cu2, cu2, 192, 192, window_size=window)
    back = out2.split([lengths[i] for i in order])
    for place, i in enumerate(order):
        assert torch.equal(back[place], out.split(lengths)[i])


def test_nan_in_one_sequence_reaches_no_other():
    q, k, v, cu, _ = packed([40, 50, 30])
    with torch.no_grad():
        k[40:90] = float("nan")
    out = attnkit.varlen_attn(q, k, v, cu, cu, 50, 50, window_size=(-1, 0))
    assert torch.isfinite(out[:40]).all() and torch.isfinite(out[90:]).all()
    (out[:40].sum() + out[90:].sum()).backward()
    for t in (q, k, v):  # (the second sequence's own rows are its own: NaN keys make NaN there)
        assert torch.isfinite(t.grad[:40]).all() and torch.isfinite(t.grad[90:]).all()


def test_seqused_k_and_a_paged_cache_equal_the_same_keys_packed():
    """Decoding against a paged cache: sequence i reads pages block_table[i] of the pool, its first seqused_k[i]
    tokens; the result is that of those keys packed contiguously, gradients included."""
    S, P, Hkv, D = 16, 12, 2, 16
    g = torch.Generator().manual_seed(7)
    pool_k = torch.randn(P, S, Hkv, D, generator=g, requires_grad=True)
    pool_v = torch.randn(P, S, Hkv, D, generator=g, requires_grad=True)
    table = torch.tensor([[3, 7, 1, -1], [0, 11, 5, 2], [9, -1, -1, -1]], dtype=torch.int32)  # -1: never read
    used = torch.tensor([40, 64, 5], dtype=torch.int32)
    q = torch.randn(3, 4, D, generator=g, requires_grad=True)  # one query a sequence
    cu_q = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    out = attnkit.varlen_attn(
        q, pool_k, pool_v, cu_q, None, 1, 64, enable_gqa=True, seqused_k=used, block_table=table, window_size=(-1, 0)
    )
    keys = [pool_k[table[i, : -(-int(used[i]) // S)].long()].flatten(0, 1)[: int(used[i])] for i in range(3)]
    values = [pool_v[table[i, : -(-int(used[i]) // S)].long()].flatten(0, 1)[: int(used[i])] for i in range(3)]
    cu_k = torch.tensor([0, *used.cumsum(0).tolist()], dtype=torch.int32)
    want = attnkit.varlen_attn(
        q, torch.cat(keys), torch.cat(values), cu_q, cu_k, 1, 64, enable_gqa=True, window_size=(-1, 0)
    )
    assert max_err(out, want) <= 1e-6
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, pool_k, pool_v), dout)
    expected = torch.autograd.grad(want, (q, pool_k, pool_v), dout)
    for a, b in zip(got, expected, strict=True):
        assert max_err(a, b) <= 1e-6
    # seqused_k alone: the first used keys of each packed sequence
    k, v = torch.cat(keys).detach(), torch.cat(values).detach()
    part = attnkit.varlen_attn(q, k, v, cu_q, cu_k, 1, 64, enable_gqa=True, seqused_k=torch.tensor([10, 3, 5]))
    first = attnkit.varlen_attn(q[:1], k[:10], v[:10], cu_q[:2], torch.tensor([0, 10]), 1, 10, enable_gqa=True)
    assert torch.equal(part[:1], first)


def test_is_causal_is_window_minus_one_zero():
    q, k, v, cu, _ = packed([30, 40])
    assert torch.equal(
        attnkit.varlen_attn(q, k, v, cu, cu, 40, 40, is_causal=True),
        attnkit.varlen_attn(q, k, v, cu, cu, 40, 40, window_size=(-1, 0)),
    )


@pytest.mark.parametrize(
    ("change", "error", "words"),
    [
        ({"cu_seq_q": torch.tensor([0, 40, 30, 70])}, ValueError, "never decrease"),
        ({"cu_seq_q": torch.tensor([0, 30, 60])}, ValueError, "end at the 70"),
        ({"cu_seq_q": torch.tensor([1, 30, 70])}, ValueError, "start at 0"),
        ({"cu_seq_q": torch.tensor([0.0, 30, 70])}, TypeError, "integer"),
        ({"cu_seq_k": torch.tensor([0, 70])}, ValueError, "entries"),
        ({"max_q": 10}, ValueError, "max_q=10"),
        ({"window_size": (-2, 0)}, ValueError, "window_size"),
        ({"window_size": (3, 0), "is_causal": True}, ValueError, "one or the other"),
        ({"seqused_k": torch.tensor([31, 2])}, ValueError, "seqused_k\\[0\\]=31"),
        ({"block_table": torch.tensor([[0], [1]])}, ValueError, "seqused_k"),
        ({"num_splits": 1}, None, None),
    ],
    ids=lambda x: str(x)[:40],
)
def test_bad_input_names_the_argument_and_values(change, error, words):
    q, k, v, cu, _ = packed([30, 40])
    args = {"cu_seq_q": cu, "cu_seq_k": cu, "max_q": 40, "max_k": 40}
    args |= change
    call = lambda: attnkit.varlen_attn(q, k, v, **args)  # noqa: E731
    if error is None:
        call()
        return
    with pytest.raises(error, match=words):
        call()


def test_inputs_that_do_not_fit_are_refused_in_the_packed_shapes_even_without_keys():
    q, k = torch.randn(5, 2, 8), torch.randn(0, 2, 4)
    cu_q, cu_k = torch.tensor([0, 5]), torch.tensor([0, 0])
    with pytest.raises(ValueError, match=r"query \(5, 2, 8\) and key \(0, 2, 4\)"):
        attnkit.varlen_attn(q, k, torch.randn(0, 2, 3), cu_q, cu_k, 5, 0)
    with pytest.raises(TypeError, match="float64"):
        attnkit.varlen_attn(q, torch.randn(0, 2, 8, dtype=torch.float64), torch.randn(0, 2, 8), cu_q, cu_k, 5, 0)


def test_a_block_table_page_out_of_the_pool_is_refused():
    pool = torch.randn(4, 8, 2, 16)
    q = torch.randn(2, 2, 16)
    cu = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match=r"block_table\[1\] names pages \[9\]"):
        attnkit.varlen_attn(
            q, pool, pool, cu, None, 1, 16, seqused_k=torch.tensor([8, 16]), block_table=torch.tensor([[0, 1], [2, 9]])
        )
