"""attnkit.rollout on SmolLM2-135M-Instruct (attnkit.integrations.smollm2) against rollout from eager's whole
weights at 1,024 tokens: both models in float64 (eager's softmax itself runs in float32: the issue's bound, 1e-6).
The first 4 layers in make test, all 30 in make test-all."""

from __future__ import annotations

import pytest
import torch

import attnkit
from attnkit.integrations import smollm2
from test_presses_smollm2 import _first, _text_ids  # (it skips the module where the model is not installed)

TOL = 1e-6


@pytest.mark.parametrize("layers", [4, pytest.param(30, marks=pytest.mark.slow)])
def test_rollout_equals_rollout_from_eagers_weights_on_smollm2(layers):
    length, targets = 1024, [-1, -2, 500, 100]
    model, tokenizer = smollm2.load(dtype=torch.float64, quiet=True)
    model = _first(model, layers)
    eager = _first(smollm2.load(attn_implementation="eager", dtype=torch.float64, quiet=True)[0], layers)
    ids = _text_ids(tokenizer, length)
    means: list[torch.Tensor] = []

    def keep(module, args, output):  # each layer's weights (1, 9, L, L), averaged over the heads as they come
        means.append(output[1].mean(dim=1))

    hooks = [layer.self_attn.register_forward_hook(keep) for layer in eager.model.layers]
    with torch.no_grad():
        eager(ids, use_cache=False, output_attentions=True)
        with attnkit.rollout(model, targets) as found:
            model(ids, use_cache=False)
    for hook in hooks:
        hook.remove()
    r = torch.zeros(1, len(targets), length, dtype=torch.float64)
    for i, t in enumerate(targets):
        r[0, i, t % length] = 1.0
    for a in reversed(means):
        r = 0.5 * r + 0.5 * r @ a  # (1, T, L)
    assert len(found.layers) == layers
    assert (found.relevance - r).abs().max().item() <= TOL
