"""attnkit's modules: shapes, grouped-query attention, masks, dropout, errors, record_weights."""

from __future__ import annotations

import copy
import gc
import re

import pytest
import torch
from torch import nn

import attnkit
from attnkit import d2l, dispatch, recording
from mathref import max_err


def test_modern_self_and_cross_attention_shapes():
    mha = attnkit.MultiHeadAttention(512, 8, dropout=0.1)
    q = torch.randn(10, 60, 512)
    assert mha(q, q, q).shape == (10, 60, 512)
    kv = torch.randn(10, 75, 512)
    assert mha(q, kv, kv).shape == (10, 60, 512)


def test_different_query_key_value_sizes_are_inferred_at_the_first_call():
    mha = attnkit.MultiHeadAttention(16, 4)
    out = mha(torch.randn(2, 3, 5), torch.randn(2, 7, 9), torch.randn(2, 7, 11), torch.tensor([7, 2]))
    assert out.shape == (2, 3, 16)
    assert mha.W_q.weight.shape == (16, 5) and mha.W_k.weight.shape == (16, 9) and mha.W_v.weight.shape == (16, 11)


def test_grouped_query_attention_equals_repeated_key_value_heads():
    torch.manual_seed(0)
    gqa = attnkit.MultiHeadAttention(32, 8, num_kv_heads=2, query_size=32, key_size=32, value_size=32, bias=True)
    plain = attnkit.MultiHeadAttention(32, 8, query_size=32, key_size=32, value_size=32, bias=True)
    assert gqa.W_k.weight.shape == (8, 32)  # 2 heads of 4
    with torch.no_grad():
        plain.W_q.load_state_dict(gqa.W_q.state_dict())
        plain.W_o.load_state_dict(gqa.W_o.state_dict())
        for name in ("W_k", "W_v"):
            small, big = getattr(gqa, name), getattr(plain, name)
            big.weight.copy_(small.weight.view(2, 4, 32).repeat_interleave(4, dim=0).reshape(32, 32))
            big.bias.copy_(small.bias.view(2, 4).repeat_interleave(4, dim=0).reshape(32))
    x, y = torch.randn(3, 5, 32), torch.randn(3, 9, 32)
    lens = torch.tensor([9, 4, 1])
    torch.testing.assert_close(gqa(x, y, y, lens), plain(x, y, y, lens), rtol=0, atol=1e-5)
    torch.testing.assert_close(gqa(x, x, x, is_causal=True), plain(x, x, x, is_causal=True), rtol=0, atol=1e-5)
    mqa = attnkit.MultiHeadAttention(32, 8, num_kv_heads=1)
    assert mqa(x, y, y).shape == (3, 5, 32)


def test_attn_mask_of_two_three_and_four_dims():
    torch.manual_seed(1)
    mha = attnkit.MultiHeadAttention(16, 4).eval()
    x, y = torch.randn(2, 3, 16), torch.randn(2, 5, 16)
    allowed = torch.rand(2, 4, 3, 5) < 0.6
    per_head = mha(x, y, y, attn_mask=allowed)
    shared = allowed[:, :1].expand(2, 4, 3, 5)
    torch.testing.assert_close(mha(x, y, y, attn_mask=allowed[:, 0]), mha(x, y, y, attn_mask=shared))
    torch.testing.assert_close(mha(x, y, y, attn_mask=allowed[0, 0]), mha(x, y, y, attn_mask=allowed[:1, :1]))
    assert not torch.allclose(per_head, mha(x, y, y, attn_mask=shared))


def test_dropout_acts_only_in_training_mode():
    torch.manual_seed(2)
    mha = attnkit.MultiHeadAttention(16, 4, dropout=0.5)
    x = torch.randn(2, 6, 16)
    mha.eval()
    torch.testing.assert_close(mha(x, x, x), mha(x, x, x), rtol=0, atol=0)
    mha.train()
    assert not torch.allclose(mha(x, x, x), mha(x, x, x))


def test_construction_errors():
    with pytest.raises(ValueError, match=re.escape("num_hiddens (100) must be a multiple of num_heads (8)")):
        attnkit.MultiHeadAttention(100, 8)
    with pytest.raises(ValueError, match=re.escape("num_heads (8) must be a multiple of num_kv_heads (3)")):
        attnkit.MultiHeadAttention(64, 8, num_kv_heads=3)
    with pytest.raises(ValueError, match=re.escape("dropout must be in [0, 1), got 1.5")):
        attnkit.DotProductAttention(1.5)
    with pytest.raises(ValueError, match=re.escape("num_hiddens must be positive, got -32")):
        attnkit.MultiHeadAttention(-32, 4)
    with pytest.raises(ValueError, match=re.escape("num_hiddens must be positive, got 0")):
        attnkit.AdditiveAttention(0)
    with pytest.raises(TypeError, match=re.escape("num_heads must be a whole number, got 4.0")):
        attnkit.MultiHeadAttention(32, 4.0)
    with pytest.raises(TypeError, match=re.escape("num_kv_heads must be a whole number, got 2.0")):
        attnkit.MultiHeadAttention(32, 4, num_kv_heads=2.0)
    with pytest.raises(ValueError, match=re.escape("key_size must be positive, got 0")):
        attnkit.AdditiveAttention(8, key_size=0)


def test_wrong_input_feature_size_names_the_expected_size():
    mha = attnkit.MultiHeadAttention(16, 4, query_size=16, key_size=12, value_size=12)
    x = torch.randn(2, 3, 16)
    with pytest.raises(ValueError, match=re.escape("keys must have 12 features") + ".*got 16: keys \\(2, 3, 16\\)"):
        mha(x, x, x)
    mha = attnkit.MultiHeadAttention(16, 4)
    mha(x, x, x)  # sizes inferred: 16
    with pytest.raises(ValueError, match=re.escape("queries must have 16 features")):
        mha(torch.randn(2, 3, 8), x, x)
    additive = attnkit.AdditiveAttention(8, query_size=4, key_size=4)
    with pytest.raises(ValueError, match=re.escape("queries must have 4 features")):
        additive(torch.randn(2, 3, 5), torch.randn(2, 3, 4), torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match=re.escape("keys has 3 positions but values has 4")):
        attnkit.MultiHeadAttention(16, 4)(x, x, torch.randn(2, 4, 16))


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = attnkit.MultiHeadAttention(16, 4)
        self.decoder = nn.ModuleDict({"cross": attnkit.AdditiveAttention(8), "dot": attnkit.DotProductAttention()})

    def forward(self, x, y, lens):
        h = self.encoder(x, x, x, lens)
        h = self.decoder["cross"](h, y, y)
        return self.decoder["dot"](h, h, h, is_causal=True)


def test_record_weights_equal_the_reference_backend_and_leave_no_state():
    torch.manual_seed(3)
    model = _Model().eval()
    x, y, lens = torch.randn(2, 5, 16), torch.randn(2, 7, 16), torch.tensor([5, 3])
    before = model(x, y, lens)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with attnkit.record_weights(model) as rec, dispatch.watch() as ran:
        during = model(x, y, lens)
    assert set(rec) == {"encoder", "decoder.cross", "decoder.dot"}
    # the output still comes from the fast backend (small additive attention runs on the reference anyway);
    # the weights are computed beside it, by the reference math, without an output
    assert ran == ["sdpa", "reference", "sdpa"]
    assert during.requires_grad and not any(w.requires_grad for w in rec.values())
    torch.testing.assert_close(during, before, rtol=0, atol=0)

    enc = model.encoder
    q = enc.W_q(x).view(2, 5, 4, 4).transpose(1, 2)
    k = enc.W_k(x).view(2, 5, 4, 4).transpose(1, 2)
    v = enc.W_v(x).view(2, 5, 4, 4).transpose(1, 2)
    expected = attnkit.scaled_dot_product_attention(q, k, v, valid_lens=lens, need_weights=True, backend="reference")
    assert rec["encoder"].shape == (2, 4, 5, 5)
    torch.testing.assert_close(rec["encoder"], expected.weights)
    assert (rec["encoder"][1, :, :, 3:] == 0).all()
    assert rec["decoder.cross"].shape == (2, 5, 7) and rec["decoder.dot"].shape == (2, 5, 5)

    for module in model.modules():
        assert recording.recorder(module) is None
        assert not module._forward_hooks and not module._forward_pre_hooks
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    with dispatch.watch() as ran:
        model(x, y, lens)
    assert ran == ["sdpa", "reference", "sdpa"]  # small additive attention runs on the reference anyway


def test_record_weights_keeps_every_call():
    attn = attnkit.DotProductAttention()
    x = torch.randn(1, 3, 4)
    with attnkit.record_weights(attn) as rec:
        attn(x, x, x)
        attn(x[:, :2], x, x)
    assert [w.shape for w in rec.calls("")] == [(1, 3, 3), (1, 2, 3)]
    assert rec[""].shape == (1, 2, 3)


def test_nested_records_of_the_same_model_both_see_the_inner_calls():
    attn = attnkit.DotProductAttention()
    x = torch.randn(1, 3, 4)
    with attnkit.record_weights(attn) as outer:
        attn(x, x, x)
        with attnkit.record_weights(attn) as inner:
            attn(x[:, :2], x, x)
        attn(x[:, :1], x, x)  # the outer record goes on after the inner one closes
    attn(x, x, x)
    assert [w.shape[1] for w in outer.calls("")] == [3, 2, 1]
    assert [w.shape[1] for w in inner.calls("")] == [2]


def test_parent_and_child_records_open_together_both_record():
    torch.manual_seed(0)
    model = _Model().eval()
    x, y, lens = torch.randn(2, 5, 16), torch.randn(2, 7, 16), torch.tensor([5, 3])
    with attnkit.record_weights(model) as whole, attnkit.record_weights(model.decoder) as part:
        model(x, y, lens)
    assert set(whole) == {"encoder", "decoder.cross", "decoder.dot"} and set(part) == {"cross", "dot"}
    torch.testing.assert_close(whole["decoder.dot"], part["dot"], rtol=0, atol=0)


def test_records_closed_out_of_order_each_see_the_calls_made_while_open():
    attn = attnkit.DotProductAttention()
    x = torch.randn(1, 3, 4)
    first_cm, second_cm = attnkit.record_weights(attn), attnkit.record_weights(attn)
    first, second = first_cm.__enter__(), second_cm.__enter__()
    attn(x, x, x)
    first_cm.__exit__(None, None, None)  # closed before the record opened after it
    attn(x[:, :2], x, x)
    second_cm.__exit__(None, None, None)
    attn(x, x, x)
    assert [w.shape[1] for w in first.calls("")] == [3]
    assert [w.shape[1] for w in second.calls("")] == [3, 2]


def _records_reachable_from(obj: object) -> list[recording.WeightRecord]:
    """The WeightRecords reachable from ``obj`` through modules, dicts, lists, tuples and sets."""
    found, seen, todo = [], set(), [obj]
    while todo:
        o = todo.pop()
        if id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, recording.WeightRecord):
            found.append(o)
        elif isinstance(o, (nn.Module, dict, list, tuple, set)):
            todo.extend(gc.get_referents(o))
    return found


def test_a_name_not_recorded_is_a_key_error_that_lists_the_recorded_names():
    """A newcomer's first guess at a name (the README's encoder keys its layer "attention") must say what exists."""
    model = torch.nn.Sequential(attnkit.MultiHeadAttention(16, 2))
    x = torch.randn(1, 3, 16)
    with attnkit.record_weights(model) as rec:
        model[0](x, x, x)
    with pytest.raises(KeyError, match=r"no call of a module named 'attention' was recorded; recorded: '0'"):
        rec["attention"]
    with attnkit.record_weights(model) as empty:
        pass
    with pytest.raises(KeyError, match="recorded: nothing"):
        empty["0"]


def test_a_deepcopy_made_inside_a_record_block_carries_no_recording():
    torch.manual_seed(0)
    model = _Model().eval()
    x, y, lens = torch.randn(2, 5, 16), torch.randn(2, 7, 16), torch.tensor([5, 3])
    with attnkit.record_weights(model) as rec:
        model(x, y, lens)
        twin = copy.deepcopy(model)
        twin(x, y, lens)  # another model: not the one being recorded
    assert {name: len(rec.calls(name)) for name in rec} == {"encoder": 1, "decoder.cross": 1, "decoder.dot": 1}
    twin(x, y, lens)
    assert _records_reachable_from(twin) == []
    with attnkit.record_weights(twin) as twin_rec:  # the twin records as any model does, once per call
        twin(x, y, lens)
    assert {name: len(twin_rec.calls(name)) for name in twin_rec} == {
        "encoder": 1,
        "decoder.cross": 1,
        "decoder.dot": 1,
    }
    torch.testing.assert_close(twin_rec["encoder"], rec["encoder"], rtol=0, atol=0)


def test_record_weights_records_the_books_modules_without_computing_them_again():
    torch.manual_seed(0)
    model = nn.ModuleDict(
        {
            "mha": d2l.MultiHeadAttention(100, 100, 100, 100, 5, 0.5),
            "additive": d2l.AdditiveAttention(2, 20, 8, 0.1),
            "dot": d2l.DotProductAttention(0.5),
        }
    ).eval()
    X, Y, lens = torch.randn(2, 4, 100), torch.randn(2, 6, 100), torch.tensor([3, 2])
    q, k, v = torch.randn(2, 1, 20), torch.randn(2, 10, 2), torch.randn(2, 10, 4)
    with attnkit.record_weights(model) as rec, dispatch.watch() as ran:
        model["mha"](X, Y, Y, lens)
        model["additive"](q, k, v, torch.tensor([2, 6]))
        model["dot"](X, Y, Y, lens)
    assert ran == ["reference"] * 3  # one call each: the book's modules compute their weights, the record keeps them
    assert set(rec) == {"mha", "mha.attention", "additive", "dot"}
    mha = model["mha"]
    # the book's layout inside (heads folded into the batch), attnkit's (B, H, Lq, Lk) for the layer itself
    assert rec["mha.attention"].shape == (10, 4, 6) and rec["mha"].shape == (2, 5, 4, 6)
    torch.testing.assert_close(rec["mha"], mha.attention.attention_weights.reshape(2, 5, 4, 6), rtol=0, atol=0)
    assert (rec["mha"][0, :, :, 3:] == 0).all() and (rec["mha"][1, :, :, 2:] == 0).all()
    owners = {"mha": mha.attention, "mha.attention": mha.attention, "additive": model["additive"], "dot": model["dot"]}
    for name, owner in owners.items():  # the same memory: kept, not computed again
        assert rec[name].data_ptr() == owner.attention_weights.data_ptr()
    torch.testing.assert_close(rec["additive"], model["additive"].attention_weights, rtol=0, atol=0)
    torch.testing.assert_close(rec["dot"], model["dot"].attention_weights, rtol=0, atol=0)
    assert not any(w.requires_grad for w in rec.values())
    with attnkit.record_weights(mha) as alone:  # recorded on its own: named ""
        mha(X, Y, Y, lens)
    assert set(alone) == {"", "attention"} and alone[""].shape == (2, 5, 4, 6)


# --- autocast ---------------------------------------------------------------------------------------------------


def _autocast_layers():
    from attnkit import d2l

    return {
        "DotProductAttention": lambda: attnkit.DotProductAttention(),
        "AdditiveAttention": lambda: attnkit.AdditiveAttention(16, query_size=12, key_size=10),
        "AdditiveAttention(inferred)": lambda: attnkit.AdditiveAttention(16),
        "MultiHeadAttention": lambda: attnkit.MultiHeadAttention(16, 4, query_size=12, key_size=10, value_size=10),
        "MultiHeadAttention(gqa)": lambda: attnkit.MultiHeadAttention(16, 4, num_kv_heads=2),
        "d2l.DotProductAttention": lambda: d2l.DotProductAttention(0.0),
        "d2l.AdditiveAttention": lambda: d2l.AdditiveAttention(10, 12, 16, 0.0),
        "d2l.AdditiveAttention(inferred)": lambda: d2l.AdditiveAttention(16, 0.0),
        "d2l.MultiHeadAttention": lambda: d2l.MultiHeadAttention(10, 12, 10, 16, 4, 0.0),
        "d2l.MultiHeadAttention(inferred)": lambda: d2l.MultiHeadAttention(16, 4, 0.0),
    }


AUTOCAST_DEVICES = [
    pytest.param("cpu", torch.bfloat16, id="cpu-bfloat16"),
    pytest.param(
        "cuda",
        torch.float16,
        id="cuda-float16",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        ],
    ),
]


@pytest.mark.parametrize(("device", "low"), AUTOCAST_DEVICES)
@pytest.mark.parametrize("name", list(_autocast_layers()))
def test_every_layer_runs_under_autocast_within_the_low_precision_tolerance(name, device, low):
    """Under torch.autocast each layer runs (no dtype mismatch between projected queries and raw values), returns the
    autocast dtype, and its error against float64 is at most twice that of the same layer run wholly in the low
    precision, forward and backward."""
    torch.manual_seed(0)
    layer = _autocast_layers()[name]().to(device)
    g = torch.Generator().manual_seed(1)
    dot = name.endswith("DotProductAttention")
    features = (16, 16, 16) if name.endswith("(inferred)") or name.endswith("(gqa)") else (12, 10, 10)
    if dot:
        features = (12, 12, 10)
    lens = torch.tensor([5, 9], device=device)
    x = [torch.randn(2, n, f, generator=g).to(device) for n, f in zip((7, 9, 9), features, strict=True)]
    with torch.no_grad():
        layer(*x, lens)  # sizes inferred, lazy parameters made
    grad_out = None

    def run(model, dtype, autocast):
        nonlocal grad_out
        inputs = [t.to(dtype).requires_grad_() for t in x]
        with torch.autocast(device, dtype=low, enabled=autocast):
            out = model(*inputs, lens)
        if grad_out is None:
            grad_out = torch.randn(out.shape, generator=g).to(device)
        grads = torch.autograd.grad(out, inputs, grad_out.to(out.dtype))
        return out, grads

    truth, true_grads = run(copy.deepcopy(layer).double(), torch.float64, False)
    wholly_low, low_grads = run(copy.deepcopy(layer).to(low), low, False)
    out, grads = run(layer, torch.float32, True)
    assert out.dtype == low
    assert torch.isfinite(out).all()
    assert max_err(out, truth) <= 2 * max_err(wholly_low, truth) + 1e-6
    for grad, low_grad, true in zip(grads, low_grads, true_grads, strict=True):
        assert max_err(grad, true) <= 2 * max_err(low_grad, true) + 1e-6
