"""Packed documents as separate calls ("varlen"): a call whose mask holds a document mask
(:func:`attnkit.mods.document`, alone or inside :func:`~attnkit.mods.and_masks`) runs as one call per run of a
document's queries, over that document's keys only.

Why: inside one call, a document's queries meet other documents' keys in the same blocks, where a hidden weight of
exactly 0 still multiplies the hidden value (``0 * NaN = NaN``, and an overflowing hidden score meets the mask's
``-inf``); a packed document's content, NaN and overflow included, then reaches the others. As separate calls it
cannot, on any backend (the reference, the spec, included). And each piece is an ordinary call: causal packed
documents become one plain causal call per document, which PyTorch's fused kernel runs.

A piece keeps every other part of the mask, restricted to its queries and keys: ``valid_lens`` (counted over the
piece's keys), ``is_causal`` (still ``is_causal`` when the piece's keys and queries end together, else per-query
lengths), ``attn_mask``, and the rest of the mask_mod and the score_mod, which still see the call's own indices
(``b``, ``q_idx``, ``kv_idx`` as in the whole call).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit import mods
from attnkit.backends.contract import Call
from attnkit.masks import Mask

__all__ = ["Piece", "assemble", "split"]

# B batch (B' the examples of a piece), H heads, Lq/Lk query/key length, n a piece's queries, m its keys, Dv value dim

# A range of key positions [a, z), or the sorted positions of a document whose keys lie in several runs.
Keys = tuple[int, int] | Tensor


class Piece(NamedTuple):
    """The queries ``rows`` of the examples ``batch`` of a call, with their document's keys ``keys`` (``None``: the
    document has no key, and the rows see nothing); ``call`` the restricted call (``None`` when ``keys`` is)."""

    batch: slice
    rows: tuple[int, int]
    keys: Keys | None
    call: Call | None


class Result(NamedTuple):
    """What a backend gave for one piece: output ``(B', H, n, Dv)``, weights ``(B', H, n, m)`` or ``None``, and each
    row's log-sum-exp ``(B', H, n)`` or ``None``."""

    output: Tensor
    weights: Tensor | None
    lse: Tensor | None


def split(call: Call) -> list[Piece] | None:
    """The pieces of ``call``, examples group after group and each group's rows in order, or ``None`` when its mask
    has no document part (or nothing to split: no example, query or key; or ``torch.compile`` tracing, which would
    turn each boundary into a recompilation)."""
    mask = call.mask
    found = _document(mask.mask_mod)
    if found is None or not call.q.shape[0] or not mask.num_queries or not mask.num_keys:
        return None
    if torch.compiler.is_compiling():
        return None
    doc, rest = found
    ids_q, ids_k = doc.ids_q.detach(), doc.keys.detach()  # (B|1, Lq), (B|1, Lk)
    B = call.q.shape[0]
    shared = ids_q.shape[0] == 1 and ids_k.shape[0] == 1
    groups = [slice(0, B)] if shared else [slice(b, b + 1) for b in range(B)]
    # Each tensor is cut once (torch.split): slicing it once per piece would make each piece's backward add into a
    # zero tensor of the whole input's size (pieces x size).
    sizes = [g.stop - g.start for g in groups]
    qs, ks, vs = (t.split(sizes, dim=0) for t in (call.q, call.k, call.v))  # (B', H|Hkv, L, D) each
    pieces = []
    proof = _Proof(call.score_mod)
    for batch, q, k, v in zip(groups, qs, ks, vs, strict=True):
        row_q = ids_q[0 if ids_q.shape[0] == 1 else batch.start]  # (Lq,)
        row_k = ids_k[0 if ids_k.shape[0] == 1 else batch.start]  # (Lk,)
        q_runs, k_runs = _runs(row_q), _runs(row_k)
        q_parts = q.split([z - a for a, z, _ in q_runs], dim=2)  # (B', H, n, D) each
        spans = [(a, z) for a, z, _ in k_runs]
        k_parts = dict(zip(spans, k.split([z - a for a, z in spans], dim=2), strict=True))  # (B', Hkv, m, D) each
        v_parts = dict(zip(spans, v.split([z - a for a, z in spans], dim=2), strict=True))
        by_id: dict[int, list[tuple[int, int]]] = {}
        for a, z, d in k_runs:
            by_id.setdefault(d, []).append((a, z))
        for (r0, r1, d), q_part in zip(q_runs, q_parts, strict=True):
            runs = by_id.get(d, [])
            keys = _keys(runs, call.k.device)
            piece_call = None
            if keys is not None:
                kv = [torch.cat([parts[r] for r in runs], dim=2) for parts in (k_parts, v_parts)]  # (B', Hkv, m, D)
                piece_call = _restrict(call, batch, (r0, r1), keys, rest, q_part, kv[0], kv[1], proof)
            pieces.append(Piece(batch, (r0, r1), keys, piece_call))
    return pieces


def assemble(call: Call, pieces: list[Piece], results: list[Result | None]) -> Result:
    """The whole call's output, weights and log-sum-exp from its pieces' (``None`` for a piece without keys: zeros;
    the log-sum-exp is ``None`` when some piece had none to give)."""
    q, v, Lk = call.q, call.v, call.mask.num_keys
    B, H = q.shape[:2]
    outs: list[list[Tensor]] = []
    weights: list[list[Tensor]] | None = [] if call.need_weights else None
    lses: list[list[Tensor]] | None = []
    batch = None
    for piece, result in zip(pieces, results, strict=True):
        if piece.batch != batch:  # a new group of examples
            batch = piece.batch
            outs.append([])
            if weights is not None:
                weights.append([])
            if lses is not None:
                lses.append([])
        nb, n = batch.stop - batch.start, piece.rows[1] - piece.rows[0]
        if result is None:  # a document without keys: its rows see nothing
            rows = q[batch, :, piece.rows[0] : piece.rows[1], :1].expand(nb, H, n, v.shape[-1])  # (B', H, n, Dv)
            # zeros that autograd still reaches, with a zero gradient (never 0 * NaN), as every backend gives them
            outs[-1].append(torch.where(torch.zeros((), dtype=torch.bool, device=q.device), rows, 0.0))
            if weights is not None:
                weights[-1].append(q.new_zeros((nb, H, n, Lk)))  # (B', H, n, Lk)
            if lses is not None:
                lses[-1].append(q.new_zeros((nb, H, n)))  # (B', H, n)
            continue
        outs[-1].append(result.output)
        if weights is not None:
            assert result.weights is not None and piece.keys is not None
            weights[-1].append(_widen(result.weights, piece.keys, Lk))  # (B', H, n, Lk)
        if lses is not None:
            lses = None if result.lse is None else lses
            if lses is not None:
                assert result.lse is not None
                lses[-1].append(result.lse)

    def whole(parts: list[list[Tensor]]) -> Tensor:
        return torch.cat([torch.cat(group, dim=2) for group in parts], dim=0)  # (B, H, Lq, ...)

    out = whole(outs)  # (B, H, Lq, Dv)
    if all(r is None for r in results):  # no document has keys: k, v, the sinks still get (zero) gradients
        unused = [t.sum() for t in (call.k, call.v, call.w_v, call.sinks) if t is not None]
        out = out + torch.where(torch.zeros((), dtype=torch.bool, device=q.device), sum(unused), 0.0)
    return Result(out, None if weights is None else whole(weights), None if lses is None else whole(lses))


# ------------------------------------------------------------------------------------------- finding the pieces


def has_documents(mask_mod: mods.MaskFn | None) -> bool:
    """Whether ``mask_mod`` has a document part (:class:`attnkit.mods.document`): a call :func:`split` cuts up."""
    return _document(mask_mod) is not None


def _document(mask_mod: mods.MaskFn | None) -> tuple[mods.document, mods.MaskFn | None] | None:
    """The document part of a mask_mod and what is left beside it (``None`` when nothing is), or ``None``."""
    if mask_mod is None:
        return None
    parts = mods.conjuncts(mask_mod)
    docs = [m for m in parts if isinstance(m, mods.document)]
    if not docs:
        return None
    rest = [m for m in parts if not isinstance(m, mods.document)]
    doc = docs[0]
    for other in docs[1:]:  # several document masks: a pair attends when both ids agree, so split on pairs of ids
        doc = _both(doc, other)
    return doc, (None if not rest else rest[0] if len(rest) == 1 else mods.and_masks(*rest))


def _both(one: mods.document, other: mods.document) -> mods.document:
    """One document mask whose ids agree where both masks' ids agree: ``(id, other id)`` pairs, numbered."""
    low = int(torch.minimum(other.ids_q.min(), other.keys.min()))
    span = int(torch.maximum(other.ids_q.max(), other.keys.max())) - low + 1

    def pair(a: Tensor, b: Tensor) -> Tensor:  # (B|1, L) each -> (B|1, L)
        a, b = torch.broadcast_tensors(a.detach(), b.detach())
        return a.long() * span + (b.long() - low)

    return mods.document(pair(one.ids_q, other.ids_q), pair(one.keys, other.keys))


def _runs(ids: Tensor) -> list[tuple[int, int, int]]:
    """The runs of equal ids of a row, ``(start, stop, id)`` in order."""
    values, counts = torch.unique_consecutive(ids, return_counts=True)
    stops = counts.cumsum(0).tolist()
    starts = [0, *stops[:-1]]
    return list(zip(starts, stops, values.tolist(), strict=True))


def _keys(runs: list[tuple[int, int]], device: torch.device) -> Keys | None:
    """A document's keys: one range, or the sorted positions of its several runs (``None``: it has none)."""
    if not runs:
        return None
    if len(runs) == 1:
        return runs[0]
    return torch.cat([torch.arange(a, z, device=device) for a, z in runs])  # (m,)


# ------------------------------------------------------------------------------------------- restricting a call


def _take(t: Tensor, dim: int, keys: Keys) -> Tensor:
    """The piece's keys of ``t`` along ``dim`` (a view for a range)."""
    if isinstance(keys, tuple):
        return t.narrow(dim, keys[0], keys[1] - keys[0])
    return t.index_select(dim, keys)


def _count_below(limit: Tensor, keys: Keys) -> Tensor:
    """How many of the piece's keys lie before each position of ``limit`` (keys ``j < limit``): lengths in the
    piece's own key positions."""
    if isinstance(keys, tuple):
        a, z = keys
        return (limit - a).clamp(0, z - a)
    return torch.searchsorted(keys, limit.contiguous())


def _restrict(
    call: Call,
    batch: slice,
    rows: tuple[int, int],
    keys: Keys,
    rest: mods.MaskFn | None,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    proof: _Proof,
) -> Call:
    """The call of one piece: its queries ``q (B', H, n, D)``, keys ``k (B', Hkv, m, D)`` and values, the rest of
    the mask restricted to them, the score_mod moved (``proof``: whether the call's score_mod is a bias on the
    distance, asked at most once for all the pieces)."""
    r0 = rows[0]
    mask = _restrict_mask(call.mask, batch, rows, keys, k.shape[2], rest)
    score_mod = None if call.score_mod is None else _moved_score(call.score_mod, batch.start, r0, keys, proof)
    return dataclasses.replace(call, q=q, k=k, v=v, mask=mask, score_mod=score_mod, zeros_past=None)


def _restrict_mask(
    mask: Mask, batch: slice, rows: tuple[int, int], keys: Keys, m: int, rest: mods.MaskFn | None
) -> Mask:
    r0, r1 = rows
    n, nb = r1 - r0, batch.stop - batch.start
    lens = None
    if mask.valid_lens is not None:
        own = mask.valid_lens[batch]  # (B', 1, 1 | Lq, 1)
        lens = _count_below(own if own.shape[2] == 1 else own[:, :, r0:r1], keys)  # (B', 1, 1 | n, 1)
    causal = False
    if mask.is_causal:
        offset = mask.num_keys - mask.num_queries  # query i sees keys j <= i + offset
        if isinstance(keys, tuple) and r1 + offset == keys[1]:
            causal = n > 1  # the piece's queries end where its keys do: causal within it (one query sees all)
        else:
            past = torch.arange(r0 + offset + 1, r1 + offset + 1, device=mask.device).view(1, 1, n, 1)
            seen = _count_below(past, keys)  # (1, 1, n, 1)
            lens = seen if lens is None else torch.minimum(lens, seen)  # (B'|1, 1, 1 | n, 1)
    if lens is not None:
        lens = lens.expand(nb, 1, lens.shape[2], 1).contiguous()  # (B', 1, 1 | n, 1)

    def part(t: Tensor | None) -> Tensor | None:  # (B|1, H|1, Lq, Lk) -> (B'|1, H|1, n, m)
        if t is None:
            return None
        return _take(t[batch if t.shape[0] != 1 else slice(None), :, r0:r1], 3, keys)

    shift = mask.bias_shift
    if shift is not None:
        shift = shift[batch if shift.shape[0] != 1 else slice(None), :, r0:r1]  # (B'|1, H|1, n, 1)
    return Mask(
        batch=nb,
        heads=mask.heads,
        num_queries=n,
        num_keys=m,
        valid_lens=lens,
        is_causal=causal,
        bool_mask=part(mask.bool_mask),
        bias=part(mask.bias),
        bias_range=mask.bias_range,
        bias_has_neg_inf=mask.bias_has_neg_inf,
        bias_shift=shift,
        mask_mod=None if rest is None else _MovedMask(rest, batch.start, r0, keys, nb),
        device=mask.device,
    )


def _key_positions(kv_idx: Tensor, keys: Keys) -> Tensor:
    """The call's key positions of a piece's ``kv_idx``."""
    return kv_idx + keys[0] if isinstance(keys, tuple) else keys[kv_idx]


@dataclasses.dataclass(frozen=True, eq=False)
class _MovedMask(mods.MaskMod):
    """The rest of a mask_mod inside a piece: called with the call's own indices."""

    inner: mods.MaskFn
    b0: int
    r0: int
    keys: Keys
    batch: int

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return mods.evaluate_mask(self.inner, b + self.b0, h, q_idx + self.r0, _key_positions(kv_idx, self.keys))

    def bind(self, **sizes: Any) -> mods.MaskMod:
        return self

    def tiles(self, rows: Tensor, cols: Tensor) -> mods.Tiles:
        if isinstance(self.inner, mods.MaskMod) and isinstance(self.keys, tuple):
            return self.inner.tiles(rows + self.r0, cols + self.keys[0])
        return mods.Tiles.unknown(len(rows), len(cols))

    def tensors(self) -> tuple[Tensor, ...]:
        return self.inner.tensors() if isinstance(self.inner, mods.MaskMod) else ()

    def depends_on(self, batch: int, heads: int) -> tuple[int, int]:
        if not isinstance(self.inner, mods.MaskMod):
            return batch, heads
        b, h = self.inner.depends_on(self.batch, heads)
        return min(b, batch), min(h, heads)

    @property
    def opaque(self) -> bool:
        return not isinstance(self.inner, mods.MaskMod) or self.inner.opaque


class _Proof:
    """Whether a call's score_mod is a bias on the distance (``attnkit.mods.relative.is_distance_bias``), traced at most
    once for all the pieces of the call, and only if a piece's backend asks."""

    __slots__ = ("found", "score_mod")

    def __init__(self, score_mod: mods.ScoreFn | None) -> None:
        self.score_mod: mods.ScoreFn | None = score_mod
        self.found: bool | None = None

    def __call__(self) -> bool:
        if self.found is None:
            self.found = self.score_mod is not None and mods.is_distance_bias(self.score_mod)
        return self.found


def _moved_score(score_mod: mods.ScoreFn, b0: int, r0: int, keys: Keys, proof: _Proof) -> mods.ScoreFn:
    """A score_mod inside a piece, called with the call's own indices; a built-in stays a built-in (a bias such as
    ALiBi stays a bias), a function of the caller's stays one (its tensors found through it); one that reads no
    position (softcap) stays itself, so that a kernel that computes it itself (``tiles:kernel``) still takes it."""
    if not mods.reads_positions(score_mod):
        return score_mod
    if not isinstance(score_mod, mods.ScoreMod):
        return _MovedFn(score_mod, b0, r0, keys, proof)
    if type(score_mod).bias is not mods.ScoreMod.bias:
        return _MovedBias(score_mod, b0, r0, keys, proof)
    return _MovedScore(score_mod, b0, r0, keys, proof)


class _MovedFn:
    """A function of the caller's inside a piece (not a built-in: a backend still assumes it may read tensors that
    require grad, and finds them through this object's attributes)."""

    def __init__(self, inner: Callable[..., Tensor], b0: int, r0: int, keys: Keys, proof: _Proof) -> None:
        self.inner, self.b0, self.r0, self.keys, self.proof = inner, b0, r0, keys, proof

    def __call__(self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return self.inner(score, b + self.b0, h, q_idx + self.r0, _key_positions(kv_idx, self.keys))

    def attnkit_distance_bias(self) -> bool:
        """A bias on the distance where the call's function is one and the piece's keys are one range (moved by a
        constant, the distance moves by one)."""
        return isinstance(self.keys, tuple) and self.proof()


@dataclasses.dataclass(frozen=True, eq=False)
class _MovedScore(mods.ScoreMod):
    inner: mods.ScoreMod
    b0: int
    r0: int
    keys: Keys
    proof: _Proof

    def __call__(self, score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return self.inner(score, b + self.b0, h, q_idx + self.r0, _key_positions(kv_idx, self.keys))

    def attnkit_distance_bias(self) -> bool:
        """As :meth:`_MovedFn.attnkit_distance_bias`."""
        return isinstance(self.keys, tuple) and self.proof()

    def bind(self, **sizes: Any) -> mods.ScoreMod:
        return self

    def tensors(self) -> tuple[Tensor, ...]:
        return self.inner.tensors()


@dataclasses.dataclass(frozen=True, eq=False)
class _MovedBias(_MovedScore):
    def bias(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor | None:
        return self.inner.bias(b + self.b0, h, q_idx + self.r0, _key_positions(kv_idx, self.keys))


def _widen(weights: Tensor, keys: Keys, Lk: int) -> Tensor:
    """A piece's weights ``(B', H, n, m)`` in the call's key positions ``(B', H, n, Lk)``, zeros elsewhere."""
    if isinstance(keys, tuple):
        return F.pad(weights, (keys[0], Lk - keys[1]))  # (B', H, n, Lk)
    out = weights.new_zeros((*weights.shape[:-1], Lk))  # (B', H, n, Lk)
    return out.index_copy(3, keys, weights)  # (B', H, n, Lk)
