"""What the viewer page holds: the weights read into layers and calls, each call's tokens, and the bytes the page
decodes (see :mod:`attnkit.tools.viewer` for what the page shows and what is reduced when).

Nothing here knows about HTML: :func:`collect` and :func:`assign_tokens` check what the user gave and
``attnkit.tools.viewer._encode.encode`` turns it into one JSON-ready dictionary, the page's only input.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

# H heads, Lq/Lk query/key length, B batch, k weights kept per row, tq/tk thumbnail rows/columns

EXACT_CELLS = 1 << 20  # up to this many weights on a page, every one is kept as it is (float32)
MAX_ENTRIES = 4_000_000  # past that, the page keeps at most this many (the largest of each row, 3 bytes each)
MAX_MASK_BYTES = 4 << 20  # distinct mask bitmaps kept, in bytes; past that a matrix's masked cells are not known
THUMB = 64  # a model-view thumbnail has at most this many cells a side (a longer side is averaged in bins)
MAX_KEYS = 65535  # key positions are uint16 on the page
MAX_TOKEN = 60  # characters of a token shown; a longer one is cut, ending in an ellipsis


@dataclass
class Layer:
    """One attention module (or one layer of a 4-D tensor): its calls, each ``(H, Lq, Lk)``, in order."""

    name: str
    calls: list[np.ndarray]
    groups: int = 1  # key/value heads: query heads h and h' share one when h // (H // groups) is the same
    # per call: (query tokens or None, offset of the call's first query in them, key tokens or None)
    tokens: list[tuple[list[str] | None, int, list[str] | None]] = field(default_factory=list)


def collect(weights: Any, example: int) -> tuple[list[Layer], list[str]]:
    """The layers to show and notes on what was left out.

    A mapping (a :class:`~attnkit.layers.WeightRecord`, or ``{name: tensor or list of tensors}`` as saved with
    ``torch.save``) holds, per module, calls of ``(B, H, Lq, Lk)`` or ``(B, Lq, Lk)`` (one head): ``example``
    picks the batch row. A tuple or list of tensors is one per layer (Hugging Face's ``outputs.attentions``), each
    ``(B, H, Lq, Lk)`` or one example's ``(H, Lq, Lk)``; a tuple of such tuples is one per call (``generate``'s
    ``attentions``: a step, then each layer). A tensor or array is ``(Lq, Lk)``, ``(H, Lq, Lk)`` or
    ``(layers, H, Lq, Lk)``.
    """
    if isinstance(example, bool) or not isinstance(example, int):
        raise TypeError(f"example must be a whole number (a row of the batch), got {example!r}")
    if isinstance(weights, Mapping):
        return _from_record(weights, example)
    if isinstance(weights, (list, tuple)):
        per_layer = _per_layer(weights, example)
        if per_layer is not None:
            return _from_record(per_layer, example)
    if example != 0:
        raise ValueError(
            f"example={example} picks a row of a record's batch; a tensor of weights has no batch (it is "
            "(Lq, Lk), (H, Lq, Lk) or (layers, H, Lq, Lk)): select the row first"
        )
    w = _array(weights, "weights")
    if w.ndim not in (2, 3, 4):
        raise ValueError(f"weights must be (Lq, Lk), (H, Lq, Lk) or (layers, H, Lq, Lk), got shape {w.shape}")
    _check_values(w, "weights")
    w = w.reshape((1,) * (4 - w.ndim) + w.shape)  # (layers, H, Lq, Lk)
    if len(w) == 1:
        return [Layer("attention", [w[0]])], []
    return [Layer(f"layer {i}", [w[i]]) for i in range(len(w))], []


_NO_WEIGHTS = (
    "a Hugging Face model returns attention weights only from eager attention (or attnkit's): load it with "
    'attn_implementation="eager" (or call model.set_attn_implementation("eager"), or "attnkit" after '
    "attnkit.integrations.transformers.register()), then pass output_attentions=True"
)


def _per_layer(weights: list | tuple, example: int) -> dict[str, list[Any]] | None:
    """``{"layer i": [its calls, each (B, H, Lq, Lk)]}`` from a tuple of layers or a tuple of calls of layers;
    ``None`` when ``weights`` is rather one array written as nested lists (``[[0.5, 0.5], [1, 0]]``, or a list
    of ``(Lq, Lk)`` heads), which is read as before."""
    if not weights:
        raise ValueError(f"weights is an empty {type(weights).__name__}: no layer to show; {_NO_WEIGHTS}")
    nested = all(isinstance(s, (list, tuple)) for s in weights)
    if nested and not any(weights):  # generate's attentions without weights: a () per step
        raise ValueError(f"weights[0] is an empty {type(weights[0]).__name__}: no layer to show; {_NO_WEIGHTS}")
    steps = nested and any(_is_array(t) or t is None for s in weights for t in s)
    if not steps and not any((_is_array(t) and t.ndim >= 3) or t is None for t in weights):
        return None
    calls = weights if steps else [weights]  # [call][layer]
    n = len(calls[0])
    for c, step in enumerate(calls):
        if len(step) != n:
            raise ValueError(
                f"weights[{c}] holds {len(step)} layers but weights[0] holds {n}: a tuple of calls (as generate "
                f"returns) holds every layer at every call"
            )
    out: dict[str, list[Any]] = {}
    for i in range(n):
        layer: list[Any] = []
        out[f"layer {i}"] = layer
        for c, step in enumerate(calls):
            t = step[i]
            where = f"weights[{c}][{i}]" if steps else f"weights[{i}]"
            if t is None:
                raise ValueError(f"{where} is None; {_NO_WEIGHTS}")
            if not _is_array(t):
                raise TypeError(f"{where}: a layer's weights must be a tensor or an array, got {type(t).__name__}")
            if t.ndim == 3:  # one example's (H, Lq, Lk)
                if example != 0:
                    raise ValueError(
                        f"example={example} picks a row of the batch, but {where} is one example's (H, Lq, Lk) "
                        f"weights, shape {tuple(t.shape)}: give (B, H, Lq, Lk) or leave example at 0"
                    )
                t = t[None]  # (1, H, Lq, Lk)
            elif t.ndim != 4:
                raise ValueError(
                    f"{where} (layer {i}) has shape {tuple(t.shape)}: each layer's weights are (B, H, Lq, Lk) or "
                    "(H, Lq, Lk)"
                )
            layer.append(t)
    return out


def _is_array(x: Any) -> bool:
    return isinstance(x, (torch.Tensor, np.ndarray))


def _from_record(record: Mapping, example: int) -> tuple[list[Layer], list[str]]:
    if not record:
        raise ValueError("the record holds no weights: nothing was called inside record_weights, or no module in it")
    calls_of = getattr(record, "calls", None)
    read: list[tuple[str, list[np.ndarray], list[tuple[int, int] | None]]] = []  # name, calls, storage per call
    for name in record:
        if not isinstance(name, str):
            raise TypeError(f"a record's keys are module names (strings), got {name!r}")
        value = calls_of(name) if callable(calls_of) else record[name]
        calls = list(value) if isinstance(value, (list, tuple)) else [value]
        shown = name or "(model)"
        if not calls:
            raise ValueError(f"layer {shown!r}: no calls recorded")
        kept: list[np.ndarray] = []
        ptrs: list[tuple[int, int] | None] = []
        for c, t in enumerate(calls):
            where = f"layer {shown!r}" + (f" call {c}" if len(calls) > 1 else "")
            w = _array(t, where)
            if w.ndim not in (3, 4):
                raise ValueError(
                    f"{where}: a record holds (B, H, Lq, Lk) or (B, Lq, Lk) weights per call, got shape {w.shape}"
                )
            if not 0 <= example < w.shape[0]:
                raise ValueError(f"example {example} does not exist: {where} has a batch of {w.shape[0]}: {w.shape}")
            row = w[example] if w.ndim == 4 else w[example][None]  # (H, Lq, Lk)
            _check_values(row, where)
            if kept and row.shape[0] != kept[0].shape[0]:
                raise ValueError(
                    f"{where}: the calls of a layer have one number of heads, got {row.shape[0]} after "
                    f"{kept[0].shape[0]}: {w.shape}"
                )
            kept.append(row)
            ptrs.append((t.untyped_storage().data_ptr(), w.ndim) if isinstance(t, torch.Tensor) else None)
        read.append((shown, kept, ptrs))
    # attnkit.d2l.MultiHeadAttention reports its weights twice, in attnkit's layout (B, H, Lq, Lk) and, through its
    # inner attention (called first), as the book's (B*H, Lq, Lk): one tensor, two views. Shown once, as (B, H, ...).
    four_dims: dict[tuple[int, ...], str] = {}
    for shown, _, ptrs in read:
        storage = _storage(ptrs, 4)
        if storage is not None:
            four_dims.setdefault(storage, shown)
    layers, notes = [], []
    for shown, kept, ptrs in read:
        storage = _storage(ptrs, 3)
        twin = None if storage is None else four_dims.get(storage)
        if twin is not None:
            notes.append(f"layer {shown!r} holds the weights of {twin!r} in the book's layout; shown once")
        else:
            layers.append(Layer(shown, kept))
    return layers, notes


def _storage(ptrs: list[tuple[int, int] | None], ndim: int) -> tuple[int, ...] | None:
    """The storage addresses of a layer's calls when every call is a tensor of ``ndim`` dims, else ``None``."""
    addresses = []
    for p in ptrs:
        if p is None or p[1] != ndim:
            return None
        addresses.append(p[0])
    return tuple(addresses)


def _array(x: Any, name: str) -> np.ndarray:
    if isinstance(x, torch.Tensor):
        if x.is_complex() or x.dtype == torch.bool:
            raise TypeError(f"{name}: weights must be real numbers, got dtype {x.dtype}")
        return x.detach().to("cpu", torch.float32).numpy()
    if isinstance(x, np.ndarray) and (x.dtype.kind not in "fiu"):
        raise TypeError(f"{name}: weights must be real numbers, got dtype {x.dtype}")
    try:
        return np.asarray(x, dtype=np.float32)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name}: weights must be a tensor or an array of numbers, got {type(x).__name__}") from e


def _check_values(w: np.ndarray, name: str) -> None:
    if 0 in w.shape:
        raise ValueError(f"{name}: the weights are empty, shape {w.shape}")
    if w.shape[-1] > MAX_KEYS:
        raise ValueError(f"{name}: {w.shape[-1]} keys, more than the {MAX_KEYS} the viewer shows: shape {w.shape}")
    bad = ~np.isfinite(w)
    if bad.any():
        raise ValueError(f"{name}: {int(bad.sum())} weights are NaN or infinite, of shape {w.shape}")
    low = float(w.min())
    if low < 0:
        raise ValueError(f"{name}: weights must be >= 0 (attention weights), the smallest is {low:g}: shape {w.shape}")


# ---------------------------------------------------------------------------------------------------- tokens


def labels(tokens: Any, name: str) -> list[str]:
    """``tokens`` as strings cut for display, or a TypeError naming ``name``."""
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, (Sequence, np.ndarray, torch.Tensor)):
        raise TypeError(f"{name} must be a sequence of tokens (a list, e.g. text.split()), got {type(tokens).__name__}")
    out = []
    for t in tokens:
        text = str(t.item() if isinstance(t, (np.generic, torch.Tensor)) else t)
        out.append(text if len(text) <= MAX_TOKEN else text[: MAX_TOKEN - 1] + "\u2026")
    return out


def assign_tokens(
    layers: list[Layer],
    tokens: Any,
    query_tokens: Any,
    key_tokens: Any,
    layer_tokens: Mapping[str, Any] | None,
) -> None:
    """Give every call of every layer its query and key tokens (``Layer.tokens``), by the rules of
    :func:`attnkit.tools.viewer.view`; a list that does not cover exactly the positions of the calls it labels is a
    ValueError naming it, the layer and the lengths."""
    if tokens is not None and (query_tokens is not None or key_tokens is not None):
        raise ValueError("give tokens (the same for queries and keys) or query_tokens/key_tokens, not both")
    both = None if tokens is None else labels(tokens, "tokens")
    q_all = None if query_tokens is None else labels(query_tokens, "query_tokens")
    k_all = None if key_tokens is None else labels(key_tokens, "key_tokens")
    per_layer = dict(layer_tokens or {})
    names = [layer.name for layer in layers]
    unknown = [n for n in per_layer if n not in names]
    if unknown:
        raise ValueError(f"layer_tokens names layers that are not shown: {unknown}; the layers are {names}")
    for layer in layers:
        if layer.name in per_layer:
            given = per_layer[layer.name]
            what = f"layer_tokens[{layer.name!r}]"
            if _is_pair(given):
                q, k = labels(given[0], what + "[0]"), labels(given[1], what + "[1]")
                _label(layer, None, q, k, (what + "[0]", what + "[1]"))
            else:
                _label(layer, labels(given, what), None, None, (what, what))
        else:
            _label(
                layer, both, q_all, k_all, ("tokens", "tokens") if both is not None else ("query_tokens", "key_tokens")
            )


def _is_pair(given: Any) -> bool:
    """``(query tokens, key tokens)`` rather than one list of tokens."""
    return (
        isinstance(given, (tuple, list))
        and len(given) == 2
        and all(isinstance(g, (Sequence, np.ndarray, torch.Tensor)) and not isinstance(g, (str, bytes)) for g in given)
    )


def _label(
    layer: Layer, both: list[str] | None, q: list[str] | None, k: list[str] | None, what: tuple[str, str]
) -> None:
    """Set ``layer.tokens``. Keys are always the first ``Lk`` of the key list (a cache only grows). Queries:
    self-attention (``both``, or no tokens on a layer whose calls fit it) stands at the end of the keys (bottom
    right, as a cache's new positions); otherwise each call's queries continue the previous call's, starting over
    when the list is used up (a whole sequence, then decoding steps of one query each)."""
    shapes = [c.shape[1:] for c in layer.calls]  # (Lq, Lk) per call
    lk_max = max(lk for _, lk in shapes)
    lq_max = max(lq for lq, _ in shapes)
    where = f"layer {layer.name!r}"
    many = len(shapes) > 1
    shape_text = ", ".join(f"({lq}, {lk})" for lq, lk in shapes[:4]) + (", ..." if len(shapes) > 4 else "")
    keys = both if both is not None else k
    if keys is not None and len(keys) != lk_max:
        raise ValueError(
            f"{what[1]} has {len(keys)} tokens but {where} has {lk_max} keys"
            + (" in its longest call" if many else "")
            + f": (Lq, Lk) {shape_text}"
        )
    self_attention = both is not None or (q is None and k is None and all(lq <= lk for lq, lk in shapes))
    layer.tokens = []
    if self_attention:
        for lq, lk in shapes:
            if lq > lk:
                raise ValueError(
                    f"{what[0]}: {where} has a call with more queries than keys, (Lq, Lk) ({lq}, {lk}): "
                    "give query_tokens and key_tokens"
                )
            layer.tokens.append((both, lk - lq, keys))
        return
    length = len(q) if q is not None else lq_max
    if q is not None and lq_max > length:
        raise ValueError(
            f"{what[0]} has {len(q)} tokens but {where} has {lq_max} queries"
            + (" in its longest call" if many else "")
            + f": (Lq, Lk) {shape_text}"
        )
    position, reach = 0, 0
    for lq, _ in shapes:
        if position + lq > length:
            position = 0
        layer.tokens.append((q, position, keys))
        position += lq
        reach = max(reach, position)
        if position == length:
            position = 0
    if q is not None and reach != length:
        raise ValueError(
            f"{what[0]} has {len(q)} tokens but the queries of {where} reach {reach}: (Lq, Lk) {shape_text}"
        )


def check_groups(layers: list[Layer], kv_heads: Any) -> None:
    """Set ``Layer.groups`` from ``kv_heads``: a whole number for every layer, or ``{layer name: number}``."""
    if kv_heads is None:
        return
    per_layer = dict(kv_heads) if isinstance(kv_heads, Mapping) else {layer.name: kv_heads for layer in layers}
    names = [layer.name for layer in layers]
    unknown = [n for n in per_layer if n not in names]
    if unknown:
        raise ValueError(f"kv_heads names layers that are not shown: {unknown}; the layers are {names}")
    for layer in layers:
        if layer.name not in per_layer:
            continue
        value = per_layer[layer.name]
        try:
            if isinstance(value, bool):
                raise TypeError
            groups = operator.index(value)
        except TypeError as e:
            raise TypeError(f"kv_heads must be a whole number of key/value heads, got {value!r}") from e
        H = layer.calls[0].shape[0]
        if groups < 1 or H % groups:
            raise ValueError(
                f"kv_heads={groups} must divide the {H} heads of layer {layer.name!r} (query heads h share key/value "
                f"head h // (H // kv_heads))"
            )
        layer.groups = groups


# -------------------------------------------------------------------------------------------------- encoding
