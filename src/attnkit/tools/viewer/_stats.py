"""The viewer's page of a statistics record (:func:`attnkit.record_stats`): per layer x head summaries, each
query's strongest keys, and the series along the sequence (see :func:`attnkit.tools.viewer.view`)."""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from attnkit.recording import StatsRecord
from attnkit.tools.viewer._data import labels
from attnkit.tools.viewer._encode import _Blobs

__all__ = ["ENTRY_BYTES", "SERIES_BINS", "encode", "is_stats"]

# H heads, Lq/Lk query/key length, k top entries a row keeps on the page

# The page keeps each row's strongest keys up to this many bytes in all, deflated (see _top): under 25 MB of page for
# 8 layers x 8 heads x 32,768 queries.
ENTRY_BYTES = 14_000_000
# Series along the sequence (entropy, distance, sink mass per query; weight received per key) are averaged into at
# most this many bins a head (column sums: the largest of each bin too).
SERIES_BINS = 1024


def is_stats(record: Any) -> bool:
    """A statistics record, or what ``StatsRecord.save`` wrote (loaded back)."""
    return isinstance(record, StatsRecord) or (isinstance(record, Mapping) and record.get("attnkit_stats") == 1)


def encode(
    record: Any,
    tokens: Sequence[Any] | None,
    example: int,
    title: str,
    rollout: Any = None,
    sweep: Any = None,
) -> dict[str, Any]:
    """The page's data: for each layer its calls, each with its summaries, series and top entries as blobs; with
    ``rollout`` (:func:`attnkit.rollout`'s result) each target's relevance over the positions, float32 blobs; with
    ``sweep`` (:func:`attnkit.head_sweep`'s) its layer x head table of logit changes."""
    if isinstance(example, bool) or not isinstance(example, int):
        raise TypeError(f"example must be a whole number (a row of the batch), got {example!r}")
    if not isinstance(record, StatsRecord):
        record = StatsRecord.from_dict(dict(record))
    if not len(record):
        raise ValueError("the statistics record is empty: no attention module was called inside record_stats")
    names = list(record)
    calls = {n: record.calls(n) for n in names}
    # statistics without a head axis (the book's inner attention over (B*H) rows, or a one-head layer): left out
    # beside layers with heads (their outer layer is shown), else shown as one head each
    headless = [n for n in names if calls[n][-1].entropy.dim() != 3]
    if len(headless) < len(names):
        names = [n for n in names if n not in headless]
    else:
        calls = {n: [_one_head(s) for s in calls[n]] for n in names}
    for n in names:
        for s in calls[n]:
            if s.entropy.dim() != 3:
                raise ValueError(f"{n or '(model)'!r}: its calls' statistics do not all have a head axis")
            if not 0 <= example < s.entropy.shape[0]:
                raise ValueError(f"example {example} is past the batch of {s.entropy.shape[0]} in {n or '(model)'!r}")
    rows = sum(s.entropy.shape[1] * s.entropy.shape[2] for n in names for s in calls[n])
    token_list = None if tokens is None else labels(tokens, "tokens")
    if token_list is not None:
        _check_tokens(token_list, names, calls, example)
    k_page, tops, size = _fitted(names, calls, example, record.topk)
    blobs = _Blobs()
    layers = []
    for n in names:
        encoded = [_call(s, example, top, blobs) for s, top in zip(calls[n], tops[n], strict=True)]
        first = calls[n][-1]
        layers.append(
            {"name": n or "(model)", "heads": int(first.entropy.shape[1]), "kv": first.kv_heads, "calls": encoded}
        )
    left_out = [n for n in headless if n not in names]
    notes = [
        f"Statistics of every query row, from attnkit.record_stats (top-{record.topk}, sink mass over the first "
        f"{record.sink_keys} keys): no weight matrix was kept. Summaries average the rows that see some key.",
    ]
    if left_out:
        notes.append(
            f"Left out, having no head axis (the book's inner attention: its layer is shown): {', '.join(left_out)}."
        )
    if k_page < record.topk:
        room = (
            f"the page holds at most {ENTRY_BYTES / 1e6:g} MB of them, deflated"
            if size <= ENTRY_BYTES
            else f"they take {size / 1e6:.1f} MB deflated, past the page's {ENTRY_BYTES / 1e6:g} MB: one a row is "
            "the fewest it keeps"
        )
        notes.append(
            f"Reduced: {rows:,} rows keep their {k_page} strongest keys of the {record.topk} recorded ({room}), "
            "weights rounded to 1/255."
        )
    else:
        notes.append("Each row's recorded strongest keys are all kept, weights rounded to 1/255.")
    if any(c["lq"] > SERIES_BINS or c["lk"] > SERIES_BINS for layer in layers for c in layer["calls"]):
        notes.append(
            f"Series along the sequence are averaged into at most {SERIES_BINS} bins "
            "(the weight keys receive: also each bin's largest)."
        )
    return {
        "title": title,
        "notes": notes,
        "rollout": _rollout(rollout, example, blobs),
        "sweep": _sweep(sweep),
        "topk": record.topk,
        "k": k_page,
        "sinkKeys": record.sink_keys,
        "tokens": token_list,
        "layers": layers,
        "blobs": blobs.items,
    }


def _rollout(found: Any, example: int, blobs: _Blobs) -> dict[str, Any] | None:
    """A rollout's targets and, per target, its relevance over the positions (a float32 blob each)."""
    if found is None:
        return None
    relevance = getattr(found, "relevance", None)
    if not isinstance(relevance, torch.Tensor) or relevance.dim() != 3:
        raise TypeError(f"rollout must be what attnkit.rollout gave after its forward, got {type(found).__name__}")
    if not 0 <= example < relevance.shape[0]:
        raise ValueError(f"example {example} is past the rollout's batch of {relevance.shape[0]}")
    L = relevance.shape[-1]
    rows = relevance[example].float().numpy()  # (T, L)
    return {
        "targets": [t % L for t in found.targets],
        "residual": found.residual,
        "heads": found.heads,
        "n": L,
        "relevance": [blobs.add(row.astype("<f4").tobytes()) for row in rows],
    }


def _sweep(found: Any) -> dict[str, Any] | None:
    """A head sweep's layers, its logit changes ``(layers, H)`` and the logit without ablation."""
    if found is None:
        return None
    change = getattr(found, "change", None)
    if not isinstance(change, torch.Tensor) or change.dim() != 2:
        raise TypeError(f"sweep must be what attnkit.head_sweep returned, got {type(found).__name__}")
    return {"names": list(found.names), "change": change.tolist(), "base": float(found.base)}


def _check_tokens(tokens: list[str], names: list[str], calls: dict[str, list[Any]], example: int) -> None:
    """The tokens cover the positions the record's calls label, as on a page of weights: exactly as many as the
    longest call's keys; or, for calls through a cache, which keep their positions, at least as many as those
    positions reach (the text the cache was filled from may go on).

    Raises:
        ValueError: naming the layer and the lengths."""
    for n in names:
        keys, reach, cached = 0, 0, False
        for s in calls[n]:
            keys = max(keys, int(s.column_sum.shape[-1]))
            for p in (s.query_positions, s.key_positions):
                if p is not None and p.numel():
                    cached = True
                    reach = max(reach, int(p[example if p.shape[0] > 1 else 0].max()) + 1)
        if cached and len(tokens) < max(reach, keys if calls[n][-1].key_positions is None else 0):
            raise ValueError(
                f"tokens has {len(tokens)} tokens but layer {n or '(model)'!r} labels positions up to "
                f"{max(reach, keys) - 1} through its cache"
            )
        if not cached and len(tokens) != keys:
            raise ValueError(
                f"tokens has {len(tokens)} tokens but layer {n or '(model)'!r} has {keys} keys in its longest call"
            )


def _one_head(s: Any) -> Any:
    """Statistics without a head axis as those of one head."""
    if s.entropy.dim() != 2:
        return s
    positions = ("query_positions", "key_positions")  # (B|1, L): no head axis to add
    return dataclasses.replace(s, **{n: t.unsqueeze(1) for n, t in s.tensors().items() if n not in positions})


def _fitted(
    names: list[str], calls: dict[str, list[Any]], example: int, topk: int
) -> tuple[int, dict[str, list[bytes]], int]:
    """The most strongest keys a row can keep with every call's top entries (deflated, :func:`_top`) in
    ``ENTRY_BYTES``, and those entries: tried with all ``topk``, then with as many as the bytes a key took
    leave room for, fewer until they fit (one key at least); and their bytes."""
    k = topk
    while True:
        tops = {n: [_top(s, example, k) for s in calls[n]] for n in names}
        size = sum(len(t) for n in names for t in tops[n])
        if size <= ENTRY_BYTES or k == 1:
            return k, tops, size
        k = max(1, min(k - 1, int(k * ENTRY_BYTES / size * 0.97)))


def _top(s: Any, example: int, k: int) -> bytes:
    """The ``k`` strongest keys of each row of one call, deflated (zlib; the page inflates them with
    ``DecompressionStream``): for ``(H, Lq, k)`` entries, each key's offset from its query's position
    ``pos(i) - j`` (``pos(i) = i + Lk - Lq``), zigzagged (``2d`` for ``d >= 0``, ``-2d - 1`` below), plus 1, 0
    naming no key, as four byte planes of uint32 (every entry's lowest byte, then the next...: the keys near their
    query deflate to almost their lowest bytes only), then each weight in 1/255 steps, uint8."""
    values = s.topk_values[example, :, :, :k].float().numpy()  # (H, Lq, k)
    index = s.topk_indices[example, :, :, :k].numpy().astype(np.int64)  # (H, Lq, k)
    Lq, Lk = index.shape[1], int(s.column_sum.shape[-1])
    offset = np.arange(Lq, dtype=np.int64)[None, :, None] + (Lk - Lq) - index  # (H, Lq, k): pos(i) - j
    zigzag = np.where(index < 0, 0, np.where(offset >= 0, 2 * offset, -2 * offset - 1) + 1)  # (H, Lq, k)
    if zigzag.size and int(zigzag.max()) >= 2**32:
        raise ValueError(f"a page of statistics holds keys up to 2**31 positions from their query, got Lk={Lk}")
    code = zigzag.astype("<u4")  # (H, Lq, k)
    planes = code.view(np.uint8).reshape(-1, 4).T  # (4, H*Lq*k): byte b of every entry
    weights = np.rint(values * 255).clip(0, 255).astype(np.uint8)  # (H, Lq, k)
    return zlib.compress(planes.tobytes() + weights.tobytes(), 1)


def _call(s: Any, example: int, top: bytes, blobs: _Blobs) -> dict[str, Any]:
    entropy = s.entropy[example].double().numpy()  # (H, Lq)
    distance = s.distance[example].double().numpy()
    sink = s.sink_mass[example].double().numpy()
    column = s.column_sum[example].double().numpy()  # (H, Lk)
    H, Lq = entropy.shape
    live = s.topk_values[example, :, :, 0].float().numpy() > 0  # (H, Lq): rows that see some key
    count = np.maximum(live.sum(-1), 1)

    def mean(x: np.ndarray) -> list[float]:
        return [float(v) for v in np.where(live, x, 0).sum(-1) / count]

    # where the queries and keys stand when not at the default (a cache's rows): the tokens they are, int32 each
    qpos, kpos = (
        None if p is None else blobs.add(p[example if p.shape[0] > 1 else 0].numpy().astype("<i4").tobytes())
        for p in (s.query_positions, s.key_positions)
    )
    return {
        "lq": Lq,
        "lk": int(column.shape[-1]),
        "qpos": qpos,
        "kpos": kpos,
        "summary": {"entropy": mean(entropy), "sink": mean(sink), "distance": mean(distance)},
        "top": blobs.add(top),
        "series": {
            "entropy": _bins(entropy, live, blobs),
            "distance": _bins(distance, live, blobs),
            "sink": _bins(sink, live, blobs),
            "received": _bins(column, None, blobs),
            "receivedMax": _bins(column, None, blobs, largest=True),
        },
    }


def _bins(x: np.ndarray, live: np.ndarray | None, blobs: _Blobs, *, largest: bool = False) -> dict[str, int]:
    """``(H, L)`` values averaged (or their largest) over at most ``SERIES_BINS`` bins, float32, as a blob."""
    H, L = x.shape
    n = min(L, SERIES_BINS)
    edges = np.linspace(0, L, n + 1).round().astype(np.intp)
    if largest:
        out = np.maximum.reduceat(x, edges[:-1], axis=1)
    else:
        weight = np.ones_like(x) if live is None else live.astype(np.float64)
        out = np.add.reduceat(x * weight, edges[:-1], axis=1) / np.maximum(
            np.add.reduceat(weight, edges[:-1], axis=1), 1
        )
    return {"n": n, "data": blobs.add(out.astype("<f4").tobytes())}
