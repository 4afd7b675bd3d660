"""How attnkit reads a transformers call whose sequence is packed or split over ranks.

* Packed documents from ``position_ids`` when a call comes with no mask at all (DeepSpeed Ulysses drops every
  mask and passes the whole sequence's ``position_ids``): :func:`documents_in`.
* Calls inside :func:`attnkit.distributed.context_parallel`, where each rank holds a shard of the sequence and the
  mask transformers builds is of that shard's positions: :func:`split_mask` (what the model's mask function
  returns there) and :func:`split_attention` (the call, as ring attention).

Used by :mod:`attnkit.integrations.transformers`; checked against transformers 5.23.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from attnkit import _context_parallel, mods
from attnkit._validate import describe
from attnkit.functional import Masks
from attnkit.recording import wants_stats

# B batch, H heads, L whole length, L_r this rank's positions, Dv value head dim


def documents_in(
    position_ids: Any, B: int, L: int, mask_mod: mods.MaskFn | None, attn_mask: Tensor | None = None
) -> mods.MaskFn | None:
    """``mask_mod`` and, where ``position_ids (B|1, L)`` hold packed documents, attention within each document.

    One rule for every call whose keys are its queries' own positions: the documents ``position_ids`` say are
    kept apart, whatever mask comes with the call, as transformers does when it builds a mask without a cache and
    as flash-attention-2 does from ``position_ids``. (DeepSpeed Ulysses drops every mask and passes the whole
    sequence's ``position_ids``; transformers' eager and sdpa attend across documents when a cache or a mask of
    its own is passed, and for bidirectional models, whose mask ignores ``position_ids``.)

    They are read as transformers reads packed rows (``masking_utils.find_packed_sequence_indices``): a document
    starts wherever a position does not follow the one before, so a row that counts up by one from anywhere is one
    document; but a position the call's ``attn_mask`` (attnkit's, ``(B|1, H|1, L, L)``) marks as padding, a key no
    query may see, never starts one (transformers gives right padding the position 1: read as documents, its
    queries saw nothing, and generate() continued from zeros). Each call reads them (one wait for the device a
    layer). While torch.compile or another tracer traces, the values cannot be looked at: the call then carries
    the document mask, exact, on a backend that takes a ``mask_mod``.

    Raises:
        ValueError: ``position_ids`` whose batch is neither 1 nor the queries'.
    """
    if not isinstance(position_ids, Tensor) or position_ids.dim() != 2 or position_ids.shape[-1] != L:
        return mask_mod
    if position_ids.shape[0] not in (1, B):
        raise ValueError(f"position_ids must have shape (B, L) or (1, L) = (1|{B}, {L}), got {describe(position_ids)}")
    tracing = torch.compiler.is_compiling() or torch.jit.is_tracing()
    steps = torch.diff(position_ids, prepend=position_ids[:, :1] - 1, dim=-1)  # (B|1, L): 1 within a document
    starts = steps != 1  # (B|1, L)
    if not tracing and not bool(starts.any()):
        return mask_mod  # one document a row
    if attn_mask is not None:
        starts = starts & ~_padding(attn_mask, starts, tracing)  # (B, L)
        if not tracing and not bool(starts.any()):
            return mask_mod
    documents = mods.document(starts.cumsum(dim=-1))  # (B|1, L) ids
    return documents if mask_mod is None else mods.and_masks(mask_mod, documents)


def _padding(attn_mask: Tensor, starts: Tensor, tracing: bool) -> Tensor:
    """Which positions ``attn_mask`` (``(B|1, H|1, L, L)``, attnkit's: ``True`` or finite where a query may see a
    key) marks as padding, keys no query may see, ``(B|1, L)``; read at the positions ``starts`` says begin a
    document only (a few columns; every column while tracing)."""
    seen = attn_mask if attn_mask.dtype == torch.bool else ~torch.isneginf(attn_mask)  # (B|1, H|1, L, L)
    if tracing:
        return ~seen.any(dim=-2).any(dim=1)  # (B|1, L)
    columns = starts.any(dim=0).nonzero()[:, 0]  # (c,): the positions some row starts a document at
    padding = torch.zeros(seen.shape[0], seen.shape[-1], dtype=torch.bool, device=seen.device)  # (B|1, L)
    padding[:, columns] = ~seen[..., columns].any(dim=-2).any(dim=1)  # (B|1, c)
    return padding


# What a model's mask may say inside context_parallel, where the mask transformers builds is of one shard's positions.
_SPLIT_MASKS = "causality, a sliding window and packed documents (from position_ids), set in whole-sequence positions"


def split_mask(config: Any, kwargs: dict[str, Any]) -> Tensor:
    """The mask inside ``context_parallel``, where transformers' mask would be of one shard's positions: a marker
    that carries what :func:`_split_attention` sets in whole-sequence positions instead (a sliding window found in
    the mask), or why the mask cannot be honoured there, which the attention raises on every rank at once.

    What transformers asks for is read from its mask function, a tree of closures (checked against 5.23):
    causality, bidirectional attention, a causal sliding window and packed documents are allowed (documents come
    back from the whole sequence's ``position_ids``: transformers' own reading of a zig-zag shard's ids sees
    documents that are not there); any other function (a prefix's block overlay, a chunked or bidirectional
    window, a model's own ``or``/``and`` masks) and padding are refused."""
    window, reason = None, None
    padding = kwargs.get("attention_mask")
    if isinstance(padding, Tensor) and not bool(padding.all()):
        reason = "padding in attention_mask"
    elif getattr(config, "attention_chunk_size", None):
        reason = "chunked attention"
    else:
        try:
            window = _window_of(kwargs.get("mask_function"))
        except ValueError as e:
            reason = str(e)
    marker = torch.ones((1, 1, 1, 1), dtype=torch.bool)
    marker.attnkit_split = (window, reason)  # type: ignore[attr-defined]
    return marker


# transformers 5.23's mask functions, by qualified name: those a ring can honour in whole-sequence positions
_ALLOWED_MASKS = {
    "causal_mask_function",
    "bidirectional_mask_function",
    "and_masks.<locals>.and_mask",
    "packed_sequence_mask_function.<locals>.inner_mask",
    "remap_positions_for_packed_sequence.<locals>.inner_mask",
    "add_offsets_to_mask_function.<locals>.inner_mask",
    "sliding_window_overlay.<locals>.inner_mask",
}


def _window_of(fn: Any) -> int | None:
    """The causal sliding window in transformers' mask function ``fn`` (``None`` if none); ``ValueError`` naming a
    function of it that is not in ``_ALLOWED_MASKS``. Walks the closures: ``and_masks`` holds its functions in
    a tuple, the others their inner function in a cell."""
    if fn is None:
        return None
    name = getattr(fn, "__qualname__", type(fn).__name__)
    if name not in _ALLOWED_MASKS:
        raise ValueError(f"the model's mask function {name}")
    cells = {c: cell.cell_contents for c, cell in zip(fn.__code__.co_freevars, fn.__closure__ or (), strict=True)}
    if name == "sliding_window_overlay.<locals>.inner_mask":
        return int(cells["sliding_window"])
    inner = [f for v in cells.values() for f in (v if isinstance(v, tuple) else (v,)) if callable(f)]
    windows = [w for f in inner if (w := _window_of(f)) is not None]
    return min(windows) if windows else None


def split_attention(
    runner: _context_parallel.Runner,
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    causal: bool,
    given: tuple,
    backend: str,
    kwargs: dict[str, Any],
    need_weights: bool,
) -> tuple[Tensor, None]:
    """:func:`attention_forward` inside ``context_parallel``: ring attention with the model's masks in
    whole-sequence positions; packed documents from the whole sequence's ``position_ids`` (gathered from every
    rank's shard). What cannot be said there is refused on every rank at once."""
    attention_mask, softcap, s_aux, position_bias, sliding_window, dropout, scaling = given
    refused = None
    window, why = getattr(attention_mask, "attnkit_split", (None, None))
    if attention_mask is not None and not hasattr(attention_mask, "attnkit_split"):
        why = f"an attention mask of shape {tuple(attention_mask.shape)} that attnkit's mask function did not build"
    if why is not None:
        refused = f"{why} cannot be honoured inside context_parallel: attnkit takes {_SPLIT_MASKS} there"
    elif position_bias is not None:
        refused = "a position_bias (T5) cannot be used inside context_parallel"
    elif sliding_window and not causal:
        refused = f"a bidirectional sliding window cannot be used inside context_parallel: it takes {_SPLIT_MASKS}"
    window = window or (sliding_window if causal else None)  # the mask's own, else the one the model passes
    mask_mod: mods.MaskFn | None = mods.sliding_window(window) if window else None
    position_ids = kwargs.get("position_ids")
    if isinstance(position_ids, Tensor) and position_ids.dim() != 2:
        refused = refused or f"position_ids of shape {tuple(position_ids.shape)} (not (B, L)) inside context_parallel"
    elif isinstance(position_ids, Tensor):
        L_r = position_ids.shape[-1]
        own = torch.arange(L_r, device=position_ids.device)  # (L_r,): transformers' default, a shard's 0..L_r-1
        flag = torch.full_like(position_ids, int(bool((position_ids == own).all())))  # (B|1, L_r)
        whole, defaults = runner.whole(torch.stack([position_ids, flag]), dim=-1)  # (2, B|1, L): every rank's
        if whole.shape[-1] > L_r and bool(defaults.all()):  # (a short sequence's would even pass as documents)
            refused = refused or (
                f"position_ids are each shard's own 0..{L_r - 1} on every rank (transformers' default when none are "
                "passed), not the whole sequence's: inside context_parallel pass the whole sequence's position_ids "
                "in context_parallel's buffers, and to the model"
            )
        try:
            mask_mod = documents_in(whole, query.shape[0], whole.shape[-1], mask_mod)  # read as on one process
        except ValueError as e:
            refused = refused or f"{e} inside context_parallel"
    masks = Masks(None, None, causal, mask_mod, mods.softcap(softcap) if softcap else None)
    out = runner.attend(
        query,
        key,
        value,
        masks,
        w_v=None,
        scale=scaling,
        sinks=s_aux,
        dropout_p=float(dropout),
        need_weights=need_weights,
        backend=backend,
        zeros_past=None,
        need_lse=wants_stats(module),
        refused=refused,
    ).output  # (B, H, L_r, Dv)
    return out.transpose(1, 2).contiguous(), None  # (B, L_r, H, Dv)
