"""Pictures: files of the right type and size, read back; padding greyed out; no partial file on failure."""

from __future__ import annotations

import time

import matplotlib.image
import pytest
import torch

from attnkit import d2l, plot


def test_show_heatmaps_png_has_the_expected_pixel_size(tmp_path):
    w = torch.softmax(torch.randn(2, 3, 5, 7), -1)
    path = tmp_path / "grid.png"
    d2l.show_heatmaps(w, "Keys", "Queries", titles=["a", "b", "c"], path=path)
    image = matplotlib.image.imread(path)
    assert image.shape[:2] == (2 * 250, 3 * 250)  # rows x 2.5 in, cols x 2.5 in, at 100 dpi
    assert image[..., :3].std() > 0.05  # not blank


@pytest.mark.parametrize(("suffix", "magic"), [(".svg", b"<?xml"), (".pdf", b"%PDF")])
def test_the_file_type_follows_the_extension(tmp_path, suffix, magic):
    path = tmp_path / f"weights{suffix}"
    plot.plot_attention(torch.softmax(torch.randn(2, 3, 4), -1), path=path)
    assert path.read_bytes().startswith(magic)


def test_plot_attention_greys_out_padding():
    w = torch.softmax(torch.randn(2, 4, 6), -1)
    w[..., 4:] = 0  # keys past valid_lens
    fig = plot.plot_attention(w, query_labels=list("abcd"), key_labels=list("uvwxyz"))
    shown = fig.axes[0].images[0].get_array()
    assert shown.mask[:, 4:].all() and not shown.mask[:, :4].any()
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == list("uvwxyz")
    assert len([ax for ax in fig.axes if ax.images]) == 2


def test_a_failed_write_leaves_no_partial_file(tmp_path, monkeypatch):
    fig = plot.plot_attention(torch.softmax(torch.randn(3, 4), -1))
    target = tmp_path / "out.png"

    def broken(file, **kwargs):
        file.write(b"\x89PNG half a picture")
        raise OSError("disk full")

    monkeypatch.setattr(fig, "savefig", broken)
    with pytest.raises(OSError, match="disk full"):
        plot.save_figure(fig, target)
    assert list(tmp_path.iterdir()) == []


def test_bad_paths_and_shapes_raise_clear_errors(tmp_path):
    w = torch.softmax(torch.randn(3, 4), -1)
    with pytest.raises(ValueError, match="extension must be one of"):
        plot.plot_attention(w, path=tmp_path / "out.docx")
    with pytest.raises(FileNotFoundError):
        plot.plot_attention(w, path=tmp_path / "missing" / "out.png")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match=r"key_labels has 2 labels but the weights have 4"):
        plot.plot_attention(w, key_labels=["a", "b"])
    with pytest.raises(ValueError, match=r"matrices must be \(rows, cols, Lq, Lk\)"):
        plot.show_heatmaps(torch.ones(1, 1, 1, 2, 2), "x", "y")


def test_written_files_get_the_usual_permissions(tmp_path):
    import os

    path = tmp_path / "w.png"
    plot.plot_attention(torch.softmax(torch.randn(3, 4), -1), path=path)
    reference = tmp_path / "plain"
    reference.write_text("")
    assert os.stat(path).st_mode & 0o777 == os.stat(reference).st_mode & 0o777


def test_more_panels_than_one_figure_takes_is_refused_before_drawing():
    start = time.perf_counter()
    with pytest.raises(ValueError, match=r"matrices \(30, 30, 2, 2\) would be drawn as 900 panels.*matrices\[:8, :8\]"):
        plot.show_heatmaps(torch.rand(30, 30, 2, 2), "keys", "queries")
    with pytest.raises(ValueError, match=r"weights \(100, 3, 3\) would be drawn as 100 panels.*heads="):
        plot.plot_attention(torch.rand(100, 3, 3))
    assert time.perf_counter() - start < 5  # refused, not drawn (900 panels took more than 4 minutes)
    fig = plot.plot_attention(torch.rand(100, 3, 3), heads=range(8))  # choosing heads is the way
    assert len([ax for ax in fig.axes if ax.images]) == 8


def test_the_largest_grid_draws(tmp_path):
    side = int(plot.MAX_PANELS**0.5)
    d2l.show_heatmaps(torch.rand(side, side, 3, 3), "keys", "queries", path=tmp_path / "grid.png")
    assert matplotlib.image.imread(tmp_path / "grid.png").shape[:2] == (side * 250, side * 250)


@pytest.mark.parametrize("draw", ["show_heatmaps", "plot_attention"])
def test_long_sides_are_averaged_for_display_and_the_title_says_so(draw):
    w = torch.rand(2, 1000, 300)
    w[:, :, 280:] = 0  # padding keys
    fig = plot.show_heatmaps(w, "keys", "queries") if draw == "show_heatmaps" else plot.plot_attention(w)
    image = fig.axes[0].images[0]
    shown = image.get_array()
    assert shown.shape == (plot.MAX_CELLS, plot.MAX_CELLS)
    assert image.get_extent() == [-0.5, 299.5, 999.5, -0.5]  # the axes keep the positions of the weights
    assert "averaged for display: 1000 x 300 -> 256 x 256 cells" in fig.get_suptitle()
    q_end, k_end = round(1000 / 256), round(300 / 256)  # the first bins: 1000 queries and 300 keys in 256 each
    first = w[0, :q_end, :k_end].mean()
    assert abs(float(shown[0, 0]) - float(first)) < 1e-6
    largest = max(float(ax.images[0].get_array().max()) for ax in fig.axes if ax.images)
    assert image.norm.vmax == pytest.approx(largest)  # the colours span what is shown, not the peaks averaged away
    if draw == "plot_attention":
        assert shown.mask[:, -1].all() and not shown.mask[:, :200].any()  # bins of padding only: grey


def test_nan_and_infinite_entries_are_left_out_of_the_colour_scale():
    w = torch.softmax(torch.randn(3, 4), -1)
    w[0, 0], w[1, 1], w[2, 2] = float("nan"), float("inf"), -float("inf")
    for fig in (plot.plot_attention(w), plot.show_heatmaps(w, "keys", "queries")):
        image = fig.axes[0].images[0]
        shown = image.get_array()
        assert shown.mask[0, 0] and shown.mask[1, 1] and shown.mask[2, 2]  # drawn in the "bad" colour
        finite = w[w.isfinite()]
        assert image.norm.vmax == pytest.approx(float(finite.max()))
    with pytest.raises(ValueError, match=r"weights has no finite entry to draw \(all NaN or infinite\)"):
        plot.plot_attention(torch.full((2, 3), float("nan")))
    with pytest.raises(ValueError, match="matrices has no finite entry to draw"):
        plot.show_heatmaps(torch.full((1, 1, 2, 3), float("inf")), "keys", "queries")


def test_heads_wrap_eight_to_a_row_with_labels_on_the_outer_panels():
    fig = plot.plot_attention(torch.softmax(torch.randn(10, 3, 5), -1))
    panels = [ax for ax in fig.axes if ax.images]
    assert len(panels) == 10
    rows = sorted({round(ax.get_position().y0, 3) for ax in panels})
    assert len(rows) == 2
    assert sum(ax.get_ylabel() == "queries" for ax in panels) == 2  # one per row
    assert [ax.get_xlabel() for ax in panels] == [""] * 2 + ["keys"] * 8  # the bottom of each column


def test_show_heatmaps_takes_a_figure_title():
    fig = plot.show_heatmaps(torch.rand(2, 3, 4), "keys", "queries", title="layer 1")
    assert fig.get_suptitle() == "layer 1"
