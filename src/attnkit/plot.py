"""Pictures of attention weights (matplotlib, headless; ``pip install attnkit[plot]``).

The file type follows the extension (``.png``, ``.svg``, ``.pdf``, anything matplotlib writes). A figure is
written to a temporary file beside the target and renamed into place, so a failed write never leaves a
partial file behind.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["plot_attention", "save_figure", "show_heatmaps"]


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
) -> Any:
    """The book's ``show_heatmaps``: a grid of heatmaps with one shared colour bar.

    Args:
        matrices: ``(rows, cols, Lq, Lk)`` tensor or array (2-D and 3-D are taken as one row).
        xlabel, ylabel: axis labels (on the bottom row and left column).
        titles: one per column.
        figsize: size of each panel, in inches (the book's value is per figure; see below).
        cmap: matplotlib colour map.
        path: where to save (type from the extension); ``None`` to only return the figure.

    Returns:
        The matplotlib ``Figure``.

    Raises:
        ValueError: for ``matrices`` with fewer than 2 or more than 4 dims, or a bad extension.
    """
    m = _as_array(matrices, "matrices")
    if m.ndim not in (2, 3, 4):
        raise ValueError(f"matrices must be (rows, cols, Lq, Lk), (cols, Lq, Lk) or (Lq, Lk), got shape {m.shape}")
    m = m.reshape((1,) * (4 - m.ndim) + m.shape)  # (rows, cols, Lq, Lk)
    rows, cols = m.shape[:2]
    plt = _pyplot()
    fig, axes = plt.subplots(
        rows,
        cols,
        figsize=(figsize[0] * cols, figsize[1] * rows),
        sharex=True,
        sharey=True,
        squeeze=False,
        layout="constrained",
    )
    vmin, vmax = float(np.nanmin(m)), float(np.nanmax(m))
    image = None
    for i in range(rows):
        for j in range(cols):
            ax = axes[i, j]
            image = ax.imshow(m[i, j], cmap=cmap, vmin=vmin, vmax=vmax)
            if i == rows - 1:
                ax.set_xlabel(xlabel)
            if j == 0:
                ax.set_ylabel(ylabel)
            if titles:
                ax.set_title(titles[j])
    fig.colorbar(image, ax=axes, shrink=0.6)
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
) -> Any:
    """One panel per head, tokens on the axes, padding greyed out.

    Padding is what attnkit gives exactly zero weight: a key column with zero weight from every query (keys past
    ``valid_lens``), and a query row with zero weight on every key (nothing to attend to). Both are drawn grey.

    Args:
        weights: ``(Lq, Lk)`` or ``(H, Lq, Lk)`` (a leading batch of 1 is dropped).
        query_labels, key_labels: tick labels, ``Lq`` and ``Lk`` of them.
        heads: which heads to draw (all by default).
        path: where to save (type from the extension); ``None`` to only return the figure.
        title, xlabel, ylabel, cmap: the figure's title, axis labels and colour map.

    Returns:
        The matplotlib ``Figure``.
    """
    w = _as_array(weights, "weights")
    if w.ndim == 4 and w.shape[0] == 1:
        w = w[0]
    if w.ndim == 2:
        w = w[None]  # (1, Lq, Lk)
    if w.ndim != 3:
        raise ValueError(f"weights must be (Lq, Lk) or (H, Lq, Lk), got shape {w.shape}")
    H, Lq, Lk = w.shape
    for name, labels, n in (("query_labels", query_labels, Lq), ("key_labels", key_labels, Lk)):
        if labels is not None and len(labels) != n:
            raise ValueError(f"{name} has {len(labels)} labels but the weights have {n}: weights {w.shape}")
    chosen = list(range(H)) if heads is None else list(heads)
    for h in chosen:
        if not 0 <= h < H:
            raise ValueError(f"heads: head {h} does not exist; the weights have {H} heads")
    plt = _pyplot()
    cell = 0.32
    fig, axes = plt.subplots(
        1,
        len(chosen),
        figsize=(max(2.5, cell * Lk + 1.2) * len(chosen), max(2.2, cell * Lq + 1.0)),
        squeeze=False,
        layout="constrained",
    )
    colours = plt.get_cmap(cmap).with_extremes(bad="#d9d9d9")  # padding
    image = None
    for ax, h in zip(axes[0], chosen, strict=True):
        panel = w[h]
        padding = (panel == 0).all(axis=0)[None, :] | (panel == 0).all(axis=1)[:, None]  # (Lq, Lk)
        image = ax.imshow(np.ma.masked_where(padding, panel), cmap=colours, vmin=0.0, vmax=max(float(w.max()), 1e-12))
        ax.set_title(f"head {h}" if H > 1 else (title or "attention"))
        ax.set_xticks(range(Lk), key_labels if key_labels is not None else [str(j) for j in range(Lk)])
        ax.set_yticks(range(Lq), query_labels if query_labels is not None else [str(i) for i in range(Lq)])
        ax.tick_params(axis="x", labelrotation=90 if key_labels is not None and max(map(len, key_labels)) > 2 else 0)
        ax.set_xlabel(xlabel)
    axes[0, 0].set_ylabel(ylabel)
    if title and H > 1:
        fig.suptitle(title)
    fig.colorbar(image, ax=axes, shrink=0.8)
    if path is not None:
        save_figure(fig, path)
    return fig


def save_figure(fig: Any, path: str | os.PathLike[str], *, dpi: int = 100) -> Path:
    """Write ``fig`` to ``path`` atomically (temporary file, then rename); the type follows the extension.

    Raises:
        ValueError: for an extension matplotlib cannot write.
        OSError: when the folder does not exist or cannot be written (nothing is left behind).
    """
    target = Path(path)
    fmt = target.suffix.lower().lstrip(".")
    supported = fig.canvas.get_supported_filetypes()
    if fmt not in supported:
        raise ValueError(f"cannot write {str(target)!r}: the extension must be one of {', '.join(sorted(supported))}")
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            fig.savefig(f, format=fmt, dpi=dpi)
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it private; a plain open() would not
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    finally:
        _pyplot().close(fig)
    return target


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _as_array(x: Any, name: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float32).numpy()
    try:
        return np.asarray(x, dtype=np.float32)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name} must be a tensor or an array of numbers, got {type(x).__name__}") from e
