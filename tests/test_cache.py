"""Key/value caches: incremental decoding equals the full causal forward on each row's whole sequence, for growing,
static and sliding caches, ragged prompts (right-padded), prefill in one call, token by token or in chunks, GQA,
cross-attention and every backend; a static cache's decode step compiles once; bytes, reset and errors."""

from __future__ import annotations

import pytest
import torch
from tests.mathref import max_err

import attnkit
from attnkit import dispatch, mods
from attnkit.cache import CrossKVCache, KVCache

# B batch, E hidden size, H heads, Hkv key/value heads, P padded prompt length, T generated tokens

E, H = 32, 4
LENS = torch.tensor([5, 2, 7])  # ragged prompts, right-padded to 7
P, T = 7, 20
OUT_TOL32 = 2e-5  # float32 against the float32 full forward: the suite's output tolerance

KINDS = {"growing": {}, "static": {"max_len": 40}, "sliding": {"window": 4}}


def _model(num_kv_heads: int, dtype: torch.dtype, backend: str = "auto") -> attnkit.MultiHeadAttention:
    torch.manual_seed(0)
    return attnkit.MultiHeadAttention(E, H, num_kv_heads=num_kv_heads, backend=backend).to(dtype).eval()


def _data(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(len(LENS), P, E, generator=g, dtype=dtype), torch.randn(
        len(LENS), T, E, generator=g, dtype=dtype
    )


def _full_rows(mha, prompt, gen, window):
    """Each row's whole sequence (its prompt, then the generated tokens) through the full causal forward."""
    rows = []
    for b, n in enumerate(LENS.tolist()):
        seq = torch.cat([prompt[b : b + 1, :n], gen[b : b + 1]], dim=1)  # (1, n + T, E)
        mask_mod = None if window is None else mods.sliding_window(window)
        rows.append(mha(seq, seq, seq, is_causal=True, mask_mod=mask_mod)[0])  # (n + T, E)
    return rows


def _decode(mha, cache, prompt, gen, chunk):
    """Prefill with the ragged prompts, then the generated tokens `chunk` at a time; each row's outputs in order."""
    first = mha(prompt, prompt, prompt, LENS, is_causal=True, cache=cache)  # (B, P, E)
    steps = [mha(x, x, x, is_causal=True, cache=cache) for x in gen.split(chunk, dim=1)]  # (B, chunk, E) each
    return [torch.cat([first[b, :n], *(s[b] for s in steps)]) for b, n in enumerate(LENS.tolist())]


@pytest.fixture(params=["positions_last", "heads_rows"])
def layout(request, monkeypatch):
    """Both layouts a cache stores (decode.POSITIONS_LAST_FROM decides by size; these caches are small)."""
    from attnkit.backends import decode

    monkeypatch.setattr(decode, "POSITIONS_LAST_FROM", 0 if request.param == "positions_last" else 10**9)
    return request.param


@pytest.mark.parametrize("backend", ["reference", "sdpa", "tiles:online", "auto"])  # auto: the decode backend's steps
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("num_kv_heads", [4, 2])
@pytest.mark.parametrize("chunk", [1, 17, T])
def test_incremental_decoding_equals_the_full_forward_of_each_row(kind, backend, num_kv_heads, chunk, layout):
    mha = _model(num_kv_heads, torch.float32, backend)
    prompt, gen = _data(torch.float32)
    got = _decode(mha, KVCache(**KINDS[kind]), prompt, gen, chunk)
    want = _full_rows(mha, prompt, gen, KINDS[kind].get("window"))
    for b, (g, w) in enumerate(zip(got, want, strict=True)):
        assert max_err(g, w) <= OUT_TOL32, (b, max_err(g, w))


def test_prefill_in_one_call_token_by_token_or_in_chunks_agree_in_float64():
    mha = _model(2, torch.float64)
    prompt, gen = _data(torch.float64)
    results = [_decode(mha, KVCache(), prompt, gen, chunk) for chunk in (1, 3, 17, T)]
    for other in results[1:]:
        for a, b in zip(results[0], other, strict=True):
            assert max_err(a, b) <= 1e-12


def test_sliding_cache_holds_exactly_the_window_far_past_it():
    """120 steps past a window of 8: the ring holds 8 positions per row, the outputs equal the full sliding-window
    forward, and the bytes never grow."""
    mha = _model(2, torch.float64)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 128, E, generator=g, dtype=torch.float64)
    cache = KVCache(window=8)
    outs = [mha(x[:, t : t + 1], x[:, t : t + 1], x[:, t : t + 1], is_causal=True, cache=cache) for t in range(128)]
    want = mha(x, x, x, is_causal=True, mask_mod=mods.sliding_window(8))
    assert max_err(torch.cat(outs, dim=1), want) <= 1e-12
    assert cache.capacity == 8 and cache.nbytes == 2 * 2 * 2 * 8 * (E // H) * 8
    assert sorted(cache.slot_positions[0].tolist()) == list(range(120, 128))


def test_cache_bytes_are_exactly_the_kv_heads_and_gqa_holds_a_quarter():
    x = torch.randn(2, 10, 64)
    sizes = {}
    for hkv in (8, 2):
        mha = attnkit.MultiHeadAttention(64, 8, num_kv_heads=hkv).eval()
        cache = KVCache(max_len=100)
        mha(x, x, x, is_causal=True, cache=cache)
        assert cache.nbytes == 2 * 2 * hkv * 100 * 8 * 4  # 2 (k, v) * B * Hkv * max_len * D * float32
        sizes[hkv] = cache.nbytes
    assert sizes[2] * 4 == sizes[8]


def test_a_growing_cache_grows_by_doubling():
    mha = _model(4, torch.float32)
    cache, seen = KVCache(), set()
    for _ in range(200):
        x = torch.randn(1, 1, E)
        mha(x, x, x, is_causal=True, cache=cache)
        seen.add(cache.capacity)
    assert sorted(seen) == [16, 32, 64, 128, 256]  # 4 copies in 200 steps, not one a step


@pytest.mark.parametrize(
    "compiler",
    ["eager", pytest.param("inductor", marks=pytest.mark.slow)],  # inductor: ~28 s of compiling on 2 cores
)
def test_a_static_cache_step_compiles_once(compiler):
    """32 decode steps of a compiled layer with a static cache: nothing is compiled after the second step (dynamo's
    graphs are the promise, whichever backend compiles them; Inductor's code is checked by `make test-all`)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    mha = _model(2, torch.float32)
    cache = KVCache(max_len=64)
    with torch.no_grad():
        p = torch.randn(2, 5, E)
        mha(p, p, p, torch.tensor([5, 3]), is_causal=True, cache=cache)
        step = torch.compile(lambda x: mha(x, x, x, is_causal=True, cache=cache), backend=compiler)
        x = torch.randn(2, 1, E)
        want = []
        eager_cache = KVCache(max_len=64)
        mha(p, p, p, torch.tensor([5, 3]), is_causal=True, cache=eager_cache)
        counters.clear()
        for i in range(32):
            y = step(x)
            want.append(mha(x, x, x, is_causal=True, cache=eager_cache))
            if i == 1:
                graphs = counters["stats"]["unique_graphs"]
            assert max_err(y, want[-1]) <= OUT_TOL32
    assert counters["stats"]["unique_graphs"] == graphs, dict(counters["stats"])
    assert cache.lengths.tolist() == [37, 35]


def test_cross_attention_cache_projects_the_memory_once():
    mha = _model(2, torch.float64)
    g = torch.Generator().manual_seed(3)
    memory = torch.randn(3, 9, E, generator=g, dtype=torch.float64)
    enc_lens = torch.tensor([9, 4, 1])
    ys = torch.randn(3, 6, E, generator=g, dtype=torch.float64)
    projected = []
    hook = mha.W_k.register_forward_hook(lambda m, i, o: projected.append(o.shape))
    cache = CrossKVCache()
    steps = [mha(ys[:, t : t + 1], memory, memory, enc_lens, cache=cache) for t in range(6)]
    hook.remove()
    assert len(projected) == 1  # the keys were projected at the first step only
    want = mha(ys, memory, memory, enc_lens)
    assert max_err(torch.cat(steps, dim=1), want) <= 1e-12


def test_record_weights_records_each_decode_step_over_the_cache():
    mha = _model(4, torch.float64)
    prompt, gen = _data(torch.float64)
    cache = KVCache()
    with attnkit.record_weights(mha) as rec:
        mha(prompt, prompt, prompt, LENS, is_causal=True, cache=cache)
        for t in range(3):
            mha(gen[:, t : t + 1], gen[:, t : t + 1], gen[:, t : t + 1], is_causal=True, cache=cache)
    calls = rec.calls("")
    assert [tuple(w.shape) for w in calls] == [(3, H, P, 7), (3, H, 1, 8), (3, H, 1, 9), (3, H, 1, 10)]
    last = calls[-1]
    for b, n in enumerate(LENS.tolist()):  # row b has n + 3 keys: its weights sum to 1 over them, 0 past them
        assert torch.allclose(last[b, :, 0, : n + 3].sum(-1), torch.ones(H, dtype=torch.float64))
        assert torch.all(last[b, :, 0, n + 3 :] == 0)


def test_reset_empties_the_cache_for_a_new_batch():
    mha = _model(4, torch.float64)
    prompt, gen = _data(torch.float64)
    for kind in KINDS.values():
        cache = KVCache(**kind)
        first = _decode(mha, cache, prompt, gen, 5)
        cache.reset()
        again = _decode(mha, cache, prompt, gen, 5)
        for a, b in zip(first, again, strict=True):
            assert max_err(a, b) == 0


def test_mistakes_are_value_errors_that_say_what_fits():
    mha = _model(4, torch.float32)
    x = torch.randn(2, 3, E)
    with pytest.raises(ValueError, match="give max_len .* or window .*, not both"):
        KVCache(max_len=4, window=2)
    with pytest.raises(ValueError, match="max_len must be a positive whole number"):
        KVCache(max_len=0)
    with pytest.raises(ValueError, match="attn_mask, mask_mod, score_mod and plan are not supported"):
        mha(x, x, x, is_causal=True, cache=KVCache(), mask_mod=mods.sliding_window(2))
    with pytest.raises(ValueError, match=r"valid_lens must have shape \(B,\) = \(2,\)"):
        mha(x, x, x, torch.ones(2, 3), is_causal=True, cache=KVCache())
    cache = KVCache(max_len=4)
    mha(x, x, x, is_causal=True, cache=cache)
    with pytest.raises(ValueError, match="holds max_len=4 positions per row; a row already holds 3 and the call"):
        mha(x, x, x, is_causal=True, cache=cache)
    with pytest.raises(ValueError, match="one cache per layer and batch"):
        mha(torch.randn(3, 1, E), torch.randn(3, 1, E), torch.randn(3, 1, E), is_causal=True, cache=cache)
    with pytest.raises(TypeError, match="cache must be an attnkit.KVCache or attnkit.CrossKVCache"):
        mha(x, x, x, cache={})


@pytest.mark.parametrize("backend", ["reference", "sdpa", "tiles:online"])
def test_nan_in_prompt_padding_never_reaches_a_decode_step(backend):
    """Padded prompt positions are projected and written past each row's length; whatever they hold (NaN here)
    never reaches an output, at the prefill or at any later step (dead keys that are not finite are zeroed)."""
    mha = _model(2, torch.float64, backend)
    prompt, gen = _data(torch.float64)
    poisoned = prompt.clone()
    for b, n in enumerate(LENS.tolist()):
        poisoned[b, n:] = float("nan")
    runs = [_decode(mha, KVCache(), p, gen, 1) for p in (prompt, poisoned)]
    for clean, dirty in zip(*runs, strict=True):
        assert torch.equal(clean, dirty)


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_prefill_of_empty_rows_gives_zeros_and_an_empty_batch_runs(kind):
    mha = _model(2, torch.float64)
    x = torch.randn(2, 3, E, dtype=torch.float64)
    cache = KVCache(**KINDS[kind])
    out = mha(x, x, x, torch.tensor([0, 0]), is_causal=True, cache=cache)  # every row empty: all padding
    assert torch.equal(out, mha.W_o(torch.zeros_like(x)))
    step = mha(x[:, :1], x[:, :1], x[:, :1], is_causal=True, cache=cache)  # then the first real token
    assert max_err(step, mha(x[:, :1], x[:, :1], x[:, :1], is_causal=True)) <= 1e-12
    none = torch.randn(0, 2, E, dtype=torch.float64)
    assert mha(none, none, none, is_causal=True, cache=KVCache(**KINDS[kind])).shape == (0, 2, E)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("chunk", [1, 6])
def test_aligned_rows_decode_equals_the_full_forward(kind, chunk):
    """Prompts of one length and no valid_lens (a growing cache then appends slices, with no mask): every step
    equals the full causal forward; then a call with valid_lens makes the rows ragged and they stay right."""
    mha = _model(2, torch.float64)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 30, E, generator=g, dtype=torch.float64)
    cache = KVCache(**KINDS[kind])
    outs = [mha(x[:, :6], x[:, :6], x[:, :6], is_causal=True, cache=cache)]
    outs += [mha(c, c, c, is_causal=True, cache=cache) for c in x[:, 6:18].split(chunk, dim=1)]
    window = KINDS[kind].get("window")
    mask_mod = None if window is None else mods.sliding_window(window)
    want = mha(x[:, :18], x[:, :18], x[:, :18], is_causal=True, mask_mod=mask_mod)
    assert max_err(torch.cat(outs, dim=1), want) <= 1e-12
    ragged = mha(x[:, 18:20], x[:, 18:20], x[:, 18:20], torch.tensor([2, 1]), is_causal=True, cache=cache)
    assert cache.lengths.tolist() == [20, 19]
    for b, n in enumerate((20, 19)):
        row = mha(x[b : b + 1, :n], x[b : b + 1, :n], x[b : b + 1, :n], is_causal=True, mask_mod=mask_mod)
        assert max_err(ragged[b, : n - 18], row[0, 18:n]) <= 1e-12


def test_padding_is_stored_as_zeros():
    """What a padded prompt position held (NaN here) is not kept: the cache stores zeros past each row's length,
    so a decode step has no dead key to zero."""
    mha = _model(2, torch.float64)
    prompt, _ = _data(torch.float64)
    prompt[0, 5:] = float("nan")
    cache = KVCache()
    mha(prompt, prompt, prompt, LENS, is_causal=True, cache=cache)
    for b, n in enumerate(LENS.tolist()):
        assert torch.equal(cache.keys[b, :, n:], torch.zeros_like(cache.keys[b, :, n:]))
        assert torch.equal(cache.values[b, :, n:], torch.zeros_like(cache.values[b, :, n:]))


def test_a_cpu_cache_stores_positions_last_from_its_threshold_in_the_decode_dtypes():
    from attnkit.backends import decode

    n = decode.POSITIONS_LAST_FROM
    x = torch.randn(1, 2, 5, 8)
    small, large = decode.storage(x, n - 1), decode.storage(x, n)
    assert small.stride() == (2 * (n - 1) * 8, (n - 1) * 8, 8, 1) and large.stride() == (2 * n * 8, n * 8, 1, n)
    assert torch.equal(small[:, :, :5], x) and torch.equal(large[:, :, :5], x)
    assert not small[:, :, 5:].any() and not large[:, :, 5:].any()  # zeros past what was given
    half = decode.storage(x.bfloat16(), n)  # the decode step takes float32 and float64 only: SDPA's layout
    assert half.stride() == (2 * n * 8, n * 8, 8, 1)


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_cpu_cache_stores_positions_last_and_its_decode_step_is_two_products(kind, monkeypatch):
    """Keys and values are kept with the positions as the last dimension in memory (here from the first position
    on), for every kind of cache and the cross-attention one, and an MHA decode step over them runs the decode
    backend, not the fused kernel (which reads that layout slower); its output equals the full forward's."""
    from attnkit.backends import decode, sdpa

    monkeypatch.setattr(decode, "POSITIONS_LAST_FROM", 0)

    calls = []
    kernel = sdpa.fused  # every call of the fused kernel goes through it
    monkeypatch.setattr(sdpa, "fused", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    mha = _model(2, torch.float32, "auto")
    prompt, gen = _data(torch.float32)
    cache = KVCache(**KINDS[kind])
    with torch.no_grad():
        mha(prompt, prompt, prompt, LENS, is_causal=True, cache=cache)
        calls.clear()
        with dispatch.watch(implementations=True) as ran:
            steps = [mha(x, x, x, is_causal=True, cache=cache) for x in gen.split(1, dim=1)]
        assert calls == [] and set(ran) == {"decode"}
        cross = CrossKVCache()
        mha(gen[:, :1], prompt, prompt, LENS, cache=cross)  # projects the memory (and attends over the projection)
        calls.clear()
        with dispatch.watch(implementations=True) as ran:
            crossed = mha(gen[:, 1:2], prompt, prompt, LENS, cache=cross)  # a step over what it stored
        assert calls == [] and ran == ["decode"]
        want = _full_rows(mha, prompt, gen, KINDS[kind].get("window"))
        assert max_err(crossed, mha(gen[:, 1:2], prompt, prompt, LENS)) <= OUT_TOL32
    for stored in (cache.keys, cache.values, cross.keys, cross.values):
        assert stored is not None and stored.stride(2) == 1 and stored.stride(3) == stored.shape[2]
    for b, n in enumerate(LENS.tolist()):
        got = torch.cat([s[b] for s in steps])  # (T, E)
        assert max_err(got, want[b][n:]) <= OUT_TOL32


def test_a_reset_static_cache_keeps_nothing_of_the_last_batch_nan_included():
    """A static cache keeps its storage across reset(), zeroed: a NaN that a real token of the last batch brought
    (its own row's outputs are NaN then) is not in the band past the new rows' lengths."""
    mha = _model(2, torch.float64, "sdpa")
    prompt, gen = _data(torch.float64)
    poisoned = gen.clone()
    poisoned[:, 10] = float("nan")  # the 11th generated token of every row: real, stored at length_b + 10
    cache = KVCache(max_len=40)
    with torch.no_grad():
        _decode(mha, cache, prompt, poisoned, 1)
        cache.reset()
        again = _decode(mha, cache, prompt, gen[:, :3], 1)  # shorter rows: the NaN lies past them
        fresh = _decode(mha, KVCache(max_len=40), prompt, gen[:, :3], 1)
    for got, want in zip(again, fresh, strict=True):
        assert torch.isfinite(got).all() and torch.equal(got, want)


@pytest.mark.parametrize("book", [False, True], ids=["attnkit", "d2l"])
def test_a_cache_step_tells_the_backends_its_keys_are_zeros_past_each_row(monkeypatch, book):
    """Over a KVCache the band past each row's length is zeros by construction, so zero_dead does not read it (on
    a ragged decode step it was the largest cost after the products): the cache's update returns each row's
    length, which the layer (attnkit's or the book's) passes on in the Call; outside a cache call it is checked."""
    from attnkit import d2l
    from attnkit.backends import common

    seen = []
    check = common._finite_suffixes
    monkeypatch.setattr(common, "_finite_suffixes", lambda *a: seen.append((a[-1], check(*a))))
    mha = _model(2, torch.float32, "sdpa")
    if book:  # the heads folded into the batch: lengths (B*H,); the book's valid_lens is positional
        layer = d2l.MultiHeadAttention(E, H, 0.0)
        mha = lambda q, k, v, valid_lens=None, **kw: layer(q, k, v, valid_lens, **kw)  # noqa: E731
    prompt, gen = _data(torch.float32)
    with torch.no_grad():
        _decode(mha, KVCache(), prompt, gen[:, :2], 1)  # ragged: valid_lens masks every step
        assert seen and all(lengths is not None and skipped for lengths, skipped in seen)
        seen.clear()
        q, k = torch.randn(3, 4, 1, 8), torch.randn(3, 2, 9, 8)
        attnkit.scaled_dot_product_attention(q, k, k, valid_lens=torch.tensor([9, 3, 5]), backend="sdpa")
    assert [lengths for lengths, _ in seen] == [None]


@pytest.mark.parametrize("layout", ["positions_last", "heads_rows"], indirect=True)
@pytest.mark.parametrize("backend", ["reference", "sdpa", "tiles:online"])
def test_a_row_with_no_new_token_over_a_past_holding_inf_gives_zeros(backend, layout):
    """The promise is about each row's length: a row whose new tokens are all padding sees no key, so all its
    keys are dead, including its real past ones, which hold inf here: they are zeroed, and its output is zero."""
    mha = _model(2, torch.float64, backend)
    x = torch.randn(2, 4, E, dtype=torch.float64)
    x[1, 2] = float("inf")  # a real token of row 1: its key and value are not finite
    cache = KVCache()
    with torch.no_grad():
        mha(x, x, x, torch.tensor([4, 4]), is_causal=True, cache=cache)
        step = mha(x[:, :1], x[:, :1], x[:, :1], torch.tensor([1, 0]), is_causal=True, cache=cache)
    assert torch.equal(step[1], mha.W_o(torch.zeros(1, E, dtype=torch.float64)))
    assert torch.isfinite(step[0]).all()


def test_a_static_cache_resets_between_batches_under_autograd_and_inference_mode():
    """reset() gives new zeroed tensors of the same shapes: the last batch's backward may still come (its graph
    holds the old ones), a second batch trains, and a cache filled in inference mode resets outside it."""
    torch.manual_seed(0)
    mha = attnkit.MultiHeadAttention(16, 4, num_kv_heads=2)
    cache = KVCache(max_len=32)
    x, s = torch.randn(2, 5, 16), torch.randn(2, 1, 16)
    for _ in range(2):  # two batches, each reset before its backward
        loss = mha(x, x, x, is_causal=True, cache=cache).sum() + mha(s, s, s, is_causal=True, cache=cache).sum()
        cache.reset()
        loss.backward()
        assert cache.capacity == 32 and not cache.keys.any() and cache.lengths.tolist() == [0, 0]
    cache = KVCache(max_len=32)
    with torch.inference_mode():
        mha(x, x, x, is_causal=True, cache=cache)
    cache.reset()
    with torch.no_grad():
        assert max_err(mha(x, x, x, is_causal=True, cache=cache), mha(x, x, x, is_causal=True)) <= OUT_TOL32


@pytest.mark.parametrize("layout", ["positions_last", "heads_rows"], indirect=True)
def test_a_batch_of_no_rows_decodes(layout):
    mha = _model(2, torch.float32, "sdpa")
    none = torch.randn(0, 3, E)
    cache = KVCache(max_len=40)
    with torch.no_grad():
        mha(none, none, none, torch.zeros(0, dtype=torch.long), is_causal=True, cache=cache)
        assert mha(none[:, :1], none[:, :1], none[:, :1], is_causal=True, cache=cache).shape == (0, 1, E)


# --- what adversarial testing found (issue 22, findings e, g, i) -------------------------------------------


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("book", [False, True], ids=["attnkit", "d2l"])
def test_keys_of_another_length_than_the_queries_are_one_value_error_naming_both(kind, book):
    """A self-attention cache takes the call's new positions as keys and values, as many as the queries: the
    growing cache took more silently, the static and sliding ones failed about shapes never passed (finding e)."""
    from attnkit import d2l

    mha = d2l.MultiHeadAttention(E, H, 0.0) if book else _model(2, torch.float32)
    x, kv = torch.randn(3, 1, E), torch.randn(3, 4, E)
    with pytest.raises(
        ValueError, match=rf"queries has 1 positions but keys 4: queries \(3, 1, {E}\), keys \(3, 4, {E}\)"
    ):
        mha(x, kv, kv, None, cache=KVCache(**KINDS[kind]))


@pytest.mark.parametrize("kind", list(KINDS))
def test_one_backward_through_several_calls_of_a_cache_gives_the_full_forwards_gradient(kind):
    """Training through a cache (a prefill, then steps, one loss): every kind of cache gives the gradient of the
    full causal forward; the growing cache used to raise autograd's in-place error (finding g)."""
    torch.manual_seed(0)
    mha = attnkit.MultiHeadAttention(E, H, num_kv_heads=2).double()
    x = torch.randn(2, 7, E, dtype=torch.float64, requires_grad=True)
    cache = KVCache(**KINDS[kind])
    parts = [mha(x[:, :4], x[:, :4], x[:, :4], is_causal=True, cache=cache)]
    parts += [mha(x[:, t : t + 1], x[:, t : t + 1], x[:, t : t + 1], is_causal=True, cache=cache) for t in range(4, 7)]
    window = KINDS[kind].get("window")
    full = mha(x, x, x, is_causal=True, mask_mod=None if window is None else mods.sliding_window(window))
    got = torch.autograd.grad(torch.cat(parts, dim=1).square().sum(), [x, *mha.parameters()])
    want = torch.autograd.grad(full.square().sum(), [x, *mha.parameters()])
    for g, w in zip(got, want, strict=True):
        assert max_err(g, w) <= 1e-10


def test_a_cache_filled_in_one_dtype_and_stepped_in_another_says_the_caches_dtype():
    """Filled under bfloat16 autocast, then stepped in float32: the error names the cache's dtype and the call's
    (finding i), instead of failing in a write."""
    mha = _model(2, torch.float32)
    x = torch.randn(2, 3, E)
    cache = KVCache()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mha(x, x, x, is_causal=True, cache=cache)
    with pytest.raises(
        ValueError, match=r"this cache holds torch.bfloat16 keys and values, but the call brings torch.float32"
    ):
        mha(x[:, :1], x[:, :1], x[:, :1], is_causal=True, cache=cache)


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_cache_filled_in_inference_mode_steps_outside_it(kind):
    """Filled under torch.inference_mode(), stepped under no_grad (and with autograd): inference tensors cannot be
    written outside inference mode, so the cache writes into copies, and every step equals the full forward."""
    mha = _model(2, torch.float64)
    x = torch.randn(2, 6, E, dtype=torch.float64)
    cache = KVCache(**KINDS[kind])
    with torch.inference_mode():
        mha(x[:, :4], x[:, :4], x[:, :4], is_causal=True, cache=cache)
    with torch.no_grad():
        step = mha(x[:, 4:5], x[:, 4:5], x[:, 4:5], is_causal=True, cache=cache)
    last = mha(x[:, 5:6], x[:, 5:6], x[:, 5:6], is_causal=True, cache=cache)
    window = KINDS[kind].get("window")
    with torch.no_grad():
        full = mha(x, x, x, is_causal=True, mask_mod=None if window is None else mods.sliding_window(window))
    assert max_err(step, full[:, 4:5]) <= 1e-12 and max_err(last, full[:, 5:6]) <= 1e-12


def test_a_cross_cache_given_another_batch_names_the_cache():
    mha = _model(2, torch.float32)
    memory, y = torch.randn(3, 7, E), torch.randn(3, 1, E)
    cache = CrossKVCache()
    mha(y, memory, memory, cache=cache)
    with pytest.raises(ValueError, match=r"this CrossKVCache holds the projected encoder outputs of a batch of 3"):
        mha(y[:2], memory[:2], memory[:2], cache=cache)
