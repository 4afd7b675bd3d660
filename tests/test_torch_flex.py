"""attnkit.flex_attention: torch's flex_attention signature and semantics on the CPU, forward and backward, against
float64 math; a BlockMask read as torch reads it; lse and max_scores; patch_flex_attention; bad input.

PyTorch's own cases are the client: the score_mods, mask_mods, grouped heads and block sizes of
``test/inductor/test_flex_attention.py`` (pytorch/pytorch at 00125ef3dad64a9f8dd8768e81326a34ed7ba91d), kept as
parameters at lengths this machine runs in seconds (257 queries: not a multiple of any block size), and
attention-gym's masks (causal, sliding window, prefix LM, packed documents) through ``create_block_mask``.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.attention.flex_attention import (
    AuxRequest,
    BlockMask,
    and_masks,
    create_block_mask,
    create_mask,
    noop_mask,
)

import attnkit
from attnkit import csrc, dispatch
from attnkit.integrations import flex_patch, torch_flex
from mathref import max_err

# B batch, H query heads, Hkv key/value heads, Lq/Lk query/key length, D head dim


# --- PyTorch's score_mods (test_flex_attention.py), each elementwise on the scaled score
def _identity(score, b, h, m, n):
    return score


def _times_two(score, b, h, m, n):
    return score * 2


def _squared(score, b, h, m, n):
    return score * score


def _causal(score, b, h, m, n):
    return torch.where(m >= n, score, float("-inf"))


def _inverse_causal(score, b, h, m, n):
    return torch.where(m <= n, score, float("-inf"))


def _rel_bias(score, b, h, m, n):
    return score + (m - n)


def _rel_causal(score, b, h, m, n):
    return torch.where(m >= n, score + (m - n), float("-inf"))


def _alibi8(score, b, h, m, n):
    return score + (n - m) * torch.exp2(-((h + 1) * 8.0 / 8))


def _trig(score, b, h, m, n):
    return torch.sin(torch.cos(score)) + torch.tan(b)


SCORE_MODS = [_identity, _times_two, _squared, _causal, _inverse_causal, _rel_bias, _rel_causal, _alibi8, _trig]


# --- mask_mods: PyTorch's two, and attention-gym's
def causal(b, h, q, kv):
    return q >= kv


def inverse_causal(b, h, q, kv):
    return q <= kv


def sliding_window(window):
    def mask(b, h, q, kv):
        return (q >= kv) & (q - kv < window)

    return mask


def prefix_lm(prefix):
    def mask(b, h, q, kv):
        return (kv <= q) | (kv < prefix)

    return mask


def documents(lengths, total):
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    ids = torch.cat([ids, torch.full((total - len(ids),), len(lengths))])  # the rest: one more document

    def mask(b, h, q, kv):
        return (ids[q] == ids[kv]) & (q >= kv)

    return mask


def per_head(b, h, q, kv):  # even heads causal, odd heads the reverse
    return torch.where(h % 2 == 0, q >= kv, q <= kv)


MASK_MODS = {
    "none": None,
    "causal": causal,
    "inverse causal": inverse_causal,
    "sliding window 64": sliding_window(64),
    "prefix lm 40": prefix_lm(40),
    "documents": documents([100, 7, 90], 257),
    "per head": per_head,
}


def reference(q, k, v, *, score_mod=None, allowed=None, scale=None, dtype=torch.float64):
    """Output, lse and max_scores from the definitions in ``dtype`` (rows that see nothing: zeros, -inf, -inf)."""
    H, Hkv = q.shape[1], k.shape[1]
    q, k, v = q.to(dtype), k.to(dtype).repeat_interleave(H // Hkv, 1), v.to(dtype).repeat_interleave(H // Hkv, 1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    s = (q @ k.transpose(-2, -1)) * scale  # (B, H, Lq, Lk)
    B, _, Lq, Lk = s.shape
    if score_mod is not None:
        idx = (
            torch.arange(B).view(B, 1, 1, 1),
            torch.arange(H).view(1, H, 1, 1),
            torch.arange(Lq).view(1, 1, Lq, 1),
            torch.arange(Lk).view(1, 1, 1, Lk),
        )
        s = score_mod(s, *idx).to(dtype).expand(B, H, Lq, Lk)
    hidden = torch.isneginf(s)
    if allowed is not None:
        hidden = hidden | ~allowed
    s = s.masked_fill(hidden, -math.inf)
    lse = torch.logsumexp(s, dim=-1)  # (B, H, Lq)
    live = torch.isfinite(lse)[..., None]
    p = torch.where(live & ~hidden, torch.exp(s - torch.where(live, lse[..., None], 0.0)), 0.0)
    return p @ v, lse, s.detach().amax(dim=-1)


def inputs(B, H, Hkv, Lq, Lk, D, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(shape, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
        for shape in ((B, H, Lq, D), (B, Hkv, Lk, D), (B, Hkv, Lk, D))
    ]


def tolerance(got_err_low: float) -> float:
    """Twice the error of the same math computed in the input's own precision (flash-attention's rule), with a
    floor for values that round to nothing."""
    return 2 * got_err_low + 1e-6


def check(q, k, v, *, score_mod=None, block_mask=None, allowed=None, enable_gqa=False, aux=True):
    """attnkit.flex_attention's output, lse and every gradient (through the output and the lse) against float64
    math, within twice the error of that math in the inputs' dtype."""
    request = AuxRequest(lse=True, max_scores=True) if aux else None
    got = attnkit.flex_attention(
        q, k, v, score_mod=score_mod, block_mask=block_mask, enable_gqa=enable_gqa, return_aux=request
    )
    out, found = got if aux else (got, None)
    want, lse, top = reference(q, k, v, score_mod=score_mod, allowed=allowed)
    low, low_lse, _ = reference(q, k, v, score_mod=score_mod, allowed=allowed, dtype=q.dtype)
    assert max_err(out, want) <= tolerance(max_err(low, want))
    leaves = (q, k, v)
    dout = torch.randn_like(want)
    if found is not None:
        assert found.lse.dtype == torch.float32 or q.dtype == torch.float64
        assert torch.equal(torch.isneginf(found.lse), torch.isneginf(lse))
        live = torch.isfinite(lse)
        assert max_err(found.lse[live], lse[live]) <= tolerance(max_err(low_lse[live], lse[live]))
        assert torch.equal(torch.isneginf(found.max_scores), torch.isneginf(top))
        assert max_err(found.max_scores[live], top[live]) <= tolerance(max_err(low_lse[live], lse[live])) * 4
        dlse = torch.randn_like(lse)
        got_grads = torch.autograd.grad((out, found.lse), leaves, (dout.to(out.dtype), dlse.to(found.lse.dtype)))
        want_grads = torch.autograd.grad((want, torch.where(live, lse, 0.0)), leaves, (dout, dlse))
        low_grads = torch.autograd.grad(
            (low, torch.where(live, low_lse, 0.0)), leaves, (dout.to(low.dtype), dlse.to(low_lse.dtype))
        )
    else:
        got_grads = torch.autograd.grad(out, leaves, dout.to(out.dtype))
        want_grads = torch.autograd.grad(want, leaves, dout)
        low_grads = torch.autograd.grad(low, leaves, dout.to(low.dtype))
    for name, a, b, c in zip("qkv", got_grads, want_grads, low_grads, strict=True):
        assert max_err(a, b) <= tolerance(max_err(c, b)), name


@pytest.mark.parametrize("score_mod", SCORE_MODS, ids=lambda f: f.__name__)
def test_pytorchs_score_mods_forward_and_backward(score_mod):
    q, k, v = inputs(2, 4, 4, 257, 257, 16)
    check(q, k, v, score_mod=score_mod)


@pytest.mark.parametrize("name", list(MASK_MODS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_block_masks_from_create_block_mask(name, dtype):
    mask_mod = MASK_MODS[name]
    q, k, v = inputs(2, 4, 2, 257, 257, 16, dtype=dtype)
    heads = 4 if name == "per head" else None  # (a mask of the head needs its heads: else head 0's blocks serve all)
    block_mask = None if mask_mod is None else create_block_mask(mask_mod, None, heads, 257, 257, device="cpu")
    allowed = None if mask_mod is None else create_mask(mask_mod, 2, 4, 257, 257, device="cpu")
    check(q, k, v, block_mask=block_mask, allowed=allowed, enable_gqa=True)


@pytest.mark.parametrize("block_size", [128, 64, (128, 256), (256, 128)], ids=str)
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 2), (4, 1)])
def test_block_sizes_and_grouped_heads_with_a_score_mod(block_size, heads, kv_heads):
    """PyTorch's test_block_size and test_Hq_Hkv cases: a block mask of each block size, grouped heads, a
    score_mod that reads the positions, queries fewer than keys."""
    q, k, v = inputs(1, heads, kv_heads, 200, 300, 16)
    mask = sliding_window(90)
    block_mask = create_block_mask(mask, 1, 1, 200, 300, device="cpu", BLOCK_SIZE=block_size)
    allowed = create_mask(mask, 1, heads, 200, 300, device="cpu")
    check(q, k, v, score_mod=_rel_bias, block_mask=block_mask, allowed=allowed, enable_gqa=True)


def test_a_block_mask_is_read_as_torch_reads_it_unlisted_blocks_hidden_full_blocks_unmasked():
    """from_kv_blocks with a mask_mod: a pair in a block not listed is hidden whatever the mask_mod says; a pair in
    a full block is visible whatever it says; a partial block's pairs are the mask_mod's. Per example and head."""
    B, H, L, QB = 2, 2, 256, 64
    n = L // QB
    g = torch.Generator().manual_seed(3)
    kind = torch.randint(0, 3, (B, H, n, n), generator=g)  # 0 unlisted, 1 partial, 2 full

    def ordered(which):
        dense = kind == which  # (B, H, n, n)
        counts = dense.sum(-1).int()
        indices = torch.argsort((~dense).int(), dim=-1, stable=True).int()
        return counts, indices

    counts, indices = ordered(1)
    full_counts, full_indices = ordered(2)
    block_mask = BlockMask.from_kv_blocks(
        counts, indices, full_counts, full_indices, BLOCK_SIZE=QB, mask_mod=causal, seq_lengths=(L, L)
    )
    blocks = kind.repeat_interleave(QB, 2).repeat_interleave(QB, 3)  # (B, H, L, L)
    allowed = (blocks == 2) | ((blocks == 1) & create_mask(causal, B, H, L, L, device="cpu"))
    q, k, v = inputs(B, H, H, L, L, 16, seed=4)
    check(q, k, v, block_mask=block_mask, allowed=allowed)
    no_mod = BlockMask.from_kv_blocks(counts, indices, BLOCK_SIZE=QB, seq_lengths=(L, L))  # noop: listed = visible
    check(q, k, v, block_mask=no_mod, allowed=(blocks == 1), aux=False)


def test_bfloat16_within_twice_the_math_in_bfloat16():
    q, k, v = inputs(1, 4, 4, 257, 257, 32, dtype=torch.bfloat16)
    block_mask = create_block_mask(causal, None, None, 257, 257, device="cpu")
    out = attnkit.flex_attention(q, k, v, block_mask=block_mask)
    assert out.dtype == torch.bfloat16
    check(q, k, v, block_mask=block_mask, allowed=create_mask(causal, 1, 4, 257, 257, device="cpu"))


def test_bfloat16_on_the_kernel_with_lse_within_twice_the_math_in_bfloat16():
    """A window in bfloat16 runs on the C++ kernel (its products in bfloat16 where the CPU has them): output, lse
    and the gradients through both, at odd lengths and head dims (the lse's gradient rides on a column of v)."""
    q, k, v = inputs(1, 4, 2, 301, 301, 33, dtype=torch.bfloat16)
    block_mask = create_block_mask(sliding_window(50), None, None, 301, 301, device="cpu")
    with dispatch.watch(implementations=True) as ran:
        check(q, k, v, block_mask=block_mask, allowed=create_mask(sliding_window(50), 1, 4, 301, 301), enable_gqa=True)
    assert ran[0] == "tiles:kernel" or csrc.ensure("flash") is not None, ran


def test_gradients_reach_tensors_a_score_mod_closes_over():
    q, k, v = inputs(2, 4, 4, 130, 130, 16)
    bias = torch.randn(4, 260, dtype=torch.float64, requires_grad=True)  # a learned bias per head and distance

    def learned(score, b, h, m, n):
        return score + bias.to(score.dtype)[h, m - n + 129]

    block_mask = create_block_mask(causal, None, None, 130, 130, device="cpu")
    out = attnkit.flex_attention(q, k, v, score_mod=learned, block_mask=block_mask)
    allowed = create_mask(causal, 1, 4, 130, 130, device="cpu")
    want = reference(q, k, v, score_mod=learned, allowed=allowed)[0]
    dout = torch.randn_like(want)
    (got,) = torch.autograd.grad(out, bias, dout.float())
    (expected,) = torch.autograd.grad(want, bias, dout)
    assert max_err(got, expected) <= 1e-4 * max(1.0, expected.abs().max().item())


def test_rows_that_see_nothing_give_zeros_and_minus_infinity_and_hidden_nan_reaches_nothing():
    L = 200

    def late(b, h, q, kv):  # queries before 64 see nothing; keys past 150 are seen by no query
        return (q >= 64) & (kv <= q) & (kv < 150)

    block_mask = create_block_mask(late, None, None, L, L, device="cpu", BLOCK_SIZE=64)
    q, k, v = inputs(1, 2, 2, L, L, 16)
    with torch.no_grad():
        k[..., 150:, :] = float("nan")
        v[..., 150:, :] = float("inf")
    out, aux = attnkit.flex_attention(q, k, v, block_mask=block_mask, return_aux=AuxRequest(lse=True, max_scores=True))
    assert torch.equal(out[:, :, :64], torch.zeros_like(out[:, :, :64]))
    assert torch.isneginf(aux.lse[:, :, :64]).all() and torch.isneginf(aux.max_scores[:, :, :64]).all()
    assert torch.isfinite(out).all() and torch.isfinite(aux.lse[:, :, 64:]).all()
    (out.sum() + aux.lse[:, :, 64:].sum()).backward()
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
def test_without_gradients_a_row_that_sees_nothing_has_an_lse_of_minus_infinity(dtype):
    """Each engine's own lse (the kernel's, the online softmax's), not only the fallback's."""
    L = 200

    def late(b, h, q, kv):
        return (q >= 64) & (kv <= q) & (q - kv < 50)

    block_mask = create_block_mask(late, None, None, L, L, device="cpu", BLOCK_SIZE=64)
    q, k, v = (t.detach() for t in inputs(1, 2, 2, L, L, 16, dtype=dtype))
    with torch.no_grad():
        out, aux = attnkit.flex_attention(q, k, v, block_mask=block_mask, return_aux=AuxRequest(lse=True))
    assert torch.isneginf(aux.lse[:, :, :64]).all() and torch.isfinite(aux.lse[:, :, 64:]).all()
    want = reference(q, k, v, allowed=create_mask(late, 1, 2, L, L, device="cpu"))[1]
    assert max_err(aux.lse[:, :, 64:], want[:, :, 64:]) <= (1e-12 if dtype == torch.float64 else 1e-5)
    assert out.dtype == dtype and out.is_contiguous()


def test_the_plan_is_made_once_for_a_block_mask_every_layer_passes():
    q, k, v = inputs(1, 2, 2, 512, 512, 16)
    block_mask = create_block_mask(sliding_window(100), None, None, 512, 512, device="cpu")
    first = attnkit.flex_attention(q, k, v, block_mask=block_mask)
    plans = dict(block_mask._attnkit_plans)
    second = attnkit.flex_attention(q, k, v, block_mask=block_mask)
    assert torch.equal(first, second)
    assert len(plans) == 1 and block_mask._attnkit_plans == plans  # the same plan object, not made again


def test_a_tensor_the_mask_mod_reads_changed_in_place_is_read_again_as_torch_does():
    """torch evaluates a partial block's mask_mod at every call: new document ids written into the same buffer
    count at the next call with the same BlockMask (the tester's finding: the kept plan's booleans were the first
    call's)."""
    L = 256
    q, k, v = inputs(1, 1, 1, L, L, 16, seed=2)
    ids = (torch.arange(L) >= 100).long()  # two documents: every block of 128 partial (the boundary, the diagonal)

    def same_document(b, h, q_idx, kv_idx):
        return (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)

    block_mask = create_block_mask(same_document, None, None, L, L, device="cpu")
    attnkit.flex_attention(q, k, v, block_mask=block_mask)
    ids[:] = (torch.arange(L) >= 120).long()  # the boundary moves within partial blocks, where torch asks again
    out = attnkit.flex_attention(q, k, v, block_mask=block_mask)
    allowed = (ids[:, None] == ids[None, :]) & torch.ones(L, L, dtype=torch.bool).tril()
    want = reference(q, k, v, allowed=allowed)[0]
    assert max_err(out, want) <= 1e-5


def test_the_lse_comes_from_the_kernel_with_its_gradient_where_the_kernel_runs():
    if "tiles:kernel" not in attnkit.available_backends(implementations=True):
        pytest.skip("no C++ kernel here")
    q, k, v = inputs(1, 2, 2, 300, 300, 16)
    block_mask = create_block_mask(sliding_window(50), None, None, 300, 300, device="cpu")
    with dispatch.watch(implementations=True) as ran:
        check(q, k, v, block_mask=block_mask, allowed=create_mask(sliding_window(50), 1, 2, 300, 300, device="cpu"))
    assert "tiles:kernel" in ran


def test_keys_and_values_of_one_example_are_shared_by_every_query_example():
    q, _, _ = inputs(3, 2, 2, 64, 64, 16)
    _, k, v = inputs(1, 2, 2, 64, 64, 16, seed=1)
    block_mask = create_block_mask(causal, 3, None, 64, 64, device="cpu")
    out = attnkit.flex_attention(q, k, v, block_mask=block_mask)
    want = attnkit.flex_attention(q, k.expand(3, -1, -1, -1), v.expand(3, -1, -1, -1), block_mask=block_mask)
    assert torch.equal(out, want)


def test_return_lse_gives_the_pair_and_return_aux_only_what_it_asks():
    q, k, v = inputs(1, 2, 2, 32, 32, 8)
    out, lse = attnkit.flex_attention(q, k, v, return_lse=True)
    assert lse.shape == (1, 2, 32)
    _, aux = attnkit.flex_attention(q, k, v, return_aux=AuxRequest(max_scores=True))
    assert aux.lse is None and aux.max_scores.shape == (1, 2, 32)


@pytest.mark.parametrize(
    ("kwargs", "error", "words"),
    [
        ({"block_mask": "sizes"}, ValueError, "made for 128 queries and 128 keys"),
        ({"block_mask": "batch"}, ValueError, "B=3"),
        ({"kernel_options": {"BLOCK_M": 64, "fwd_num_warps": 4}}, None, None),
        ({"kernel_options": {"CHANGES_MATH": True}}, ValueError, "CHANGES_MATH"),
        ({"kernel_options": [1]}, TypeError, "kernel_options"),
        ({"enable_gqa": False, "kv_heads": 1}, ValueError, "enable_gqa=True"),
        ({"enable_gqa": True, "kv_heads": 3}, ValueError, "multiple"),
        ({"return_lse": True, "return_aux": AuxRequest(lse=True)}, ValueError, "return_aux"),
        ({"return_aux": True}, TypeError, "AuxRequest"),
        ({"block_mask": "not a mask"}, TypeError, "BlockMask"),
    ],
    ids=lambda x: str(x)[:40],
)
def test_bad_input_names_the_argument_and_values(kwargs, error, words):
    kwargs = dict(kwargs)
    kv_heads = kwargs.pop("kv_heads", 2)
    q, k, v = inputs(2, 2, kv_heads, 64, 64, 8)
    if kwargs.get("block_mask") == "sizes":
        kwargs["block_mask"] = create_block_mask(causal, None, None, 128, 128, device="cpu")
    elif kwargs.get("block_mask") == "batch":
        kwargs["block_mask"] = create_block_mask(causal, 3, None, 64, 64, device="cpu")
    if error is None:
        attnkit.flex_attention(q, k, v, **kwargs)
        return
    with pytest.raises(error, match=words):
        attnkit.flex_attention(q, k, v, **kwargs)


def test_patch_runs_torchs_name_on_attnkit_and_restores_it():
    import sys

    import torch.nn.attention.flex_attention as flex

    original = flex.flex_attention
    before = type(torch)("attnkit_test_before")  # a module that imported the name before the patch
    before.flex_attention = original
    sys.modules["attnkit_test_before"] = before
    try:
        q, k, v = inputs(1, 2, 2, 128, 128, 16)
        block_mask = create_block_mask(causal, None, None, 128, 128, device="cpu")
        with attnkit.patch_flex_attention():
            assert flex.flex_attention is not original and before.flex_attention is flex.flex_attention
            during = type(torch)("attnkit_test_during")  # one imported inside the block copies the patched name
            during.flex_attention = flex.flex_attention
            sys.modules["attnkit_test_during"] = during
            out = flex.flex_attention(q, k, v, block_mask=block_mask)
            out.sum().backward()  # torch's own has no backward on the CPU
            compiled = torch.compile(flex.flex_attention)(q, k, v, block_mask=block_mask)
            assert torch.equal(compiled, out)
        assert flex.flex_attention is original and before.flex_attention is original
        assert during.flex_attention is original
        want = attnkit.flex_attention(q, k, v, block_mask=block_mask)
        assert torch.equal(out, want) and out.is_contiguous()
    finally:
        sys.modules.pop("attnkit_test_before", None)
        sys.modules.pop("attnkit_test_during", None)


def test_a_plain_call_patches_until_closed_and_nested_patches_restore_once():
    import torch.nn.attention.flex_attention as flex

    original = flex.flex_attention
    outer = attnkit.patch_flex_attention()
    try:
        with attnkit.patch_flex_attention():
            assert flex.flex_attention is not original
        assert flex.flex_attention is not original  # the plain call's patch still holds
    finally:
        outer.close()
    assert flex.flex_attention is original
    outer.close()  # a second close does nothing
    assert flex.flex_attention is original


def test_the_noop_mask_and_mask_mod_names_are_torchs():
    """The names of torch's module read here (torch 2.13): when one moves, this fails."""
    import torch.nn.attention.flex_attention as flex

    for name in ("noop_mask", "BlockMask", "AuxRequest", "AuxOutput", "_sliced_mask_mod_error"):
        assert hasattr(flex, name), name
    assert callable(noop_mask) and callable(and_masks)
    assert set(flex.FlexKernelOptions.__annotations__) <= torch_flex._TUNING


def _tiny(name):
    transformers = pytest.importorskip("transformers")
    common = dict(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    if name == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    config = transformers.Gemma2Config(
        **common, head_dim=16, sliding_window=8, attn_logit_softcapping=50.0, query_pre_attn_scalar=16
    )  # softcap as a score_mod, a sliding window on every other layer
    return transformers.Gemma2ForCausalLM(config)


@pytest.mark.parametrize("name", ["llama", "gemma2"])
def test_transformers_flex_attention_trains_on_the_cpu_under_the_patch_as_eager_does(name):
    """transformers' attn_implementation="flex_attention" (its score_mod closure, its BlockMask, its compiled call)
    gives eager's loss and gradients. With left padding eager itself moves from sdpa (a padded row's uniform
    weights; 7e-4 on this loss, measured): there flex must give sdpa's."""
    torch.manual_seed(0)
    model = _tiny(name)
    ids = torch.randint(0, 100, (2, 40), generator=torch.Generator().manual_seed(1))
    padded = torch.ones(2, 40, dtype=torch.long)
    padded[1, :5] = 0
    cases = [(torch.ones_like(padded), "eager")] + ([(padded, "sdpa")] if name == "llama" else [])  # (Gemma 2: no sdpa)
    for mask, peer in cases:
        labels = ids.masked_fill(mask == 0, -100)
        found = {}
        for implementation in (peer, "flex_attention"):
            model.set_attn_implementation(implementation)
            model.zero_grad()
            with attnkit.patch_flex_attention():
                loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
                loss.backward()
            found[implementation] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()})
        (want, want_grads), (got, got_grads) = found[peer], found["flex_attention"]
        assert abs(float(got - want)) <= 1e-5 * max(1.0, abs(float(want)))
        for n, g in want_grads.items():
            assert max_err(got_grads[n], g) <= 2e-5 * max(1.0, g.abs().max().item()), n
    import torch.nn.attention.flex_attention as flex

    model.set_attn_implementation("flex_attention")
    with pytest.raises(NotImplementedError):  # without the patch, torch's own: no backward on the CPU
        model(input_ids=ids, labels=ids).loss.backward()
    assert flex.flex_attention is flex_patch.original()


def test_transformers_compiled_copy_name_is_where_the_patch_looks():
    """transformers 5.23 keeps torch.compile(flex_attention) on WrappedFlexAttention (a private name the patch
    marks stale): when it moves, this fails."""
    module = pytest.importorskip("transformers.integrations.flex_attention")
    assert hasattr(module.WrappedFlexAttention, "_is_flex_compiled")
    assert module.flex_attention is torch_flex._torch_flex().flex_attention


def test_the_fallback_lse_over_several_blocks_of_rows_with_its_gradient(monkeypatch):
    """float64 (no C++ kernel): the lse comes from the scores a block of rows at a time, each block recomputed in
    the backward; forced to blocks of a few rows here."""
    from attnkit.integrations import _statistics

    monkeypatch.setattr(_statistics, "_STAT_ELEMENTS", 4 * 257 * 5)  # 5 rows a block
    q, k, v = inputs(1, 4, 2, 131, 257, 16, dtype=torch.float64)
    mask = sliding_window(40)
    block_mask = create_block_mask(mask, None, None, 131, 257, device="cpu", BLOCK_SIZE=64)
    check(
        q,
        k,
        v,
        score_mod=_alibi8,
        block_mask=block_mask,
        allowed=create_mask(mask, 1, 4, 131, 257, device="cpu"),
        enable_gqa=True,
    )


def test_torchs_mask_of_every_pair_is_taken_for_any_lengths_and_a_mask_elsewhere_is_refused():
    """torch's ``_create_empty_block_mask`` (one block as large as any call, what torch uses when none is given)
    means no mask, whatever its seq_lengths say; a BlockMask on another device names both."""
    from torch.nn.attention.flex_attention import _create_empty_block_mask

    q, k, v = inputs(1, 2, 2, 70, 90, 8)
    empty = _create_empty_block_mask(q, k)
    assert torch.equal(
        attnkit.flex_attention(q, k, v, block_mask=empty), attnkit.flex_attention(q, k, v, block_mask=None)
    )
    meta = create_block_mask(causal, None, None, 70, 90, device="cpu").to("meta")
    with pytest.raises(ValueError, match="block_mask is on meta, query on cpu"):
        attnkit.flex_attention(q, k, v, block_mask=meta)


def test_the_fallback_lse_gives_gradients_to_what_a_score_mod_reads_and_none_from_dead_positions():
    """float64 (the fallback lse): inputs that need no gradient and slopes that do; NaN in keys no query may see and
    in queries that see no key (reviewer's findings: the slopes got no gradient through the lse; the dead NaN
    reached it)."""
    L = 200
    q, k, v = (t.detach() for t in inputs(1, 2, 2, L, L, 16, dtype=torch.float64))
    slopes = torch.tensor([0.5, 0.25], dtype=torch.float64, requires_grad=True)

    def alibi(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx)

    def late(b, h, q_idx, kv_idx):  # queries before 64 see nothing; keys from 150 on are seen by no query
        return (q_idx >= 64) & (kv_idx <= q_idx) & (kv_idx < 150)

    block_mask = create_block_mask(late, None, None, L, L, device="cpu", BLOCK_SIZE=64)
    dirty_q, dirty_k = q.clone(), k.clone()
    dirty_q[:, :, :64], dirty_k[:, :, 150:] = float("nan"), float("nan")
    _, aux = attnkit.flex_attention(
        dirty_q, dirty_k, v, score_mod=alibi, block_mask=block_mask, return_aux=AuxRequest(lse=True)
    )
    (got,) = torch.autograd.grad(aux.lse[:, :, 64:].sum(), slopes)
    lse = reference(q, k, v, score_mod=alibi, allowed=create_mask(late, 1, 2, L, L, device="cpu"))[1]
    (want,) = torch.autograd.grad(lse[:, :, 64:].sum(), slopes)
    assert torch.isfinite(got).all() and max_err(got, want) <= 1e-9 * max(1.0, want.abs().max().item())


@pytest.mark.parametrize(("batch", "queries"), [(0, 16), (1, 0)])
def test_no_example_or_no_query_gives_empty_results_and_statistics(batch, queries):
    q, k = torch.randn(batch, 2, queries, 8), torch.randn(batch, 2, 16, 8)
    out, aux = attnkit.flex_attention(q, k, k, return_aux=AuxRequest(lse=True, max_scores=True))
    assert out.shape == (batch, 2, queries, 8)
    assert aux.lse.shape == aux.max_scores.shape == (batch, 2, queries)
