"""Step planning for ring attention: what every rank agreed on (:class:`Plan`), which query rows and key columns
of a step the masks may allow (:func:`step_span`, from position ranges alone), the mask of a step's blocks in
whole-sequence positions (:class:`StepMask`), and which of this rank's keys some query may see
(:func:`seen_keys`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from datetime import timedelta

import torch
from torch import Tensor

from attnkit import mods
from attnkit._validate import ranges
from attnkit.distributed import comm
from attnkit.distributed.sequence import length, positions
from attnkit.masks import LIVENESS_BLOCK_ELEMENTS, LIVENESS_ROWS

__all__ = ["Plan", "StepMask", "seen_keys", "step_span"]

# B batch, H heads, Lq/Lk whole-sequence lengths, Lq_r/Lk_r the positions this rank holds, Lb one block's keys


@dataclass(frozen=True)
class Plan:
    """What every rank agreed on, and where this rank's positions are."""

    ring: comm.Ring
    timeout: timedelta  # for every wait on another rank
    q_ranges: list[list[tuple[int, int]]]  # per rank: the [start, stop) query positions it holds
    k_ranges: list[list[tuple[int, int]]]  # per rank: the same for keys and values
    offset: int  # Lk - Lq: query i sees key j <= i + offset when causal
    is_causal: bool
    valid_lens: Tensor | None  # (B,) int64
    key_limit: int  # no query sees a key at or past this position (max valid_lens, or Lk)
    scale: float
    block: int  # keys scored at a time inside a block
    mask_mod: mods.MaskFn | None = None  # a built-in bound to the whole lengths; q_idx, kv_idx global positions
    score_mod: mods.ScoreFn | None = None  # the same; it reads no tensor that needs a gradient
    score_protected: frozenset[int] | None = frozenset()  # the memory it reads (mods.protected_storages)
    batch: int = 1  # B and H: the mask_mod's and score_mod's b and h
    heads: int = 1

    @property
    def num_queries(self) -> int:
        return sum(length(r) for r in self.q_ranges)

    @functools.cached_property
    def host_lens(self) -> Tensor | None:
        """``valid_lens`` on the host, to plan blocks without waiting for the device."""
        return None if self.valid_lens is None else self.valid_lens.detach().cpu()  # (B,)

    def tiles(self, rows: Tensor, cols: Tensor) -> mods.Tiles:
        """What the masks say, from the ranges alone, of the blocks of query positions ``rows`` ``(nq, 2)`` and key
        positions ``cols`` ``(nk, 2)`` (``[start, stop)`` in the whole sequence, CPU int64); see
        :class:`attnkit.mods.Tiles`."""
        p0, p1 = rows[:, :1], rows[:, 1:] - 1  # (nq, 1): first and last query position
        k0, k1 = cols[None, :, 0], cols[None, :, 1] - 1  # (1, nk): first and last key position
        known = mods.Tiles(
            torch.ones(len(rows), len(cols), dtype=torch.bool), torch.ones(len(rows), len(cols), dtype=torch.bool)
        )
        lens = self.host_lens
        if lens is not None and lens.numel():
            known = known & mods.Tiles(some=k0 < lens.max(), every=k1 < lens.min())
        if self.is_causal:
            known = known & mods.Tiles(some=k0 <= p1 + self.offset, every=k1 <= p0 + self.offset)
        if isinstance(self.mask_mod, mods.MaskMod):
            known = known & self.mask_mod.tiles(rows, cols)
        elif self.mask_mod is not None:  # a caller's function says nothing until it is evaluated
            known = known & mods.Tiles.unknown(len(rows), len(cols))
        return known


def seen_keys(plan: Plan, device: torch.device) -> Tensor:
    """Which of this rank's keys some query of the whole sequence may see, ``(B, H, Lk_r)`` bool, under all the
    masks together (a mask_mod can leave a key unseen: a window ending before it, a document without queries).
    Asked only when a key holds NaN or inf (a finite key no query sees adds exactly 0 to every sum).

    Scanned in tiles of at most ``attnkit.masks.LIVENESS_BLOCK_ELEMENTS`` booleans, skipping the tiles the
    masks' ranges hide, evaluating none they show in full, and none whose keys are already known to be seen: for a
    built-in this is the band or the documents, for a caller's function typically one tile of rows per key tile.
    """
    mine = plan.k_ranges[plan.ring.rank]
    Lq, Lk_r, B, H = plan.num_queries, length(mine), plan.batch, plan.heads
    live = torch.zeros(B, H, Lk_r, dtype=torch.bool, device=device)  # (B, H, Lk_r)
    if not live.numel():
        return live
    mask = StepMask(plan, [(0, Lq)], mine, (0, Lq), (0, Lk_r), device)
    row_step = min(Lq, LIVENESS_ROWS)
    col_step = max(1, min(LIVENESS_ROWS, LIVENESS_BLOCK_ELEMENTS // (B * H * row_step)))
    rows, cols = ranges(0, Lq, row_step), ranges(0, Lk_r, col_step)  # (nq, 2), (nk, 2)
    known = mask.tiles(rows, cols)
    done = known.every.any(dim=0)  # (nk,): key tiles some row tile sees in full
    for c in done.nonzero()[:, 0].tolist():
        live[..., cols[c, 0] : cols[c, 1]] = True
    for r, c in (known.some & ~known.every).nonzero().tolist():
        if done[c]:
            continue
        (r0, r1), (j0, j1) = rows[r].tolist(), cols[c].tolist()
        allowed, _ = mask.tile(r0, r1, j0, j1)
        assert allowed is not None  # a mask_mod is given
        live[..., j0:j1] |= allowed.any(dim=-2)  # (B|1, H|1, blk) into (B, H, blk)
        done[c] = bool(live[..., j0:j1].all())
    return live


def step_span(plan: Plan, src: int) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """The rows of this rank's queries and the columns of block ``src`` that hold every allowed pair, or
    ``None`` when the masks allow none (the step is skipped). With the zig-zag layout and a causal mask this is
    half the block on every step but the first, which is what balances the work; a built-in mask_mod narrows it
    further (:func:`_narrow`)."""
    rows: list[int] = []
    cols: list[int] = []
    qa = 0
    for q0, q1 in plan.q_ranges[plan.ring.rank]:
        ka = 0
        for k0, k1 in plan.k_ranges[src]:
            last, first_row = min(k1, plan.key_limit), q0  # keys [k0, last) are seen by queries [first_row, q1)
            if plan.is_causal:
                last = min(last, q1 + plan.offset)  # the last query, q1 - 1, sees keys up to q1 - 1 + offset
                first_row = max(q0, k0 - plan.offset)  # queries before k0 - offset see none of them
            box = ((first_row, q1), (k0, last)) if k0 < last and first_row < q1 else None
            if box is not None and isinstance(plan.mask_mod, mods.MaskMod):
                box = _narrow(plan, *box)
            if box is not None:
                (a, b), (c, d) = box  # whole-sequence positions
                rows += [qa + a - q0, qa + b - q0]
                cols += [ka + c - k0, ka + d - k0]
            ka += k1 - k0
        qa += q1 - q0
    return ((min(rows), max(rows)), (min(cols), max(cols))) if rows else None


# _narrow looks at a rectangle of positions in at most this many pieces a side: exact for small rectangles, within a
# 1/64th of each side for long ones (the block plan inside the step skips the rest)
_GRID = 64


def _narrow(plan: Plan, rows: tuple[int, int], cols: tuple[int, int]) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """The part of the rectangle of query positions ``rows`` and key positions ``cols`` (``[start, stop)``) that
    the masks' tiles do not hide, or ``None`` when they hide all of it (a sliding window's far blocks, another
    document): one call of :meth:`Plan.tiles` on a grid of ``_GRID`` pieces a side."""
    row_pieces = ranges(*rows, -(-(rows[1] - rows[0]) // _GRID))  # (nr, 2), nr <= _GRID
    col_pieces = ranges(*cols, -(-(cols[1] - cols[0]) // _GRID))  # (nc, 2), nc <= _GRID
    some = plan.tiles(row_pieces, col_pieces).some  # (nr, nc)
    seen_rows, seen_cols = some.any(dim=1).nonzero()[:, 0], some.any(dim=0).nonzero()[:, 0]
    if not len(seen_rows):
        return None
    first_row, last_row, first_col, last_col = (
        int(i) for i in (seen_rows[0], seen_rows[-1], seen_cols[0], seen_cols[-1])
    )
    return (
        (int(row_pieces[first_row, 0]), int(row_pieces[last_row, 1])),
        (int(col_pieces[first_col, 0]), int(col_pieces[last_col, 1])),
    )


class StepMask:
    """Which of queries ``rows = [r0, r1)`` of ``queries`` may see which of keys ``cols = [c0, c1)`` of ``keys``
    (each a list of ``[start, stop)`` ranges of whole-sequence positions, as :func:`segments` gives), with
    ``tile`` and ``tiles`` as :class:`attnkit.masks.Mask` (in indices local to these rows and keys)."""

    def __init__(
        self,
        plan: Plan,
        queries: list[tuple[int, int]],
        keys: list[tuple[int, int]],
        rows: tuple[int, int],
        cols: tuple[int, int],
        device: torch.device,
    ) -> None:
        (r0, r1), (c0, c1) = rows, cols
        self.plan = plan
        self.valid_lens = None if plan.valid_lens is None else plan.valid_lens.view(-1, 1, 1, 1)  # (B, 1, 1, 1)
        self.queries = positions(queries, device)[r0:r1, None]  # (Lq', 1)
        self.keys = positions(keys, device)[c0:c1]  # (Lb',)
        # on the host, to plan blocks without waiting for the device; positions ascend in both layouts
        self.host_queries = positions(queries)[r0:r1]  # (Lq',)
        self.host_keys = positions(keys)[c0:c1]  # (Lb',)
        # a caller's mask_mod (alone, or inside and_masks/or_masks) says nothing of a block until it is evaluated:
        # the online softmax then narrows the block to the rows that see a key, and skips it when none does
        mod = plan.mask_mod
        self.opaque = mod is not None and (not isinstance(mod, mods.MaskMod) or mod.opaque)
        if plan.mask_mod is not None:
            self.b = torch.arange(plan.batch, device=device).view(-1, 1, 1, 1)  # (B, 1, 1, 1)
            self.h = torch.arange(plan.heads, device=device).view(1, -1, 1, 1)  # (1, H, 1, 1)

    def tiles(self, rows: Tensor, cols: Tensor) -> mods.Tiles:
        # Local rows [a, z) hold positions from the first to the last one's: with the zig-zag layout a superset (the
        # gap between a rank's two chunks), of which "hidden" and "visible in full" hold all the more.
        first, last = self.host_queries[rows[:, 0]], self.host_queries[rows[:, 1] - 1]  # (nq,) each
        k_first, k_last = self.host_keys[cols[:, 0]], self.host_keys[cols[:, 1] - 1]  # (nk,) each
        return self.plan.tiles(
            torch.stack([first, last + 1], dim=1),
            torch.stack([k_first, k_last + 1], dim=1),  # (nq, 2), (nk, 2)
        )

    def tile(
        self, r0: int, r1: int, j0: int, j1: int, dtype: torch.dtype = torch.float32, *, every: bool = False
    ) -> tuple[Tensor | None, Tensor | None]:
        if every:
            return None, None
        keys = self.keys[j0:j1]  # (blk,)
        plan = self.plan
        allowed = None if self.valid_lens is None else keys < self.valid_lens  # (B, 1, 1, blk)
        if plan.is_causal:
            causal = keys <= self.queries[r0:r1] + plan.offset  # (n, blk)
            allowed = causal if allowed is None else allowed & causal  # (B, 1, n, blk)
        if plan.mask_mod is not None:
            q_idx = self.queries[r0:r1].view(1, 1, -1, 1)  # (1, 1, n, 1)
            kv_idx = keys.view(1, 1, 1, -1)  # (1, 1, 1, blk)
            by_mod = mods.evaluate_mask(plan.mask_mod, self.b, self.h, q_idx, kv_idx)  # broadcastable to (B, H, n, blk)
            allowed = by_mod if allowed is None else allowed & by_mod  # (B|1, H|1, n, blk)
        return allowed, None
