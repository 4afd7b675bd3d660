"""Shape traces: the steps, their shapes and order, the book's view, and nothing left behind."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch
from torch import nn

import attnkit
from attnkit import d2l, mods, trace

X, Y = torch.ones((2, 4, 100)), torch.ones((2, 6, 100))
LENS = torch.tensor([3, 2])


def _find(t, step):
    return [s for s in t.steps if s.step == step]


def test_book_multihead_trace_shows_the_books_view():
    mha = d2l.MultiHeadAttention(100, 100, 100, 100, 5, 0.5).eval()
    with attnkit.trace_shapes() as t:
        mha(X, Y, Y, LENS)
    split = _find(t, "transpose_qkv")
    assert [(s.shapes_in, s.shape_out) for s in split] == [
        ([(2, 4, 100)], (10, 4, 20)),
        ([(2, 6, 100)], (10, 6, 20)),
        ([(2, 6, 100)], (10, 6, 20)),
    ]
    (repeat,) = _find(t, "repeat valid_lens")
    assert repeat.note == "[3, 2] -> [3, 3, 3, 3, 3, 2, 2, 2, 2, 2]"
    (scores,) = _find(t, "scores")
    assert scores.module == "MultiHeadAttention.attention" and scores.shape_out == (10, 4, 6)
    (merge,) = _find(t, "transpose_output")
    assert merge.shapes_in == [(10, 4, 20)] and merge.shape_out == (2, 4, 100)
    text = str(t)
    assert "transpose_qkv" in text and "(2, 4, 100)" in text and "-> (10, 4, 20)" in text


def test_multihead_trace_has_every_step_in_order():
    mha = attnkit.MultiHeadAttention(100, 5).eval()
    with attnkit.trace_shapes() as t:
        mha(X, Y, Y, LENS)
    assert [s.step for s in t.steps] == [
        "W_q",
        "W_k",
        "W_v",
        "split heads",
        "split heads",
        "split heads",
        "scores",
        "mask",
        "softmax",
        "weighted sum",
        "merge heads",
        "W_o",
    ]
    by_step = {s.step: s for s in reversed(t.steps)}  # the first of each
    assert by_step["split heads"].shapes_in == [(2, 4, 100)] and by_step["split heads"].shape_out == (2, 5, 4, 20)
    assert by_step["scores"].shape_out == (2, 5, 4, 6)
    assert by_step["mask"].note == "valid_lens [3, 2]"
    assert "backend sdpa" in by_step["weighted sum"].note
    assert by_step["merge heads"].shape_out == (2, 4, 100)
    assert all(s.module == "MultiHeadAttention" for s in t.steps)


def test_markdown_and_json():
    with attnkit.trace_shapes() as t:
        attnkit.AdditiveAttention(8)(torch.ones(2, 3, 5), torch.ones(2, 4, 6), torch.ones(2, 4, 2), LENS)
    rows = json.loads(t.to_json())
    assert rows[2]["step"] == "scores" and rows[2]["shape_out"] == [2, 3, 4]
    markdown = t.to_markdown().splitlines()
    assert markdown[0] == "| module | step | shape in | shape out | note |"
    assert len(markdown) == 2 + len(t.steps)


def test_modules_are_named_from_the_model_and_recording_adds_no_steps():
    model = nn.ModuleDict({"encoder": attnkit.MultiHeadAttention(8, 2)})
    x = torch.ones(1, 3, 8)
    with attnkit.trace_shapes(model) as t, attnkit.record_weights(model) as rec:
        model["encoder"](x, x, x)
    assert {s.module for s in t.steps} == {"encoder"}
    assert len(_find(t, "scores")) == 1 and rec["encoder"].shape == (1, 2, 3, 3)


def _global_hooks():
    from torch.nn.modules import module as torch_module

    return len(torch_module._global_forward_pre_hooks), len(torch_module._global_forward_hooks)


def test_nothing_is_left_behind_even_after_an_exception():
    hooks = _global_hooks()
    with pytest.raises(KeyError), attnkit.trace_shapes():
        raise KeyError("inside")
    assert trace.active() is None
    assert _global_hooks() == hooks
    mha = attnkit.MultiHeadAttention(8, 2)
    x = torch.ones(1, 3, 8)
    with attnkit.trace_shapes() as t:
        pass
    mha(x, x, x)
    assert t.steps == []


def test_nested_traces_each_see_every_step_made_while_they_are_open():
    model = nn.ModuleDict({"encoder": attnkit.MultiHeadAttention(100, 5)}).eval()
    with attnkit.trace_shapes() as alone:
        model["encoder"](X, Y, Y, LENS)
    per_call = len(alone.steps)
    hooks = _global_hooks()
    with attnkit.trace_shapes() as outer:
        model["encoder"](X, Y, Y, LENS)
        with attnkit.trace_shapes(model) as inner:
            model["encoder"](X, Y, Y, LENS)
            with trace.paused():  # hidden from both
                model["encoder"](X, Y, Y, LENS)
        assert trace.active() is outer
        model["encoder"](X, Y, Y, LENS)
    assert trace.active() is None and _global_hooks() == hooks
    assert len(outer.steps) == 3 * per_call and len(inner.steps) == per_call
    # each names the modules its own way: the inner trace from the model it was given
    assert {s.module for s in inner.steps} == {"encoder"}
    assert {s.module for s in outer.steps} == {"MultiHeadAttention"}
    assert [s.step for s in inner.steps] == [s.step for s in alone.steps]


def test_traces_closed_out_of_order_stop_seeing_steps_when_they_close():
    mha = attnkit.MultiHeadAttention(100, 5).eval()
    with attnkit.trace_shapes() as alone:
        mha(X, Y, Y, LENS)
    per_call = len(alone.steps)
    with contextlib.ExitStack() as first_stack:
        first = first_stack.enter_context(attnkit.trace_shapes())
        second_cm = attnkit.trace_shapes()
        second = second_cm.__enter__()
        mha(X, Y, Y, LENS)
    mha(X, Y, Y, LENS)  # first is closed; second is still open
    second_cm.__exit__(None, None, None)
    mha(X, Y, Y, LENS)
    assert len(first.steps) == per_call and len(second.steps) == 2 * per_call
    assert trace.active() is None


def test_a_call_given_a_plan_says_so_and_what_it_holds():
    """(reviewer's finding: a plan= call's mask was traced as 'none')."""
    q = torch.randn(1, 2, 16, 8)
    made = attnkit.make_plan(16, 16, mask_mod=mods.sliding_window(4), is_causal=True)
    with trace.trace_shapes() as t:
        attnkit.scaled_dot_product_attention(q, q, q, plan=made)
    notes = [s.note for s in t.steps if s.step == "mask"]
    assert notes == ["plan (causal; mask_mod sliding_window)"], notes
