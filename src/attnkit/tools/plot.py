"""Pictures of attention weights (matplotlib, headless; in a checkout: ``pip install -e '.[plot]'``).

The file type follows the extension (``.png``, ``.svg``, ``.pdf``, anything matplotlib writes). A figure is
written to a temporary file beside the target and renamed into place, so a failed write never leaves a
partial file behind.

The work is bounded, so that a picture of any tensor takes seconds: at most ``MAX_PANELS`` panels per
figure (matplotlib's time grows faster than the number of panels: on this project's 2-core machine an 8 x 8 grid
takes 3.5 s, a 16 x 16 one took over a minute, and 30 x 30 did not finish in 4 minutes), and at most
``MAX_CELLS`` cells along each side of a panel (a longer side is averaged in equal bins, which a screen
would do anyway, and the figure's title says so). NaN and infinite entries are drawn in the "bad" colour and
left out of the colour scale. The options are bounded too: a figure is kept within ``MAX_INCHES`` inches each
way (a larger ``figsize`` is shrunk to fit), and tick labels and titles are cut to ``MAX_LABEL`` characters
(with an ellipsis) for display.

Panels are laid out by matplotlib's ``"compressed"`` layout, the constrained layout for panels of a fixed aspect
(square cells): it packs them and keeps every text inside the figure, on screen and in a saved file, which has the
figure's size (plain ``"constrained"`` left wide gaps between rows and, on some draws, cut titles and labels at the
edge). It cannot make a text narrower than the figure, so titles are wrapped to the width they have and
plot_attention's figure leaves room for its token labels. Padding (a key column or query row of exactly zero
weight), NaN and infinities are grey in both functions: a map's own lowest colour (near white in ``"Reds"``)
cannot be told from a small weight.

For an interactive page instead of a picture (head view, model view and matrix view in one self-contained HTML
file), see :func:`view`, from :mod:`attnkit.tools.viewer`.
"""

from __future__ import annotations

import math
import operator
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from attnkit._atomic import write_atomically
from attnkit.tools.text_fit import SLACK as _SLACK
from attnkit.tools.text_fit import fill as _fill
from attnkit.tools.text_fit import inches as _inches
from attnkit.tools.viewer import AttentionView, view

__all__ = [
    "MAX_CELLS",
    "MAX_INCHES",
    "MAX_LABEL",
    "MAX_PANELS",
    "AttentionView",
    "plot_attention",
    "save_figure",
    "show_heatmaps",
    "view",
]

# Lq/Lk query/key length, H heads, rows/cols of a grid of heatmaps

MAX_PANELS = 64  # panels (heatmaps) in one figure; more is refused with a ValueError that says how to choose
MAX_CELLS = 256  # cells along each side of a panel; a longer side is averaged into this many bins
_TICK_EACH = 64  # plot_attention labels every position of a side up to this length (then automatic ticks)
_CELL = 0.32  # inches per position in plot_attention, when every position is labelled
MAX_INCHES = 40.0  # a figure is kept within this, each way (4000 px at 100 dpi): larger figsizes are shrunk to it
MAX_LABEL = 40  # characters of a tick label or panel title shown; a longer one is cut, ending in an ellipsis
_MAX_PIXELS = 16000  # save_figure refuses a dpi that would make a side longer than this
_MIN_INCHES = 1.0  # a figure is at least this, each way (smaller leaves no room for a panel)
_WRAP = 8  # plot_attention puts at most this many heads in one row
_PADDING = "#d9d9d9"  # padding, NaN and infinities: a grey outside the usual colour maps, unlike a small weight


def _pyplot() -> Any:
    # matplotlib picks a headless backend (Agg) by itself when there is no display; notebooks keep theirs.
    import matplotlib.pyplot as plt

    return plt


def show_heatmaps(
    matrices: Any,
    xlabel: str,
    ylabel: str,
    titles: Sequence[str] | None = None,
    figsize: tuple[float, float] = (2.5, 2.5),
    cmap: str = "Reds",
    path: str | os.PathLike[str] | None = None,
    *,
    title: str | None = None,
) -> Any:
    """The book's ``show_heatmaps``: a grid of heatmaps with one shared colour bar, padding greyed out.

    Args:
        matrices: ``(rows, cols, Lq, Lk)`` tensor or array (2-D and 3-D are taken as one row); at most
            ``MAX_PANELS`` panels, ``rows * cols``. Sides longer than ``MAX_CELLS`` are averaged in bins
            for display; the axes keep the original positions and the figure's title says so.
        xlabel, ylabel: axis labels (on the bottom row and left column).
        titles: one per column, above the top row (converted with ``str``, cut to ``MAX_LABEL`` characters,
            wrapped to the column's width).
        figsize: size of each panel, in inches, two positive numbers (the book's value is per figure); the
            whole figure is kept within ``MAX_INCHES`` each way (a larger one is shrunk to fit).
        cmap: matplotlib colour map.
        path: where to save (type from the extension); ``None`` to only return the figure.
        title: a title for the whole figure.

    Returns:
        The matplotlib ``Figure``.

    Raises:
        ValueError: for ``matrices`` with fewer than 2 or more than 4 dims, more than ``MAX_PANELS`` panels,
            no finite entry, fewer ``titles`` than columns, a ``figsize`` that is not two positive finite
            numbers, or a bad extension.
        TypeError: for a ``figsize`` that is not two numbers.
    """
    panel_w, panel_h = _figsize(figsize)
    m = _as_array(matrices, "matrices")
    if m.ndim not in (2, 3, 4):
        raise ValueError(f"matrices must be (rows, cols, Lq, Lk), (cols, Lq, Lk) or (Lq, Lk), got shape {m.shape}")
    m = m.reshape((1,) * (4 - m.ndim) + m.shape)  # (rows, cols, Lq, Lk)
    rows, cols, Lq, Lk = m.shape
    _check_panels(rows * cols, f"matrices {m.shape}", "select rows and columns first, e.g. matrices[:8, :8]")
    if 0 in m.shape:
        raise ValueError(f"matrices is empty: shape {m.shape}")
    if titles is not None:
        titles = _labels(titles, "titles")
        if len(titles) < cols:
            raise ValueError(f"titles has {len(titles)} titles but matrices has {cols} columns: matrices {m.shape}")
    _finite_range(m, "matrices")
    shown, note = _shrink(m)  # (rows, cols, <=MAX_CELLS, <=MAX_CELLS)
    vmin, vmax = _finite_range(shown, "matrices", fallback=(0.0, 1.0))  # the colours span what is shown
    shown = _hide_padding(m, shown)  # (rows, cols, <=MAX_CELLS, <=MAX_CELLS), masked
    plt = _pyplot()
    width, height = _bounded(panel_w * cols, panel_h * rows)
    fig, axes = plt.subplots(rows, cols, figsize=(width, height), squeeze=False, layout="compressed")
    colours = _colours(cmap)
    extent = (-0.5, Lk - 0.5, Lq - 0.5, -0.5)  # axes in the original positions, also when averaged
    image = None
    for i in range(rows):
        for j in range(cols):
            ax = axes[i, j]
            image = ax.imshow(shown[i, j], cmap=colours, vmin=vmin, vmax=vmax, extent=extent, interpolation="nearest")
            # every panel spans the same extent, so tick labels on the outer panels only; sharex/sharey would do
            # the same but pass every change of limits to every sibling (8 x 8 panels: 4.3 s with them, 3.5 s
            # without, median of 3 on this project's 2-core machine)
            ax.tick_params(labelbottom=i == rows - 1, labelleft=j == 0)
            if i == rows - 1:
                ax.set_xlabel(xlabel)
            if j == 0:
                ax.set_ylabel(ylabel)
            if titles and i == 0:  # a column's title above the column (the book repeats it on every row)
                _title(ax, titles[j], width / cols)
    fig.colorbar(image, ax=axes, shrink=0.6)
    _suptitle(fig, title, note)
    if path is not None:
        save_figure(fig, path)
    return fig


def plot_attention(
    weights: Any,
    query_labels: Sequence[str] | None = None,
    key_labels: Sequence[str] | None = None,
    heads: Sequence[int] | None = None,
    path: str | os.PathLike[str] | None = None,
    *,
    title: str | None = None,
    xlabel: str = "keys",
    ylabel: str = "queries",
    cmap: str = "Reds",
    head_titles: Sequence[str] | None = None,
) -> Any:
    """One panel per head, tokens on the axes, padding greyed out.

    Padding is what attnkit gives exactly zero weight: a key column with zero weight from every query (keys past
    ``valid_lens``), and a query row with zero weight on every key (nothing to attend to). Both are drawn grey,
    as are NaN and infinite entries, as in :func:`show_heatmaps`. Heads are laid out 8 to a row. Every position
    gets a tick label up to 64 positions; longer sides get automatic ticks (labelled from ``query_labels``/
    ``key_labels`` when given), and sides longer than ``MAX_CELLS`` are averaged in bins for display (the
    title says so). The figure leaves room for the longest token label.

    Args:
        weights: ``(Lq, Lk)`` or ``(H, Lq, Lk)`` (a leading batch of 1 is dropped).
        query_labels, key_labels: tick labels, ``Lq`` and ``Lk`` of them (converted with ``str``, cut to
            ``MAX_LABEL`` characters for display).
        heads: which heads to draw, whole numbers (all by default); at most ``MAX_PANELS``.
        path: where to save (type from the extension); ``None`` to only return the figure.
        title, xlabel, ylabel, cmap: the figure's title, axis labels and colour map.
        head_titles: a title for each drawn panel, in order (default ``"head h"``).

    Returns:
        The matplotlib ``Figure``.

    Raises:
        ValueError: for weights of another shape, labels of the wrong length, a head that does not exist, more
            than ``MAX_PANELS`` heads, ``head_titles`` not one per panel, no finite entry, or a bad extension.
        TypeError: for labels or ``head_titles`` that are not a sequence, or ``heads`` that are not whole numbers.
    """
    w = _as_array(weights, "weights")
    if w.ndim == 4 and w.shape[0] == 1:
        w = w[0]
    if w.ndim == 2:
        w = w[None]  # (1, Lq, Lk)
    if w.ndim != 3:
        raise ValueError(f"weights must be (Lq, Lk) or (H, Lq, Lk), got shape {w.shape}")
    H, Lq, Lk = w.shape
    if 0 in w.shape:
        raise ValueError(f"weights is empty: shape {w.shape}")
    query_labels = None if query_labels is None else _labels(query_labels, "query_labels")
    key_labels = None if key_labels is None else _labels(key_labels, "key_labels")
    for name, labels, n in (("query_labels", query_labels, Lq), ("key_labels", key_labels, Lk)):
        if labels is not None and len(labels) != n:
            raise ValueError(f"{name} has {len(labels)} labels but the weights have {n}: weights {w.shape}")
    chosen = list(range(H)) if heads is None else _heads(heads, H)
    if not chosen:
        raise ValueError("heads: no head chosen")
    _check_panels(len(chosen), f"weights {w.shape}", "choose some with heads=, e.g. heads=range(8)")
    if head_titles is not None and (
        isinstance(head_titles, (str, bytes))
        or not isinstance(head_titles, Sequence)
        or not all(isinstance(t, str) for t in head_titles)
    ):
        raise TypeError(f"head_titles must be a list or tuple of strings, got {head_titles!r}"[:300])
    names = [f"head {h}" for h in chosen] if head_titles is None else list(head_titles)
    if len(names) != len(chosen):
        raise ValueError(f"head_titles has {len(names)} titles for {len(chosen)} panels")
    w = w[chosen]  # (n, Lq, Lk), n = len(chosen)
    _finite_range(w, "weights")
    shown, note = _shrink(w)  # (n, <=MAX_CELLS, <=MAX_CELLS)
    low, high = _finite_range(shown, "weights", fallback=(0.0, 1.0))  # the colours span what is shown
    shown = _hide_padding(w, shown)  # (n, <=MAX_CELLS, <=MAX_CELLS), masked

    cols = min(len(chosen), _WRAP)
    rows = math.ceil(len(chosen) / cols)
    ticked_q, ticked_k = min(Lq, _TICK_EACH), min(Lk, _TICK_EACH)
    plt = _pyplot()
    rotate = key_labels is not None and max(map(len, key_labels), default=0) > 2
    # room for the tick labels, once: on the left column and the bottom row only (the margins below hold numbers)
    room_w = _inches(query_labels or [], plt.rcParams["ytick.labelsize"])
    room_h = _inches(key_labels or [], plt.rcParams["xtick.labelsize"]) if rotate else 0.0
    cell = min(_CELL, ((MAX_INCHES - room_w) / cols - 1.2) / ticked_k, ((MAX_INCHES - room_h) / rows - 1.0) / ticked_q)
    width, height = _bounded(
        max(2.5, cell * ticked_k + 1.2) * cols + room_w, max(2.2, cell * ticked_q + 1.0) * rows + room_h
    )
    fig, axes = plt.subplots(rows, cols, figsize=(width, height), squeeze=False, layout="compressed")
    colours = _colours(cmap)
    extent = (-0.5, Lk - 0.5, Lq - 0.5, -0.5)  # axes in the original positions, also when averaged
    image = None
    for n, ax in enumerate(axes.flat):
        if n >= len(chosen):
            ax.set_axis_off()
            continue
        image = ax.imshow(
            shown[n], cmap=colours, vmin=min(low, 0.0), vmax=max(high, 1e-12), extent=extent, interpolation="nearest"
        )
        _title(ax, names[n] if H > 1 or head_titles is not None else _cut(title or "attention"), width / cols)
        _ticks(ax.xaxis, Lk, key_labels, each=Lk <= _TICK_EACH and cell >= 0.2)
        _ticks(ax.yaxis, Lq, query_labels, each=Lq <= _TICK_EACH and cell >= 0.2)
        ax.tick_params(axis="x", labelrotation=90 if rotate else 0)
        bottom = n + cols >= len(chosen)  # no panel below this one
        ax.tick_params(labelbottom=bottom, labelleft=n % cols == 0)  # the same positions on every panel
        if bottom:
            ax.set_xlabel(xlabel)
        if n % cols == 0:
            ax.set_ylabel(ylabel)
    _suptitle(fig, title if H > 1 or head_titles is not None else None, note)
    fig.colorbar(image, ax=axes, shrink=0.8)
    if path is not None:
        save_figure(fig, path)
    return fig


def save_figure(fig: Any, path: str | os.PathLike[str], *, dpi: int = 100) -> Path:
    """Write ``fig`` to ``path`` atomically (temporary file, then rename); the type follows the extension.

    The temporary file is a hidden short random name with the target's extension (``.k3v9x_2a.png``), so a
    target name near the file system's limit still fits.

    Raises:
        ValueError: for an extension matplotlib cannot write, or a ``dpi`` that is not positive or would make a
            side of the picture longer than 16000 pixels.
        FileNotFoundError: when the folder does not exist (naming ``path``).
        OSError: when the folder cannot be written (nothing is left behind).
    """
    target = Path(path)
    fmt = target.suffix.lower().lstrip(".")
    supported = fig.canvas.get_supported_filetypes()
    if fmt not in supported:
        raise ValueError(f"cannot write {str(target)!r}: the extension must be one of {', '.join(sorted(supported))}")
    width, height = fig.get_size_inches()
    if not (isinstance(dpi, (int, float)) and not isinstance(dpi, bool) and 0 < dpi < math.inf):
        raise ValueError(f"dpi must be a positive number, got {dpi!r}")
    if max(width, height) * dpi > _MAX_PIXELS:
        raise ValueError(
            f"dpi {dpi} would make a {width:g} x {height:g} inch figure {width * dpi:.0f} x {height * dpi:.0f} "
            f"pixels, more than {_MAX_PIXELS} a side: choose dpi <= {int(_MAX_PIXELS / max(width, height))}"
        )
    try:
        return write_atomically(target, lambda f: fig.savefig(f, format=fmt, dpi=dpi))
    finally:
        _pyplot().close(fig)


def _figsize(figsize: Any) -> tuple[float, float]:
    """``figsize`` as two positive finite floats, or a TypeError/ValueError naming it."""
    try:
        width, height = (float(x) for x in figsize)
    except (TypeError, ValueError) as e:
        raise TypeError(f"figsize must be two numbers (width, height) in inches, got {figsize!r}") from e
    if not (0 < width < math.inf and 0 < height < math.inf):
        raise ValueError(f"figsize must be two positive finite numbers (width, height) in inches, got {figsize!r}")
    return width, height


def _bounded(width: float, height: float) -> tuple[float, float]:
    """A figure's size in inches, kept within ``MAX_INCHES`` (and at least 1 inch) each way."""
    return min(max(width, _MIN_INCHES), MAX_INCHES), min(max(height, _MIN_INCHES), MAX_INCHES)


def _cut(text: str) -> str:
    """``text`` cut to ``MAX_LABEL`` characters, ending in an ellipsis when it was longer."""
    return text if len(text) <= MAX_LABEL else text[: MAX_LABEL - 1] + "\u2026"


def _labels(labels: Any, name: str) -> list[str]:
    """Labels as strings cut for display, or a TypeError naming ``name``."""
    if isinstance(labels, (str, bytes)) or not isinstance(labels, (Sequence, np.ndarray, torch.Tensor)):
        raise TypeError(f"{name} must be a sequence of labels (a list or tuple), got {type(labels).__name__}")
    return [_cut(str(x.item() if isinstance(x, (np.generic, torch.Tensor)) else x)) for x in labels]


def _heads(heads: Any, H: int) -> list[int]:
    """``heads`` as a list of whole numbers in ``range(H)``, or a TypeError/ValueError naming ``heads``."""
    try:
        given = list(heads)
    except TypeError as e:
        raise TypeError(f"heads must be a sequence of head numbers, e.g. heads=range(8), got {heads!r}") from e
    chosen = []
    for h in given:
        try:
            if isinstance(h, (bool, np.bool_)):
                raise TypeError
            chosen.append(operator.index(h))
        except TypeError as e:
            raise TypeError(f"heads must be whole numbers, got {h!r} ({type(h).__name__}) in heads") from e
        if not 0 <= chosen[-1] < H:
            raise ValueError(f"heads: head {chosen[-1]} does not exist; the weights have {H} heads")
    return chosen


def _suptitle(fig: Any, title: str | None, note: str | None) -> None:
    """The figure's title and the averaging note, wrapped to the figure's width (the note in a smaller font)."""
    if not (title or note):
        return
    points = 10 if note else 12  # matplotlib's suptitle is 12 pt ("large")
    inches = _SLACK * fig.get_figwidth()
    fig.suptitle("\n".join(_fill(t, inches, points) for t in (title, note) if t), fontsize=points, wrap=True)


def _title(ax: Any, text: str, inches: float) -> None:
    """A panel's title, wrapped to ``inches`` (its column's width), so that the layout can keep it inside."""
    title = ax.set_title(text, wrap=True)  # wrap=True: matplotlib wraps again at spaces should a line still not fit
    title.set_text(_fill(text, _SLACK * inches, title.get_fontsize()))


def _check_panels(n: int, what: str, fix: str) -> None:
    if n > MAX_PANELS:
        raise ValueError(
            f"{what} would be drawn as {n} panels, more than the {MAX_PANELS} one figure takes "
            f"(matplotlib's time grows faster than the number of panels): {fix}"
        )


def _finite_range(m: np.ndarray, name: str, fallback: tuple[float, float] | None = None) -> tuple[float, float]:
    """The smallest and largest finite entries of ``m``, for the colour scale; ``fallback``, or a ValueError
    naming ``name``, when there is none."""
    finite = np.isfinite(m)
    if not finite.any():
        if fallback is not None:
            return fallback
        raise ValueError(f"{name} has no finite entry to draw (all NaN or infinite): shape {m.shape}")
    return float(m.min(where=finite, initial=np.inf)), float(m.max(where=finite, initial=-np.inf))


def _shrink(m: np.ndarray) -> tuple[np.ndarray, str | None]:
    """``m`` with its last two axes averaged into at most ``MAX_CELLS`` equal bins each, and a note saying so
    (``None`` when nothing was averaged). A bin is NaN when it holds a NaN, as on the screen it stands for."""
    shape = m.shape[-2:]
    for axis in (-2, -1):
        n = m.shape[axis]
        if n > MAX_CELLS:
            edges = np.linspace(0, n, MAX_CELLS + 1).round().astype(np.intp)  # (MAX_CELLS + 1,)
            counts = np.diff(edges).reshape((-1,) + (1,) * (-axis - 1))  # (MAX_CELLS, 1) or (MAX_CELLS,)
            # sums in float64: float32 sums of large entries overflow (3e38 + 3e38) where their mean does not
            sums = np.add.reduceat(m.astype(np.float64), edges[:-1], axis=axis)
            m = (sums / counts).astype(m.dtype)  # that axis: n -> MAX_CELLS
    if m.shape[-2:] == shape:
        return m, None
    return m, f"averaged for display: {shape[0]} x {shape[1]} -> {m.shape[-2]} x {m.shape[-1]} cells"


def _hide_padding(w: np.ndarray, shown: np.ndarray) -> np.ma.MaskedArray:
    """``shown`` (``w`` as :func:`_shrink` gives it) with padding, NaN and infinities masked, to be drawn in the
    "bad" colour (:func:`_colours`).

    Padding is what attnkit gives exactly zero weight: a key column with zero weight from every query (keys past
    ``valid_lens``), and a query row with zero weight on every key (nothing to attend to). An averaged bin is
    padding when all of it is.
    """
    zero = w == 0  # (..., Lq, Lk)
    padding = zero.all(axis=-2, keepdims=True) | zero.all(axis=-1, keepdims=True)  # (..., Lq, Lk)
    hidden = _shrink(padding.astype(np.float32))[0] == 1  # the shape of shown
    return np.ma.masked_where(hidden | ~np.isfinite(shown), shown)


def _colours(cmap: Any) -> Any:
    """The colour map ``cmap`` (a name or a ``Colormap``) with masked cells (padding) in ``_PADDING`` grey."""
    return _pyplot().get_cmap(cmap).with_extremes(bad=_PADDING)


def _ticks(axis: Any, n: int, labels: Sequence[str] | None, *, each: bool) -> None:
    """A tick at every position (labelled), or a few automatic ones, labelled from ``labels`` when given."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    if each:
        axis.set_ticks(range(n), labels if labels is not None else [str(i) for i in range(n)])
        return
    axis.set_major_locator(MaxNLocator(nbins=8, integer=True))
    if labels is not None:
        axis.set_major_formatter(FuncFormatter(lambda x, _: labels[int(x)] if x == int(x) and 0 <= x < n else ""))


def _as_array(x: Any, name: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float32).numpy()
    try:
        return np.asarray(x, dtype=np.float32)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name} must be a tensor or an array of numbers, got {type(x).__name__}") from e
