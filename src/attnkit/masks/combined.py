"""The combined mask of one attention call, kept as its parts (:class:`Mask`): built and checked once, then asked
for any block of it (``tile``), for what its parts say of a grid of blocks from index ranges alone (``tiles``), and
for which keys some query may see and which queries see some key (``liveness``)."""

from __future__ import annotations

import functools
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit import mods
from attnkit._validate import as_lengths, check_device, ranges
from attnkit.masks.parts import as_4d_mask, causal_block, checked_bias
from attnkit.mods import MaskFn

__all__ = ["BIAS_SHIFT_ABOVE", "LIVENESS_BLOCK_ELEMENTS", "LIVENESS_ROWS", "Mask"]

# B batch, H heads, Lq/Lk query/key length, blk a block of keys [j0, j1)

# Booleans held at once while the liveness of a general mask is worked out block by block (16 MiB), in blocks of
# at most LIVENESS_ROWS queries and keys (small enough that a band or a document leaves most blocks known).
LIVENESS_BLOCK_ELEMENTS = 2**24
LIVENESS_ROWS = 1024

# A row's largest visible bias beyond this (in magnitude) is subtracted from the row: a score of a few units added
# to a bias of 1e4 keeps 3 bits in bfloat16, and none beside 1e30 in float32.
BIAS_SHIFT_ABOVE = 16.0


class Mask:
    """The combined mask of one attention call, kept as its parts.

    ``block(j0, j1)`` returns the boolean ``allowed`` (``True`` = may attend) and the float ``bias`` for keys
    ``j0 <= j < j1``, each broadcastable to ``(B, H, Lq, j1 - j0)``, or ``None`` where that part is absent.
    Build one with :meth:`Mask.build`, which validates every argument.
    """

    def __init__(
        self,
        *,
        batch: int,
        heads: int,
        num_queries: int,
        num_keys: int,
        valid_lens: Tensor | None,
        is_causal: bool,
        bool_mask: Tensor | None,
        bias: Tensor | None,
        bias_range: tuple[float, float] = (0.0, 0.0),
        bias_has_neg_inf: bool = False,
        bias_shift: Tensor | None = None,
        mask_mod: MaskFn | None = None,
        device: torch.device | None = None,
    ) -> None:
        self.batch, self.heads = batch, heads
        self.num_queries, self.num_keys = num_queries, num_keys
        self.valid_lens = valid_lens  # (B, 1, 1 | Lq, 1) long, or None
        self.is_causal = is_causal
        self.bool_mask = bool_mask  # (B|1, H|1, Lq, Lk) bool view, or None
        self.bias = bias  # (B|1, H|1, Lq, Lk) float view, or None
        self.bias_range = bias_range  # smallest and largest finite value of the bias
        self.bias_has_neg_inf = bias_has_neg_inf
        self.bias_shift = bias_shift  # (B|1, H|1, Lq, 1) subtracted from the bias, or None
        self.mask_mod = mask_mod  # mask_mod(b, h, q_idx, kv_idx) -> bool, built-ins bound to Lq, Lk; or None
        self.device = device
        self.plan: object = None  # its tiles (attnkit.plan.Plan), made once a call, or given (plan=)
        self.traced = False  # built while torch.compile traced: values unknown, only the graph backend runs it

    @classmethod
    def build(
        cls,
        *,
        batch: int,
        heads: int,
        num_queries: int,
        num_keys: int,
        valid_lens: Tensor | None = None,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
        mask_dims: int = 4,
        device: torch.device | None = None,
        mask_mod: MaskFn | None = None,
        lengths_made: bool = False,
    ) -> Mask:
        """Validate the masking arguments of a call and keep them as parts.

        Args:
            batch, heads, num_queries, num_keys: ``B, H, Lq, Lk`` of the call.
            valid_lens: ``(B,)`` or ``(B, Lq)`` whole numbers in ``[0, Lk]``.
            attn_mask: bool or float, broadcastable to ``(B, Lq, Lk)`` when ``mask_dims == 3`` (inputs without
                a head axis) or to ``(B, H, Lq, Lk)`` when ``mask_dims == 4``. A float mask holds finite values
                or ``-inf``.
            is_causal: bottom-right aligned causal mask.
            device: where the call runs; masks elsewhere are an error.
            mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (:mod:`attnkit.mods`); a built-in is bound to the
                call's lengths and its tensors checked.
            lengths_made: ``valid_lens`` a :class:`~attnkit.KVCache` made (int64, in range): not read again.

        Raises:
            ValueError: ``+inf`` or NaN in a float ``attn_mask``, and shapes or values that do not fit.

        Warns:
            FloatMaskWarning: a float ``attn_mask`` holding only 0 and 1.
        """
        B, H, Lq, Lk = batch, heads, num_queries, num_keys
        mods.check_callable("mask_mod", mask_mod)
        if mask_mod is not None:
            mask_mod = mods.bind(mask_mod, batch=B, heads=H, num_queries=Lq, num_keys=Lk, device=device)
        if not isinstance(is_causal, bool):
            raise TypeError(f"is_causal must be a bool, got {is_causal!r}")
        if is_causal and Lq <= 1:
            is_causal = False  # one query stands at the last key and sees them all (a decode step): no mask to build
        lens = None
        if valid_lens is not None:
            if isinstance(valid_lens, Tensor) and valid_lens.shape not in ((B,), (B, Lq)):
                raise ValueError(
                    f"valid_lens must have shape (B,) = ({B},) or (B, Lq) = ({B}, {Lq}), got {tuple(valid_lens.shape)}"
                )
            made = lengths_made and isinstance(valid_lens, Tensor) and valid_lens.dtype == torch.long
            lens = valid_lens if made else as_lengths(valid_lens, "valid_lens", Lk, device)
            per_query = lens.shape[1] if lens.dim() == 2 else 1
            lens = lens.reshape(B, 1, per_query, 1)  # (B, 1, 1 | Lq, 1)
        bool_mask = bias = None
        bias_range, has_neg_inf = (0.0, 0.0), False
        if attn_mask is not None:
            m = as_4d_mask(attn_mask, B, H, Lq, Lk, mask_dims)
            check_device("attn_mask", m, device)
            if m.dtype != torch.bool:
                m, bias_range, has_neg_inf = checked_bias(attn_mask, m)
            m = m.expand(*m.shape[:2], Lq, Lk)  # (B|1, H|1, Lq, Lk), a view: blocks slice it
            if m.dtype == torch.bool:
                bool_mask = m
            else:
                bias = m
        mask = cls(
            batch=B,
            heads=H,
            num_queries=Lq,
            num_keys=Lk,
            valid_lens=lens,
            is_causal=is_causal,
            bool_mask=bool_mask,
            bias=bias,
            bias_range=bias_range,
            bias_has_neg_inf=has_neg_inf,
            mask_mod=mask_mod,
            device=device,
        )
        mask.traced = torch.compiler.is_compiling()
        if max(-bias_range[0], bias_range[1]) > BIAS_SHIFT_ABOVE:
            shift = mask._visible_row_max()  # (B|1, H|1, Lq, 1)
            if mask.traced or bool((shift.abs() > BIAS_SHIFT_ABOVE).any()):
                mask.bias_shift = shift
        return mask

    @property
    def is_plain_causal(self) -> bool:
        """Whether the mask is causal alone over as many queries as keys (SDPA's ``is_causal=True``)."""
        plain = self.valid_lens is None and self.bool_mask is None and self.bias is None and self.mask_mod is None
        return self.is_causal and plain and self.num_queries == self.num_keys

    @property
    def is_empty(self) -> bool:
        """True when every query may attend to every key with no bias."""
        return (
            self.valid_lens is None
            and not self.is_causal
            and self.bool_mask is None
            and self.bias is None
            and self.mask_mod is None
        )

    @property
    def index_key(self) -> tuple[object, ...] | None:
        """A hashable value, equal for two masks only when they are the same function of the indices, for masks
        made of ``is_causal`` and built-in mask_mods that read no tensor (``sliding_window``), whose plans can be
        kept for the calls after; ``None`` for any other (lengths, boolean or float masks, a user's function,
        document ids: tensors whose contents may change between calls)."""
        if self.valid_lens is not None or self.bool_mask is not None or self.bias is not None:
            return None
        mod = self.mask_mod
        if mod is not None and not (
            isinstance(mod, mods.MaskMod)
            and type(mod).__module__.startswith("attnkit.")
            and type(mod).__eq__ is not object.__eq__  # equal by value (a combination is equal only to itself)
            and not mod.tensors()
        ):
            return None
        device = torch.device("cpu" if self.device is None else self.device)  # (None: made on the CPU)
        batch, heads = (1, 1) if mod is None else mod.depends_on(self.batch, self.heads)  # (B|1, H|1)
        return (batch, heads, self.num_queries, self.num_keys, self.is_causal, mod, device)

    @property
    def opaque(self) -> bool:
        """True when some part (a boolean or ``-inf`` mask, a user's mask_mod) says nothing of a block until the
        block is looked at: :meth:`tiles` then calls its blocks maybe-visible."""
        return (
            self.bool_mask is not None
            or self.bias_has_neg_inf
            or (self.mask_mod is not None and (not isinstance(self.mask_mod, mods.MaskMod) or self.mask_mod.opaque))
        )

    def tile(
        self, r0: int, r1: int, j0: int, j1: int, dtype: torch.dtype = torch.float32, *, every: bool = False
    ) -> tuple[Tensor | None, Tensor | None]:
        """``allowed`` and ``bias`` for queries ``[r0, r1)`` and keys ``[j0, j1)``, each broadcastable to
        ``(B, H, r1 - r0, j1 - j0)``, or ``None`` where that part is absent (``every=True``: the caller knows
        from :meth:`tiles` that every pair is allowed, and ``allowed`` is not built).

        The bias is in ``dtype``, less its row shift (subtracted in at least float32), its finite values clamped
        to half the finite range of ``dtype`` so that no finite bias becomes ``-inf`` (in the cast, or when a score
        is added to it); where the mask says ``-inf``, the bias is ``-inf`` and ``allowed`` is False.
        """
        allowed = None if every else self.allowed_tile(r0, r1, j0, j1)
        bias = None
        if self.bias is not None:
            part = self.bias[..., r0:r1, j0:j1]  # (B|1, H|1, n, blk)
            limit = torch.finfo(dtype).max / 2
            lo, hi = self.bias_range
            if self.bias_shift is not None or lo < -limit or hi > limit:
                # Shift and clamp in a dtype that holds the mask, the target and float32's range (a float16 mask
                # shifted in its own dtype overflows), then cast; new tensors: the caller's mask is never written to.
                work = torch.promote_types(torch.promote_types(part.dtype, dtype), torch.float32)
                part = part.to(work)
                if self.bias_shift is not None:
                    part = part - self.bias_shift[..., r0:r1, :].to(work)  # (B|1, H|1, n, blk); -inf stays -inf
                part = torch.where(torch.isneginf(part), part, part.clamp(-limit, limit))
            bias = part.to(dtype)
        return allowed, bias

    def allowed_tile(self, r0: int, r1: int, j0: int, j1: int) -> Tensor | None:
        """``allowed`` alone for queries ``[r0, r1)`` and keys ``[j0, j1)``, broadcastable to
        ``(B, H, r1 - r0, j1 - j0)``, or ``None`` when every pair is allowed."""
        allowed: Tensor | None = None
        device = self.device
        if self.valid_lens is not None:
            keys = torch.arange(j0, j1, device=device)  # (blk,)
            lens = self.valid_lens if self.valid_lens.shape[2] == 1 else self.valid_lens[:, :, r0:r1]
            allowed = keys < lens  # (B, 1, 1 | n, blk)
        if self.is_causal:
            causal = causal_block(self.num_queries, self.num_keys, j0, j1, device, r0, r1)  # (n, blk)
            allowed = causal if allowed is None else allowed & causal
        if self.bool_mask is not None:
            part = self.bool_mask[..., r0:r1, j0:j1]  # (B|1, H|1, n, blk)
            allowed = part if allowed is None else allowed & part
        if self.bias_has_neg_inf:
            assert self.bias is not None
            finite = ~torch.isneginf(self.bias[..., r0:r1, j0:j1])  # (B|1, H|1, n, blk)
            allowed = finite if allowed is None else allowed & finite
        if self.mask_mod is not None:
            idx = mods.indices(self.batch, self.heads, (r0, r1), (j0, j1), device)
            by_mod = mods.evaluate_mask(self.mask_mod, *idx)  # broadcastable to (B, H, n, blk)
            allowed = by_mod if allowed is None else allowed & by_mod
        return allowed

    def tiles(self, rows: Tensor, cols: Tensor) -> mods.Tiles:
        """What the parts say of the blocks with query ranges ``rows`` ``(nq, 2)`` and key ranges ``cols``
        ``(nk, 2)`` (``[start, stop)``, CPU int64), from the ranges alone: ``some[r, c]`` False where no pair of
        the block is allowed (skip it), ``every[r, c]`` where every pair is (no mask needed)."""
        nq, nk = len(rows), len(cols)
        known = mods.Tiles(torch.ones(nq, nk, dtype=torch.bool), torch.ones(nq, nk, dtype=torch.bool))
        j0, j1 = cols[None, :, 0], cols[None, :, 1] - 1  # (1, nk): first and last key of each block
        if self.valid_lens is not None and self.valid_lens.numel():
            lens = self.valid_lens.detach().cpu().view(self.batch, -1)  # (B, Lq|1)
            if lens.shape[1] == 1 or not len(rows):
                lo, hi = lens.amin(), lens.amax()
                lo, hi = lo.expand(nq, 1), hi.expand(nq, 1)  # (nq, 1)
            else:
                lo = torch.stack([lens[:, a:z].amin() for a, z in rows.tolist()])[:, None]  # (nq, 1)
                hi = torch.stack([lens[:, a:z].amax() for a, z in rows.tolist()])[:, None]  # (nq, 1)
            known = known & mods.Tiles(some=j0 < hi, every=j1 < lo)
        if self.is_causal:
            offset = self.num_keys - self.num_queries
            p0, p1 = rows[:, 0, None] + offset, rows[:, 1, None] - 1 + offset  # (nq, 1): first and last position
            known = known & mods.Tiles(some=j0 <= p1, every=j1 <= p0)
        if self.bool_mask is not None or self.bias_has_neg_inf:
            known = known & mods.Tiles.unknown(nq, nk)
        if self.mask_mod is not None:
            by_mod = self.mask_mod.tiles(rows, cols) if isinstance(self.mask_mod, mods.MaskMod) else None
            known = known & (by_mod if by_mod is not None else mods.Tiles.unknown(nq, nk))
        return known

    def as_mask_mod(self) -> MaskFn | None:
        """The whole mask as one ``mask_mod(b, h, q_idx, kv_idx)``, element by element (all parts must allow a
        pair: FlexAttention's form, from which it builds its block mask), or ``None`` when every pair is allowed.
        A float mask's ``-inf`` hides its pair; its values are not part of it."""
        B, H, Lq, Lk = self.batch, self.heads, self.num_queries, self.num_keys
        parts: list[MaskFn] = []
        if self.valid_lens is not None:
            lens = self.valid_lens.reshape(B, -1)  # (B, Lq|1)
            if lens.shape[1] == 1:
                parts.append(lambda b, h, q_idx, kv_idx: kv_idx < lens[b, 0])
            else:
                parts.append(lambda b, h, q_idx, kv_idx: kv_idx < lens[b, q_idx])
        if self.is_causal:
            offset = Lk - Lq
            parts.append(lambda b, h, q_idx, kv_idx: kv_idx <= q_idx + offset)
        if self.bool_mask is not None:
            full = self.bool_mask.expand(B, H, Lq, Lk)  # (B, H, Lq, Lk), a view
            parts.append(lambda b, h, q_idx, kv_idx: full[b, h, q_idx, kv_idx])
        if self.bias_has_neg_inf:
            assert self.bias is not None
            bias = self.bias.expand(B, H, Lq, Lk)  # (B, H, Lq, Lk), a view
            parts.append(lambda b, h, q_idx, kv_idx: ~torch.isneginf(bias[b, h, q_idx, kv_idx]))
        if self.mask_mod is not None:
            parts.append(self.mask_mod)
        if not parts:
            return None
        return parts[0] if len(parts) == 1 else functools.partial(_all_of, tuple(parts))

    def classify(self, rows: Tensor, cols: Tensor) -> mods.Tiles:
        """Exactly which blocks (query ranges ``rows`` ``(nq, 2)``, key ranges ``cols`` ``(nk, 2)``) are hidden
        (``some`` False) or visible in full (``every``): from index ranges where the parts say (:meth:`tiles`), and
        by evaluating the mask on the blocks only looking can tell, a block of rows at a time (FlexAttention's block
        mask). Looking at every pair some query may see, it learns the :attr:`liveness` too, and keeps it."""
        known = self.tiles(rows, cols)
        if not self.opaque or not len(rows) or not len(cols):
            return known
        some, every = known.some.clone(), known.every.clone()
        lead = self._lead_shape()
        live_keys = torch.zeros(*lead, self.num_keys, dtype=torch.bool, device=self.device)  # (B|1, H|1, Lk)
        live_rows = torch.zeros(*lead, self.num_queries, dtype=torch.bool, device=self.device)  # (B|1, H|1, Lq)
        width = int(cols[0, 1] - cols[0, 0])  # every block of keys but the last is this wide
        for r, c in every.nonzero().tolist():  # (few rows: a visible block makes its rows and keys live)
            live_rows[..., rows[r, 0] : rows[r, 1]] = True
            live_keys[..., cols[c, 0] : cols[c, 1]] = True
        for r, (r0, r1) in enumerate(rows.tolist()):
            maybe = (some[r] & ~every[r]).nonzero()[:, 0]
            if not len(maybe):
                continue
            per_look = max(1, LIVENESS_BLOCK_ELEMENTS // max(1, lead.numel() * (r1 - r0) * width))
            first, last = int(maybe[0]), int(maybe[-1])
            for a in range(first, last + 1, per_look):
                z = min(a + per_look, last + 1)  # blocks [a, z), keys [j0, j1)
                j0, j1 = int(cols[a, 0]), int(cols[z - 1, 1])
                allowed = self.allowed_tile(r0, r1, j0, j1)
                assert allowed is not None  # (opaque: some part gives one)
                allowed = allowed.reshape((1,) * (4 - allowed.dim()) + allowed.shape)  # (B|1, H|1, n|1, m|1)
                allowed = allowed.expand(*allowed.shape[:2], r1 - r0, j1 - j0)  # (B|1, H|1, n, m), a view
                by_key = allowed.any(dim=-2)  # (B|1, H|1, m), unexpanded: a function of q and k alone is looked
                # at once, not once per head
                live_keys[..., j0:j1] |= by_key
                live_rows[..., r0:r1] |= allowed.any(dim=-1)
                pad = (z - a) * width - (j1 - j0)  # the last block of keys may be narrower
                shown = F.pad(by_key.reshape(-1, j1 - j0).any(dim=0), (0, pad), value=False)  # (z-a) * width
                full = F.pad(allowed.reshape(-1, j1 - j0).all(dim=0), (0, pad), value=True)
                look = some[r, a:z] & ~every[r, a:z]  # (z - a,): the blocks only looking could tell
                some[r, a:z] = torch.where(look, shown.view(z - a, width).any(dim=-1).cpu(), some[r, a:z])
                every[r, a:z] = torch.where(look, full.view(z - a, width).all(dim=-1).cpu(), every[r, a:z])
        if "liveness" not in self.__dict__:  # (functools.cached_property keeps its value there)
            self.__dict__["liveness"] = (_none_if_all(live_keys), _none_if_all(live_rows))
        return mods.Tiles(some, every)

    def _visible_row_max(self) -> Tensor:
        """Each row's largest bias over the keys it may see, ``(B|1, H|1, Lq, 1)`` in the bias's dtype, detached
        (the softmax does not depend on it, so neither do the gradients); 0 for rows that see none."""
        assert self.bias is not None
        bias = self.bias.detach()
        row_max: Tensor | None = None
        for j0, j1 in self._scan_blocks():
            part = bias[..., j0:j1]  # (B|1, H|1, Lq, blk)
            allowed = self.allowed_tile(0, self.num_queries, j0, j1)
            if allowed is not None:
                part = torch.where(allowed, part, float("-inf"))  # (B|1, H|1, Lq, blk)
            block_max = part.amax(dim=-1, keepdim=True)  # (B|1, H|1, Lq, 1)
            row_max = block_max if row_max is None else torch.maximum(row_max, block_max)
        assert row_max is not None
        return row_max.masked_fill(torch.isneginf(row_max), 0.0)  # (B|1, H|1, Lq, 1)

    def full(self, dtype: torch.dtype = torch.float32) -> tuple[Tensor | None, Tensor | None]:
        """``tile(0, Lq, 0, Lk)``: the whole mask, for the backends that hold ``Lq x Lk`` anyway."""
        return self.tile(0, self.num_queries, 0, self.num_keys, dtype)

    def sink_logits(self, sinks: Tensor) -> Tensor:
        """Each row's sink logit, ``(B|1, H, Lq|1, 1)``: the head's (``sinks (H,)``), less the row's bias shift, which
        keeps the softmax with the sink what it is without the shift."""
        sink = sinks.view(1, -1, 1, 1)  # (1, H, 1, 1)
        return sink if self.bias_shift is None else sink - self.bias_shift.to(sink.dtype)  # (B|1, H, Lq|1, 1)

    @functools.cached_property
    def liveness(self) -> tuple[Tensor | None, Tensor | None]:
        """Which keys some query may see and which queries see some key, from the one combined mask.

        Returns:
            ``live_keys`` ``(B|1, H|1, Lk)`` and ``live_rows`` ``(B|1, H|1, Lq)``, bool; each ``None`` when all
            are live. A key is dead when no query may attend to it under all the parts together (say key 1 with
            ``valid_lens=[[2, 1]]`` and ``is_causal``: query 0 has it in its length but not in its causal past,
            query 1 the other way round); a query row is dead when it may attend to no key.

        With only ``valid_lens`` and ``is_causal``, each row sees a prefix of the keys, and both answers come
        from the prefix lengths in ``O(B * Lq + Lk)``; otherwise the mask is scanned block by block (at most
        ``LIVENESS_BLOCK_ELEMENTS`` booleans at once), skipping the blocks :meth:`tiles` knows to be hidden
        and looking at none of those it knows to be visible (a sliding window is scanned along its band only).
        """
        Lq, Lk = self.num_queries, self.num_keys
        device = self.device
        if self._prefixes_only:
            n = self._prefix_lengths  # (B|1, 1, Lq|1) keys [0, n) seen by each row, or None
            if n is None:
                return None, None
            rows = (n > 0).expand(*n.shape[:2], Lq)  # (B|1, 1, Lq)
            longest = self.live_key_counts  # (B|1, 1, 1)
            assert longest is not None
            keys = torch.arange(Lk, device=device) < longest  # (B|1, 1, Lk)
            return _none_if_all(keys), _none_if_all(rows)
        lead = self._lead_shape()
        keys = torch.zeros(*lead, Lk, dtype=torch.bool, device=device)  # (B|1, H|1, Lk)
        rows = torch.zeros(*lead, Lq, dtype=torch.bool, device=device)  # (B|1, H|1, Lq)
        row_step = min(max(Lq, 1), LIVENESS_ROWS)
        col_step = max(1, min(LIVENESS_ROWS, LIVENESS_BLOCK_ELEMENTS // max(1, lead.numel() * row_step)))
        row_ranges, col_ranges = ranges(0, Lq, row_step), ranges(0, Lk, col_step)  # (nq, 2), (nk, 2)
        known = self.tiles(row_ranges, col_ranges)
        for (r0, r1), some, every in zip(row_ranges.tolist(), known.some.tolist(), known.every.tolist(), strict=True):
            for (j0, j1), maybe, all_of in zip(col_ranges.tolist(), some, every, strict=True):
                if all_of:
                    keys[..., j0:j1] = True
                    rows[..., r0:r1] = True
                elif maybe:
                    allowed = self.allowed_tile(r0, r1, j0, j1)
                    assert allowed is not None
                    allowed = allowed.expand(*lead, r1 - r0, j1 - j0)  # (B|1, H|1, n, blk)
                    keys[..., j0:j1] |= allowed.any(dim=-2)
                    rows[..., r0:r1] |= allowed.any(dim=-1)
        return _none_if_all(keys), _none_if_all(rows)

    @property
    def _prefixes_only(self) -> bool:
        """Only ``valid_lens`` and ``is_causal`` hide keys (a float bias without ``-inf`` hides none)."""
        return self.bool_mask is None and not self.bias_has_neg_inf and self.mask_mod is None

    @functools.cached_property
    def live_key_counts(self) -> Tensor | None:
        """``(B|1, 1, 1)`` long: when only ``valid_lens`` and ``is_causal`` hide keys, the live keys of each
        example are ``[0, n)`` (its longest row's prefix) and the dead ones a suffix; ``None`` for other masks
        and when neither ``valid_lens`` nor ``is_causal`` is given."""
        if not self._prefixes_only:
            return None
        n = self._prefix_lengths  # (B|1, 1, Lq|1) or None
        if n is None:
            return None
        return n.amax(dim=-1, keepdim=True) if self.num_queries else n.new_zeros(n.shape[0], 1, 1)  # (B|1, 1, 1)

    def _scan_blocks(self) -> Iterator[tuple[int, int]]:
        """Key ranges ``[j0, j1)`` for a pass over the whole combined mask, each at most
        ``LIVENESS_BLOCK_ELEMENTS`` elements once broadcast to the parts' ``(B|1, H|1, Lq, blk)``."""
        if self.traced:  # one block under compile: a range() over a symbolic length would fix it
            yield 0, self.num_keys
            return
        step = max(1, LIVENESS_BLOCK_ELEMENTS // max(1, self._lead_shape().numel() * self.num_queries))
        for j0 in range(0, self.num_keys, step):
            yield j0, min(j0 + step, self.num_keys)

    def _lead_shape(self) -> torch.Size:
        """The broadcast ``(B|1, H|1)`` of the parts given."""
        parts = [p.shape[:2] for p in (self.valid_lens, self.bool_mask, self.bias) if p is not None]
        if self.mask_mod is not None:  # a user's may depend on the example and the head; a built-in says
            by_mod = (
                self.mask_mod.depends_on(self.batch, self.heads) if isinstance(self.mask_mod, mods.MaskMod) else None
            )
            parts.append(torch.Size(by_mod or (self.batch, self.heads)))
        return torch.broadcast_shapes(*parts, (1, 1))

    @functools.cached_property
    def _prefix_lengths(self) -> Tensor | None:
        """``n``, ``(B|1, 1, Lq|1)`` long: by ``valid_lens`` and ``is_causal`` alone, row ``i`` sees keys
        ``[0, n[i])``; ``None`` when neither is given."""
        n = None if self.valid_lens is None else self.valid_lens[..., 0]  # (B, 1, 1 | Lq)
        if self.is_causal:
            Lq, Lk = self.num_queries, self.num_keys
            past = (torch.arange(Lq, device=self.device) + (Lk - Lq + 1)).clamp(0, Lk)  # (Lq,): keys j <= i + Lk - Lq
            n = past.view(1, 1, Lq) if n is None else torch.minimum(n, past)  # (B|1, 1, Lq)
        return n


def _all_of(parts: tuple[MaskFn, ...], b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
    allowed = parts[0](b, h, q_idx, kv_idx)
    for part in parts[1:]:
        allowed = allowed & part(b, h, q_idx, kv_idx)
    return allowed


def _none_if_all(live: Tensor) -> Tensor | None:
    return None if bool(live.all()) else live
