"""attnkit next to torch: MultiHeadAttention.from_torch/to_torch give equal modules, torch's own attention
probabilities equal the recorded ones, and torch.compile runs the attnkit layers with eager results."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn

import attnkit

# B batch, H heads, Lq/Lk query/key length, E embed dim (= num_hiddens), kdim/vdim key/value feature sizes
B, H, E = 3, 4, 16
KDIM, VDIM = 12, 7  # separate q/k/v projection weights in torch
L_SELF, LQ_CROSS, LK_CROSS = 6, 5, 9
TOL = 1e-5  # float32, max abs difference

# Ways of masking; the causal ones only with Lq == Lk (self-attention), where torch's top-left aligned
# causal mask and attnkit's bottom-right aligned one agree.
MASKS_ANY = ("none", "key_padding", "key_padding_prefix")
MASKS_SELF = ("causal_float", "causal_bool_hint", "causal+key_padding_prefix")

FROM_TORCH_CASES = [
    (bias, packed, batch_first, attention, mask)
    for bias, packed, batch_first in itertools.product((True, False), repeat=3)
    for attention in ("self", "cross")
    for mask in MASKS_ANY + (MASKS_SELF if attention == "self" else ())
]


def make_torch_mha(seed: int, *, bias: bool, packed: bool, batch_first: bool, **kw) -> nn.MultiheadAttention:
    """A torch module in eval mode with every parameter, biases included, drawn from ``seed``.

    torch initialises the biases to zero, which would let a mix-up of the bias vectors pass unnoticed.
    """
    g = torch.Generator().manual_seed(seed)
    kdim, vdim = (None, None) if packed else (KDIM, VDIM)
    m = nn.MultiheadAttention(E, H, bias=bias, kdim=kdim, vdim=vdim, batch_first=batch_first, **kw)
    for p in m.parameters():
        nn.init.normal_(p, std=0.3, generator=g)
    return m.eval()


def make_inputs(g: torch.Generator, *, packed: bool, attention: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Batch-first queries ``(B, Lq, E)``, keys ``(B, Lk, kdim)``, values ``(B, Lk, vdim)``.

    Packed self-attention passes one tensor three times, which is what sends torch down its self-attention path.
    """
    Lq, Lk = (L_SELF, L_SELF) if attention == "self" else (LQ_CROSS, LK_CROSS)
    if packed:
        x = torch.randn(B, Lq, E, generator=g)
        if attention == "self":
            return x, x, x
        kv = torch.randn(B, Lk, E, generator=g)
        return x, kv, kv
    return (
        torch.randn(B, Lq, E, generator=g),
        torch.randn(B, Lk, KDIM, generator=g),
        torch.randn(B, Lk, VDIM, generator=g),
    )


def make_masks(g: torch.Generator, mask: str, Lq: int, Lk: int) -> tuple[dict, dict]:
    """The same masking in torch's words and in attnkit's: (torch kwargs, attnkit kwargs).

    torch's ``key_padding_mask`` ``(B, Lk)`` and boolean ``attn_mask`` are True = ignore; attnkit's are True = may
    attend. Every query keeps at least one key: torch gives NaN for a row with none, attnkit zeros.
    """
    torch_kw: dict = {}
    ours: dict = {}
    parts = mask.split("+")
    if "key_padding" in parts:
        kpm = torch.rand(B, Lk, generator=g) < 0.5  # (B, Lk), True = ignore
        kpm[torch.arange(B), torch.randint(0, Lk, (B,), generator=g)] = False  # one key left in each row
        torch_kw["key_padding_mask"] = kpm
        ours["attn_mask"] = ~kpm[:, None, None, :]  # (B, 1, 1, Lk), True = may attend
    if "key_padding_prefix" in parts:
        valid_lens = torch.randint(1, Lk + 1, (B,), generator=g)
        valid_lens[0] = Lk  # one example without padding
        torch_kw["key_padding_mask"] = torch.arange(Lk) >= valid_lens[:, None]  # (B, Lk)
        ours["valid_lens"] = valid_lens
    if "causal_float" in parts:
        torch_kw["attn_mask"] = nn.Transformer.generate_square_subsequent_mask(Lq)  # (L, L), 0 and -inf
        ours["is_causal"] = True
    if "causal_bool_hint" in parts:
        torch_kw["attn_mask"] = torch.ones(Lq, Lk, dtype=torch.bool).triu(1)  # (L, L), True = ignore
        torch_kw["is_causal"] = True
        ours["is_causal"] = True
    if "causal" in parts:  # with a key padding mask: a boolean one, like key_padding_mask (torch warns on a mix)
        torch_kw["attn_mask"] = torch.ones(Lq, Lk, dtype=torch.bool).triu(1)
        ours["is_causal"] = True
    return torch_kw, ours


def run_torch(m: nn.MultiheadAttention, q, k, v, **kw) -> tuple[torch.Tensor, torch.Tensor | None]:
    """torch's output, batch first ``(B, Lq, E)``, from batch-first inputs, whatever ``m.batch_first`` is."""
    if not m.batch_first:
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # (B, L, .) -> (L, B, .)
    kw.setdefault("need_weights", False)
    out, weights = m(q, k, v, **kw)
    return (out if m.batch_first else out.transpose(0, 1)), weights


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape, f"{tuple(a.shape)} != {tuple(b.shape)}"
    return (a - b).abs().max().item()


# 1. from_torch


@pytest.mark.parametrize(
    ("seed", "bias", "packed", "batch_first", "attention", "mask"),
    [(seed, *case) for seed, case in enumerate(FROM_TORCH_CASES)],
    ids=[
        f"{'bias' if b else 'nobias'}-{'packed' if p else 'kdim_vdim'}-{'batch_first' if bf else 'seq_first'}-{a}-{m}"
        for b, p, bf, a, m in FROM_TORCH_CASES
    ],
)
def test_from_torch_matches_torch(seed, bias, packed, batch_first, attention, mask):
    m = make_torch_mha(seed, bias=bias, packed=packed, batch_first=batch_first)
    g = torch.Generator().manual_seed(10_000 + seed)
    q, k, v = make_inputs(g, packed=packed, attention=attention)
    torch_kw, ours_kw = make_masks(g, mask, q.shape[1], k.shape[1])
    ours = attnkit.MultiHeadAttention.from_torch(m, batch_first=True)
    with torch.no_grad():
        expected, _ = run_torch(m, q, k, v, **torch_kw)
        got = ours(q, k, v, **ours_kw)  # (B, Lq, E)
    assert not expected.isnan().any()
    assert max_diff(got, expected) <= TOL


def test_from_torch_keeps_the_sizes_and_dtype():
    m = make_torch_mha(1, bias=True, packed=False, batch_first=True).double()
    ours = attnkit.MultiHeadAttention.from_torch(m)
    assert (ours.num_hiddens, ours.num_heads, ours.num_kv_heads, ours.bias) == (E, H, H, True)
    assert [tuple(p.weight.shape) for p in (ours.W_q, ours.W_k, ours.W_v, ours.W_o)] == [
        (E, E),
        (E, KDIM),
        (E, VDIM),
        (E, E),
    ]
    assert all(p.dtype == torch.float64 for p in ours.parameters())


def test_from_torch_keeps_training_mode():
    """An eval-mode torch module with dropout gives an eval-mode attnkit module (to_torch keeps the mode too)."""
    m = make_torch_mha(2, bias=True, packed=True, batch_first=True, dropout=0.5)  # eval
    ours = attnkit.MultiHeadAttention.from_torch(m)
    assert ours.dropout == 0.5
    x = torch.randn(B, L_SELF, E, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected, _ = run_torch(m, x, x, x)
        got = ours(x, x, x)
    assert max_diff(got, expected) <= TOL  # no dropout in eval mode
    assert ours.training == m.training
    assert attnkit.MultiHeadAttention.from_torch(m.train()).training


@pytest.mark.parametrize("option", [{"add_bias_kv": True}, {"add_zero_attn": True}])
def test_from_torch_refuses_what_attnkit_cannot_express(option):
    m = nn.MultiheadAttention(E, H, **option)
    with pytest.raises(ValueError, match="add_bias_kv and add_zero_attn"):
        attnkit.MultiHeadAttention.from_torch(m)


def test_from_torch_refuses_a_sequence_first_layer_unless_told_the_inputs_will_be_batch_first():
    """torch's default layout is (L, B, E); fed to a batch-first module, the same tensors give a silently wrong
    result, so the conversion says so instead of guessing."""
    m = make_torch_mha(3, bias=True, packed=True, batch_first=False)
    with pytest.raises(ValueError, match=r"batch_first=False, so it takes \(L, B, E\).*x.transpose\(0, 1\)"):
        attnkit.MultiHeadAttention.from_torch(m)
    with pytest.raises(ValueError, match="take \\(B, L, E\\) only"):
        attnkit.MultiHeadAttention.from_torch(m, batch_first=False)
    x = torch.randn(B, L_SELF, E, generator=torch.Generator().manual_seed(3))  # (B, L, E)
    ours = attnkit.MultiHeadAttention.from_torch(m, batch_first=True)
    with torch.no_grad():
        expected, _ = m(*(x.transpose(0, 1),) * 3, need_weights=False)  # torch on (L, B, E)
        assert max_diff(ours(x, x, x), expected.transpose(0, 1)) <= TOL
    assert attnkit.MultiHeadAttention.from_torch(make_torch_mha(3, bias=True, packed=True, batch_first=True))


# 2. to_torch

ROUND_TRIP_CASES = list(itertools.product((True, False), repeat=3))  # bias, packed, batch_first
ROUND_TRIP_IDS = [
    f"{'bias' if b else 'nobias'}-{'packed' if p else 'kdim_vdim'}-{'batch_first' if bf else 'seq_first'}"
    for b, p, bf in ROUND_TRIP_CASES
]


@pytest.mark.parametrize(("bias", "packed", "batch_first"), ROUND_TRIP_CASES, ids=ROUND_TRIP_IDS)
def test_torch_to_attnkit_to_torch_gives_the_same_module(bias, packed, batch_first):
    seed = 100 + 4 * bias + 2 * packed + batch_first
    m = make_torch_mha(seed, bias=bias, packed=packed, batch_first=batch_first)
    back = attnkit.MultiHeadAttention.from_torch(m, batch_first=True).eval().to_torch(batch_first=batch_first)
    assert back.batch_first == batch_first
    assert not back.training
    expected_state, state = m.state_dict(), back.state_dict()
    assert list(state) == list(expected_state)
    for name, value in expected_state.items():
        assert torch.equal(state[name], value), name
    g = torch.Generator().manual_seed(seed)
    for attention in ("self", "cross"):
        q, k, v = make_inputs(g, packed=packed, attention=attention)
        torch_kw, _ = make_masks(g, "key_padding", q.shape[1], k.shape[1])
        with torch.no_grad():
            expected, _ = run_torch(m, q, k, v, **torch_kw)
            got, _ = run_torch(back, q, k, v, **torch_kw)
        assert max_diff(got, expected) <= TOL, attention


@pytest.mark.parametrize(("bias", "packed", "batch_first"), ROUND_TRIP_CASES, ids=ROUND_TRIP_IDS)
def test_attnkit_to_torch_to_attnkit_gives_equal_outputs(bias, packed, batch_first):
    seed = 200 + 4 * bias + 2 * packed + batch_first
    g = torch.Generator().manual_seed(seed)
    kdim, vdim = (E, E) if packed else (KDIM, VDIM)
    ours = attnkit.MultiHeadAttention(E, H, query_size=E, key_size=kdim, value_size=vdim, bias=bias).eval()
    for p in ours.parameters():
        nn.init.normal_(p, std=0.3, generator=g)
    theirs = ours.to_torch(batch_first=batch_first)
    assert theirs.batch_first == batch_first
    assert theirs._qkv_same_embed_dim == packed
    back = attnkit.MultiHeadAttention.from_torch(theirs, batch_first=True)
    q, k, v = make_inputs(g, packed=packed, attention="cross")
    torch_kw, ours_kw = make_masks(g, "key_padding", q.shape[1], k.shape[1])
    with torch.no_grad():
        expected = ours(q, k, v, **ours_kw)
        via_torch, _ = run_torch(theirs, q, k, v, **torch_kw)
        got = back(q, k, v, **ours_kw)
    assert max_diff(via_torch, expected) <= TOL
    assert max_diff(got, expected) <= TOL


def test_to_torch_after_the_first_call_of_a_lazy_module():
    torch.manual_seed(3)
    ours = attnkit.MultiHeadAttention(E, H, bias=True).eval()
    q, k, v = torch.randn(B, 5, E), torch.randn(B, 9, KDIM), torch.randn(B, 9, VDIM)
    with torch.no_grad():
        expected = ours(q, k, v)  # infers key_size and value_size
        got, _ = run_torch(ours.to_torch(), q, k, v)
    assert max_diff(got, expected) <= TOL


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: attnkit.MultiHeadAttention(E, H, query_size=E, key_size=E, value_size=E, num_kv_heads=2), "num_kv"),
        (lambda: attnkit.MultiHeadAttention(E, H, query_size=8, key_size=E, value_size=E), "query_size"),
        (lambda: attnkit.MultiHeadAttention(E, H), "not known yet"),
        (lambda: attnkit.MultiHeadAttention(E, H, query_size=E), "not known yet"),
    ],
    ids=["grouped_query", "query_size_not_num_hiddens", "lazy", "lazy_keys_and_values"],
)
def test_to_torch_refuses_what_torch_cannot_express(make, match):
    with pytest.raises(ValueError, match=match):
        make().to_torch()


# 3. torch's attention probabilities


@pytest.mark.parametrize(("bias", "packed", "batch_first"), ROUND_TRIP_CASES, ids=ROUND_TRIP_IDS)
@pytest.mark.parametrize("attention", ["self", "cross"])
def test_recorded_weights_equal_torch_weights(bias, packed, batch_first, attention):
    seed = 300 + 8 * (attention == "self") + 4 * bias + 2 * packed + batch_first
    m = make_torch_mha(seed, bias=bias, packed=packed, batch_first=batch_first)
    g = torch.Generator().manual_seed(seed)
    q, k, v = make_inputs(g, packed=packed, attention=attention)
    torch_kw, ours_kw = make_masks(g, "key_padding", q.shape[1], k.shape[1])
    ours = attnkit.MultiHeadAttention.from_torch(m, batch_first=True)
    with torch.no_grad():
        expected, expected_weights = run_torch(m, q, k, v, need_weights=True, average_attn_weights=False, **torch_kw)
        with attnkit.record_weights(ours) as rec:
            got = ours(q, k, v, **ours_kw)
    weights = rec[""]  # (B, H, Lq, Lk)
    assert weights.shape == (B, H, q.shape[1], k.shape[1])
    assert max_diff(weights, expected_weights) <= TOL
    assert max_diff(got, expected) <= TOL
    assert (weights[torch_kw["key_padding_mask"][:, None, None, :].expand_as(weights)] == 0).all()


# 4. torch.compile


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def mha_case(g: torch.Generator):
    model = attnkit.MultiHeadAttention(32, 4)  # lazy: its sizes are inferred under torch.compile
    x = torch.randn(2, 7, 32, generator=g)
    return model, (x, x.clone(), x.clone())


def additive_case(g: torch.Generator):
    model = attnkit.AdditiveAttention(16, query_size=8, key_size=8)
    q, k, v = torch.randn(2, 5, 8, generator=g), torch.randn(2, 7, 8, generator=g), torch.randn(2, 7, 6, generator=g)
    return model, (q, k, v)


def dot_case(g: torch.Generator):
    model = attnkit.DotProductAttention()
    q = torch.randn(2, 4, 5, 8, generator=g)  # (B, H, Lq, D)
    k, v = torch.randn(2, 2, 7, 8, generator=g), torch.randn(2, 2, 7, 6, generator=g)  # (B, Hkv, Lk, .)
    return model, (q, k, v)


COMPILE_CASES = {"mha": mha_case, "additive": additive_case, "dot": dot_case}


def check_compiled_matches_eager(name: str, backend: str) -> None:
    torch.manual_seed(0)  # the parameters of the layers
    model, inputs = COMPILE_CASES[name](torch.Generator().manual_seed(7))
    compiled = torch.compile(model, backend=backend)
    valid_lens = torch.tensor([7, 4])  # one full example, one padded
    for kw in ({"is_causal": True}, {"valid_lens": valid_lens}, {"valid_lens": valid_lens, "is_causal": True}):
        results = []
        for run in (compiled, model):  # compiled first: it initialises the lazy MultiHeadAttention
            leaves = [t.detach().clone().requires_grad_() for t in inputs]
            out = run(*leaves, **kw)
            grad_out = torch.linspace(-1, 1, out.numel()).reshape(out.shape)
            results.append((out, torch.autograd.grad(out, leaves, grad_out)))
        (got, got_grads), (expected, expected_grads) = results
        assert max_diff(got, expected) <= TOL, kw
        for label, grad, expected_grad in zip(("queries", "keys", "values"), got_grads, expected_grads, strict=True):
            assert max_diff(grad, expected_grad) <= TOL, f"d{label}, {kw}"


@pytest.mark.parametrize("name", COMPILE_CASES)
def test_compiled_matches_eager_aot_eager(name, fresh_dynamo):
    check_compiled_matches_eager(name, "aot_eager")


@pytest.mark.slow  # inductor needs ~25 s for MultiHeadAttention alone on a 2-core CPU
@pytest.mark.parametrize("name", COMPILE_CASES)
def test_compiled_matches_eager_inductor(name, fresh_dynamo):
    check_compiled_matches_eager(name, "inductor")
