"""Attention statistics (attnkit.stats, record_stats, record_weights' selections) against float64 statistics of
whole weights, written here from their definitions."""

from __future__ import annotations

import sys
import threading
import zlib

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import attnkit
import mathref
from attnkit import mods, stats
from mathref import attention_mods
from pages import blob, payload

# B batch, H heads, Lq/Lk query/key length


def truth(w: torch.Tensor, k: int, sink_keys: int = 4, qpos=None, kpos=None) -> dict[str, torch.Tensor]:
    """The statistics of whole float64 weights (B, H, Lq, Lk), from the definitions in attnkit.stats."""
    B, H, Lq, Lk = w.shape
    if qpos is None:
        qpos = (torch.arange(Lq) + Lk - Lq).expand(B, Lq)
    if kpos is None:
        kpos = torch.arange(Lk).expand(B, Lk)
    dist = (qpos[:, None, :, None] - kpos[:, None, None, :]).abs().double()  # (B, 1, Lq, Lk)
    mass = w.sum(-1)
    padded = torch.nn.functional.pad(w, (0, max(0, k - Lk)))
    values = padded.topk(k, dim=-1).values  # (B, H, Lq, k), largest first
    return {
        "topk_values": values,
        "entropy": -torch.special.xlogy(w, w).sum(-1),
        "column_sum": w.sum(-2),
        "distance": torch.where(mass > 0, (w * dist).sum(-1) / mass.clamp_min(1e-300), 0.0),
        "sink_mass": (w * (kpos[:, None, None, :] < sink_keys)).sum(-1),
    }


def assert_stats(found: stats.AttentionStats, w: torch.Tensor, tol: float = 1e-5, **where) -> None:
    """``found`` equals the statistics of the float64 weights ``w``: values to ``tol``, each index naming a weight
    equal to its value (ties allowed), -1 exactly where the value is 0; entropy and sums to 10 * tol, relative."""
    want = truth(w, found.topk, found.sink_keys, **where)
    assert found.topk_indices.dtype == torch.int64
    for name, expected in want.items():
        got = getattr(found, name).double()
        assert torch.isfinite(got).all(), name
        scale = 1.0 if name == "topk_values" else 10 * max(1.0, float(expected.abs().max()))
        assert (got - expected).abs().max() <= tol * scale, (name, float((got - expected).abs().max()))
    idx, vals = found.topk_indices, found.topk_values.double()
    assert torch.equal(idx == -1, vals == 0)
    named = w.gather(-1, idx.clamp_min(0)) if w.shape[-1] else torch.zeros_like(vals)
    assert (torch.where(idx >= 0, named, 0.0) - vals).abs().max() <= tol


@st.composite
def calls(draw):
    """Shapes, every mask kind, modifiers and sinks, NaN where no query may see, and a block budget small enough
    that a call takes several blocks."""
    B, Hkv = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    H = Hkv * draw(st.sampled_from([1, 2, 4]))
    Lq, Lk, D = draw(st.integers(1, 40)), draw(st.integers(1, 150)), draw(st.integers(1, 16))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    q, k = torch.randn(B, H, Lq, D, generator=g), torch.randn(B, Hkv, Lk, D, generator=g)
    kw: dict = {"is_causal": draw(st.booleans())}
    lens = draw(st.sampled_from(["none", "1d", "2d"]))
    if lens != "none":
        kw["valid_lens"] = torch.randint(0, Lk + 1, (B,) if lens == "1d" else (B, Lq), generator=g)
    mask = draw(st.sampled_from(["none", "bool", "float", "-inf"]))
    if mask == "bool":
        kw["attn_mask"] = torch.rand(B, 1, Lq, Lk, generator=g) < 0.7
    elif mask != "none":
        bias = torch.randn(1, H, Lq, Lk, generator=g)
        kw["attn_mask"] = (
            bias.masked_fill(torch.rand(1, H, Lq, Lk, generator=g) < 0.3, float("-inf")) if mask == "-inf" else bias
        )
    ref = dict(kw)  # the same call for mathref, its modifiers written from their definitions
    mod = draw(st.sampled_from(["none", "window", "document", "user"]))
    if mod == "window":
        window = draw(st.integers(1, 20))
        kw["mask_mod"], ref["mask_mod"] = mods.sliding_window(window), mathref.sliding_window(window, Lq, Lk)
    elif mod == "document":
        ids = torch.randint(0, 3, (B, max(Lq, Lk)), generator=g).sort(-1).values
        kw["mask_mod"], ref["mask_mod"] = (
            mods.document(ids[:, :Lq], ids[:, :Lk]),
            mathref.document(ids[:, :Lq], ids[:, :Lk]),
        )
    elif mod == "user":
        kw["mask_mod"] = ref["mask_mod"] = lambda b, h, i, j: (i + j) % 3 != 1
    score = draw(st.sampled_from(["none", "softcap", "alibi", "user"]))
    if score == "softcap":
        kw["score_mod"], ref["score_mod"] = mods.softcap(2.0), mathref.softcap(2.0)
    elif score == "alibi":
        slopes = torch.rand(H, generator=g)
        kw["score_mod"], ref["score_mod"] = mods.alibi(slopes), mathref.alibi(slopes, Lq, Lk)
    elif score == "user":  # its -inf hides key 0, as a mask would (mathref says so with a mask)
        kw["score_mod"] = lambda s, b, h, i, j: torch.where(j == 0, float("-inf"), s * (1 + h))
        ref["score_mod"] = lambda s, b, h, i, j: s * (1 + h)
        not_first = lambda b, h, i, j: j != 0  # noqa: E731
        ref["mask_mod"] = mathref.and_masks(ref["mask_mod"], not_first) if "mask_mod" in ref else not_first
    if draw(st.booleans()):
        kw["sinks"] = ref["sinks"] = torch.randn(H, generator=g)
    return q, k, kw, ref, draw(st.integers(1, 12)), draw(st.sampled_from([64, 2**12, 2**20]))


def weights64(q, k, kw):
    return attention_mods(q.double(), k.double(), k.double(), **kw)[1]  # (B, H, Lq, Lk)


@settings(max_examples=120, deadline=None)
@given(calls())
def test_stats_equal_those_of_the_whole_weights(call):
    q, k, kw, ref, topk, block = call
    w = weights64(q, k, ref)
    # NaN where no query may see: keys no row sees, rows that see no key
    live_keys, live_rows = (w > 0).any(-2), (w > 0).any(-1)  # (B, H, Lk), (B, H, Lq)
    G = q.shape[1] // k.shape[1]
    dead_keys = ~live_keys.unflatten(1, (k.shape[1], G)).any(2)  # (B, Hkv, Lk)
    k = k.masked_fill(dead_keys[..., None] & ~torch.isnan(k), float("nan")) if "score_mod" not in kw else k
    q = q.masked_fill(~live_rows[..., None], float("nan")) if "score_mod" not in kw else q
    parts, _ = stats.parts(q, k, **kw)
    found = stats.compute(parts, topk, block_bytes=block)
    assert_stats(found, w)
    # the chosen rows of record_weights(queries=...) are the whole weights' rows
    rows = sorted({0, q.shape[2] - 1, q.shape[2] // 2})
    assert (stats.rows_of(parts, rows, block_bytes=block).double() - w[:, :, rows]).abs().max() <= 1e-5
    heads = [q.shape[1] - 1, 0]  # and of chosen heads only, in the order chosen
    assert (stats.rows_of(parts, rows, heads, block).double() - w[:, heads][:, :, rows]).abs().max() <= 1e-5


@pytest.mark.parametrize(
    "kw",
    [{}, {"is_causal": True}, {"mask_mod": mods.sliding_window(40)}, {"sinks": torch.tensor([3.0, -1.0, 0.0, 9.0])}],
    ids=["full", "causal", "window", "sinks"],
)
def test_long_rows_take_the_chunked_top_k_search_and_the_distance_bands(kw):
    """Rows of hundreds of keys, in blocks of a few rows of one key/value head's heads: the top-k search through
    chunk maxima, and the distance's keys before, after and among a block's queries."""
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 4, 300, 8, generator=g) * 2, torch.randn(2, 2, 700, 8, generator=g) * 2
    ref = dict(kw)
    if "mask_mod" in kw:
        ref["mask_mod"] = mathref.sliding_window(40, 300, 700)
    found = stats.compute(stats.parts(q, k, **kw)[0], 3, block_bytes=2**17)  # 11 rows a block
    assert_stats(found, weights64(q, k, ref))


@settings(max_examples=300, deadline=None)
@given(
    st.integers(1, 3),
    st.integers(1, 700),
    st.integers(1, 20),
    st.sampled_from(["random", "ties", "few values", "zeros"]),
    st.integers(0, 2**31 - 1),
)
def test_the_chunked_top_k_search_finds_the_k_largest_with_their_columns(rows, m, k, kind, seed):
    """The search through chunk and group maxima (rows long enough to take it, and shorter ones), against a sort of
    the whole row: the same values, and each column naming a weight equal to its value (ties among equal values
    name any of them)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.rand(1, 2, rows, m, generator=g, dtype=torch.float64)
    if kind == "ties":
        w = (w * 4).floor() / 4  # four values, each many times
    elif kind == "few values":
        w = torch.where(torch.rand(w.shape, generator=g, dtype=torch.float64) < 0.01, w, 0.0)
    elif kind == "zeros":
        w = torch.zeros_like(w)
    maxima = w[..., : m // stats.CHUNK * stats.CHUNK].unflatten(-1, (m // stats.CHUNK, stats.CHUNK)).amax(-1)
    reduce_module = sys.modules["attnkit.stats.reduce"]
    for given_maxima in (None, maxima):
        values, indices = reduce_module._topk(w, k, given_maxima)
        want = torch.nn.functional.pad(w, (0, max(0, k - m))).sort(dim=-1, descending=True).values[..., :k]
        assert torch.equal(values, want)
        named = w.gather(-1, indices.clamp_min(0))
        assert torch.equal(torch.where(indices >= 0, named, 0.0), values)
        assert bool((indices[..., : min(k, m)] >= 0).all()) and bool((indices[..., m:] == -1).all())
        distinct = indices[..., : min(k, m)].sort(dim=-1).values
        assert bool((distinct[..., 1:] != distinct[..., :-1]).all())  # no column named twice


def test_float64_and_low_precision():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 50, 8, generator=g), torch.randn(2, 2, 60, 8, generator=g)
    w = weights64(q, k, {"is_causal": True})
    found = attnkit.attention_stats(q.double(), k.double(), topk=5, is_causal=True)
    assert found.entropy.dtype == torch.float64
    assert_stats(found, w, tol=1e-12)
    low = attnkit.attention_stats(q.bfloat16(), k.bfloat16(), topk=5, is_causal=True)
    assert low.entropy.dtype == torch.float32  # computed and returned in float32
    assert_stats(low, weights64(q.bfloat16(), k.bfloat16(), {"is_causal": True}), tol=1e-5)


def test_topk_larger_than_the_keys_pads_with_zeros_naming_no_key():
    q, k = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    found = attnkit.attention_stats(q, k, topk=5, valid_lens=torch.tensor([2]))
    assert found.topk_values.shape == (1, 2, 3, 5)
    assert (found.topk_indices[..., 2:] == -1).all() and (found.topk_values[..., 2:] == 0).all()
    assert set(found.topk_indices[..., :2].flatten().tolist()) == {0, 1}
    # a row that sees no key: all zeros, entropy and distance 0
    empty = attnkit.attention_stats(q, k, topk=2, valid_lens=torch.tensor([0]))
    assert (empty.topk_indices == -1).all() and not empty.entropy.any() and not empty.distance.any()


def test_three_dim_inputs_and_additive_scoring():
    q, k, w_v = torch.randn(2, 5, 6), torch.randn(2, 70, 6), torch.randn(6)
    found = attnkit.attention_stats(q, k, w_v=w_v, topk=3, valid_lens=torch.tensor([70, 20]))
    assert found.topk_values.shape == (2, 5, 3) and found.column_sum.shape == (2, 70)
    w = attention_mods(q.double(), k.double(), k.double(), w_v=w_v.double(), valid_lens=torch.tensor([70, 20]))[1]
    parts, _ = stats.parts(q, k, w_v=w_v, valid_lens=torch.tensor([70, 20]))
    small = stats.compute(parts._replace(three_d=False), 3, block_bytes=512)  # keys in several slices per block
    assert_stats(small, w.unsqueeze(1))


@pytest.mark.parametrize("backend", ["reference", "sdpa", "tiles:online", "auto"])
def test_layers_record_stats_beside_an_unchanged_output(backend):
    torch.manual_seed(0)
    mha = attnkit.MultiHeadAttention(16, 4, num_kv_heads=2, backend=backend).double().eval()
    x = torch.randn(2, 30, 16, dtype=torch.float64)
    lens = torch.tensor([30, 11])
    plain = mha(x, x, x, lens, is_causal=True)
    with attnkit.record_stats(mha, topk=4) as rec, attnkit.record_weights(mha) as rw:
        out = mha(x, x, x, lens, is_causal=True)
    assert torch.equal(out, plain)
    assert_stats(rec[""], rw[""], tol=1e-12)
    assert rec.kv_heads == {"": 2} and rec[""].kv_heads == 2


@pytest.mark.parametrize("kind", ["growing", "static", "sliding"])
def test_decode_steps_through_a_cache_are_recorded_call_by_call_at_their_positions(kind):
    torch.manual_seed(0)
    mha = attnkit.MultiHeadAttention(16, 4, num_kv_heads=2).double().eval()
    cache = {"growing": attnkit.KVCache(), "static": attnkit.KVCache(max_len=20), "sliding": attnkit.KVCache(window=4)}[
        kind
    ]
    x = torch.randn(2, 12, 16, dtype=torch.float64)
    with attnkit.record_stats(mha, topk=3) as rec, attnkit.record_weights(mha) as rw:
        mha(x[:, :6], x[:, :6], x[:, :6], torch.tensor([6, 3]), is_causal=True, cache=cache)
        for i in range(6, 9):
            mha(x[:, i : i + 1], x[:, i : i + 1], x[:, i : i + 1], is_causal=True, cache=cache)
    assert len(rec.calls("")) == 4
    lengths = torch.tensor([6, 3])
    for step, (found, w) in enumerate(zip(rec.calls(""), rw.calls(""), strict=True)):
        # the prompt's queries at 0..5; each step's at its row's own position
        qpos = torch.arange(6).expand(2, 6) if step == 0 else (lengths + step - 1)[:, None]
        kpos = None
        if kind == "sliding":
            assert found.topk_values.shape[-1] == 3
            continue  # ring slots: positions checked below through the distance of the last step
        assert_stats(found, w, tol=1e-12, qpos=qpos, kpos=kpos)
    if kind == "sliding":  # the last step of each row sees its last 4 positions: distances 0..3
        last = rec.calls("")[-1]
        w = rw.calls("")[-1]
        assert torch.allclose(last.column_sum, w.sum(-2))
        assert (last.distance <= 3 + 1e-9).all() and (last.distance > 0).all()


def test_d2l_layers_and_their_inner_attention():
    from attnkit import d2l

    mha = d2l.MultiHeadAttention(16, 4, 0.0).eval()
    x = torch.randn(2, 7, 16)
    with attnkit.record_stats(mha, topk=2) as rec, attnkit.record_weights(mha) as rw:
        mha(x, x, x, torch.tensor([7, 4]))
    assert set(rec) == {"", "attention"}
    assert rec["attention"].topk_values.shape == (8, 7, 2)  # the book's (B*H, Lq, k)
    assert_stats(rec[""], rw[""].double())


@pytest.mark.parametrize("window", [None, 4])
def test_a_d2l_inner_attention_through_a_cache_stands_at_the_cache_positions(window):
    """The book's inner attention, called by its MultiHeadAttention through a KVCache (a sliding one's ring holds
    positions out of order): its statistics, heads folded into the batch, are the layer's own, call by call."""
    from attnkit import d2l

    torch.manual_seed(0)
    mha = d2l.MultiHeadAttention(16, 4, 0.0).double().eval()
    cache = attnkit.KVCache(window=window)
    x = torch.randn(2, 9, 16, dtype=torch.float64)
    with attnkit.record_stats(mha, topk=3) as rec:
        mha(x[:, :5], x[:, :5], x[:, :5], torch.tensor([5, 3]), is_causal=True, cache=cache)
        for i in range(5, 9):
            mha(x[:, i : i + 1], x[:, i : i + 1], x[:, i : i + 1], None, cache=cache)
    assert len(rec.calls("attention")) == len(rec.calls("")) == 5
    for outer, inner in zip(rec.calls(""), rec.calls("attention"), strict=True):
        for name in ("topk_values", "entropy", "column_sum", "distance", "sink_mass"):
            want = getattr(outer, name).flatten(0, 1)  # (B, H, ...) -> (B*H, ...)
            assert torch.allclose(getattr(inner, name), want, atol=1e-12), name
    if window is not None:  # the last step sees its row's last 4 positions: distances of 0 to 3
        assert bool((rec["attention"].distance <= 3 + 1e-9).all())
    # called directly, the inner attention keeps the default positions
    q = torch.randn(3, 2, 4, dtype=torch.float64)
    with attnkit.record_stats(mha.attention, topk=1) as alone:
        mha.attention(q, q, q, None)
    assert torch.allclose(alone[""].distance, stats.from_weights(mha.attention.attention_weights, 1).distance)


def test_selected_weights_of_a_long_prompt_are_computed_a_block_at_a_time(monkeypatch):
    torch.manual_seed(0)
    mha = attnkit.MultiHeadAttention(32, 4).eval()
    x = torch.randn(1, 600, 32)
    monkeypatch.setattr(stats, "BLOCK_BYTES", 4096)
    with (
        attnkit.record_weights(mha, heads=[-1, 0], queries=slice(-2, None)) as chosen,
        attnkit.record_weights(mha) as rw,
    ):
        mha(x, x, x, is_causal=True)
    assert chosen[""].shape == (1, 2, 2, 600) and chosen.selected[""] == ([0, 3], [598, 599])
    assert torch.allclose(chosen[""], rw[""][:, [0, 3]][:, :, -2:], atol=1e-7)
    # a head without chosen rows: only that head's blocks are computed, not every head's at full size
    computed, real = [], stats.blocks

    def spy(*args, **kwargs):
        for block in real(*args, **kwargs):
            computed.append(block.h0)
            yield block

    monkeypatch.setattr(stats, "blocks", spy)
    with attnkit.record_weights(mha, heads=2) as one:
        mha(x, x, x, is_causal=True)
    assert set(computed) == {2} and torch.allclose(one[""], rw[""][:, [2]], atol=1e-7)


class SelfAttention(torch.nn.Module):
    def __init__(self, attn: torch.nn.Module) -> None:
        super().__init__()
        self.attn = attn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(x, x, x)


def test_bad_input_names_the_argument_and_what_exists():
    mha = attnkit.MultiHeadAttention(8, 2)
    x = torch.randn(1, 3, 8)
    for topk, err in ((0, ValueError), (-1, ValueError), (1.5, TypeError), (True, TypeError), ("3", TypeError)):
        with pytest.raises(err, match="topk"):
            attnkit.record_stats(mha, topk=topk)
        with pytest.raises(err, match="topk"):
            attnkit.attention_stats(x[:, None], x[:, None], topk=topk)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        attnkit.record_stats("model")
    model = SelfAttention(mha)
    with pytest.raises(ValueError, match=r"'decoder\.\*' names no module.*'attn'"):
        attnkit.record_stats(model, layers="decoder.*")
    with pytest.raises(TypeError, match="heads"):
        attnkit.record_weights(model, heads="0")
    with pytest.raises(ValueError, match="queries"):
        attnkit.record_weights(model, queries=[])
    with pytest.raises(ValueError, match="has 2 heads"), attnkit.record_weights(model, heads=[2]):
        model(x)
    with attnkit.record_stats(model, layers="at*") as rec:
        model(x)
    with pytest.raises(KeyError, match="recorded: 'attn'"):
        rec["1"]
    # a call without values names q and k only, each once
    with pytest.raises(
        ValueError,
        match=r"^the 3 heads of q must be a multiple of the 2 heads of k: q \(1, 3, 4, 4\), k \(1, 2, 5, 4\)$",
    ):
        attnkit.attention_stats(torch.ones(1, 3, 4, 4), torch.ones(1, 2, 5, 4))
    with pytest.raises(ValueError, match=r"^batch sizes differ: q has 2, k has 1: q \(2, 3, 4\), k \(1, 3, 4\)$"):
        attnkit.attention_stats(torch.ones(2, 3, 4), torch.ones(1, 3, 4))


def test_threads_and_nesting():
    mha = attnkit.MultiHeadAttention(8, 2).eval()
    x = torch.randn(1, 5, 8)
    other = []

    def run():
        mha(x, x, x)
        other.append(True)

    with attnkit.record_stats(mha, topk=1) as outer:
        with attnkit.record_stats(mha, topk=3) as inner:
            mha(x, x, x)
            t = threading.Thread(target=run)
            t.start()
            t.join()
        mha(x, x, x)
    assert other and len(inner.calls("")) == 1 and len(outer.calls("")) == 2
    assert inner[""].topk == 3 and outer[""].topk == 1
    assert torch.equal(inner[""].topk_values[..., :1], outer.calls("")[0].topk_values)


def test_a_saved_record_loads_back(tmp_path):
    mha = attnkit.MultiHeadAttention(8, 2).eval()
    x = torch.randn(1, 5, 8)
    with attnkit.record_stats(mha, topk=2) as rec:
        mha(x, x, x, is_causal=True)
    path = rec.save(tmp_path / "stats.pt")
    back = attnkit.recording.StatsRecord.from_dict(torch.load(path, weights_only=True))
    assert back.topk == 2 and torch.equal(back[""].topk_indices, rec[""].topk_indices)
    with pytest.raises(ValueError, match="not a saved attnkit statistics record"):
        attnkit.recording.StatsRecord.from_dict({"x": 1})
    # a call through a cache keeps where its queries and keys stand, saved and loaded back
    cache = attnkit.KVCache(window=3)
    with attnkit.record_stats(mha, topk=2) as cached:
        mha(x, x, x, is_causal=True, cache=cache)
        mha(x[:, :1], x[:, :1], x[:, :1], is_causal=True, cache=cache)
    saved = attnkit.recording.StatsRecord.from_dict(torch.load(cached.save(tmp_path / "c.pt"), weights_only=True))
    assert saved[""].query_positions.tolist() == [[5]]
    assert torch.equal(saved[""].key_positions, cached[""].key_positions) and cached[""].key_positions.shape[0] == 1
    values = saved[""].as_dict() | {"query_positions": torch.zeros(1, 2, dtype=torch.long)}
    with pytest.raises(ValueError, match=r"do not fit together: .*'query_positions': \(1, 2\)"):
        stats.AttentionStats.from_dict(values)
    with pytest.raises(ValueError, match="positions are whole numbers, got torch.float32"):
        stats.AttentionStats.from_dict(saved[""].as_dict() | {"query_positions": torch.zeros(1, 1)})


def test_empty_or_zero_step_selections_are_refused_before_any_call():
    mha = attnkit.MultiHeadAttention(8, 2)
    empty_at_any_length = (
        slice(5, 2),
        slice(-2, -5),
        slice(2, 5, -1),
        slice(3, 3),
        slice(None, 0),
        slice(None, -1, -1),
    )
    for bad in (range(0), slice(None, None, 0), *empty_at_any_length):
        with pytest.raises(ValueError, match="queries"):
            attnkit.record_weights(mha, queries=bad)
    attnkit.record_weights(mha, queries=slice(5, 2, -1), heads=slice(-1, 3))  # names some at some lengths
    x = torch.randn(1, 4, 8)
    for kw, named in (({"queries": slice(10, 20)}, "4 query rows"), ({"heads": slice(5, 9)}, "2 heads")):
        with attnkit.record_weights(mha, **kw), pytest.raises(ValueError, match=f"names no .*: .* has {named}"):
            mha(x, x, x)
    with attnkit.record_weights(mha, queries=slice(None)) as every:  # a call of no queries: all of them, none
        mha(x[:, :0], x, x)
    assert every[""].shape == (1, 2, 0, 4)
    with pytest.raises(ValueError, match="layers"):
        attnkit.record_stats(mha, layers=[])
    stats_ = attnkit.attention_stats(torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8), topk=1)
    assert stats_.kv_heads == 2
    assert attnkit.attention_stats(torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8), topk=1).kv_heads is None


def test_an_empty_batch_or_no_queries_gives_empty_statistics():
    empty = attnkit.attention_stats(torch.randn(0, 2, 3, 4), torch.randn(0, 2, 5, 4), topk=2)
    assert empty.topk_values.shape == (0, 2, 3, 2) and empty.column_sum.shape == (0, 2, 5)
    none = attnkit.attention_stats(torch.randn(1, 2, 0, 4), torch.randn(1, 2, 5, 4), topk=2)
    assert none.entropy.shape == (1, 2, 0) and not none.column_sum.any()
    # an empty batch at a cache's positions, and no query heads at all
    call = stats.parts(torch.randn(0, 2, 3, 4), torch.randn(0, 2, 5, 4), query_positions=torch.zeros(0, 3))[0]
    assert stats.compute(call, 2).distance.shape == (0, 2, 3)
    headless = attnkit.attention_stats(torch.randn(1, 0, 3, 4), torch.randn(1, 1, 5, 4), topk=2)
    assert headless.topk_values.shape == (1, 0, 3, 2)
    # rows long enough for the chunked top-k search, and none of them
    long = attnkit.attention_stats(torch.randn(0, 2, 3, 4), torch.randn(0, 2, 1000, 4), topk=3)
    assert long.topk_indices.shape == (0, 2, 3, 3)
    assert stats.from_weights(torch.rand(0, 2, 1000), 3).topk_values.shape == (0, 2, 3)
    with pytest.raises(ValueError, match="topk must be at least 1, got 0"):
        stats.compute(call, 0)
    with pytest.raises(ValueError, match=r"heads must be in \[0, 2\), got \[2\]"):
        stats.rows_of(call, [0], [2])


def test_additive_scoring_with_grouped_query_heads():
    g = torch.Generator().manual_seed(4)
    q, k, w_v = torch.randn(2, 4, 6, 5, generator=g), torch.randn(2, 2, 70, 5, generator=g), torch.randn(5)
    want = attention_mods(q.double(), k.double(), k.double(), w_v=w_v.double(), is_causal=True)[1]  # (B, H, Lq, Lk)
    assert_stats(attnkit.attention_stats(q, k, w_v=w_v, topk=3, is_causal=True), want)
    parts, _ = stats.parts(q, k, w_v=w_v, is_causal=True)
    assert_stats(stats.compute(parts, 3, block_bytes=512), want)  # keys in several slices per block


def test_a_saved_record_with_values_that_are_not_tensors_is_refused():
    fields = dict.fromkeys(["topk_values", "topk_indices", "entropy", "column_sum", "distance", "sink_mass"], 1)
    with pytest.raises(ValueError, match="hold tensors"):
        attnkit.recording.StatsRecord.from_dict({"attnkit_stats": 1, "calls": {"a": [fields]}})
    good = attnkit.attention_stats(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 5, 4), topk=2).as_dict()
    bad = dict(good, entropy=good["entropy"][..., None])  # (1, 2, 3, 1): not the rows of the top-k
    with pytest.raises(ValueError, match="shapes that do not fit together"):
        attnkit.recording.StatsRecord.from_dict({"attnkit_stats": 1, "calls": {"a": [bad]}})
    with pytest.raises(ValueError, match=r"topk must be below 2147483648 \(more than any row has keys\), got 10{12}"):
        attnkit.attention_stats(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 5, 4), topk=10**12)


def test_a_head_attending_next_to_its_queries_keeps_every_digit_of_its_distance():
    """Each query puts ~0.1% of its weight on the key before it: the distance is that weight, ~9.1e-4, at every
    position of a long sequence (a product over all keys would round it at the positions' size)."""
    L = 3000
    q, k = torch.ones(1, 1, L, 1), torch.zeros(1, 1, L, 1)
    k[0, 0, 1::2] = 7.0  # keys alternate scores 0 and 7
    kw = {"scale": 1.0, "mask_mod": mods.sliding_window(2)}
    found = attnkit.attention_stats(q, k, topk=1, **kw)
    w = attnkit.functional.attention_weights(q.double(), k.double(), **kw)  # (1, 1, L, L)
    exact = (w * (torch.arange(L)[:, None] - torch.arange(L)).abs()).sum(-1)  # (1, 1, L)
    assert ((found.distance.double() - exact).abs() / exact.clamp_min(1e-12))[..., 1:].max() <= 1e-6


def test_rows_chosen_by_a_reversed_slice_and_grouped_heads_kept_with_chosen_rows():
    torch.manual_seed(0)
    mha = attnkit.MultiHeadAttention(16, 4, num_kv_heads=2).eval()
    x = torch.randn(1, 5, 16)
    with attnkit.record_weights(mha) as whole, attnkit.record_weights(mha, queries=slice(None, None, -2)) as rev:
        mha(x, x, x, is_causal=True)
    assert rev.selected[""] == ([0, 1, 2, 3], [0, 2, 4])  # the rows named, in order
    assert torch.allclose(rev[""], whole[""][:, :, [0, 2, 4]], atol=1e-7)
    assert rev.kv_heads == {"": 2}  # every head kept: still grouped


def test_the_page_of_a_d2l_model_leaves_out_its_inner_attention_or_shows_it_as_one_head(tmp_path):
    import attnkit.tools.plot
    from attnkit import d2l

    mha, additive = d2l.MultiHeadAttention(16, 4, 0.0).eval(), d2l.AdditiveAttention(16, 0.0).eval()
    x = torch.randn(2, 5, 16)
    with attnkit.record_stats(mha, topk=2) as layered, attnkit.record_stats(additive, topk=2) as alone:
        mha(x, x, x, torch.tensor([5, 3]))
        additive(x, x, x, torch.tensor([5, 3]))
    page = attnkit.tools.plot.view(layered, path=tmp_path / "mha.html").path.read_text()
    assert "Left out, having no head axis" in page and "attention" in page
    assert attnkit.tools.plot.view(alone, path=tmp_path / "additive.html").path.stat().st_size > 0


def page_keys(data: dict, call: dict) -> tuple[np.ndarray, np.ndarray]:
    """The keys ((H, Lq, k), -1 naming none) and weights (in 1/255 steps) a statistics page keeps of one call,
    inflated and decoded as its script does (attnkit/viewer/stats.js)."""
    raw = zlib.decompress(blob(data, call["top"]))
    H = len(call["summary"]["entropy"])
    cells = H * call["lq"] * data["k"]
    code = np.frombuffer(raw[: 4 * cells], dtype=np.uint8).reshape(4, cells).T.copy().view("<u4")[:, 0]
    z = code.astype(np.int64) - 1
    offset = np.where(z % 2 == 0, z // 2, -(z + 1) // 2)  # pos(i) - key
    pos = np.arange(call["lq"])[None, :, None] + call["lk"] - call["lq"]
    keys = np.where(code.reshape(H, call["lq"], -1) == 0, -1, pos - offset.reshape(H, call["lq"], -1))
    weights = np.frombuffer(raw[4 * cells :], dtype=np.uint8).reshape(H, call["lq"], -1) / 255
    return keys, weights


@pytest.mark.parametrize("budget", [None, 500, 10])
def test_the_page_keeps_the_strongest_keys_it_has_room_for_deflated(budget, tmp_path, monkeypatch):
    """Keys before and after their queries (cross-attention, no causal mask), padded keys naming none, and a budget
    too small for every recorded key: the page keeps each row's strongest ones, a prefix of the record's, and says
    how many."""
    import attnkit.tools.plot
    from attnkit.tools.viewer import _stats

    if budget is not None:
        monkeypatch.setattr(_stats, "ENTRY_BYTES", budget)
    torch.manual_seed(0)
    mha = attnkit.MultiHeadAttention(16, 4).eval()
    with attnkit.record_stats(mha, topk=8) as rec:
        mha(torch.randn(2, 30, 16), torch.randn(2, 70, 16), torch.randn(2, 70, 16), valid_lens=torch.tensor([70, 5]))
    for example in (0, 1):  # keys on both sides of their queries; keys past a row's 5 naming none
        data = payload(attnkit.tools.plot.view(rec, example=example, path=tmp_path / f"s{example}.html"))
        call = data["layers"][0]["calls"][0]
        k = data["k"]
        if budget is None:
            assert k == 8 and any("are all kept" in n for n in data["notes"])
        elif budget == 10:  # no key fits: one a row all the same, and the page says it is past its room
            assert k == 1 and any(
                "keep their 1 strongest keys" in n and "the fewest it keeps" in n for n in data["notes"]
            )
        else:
            assert 1 <= k < 8 and len(blob(data, call["top"])) <= budget
            assert any(f"keep their {k} strongest keys of the 8" in n for n in data["notes"])
        keys, weights = page_keys(data, call)
        s = rec[""]
        want = s.topk_indices[example, :, :, :k].numpy()
        assert (keys == want).all()
        assert np.abs(weights - s.topk_values[example, :, :, :k].numpy()).max() <= 0.5 / 255 + 1e-6
    positions = np.arange(30)[None, :, None] + 40
    assert (rec[""].topk_indices[0].numpy() > positions).any() and (rec[""].topk_indices[1, ..., 5:] == -1).all()


def test_the_books_layers_run_and_record_under_inference_mode():
    from attnkit import d2l

    mha, x = d2l.MultiHeadAttention(16, 4, 0.0).eval(), torch.randn(2, 5, 16)
    with torch.inference_mode():
        with attnkit.record_stats(mha, topk=2) as rec:
            y = mha(x, x, x, torch.tensor([5, 3]))
        scores = mha.attention.scores  # computed when read, as outside inference_mode
    q = mha.transpose_qkv(mha.W_q(x))
    assert y.shape == (2, 5, 16) and rec[""].entropy.shape == (2, 4, 5)
    assert torch.allclose(scores, q @ mha.transpose_qkv(mha.W_k(x)).transpose(1, 2) / 2)


def test_a_key_of_minus_infinity_weighs_0_and_leaves_every_statistic_finite():
    """A key whose score is -inf in the data (not a mask): weight exactly 0, as in the output; its entropy term is
    0, not -inf x 0 (a tester's finding: NaN entropy on the whole-row path)."""
    g = torch.Generator().manual_seed(4)
    q, k = torch.ones(2, 2, 40, 3), torch.randn(2, 1, 40, 3, generator=g)
    k[0, 0, 7] = float("-inf")
    w = attnkit.functional.attention_weights(q.double(), k.double(), is_causal=True)  # (2, 2, 40, 40)
    assert torch.isfinite(w).all() and w[0, :, 8:, 7].eq(0).all()
    assert_stats(attnkit.attention_stats(q, k, topk=3, is_causal=True), w)


@settings(max_examples=60, deadline=None)
@given(calls(), st.floats(0.0, 1.0))
def test_scores_of_minus_infinity_hide_their_keys_in_every_statistic(call, share):
    """Keys whose scores are -inf in the data (not a mask) weigh 0 as a mask would hide them: a row
    that sees only such keys is a row with no key (a tester's finding: its weight went to keys it may not see)."""
    q, k, kw, ref, topk, block = call
    g = torch.Generator().manual_seed(topk)
    q, k = q.clone(), k.clone()
    q[..., 0] = q[..., 0].abs() + 0.5
    k[..., 0] = k[..., 0].masked_fill(torch.rand(k.shape[:3], generator=g) < share, float("-inf"))
    w = weights64(q, k, ref)
    assume(bool(torch.isfinite(w).all()))  # (a score_mod may make NaN of -inf: 0 x -inf)
    parts, _ = stats.parts(q, k, **kw)
    assert_stats(stats.compute(parts, topk, block_bytes=block), w)


@pytest.mark.parametrize("sinks", [None, torch.zeros(2)], ids=["no sinks", "sinks"])
def test_a_query_that_holds_nan_leaves_the_keys_it_may_not_see_finite(sinks):
    """A NaN query's row is NaN where it may see; the keys it may not see receive nothing of it (a tester's finding:
    every key's column sum was NaN, and with sinks still after the first fix, a reviewer's)."""
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(1, 2, 8, 4, generator=g), torch.randn(1, 2, 8, 4, generator=g)
    q[0, 0, 2, 0] = float("nan")
    found = attnkit.attention_stats(q, k, topk=3, is_causal=True, sinks=sinks)
    assert found.column_sum[0, 0, :3].isnan().all() and torch.isfinite(found.column_sum[0, 0, 3:]).all()
    assert torch.isfinite(found.column_sum[0, 1]).all() and found.entropy[0, 0, 2].isnan()


def test_a_topk_past_the_keys_is_said_once_a_record():
    """record_stats(topk=100) over 6 keys: each row's entries past its keys are 0 with index -1, said once."""
    mha = attnkit.MultiHeadAttention(16, 4)
    x = torch.randn(1, 6, 16)
    with pytest.warns(UserWarning, match=r"topk=100.*6 keys.*said once") as said, attnkit.record_stats(mha, 100) as rec:
        mha(x, x, x)
        mha(x, x, x)
    assert len([w for w in said if "topk=100" in str(w.message)]) == 1
    assert (rec[""].topk_indices[..., 6:] == -1).all()
