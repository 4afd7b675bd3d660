"""Agreeing before the first exchange: each rank checks its own call, all-gathers what it holds, and checks that
the ranks agree (shapes, dtypes, options, masks), so that a mistake on any rank is a ``ValueError`` on every rank
before any block travels; the agreed call is a :class:`~attnkit.distributed.plan.Plan`."""

from __future__ import annotations

import dataclasses
import struct
import zlib
from datetime import timedelta
from typing import Any, NamedTuple

import torch
from torch import Tensor

from attnkit import mods
from attnkit._validate import as_lengths, check_qkv, check_scale, short
from attnkit.backends.common import probe
from attnkit.backends.tiles import online
from attnkit.distributed import comm
from attnkit.distributed.plan import Plan
from attnkit.distributed.sequence import LAYOUTS, check_layout, length, segments

__all__ = ["Request", "agree"]

# B batch, H heads, Hkv key/value heads, D head dim, Dv value head dim, Lq_r/Lk_r the positions this rank holds


class Request(NamedTuple):
    """One rank's call, as given: checked by :func:`agree` against itself and the other ranks."""

    q: Tensor
    k: Tensor
    v: Tensor
    valid_lens: Tensor | None
    is_causal: bool
    scale: float | None
    layout: str
    mask_mod: mods.MaskFn | None = None
    score_mod: mods.ScoreFn | None = None


# --- agreeing before the first exchange --------------------------------------------------------------------

# Everything one rank says about its call; the _AGREED fields must be equal on every rank.
_FIELDS = (
    "B",
    "H",
    "Hkv",
    "D",
    "Dv",
    "Lq_r",
    "Lk_r",
    "dtype",
    "is_causal",
    "layout",
    "scale",
    "lens",
    "grad",
    "mask_mod",
    "score_mod",
)
_AGREED = {
    "B": "the batch size",
    "H": "the number of query heads",
    "Hkv": "the number of key/value heads",
    "D": "the head dim",
    "Dv": "the value head dim",
    "dtype": "the dtype",
    "is_causal": "is_causal",
    "layout": "the layout",
    "scale": "the scale",
    "lens": "valid_lens",
    "grad": "whether gradients are needed",
    "mask_mod": "the mask_mod",
    "score_mod": "the score_mod",
}


def agree(ring: comm.Ring, request: Request, timeout: float | timedelta | None, *, refused: str | None) -> Plan:
    """Check this rank's inputs, all-gather what each rank holds, and check that the ranks agree.

    A rank whose own inputs are wrong still joins the all-gather (flagged), so that every rank raises at once
    instead of the others waiting for blocks that never come. ``refused`` is a caller's reason to refuse this
    rank's call (:class:`RingMultiHeadAttention`'s), raised as a ``ValueError`` in the same way.
    """
    q, valid_lens, is_causal, mask_mod = request.q, request.valid_lens, request.is_causal, request.mask_mod
    score_mod = request.score_mod
    error: Exception | None = None
    mine: dict[str, int] | None = None
    wait = comm.DEFAULT_TIMEOUT
    try:
        wait = comm.as_timeout(timeout)
        if refused is not None:
            raise ValueError(refused)
        mine = _describe(request)
    except Exception as e:  # noqa: BLE001 - every rank must hear of it; gather_checked raises it here
        error = e
    rows = comm.gather_checked(
        None if mine is None else [mine[f] for f in _FIELDS],
        error,
        size=len(_FIELDS),
        who="ring_attention",
        group=ring.group,
        timeout=wait,
        device=q.device if isinstance(q, Tensor) else torch.device("cpu"),
    )
    assert mine is not None  # gather_checked raised otherwise
    theirs = [dict(zip(_FIELDS, row, strict=True)) for row in rows]
    for r, other in enumerate(theirs):
        for field, what in _AGREED.items():
            if other[field] != mine[field]:
                hint = ""
                if field in ("mask_mod", "score_mod"):
                    hint = f" (a {field} sees whole-sequence positions: give every rank the same one)"
                mod = score_mod if field == "score_mod" else mask_mod
                raise ValueError(
                    f"ring_attention: rank {r} and rank {ring.rank} disagree on {what}: rank {r} has "
                    f"{_show(field, other)}, rank {ring.rank} has {_show(field, mine, valid_lens, mod)}{hint}"
                )
    num_queries = sum(t["Lq_r"] for t in theirs)
    num_keys = sum(t["Lk_r"] for t in theirs)
    layout_name = LAYOUTS[mine["layout"]]
    q_ranges = segments(num_queries, ring.size, layout_name)
    k_ranges = segments(num_keys, ring.size, layout_name)
    for r, other in enumerate(theirs):
        for name, n, held, total in (
            ("queries", "Lq_r", q_ranges, num_queries),
            ("keys", "Lk_r", k_ranges, num_keys),
        ):
            expected = length(held[r])
            if other[n] != expected:
                raise ValueError(
                    f"ring_attention: rank {r} holds {other[n]} {name}, but the {layout_name} split of {total} "
                    f"positions over {ring.size} ranks gives it {expected} (shard with shard_sequence(layout="
                    f"{layout_name!r})); ranks hold {[t[n] for t in theirs]}"
                )
    lens = None
    key_limit = num_keys
    if valid_lens is not None:
        lens = as_lengths(valid_lens, "valid_lens", num_keys)  # now that Lk is known: at most Lk
        key_limit = int(lens.max()) if lens.numel() else 0
    sizes = {"batch": mine["B"], "heads": mine["H"], "num_queries": num_queries, "num_keys": num_keys}
    bound_mask = _bound("mask_mod", mask_mod, sizes, ring.rank, q.device)
    bound_score = _bound("score_mod", score_mod, sizes, ring.rank, q.device)
    return Plan(
        ring=ring,
        timeout=wait,
        q_ranges=q_ranges,
        k_ranges=k_ranges,
        offset=num_keys - num_queries,
        is_causal=is_causal,
        valid_lens=lens,
        key_limit=key_limit,
        scale=_from_bits(mine["scale"]),
        block=online.current_settings().block_size,
        mask_mod=bound_mask,
        score_mod=bound_score,
        score_protected=None if score_mod is None else mods.protected_storages(score_mod),
        batch=mine["B"],
        heads=mine["H"],
    )


def _bound(name: str, mod: Any, sizes: dict[str, int], rank: int, device: torch.device) -> Any:
    """A built-in mask_mod or score_mod bound to the whole lengths (every rank agreed on its digest, so every rank
    binds it alike, or raises alike); a function as it is."""
    if mod is None:
        return None
    try:
        return mods.bind(mod, **sizes, device=device)
    except ValueError as e:
        raise ValueError(
            f"ring_attention on rank {rank}: {e} (a {name} sees the whole sequence, {sizes['num_queries']} queries "
            f"and {sizes['num_keys']} keys, not one rank's shard)"
        ) from e


def _describe(request: Request) -> dict[str, int]:
    """This rank's call as integers, after the checks that need no other rank."""
    q, k, v, valid_lens, is_causal, scale, layout, mask_mod, score_mod = request
    if check_qkv(q, k, v):
        raise ValueError(
            f"ring_attention takes (B, H, L_r, D) inputs, got 3 dims: q {tuple(q.shape)}, k {tuple(k.shape)}, "
            f"v {tuple(v.shape)}; add a head axis with q.unsqueeze(1)"
        )
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {is_causal!r}")
    check_layout(layout)
    B, H, Lq_r, D = q.shape
    Hkv, Lk_r, Dv = k.shape[1], k.shape[2], v.shape[3]
    scale = check_scale(D**-0.5 if scale is None else scale)  # the rule of the single-process functions
    lens_hash = 0
    if valid_lens is not None:
        if not isinstance(valid_lens, Tensor) or valid_lens.shape != (B,):
            shape = tuple(valid_lens.shape) if isinstance(valid_lens, Tensor) else type(valid_lens).__name__
            raise ValueError(
                f"ring_attention takes valid_lens of shape (B,) = ({B},), in global positions, got {shape}"
            )
        lens = as_lengths(valid_lens, "valid_lens", 2**62, q.device)  # the upper bound is checked once Lk is known
        lens_hash = hash(tuple(lens.tolist()))  # the same tensor on every rank: compare a digest, not B values
    if score_mod is not None and callable(score_mod):
        _check_score_mod(score_mod, q)
    for name, mod in (("mask_mod", mask_mod), ("score_mod", score_mod)):
        mods.check_callable(name, mod)
        if isinstance(mod, (mods.MaskMod, mods.ScoreMod)):
            for t in mod.tensors():
                if t.device != q.device:
                    raise ValueError(f"{name} {_mod_name(mod)} holds a tensor on {t.device}, but q is on {q.device}")
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    return {
        "B": B,
        "H": H,
        "Hkv": Hkv,
        "D": D,
        "Dv": Dv,
        "Lq_r": Lq_r,
        "Lk_r": Lk_r,
        "dtype": comm.dtype_code(q.dtype),
        "is_causal": int(is_causal),
        "layout": LAYOUTS.index(layout),
        "scale": _to_bits(scale),
        "lens": lens_hash,
        "grad": int(needs_grad),
        "mask_mod": _mod_digest(mask_mod),
        "score_mod": _mod_digest(score_mod),
    }


def _check_score_mod(score_mod: mods.ScoreFn, q: Tensor) -> None:
    """The ring takes no gradient of what a score_mod reads (a bias table that is a parameter): while gradients are
    on, one whose result depends on a tensor needing a gradient is refused. That is seen by running it once on a
    probe and walking its result's graph; a function that does not run on the probe is judged by the tensors it
    holds.

    Raises:
        ValueError: naming the shapes of those tensors.
    """
    if not torch.is_grad_enabled():
        return
    args = probe(q.dtype, q.device)
    try:
        with torch.enable_grad():
            score_mod(*args)
        needing = mods.grad_inputs(score_mod, args, ())  # the leaves its result depends on
    except Exception:  # noqa: BLE001 - it runs on real blocks only: what it holds is all that is known
        try:
            needing = tuple(t for t in mods.read_tensors(score_mod) if t.requires_grad)
        except mods.Uninspectable:
            needing = ()
    if needing:
        shapes = ", ".join(str(tuple(t.shape)) for t in needing)
        raise ValueError(
            f"ring attention takes no gradient of what a score_mod reads, and this one reads tensors needing a "
            f"gradient (of shapes {shapes}): detach them, or run it under torch.no_grad()"
        )


def _mod_digest(mod: mods.MaskFn | mods.ScoreFn | None) -> int:
    """0: no mask_mod (score_mod); an odd number for a function of the caller's (a checksum of its name and code:
    what it closes over cannot be compared); an even one for a built-in (a checksum of its kind, numbers and
    tensors, shapes and values), the same in every process."""
    if mod is None:
        return 0
    if not isinstance(mod, (mods.MaskMod, mods.ScoreMod)):  # odd: its name and code (not what it closes over)
        code = getattr(getattr(mod, "__code__", None), "co_code", b"")
        return 2 * zlib.crc32(getattr(mod, "__qualname__", type(mod).__qualname__).encode() + code) + 1
    sums = [_checksum(t) for t in mod.tensors()]
    return 2 * (1 + zlib.crc32(f"{_mod_name(mod)} {sums}".encode()))  # even


def _checksum(t: Tensor) -> int:
    """A weighted sum of the 16-bit folds of a tensor's values: equal tensors give equal sums on any device, and
    no partial sum can overflow (below 2^32 a term, fewer than 2^31 terms)."""
    x = t.detach().flatten()  # (n,)
    x = x.double().view(torch.int64) if x.is_floating_point() else x.long()  # (n,) values or bit patterns
    x = (x ^ (x >> 16) ^ (x >> 32) ^ (x >> 48)) & 0xFFFF  # (n,)
    weights = torch.arange(x.numel(), device=x.device) % 65521 + 1  # (n,)
    return int((x * weights).sum())


def _mod_name(mod: mods.MaskFn | mods.ScoreFn) -> str:
    """A built-in as the user would write it, tensors by their shapes: ``sliding_window(window=4)``."""
    if not dataclasses.is_dataclass(mod):
        return getattr(mod, "__name__", type(mod).__name__)
    name, parts = type(mod).__name__, []
    for field in dataclasses.fields(mod):
        value = getattr(mod, field.name)
        if field.name == "offset" or value is None:
            continue
        if field.name == "every_one":  # and_masks / or_masks
            name = "and_masks" if value else "or_masks"
        elif isinstance(value, Tensor):
            parts.append(f"{field.name} of shape {tuple(value.shape)}")
        elif isinstance(value, tuple):
            parts += [_mod_name(m) for m in value]
        else:
            parts.append(f"{field.name}={value!r}")
    return f"{name}({', '.join(parts)})"


def _show(
    field: str, f: dict[str, int], valid_lens: Tensor | None = None, mod: mods.MaskFn | mods.ScoreFn | None = None
) -> str:
    """One rank's value of ``field``, as the user would write it (only a digest of another rank's
    ``valid_lens``, ``mask_mod`` and ``score_mod`` travels: this rank's own are shown when given, ``mod``)."""
    if field in ("B", "H", "Hkv", "D", "Dv"):
        return f"q {(f['B'], f['H'], f['Lq_r'], f['D'])}, k {(f['B'], f['Hkv'], f['Lk_r'], f['D'])}, v " + str(
            (f["B"], f["Hkv"], f["Lk_r"], f["Dv"])
        )
    if field == "dtype":
        return comm.dtype_name(f["dtype"])
    if field == "layout":
        return repr(LAYOUTS[f["layout"]])
    if field == "scale":
        return repr(_from_bits(f["scale"]))
    if field == "is_causal" or field == "grad":
        return str(bool(f[field]))
    if field in ("mask_mod", "score_mod"):
        if f[field] == 0:
            return f"no {field}"
        if mod is not None:
            return _mod_name(mod)
        return f"another {field} function" if f[field] % 2 else f"another built-in {field}"
    if f["lens"] == 0:
        return "no valid_lens"
    return "other values" if valid_lens is None else short(valid_lens)


def _to_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _from_bits(n: int) -> float:
    return struct.unpack("<d", struct.pack("<q", n))[0]
