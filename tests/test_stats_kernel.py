"""attnkit.stats.kernel: the statistics' tile kernel (attnkit/csrc/stats.cpp) against the float64 weights on the
orders that stress its top-k search, NaN where no row looks, threads, and what happens where it cannot be built."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from attnkit import csrc, stats
from attnkit.stats import kernel, tiled
from test_stats import assert_stats
from test_stats_tiled import FLASH, weights64

# B batch, H heads, L length, D head dim, r rows of a tile, w its keys, k the top-k

if os.environ.get("CI"):  # CI has a C++ compiler (make compiler) and ninja (a dependency): no kernel is a failure
    assert kernel.available(), "the statistics' tile kernel did not build"
needs_kernel = pytest.mark.skipif(not kernel.available(), reason="the tile kernel cannot be built here")


def _stats(q: torch.Tensor, k: torch.Tensor, causal: bool, topk: int, scale: float) -> stats.AttentionStats:
    """The statistics of ``q``, ``k`` through the tiled path, the forward's log-sum-exp given."""
    _, lse = FLASH(q, k, k, 0.0, causal, scale=scale)[:2]  # (B, H, Lq)
    parts = stats.parts(q, k, is_causal=causal, scale=scale)[0]._replace(lse=lse)
    assert tiled.supports(parts)
    return stats.compute(parts, topk)


def _ordered(order: str, L: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One head whose scores follow ``order`` along the keys, the same for every row: ``q (1, 1, L, 1)`` of ones,
    ``k (1, 1, L, 1)`` the scores."""
    j = torch.arange(L, dtype=torch.float32)
    scores = {
        "rising": j * 0.01,  # a head reading its neighbours: each tile's keys beat the row's k-th so far
        "falling": -j * 0.01,  # a sink-like head: the first keys hold the top
        "ties": torch.zeros(L),  # every weight equal
        "steps": (j // 7) % 3,  # runs of ties at three levels
        "random": torch.randn(L, generator=torch.Generator().manual_seed(1)) * 3,
    }[order]
    return torch.ones(1, 1, L, 1), scores.view(1, 1, L, 1)


@needs_kernel
@pytest.mark.parametrize("order", ["rising", "falling", "ties", "steps", "random"])
@pytest.mark.parametrize("topk", [1, 5, 40])
@pytest.mark.parametrize("causal", [True, False])
def test_top_k_over_tiles_in_every_order_equals_the_float64_weights(monkeypatch, order, topk, causal):
    """Scores rising, falling, tied or random along 700 keys, in tiles of 64 and 1,024 (one): each row's top-k (k
    from 1 to more than a causal row's first keys), entropy, sums and distances as the float64 weights give them."""
    q, k = _ordered(order, 700)
    for width in (64, 1024):
        monkeypatch.setattr(tiled, "TILE", width)
        assert_stats(_stats(q, k, causal, topk, 1.0), weights64(q, k, causal, 1.0))


def _tile_sums(t: torch.Tensor, causal: bool, real: int, topk: int = 3):
    """The kernel's results for one tile of scores ``t (r, w)``, rows at positions 10..10+r, keys from 0."""
    r, w = t.shape
    qpos = torch.arange(10, 10 + r)
    shift = torch.full((r,), -5.0)
    sums = torch.zeros(4, r, dtype=torch.float64)
    column = torch.zeros(1, w)
    top = (torch.full((r, topk), float("-inf")), torch.zeros(r, topk), torch.full((r, topk), -1, dtype=torch.long))
    kernel.tile(t, shift, qpos, 0, real, causal, 4, r, sums, column, top)
    return sums, column, top


@needs_kernel
def test_nan_where_no_row_looks_reaches_nothing():
    """NaN in the scores of keys past each causal row's position and past the tile's last key: every result as
    with finite values there."""
    g = torch.Generator().manual_seed(0)
    t = torch.randn(6, 64, generator=g)  # rows at 10..15 see keys 0..10..15; 40 of the 64 exist
    hidden = torch.arange(64)[None, :] > torch.arange(10, 16)[:, None]  # (r, w): past each row
    hidden[:, 40:] = True
    for causal, real in ((True, 40), (False, 40)):
        unseen = hidden if causal else hidden & (torch.arange(64) >= 40)
        clean = _tile_sums(t.masked_fill(unseen, 0.0), causal, real)
        dirty = _tile_sums(t.masked_fill(unseen, float("nan")), causal, real)
        for a, b in zip((clean[0], clean[1], *clean[2]), (dirty[0], dirty[1], *dirty[2]), strict=True):
            assert torch.equal(a, b)
        assert torch.isfinite(dirty[0]).all()


@needs_kernel
def test_threads_give_the_same_statistics():
    """One thread and two, and two again: the same bits (a tile's rows are split into a fixed number of parts, each
    part's column sums added in part order), and the float64 weights' statistics."""
    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(1, 2, 600, 16, generator=g), torch.randn(1, 2, 600, 16, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _stats(q, k, True, 6, 0.25)
        torch.set_num_threads(2)
        two, again = _stats(q, k, True, 6, 0.25), _stats(q, k, True, 6, 0.25)
    finally:
        torch.set_num_threads(threads)
    for name in ("topk_values", "topk_indices", "entropy", "column_sum", "distance", "sink_mass"):
        assert torch.equal(getattr(one, name), getattr(two, name)), name  # the rows' parts do not follow threads
        assert torch.equal(getattr(two, name), getattr(again, name)), name
    assert_stats(two, weights64(q, k, True, 0.25))


def test_a_kernel_that_cannot_be_built_says_so_once_and_the_torch_ops_give_the_same(monkeypatch):
    """The loader raising (no compiler): one RuntimeWarning naming the error, then the torch ops' statistics, equal
    to the float64 weights'; ATTNKIT_STATS_KERNEL=0: no build tried, no warning."""
    from torch.utils import cpp_extension

    def fail(*args, **kwargs):
        raise RuntimeError("no compiler here\nmore lines")

    monkeypatch.delenv("ATTNKIT_STATS_KERNEL", raising=False)
    monkeypatch.setattr(csrc, "_LOADED", {})
    monkeypatch.setattr(cpp_extension, "load", fail)
    monkeypatch.setattr(tiled, "MIN_KEYS", 1)  # the tiled path's torch ops, not the whole-row path
    used = []
    original = tiled._rows
    monkeypatch.setattr(tiled, "_rows", lambda *a: (used.append(1), original(*a))[1])
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(1, 2, 50, 8, generator=g), torch.randn(1, 2, 50, 8, generator=g)
    with pytest.warns(RuntimeWarning, match="could not be built .RuntimeError: no compiler here.") as caught:
        found = _stats(q, k, True, 3, 0.3)
        _stats(q, k, True, 3, 0.3)
    assert len([w for w in caught if "could not be built" in str(w.message)]) == 1
    assert used and not kernel.available()
    assert_stats(found, weights64(q, k, True, 0.3))
    monkeypatch.setattr(csrc, "_LOADED", {})
    monkeypatch.setenv("ATTNKIT_STATS_KERNEL", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not kernel.available()
    assert csrc._LOADED == {}


def test_a_lock_left_by_a_build_that_died_is_removed_and_the_build_goes_on(tmp_path, monkeypatch):
    """A build interrupted leaves PyTorch's loader's lock file, and the loader would wait for it forever: under
    attnkit's own flock it is removed before the loader runs, in attnkit's own directory, with the ninja installed
    beside attnkit first on PATH (the loader itself is not run again: its op is registered once a process)."""
    import ninja
    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.delenv("ATTNKIT_STATS_KERNEL", raising=False)
    monkeypatch.setattr(csrc, "_LOADED", {})
    monkeypatch.setattr(csrc, "prebuilt", lambda name: None)
    directory = csrc.build_directory("stats")
    assert tmp_path in directory.parents and directory.name.startswith("attnkit-stats-")
    directory.mkdir(parents=True)
    (directory / "lock").touch()
    seen = {}

    def load(name, sources, **kwargs):
        seen.update(kwargs, lock=(directory / "lock").exists(), path=os.environ["PATH"].split(os.pathsep)[0])

    monkeypatch.setattr(cpp_extension, "load", load)
    path = os.environ["PATH"]
    assert kernel.available()
    assert seen["build_directory"] == str(directory) and not seen["lock"] and seen["path"] == ninja.BIN_DIR
    assert os.environ["PATH"] == path  # as it was, after the build


@needs_kernel
def test_a_kernel_that_fails_as_it_runs_says_so_once_and_the_torch_ops_take_the_call(monkeypatch):
    """The kernel raising at its first tile (an OpenMP runtime unlike the one it was built for): one RuntimeWarning,
    the call's statistics from the torch ops, none of the kernel's partial sums left in them."""
    monkeypatch.setattr(csrc, "_LOADED", {"stats": None})
    calls = []

    def tile(*args):
        calls.append(1)
        raise RuntimeError("a thread past at::get_num_threads()")

    monkeypatch.setattr(kernel, "tile", tile)
    g = torch.Generator().manual_seed(6)
    q, k = torch.randn(1, 2, 80, 8, generator=g), torch.randn(1, 2, 80, 8, generator=g)
    with pytest.warns(RuntimeWarning, match="kernel failed .RuntimeError: a thread past"):
        found = _stats(q, k, False, 4, 0.3)
    assert calls == [1] and not kernel.available()
    assert_stats(found, weights64(q, k, False, 0.3))
