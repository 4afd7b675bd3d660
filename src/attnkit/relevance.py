"""Attention rollout (Abnar and Zuidema, 2020) from exact weights computed block by block, never a layer's L x L.

``with attnkit.rollout(model, targets=[-1]) as found: model(ids)``, then ``found.relevance`` ``(B, T, L)``: for each
target position t, how much each position flows into it through every layer. From the last layer to the first,

    r <- r ((1 - residual) A_l + residual I),   r = e_t at the start,

with ``A_l`` the layer's weights ``(L, L)`` averaged over its heads (``heads="mean"``), or their largest over the
heads with each row then scaled to sum to 1 (``heads="max"``); ``residual=0.5`` is the paper's ``A / 2 + I / 2``,
``residual=0`` drops the identity. Each product ``r A_l`` is a weighted sum of the weights' rows, taken block by
block from the layer's queries, keys and masks as its call recorded them (:mod:`attnkit.stats`): the same weights
as eager's, to rounding.

The block keeps each layer's queries and keys until the forward ends (the product runs from the last layer back),
about ``L x (H + Hkv) x D`` floats a layer: 25 MiB a layer for SmolLM2-135M at 8,192 tokens in float32, 755 MiB for
its 30 layers. Past ``keep_bytes`` of them (64 MiB unless given), the next layers' go to a temporary file as they
come and are read back one at a time (the file is deleted when the block ends, also after an exception). It follows
one forward of a model whose attention is attnkit's (a transformers model with ``attn_implementation="attnkit"``, or
attnkit's own layers), without a cache (the queries are every position).
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from attnkit import recording, stats
from attnkit._validate import describe, indices
from attnkit.stats.blocks import Parts, blocks

__all__ = ["KEEP_BYTES", "Rollout", "rollout"]

#: The layers' queries and keys a rollout keeps in memory (bytes); the next go to a temporary file.
KEEP_BYTES = 64 * 2**20


class Rollout(recording.Observer):
    """What :func:`attnkit.rollout` gives: ``relevance`` ``(B, T, L)`` once the forward inside the block has run
    (``None`` before), and ``layers``, the attention modules' names from the first to the last."""

    wants_lse = True

    def __init__(self, targets: list[int], heads: str, residual: float, keep_bytes: int, spill: Path) -> None:
        super().__init__()
        self.targets, self.heads, self.residual = targets, heads, residual
        self.layers: list[str] = []
        self.relevance: Tensor | None = None
        self._kept: list[Parts | Path] = []  # a layer's parts, or the file its queries and keys went to
        self._parts: dict[Path, Parts] = {}  # (a spilled layer's parts without them)
        self._bytes, self._keep_bytes, self._spill = 0, keep_bytes, spill

    def observe(self, name: str, module: nn.Module, parts: Any, kv_heads: int | None) -> None:
        found = parts()
        if found is None:
            raise ValueError(f"rollout: {name!r} gave no queries and keys (its attention is not attnkit's)")
        if name in self.layers:
            raise ValueError(f"rollout follows one forward: {name!r} ran twice inside the block")
        if found.q.shape[2] != found.k.shape[2] or found.three_d:
            raise ValueError(
                f"rollout follows a forward without a cache: {name!r} had {found.q.shape[2]} queries over "
                f"{found.k.shape[2]} keys"
            )
        self.layers.append(name)
        size = sum(t.numel() * t.element_size() for t in (found.q, found.k))
        if self._bytes + size <= self._keep_bytes:
            self._bytes += size
            self._kept.append(found)
            return
        path = self._spill / f"{len(self.layers)}.pt"
        torch.save({"q": found.q.detach().contiguous(), "k": found.k.detach().contiguous()}, path)
        self._parts[path] = found._replace(q=torch.empty(0), k=torch.empty(0))  # (theirs let go: read back later)
        self._kept.append(path)

    def _layer(self, kept: Parts | Path) -> Parts:
        if isinstance(kept, Parts):
            return kept
        saved = torch.load(kept, weights_only=True)
        kept.unlink()
        return self._parts.pop(kept)._replace(q=saved["q"], k=saved["k"])

    def _finish(self) -> None:
        kept, self._kept = self._kept, []
        if not kept:
            raise ValueError("rollout: no attention call of the model ran inside the block")
        last = self._layer(kept.pop())  # (read back first: the first layer's may be in the file too)
        q = last.q
        B, _, L, _ = q.shape
        wrong = [t for t in self.targets if not -L <= t < L]
        if wrong:
            raise ValueError(f"rollout(targets=...): {wrong[0]} is out of range for {L} positions")
        dtype = stats.compute_dtype(q.dtype)
        r = torch.zeros(B, len(self.targets), L, dtype=dtype, device=q.device)  # (B, T, L)
        r[:, torch.arange(len(self.targets)), torch.tensor([t % L for t in self.targets])] = 1.0
        for parts in [last, *reversed(kept)]:
            parts = self._layer(parts)
            r = self.residual * r + (1.0 - self.residual) * _times_weights(r, parts, self.heads)  # (B, T, L)
        self.relevance = r


def _times_weights(r: Tensor, parts: Parts, heads: str) -> Tensor:
    """``r (B, T, Lq)`` times the call's weights averaged over its heads (``"mean"``), or their largest with rows
    scaled to sum to 1 (``"max"``): ``(B, T, Lk)``, block by block."""
    B, H, Lq, _ = parts.q.shape
    out = torch.zeros(B, r.shape[1], parts.k.shape[2], dtype=r.dtype, device=r.device)  # (B, T, Lk)
    largest: Tensor | None = None  # (B, n, m): the block's rows' largest weight over the heads seen so far
    where: tuple[int, int, int] | None = None  # (r0, r1, a) of that block

    def flush() -> None:
        if largest is None or where is None:
            return
        r0, r1, a = where
        rows = largest / largest.sum(-1, keepdim=True).clamp_min(torch.finfo(largest.dtype).tiny)  # (B, n, m)
        out[:, :, a : a + rows.shape[-1]] += torch.einsum("btn,bnm->btm", r[:, :, r0:r1], rows)

    with torch.no_grad():
        for block in blocks(parts, [(0, Lq)], stats.BLOCK_BYTES):
            w = block.w if block.keep is None else block.w * block.keep  # (B, G, n, m)
            w = w.to(r.dtype)
            if heads == "mean":
                part = torch.einsum("btn,bgnm->btm", r[:, :, block.r0 : block.r1], w) / H  # (B, T, m)
                out[:, :, block.a : block.a + w.shape[-1]] += part
                continue
            if where != (block.r0, block.r1, block.a):
                flush()
                where, largest = (block.r0, block.r1, block.a), w.amax(dim=1)  # (B, n, m)
            else:
                assert largest is not None
                largest = torch.maximum(largest, w.amax(dim=1))  # (B, n, m)
        flush()
    return out


@contextlib.contextmanager
def rollout(
    model: nn.Module,
    targets: int | Sequence[int],
    *,
    heads: str = "mean",
    residual: float = 0.5,
    keep_bytes: int = KEEP_BYTES,
) -> Iterator[Rollout]:
    """Attention rollout of one forward run inside the block, for the ``targets`` positions (an int or a list;
    negative counts from the end): ``.relevance`` ``(B, T, L)`` after the block.

    Args:
        model: a module whose attention is attnkit's (transformers with ``attn_implementation="attnkit"``).
        targets: the positions whose relevance is wanted (the answer's, the last: ``-1``).
        heads: ``"mean"`` (the paper's) or ``"max"`` (each row's largest weight over the heads, rows then scaled to
            sum to 1).
        residual: the identity's share, in [0, 1]: 0.5 (the paper's ``A / 2 + I / 2``), 0 (none).
        keep_bytes: the layers' queries and keys kept in memory, in bytes; past it they go to a temporary file.

    Raises:
        TypeError, ValueError: a model that is not a module, targets that are not ints or out of range, another
            ``heads``, a ``residual`` outside [0, 1], a forward with a cache or none at all inside the block.

    Example:
        >>> with attnkit.rollout(model, targets=[-1]) as found:  # doctest: +SKIP
        ...     model(ids)
        >>> found.relevance.shape  # doctest: +SKIP
        torch.Size([1, 1, 1024])
    """
    chosen = indices(targets)
    if not chosen:  # (None: not positions; []: none)
        raise TypeError(f"rollout(targets=...) takes a position or a non-empty list of them, got {describe(targets)}")
    if heads not in ("mean", "max"):
        raise ValueError(f"rollout(heads=...) is 'mean' or 'max', got {heads!r}")
    if isinstance(residual, bool) or not isinstance(residual, (int, float)) or not 0.0 <= residual <= 1.0:
        raise ValueError(f"rollout(residual=...) is a share in [0, 1], got {residual!r}")
    if isinstance(keep_bytes, bool) or not isinstance(keep_bytes, int) or keep_bytes < 0:
        raise ValueError(f"rollout(keep_bytes=...) is a number of bytes, 0 or more, got {keep_bytes!r}")
    with tempfile.TemporaryDirectory(prefix="attnkit-rollout-") as spill:
        found = Rollout(chosen, heads, float(residual), keep_bytes, Path(spill))
        try:
            with recording.observe(model, found, "rollout"):
                yield found
            found._finish()
        finally:
            found._kept, found._parts = [], {}  # (the layers' queries and keys let go; the folder goes next)
