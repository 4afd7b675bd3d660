"""The presses on SmolLM2-135M-Instruct (attnkit.integrations.smollm2): every press whose scores come from
attention weights, through attnkit in float32, against the same formula on eager's weights of the float64 model,
every layer and key/value head, and the kept sets, ties aside. make test runs the first 4 layers at 1,024 tokens;
make test-all all 30 layers at 1,024 and 2,048."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from attnkit import presses
from test_presses import _close, _same_kept, observed, snapkv, tova

pytest.importorskip("transformers")
from attnkit.integrations import smollm2  # noqa: E402

try:
    smollm2.gguf_path()
    smollm2.check_installed()
except ModuleNotFoundError as err:
    if os.environ.get("CI"):  # CI runs make test, whose make venv installs the model: missing there is a failure
        raise
    pytest.skip(str(err), allow_module_level=True)

# float32 through up to 30 layers against float64: measured at most 3e-6 relative (ObservedAttention, 1,024 tokens)
TOL = 1e-5
HKV = 3

PRESSES = {
    "observed": (lambda: presses.ObservedAttention(0.5), lambda a: observed(a, hkv=HKV)),
    "snapkv": (lambda: presses.SnapKV(0.5), lambda a: snapkv(a, hkv=HKV)),
    "question": (lambda: presses.QuestionAware(0.5, question_tokens=24), lambda a: snapkv(a, 24, 1, HKV)),
    "tova": (lambda: presses.TOVA(0.5), lambda a: tova(a, HKV)),
}


def _text_ids(tokenizer, length: int) -> torch.Tensor:
    """``(1, length)`` tokens of seeded random English words (the same every run; no file of the project's)."""
    words = [
        "the",
        "of",
        "and",
        "to",
        "in",
        "is",
        "was",
        "for",
        "that",
        "on",
        "with",
        "as",
        "by",
        "at",
        "from",
        "his",
        "her",
        "they",
        "which",
        "this",
        "have",
        "had",
        "were",
        "are",
        "but",
        "river",
        "mountain",
        "city",
        "market",
        "letter",
        "garden",
        "winter",
        "station",
        "number",
        "answer",
        "question",
        "morning",
        "village",
        "story",
        "people",
        "water",
        "light",
        "house",
        "road",
        "school",
        "music",
        "paper",
        "window",
        "silver",
        "animal",
        "forest",
        "island",
        "engine",
        "doctor",
    ]
    pick = torch.randint(0, len(words), (length,), generator=torch.Generator().manual_seed(7)).tolist()
    ids = tokenizer(" ".join(words[i] for i in pick), return_tensors="pt").input_ids
    return ids[:, :length]


def _first(model, layers: int):
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    return model


@pytest.mark.parametrize(
    ("layers", "length"),
    [(4, 1024), pytest.param(30, 1024, marks=pytest.mark.slow), pytest.param(30, 2048, marks=pytest.mark.slow)],
)
def test_scores_equal_eager_float64_on_smollm2(layers, length):
    model, tokenizer = smollm2.load(quiet=True)
    model = _first(model, layers)
    eager = _first(smollm2.load(attn_implementation="eager", dtype=torch.float64, quiet=True)[0], layers)
    ids = _text_ids(tokenizer, length)
    assert ids.shape == (1, length)
    refs: dict[str, list[torch.Tensor]] = {kind: [] for kind in PRESSES}

    def reduce(module, args, output):  # each layer's float64 weights (1, 9, L, L), reduced as they come
        for kind, (_, formula) in PRESSES.items():
            refs[kind].append(formula(output[1]))

    hooks = [layer.self_attn.register_forward_hook(reduce) for layer in eager.model.layers]
    with torch.no_grad():
        eager(ids, use_cache=False)
    for hook in hooks:
        hook.remove()
    for kind, (make, _) in PRESSES.items():
        press = make()
        with torch.no_grad(), press(model):
            out = model(ids)
        assert sorted(press.scores) == list(range(layers)), kind
        for i, ref in enumerate(refs[kind]):
            _close(press.scores[i], ref, TOL)
            _same_kept(press.kept[i], ref, TOL)
            assert out.past_key_values.layers[i].keys.shape == (1, HKV, length // 2, 64)


@pytest.mark.parametrize(("length", "depth"), [(300, 0.0), (300, 1.0), (1024, 0.5), (2048, 0.9), (8150, 0.5)])
def test_the_needle_prompt_holds_its_value_at_its_depth_in_about_its_length(length, depth):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2.converted(quiet=True))
    needle = smollm2.needle(tokenizer, length, depth, value="1234567")
    n = needle.context.shape[1]
    assert length - 16 <= n <= length, n  # the haystack's whole sentences, up to `length`
    assert needle.ids.shape == (1, n + needle.question.shape[1] + needle.rest.shape[1])
    text = tokenizer.decode(needle.context[0])
    sentence = "One of the special magic numbers for lively-harbor is: 1234567."
    at = text.index(sentence)
    haystack = text.index("<|im_start|>user\n") + len("<|im_start|>user\n")
    assert abs((at - haystack) / (len(text) - haystack - len(sentence)) - depth) < 0.02, (at, haystack, len(text))
    if depth in (0.0, 1.0):  # the needle the first or last sentence, nothing stray around it
        assert text[haystack:].startswith("One of") if depth == 0 else text.endswith("is: 1234567.")
    assert tokenizer.decode(needle.question[0]).strip().startswith("What is the special magic number")
    assert tokenizer.decode(needle.rest[0]).endswith("mentioned in the provided text is")


def test_the_needle_prompt_refuses_a_depth_outside_0_to_1_and_a_length_too_short():
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2.converted(quiet=True))
    for depth in (-0.1, 1.5):
        with pytest.raises(ValueError, match="depth="):
            smollm2.needle(tokenizer, 1024, depth)
    with pytest.raises(ValueError, match=r"length=10: .* at least \d+"):
        smollm2.needle(tokenizer, 10)
    for wrong in ({"length": 300.0}, {"length": True}, {"length": 300, "depth": "0.5"}, {"length": 300, "value": 7}):
        with pytest.raises(TypeError, match="length|depth|value"):
            smollm2.needle(tokenizer, **wrong)
    with pytest.raises(ValueError, match="value: empty"):
        smollm2.needle(tokenizer, 300, value="")
    assert torch.equal(smollm2.needle(tokenizer, np.int64(300)).ids, smollm2.needle(tokenizer, 300).ids)


@pytest.mark.parametrize(
    ("length", "depth", "value", "n", "digest"),
    [(1024, 0.5, "4817263", 1061, "6e1cff7b536b63f0"), (2048, 0.1, "1234567", 2086, "16de04dfe71ef03f")],
)
def test_the_needle_prompt_is_the_one_the_presses_benchmark_measured(length, depth, value, n, digest):
    """The prompt of benchmarks/presses.py's measurements, pinned: its needle_prompt moved into the library (and
    searches its sentences by halves instead of one by one), and gave these ids before the move (the same as the new
    code's for every length from 48 to 1,100 tokens and depth from 0 to 1 tried then)."""
    import hashlib

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2.converted(quiet=True))
    ids = smollm2.needle(tokenizer, length, depth, value).ids[0].tolist()
    assert len(ids) == n and hashlib.sha256(str(ids).encode()).hexdigest()[:16] == digest
