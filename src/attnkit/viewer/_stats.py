"""The viewer's page of a statistics record (:func:`attnkit.record_stats`): per layer x head summaries, each
query's strongest keys, and the series along the sequence (see :func:`attnkit.viewer.view`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from attnkit.recording import StatsRecord
from attnkit.viewer._data import _Blobs, labels

__all__ = ["ENTRY_BYTES", "SERIES_BINS", "encode", "is_stats"]

# H heads, Lq/Lk query/key length, k top entries a row keeps on the page

# The page keeps each row's strongest keys up to this many bytes in all (3 a key: its position, uint16, and its
# weight in 1/255 steps; 5 past 65,536 keys): under 25 MB of page for 8 layers x 8 heads x 32,768 queries.
ENTRY_BYTES = 14_000_000
# Series along the sequence (entropy, distance, sink mass per query; weight received per key) are averaged into at
# most this many bins a head (column sums: the largest of each bin too).
SERIES_BINS = 1024


def is_stats(record: Any) -> bool:
    """A statistics record, or what ``StatsRecord.save`` wrote (loaded back)."""
    return isinstance(record, StatsRecord) or (isinstance(record, Mapping) and record.get("attnkit_stats") == 1)


def encode(record: Any, tokens: Sequence[Any] | None, example: int, title: str) -> dict[str, Any]:
    """The page's data: for each layer its calls, each with its summaries, series and top entries as blobs."""
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
    lk_max = max(s.column_sum.shape[-1] for n in names for s in calls[n])
    wide = lk_max > 65536
    k_page = max(1, min(record.topk, ENTRY_BYTES // max(1, rows * (5 if wide else 3))))
    token_list = None if tokens is None else labels(tokens, "tokens")
    blobs = _Blobs()
    layers = []
    for n in names:
        encoded = [_call(s, example, k_page, wide, blobs) for s in calls[n]]
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
        notes.append(
            f"Reduced: {rows:,} rows keep their {k_page} strongest keys of the {record.topk} recorded "
            f"(the page holds at most {ENTRY_BYTES // 1_000_000} MB of them), weights rounded to 1/255."
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
        "topk": record.topk,
        "k": k_page,
        "wide": wide,
        "sinkKeys": record.sink_keys,
        "tokens": token_list,
        "layers": layers,
        "blobs": blobs.items,
    }


def _one_head(s: Any) -> Any:
    """Statistics without a head axis as those of one head."""
    if s.entropy.dim() != 2:
        return s
    return dataclasses.replace(s, **{name: t.unsqueeze(1) for name, t in s.tensors().items()})


def _call(s: Any, example: int, k: int, wide: bool, blobs: _Blobs) -> dict[str, Any]:
    values = s.topk_values[example, :, :, :k].float().numpy()  # (H, Lq, k)
    index = s.topk_indices[example, :, :, :k].numpy()  # (H, Lq, k)
    entropy = s.entropy[example].double().numpy()  # (H, Lq)
    distance = s.distance[example].double().numpy()
    sink = s.sink_mass[example].double().numpy()
    column = s.column_sum[example].double().numpy()  # (H, Lk)
    H, Lq = entropy.shape
    live = values[..., 0] > 0  # (H, Lq): rows that see some key
    count = np.maximum(live.sum(-1), 1)

    def mean(x: np.ndarray) -> list[float]:
        return [float(v) for v in np.where(live, x, 0).sum(-1) / count]

    codes = np.rint(values * 255).clip(0, 255).astype(np.uint8)
    keys = np.where(index < 0, 2**32 - 1 if wide else 2**16 - 1, index).astype("<u4" if wide else "<u2")  # -1: none
    top = blobs.add(keys.tobytes() + codes.tobytes())
    return {
        "lq": Lq,
        "lk": int(column.shape[-1]),
        "summary": {"entropy": mean(entropy), "sink": mean(sink), "distance": mean(distance)},
        "top": top,
        "series": {
            "entropy": _bins(entropy, live, blobs),
            "distance": _bins(distance, live, blobs),
            "sink": _bins(sink, live, blobs),
            "received": _bins(column, None, blobs),
            "receivedMax": _bins(column, None, blobs, largest=True),
        },
    }


def _bins(x: np.ndarray, live: np.ndarray | None, blobs: _Blobs, *, largest: bool = False) -> dict[str, int]:
    """``(H, L)`` values averaged (or their largest) over at most :data:`SERIES_BINS` bins, float32, as a blob."""
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
