"""attnkit.stats.tiled: statistics from the rows' log-sum-exp the forward gave, a tile of keys at a time, against the
float64 weights; and the sdpa backend's kernel that gives it (attnkit.backends.sdpa.attention_with_lse)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import attnkit
import test_stats
from attnkit import stats
from attnkit.backends import sdpa
from attnkit.backends.contract import Call
from attnkit.functional import Masks, _build_mask
from attnkit.stats import kernel, tiled
from attnkit.stats.blocks import Parts
from attnkit.stats.reduce import Sums
from test_stats import assert_stats

# B batch, H heads, Hkv key/value heads, Lq/Lk query/key length, D head dim

FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def weights64(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    """The float64 weights, from their definition: ``(B, H, Lq, Lk)``."""
    G = q.shape[1] // k.shape[1]
    s = q.double() @ k.double().repeat_interleave(G, 1).transpose(-1, -2) * scale  # (B, H, Lq, Lk)
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    return s.softmax(-1)


@st.composite
def calls(draw):
    """Shapes (grouped heads, several examples, lengths that end mid-chunk and mid-tile), causal or not, scores from
    flat to so sharp that most weights underflow, float32 or float64, tiles small enough to take several, a budget
    that keeps one tile's weights at a time, a few, or all, and float32's tiles by the kernel or by torch ops."""
    B, Hkv, G = draw(st.integers(1, 2)), draw(st.integers(1, 2)), draw(st.sampled_from([1, 2, 4]))
    causal = draw(st.booleans())
    Lq = draw(st.integers(1, 300))
    Lk = Lq if causal else draw(st.integers(1, 300))
    D = draw(st.sampled_from([1, 8, 16]))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    sharp = draw(st.sampled_from([0.1, 1.0, 4.0, 40.0]))  # 40: scores hundreds apart, most weights below 1e-38
    q = torch.randn(B, Hkv * G, Lq, D, generator=g, dtype=dtype) * sharp
    k = torch.randn(B, Hkv, Lk, D, generator=g, dtype=dtype)
    tile, rows = draw(st.sampled_from([32, 64, 1024])), draw(st.sampled_from([1, 8, 512]))
    block = draw(st.sampled_from([1, 2**14, 2**24]))
    return q, k, causal, draw(st.integers(1, 12)), tile, rows, block, sharp, draw(st.booleans())


@contextlib.contextmanager
def tiles(tile: int, rows: int, kept: int) -> Iterator[None]:
    """tiled.TILE, ROWS and KEPT_BYTES set for one example, and rows of any length tiled (hypothesis runs many
    examples in one test: no monkeypatch)."""
    saved = tiled.TILE, tiled.ROWS, tiled.KEPT_BYTES, tiled.MIN_KEYS
    tiled.TILE, tiled.ROWS, tiled.KEPT_BYTES, tiled.MIN_KEYS = tile, rows, kept, 1
    try:
        yield
    finally:
        tiled.TILE, tiled.ROWS, tiled.KEPT_BYTES, tiled.MIN_KEYS = saved


@settings(max_examples=50, deadline=None)
@given(calls())
def test_statistics_from_the_kernels_row_sums_equal_those_of_the_whole_weights(call):
    _check_row_sums(call)


@pytest.mark.slow  # make test-all: 100 examples more of the test above (5-15 s on 2 cores, more when busy)
@settings(max_examples=100, deadline=None)
@given(calls())
def test_statistics_from_the_kernels_row_sums_equal_those_of_the_whole_weights_more_examples(call):
    _check_row_sums(call)


def _check_row_sums(call) -> None:
    q, k, causal, topk, tile, rows, block, sharp, by_kernel = call
    scale = q.shape[-1] ** -0.5
    _, lse = FLASH(q, k, k, 0.0, causal, scale=scale)[:2]  # (B, H, Lq)
    parts, _ = stats.parts(q, k, is_causal=causal)
    parts = parts._replace(lse=lse)
    assert tiled.supports(parts)
    with tiles(tile, rows, block), contextlib.nullcontext() if by_kernel else kernel.disabled():
        assert tiled.fused(parts) == (by_kernel and q.dtype == torch.float32 and kernel.available())
        sums = Sums(*q.shape[:3], k.shape[2], topk, q.dtype, q.device)
        taken = tiled.compute(parts, sums, 4)  # (its rows summed to 1: it was not put aside for the whole-row path)
        found = stats.compute(parts, topk)
    assert taken or sharp > 4
    # each weight is off by the scores' rounding, about eps x the largest score (as on the whole-row path: sharp
    # float32 scores of ~100 give 1e-5)
    kk = k.double().repeat_interleave(q.shape[1] // k.shape[1], 1)  # (B, H, Lk, D)
    largest = float((q.double() @ kk.transpose(-1, -2)).abs().max()) * scale
    assert_stats(found, weights64(q, k, causal, scale), tol=max(1e-5, 4 * torch.finfo(q.dtype).eps * largest))


@pytest.fixture(params=["kernel", "torch ops"])
def tile_path(request, monkeypatch) -> str:
    """A float32 call's tiles by the kernel (where it builds) or by torch ops."""
    if request.param == "torch ops":
        monkeypatch.setenv("ATTNKIT_STATS_KERNEL", "0")
    return request.param


def test_long_rows_take_the_chunked_top_k_search_over_tiles(monkeypatch, tile_path):
    """Rows of thousands of keys over tiles of 256: the top-k search through chunk maxima across tiles (a last tile
    narrower than the others), with ties, its weights kept 2 tiles at a time or all at once; and the distance's far
    tiles, before every row."""
    monkeypatch.setattr(tiled, "TILE", 256)
    monkeypatch.setattr(tiled, "MIN_KEYS", 1)
    g = torch.Generator().manual_seed(5)
    q, k = torch.randn(2, 4, 1500, 16, generator=g) * 2, torch.randn(2, 2, 1500, 16, generator=g) * 2
    k[:, :, 700:760] = k[:, :, 100:160]  # equal keys: tied weights in two tiles
    for causal in (True, False):
        _, lse = FLASH(q, k, k, 0.0, causal, scale=0.25)[:2]
        parts = stats.parts(q, k, is_causal=causal)[0]._replace(lse=lse)
        want = weights64(q, k, causal, 0.25)
        for block in (2**19, 2**24):  # 512 rows x 256 keys x 4 bytes: one tile at a time, or all
            monkeypatch.setattr(tiled, "KEPT_BYTES", block)
            assert_stats(stats.compute(parts, 5), want)


def test_row_sums_that_do_not_sum_the_weights_to_1_send_the_call_to_the_whole_row_path(monkeypatch, tile_path):
    """A log-sum-exp off by 1e-3 (weights summing to 0.999) and NaN: the call gives the whole-row path's statistics.
    Huge scores (a key of -1e30, scores ~1e29: this pass's and the kernel's may round far apart, weights past 1):
    finite statistics, the whole-row path's or, where every row summed to 1 within MASS_TOLERANCE, near them."""
    monkeypatch.setattr(tiled, "MIN_KEYS", 1)
    g = torch.Generator().manual_seed(2)
    q, k = torch.randn(1, 2, 30, 8, generator=g), torch.randn(1, 2, 30, 8, generator=g)
    huge = k.clone()
    huge[0, 0, 3] = -1e30
    nan_q = q.clone()
    nan_q[0, 1, 7, 3] = float("nan")
    for name, (qq, kk, causal, off) in {
        "off": (q, k, True, 1e-3),
        "huge": (q, huge, False, 0.0),
        "nan": (nan_q, k, True, 0.0),
    }.items():
        _, lse = FLASH(qq, kk, kk, 0.0, causal, scale=0.5)[:2]
        parts = stats.parts(qq, kk, is_causal=causal, scale=0.5)[0]
        taken = tiled.compute(parts._replace(lse=lse + off), Sums(1, 2, 30, 30, 3, q.dtype, q.device), 4)
        assert not taken or name == "huge", name  # huge scores may round alike in both: then they are kept
        found, whole = stats.compute(parts._replace(lse=lse + off), 3), stats.compute(parts, 3)
        for field in ("topk_values", "entropy", "column_sum", "distance", "sink_mass"):
            got, want = getattr(found, field), getattr(whole, field)
            atol = 1e-3 if taken else 0.0
            torch.testing.assert_close(got, want, rtol=0, atol=atol, equal_nan=True, msg=f"{name} {field}")
        assert torch.isfinite(found.entropy).all() == (name != "nan"), name


def test_calls_the_kernel_does_not_run_take_the_whole_row_path():
    q, k = torch.randn(1, 2, 10, 8), torch.randn(1, 2, 10, 8)
    lse = torch.zeros(1, 2, 10)
    for kw in ({"valid_lens": torch.tensor([4])}, {"sinks": torch.zeros(2)}, {"is_causal": True, "scale": 0.5}):
        parts = stats.parts(q, k, **kw)[0]._replace(lse=lse)
        assert tiled.supports(parts) == ("is_causal" in kw)
    parts = stats.parts(q, k[:, :, :7], is_causal=True)[0]._replace(lse=lse)  # causal with Lq != Lk
    assert not tiled.supports(parts)
    parts = stats.parts(q.half(), k.half())[0]._replace(lse=lse)
    assert not tiled.supports(parts)
    parts = stats.parts(q, k)[0]._replace(lse=lse, query_positions=torch.arange(10)[None])
    assert not tiled.supports(parts)


def _call(q, k, v, causal=False, **kw) -> Call:
    masks = Masks(is_causal=causal, valid_lens=kw.pop("valid_lens", None))
    return Call(q, k, v, _build_mask(q, k, masks, False), scale=q.shape[-1] ** -0.5, **kw)


def test_the_kernel_gives_sdpas_output_and_each_rows_log_sum_exp():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 40, 4, 16, generator=g).transpose(1, 2)  # (B, H, L, D), a view as a model's
    k, v = torch.randn(2, 2, 40, 16, generator=g), torch.randn(2, 2, 40, 16, generator=g)
    for causal in (False, True):
        found = sdpa.attention_with_lse(_call(q, k, v, causal))
        assert found is not None
        out, lse = found
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        assert torch.equal(out, want)
        s = q.double() @ k.double().repeat_interleave(2, 1).transpose(-1, -2) / 4  # (B, H, L, L)
        if causal:
            s = s.masked_fill(torch.ones(40, 40, dtype=torch.bool).triu(1), float("-inf"))
        assert lse.shape == (2, 4, 40) and (lse.double() - s.logsumexp(-1)).abs().max() <= 1e-5


def test_the_kernel_reads_keys_and_values_stored_positions_last_as_sdpa_does(monkeypatch):
    """A KVCache's memory keeps positions last (from 4,096 on): the kernel reads rows as contiguous, so they are
    made so first; the output is the sdpa backend's, bit for bit (it copies them too), and a cached prefill
    recorded equals the same one unrecorded."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, 50, 8, generator=g)
    k, v = (torch.randn(1, 2, 8, 50, generator=g).transpose(-1, -2) for _ in range(2))  # (B, H, L, D), positions last
    for causal in (False, True):
        found = sdpa.attention_with_lse(_call(q, k, v, causal))
        assert found is not None
        assert torch.equal(found[0], sdpa.attention(_call(q, k, v, causal))[0])
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)  # on the views
        assert (found[0] - want).abs().max() <= 1e-6
    monkeypatch.setattr(tiled, "MIN_KEYS", 1)
    torch.manual_seed(0)
    mha = attnkit.MultiHeadAttention(32, 4).eval()
    x = torch.randn(1, 4096, 32)
    with torch.no_grad():
        plain = mha(x, x, x, is_causal=True, cache=attnkit.KVCache())
        with attnkit.record_stats(mha, topk=2) as rec:
            out = mha(x, x, x, is_causal=True, cache=attnkit.KVCache())
    assert torch.equal(out, plain)
    assert (rec[""].column_sum.sum(-1) - 4096).abs().max() <= 4096 * 1e-5  # every row's weights sum to 1


def test_the_kernel_is_asked_only_for_calls_it_runs_as_sdpa_would():
    q, k, v = torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    assert sdpa.attention_with_lse(_call(q, k, v, valid_lens=torch.tensor([3]))) is None  # a mask
    assert sdpa.attention_with_lse(_call(q, k[:, :, :4], v[:, :, :4], causal=True)) is None  # causal, Lq != Lk
    assert sdpa.attention_with_lse(_call(q.half(), k.half(), v.half())) is None
    assert sdpa.attention_with_lse(_call(q, k, v[..., :4])) is None  # another value size
    assert sdpa.attention_with_lse(_call(q, k, v, dropout_p=0.1)) is None
    rows_strided = q.transpose(-1, -2).contiguous().transpose(-1, -2)  # (B, H, L, D), features not contiguous
    assert sdpa.attention_with_lse(_call(rows_strided, k, v)) is None  # SDPA takes another kernel for those
    assert sdpa.attention_with_lse(_call(q.requires_grad_(), k, v)) is None  # its backward is not attnkit's
    with torch.no_grad():
        assert sdpa.attention_with_lse(_call(q, k, v)) is not None


def test_a_layer_recorded_without_grad_takes_the_kernels_row_sums(monkeypatch):
    """MultiHeadAttention, causal, GQA, under no_grad, rows as long as MIN_KEYS: the statistics come from the tiled
    path, equal to the whole weights', and the output is the one the layer gives unrecorded. A mask: the whole-row
    path. Shorter rows: the tiled path where the kernel takes them, the whole-row path where torch ops would."""
    monkeypatch.setattr(tiled, "MIN_KEYS", 90)
    used = []
    original = tiled.compute
    monkeypatch.setattr(tiled, "compute", lambda *a: (used.append(1), original(*a))[1])
    torch.manual_seed(0)
    mha = attnkit.MultiHeadAttention(32, 4, num_kv_heads=2).eval()
    x = torch.randn(2, 90, 32)
    with torch.no_grad():
        plain = mha(x, x, x, is_causal=True)
        with attnkit.record_stats(mha, topk=4) as rec:
            out = mha(x, x, x, is_causal=True)
        with attnkit.record_weights(mha) as rw:
            mha(x, x, x, is_causal=True)
    assert used == [1]
    assert torch.equal(out, plain)
    assert_stats(rec[""], rw[""].double())
    with torch.no_grad(), attnkit.record_stats(mha, topk=4):  # a mask: the whole-row path
        mha(x, x, x, torch.tensor([90, 40]), is_causal=True)
    with torch.no_grad(), kernel.disabled(), attnkit.record_stats(mha, topk=4):  # torch ops, fewer keys: whole rows
        mha(x[:, :89], x[:, :89], x[:, :89], is_causal=True)
    assert used == [1]
    with torch.no_grad(), attnkit.record_stats(mha, topk=4) as short:  # the kernel takes rows of any length
        mha(x[:, :89], x[:, :89], x[:, :89], is_causal=True)
    assert used == [1, 1] if kernel.available() else used == [1]
    with attnkit.record_weights(mha) as rw, torch.no_grad():
        mha(x[:, :89], x[:, :89], x[:, :89], is_causal=True)
    assert_stats(short[""], rw[""].double())


def test_weights_below_the_smallest_normal_number_are_those_of_the_whole_row_path(monkeypatch, tile_path):
    """Scores 0, -95 and -200 apart: weights 1, 5.5e-42 (a subnormal) and 0. The tiled path clamps what exp() would
    take slowly and takes the subnormal ones one by one: the same values and keys as the whole-row path."""
    monkeypatch.setattr(tiled, "MIN_KEYS", 1)
    q = torch.ones(1, 1, 3, 1)
    k = torch.tensor([0.0, -95.0, -200.0]).view(1, 1, 3, 1)
    _, lse = FLASH(q, k, k, 0.0, False, scale=1.0)[:2]
    parts = stats.parts(q, k, scale=1.0)[0]
    tiles, whole = stats.compute(parts._replace(lse=lse), 3), stats.compute(parts, 3)
    assert tiles.topk_indices[0, 0, 0].tolist() == whole.topk_indices[0, 0, 0].tolist() == [0, 1, -1]
    assert torch.equal(tiles.topk_values, whole.topk_values) and 0 < float(tiles.topk_values[0, 0, 0, 1]) < 1e-41


@settings(max_examples=40, deadline=None)
@given(calls(), st.floats(0.0, 1.0))
def test_keys_whose_scores_are_minus_infinity_weigh_0_on_the_tiled_path(call, share):
    """Keys that score -inf in the data (not a mask) weigh 0, leave every statistic finite and are no row's top-k,
    by the kernel and by torch ops; a row that sees only such keys sees none (the whole-row path takes it)."""
    q, k, causal, topk, tile, rows, block, sharp, by_kernel = call
    g = torch.Generator().manual_seed(topk)
    q, k = q.clone(), k.clone()
    q[..., 0] = q[..., 0].abs() + 0.5
    k[..., 0] = k[..., 0].masked_fill(torch.rand(k.shape[:3], generator=g) < share, float("-inf"))
    scale = q.shape[-1] ** -0.5
    _, lse = FLASH(q, k, k, 0.0, causal, scale=scale)[:2]  # (B, H, Lq)
    parts = stats.parts(q, k, is_causal=causal)[0]._replace(lse=lse)
    with tiles(tile, rows, block), contextlib.nullcontext() if by_kernel else kernel.disabled():
        found = stats.compute(parts, topk)
    w = test_stats.weights64(q, k, {"is_causal": causal, "scale": scale})
    kk = k.double().repeat_interleave(q.shape[1] // k.shape[1], 1)  # (B, H, Lk, D)
    finite = (q.double() @ kk.transpose(-1, -2)).nan_to_num(0.0, 0.0, 0.0)  # (B, H, Lq, Lk)
    assert_stats(found, w, tol=max(1e-5, 4 * torch.finfo(q.dtype).eps * float(finite.abs().max()) * scale))


@pytest.mark.parametrize("by_kernel", [True, False])
@pytest.mark.parametrize("causal", [False, True])
def test_the_largest_weights_are_as_near_float64_as_a_float32_softmax(monkeypatch, by_kernel, causal):
    """Scores in the tens, D = 96 (a scale no power of 2): the tiled path's largest weights are exp(score - lse) with
    this pass's scores and the kernel's lse, each rounded in its own order; over each row's own sum they are within
    twice a float32 softmax's error of float64 (they were 5-7x it)."""
    if by_kernel and not kernel.available():
        pytest.skip("the tile kernel is not built here")
    monkeypatch.setattr(tiled, "MIN_KEYS", 1)
    g = torch.Generator().manual_seed(96)
    B, H, L, D = 1, 4, 1024, 96
    q, k, v = (torch.randn(B, H, L, D, generator=g) * 4 for _ in range(3))
    scale = D**-0.5
    _, lse = FLASH(q, k, v, 0.0, causal, scale=scale)[:2]
    mask = _build_mask(q, k, Masks(is_causal=causal), False)
    parts = Parts(q, k, mask, scale=scale, lse=lse)
    sums = Sums(B, H, L, L, 8, torch.float32, q.device)
    with contextlib.nullcontext() if by_kernel else kernel.disabled():
        assert tiled.compute(parts, sums, 4)
    truth = weights64(q, k, causal, scale)  # (B, H, L, L)
    s32 = (q @ k.transpose(-1, -2)) * scale
    if causal:
        s32 = s32.masked_fill(torch.ones(L, L, dtype=torch.bool).triu(1), float("-inf"))
    float32_error = (s32.softmax(-1).topk(8, -1).values.double() - truth.topk(8, -1).values).abs().max().item()
    error = (sums.values.double() - truth.topk(8, -1).values).abs().max().item()
    assert error <= 2 * float32_error, (error, float32_error)
