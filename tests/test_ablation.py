"""attnkit.ablate_heads and attnkit.head_sweep on a transformers Llama (GQA) built from a config, attention on
attnkit: each mode against the same change made by hand at the output projection's input (where transformers
concatenates the heads), the model as it was after every block (also after an exception), and bad input."""

from __future__ import annotations

import threading

import pytest
import torch

import attnkit
import tiny_models

transformers = pytest.importorskip("transformers")
from attnkit.integrations import transformers as attnkit_hf  # noqa: E402

# B batch, L length, V vocabulary, H heads, Dh head dim
V, B, L, H, DH = 96, 2, 13, 4, 16
NAME = attnkit_hf.register()
LAYER = "model.layers.1.self_attn"


def _model(implementation: str = NAME) -> torch.nn.Module:
    return tiny_models.llama(implementation, vocab=V, hidden=H * DH, heads=H)


MODEL = _model()
IDS = torch.randint(0, V, (B, L), generator=torch.Generator().manual_seed(1))


def _by_hand(heads: list[int], change) -> torch.Tensor:  # noqa: ANN001
    """The logits with ``change`` applied to the chosen heads' slices of o_proj's input ``(B, L, H * DH)``."""
    o_proj = MODEL.get_submodule(LAYER).o_proj

    def hook(module, args):  # noqa: ANN001, ANN202
        x = args[0].unflatten(-1, (H, DH)).clone()  # (B, L, H, DH)
        for h in heads:
            x[:, :, h] = change(x[:, :, h])
        return (x.flatten(-2),)

    handle = o_proj.register_forward_pre_hook(hook)
    try:
        with torch.no_grad():
            return MODEL(IDS).logits
    finally:
        handle.remove()


@pytest.mark.parametrize(
    ("mode", "change"),
    [
        ("zero", lambda x: torch.zeros_like(x)),
        ("mean", lambda x: x.mean(dim=1, keepdim=True).expand_as(x)),  # x (B, L, DH): over the queries
        (0.5, lambda x: 0.5 * x),
    ],
    ids=["zero", "mean", "scale"],
)
def test_each_mode_equals_the_same_change_made_at_the_output_projection(mode, change):
    with torch.no_grad(), attnkit.ablate_heads(MODEL, {LAYER: [0, 3]}, mode=mode):
        ours = MODEL(IDS).logits
    want = _by_hand([0, 3], change)
    assert torch.allclose(ours, want, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        plain = MODEL(IDS).logits
    assert not torch.allclose(ours, plain, atol=1e-3)  # the ablation changed something
    assert torch.allclose(plain, _by_hand([], change), atol=0, rtol=0)  # and the block left nothing behind


def test_a_scale_of_one_changes_nothing_and_patterns_choose_every_layer():
    with torch.no_grad():
        plain = MODEL(IDS).logits
        with attnkit.ablate_heads(MODEL, {LAYER: 2}, mode=1.0):
            same = MODEL(IDS).logits
        with attnkit.ablate_heads(MODEL, {"model.layers.*.self_attn": [-1]}):  # head 3 of both layers
            both = MODEL(IDS).logits
        with attnkit.ablate_heads(MODEL, {"model.layers.0.self_attn": 3}), attnkit.ablate_heads(MODEL, {LAYER: 3}):
            nested = MODEL(IDS).logits
    assert torch.equal(same, plain)
    assert torch.allclose(both, nested, atol=1e-6)


def test_gradients_flow_through_an_ablated_call_and_only_the_chosen_heads_lose_theirs():
    """With zero ablation the chosen heads' query projections get no gradient from this layer's output."""
    attention = MODEL.get_submodule(LAYER)
    MODEL.zero_grad()
    with attnkit.ablate_heads(MODEL, {LAYER: [1]}):
        MODEL(IDS).logits.sum().backward()
    grad = attention.q_proj.weight.grad.unflatten(0, (H, DH))  # (H, DH, hidden)
    assert grad[1].abs().max() == 0 and all(grad[h].abs().max() > 0 for h in (0, 2, 3))
    MODEL.zero_grad()


def test_the_model_is_as_it_was_after_an_exception_and_another_thread_sees_no_ablation():
    with torch.no_grad():
        plain = MODEL(IDS).logits
    seen = {}

    def other() -> None:
        with torch.no_grad():
            seen["logits"] = MODEL(IDS).logits

    with pytest.raises(RuntimeError, match="inside"), attnkit.ablate_heads(MODEL, {LAYER: [0, 1, 2, 3]}):
        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        raise RuntimeError("inside the block")
    assert torch.equal(seen["logits"], plain)
    with torch.no_grad():
        assert torch.equal(MODEL(IDS).logits, plain)


def test_head_sweep_gives_each_heads_logit_change_as_one_ablation_at_a_time():
    token = 5
    sweep = attnkit.head_sweep(MODEL, IDS, token, position=-2)
    assert sweep.names == ["model.layers.0.self_attn", LAYER] and sweep.change.shape == (2, H)
    with torch.no_grad():
        base = MODEL(IDS).logits[0, -2, token].item()
        with attnkit.ablate_heads(MODEL, {LAYER: 2}):
            one = MODEL(IDS).logits[0, -2, token].item()
    assert sweep.base == pytest.approx(base, abs=1e-6)
    assert sweep.change[1, 2].item() == pytest.approx(one - base, abs=1e-6)
    assert (sweep.change != 0).all()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"heads": {"model.layers.7.self_attn": 0}}, ValueError, r"names no attention module; they are: 'model"),
        ({"heads": {LAYER: 4}}, ValueError, r"head 4 of 'model.layers.1.self_attn', which has 4 heads"),
        ({"heads": {LAYER: []}}, ValueError, "maps to no head"),
        ({"heads": {}}, ValueError, "at least one module"),
        ({"heads": {LAYER: "0"}}, TypeError, "a head index or a list"),
        ({"heads": [LAYER]}, TypeError, "maps attention module names"),
        ({"heads": {LAYER: 0}, "mode": "half"}, ValueError, "'zero', 'mean' or a number"),
        ({"heads": {LAYER: 0}, "mode": float("nan")}, TypeError, "finite number"),
    ],
)
def test_bad_input_names_the_argument(kwargs, error, match):
    with pytest.raises(error, match=match), attnkit.ablate_heads(MODEL, **kwargs):
        pass


def test_a_model_whose_attention_is_not_attnkits_is_refused_with_how_to_switch():
    eager = _model("eager")
    with (
        pytest.raises(ValueError, match="not attnkit's.*set_attn_implementation"),
        attnkit.ablate_heads(eager, {LAYER: 0}),
    ):
        pass
    with pytest.raises(TypeError, match="torch.nn.Module"):
        attnkit.head_sweep("model", IDS, 0)
    with pytest.raises(ValueError, match="out of range"):
        attnkit.head_sweep(MODEL, IDS, V)
