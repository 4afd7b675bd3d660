"""Packed sequences: a padded batch as one row of real tokens with document ids, and back.

Padding a batch to its longest example wastes the work of every padded position; packing puts the real tokens of
all examples one after the other in a single row, and a document mask (:func:`attnkit.mods.document`) keeps each
example from seeing the others. The tile engine skips the blocks of other documents, so attention costs the sum
of each document's own, and no position is padding::

    x (B=3, L=4), valid_lens [2, 4, 1]      packed.data (1, 7)         document_ids (1, 7)
    a a . .                                 a a b b b b c              0 0 1 1 1 1 2
    b b b b                                                            positions (1, 7)
    c . . .                                                            0 1 0 1 2 3 0

Example:
    >>> import torch, attnkit
    >>> from attnkit.packing import pack, unpack
    >>> mha = attnkit.MultiHeadAttention(16, 4)
    >>> x, lens = torch.randn(3, 5, 16), torch.tensor([2, 5, 1])
    >>> p = pack(x, lens)
    >>> y = mha(p.data, p.data, p.data, is_causal=True, mask_mod=p.document())  # (1, 8, 16): no padding
    >>> unpack(y, p).shape                                                      # zeros where x was padding
    torch.Size([3, 5, 16])
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from attnkit import mods
from attnkit._validate import as_lengths, describe

__all__ = ["Packed", "pack", "unpack"]

# B batch, L padded length, N real tokens (sum of valid_lens), F... feature dims


class Packed(NamedTuple):
    """A padded batch packed into one row (see the module docstring)."""

    data: Tensor  # (1, N, F...): the real tokens, example after example
    document_ids: Tensor  # (1, N) int64: the example each token came from
    positions: Tensor  # (1, N) int64: its position in that example (for position embeddings)
    lengths: Tensor  # (B,) int64: the tokens of each example
    padded_len: int  # L, the length of the padded batch

    def document(self) -> mods.MaskMod:
        """The document mask of this row: each token attends only within its own example."""
        return mods.document(self.document_ids)


def pack(x: Tensor, valid_lens: Tensor) -> Packed:
    """Pack the first ``valid_lens[b]`` positions of each example of ``x`` into one row.

    Args:
        x: ``(B, L, F...)``, padded at the end.
        valid_lens: ``(B,)`` whole numbers in ``[0, L]``.

    Returns:
        :class:`~attnkit.packing.Packed`; ``data`` is differentiable with respect to ``x``.

    Raises:
        ValueError, TypeError: for ``x`` without a length axis or lengths that do not fit it.
    """
    if not isinstance(x, Tensor) or x.dim() < 2:
        raise ValueError(f"x must be a (B, L, ...) tensor, got {describe(x)}")
    B, L = x.shape[:2]
    if not isinstance(valid_lens, Tensor) or valid_lens.shape != (B,):
        raise ValueError(f"valid_lens must have shape (B,) = ({B},), got {describe(valid_lens)}")
    lengths = as_lengths(valid_lens, "valid_lens", L, x.device)  # (B,)
    keep = torch.arange(L, device=x.device) < lengths[:, None]  # (B, L)
    data = x[keep].unsqueeze(0)  # (1, N, F...)
    ids = torch.arange(B, device=x.device).repeat_interleave(lengths)  # (N,)
    positions = torch.arange(L, device=x.device).expand(B, L)[keep]  # (N,)
    return Packed(data, ids.unsqueeze(0), positions.unsqueeze(0), lengths, L)


def unpack(data: Tensor, packed: Packed) -> Tensor:
    """The padded batch back from a packed row (the output of a layer run on ``packed.data``, say).

    Args:
        data: ``(1, N, F...)`` or ``(N, F...)``, the tokens in the order of ``packed``.
        packed: what :func:`pack` returned.

    Returns:
        ``(B, L, F...)`` with zeros at the padded positions; differentiable with respect to ``data``.

    Raises:
        ValueError: ``data`` does not hold ``N`` tokens.
    """
    lengths, L = packed.lengths, packed.padded_len
    N = int(lengths.sum())
    tokens = data[0] if data.dim() >= 2 and data.shape[0] == 1 and data.shape[1] == N else data  # (N, F...)
    if tokens.dim() < 1 or tokens.shape[0] != N:
        raise ValueError(f"data must hold the {N} packed tokens, (1, {N}, ...) or ({N}, ...), got {describe(data)}")
    B = lengths.shape[0]
    keep = torch.arange(L, device=tokens.device) < lengths[:, None]  # (B, L)
    out = tokens.new_zeros((B, L, *tokens.shape[1:]))  # (B, L, F...)
    return out.index_put((keep,), tokens)  # (B, L, F...)
