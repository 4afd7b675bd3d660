"""Pictures: files of the right type and size, read back; padding greyed out; no partial file on failure."""

from __future__ import annotations

import tempfile
import time
import warnings

import matplotlib.image
import pytest
import torch

from attnkit.tools import plot


def test_show_heatmaps_png_has_the_expected_pixel_size(tmp_path):
    w = torch.softmax(torch.randn(2, 3, 5, 7), -1)
    path = tmp_path / "grid.png"
    plot.show_heatmaps(w, "Keys", "Queries", titles=["a", "b", "c"], path=path)  # figsize per panel
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
    plot.show_heatmaps(torch.rand(side, side, 3, 3), "keys", "queries", path=tmp_path / "grid.png")
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
    assert "averaged for display: 1000 x 300 -> 256 x 256 cells" in " ".join(fig.get_suptitle().split())
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


@pytest.mark.parametrize("figsize", [(0, 0), (-1, 2), (float("nan"), 1), (1, float("inf"))])
def test_figsize_must_be_two_positive_finite_numbers(figsize):
    with pytest.raises(ValueError, match=r"figsize must be two positive finite numbers"):
        plot.show_heatmaps(torch.rand(2, 2), "keys", "queries", figsize=figsize)


@pytest.mark.parametrize("figsize", [("wide", 1), 3, (1, 2, 3)])
def test_figsize_that_is_not_two_numbers_is_a_type_error(figsize):
    with pytest.raises(TypeError, match=r"figsize must be two numbers"):
        plot.show_heatmaps(torch.rand(2, 2), "keys", "queries", figsize=figsize)


@pytest.mark.parametrize(("shape", "figsize"), [((8, 8, 3, 3), (40, 40)), ((1, 1, 3, 3), (200, 200))])
def test_large_figsizes_are_shrunk_to_the_largest_figure(shape, figsize):
    fig = plot.show_heatmaps(torch.rand(shape), "keys", "queries", figsize=figsize)
    assert tuple(fig.get_size_inches()) == (plot.MAX_INCHES, plot.MAX_INCHES)  # 4000 px, not 32000 or 20000


def test_long_labels_are_cut_for_display_and_draw_quickly():
    start = time.perf_counter()
    labels = ["x" * 5000] * 64
    fig = plot.plot_attention(torch.rand(64, 64), key_labels=labels, query_labels=labels)
    fig.canvas.draw()
    assert time.perf_counter() - start < 20  # 47 s before labels were cut
    shown = [t.get_text() for t in fig.axes[0].get_xticklabels() + fig.axes[0].get_yticklabels()]
    assert shown and all(t == "x" * (plot.MAX_LABEL - 1) + "\u2026" for t in shown)
    assert all(side <= plot.MAX_INCHES for side in fig.get_size_inches())


def test_labels_are_converted_with_str():
    fig = plot.plot_attention(torch.rand(2, 3), key_labels=[1, 2, 3], query_labels=(None, 2.5))
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["1", "2", "3"]
    assert [t.get_text() for t in fig.axes[0].get_yticklabels()] == ["None", "2.5"]
    with pytest.raises(TypeError, match="key_labels must be a sequence"):
        plot.plot_attention(torch.rand(2, 3), key_labels=3)


def test_heads_must_be_whole_numbers_in_range():
    w = torch.rand(4, 3, 3)
    for heads in ([0.5], [True], ["1"], 2):
        with pytest.raises(TypeError, match="heads"):
            plot.plot_attention(w, heads=heads)
    with pytest.raises(ValueError, match="heads: head 4 does not exist; the weights have 4 heads"):
        plot.plot_attention(w, heads=[4])
    with pytest.raises(ValueError, match="heads: head -1 does not exist"):
        plot.plot_attention(w, heads=[-1])
    import numpy as np

    fig = plot.plot_attention(w, heads=[np.int64(1), torch.tensor(3)])
    assert [ax.get_title() for ax in fig.axes if ax.images] == ["head 1", "head 3"]


def test_averaging_entries_near_the_float32_limit_does_not_overflow():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's "overflow encountered in reduceat"
        fig = plot.show_heatmaps(torch.full((1, 1, 300, 300), 3e38), "keys", "queries")
    shown = fig.axes[0].images[0].get_array()
    assert shown.shape == (plot.MAX_CELLS, plot.MAX_CELLS)
    assert not shown.mask.any() and float(shown.min()) == pytest.approx(3e38, rel=1e-6)  # no blank stripes


@pytest.mark.parametrize("draw", ["show_heatmaps", "plot_attention"])
def test_the_averaging_note_fits_in_the_figure(draw):
    w = torch.rand(1000, 300)
    fig = plot.show_heatmaps(w, "keys", "queries") if draw == "show_heatmaps" else plot.plot_attention(w)
    fig.canvas.draw()
    box = fig._suptitle.get_window_extent()
    assert 0 <= box.x0 and box.x1 <= fig.bbox.width and box.y1 <= fig.bbox.height


def test_saving_into_a_missing_folder_names_the_users_path(tmp_path):
    fig = plot.plot_attention(torch.rand(3, 4))
    target = tmp_path / "missing" / "x.png"
    with pytest.raises(FileNotFoundError, match=r"cannot write .*missing/x\.png.*does not exist") as caught:
        plot.save_figure(fig, target)
    assert ".part" not in str(caught.value)
    assert list(tmp_path.iterdir()) == []


def test_a_target_name_at_the_length_limit_saves(tmp_path, monkeypatch):
    names = []
    real = tempfile.mkstemp

    def spy(*args, **kwargs):
        fd, name = real(*args, **kwargs)
        names.append(name)
        return fd, name

    monkeypatch.setattr(tempfile, "mkstemp", spy)  # the module attnkit.tools.files writes through
    target = tmp_path / ("a" * 251 + ".png")  # 255 bytes, the usual limit of a name
    plot.save_figure(plot.plot_attention(torch.rand(3, 4)), target)
    assert [p.name for p in tmp_path.iterdir()] == [target.name]
    temporary = plot.Path(names[0]).name
    assert temporary.startswith(".") and temporary.endswith(".png") and len(temporary) < 20


# Figures of the configurations people draw: heads in one row and in two, a long title, token labels on the axes,
# a colour bar, the averaging note, and show_heatmaps' grids (the book's 7 x 3.5 inch one among them).
_TOKENS = ["<bos>", "the", "attention", "weights", "sum", "to", "one", "<eos>"]
_FIGURES = {
    "1 head, long title": lambda path: plot.plot_attention(
        torch.softmax(torch.randn(3, 4), -1), title="encoder layer 2, the first batch element's weights", path=path
    ),
    "1 head, long tokens": lambda path: plot.plot_attention(
        torch.softmax(torch.randn(3, 2), -1), query_labels=["q" * 40] * 3, key_labels=["k" * 40] * 2, path=path
    ),
    "4 heads": lambda path: plot.plot_attention(torch.softmax(torch.randn(4, 3, 4), -1), path=path),
    "8 heads": lambda path: plot.plot_attention(torch.softmax(torch.randn(8, 3, 4), -1), path=path),
    "8 heads, tokens, title": lambda path: plot.plot_attention(
        torch.softmax(torch.randn(8, 8, 8), -1),
        query_labels=_TOKENS,
        key_labels=_TOKENS,
        title="a title longer than any panel " * 6,
        path=path,
    ),
    "16 heads, tokens": lambda path: plot.plot_attention(
        torch.softmax(torch.randn(16, 8, 8), -1), query_labels=_TOKENS, key_labels=_TOKENS, path=path
    ),
    "16 heads, 20 positions": lambda path: plot.plot_attention(torch.softmax(torch.randn(16, 20, 20), -1), path=path),
    "averaged": lambda path: plot.plot_attention(torch.rand(2, 1000, 300), title="layer 0", path=path),
    "heatmap": lambda path: plot.show_heatmaps(torch.rand(1, 1, 3, 5), "Keys", "Queries", path=path),
    "heatmaps, the book's grid": lambda path: plot.show_heatmaps(
        torch.rand(4, 4, 3, 5),
        "Keys",
        "Queries",
        titles=[f"Head {i}" for i in range(1, 5)],
        figsize=(1.75, 0.875),
        path=path,
    ),
    "heatmaps, wide letters": lambda path: plot.show_heatmaps(
        torch.rand(1, 3, 4, 4), "keys", "queries", titles=["W" * 40] * 3, title="MW" * 40, path=path
    ),
    "heatmaps, long titles": lambda path: plot.show_heatmaps(
        torch.rand(2, 3, 5, 7),
        "Key positions",
        "Query positions",
        titles=[f"a column title as long as allowed {i}" for i in range(3)],
        title="x" * 150,
        path=path,
    ),
}


@pytest.fixture
def drawn_texts(monkeypatch):
    """Every non-empty visible text drawn from now on: (text, window extent, (width, height) of its canvas).

    Recorded as drawn, so tick labels that matplotlib keeps but does not draw (ticks outside the view) are left out,
    and a text drawn into a saved file is measured against that file's canvas.
    """
    import matplotlib.text

    drawn = []
    draw = matplotlib.text.Text.draw

    def recording(self, renderer):
        draw(self, renderer)
        if self.get_visible() and self.get_text():
            drawn.append((self.get_text(), self.get_window_extent(renderer), (renderer.width, renderer.height)))

    monkeypatch.setattr(matplotlib.text.Text, "draw", recording)
    return drawn


def _cut_off(drawn):
    """The texts of ``drawn`` that reach past the edge of their canvas (by more than half a pixel)."""
    return [
        (text[:30], [round(v) for v in box.extents], canvas)
        for text, box, canvas in drawn
        if box.x0 < -0.5 or box.y0 < -0.5 or box.x1 > canvas[0] + 0.5 or box.y1 > canvas[1] + 0.5
    ]


@pytest.mark.parametrize("name", _FIGURES)
def test_every_text_is_inside_the_figure_on_screen(name, drawn_texts):
    import matplotlib.pyplot as plt

    fig = _FIGURES[name](None)
    try:
        for _ in range(2):  # a window draws again (resized, zoomed): the layout must hold on every draw
            drawn_texts.clear()
            fig.canvas.draw()
            assert drawn_texts, "nothing drawn"
            on_screen = [(text, box, (fig.bbox.width, fig.bbox.height)) for text, box, _ in drawn_texts]
            assert _cut_off(on_screen) == []
    finally:
        plt.close(fig)


@pytest.mark.parametrize("name", _FIGURES)
def test_every_text_is_inside_the_saved_picture(name, drawn_texts, tmp_path):
    path = tmp_path / "heads.png"
    _FIGURES[name](path)  # the user's way: path= on the call, so saving is the figure's first draw
    height, width = matplotlib.image.imread(path).shape[:2]
    assert drawn_texts, "nothing drawn"
    assert {c for _, _, c in drawn_texts} == {(width, height)}  # measured on the canvas that was written
    assert _cut_off(drawn_texts) == []


def _colour_at(fig, ax, row, col):
    """The RGB colour drawn at the centre of cell (row, col) of ``ax``'s heatmap, read from the rendered canvas."""
    import numpy as np

    fig.canvas.draw()
    pixels = np.asarray(fig.canvas.buffer_rgba())  # (height, width, 4), the top row first
    x, y = ax.transData.transform((col, row))  # pixels from the bottom left
    return tuple(int(c) for c in pixels[pixels.shape[0] - 1 - int(y), int(x), :3])


def test_padding_is_drawn_the_same_in_both_functions_and_unlike_a_small_weight():
    import matplotlib.pyplot as plt

    w = torch.zeros(1, 4, 6)
    w[0, :, :4] = torch.tensor([0.01, 0.33, 0.33, 0.33])  # keys 4 and 5 are padding; key 0 gets a small weight
    colours = {}
    for draw in ("show_heatmaps", "plot_attention"):
        fig = plot.show_heatmaps(w, "keys", "queries") if draw == "show_heatmaps" else plot.plot_attention(w)
        ax = next(ax for ax in fig.axes if ax.images)
        colours[draw] = _colour_at(fig, ax, 1, 5), _colour_at(fig, ax, 1, 0)  # (padding, small weight)
        plt.close(fig)
    assert colours["show_heatmaps"][0] == colours["plot_attention"][0]
    for padding, small in colours.values():
        assert max(abs(a - b) for a, b in zip(padding, small, strict=True)) > 20  # tells apart at a glance (of 255)


@pytest.mark.parametrize(
    ("shape", "titles", "figsize"),
    [
        ((2, 3, 5, 7), list("abc"), (2.5, 2.5)),  # panels wider than tall, the default figsize
        ((2, 4, 10, 10), [f"Head {i}" for i in range(1, 5)], (1.75, 1.75)),  # the book's (7, 3.5) for 2 x 4 heads
        ((3, 2, 4, 9), None, (2.5, 2.5)),
    ],
)
def test_show_heatmaps_rows_are_close_together(shape, titles, figsize):
    import matplotlib.pyplot as plt

    fig = plot.show_heatmaps(torch.rand(shape), "Keys", "Queries", titles=titles, figsize=figsize)
    try:
        fig.canvas.draw()  # the layout is made on drawing
        panels = [ax for ax in fig.axes if ax.images]
        cols = shape[1]
        for upper, lower in zip(panels[:-cols], panels[cols:], strict=True):
            top, below = upper.get_position(), lower.get_position()  # figure fractions, as drawn
            gap = top.y0 - below.y1
            assert 0 <= gap < 0.2 * top.height, (gap * fig.get_figheight(), top.height * fig.get_figheight())
    finally:
        plt.close(fig)


def test_each_panel_takes_its_own_title_and_wrong_titles_are_named():
    w = torch.softmax(torch.randn(3, 4, 4), -1)
    fig = plot.plot_attention(w, heads=[2, 0], head_titles=["sink: layer 2", "previous token: layer 0"])
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert titles == ["sink: layer 2", "previous token: layer 0"]
    one = plot.plot_attention(w[0], title="the figure", head_titles=["the only head"])  # (Lq, Lk): named too
    assert [ax.get_title() for ax in one.axes if ax.get_title()] == ["the only head"]
    assert one._suptitle is not None and one._suptitle.get_text() == "the figure"  # the figure keeps its title
    for figure in (fig, one):
        plot._pyplot().close(figure)
    with pytest.raises(ValueError, match="head_titles has 1 titles for 2 panels"):
        plot.plot_attention(w, heads=[2, 0], head_titles=["one"])
    for wrong in ("abc", [None, None, None], (["a"], "b", "c")):
        with pytest.raises(TypeError, match="head_titles must be a list or tuple of strings"):
            plot.plot_attention(w, head_titles=wrong)
