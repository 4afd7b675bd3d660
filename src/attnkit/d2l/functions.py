"""The book's functions: ``sequence_mask``, ``masked_softmax``, ``transpose_qkv``, ``transpose_output`` and
``show_heatmaps``, with the book's signatures (see :mod:`attnkit.d2l`)."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from attnkit import masks, trace
from attnkit._validate import as_lengths, check_sizes

__all__ = ["masked_softmax", "sequence_mask", "show_heatmaps", "transpose_output", "transpose_qkv"]

# B batch, H heads, L length, d head dim


def sequence_mask(X: Tensor, valid_len: Tensor, value: float = 0) -> Tensor:
    """``X`` with the entries past ``valid_len`` (along axis 1) set to ``value``, as a new tensor.

    Args:
        X: ``(N, L, ...)`` or ``(N, L)``.
        valid_len: ``(N,)``, whole numbers in ``[0, L]``.

    Raises:
        TypeError: ``X`` or ``valid_len`` not a tensor, or ``valid_len`` not of whole numbers.
        ValueError: ``X`` with fewer than 2 dims, ``valid_len`` not ``(N,)``, or a length outside ``[0, L]``.

    Example:
        >>> sequence_mask(torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.tensor([1, 2]))
        tensor([[1, 0, 0],
                [4, 5, 0]])
    """
    if not isinstance(X, Tensor):
        raise TypeError(f"sequence_mask: X must be a tensor, got {type(X).__name__}")
    if X.dim() < 2:
        raise ValueError(f"sequence_mask: X must be (N, L) or (N, L, ...), got {tuple(X.shape)}")
    if not isinstance(valid_len, Tensor):
        raise TypeError(f"sequence_mask: valid_len must be a tensor of lengths, got {type(valid_len).__name__}")
    if valid_len.shape != X.shape[:1]:
        raise ValueError(
            f"sequence_mask: valid_len must have shape (N,) = ({X.shape[0]},), one length per row of X, got "
            f"valid_len {tuple(valid_len.shape)}, X {tuple(X.shape)}"
        )
    valid_len = as_lengths(valid_len, "valid_len", X.shape[1])  # whole numbers in [0, L]
    keep = masks.sequence_mask(valid_len, X.shape[1])  # (N, L)
    keep = keep.view(*keep.shape, *([1] * (X.dim() - 2)))  # (N, L, 1, ...)
    return X.masked_fill(~keep, value)


def masked_softmax(X: Tensor, valid_lens: Tensor | None) -> Tensor:
    """The book's ``masked_softmax(X, valid_lens)``: ``X (B, Lq, Lk)``, ``valid_lens (B,)`` or ``(B, Lq)``.

    Rows with no valid key are all zeros (the book gives them uniform weights); ``X`` is never modified.
    """
    return masks.masked_softmax(X, valid_lens)


def transpose_qkv(X: Tensor, num_heads: int) -> Tensor:
    """Split the hidden axis into heads and fold them into the batch: ``(B, L, H*d) -> (B*H, L, d)``.

    Raises:
        TypeError: ``num_heads`` not a whole number.
        ValueError: ``num_heads`` below 1, or ``X`` not 3-dim with a last axis a multiple of ``num_heads``.

    Example:
        >>> transpose_qkv(torch.zeros(2, 3, 8), 2).shape
        torch.Size([4, 3, 4])
    """
    check_sizes(num_heads=num_heads)
    if X.dim() != 3 or X.shape[-1] % num_heads:
        raise ValueError(
            f"transpose_qkv: X must be (B, L, num_heads * d) with num_heads={num_heads}, got {tuple(X.shape)}"
        )
    B, L, d = X.shape[0], X.shape[1], X.shape[2] // num_heads  # sizes named, not -1: B or L may be 0
    out = X.reshape(B, L, num_heads, d)  # (B, L, H, d)
    out = out.permute(0, 2, 1, 3)  # (B, H, L, d)
    out = out.reshape(B * num_heads, L, d)  # (B*H, L, d)
    tracer = trace.active()
    if tracer is not None:
        tracer.add("transpose_qkv", [X], out, "(B, L, H*d) -> (B*H, L, d)")
    return out


def transpose_output(X: Tensor, num_heads: int) -> Tensor:
    """Undo :func:`transpose_qkv`: ``(B*H, L, d) -> (B, L, H*d)``.

    Raises:
        TypeError: ``num_heads`` not a whole number.
        ValueError: ``num_heads`` below 1, or ``X`` not 3-dim with a first axis a multiple of ``num_heads``.

    Example:
        >>> X = torch.randn(2, 3, 8)
        >>> torch.equal(transpose_output(transpose_qkv(X, 2), 2), X)
        True
    """
    check_sizes(num_heads=num_heads)
    if X.dim() != 3 or X.shape[0] % num_heads:
        raise ValueError(
            f"transpose_output: X must be (B * num_heads, L, d) with num_heads={num_heads}, got {tuple(X.shape)}"
        )
    B, L, d = X.shape[0] // num_heads, X.shape[1], X.shape[2]  # sizes named, not -1: B or L may be 0
    out = X.reshape(B, num_heads, L, d)  # (B, H, L, d)
    out = out.permute(0, 2, 1, 3)  # (B, L, H, d)
    out = out.reshape(B, L, num_heads * d)  # (B, L, H*d)
    tracer = trace.active()
    if tracer is not None:
        tracer.add("transpose_output", [X], out, "(B*H, L, d) -> (B, L, H*d)")
    return out


def show_heatmaps(
    matrices: Any,
    xlabel: str,
    ylabel: str,
    titles: Any = None,
    figsize: tuple[float, float] = (2.5, 2.5),
    cmap: str = "Reds",
    path: Any = None,
) -> None:
    """The book's ``show_heatmaps(matrices, xlabel, ylabel, titles=None, figsize=(2.5, 2.5), cmap='Reds')``, with
    ``path`` to save; see :func:`attnkit.tools.plot.show_heatmaps` (needs matplotlib: ``pip install -e '.[plot]'`` in a
    checkout).

    ``figsize`` is the whole figure's size in inches, as in the book (``plt.subplots(rows, cols, figsize=figsize)``):
    the Transformer chapter's ``figsize=(7, 3.5)`` on a 4 x 4 grid gives a 7 x 3.5 inch figure. (It is divided
    among the panels here, since :func:`attnkit.tools.plot.show_heatmaps` reads ``figsize`` per panel.) ``titles``: one
    per column (more are ignored, as in the book).

    Returns nothing, as the book's does: a notebook shows the figure once (a returned figure, as the cell's value,
    would be shown a second time). :func:`attnkit.tools.plot.show_heatmaps` returns it; the figure stays open in pyplot
    (``plt.gcf()``), as the book's does.

    Raises:
        ValueError: fewer ``titles`` than columns, and what :func:`attnkit.tools.plot.show_heatmaps` raises.
    """
    import numpy as np  # with matplotlib, which needs it; attnkit itself does not

    from attnkit.tools.plot import show_heatmaps as draw

    shape = tuple(np.shape(matrices))
    if len(shape) in (2, 3, 4):
        rows, cols = ((1, 1) + shape[:-2])[-2:]  # 2-D and 3-D are one row, as in attnkit.tools.plot.show_heatmaps
        if titles and len(titles) < cols:
            raise ValueError(
                f"titles must have one per column, {cols} for matrices {shape}, got {len(titles)}: {list(titles)!r}"
            )
        figsize = (figsize[0] / max(cols, 1), figsize[1] / max(rows, 1))  # the book's figure -> per panel
    draw(matrices, xlabel, ylabel, titles=titles, figsize=figsize, cmap=cmap, path=path)
