"""Pictures: files of the right type and size, read back; padding greyed out; no partial file on failure."""

from __future__ import annotations

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
