"""The results of ``attnkit bench``: its rows, the table it prints, and its JSON and PNG files (written whole or
not at all)."""

from __future__ import annotations

import dataclasses
import io
import json
import types
import typing
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from attnkit._atomic import write_atomically

__all__ = ["HEADS", "HIDDENS", "Report", "Row", "load_json", "plot_report", "save_json", "table"]

# B batch, L sequence length

HIDDENS, HEADS = 512, 8  # the MultiHeadAttention every row times


@dataclass
class Row:
    """One measured configuration."""

    kind: str  # "mha", "additive", "overhead"
    B: int
    L: int
    mode: str
    mask: str
    contender: str
    seconds: float | None = None
    peak_bytes: int | None = None
    gflops: float | None = None
    note: str = ""

    def key(self) -> str:
        return f"{self.kind}|{self.B}|{self.L}|{self.mode}|{self.mask}|{self.contender}"


@dataclass
class Report:
    rows: list[Row] = field(default_factory=list)
    matmul_gflops: float = 0.0
    threads: int = 0
    torch_version: str = ""
    seconds: float = 0.0

    def find(self, **match: Any) -> Row | None:
        for r in self.rows:
            if all(getattr(r, k) == v for k, v in match.items()):
                return r
        return None


def _ratio(report: Report, row: Row, contender: str) -> str:
    peer = report.find(kind=row.kind, B=row.B, L=row.L, mode=row.mode, mask=row.mask, contender=contender)
    if peer is None or not peer.seconds or not row.seconds:
        return ""
    return f"{row.seconds / peer.seconds:.2f}x"


def table(report: Report, compare: Report | None = None) -> tuple[list[str], list[list[str]]]:
    header = [
        "what",
        "B",
        "L",
        "mode",
        "mask",
        "contender",
        "time ms",
        "x torch",
        "x book",
        "GFLOP/s",
        "peak",
        "memory",
    ]
    if compare is not None:
        header.append("vs saved")
    rows = []
    for r in report.rows:
        cells = [
            r.kind,
            str(r.B),
            str(r.L),
            r.mode,
            r.mask,
            r.contender,
            f"{r.seconds * 1e3:.3g}" if r.seconds else r.note,
            _ratio(report, r, "torch") if r.kind == "mha" else "",
            _ratio(report, r, "book"),
            f"{r.gflops:.0f}" if r.gflops else "",
            f"{r.gflops / report.matmul_gflops:.0%}" if r.gflops and report.matmul_gflops else "",
            _bytes(r.peak_bytes),
        ]
        if compare is not None:
            old = next((o for o in compare.rows if o.key() == r.key()), None)
            cells.append(f"{r.seconds / old.seconds:.2f}x" if old and old.seconds and r.seconds else "")
        rows.append(cells)
    return header, rows


def _bytes(n: int | None) -> str:
    if n is None:
        return ""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def save_json(report: Report, path: str) -> None:
    """Write ``report`` to ``path`` as JSON, whole or not at all: into a temporary file beside it, renamed into place
    (a failure removes the temporary file and leaves ``path`` as it was)."""
    data = {**asdict(report), "rows": [asdict(r) for r in report.rows]}

    def write(f: BinaryIO) -> None:
        text = io.TextIOWrapper(f, encoding="utf-8")
        json.dump(data, text, indent=1)
        text.flush()
        text.detach()  # f stays open: write_atomically closes it

    write_atomically(Path(path), write)


def load_json(path: str) -> Report:
    """Results saved by :func:`save_json`, checked field by field against :class:`Report` and :class:`Row`.

    Keys that those classes do not have are ignored (a file from a newer attnkit still compares).

    Raises:
        OSError: the file cannot be read.
        ValueError: the file is not JSON, or not results saved by :func:`save_json`; the message, one line, says
            where it differs, e.g. ``expected a JSON object with "rows", a list, got null`` or
            ``rows[3]["B"] must be int, got "8"``.
    """
    with open(path, encoding="utf-8") as f:
        data = json.load(f)  # json.JSONDecodeError and UnicodeDecodeError are ValueErrors
    if not isinstance(data, dict) or not isinstance(data.get("rows"), list):
        raise ValueError(f'expected a JSON object with "rows", a list, got {_json_excerpt(data)}')
    rows = [Row(**_fields_of(Row, r, f"rows[{i}]")) for i, r in enumerate(data["rows"])]
    return Report(**{**_fields_of(Report, {k: v for k, v in data.items() if k != "rows"}, "the results"), "rows": rows})


def _fields_of(cls: type, data: Any, where: str) -> dict[str, Any]:
    """The entries of ``data`` that are fields of the dataclass ``cls``, each checked against its annotation."""
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be a JSON object, got {_json_excerpt(data)}")
    hints = typing.get_type_hints(cls)
    found = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ValueError(f'{where} has no "{f.name}"')
            continue
        value, hint = data[f.name], hints[f.name]
        if not _is_a(value, hint):
            name = getattr(hint, "__name__", str(hint))
            raise ValueError(f'{where}["{f.name}"] must be {name}, got {_json_excerpt(value)}')
        found[f.name] = value
    return found


def _is_a(value: Any, hint: Any) -> bool:
    """Whether a JSON value fits a field's annotation (``int``, ``float``, ``str``, ``X | None``; others pass)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_is_a(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is str:
        return isinstance(value, str)
    return True


def _json_excerpt(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def plot_report(report: Report, path: str) -> None:
    from collections import Counter

    from attnkit.tools import plot

    plt = plot._pyplot()
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4), layout="constrained")
    drawn = [r for r in report.rows if r.kind == "mha" and r.mode == "train" and r.mask == "none"]
    # the batch size the report measured most (8 in the full grid, 2 with --quick); the largest on a tie
    counts = Counter(r.B for r in drawn)
    B = max(counts, key=lambda b: (counts[b], b), default=8)
    chosen = [r for r in drawn if r.B == B]
    for contender in dict.fromkeys(r.contender for r in chosen):
        rs = sorted((r for r in chosen if r.contender == contender), key=lambda r: r.L)
        ax_t.plot([r.L for r in rs], [r.seconds for r in rs], marker="o", label=contender)
        ax_m.plot([r.L for r in rs if r.peak_bytes], [r.peak_bytes / 2**20 for r in rs if r.peak_bytes], marker="o")
    for ax, label in ((ax_t, "seconds (forward + backward)"), (ax_m, "peak memory, MiB")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("L")
        ax.set_ylabel(label)
    if chosen:
        ax_t.legend(fontsize=7)
    else:
        ax_t.set_title("no MultiHeadAttention training rows in the report", fontsize=9)
    fig.suptitle(f"MultiHeadAttention, B={B}, h={HIDDENS}, {HEADS} heads, float32")
    plot.save_figure(fig, path)
