"""The bytes of the viewer page: :func:`encode` turns the layers :mod:`attnkit.tools.viewer._data` read into one
JSON-ready dictionary, the page's only input (see viewer.js for how each field is read), keeping every weight up
to ``EXACT_CELLS`` and each row's largest past that."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import torch

from attnkit.tools.viewer import _data
from attnkit.tools.viewer._data import Layer

# H heads, Lq/Lk query/key length, B batch, k weights kept per row, tq/tk thumbnail rows/columns


class _Blobs:
    """The page's byte strings, base64, each stored once (identical masks are shared)."""

    def __init__(self) -> None:
        self.items: list[str] = []
        self._ids: dict[bytes, int] = {}
        self.nbytes = 0

    def add(self, data: bytes, *, share: bool = False) -> int:
        if share and data in self._ids:
            return self._ids[data]
        self.items.append(base64.b64encode(data).decode("ascii"))
        self.nbytes += len(data)
        if share:
            self._ids[data] = len(self.items) - 1
        return len(self.items) - 1


def encode(layers: list[Layer], title: str, notes: list[str]) -> dict[str, Any]:
    """The page's data: layers, calls, token lists and base64 blobs (see viewer.js for how each is read)."""
    H_max = max(c.shape[0] for layer in layers for c in layer.calls)
    cells = sum(c.size for layer in layers for c in layer.calls)
    rows = sum(c.shape[0] * c.shape[1] for layer in layers for c in layer.calls)
    lk_max = max(c.shape[2] for layer in layers for c in layer.calls)
    exact = cells <= _data.EXACT_CELLS
    k = lk_max if exact else max(1, min(lk_max, _data.MAX_ENTRIES // rows))
    blobs = _Blobs()
    lists: dict[tuple[str, ...], int] = {}
    mask_budget = [_data.MAX_MASK_BYTES]
    stats: dict[str, Any] = {"kept": [], "least": 1.0, "thumbs": False, "masks_dropped": 0}

    def list_id(tokens: list[str] | None) -> int | None:
        if tokens is None:
            return None
        return lists.setdefault(tuple(tokens), len(lists))

    out_layers = []
    for layer in layers:
        calls = []
        for w, (q, q_offset, kt) in zip(layer.calls, layer.tokens, strict=True):
            call = _encode_call(w, exact, k, blobs, mask_budget, stats)
            call.update(q=list_id(q), qoff=q_offset, k=list_id(kt))
            calls.append(call)
        H = layer.calls[0].shape[0]
        out_layers.append({"name": layer.name, "heads": H, "groups": layer.groups, "calls": calls})

    notes = list(notes)
    if not exact:
        kept = np.concatenate(stats["kept"]) if stats["kept"] else np.ones(1)
        notes.append(
            f"Reduced: {cells:,} weights are more than the {_data.EXACT_CELLS:,} a page keeps exactly, so each row "
            f"keeps its {k} largest weights (of up to {lk_max} keys), rounded to 1/255 of its matrix's largest; the "
            f"kept weights hold {kept.mean():.1%} of a row's weight on average, {stats['least']:.1%} at least. A cell "
            "not kept is drawn white, and the value under the mouse says so."
        )
    if stats["thumbs"]:
        notes.append(f"Model view: the small matrices average bins of cells, {_data.THUMB} a side at most.")
    if stats["masks_dropped"]:
        notes.append(
            f"Masked cells are not known for {stats['masks_dropped']} matrices (distinct masks past "
            f"{_data.MAX_MASK_BYTES >> 20} MiB): there a hidden key looks like a weight of 0."
        )
    return {
        "title": title,
        "notes": notes,
        "exact": exact,
        "k": k,
        "heads": H_max,
        "thumb": _data.THUMB,
        "tokens": [list(t) for t in lists],
        "layers": out_layers,
        "blobs": blobs.items,
    }


def _encode_call(
    w: np.ndarray, exact: bool, k: int, blobs: _Blobs, mask_budget: list[int], stats: dict[str, Any]
) -> dict[str, Any]:
    """One call's weights ``(H, Lq, Lk)``: exact float32, or the largest ``k`` of each row as uint8 with their
    uint16 key positions (all of them, without positions, when ``k >= Lk``), its masks, padding and thumbnails."""
    H, Lq, Lk = w.shape
    zero = w == 0  # (H, Lq, Lk): attnkit gives exactly 0 where a mask hides a key
    scale = float(w.max()) or 1.0
    call: dict[str, Any] = {"lq": Lq, "lk": Lk, "scale": scale}
    call["padk"] = _ranges(zero.all(axis=(0, 1)))  # keys no query of any head sees: padding
    call["padq"] = _ranges(zero.all(axis=(0, 2)))  # queries that see no key
    if exact:
        call["enc"] = "f32"
        call["data"] = blobs.add(w.astype("<f4").tobytes())
    else:
        masks = []
        for h in range(H):
            if not zero[h].any():
                masks.append(-1)
                continue
            bits = np.packbits(zero[h], axis=None, bitorder="little").tobytes()  # (ceil(Lq * Lk / 8),)
            if bits not in blobs._ids and len(bits) > mask_budget[0]:
                masks.append(-2)
                stats["masks_dropped"] += 1
                continue
            if bits not in blobs._ids:
                mask_budget[0] -= len(bits)
            masks.append(blobs.add(bits, share=True))
        call["masks"] = masks
        codes = lambda x: np.rint(x / scale * 255).astype(np.uint8)  # noqa: E731
        sums = w.sum(-1, dtype=np.float64)  # (H, Lq)
        if k >= Lk:
            call["enc"] = "u8"
            call["data"] = blobs.add(codes(w).tobytes())  # (H, Lq, Lk)
            stats["kept"].append(np.ones(1))
        else:
            top = torch.from_numpy(w).topk(k, dim=-1, sorted=True)  # (H, Lq, k) each
            values, index = top.values.numpy(), top.indices.numpy()
            threshold = codes(values[..., -1])  # (H, Lq): the k-th largest of each row
            data = index.astype("<u2").tobytes() + codes(values).tobytes() + threshold.tobytes()
            call["enc"], call["kc"] = "topk", k
            call["data"] = blobs.add(data)  # (H, Lq, k) uint16, (H, Lq, k) uint8, (H, Lq) uint8
            live = sums > 0
            fraction = values.sum(-1, dtype=np.float64)[live] / sums[live]  # (rows that see a key,)
            stats["kept"].append(fraction)
            if fraction.size:
                stats["least"] = min(stats["least"], float(fraction.min()))
    thumb, tq, tk = _thumbnail(w, zero)
    stats["thumbs"] = stats["thumbs"] or (tq, tk) != (Lq, Lk)
    call.update(thumb=blobs.add(thumb.tobytes()), tq=tq, tk=tk)
    call["hmax"] = [float(m) for m in w.max(axis=(1, 2))]
    return call


def _ranges(flags: np.ndarray) -> list[list[int]]:
    """``[[start, stop], ...]`` of the runs of True in a 1-D bool array."""
    padded = np.concatenate([[False], flags, [False]])
    edges = np.flatnonzero(padded[1:] != padded[:-1])  # starts and stops, alternating
    return edges.reshape(-1, 2).tolist()


def _thumbnail(w: np.ndarray, zero: np.ndarray) -> tuple[np.ndarray, int, int]:
    """``(H, tq, tk)`` uint8: each bin's mean weight over its head's largest, as 1..255; 0 where every cell of
    the bin is masked (exactly 0)."""
    H, Lq, Lk = w.shape
    mean, hidden = w.astype(np.float64), zero.astype(np.float64)
    for axis in (1, 2):
        n = mean.shape[axis]
        if n > _data.THUMB:
            edges = np.linspace(0, n, _data.THUMB + 1).round().astype(np.intp)  # (THUMB + 1,)
            counts = np.diff(edges).reshape((-1,) + (1,) * (2 - axis))  # (THUMB, 1) or (THUMB,)
            mean = np.add.reduceat(mean, edges[:-1], axis=axis) / counts  # that axis: n -> THUMB
            hidden = np.add.reduceat(hidden, edges[:-1], axis=axis) / counts
    top = w.max(axis=(1, 2)).astype(np.float64)[:, None, None]  # (H, 1, 1)
    codes = 1 + np.rint(mean / np.where(top > 0, top, 1.0) * 254)  # (H, tq, tk), 1..255
    codes[hidden == 1] = 0
    return codes.astype(np.uint8), mean.shape[1], mean.shape[2]
