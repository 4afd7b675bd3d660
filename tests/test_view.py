"""The viewer's page, read back in Python: what it holds (exact weights, or each row's largest with their positions,
masks, padding, tokens per call), how tokens are given to decoding steps and cross-attention, the mistakes it
refuses, and `attnkit view` on the command line. What the page does in a browser: tests/test_view_browser.py."""

from __future__ import annotations

import html

import numpy as np
import pytest
import torch

import attnkit
from attnkit import d2l
from attnkit.tools import cli, viewer
from attnkit.tools.plot import view
from attnkit.tools.viewer import _data
from pages import blob, payload


def causal_weights(H, L, generator=None, valid=None):
    """Causal softmax weights ``(H, L, L)`` (exact zeros above the diagonal, and past ``valid`` keys)."""
    scores = torch.randn(H, L, L, generator=generator)
    allowed = torch.ones(L, L, dtype=torch.bool).tril()
    if valid is not None:
        allowed[:, valid:] = False
        allowed[:valid, 0] = True
    w = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.nan_to_num(w, nan=0.0)


def test_a_small_page_keeps_every_weight_exactly_as_float32():
    w = torch.softmax(torch.randn(3, 4, 5, 6), -1)  # (layers, H, Lq, Lk)
    page = view(w, query_tokens=list("abcde"), key_tokens=list("uvwxyz"))
    data = payload(page)
    assert data["exact"] and page.notes == ()
    assert [layer["name"] for layer in data["layers"]] == ["layer 0", "layer 1", "layer 2"]
    for i, layer in enumerate(data["layers"]):
        (call,) = layer["calls"]
        assert (layer["heads"], call["lq"], call["lk"], call["enc"]) == (4, 5, 6, "f32")
        got = np.frombuffer(blob(data, call["data"]), dtype="<f4").reshape(4, 5, 6)
        assert np.array_equal(got, w[i].numpy())
        assert data["tokens"][call["q"]] == list("abcde") and data["tokens"][call["k"]] == list("uvwxyz")


@pytest.mark.parametrize(("shape", "layers", "heads"), [((5, 7), 1, 1), ((3, 5, 7), 1, 3), ((2, 3, 5, 7), 2, 3)])
def test_a_tensor_of_two_three_or_four_dims(shape, layers, heads):
    data = payload(view(torch.rand(shape)))
    assert len(data["layers"]) == layers and data["layers"][0]["heads"] == heads
    call = data["layers"][0]["calls"][0]
    assert (call["lq"], call["lk"], call["q"], call["k"]) == (5, 7, None, None)  # no tokens: positions


def calls_of(data: dict) -> list[list[tuple[int, int, int, np.ndarray]]]:
    """Per layer, per call: (heads, Lq, Lk, the weights (H, Lq, Lk)) of an exact page."""
    out = []
    for layer in data["layers"]:
        H = layer["heads"]
        out.append(
            [
                (H, c["lq"], c["lk"], np.frombuffer(blob(data, c["data"]), "<f4").reshape(H, c["lq"], c["lk"]))
                for c in layer["calls"]
            ]
        )
    return out


@pytest.mark.parametrize("container", [tuple, list])
def test_a_tuple_of_layers_as_hugging_face_returns_them_is_one_layer_each(container):
    """``outputs.attentions`` (transformers, output_attentions=True): a tuple of (B, H, L, L), one per layer; example
    picks the batch row, as for a record. The same page as the layers stacked, the row taken first."""
    attentions = container(torch.softmax(torch.randn(2, 3, 5, 5), -1) for _ in range(4))  # 4 x (B, H, L, L)
    tokens = list("abcde")
    for example in (0, 1):
        got = payload(view(attentions, tokens=tokens, example=example))
        want = payload(view(torch.stack([a[example] for a in attentions]), tokens=tokens))  # (layers, H, L, L)
        assert got == want
        assert [layer["name"] for layer in got["layers"]] == ["layer 0", "layer 1", "layer 2", "layer 3"]
    one_example = container(a[1] for a in attentions)  # each (H, L, L): one example's
    assert payload(view(one_example, tokens=tokens)) == payload(view(attentions, tokens=tokens, example=1))
    heads = [torch.rand(3, 4), torch.rand(3, 4)]  # a list of (Lq, Lk) matrices is still one array: (H, Lq, Lk)
    assert [layer["heads"] for layer in payload(view(heads))["layers"]] == [2]


def test_layers_of_different_shapes_are_each_shown_as_they_are():
    """An encoder-decoder's or a pruned model's layers need not agree: heads, queries and keys are per layer."""
    layers = (torch.rand(1, 4, 5, 5), torch.rand(1, 2, 3, 5), torch.rand(1, 6, 3, 3))
    data = payload(view(layers))
    got = [[(H, lq, lk) for H, lq, lk, _ in layer] for layer in calls_of(data)]
    assert got == [[(4, 5, 5)], [(2, 3, 5)], [(6, 3, 3)]] and data["heads"] == 6
    for layer, (calls,) in zip(layers, calls_of(data), strict=True):
        assert np.array_equal(calls[3], layer[0].numpy())


def test_a_tuple_of_steps_of_layers_as_generate_returns_them_is_each_layers_calls():
    """``generate(..., output_attentions=True, return_dict_in_generate=True).attentions``: per step, per layer;
    the prompt (B, H, P, P), then a step (B, H, 1, P + t) each: each layer's calls, on the slider."""
    P, steps, layers = 3, 4, 2
    attentions = tuple(
        tuple(torch.softmax(torch.randn(2, 2, P if t == 0 else 1, P + t), -1) for _ in range(layers))
        for t in range(steps)
    )
    data = payload(view(attentions, tokens=list("abcdef"), example=1))
    for i, layer in enumerate(calls_of(data)):
        assert [(lq, lk) for _, lq, lk, _ in layer] == [(3, 3), (1, 4), (1, 5), (1, 6)]
        for t, (_, _, _, w) in enumerate(layer):
            assert np.array_equal(w, attentions[t][i][1].numpy())
    assert [c["qoff"] for c in data["layers"][0]["calls"]] == [0, 3, 4, 5]  # each step at the end of its keys


@pytest.mark.parametrize(
    ("weights", "kwargs", "message"),
    [
        ((), {}, r"weights is an empty tuple: no layer to show; .* attn_implementation=\"eager\""),
        ((torch.rand(1, 2, 3, 3), None), {}, r"weights\[1\] is None; a Hugging Face model returns attention weights"),
        ([torch.rand(1, 2, 3, 3), torch.rand(3, 3)], {}, r"weights\[1\] \(layer 1\) has shape \(3, 3\): each layer's"),
        ((torch.rand(1, 2, 3, 3, 1),), {}, r"weights\[0\] \(layer 0\) has shape \(1, 2, 3, 3, 1\)"),
        (
            (torch.rand(2, 3, 3),),
            {"example": 1},
            r"weights\[0\] is one example's \(H, Lq, Lk\) weights, shape \(2, 3, 3\)",
        ),
        ((torch.rand(2, 2, 3, 3),), {"example": 2}, r"example 2 does not exist: layer 'layer 0' has a batch of 2"),
        (
            ((torch.rand(1, 2, 3, 3), torch.rand(1, 2, 3, 3)), (torch.rand(1, 2, 1, 4),)),
            {},
            r"weights\[1\] holds 1 layers but weights\[0\] holds 2",
        ),
        (
            ((torch.rand(1, 2, 3, 3),), (torch.rand(1, 4, 1, 4),)),
            {},
            r"layer 'layer 0' call 1: the calls of a layer have one number of heads, got 4 after 2",
        ),
        (((),), {}, r"weights\[0\] is an empty tuple: no layer to show"),
    ],
)
def test_a_tuple_of_layers_that_cannot_be_shown_is_an_error_naming_the_layer(weights, kwargs, message):
    with pytest.raises(ValueError, match=message):
        view(weights, **kwargs)


def test_a_small_hugging_face_models_attentions_and_generate_steps():
    """A GPT-2 of 2 layers x 4 heads built from its config (no download), its eager attention returning weights."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_head=4, n_embd=16, vocab_size=20, n_positions=16, bos_token_id=0, eos_token_id=0
    )
    model = transformers.GPT2LMHeadModel(config).eval()
    model.set_attn_implementation("eager")
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    tokens = [f"t{i}" for i in ids[0].tolist()]
    with torch.no_grad():
        out = model(ids, output_attentions=True)
        generated = model.generate(
            ids, max_new_tokens=3, do_sample=False, output_attentions=True, return_dict_in_generate=True, pad_token_id=0
        )
    assert isinstance(out.attentions, tuple) and out.attentions[0].shape == (1, 4, 5, 5)
    data = payload(view(out.attentions, tokens=tokens))
    assert [(layer["name"], layer["heads"]) for layer in data["layers"]] == [("layer 0", 4), ("layer 1", 4)]
    for a, (calls,) in zip(out.attentions, calls_of(data), strict=True):
        assert np.array_equal(calls[3], a[0].numpy())
    steps = payload(view(generated.attentions, tokens=tokens + ["n1", "n2"]))
    assert [(c["lq"], c["lk"], c["qoff"]) for c in steps["layers"][1]["calls"]] == [(5, 5, 0), (1, 6, 5), (1, 7, 6)]
    model.set_attn_implementation("sdpa")  # returns no weights: an empty tuple, and an error saying what to do
    with torch.no_grad():
        nothing = model(ids, output_attentions=True).attentions
    if not nothing:  # transformers 5 gives (); a version that warns and computes them eagerly gives them
        with pytest.raises(ValueError, match='attn_implementation="eager"'):
            view(nothing)


def test_a_large_record_keeps_each_rows_largest_weights_and_says_so(monkeypatch):
    monkeypatch.setattr(_data, "EXACT_CELLS", 100)
    monkeypatch.setattr(_data, "MAX_ENTRIES", 2 * 3 * 9 * 4)  # 4 per row
    g = torch.Generator().manual_seed(0)
    w = torch.stack([causal_weights(3, 9, g), causal_weights(3, 9, g)])  # (2, 3, 9, 9)
    data = payload(view(w))
    assert not data["exact"] and data["k"] == 4
    assert any(note.startswith("Reduced: 486 weights") and "4 largest weights" in note for note in data["notes"])
    masks = set()
    for i, layer in enumerate(data["layers"]):
        (call,) = layer["calls"]
        assert call["enc"] == "topk" and call["kc"] == 4
        raw = blob(data, call["data"])
        n = 3 * 9 * 4
        index = np.frombuffer(raw[: 2 * n], dtype="<u2").reshape(3, 9, 4)
        codes = np.frombuffer(raw[2 * n : 3 * n], dtype=np.uint8).reshape(3, 9, 4)
        threshold = np.frombuffer(raw[3 * n :], dtype=np.uint8).reshape(3, 9)
        values, expected = w[i].topk(4, dim=-1)
        assert np.array_equal(index, expected.numpy())
        assert np.abs(codes * call["scale"] / 255 - values.numpy()).max() <= call["scale"] / 510 + 1e-7
        assert np.array_equal(threshold, np.rint(values[..., -1].numpy() / call["scale"] * 255))
        for h, mask in enumerate(call["masks"]):  # the causal mask: one bitmap, shared by every head and layer
            bits = np.unpackbits(np.frombuffer(blob(data, mask), np.uint8), bitorder="little")[:81].reshape(9, 9)
            assert np.array_equal(bits.astype(bool), (w[i, h] == 0).numpy())
            masks.add(mask)
    assert len(masks) == 1


def test_keeping_every_key_of_a_row_stores_no_positions(monkeypatch):
    monkeypatch.setattr(_data, "EXACT_CELLS", 10)
    w = torch.softmax(torch.randn(2, 3, 4), -1)
    data = payload(view(w))
    call = data["layers"][0]["calls"][0]
    assert call["enc"] == "u8" and call["masks"] == [-1, -1]  # no weight is exactly 0: nothing masked
    codes = np.frombuffer(blob(data, call["data"]), np.uint8).reshape(2, 3, 4)
    assert np.abs(codes * call["scale"] / 255 - w.numpy()).max() <= call["scale"] / 510 + 1e-7


def test_padding_and_masked_positions_come_from_exact_zeros_of_a_record():
    mha = attnkit.MultiHeadAttention(16, 4, num_kv_heads=2)
    x = torch.randn(2, 6, 16)
    with attnkit.record_weights(mha) as rec:
        mha(x, x, x, torch.tensor([4, 6]), is_causal=True)
    data = payload(view(rec, tokens=list("abcdef"), kv_heads=2, example=0))
    (layer,) = data["layers"]
    (call,) = layer["calls"]
    assert (layer["name"], layer["heads"], layer["groups"]) == ("(model)", 4, 2)
    assert call["padk"] == [[4, 6]] and call["padq"] == []  # keys past valid_lens; every query sees key 0
    weights = np.frombuffer(blob(data, call["data"]), dtype="<f4").reshape(4, 6, 6)
    assert np.array_equal(weights == 0, np.broadcast_to(~np.tri(6, dtype=bool) | (np.arange(6) >= 4), (4, 6, 6)))
    assert payload(view(rec, example=1))["layers"][0]["calls"][0]["padk"] == []


def test_a_record_says_which_layers_group_their_heads():
    """record_weights keeps each grouped-query layer's key/value heads; the page groups by them unasked."""
    model = torch.nn.ModuleDict(
        {"gqa": attnkit.MultiHeadAttention(16, 4, num_kv_heads=2), "full": attnkit.MultiHeadAttention(16, 4)}
    )
    x = torch.randn(1, 5, 16)
    with attnkit.record_weights(model) as rec:
        for m in model.values():
            m(x, x, x)
    assert rec.kv_heads == {"gqa": 2}
    groups = {layer["name"]: layer["groups"] for layer in payload(view(rec))["layers"]}
    assert groups == {"gqa": 2, "full": 1}
    assert payload(view(rec, kv_heads={"full": 4}))["layers"][0]["groups"] == 1  # given: only what is given


def test_decoding_steps_through_a_cache_are_calls_whose_queries_stand_at_the_end_of_their_keys():
    torch.manual_seed(0)
    mha = attnkit.MultiHeadAttention(16, 2).eval()
    cache = attnkit.KVCache()
    x = torch.randn(1, 7, 16)
    with attnkit.record_weights(mha) as rec, torch.no_grad():
        mha(x[:, :3], x[:, :3], x[:, :3], is_causal=True, cache=cache)  # prefill 3
        for t in range(3, 7):
            mha(x[:, t : t + 1], x[:, t : t + 1], x[:, t : t + 1], is_causal=True, cache=cache)
    tokens = ["the", "cat", "sat", "on", "the", "mat", "."]
    data = payload(view(rec, tokens=tokens))
    calls = data["layers"][0]["calls"]
    assert [(c["lq"], c["lk"], c["qoff"]) for c in calls] == [(3, 3, 0), (1, 4, 3), (1, 5, 4), (1, 6, 5), (1, 7, 6)]
    assert all(data["tokens"][c["q"]] == tokens and c["q"] == c["k"] for c in calls)
    # a step's weights are those of the whole causal forward's row
    with attnkit.record_weights(mha) as whole, torch.no_grad():
        mha(x, x, x, is_causal=True)
    step = np.frombuffer(blob(data, calls[2]["data"]), dtype="<f4").reshape(2, 1, 5).copy()
    torch.testing.assert_close(torch.from_numpy(step[:, 0]), whole[""][0, :, 4, :5])


def test_cross_attention_queries_continue_from_call_to_call():
    source, target = list("abcde"), list("XYZ")
    record = {"cross": [torch.rand(1, 2, 3, 5), *(torch.rand(1, 2, 1, 5) for _ in range(3))]}
    data = payload(view(record, query_tokens=target, key_tokens=source))
    calls = data["layers"][0]["calls"]
    assert [c["qoff"] for c in calls] == [0, 0, 1, 2]  # the whole target, then one step each
    assert all(data["tokens"][c["q"]] == target and data["tokens"][c["k"]] == source for c in calls)


def test_layer_tokens_label_an_encoder_decoder():
    record = {
        "encoder": torch.rand(1, 2, 5, 5),
        "decoder": torch.rand(1, 2, 3, 3),
        "cross": torch.rand(1, 2, 3, 5),
    }
    src, tgt = list("abcde"), list("XYZ")
    data = payload(view(record, layer_tokens={"encoder": src, "decoder": tgt, "cross": (tgt, src)}))
    got = [(data["tokens"][c["q"]], data["tokens"][c["k"]]) for c in (layer["calls"][0] for layer in data["layers"])]
    assert got == [(src, src), (tgt, tgt), (tgt, src)]


def test_the_books_inner_attention_is_shown_once():
    mha = d2l.MultiHeadAttention(16, 16, 16, 16, 2, 0.0).eval()
    x = torch.randn(2, 4, 16)
    with attnkit.record_weights(mha) as rec:
        mha(x, x, x, torch.tensor([3, 4]))
    assert set(rec) == {"", "attention"}  # (B, H, Lq, Lk) and the book's (B*H, Lq, Lk) of one tensor
    page = view(rec)
    assert [layer["name"] for layer in payload(page)["layers"]] == ["(model)"]
    assert page.notes == ("layer 'attention' holds the weights of '(model)' in the book's layout; shown once",)


def test_grouped_query_heads_and_their_mistakes():
    w = torch.rand(2, 6, 3, 3)
    data = payload(view(w, kv_heads={"layer 1": 3}))
    assert [layer["groups"] for layer in data["layers"]] == [1, 3]
    with pytest.raises(ValueError, match=r"kv_heads=4 must divide the 6 heads of layer 'layer 0'"):
        view(w, kv_heads=4)
    with pytest.raises(ValueError, match=r"kv_heads names layers that are not shown: \['nope'\]"):
        view(w, kv_heads={"nope": 2})
    with pytest.raises(TypeError, match="kv_heads must be a whole number"):
        view(w, kv_heads=1.5)


@pytest.mark.parametrize(
    ("weights", "kwargs", "error", "message"),
    [
        (
            torch.rand(5),
            {},
            ValueError,
            r"weights must be \(Lq, Lk\), \(H, Lq, Lk\) or \(layers, H, Lq, Lk\), got shape \(5,\)",
        ),
        (torch.rand(3, 0), {}, ValueError, r"the weights are empty, shape \(3, 0\)"),
        (torch.tensor([[0.5, float("nan")]]), {}, ValueError, "1 weights are NaN or infinite"),
        (torch.tensor([[0.5, -0.25]]), {}, ValueError, "weights must be >= 0 .* the smallest is -0.25"),
        (torch.rand(3, 4), {"tokens": list("abc")}, ValueError, "tokens has 3 tokens but layer 'attention' has 4 keys"),
        (torch.rand(3, 4), {"tokens": list("abcd")}, None, None),  # 3 queries at the end of 4 keys: fine
        (torch.rand(5, 4), {"tokens": list("abcd")}, ValueError, "more queries than keys, .Lq, Lk. .5, 4."),
        (torch.rand(3, 4), {"query_tokens": list("abcd")}, ValueError, "query_tokens has 4 tokens but the queries of"),
        (
            torch.rand(3, 4),
            {"query_tokens": list("ab")},
            ValueError,
            "query_tokens has 2 tokens but layer 'attention' has 3 queries",
        ),
        (torch.rand(3, 4), {"tokens": "abcd"}, TypeError, "tokens must be a sequence of tokens"),
        (torch.rand(3, 4), {"tokens": list("abcd"), "key_tokens": list("abcd")}, ValueError, "not both"),
        (torch.rand(3, 4), {"layer_tokens": {"x": list("abcd")}}, ValueError, r"layer_tokens names layers .*\['x'\]"),
        (torch.rand(3, 4), {"example": 1}, ValueError, "a tensor of weights has no batch"),
        (
            {"m": torch.rand(2, 3, 4)},
            {"example": 2},
            ValueError,
            r"example 2 does not exist: layer 'm' has a batch of 2",
        ),
        ({"m": torch.rand(3, 4)}, {}, ValueError, r"a record holds \(B, H, Lq, Lk\) or \(B, Lq, Lk\)"),
        (
            {"m": [torch.rand(1, 2, 3, 4), torch.rand(1, 3, 1, 4)]},
            {},
            ValueError,
            "call 1: the calls of a layer have one number of heads, got 3 after 2",
        ),
        ({}, {}, ValueError, "the record holds no weights"),
        ("weights", {}, TypeError, "must be a tensor or an array of numbers, got str"),
        (torch.ones(2, 2, dtype=torch.bool), {}, TypeError, "real numbers, got dtype torch.bool"),
        (torch.rand(1, 70000), {}, ValueError, "70000 keys, more than the 65535"),
    ],
)
def test_mistakes_are_errors_that_name_the_values(weights, kwargs, error, message):
    if error is None:
        view(weights, **kwargs)
        return
    with pytest.raises(error, match=message):
        view(weights, **kwargs)


def test_the_page_is_self_contained_and_its_data_cannot_end_its_script():
    tokens = ["</script><script>alert(1)</script>", "<!--", "b"]
    page = view(torch.rand(3, 3), tokens=tokens, title="<b>t</b>")
    text = page.html
    assert text.startswith("<!DOCTYPE html>") and text.count("</script>") == 2  # the data's and the program's
    assert "default-src 'none'" in text  # a Content-Security-Policy forbids every request
    for reference in ("src=", "href=", "<link", "@import", "url(", "fetch(", "XMLHttpRequest", "import(", "://"):
        assert reference not in text, reference
    assert payload(page)["tokens"] == [tokens] and "<title>&lt;b&gt;t&lt;/b&gt;</title>" in text


def test_a_notebook_shows_the_page_in_an_iframe_of_its_own():
    page = view(torch.rand(2, 2))
    frame = page._repr_html_()
    assert frame.startswith('<iframe srcdoc="') and 'sandbox="allow-scripts"' in frame
    assert html.unescape(frame.split('srcdoc="')[1].split('" style=')[0]) == page.html


def test_writing_is_atomic(tmp_path, monkeypatch):
    page = view(torch.rand(2, 2), path=tmp_path / "a.html")
    assert page.path == tmp_path / "a.html" and (tmp_path / "a.html").read_text(encoding="utf-8") == page.html
    with pytest.raises(FileNotFoundError, match="the folder .* does not exist"):
        view(torch.rand(2, 2), path=tmp_path / "missing" / "b.html")

    def fail(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(viewer.os, "replace", fail)
    with pytest.raises(OSError, match="No space left"):
        view(torch.rand(2, 2), path=tmp_path / "c.html")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.html"]


# ------------------------------------------------------------------------------------------ command line


def run(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_view_command_on_a_tensor_a_record_and_a_numpy_file(capsys, tmp_path):
    torch.save(torch.softmax(torch.randn(2, 3, 5, 5), -1), tmp_path / "w.pt")
    code, out, err = run(capsys, "view", tmp_path / "w.pt", "--out", tmp_path / "w.html", "--tokens", "a b c d e")
    assert (code, err, out.strip()) == (0, "", str(tmp_path / "w.html"))
    data = payload((tmp_path / "w.html").read_text(encoding="utf-8"))
    assert len(data["layers"]) == 2 and data["tokens"] == [list("abcde")] and data["title"] == "w.pt"

    mha = attnkit.MultiHeadAttention(16, 4, num_kv_heads=2)
    q, kv = torch.randn(2, 3, 16), torch.randn(2, 5, 16)
    with attnkit.record_weights(mha) as rec:
        mha(q, kv, kv)
    torch.save({name: rec.calls(name) for name in rec}, tmp_path / "rec.pt")
    (tmp_path / "keys.txt").write_text("k 0\nk 1\nk 2\nk 3\nk 4\n", encoding="utf-8")
    argv = ("view", tmp_path / "rec.pt", "--out", tmp_path / "rec.html", "--kv-heads", "2", "--example", "1")
    code, _, err = run(capsys, *argv, "--query-tokens", "x y z", "--key-tokens", f"@{tmp_path / 'keys.txt'}")
    assert (code, err) == (0, "")
    data = payload((tmp_path / "rec.html").read_text(encoding="utf-8"))
    call = data["layers"][0]["calls"][0]
    assert data["layers"][0]["groups"] == 2 and data["tokens"][call["k"]] == ["k 0", "k 1", "k 2", "k 3", "k 4"]
    weights = np.frombuffer(blob(data, call["data"]), dtype="<f4").reshape(4, 3, 5)
    assert np.array_equal(weights, rec[""][1].numpy())

    np.save(tmp_path / "w.npy", np.full((2, 2), 0.5, dtype=np.float32))
    assert run(capsys, "view", tmp_path / "w.npy", "--out", tmp_path / "n.html")[0] == 0


def test_view_command_on_a_saved_tuple_of_layers_as_transformers_returns_them(capsys, tmp_path):
    """``torch.save(outputs.attentions, "a.pt")``: one (B, H, Lq, Lk) tensor per layer, read as the layers."""
    g = torch.Generator().manual_seed(0)
    layers = tuple(torch.softmax(torch.randn(2, 3, 4, 4, generator=g), -1) for _ in range(2))
    torch.save(layers, tmp_path / "a.pt")
    code, _, err = run(capsys, "view", tmp_path / "a.pt", "--out", tmp_path / "a.html", "--example", "1")
    assert (code, err) == (0, "")
    data = payload((tmp_path / "a.html").read_text(encoding="utf-8"))
    assert [layer["name"] for layer in data["layers"]] == ["layer 0", "layer 1"]
    call = data["layers"][1]["calls"][0]
    weights = np.frombuffer(blob(data, call["data"]), dtype="<f4").reshape(3, 4, 4)
    assert np.array_equal(weights, layers[1][1].numpy())


def test_view_command_on_a_saved_generate_tuple_of_steps_and_on_empty_tuples(capsys, tmp_path):
    """``torch.save(out.attentions, "g.pt")`` after ``generate``: a tuple of steps, each a tuple of layers, read as
    the calls of each layer; an empty tuple (sdpa's) or a tuple of empty steps says what view() says: use eager."""
    g = torch.Generator().manual_seed(0)
    steps = tuple(
        tuple(torch.softmax(torch.randn(1, 2, 3 if s == 0 else 1, 3 + s, generator=g), -1) for _ in range(2))
        for s in range(3)
    )
    torch.save(steps, tmp_path / "g.pt")
    code, _, err = run(capsys, "view", tmp_path / "g.pt", "--out", tmp_path / "g.html")
    assert (code, err) == (0, "")
    data = payload((tmp_path / "g.html").read_text(encoding="utf-8"))
    assert [len(layer["calls"]) for layer in data["layers"]] == [3, 3]
    for empty, fragment in (((), "weights is an empty tuple"), (((), ()), "weights[0] is an empty tuple")):
        torch.save(empty, tmp_path / "e.pt")
        code, _, err = run(capsys, "view", tmp_path / "e.pt", "--out", tmp_path / "e.html")
        assert code == 2 and fragment in err and 'attn_implementation="eager"' in err, err
        assert not (tmp_path / "e.html").exists()


@pytest.mark.parametrize(
    ("make", "args", "fragment"),
    [
        (lambda d: torch.save(torch.rand(3, 4), d / "w.pt"), ("--tokens", "a b c"), "tokens has 3 tokens but"),
        (lambda d: torch.save(torch.rand(5), d / "w.pt"), (), "got shape (5,)"),
        (lambda d: torch.save(torch.rand(6, 2, 2), d / "w.pt"), ("--kv-heads", "4"), "kv_heads=4 must divide the 6"),
        (lambda d: torch.save({"m": [torch.rand(1, 2, 2)]}, d / "w.pt"), ("--example", "3"), "example 3 does not"),
        (lambda d: torch.save({"m": []}, d / "w.pt"), (), "layer 'm' has no calls"),
        (lambda d: torch.save({"m": "x"}, d / "w.pt"), (), "expected a tensor of weights, got an object of type str"),
        (lambda d: torch.save(3, d / "w.pt"), (), "got an object of type int"),
        (lambda d: torch.save([torch.rand(2, 2)], d / "w.pt"), (), "expected one tensor or array of weights"),
        (lambda d: (d / "w.pt").write_bytes(b"junk"), (), "cannot read weights"),
        (lambda d: torch.save(torch.rand(2, 2), d / "w.pt"), ("--tokens", "@nope.txt"), "nope.txt: no such file"),
        (
            lambda d: ((d / "t.txt").write_bytes(b"\xff\xfe"), torch.save(torch.rand(2, 2), d / "w.pt")),
            ("--tokens", "@{d}/t.txt"),
            "cannot be read as UTF-8",
        ),
        (lambda d: torch.save(torch.rand(2, 2), d / "w.pt"), ("--kv-heads", "0"), "--kv-heads"),
        (lambda d: torch.save(torch.rand(2, 2), d / "w.pt"), ("--out", "{d}/w.png"), "the extension must be"),
    ],
)
def test_view_command_mistakes_are_one_line_and_leave_no_file(capsys, tmp_path, make, args, fragment):
    make(tmp_path)
    before = sorted(p.name for p in tmp_path.iterdir())
    args = tuple(a.replace("{d}", str(tmp_path)) for a in args)
    out = () if "--out" in args else ("--out", tmp_path / "page.html")
    code, stdout, err = run(capsys, "view", tmp_path / "w.pt", *out, *args)
    assert code == 2 and stdout == "" and err.startswith("attnkit: error: ") and err.count("\n") == 1, err
    assert fragment in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_the_model_itself_is_named_as_the_record_names_it_and_a_folder_is_not_a_page(tmp_path):
    mha = attnkit.MultiHeadAttention(16, 4)
    x = torch.randn(1, 3, 16)
    with attnkit.record_weights(mha) as rec:
        mha(x, x, x)
    layer = payload(view(rec, kv_heads={"": 2}, layer_tokens={"": list("abc")}))["layers"][0]
    assert (layer["name"], layer["groups"]) == ("(model)", 2)
    with pytest.raises(IsADirectoryError, match=r"cannot write .*: it is a folder"):
        view(rec, path=tmp_path)
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(TypeError, match="title must be a string"):
        view(rec, title=123)


def test_a_page_written_to_another_kind_of_file_is_refused(tmp_path):
    """view(w, path="page.png") wrote HTML into a .png file: the page is one HTML file, and a path that says
    otherwise is a ValueError, with nothing written."""
    with pytest.raises(ValueError, match=r"path must end in .html or .htm .*page.png"):
        viewer.view(torch.softmax(torch.randn(2, 3, 3), -1), path=tmp_path / "page.png")
    assert list(tmp_path.iterdir()) == []
    assert viewer.view(torch.softmax(torch.randn(2, 3, 3), -1), path=tmp_path / "page.HTML").path.exists()
