"""The plan of a call's mask, as FlexAttention's ``BlockMask``: the one place where the tile structure is worked out.

A :class:`Plan` classifies each tile of ``BLOCK`` queries x ``BLOCK`` keys as hidden (never touched), visible in full
(``FULL``: no mask to build), a square tile on the diagonal that is exactly causal (``CAUSAL``), or partly visible
(``MASKED``), from index ranges where the mask's parts say (:meth:`attnkit.masks.Mask.tiles`: ``valid_lens``,
``is_causal``, sliding windows, prefixes, documents) and by evaluating the mask on the tiles only looking can tell (a
user's ``mask_mod``, a boolean ``attn_mask``), a block of rows at a time; looking, it learns which keys some query may
see and which queries see some key (:attr:`attnkit.masks.Mask.liveness`). It knows when the whole mask is causal
self-attention, whatever its parts (a user's ``q_idx >= kv_idx``): :func:`attnkit.functional.attend` then gives the
call ``is_causal`` instead, which PyTorch's fused kernels run. The tile engine (:mod:`attnkit.backends.tiles`) runs
on it: the C++ kernel takes its blocks and runs, the online softmax its key spans (:meth:`Plan.spans`).

A plan is built once a call, and kept for the calls after where the mask is a function of the indices alone (a
built-in mask_mod that reads no tensor, such as ``sliding_window``, with or without ``is_causal``): on the mask_mod
object the caller holds (its copies bound to each call share it), which every layer and decoding step passes again.
:func:`make_plan` builds one the caller holds and passes to every call itself (``plan=``), as FlexAttention's
``create_block_mask``. Nothing is kept in this module.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from attnkit import mods
from attnkit._validate import check_whole, ranges
from attnkit.masks import Mask

__all__ = [
    "BLOCK",
    "CAUSAL",
    "FULL",
    "MASKED",
    "ROW_STEP",
    "Plan",
    "Rows",
    "Run",
    "Span",
    "key_blocks",
    "make_plan",
    "plan_of",
]

# B batch, H heads, Lq/Lk query/key length, n a block's queries, m a run's keys

# Queries and keys of one tile. 256 x 256: a causal or windowed mask leaves few partly visible tiles, and a kernel's
# own blocks fit in a tile many times (docs/benchmarks.md, "Flexible attention").
BLOCK = 256

# Which query rows each block of keys needs, for the online softmax's spans, is worked out for blocks of this many
# rows (from index ranges only).
ROW_STEP = 64

# The booleans of its masked tiles a kept plan keeps for the calls after (16 MiB), and the plans kept on one
# mask_mod object (its calls' shapes: a model's layers share one, a decode loop adds one a length until it runs out).
KEPT_MASK_ELEMENTS = 2**24
KEPT_PLANS = 8

# What a run of keys is to a block of queries: every pair visible; a square tile on the diagonal whose mask is
# exactly causal (a kernel's own ``is_causal`` skips its hidden half); some pairs visible.
FULL, CAUSAL, MASKED = "full", "causal", "masked"


class Run(NamedTuple):
    """Keys ``[j0, j1)`` seen by a block of queries, and how (``FULL``, ``CAUSAL`` or ``MASKED``)."""

    j0: int
    j1: int
    kind: str


class Rows(NamedTuple):
    """A block of queries ``[r0, r1)`` and its runs of keys, in order."""

    r0: int
    r1: int
    runs: tuple[Run, ...]


class Span(NamedTuple):
    """One block of keys ``[j0, j1)`` and the rows ``[r0, r1)`` that may see some of it; ``every``: every one of
    these rows sees every one of these keys (no mask to build)."""

    j0: int
    j1: int
    r0: int
    r1: int
    every: bool


class BlockMask(Protocol):
    """What :func:`key_blocks` needs of a mask (:class:`attnkit.masks.Mask` is one; ring attention's shards too):
    ``tiles`` says, from index ranges only, which blocks are hidden or visible in full."""

    def tiles(self, rows: Tensor, cols: Tensor) -> mods.Tiles: ...


@dataclasses.dataclass(eq=False)
class Plan:
    """A mask's tiles (see the module docstring): ``rows``, each block of queries and its runs of keys; the
    ``liveness`` it learned (:attr:`attnkit.masks.Mask.liveness`); ``causal_throughout``: the mask is causal
    self-attention and nothing else; ``key``: the mask it was made for, as :attr:`~attnkit.masks.Mask.index_key`
    and the tile size (``None``: one call's mask, kept for no other). A kept plan keeps the booleans of its masked
    tiles as it meets them (:meth:`tile`, within ``KEPT_MASK_ELEMENTS``), and the online softmax's spans
    (:meth:`spans`)."""

    num_queries: int
    num_keys: int
    rows: tuple[Rows, ...]
    liveness: tuple[Tensor | None, Tensor | None]
    causal_throughout: bool
    key: tuple[object, ...] | None = None
    mask: Mask | None = dataclasses.field(default=None, repr=False)  # what make_plan made it from (plan=)
    _masks: dict[tuple[int, ...], Tensor] = dataclasses.field(default_factory=dict, repr=False)
    _elements: int = dataclasses.field(default=0, repr=False)
    _spans: dict[tuple[int, int, int], list[Span]] = dataclasses.field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, mask: Mask, key: tuple[object, ...] | None = None) -> Plan:
        """The plan of ``mask`` (looking at the tiles only looking can tell: the mask learns its liveness)."""
        rows = _blocks(mask)
        return cls(mask.num_queries, mask.num_keys, tuple(rows), mask.liveness, _causal_throughout(rows, mask), key)

    def tile(
        self, mask: Mask, r0: int, r1: int, j0: int, j1: int, dtype: torch.dtype, *, every: bool
    ) -> tuple[Tensor | None, Tensor | None]:
        """``mask.tile(...)`` (:meth:`~attnkit.masks.Mask.tile`): the ``allowed`` and ``bias`` of queries
        ``[r0, r1)`` and keys ``[j0, j1)``, each ``(B|1, H|1, n|1, m)`` or ``None``; a kept plan, or one the caller
        holds (:func:`make_plan`), keeps ``allowed`` for the calls after, within its budget (the same function of
        the indices in every layer and step), by the call's examples and heads."""
        keeps = self.key is not None or self.mask is not None
        where = (r0, j0, j1, mask.batch, mask.heads)
        if keeps and not every and where in self._masks:
            return self._masks[where], None  # (B|1, H|1, n|1, m); a kept plan's mask has no bias
        allowed, bias = mask.tile(r0, r1, j0, j1, dtype, every=every)  # (B|1, H|1, n|1, m) | None each
        if (
            keeps
            and allowed is not None
            and bias is None
            and not torch.is_inference_mode_enabled()  # (inference tensors: a training call could not save them)
            and self._elements + allowed.numel() <= KEPT_MASK_ELEMENTS
        ):
            self._masks[where] = allowed
            self._elements += allowed.numel()
        return allowed, bias

    def spans(self, mask: BlockMask, cols: tuple[int, int], block: int) -> list[Span]:
        """The online softmax's view: :func:`attnkit.plan.key_blocks` of ``mask`` over the keys ``cols``, kept on
        the plan."""
        found = self._spans.get((*cols, block))
        if found is None:
            found = self._spans[(*cols, block)] = key_blocks(mask, self.num_queries, cols, block)
        return found

    @property
    def share(self) -> float:
        """The share of the ``Lq x Lk`` pairs its visible tiles hold (what an engine that skips hidden tiles
        scores: a causal tile counts whole); 0 without pairs."""
        pairs = self.num_queries * self.num_keys
        seen = sum((r.r1 - r.r0) * (run.j1 - run.j0) for r in self.rows for run in r.runs)
        return seen / pairs if pairs else 0.0

    def distances(self) -> tuple[int, int]:
        """The distances ``q_idx - kv_idx`` of the pairs in its tiles, ``[d0, d1)`` (where a bias on the distance is
        evaluated: on the pairs the engine evaluates a score_mod on)."""
        d0, d1 = 0, 1
        for rows in self.rows:
            for run in rows.runs:
                d0, d1 = min(d0, rows.r0 - (run.j1 - 1)), max(d1, rows.r1 - run.j0)
        return d0, d1


# (plans kept on a caller's mask_mod: made under a lock, as two threads may share one)
_KEEPING = threading.Lock()


def plan_of(mask: Mask) -> Plan:
    """The plan of a call's ``mask``: the one given with the call (``plan=``), else the one its mask_mod keeps for
    masks of the same indices (:attr:`~attnkit.masks.Mask.index_key`), else a new one (kept on that mask_mod, the
    caller's object, where the mask is a function of the indices alone); then on the mask, for the call's backward
    and its other readers."""
    if isinstance(mask.plan, Plan):
        return mask.plan
    # (a plan made under inference mode holds inference tensors, which a later call under autograd may not save:
    # kept only from calls outside it)
    index_key = None if torch.is_inference_mode_enabled() else mask.index_key
    key = None if index_key is None else (*index_key, BLOCK)
    holder = _holder(mask) if key is not None else None
    found = None
    if holder is not None:
        with _KEEPING:
            found = holder.pop(key, None)
            if found is not None:
                holder[key] = found  # (the most recently used last: the least recently used goes first)
    if found is None:
        found = Plan.build(mask, key if holder is not None else None)
        if holder is not None:
            with _KEEPING:
                holder[key] = found
                while len(holder) > KEPT_PLANS:
                    holder.pop(next(iter(holder)))
    mask.__dict__.setdefault("liveness", found.liveness)  # (functools.cached_property keeps its value there)
    mask.plan = found
    return found


def _holder(mask: Mask) -> dict[object, Plan] | None:
    """Where the plans of a mask's mask_mod are kept: a dict on the object the caller passed, which the copy bound
    to this call points back to (:func:`attnkit.mods.bind`); ``None`` for a mask without a built-in mask_mod."""
    mod = mask.mask_mod
    if not isinstance(mod, mods.MaskMod):
        return None
    origin = getattr(mod, "attnkit_origin", mod)
    return origin.__dict__.setdefault("attnkit_plans", {})  # type: ignore[no-any-return]


def make_plan(
    num_queries: int,
    num_keys: int,
    *,
    mask_mod: mods.MaskFn | None = None,
    is_causal: bool = False,
    batch: int = 1,
    heads: int = 1,
    device: torch.device | str | None = None,
) -> Plan:
    """A plan to pass to every call of these lengths that shares its mask (``plan=``), as FlexAttention's
    ``create_block_mask``: the mask's tiles looked at once, and the booleans of its partly visible tiles kept on the
    plan (within 16 MiB) for the calls after; a model's layers share it. (A decoding step's lengths change with each
    token: a built-in mask_mod such as ``sliding_window`` keeps each length's plan on itself, with no ``plan=``.)

    Args:
        num_queries, num_keys: ``Lq``, ``Lk`` of the calls it serves.
        mask_mod: ``mask_mod(b, h, q_idx, kv_idx) -> bool`` (:mod:`attnkit.mods`); the plan's tiles are looked
            at when it is made, the booleans of its partly visible tiles at its first call, and the engines that
            evaluate the mask_mod in each call (``sdpa``'s dense mask) read it again: the mask must stay as it
            was, and a function of tensors that change between calls needs a plan of its own each time (as a
            FlexAttention ``BlockMask`` does), or the engines disagree. Padding (``valid_lens``) goes into it too
            (``mods.and_masks``), as the call takes no other mask beside a plan.
        is_causal: causal, aligned to the bottom right.
        batch, heads: ``B`` and ``H`` of the calls, where the mask_mod depends on them (``mods.document`` of ids
            for each example: their ``B``); ``1``, the default, promises that it does not: the plan then serves
            calls of any ``B`` and ``H``.
        device: where the calls run (``None``: PyTorch's default device).

    Returns:
        A :class:`Plan`; ``scaled_dot_product_attention(q, k, v, plan=plan)`` takes its mask from it.

    Raises:
        TypeError, ValueError: an argument that is not what it says, naming it.

    Example:
        >>> from attnkit import mods
        >>> plan = make_plan(1024, 1024, mask_mod=mods.sliding_window(64))
        >>> [(r.runs[0].j0, r.runs[-1].j1) for r in plan.rows], round(plan.share, 3), plan.causal_throughout
        ([(0, 256), (0, 512), (256, 768), (512, 1024)], 0.438, False)
    """
    sizes = {"num_queries": num_queries, "num_keys": num_keys}
    Lq, Lk = (check_whole(name, value, minimum=0) for name, value in sizes.items())
    B, H = check_whole("batch", batch), check_whole("heads", heads)
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be True or False, got {is_causal!r}")
    try:
        where = torch.empty(0).device if device is None else torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"device must name a device (such as 'cpu' or 'cuda:0'), got {device!r}") from error
    if where.type == "meta":
        raise ValueError("device must hold values to plan from (the mask is evaluated), got 'meta'")
    # (made outside inference mode, so that a training call can save what the plan holds)
    with torch.inference_mode(False):
        try:
            mask = Mask.build(
                batch=B, heads=H, num_queries=Lq, num_keys=Lk, is_causal=is_causal, mask_mod=mask_mod, device=where
            )
        except ValueError as error:
            raise ValueError(f"{error} (make_plan's batch and heads are the calls' B and H)") from None
        found = Plan.build(mask, None if mask.index_key is None else (*mask.index_key, BLOCK))
    found.mask = mask  # (the mask it was made from, which the calls take)
    return found


def key_blocks(mask: BlockMask, num_queries: int, cols: tuple[int, int], block: int) -> list[Span]:
    """The blocks of ``block`` keys in ``cols`` that some query may see, each with the span of rows that may see it
    (worked out for blocks of ``ROW_STEP`` rows, from index ranges: nothing is evaluated). Causal attention skips
    the rows above the diagonal, a sliding window all but a band, packed documents all but one document."""
    rows = ranges(0, num_queries, ROW_STEP)  # (nq, 2)
    col_ranges = ranges(*cols, block)  # (nk, 2)
    if not len(rows) or not len(col_ranges):
        return []
    known = mask.tiles(rows, col_ranges)  # (nq, nk) each
    spans = []
    for c, (j0, j1) in enumerate(col_ranges.tolist()):
        seen = known.some[:, c].nonzero()[:, 0]  # the row blocks that may see some of these keys
        if not len(seen):
            continue
        first, last = int(seen[0]), int(seen[-1])
        every = bool(known.every[first : last + 1, c].all())
        spans.append(Span(j0, j1, int(rows[first, 0]), int(rows[last, 1]), every))
    return spans


def _blocks(mask: Mask) -> list[Rows]:
    """Each block of ``BLOCK`` queries and the runs of keys it sees (:meth:`~attnkit.masks.Mask.classify`)."""
    rows, cols = ranges(0, mask.num_queries, BLOCK), ranges(0, mask.num_keys, BLOCK)  # (nq, 2), (nk, 2)
    if not len(rows) or not len(cols):
        return []
    known = mask.classify(rows, cols)  # (nq, nk) each
    some, every = known.some.tolist(), known.every.tolist()  # (lists: indexing a tensor per tile is slow)
    blocks = []
    for r, (r0, r1) in enumerate(rows.tolist()):
        runs: list[Run] = []
        for c, (j0, j1) in enumerate(cols.tolist()):
            if not some[r][c]:
                continue
            kind = FULL if every[r][c] else CAUSAL if _causal_tile(mask, r0, r1, j0, j1) else MASKED
            if runs and runs[-1].j1 == j0 and runs[-1].kind == kind != CAUSAL:
                runs[-1] = Run(runs[-1].j0, j1, kind)
            else:
                runs.append(Run(j0, j1, kind))
        blocks.append(Rows(r0, r1, tuple(runs)))
    return blocks


def _causal_tile(mask: Mask, r0: int, r1: int, j0: int, j1: int) -> bool:
    """Whether the tile is square, on the diagonal of the call (query ``p`` beside key ``p + Lk - Lq``), and its
    mask exactly causal there: what a kernel's ``is_causal`` hides in a square call. Looked at once a plan."""
    if j0 - r0 != mask.num_keys - mask.num_queries or j1 - j0 != r1 - r0 or mask.bias is not None:
        return False
    allowed = mask.allowed_tile(r0, r1, j0, j1)  # (B|1, H|1, n|1, m) or None
    if allowed is None:
        return False
    n = r1 - r0
    lower = torch.ones(n, n, dtype=torch.bool, device=allowed.device).tril()  # (n, n)
    return bool((allowed == lower).all())


def _causal_throughout(rows: list[Rows], mask: Mask) -> bool:
    """Every block of queries sees the keys before its tile on the diagonal in full, that tile as causal, nothing
    after it: the whole mask is causal self-attention (and no float mask, which a causal kernel would not add)."""
    if mask.num_queries != mask.num_keys or mask.bias is not None:
        return False
    for r in rows:
        runs = ((Run(0, r.r0, FULL),) if r.r0 else ()) + (Run(r.r0, r.r1, CAUSAL),)
        if r.runs != runs and not (r.r1 - r.r0 == 1 and r.runs == (Run(0, r.r1, FULL),)):  # (a last tile 1 x 1)
            return False
    return True
