"""attnkit.rollout against rollout from eager's whole weights (``output_attentions``) in float64, on a transformers
Llama (GQA) built from a config with attnkit's attention: each convention (mean or max over heads, with or without
the residual term), padding, bad input, and a forward with a cache refused."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

import attnkit
import tiny_models

transformers = pytest.importorskip("transformers")
from attnkit.integrations import transformers as attnkit_hf  # noqa: E402

# B batch, L length, V vocabulary
V, B, L = 96, 2, 37
# eager's softmax runs in float32 whatever the model's dtype (transformers' Llama): its weights are float32's, so the
# issue's bound, 1e-6 (7.9e-9 measured here)
TOL = 1e-6
NAME = attnkit_hf.register()


def _model(implementation: str) -> torch.nn.Module:
    return tiny_models.llama(implementation, vocab=V, layers=3).double()


OURS, EAGER = _model(NAME), _model("eager")
IDS = torch.randint(0, V, (B, L), generator=torch.Generator().manual_seed(1))


def _from_weights(weights: list[torch.Tensor], targets: list[int], heads: str, residual: float) -> torch.Tensor:
    """Rollout as written, from each layer's whole weights (B, H, L, L)."""
    r = torch.zeros(B, len(targets), L, dtype=torch.float64)
    for i, t in enumerate(targets):
        r[:, i, t % L] = 1.0
    eye = torch.eye(L, dtype=torch.float64)
    for w in reversed(weights):
        if heads == "mean":
            a = w.mean(dim=1)  # (B, L, L)
        else:
            a = w.amax(dim=1)
            a = a / a.sum(-1, keepdim=True)
        r = r @ ((1 - residual) * a + residual * eye)  # (B, T, L)
    return r


@pytest.mark.parametrize(("heads", "residual"), [("mean", 0.5), ("mean", 0.0), ("max", 0.5)])
def test_rollout_equals_rollout_from_eagers_whole_weights(heads, residual):
    targets = [-1, 5, 20]
    with torch.no_grad():
        weights = EAGER(IDS, output_attentions=True).attentions  # 3 x (B, H, L, L)
        with attnkit.rollout(OURS, targets, heads=heads, residual=residual) as found:
            OURS(IDS)
    want = _from_weights(list(weights), targets, heads, residual)
    assert found.layers == [f"model.layers.{i}.self_attn" for i in range(3)]
    assert found.relevance.shape == (B, 3, L)
    assert torch.allclose(found.relevance, want, atol=TOL, rtol=0)
    assert torch.allclose(found.relevance.sum(-1), torch.ones(B, 3, dtype=torch.float64))  # rows of a product of
    # stochastic matrices sum to 1 (max's rows are scaled to)
    assert (found.relevance[:, 1, 6:] == 0).all()  # causal: position 5 takes nothing from later ones


def test_left_padding_gives_padding_no_relevance_and_the_rest_as_the_tokens_alone():
    """A left-padded example's rollout over its real tokens is that of its tokens alone (RoPE is relative: the
    weights are the same at shifted positions); padding gets none. (eager is no reference here: in float64 its
    padding rows are NaN, a row of -inf, which reaches every later layer's real rows.)"""
    mask = torch.ones(B, L, dtype=torch.long)
    mask[1, :4] = 0
    with torch.no_grad():
        with attnkit.rollout(OURS, [-1, 10]) as padded:
            OURS(IDS, attention_mask=mask)
        with attnkit.rollout(OURS, [-1, 6]) as alone:
            OURS(IDS[1:, 4:])
    assert torch.allclose(padded.relevance[1, :, 4:], alone.relevance[0], atol=TOL, rtol=0)
    assert (padded.relevance[1, :, :4] == 0).all()


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"targets": [L]}, ValueError, f"{L} is out of range for {L} positions"),
        ({"targets": []}, TypeError, "non-empty list"),
        ({"targets": "last"}, TypeError, "non-empty list"),
        ({"targets": -1, "heads": "min"}, ValueError, "'mean' or 'max'"),
        ({"targets": -1, "residual": 1.5}, ValueError, r"in \[0, 1\]"),
        ({"targets": -1, "keep_bytes": -1}, ValueError, "a number of bytes"),
    ],
)
def test_bad_input_names_the_argument(kwargs, error, match):
    with pytest.raises(error, match=match), torch.no_grad(), attnkit.rollout(OURS, **kwargs):
        OURS(IDS)


def test_a_forward_with_a_cache_or_no_forward_is_refused():
    with torch.no_grad():
        cache = OURS(IDS[:, :10], use_cache=True).past_key_values
        with pytest.raises(ValueError, match="without a cache"), attnkit.rollout(OURS, -1):
            OURS(IDS[:, 10:12], past_key_values=cache)
    with pytest.raises(ValueError, match="no attention call"), attnkit.rollout(OURS, -1):
        pass


def test_layers_past_keep_bytes_go_to_a_file_and_give_the_same_relevance(monkeypatch, tmp_path):
    """keep_bytes=0: every layer's queries and keys go to the temporary file and come back one at a time; the
    folder is gone after the block, also after an exception inside it."""
    made = []
    real = tempfile.TemporaryDirectory

    def spy(*args, **kwargs):
        made.append(real(*args, dir=tmp_path, **kwargs))
        return made[-1]

    monkeypatch.setattr(tempfile, "TemporaryDirectory", spy)
    with torch.no_grad():
        with attnkit.rollout(OURS, [-1, 3]) as kept:
            OURS(IDS)
        with attnkit.rollout(OURS, [-1, 3], keep_bytes=0) as spilled:
            OURS(IDS)
            assert len(list(Path(made[-1].name).iterdir())) == 3  # one file a layer
        assert torch.equal(kept.relevance, spilled.relevance)
        with pytest.raises(RuntimeError, match="inside"), attnkit.rollout(OURS, -1, keep_bytes=0):
            OURS(IDS)
            raise RuntimeError("inside the block")
    assert list(tmp_path.iterdir()) == []
