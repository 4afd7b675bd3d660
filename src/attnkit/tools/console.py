"""What the command line shows on the terminal: tables and progress bars (rich when installed, plain lines
otherwise)."""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any


@contextmanager
def progress(label: str) -> Iterator[Callable[[dict], None]]:
    """A progress bar with loss, held-out accuracy and time left (rich), or plain lines without rich."""
    try:
        from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn
    except ImportError:

        def plain(p: dict) -> None:
            acc = "-" if p["accuracy"] is None else f"{p['accuracy']:.1%}"
            print(f"  step {p['step']}/{p['total']}  loss {p['loss']:.3f}  accuracy {acc}", flush=True)

        yield plain
        return
    columns = (
        TextColumn(f"  {label:<9}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} steps  loss {task.fields[loss]}  accuracy {task.fields[acc]}"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, transient=False) as bar:
        task = bar.add_task(label, total=None, loss="-", acc="-")

        def update(p: dict) -> None:
            acc = "-" if p["accuracy"] is None else f"{p['accuracy']:.1%}"
            total = p["step"] if p.get("done") else p["total"]  # stopping early fills the bar
            bar.update(task, completed=p["step"], total=total, loss=f"{p['loss']:.3f}", acc=acc)

        yield update


@contextmanager
def bench_progress() -> Iterator[Callable[[int, int, Any], None]]:
    try:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    except ImportError:
        yield lambda i, n, row: print(f"  [{i + 1}/{n}] {row.kind} L={row.L} {row.mode} {row.mask} {row.contender}")
        return
    columns = (TextColumn("{task.description:<48}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, transient=True) as bar:
        task = bar.add_task("benchmark", total=None)

        def update(i: int, n: int, row: Any) -> None:
            label = f"{row.kind} B={row.B} L={row.L} {row.mode} {row.mask} {row.contender}"
            bar.update(task, completed=i, total=n, description=label)

        yield update


def table(rows: Sequence[Sequence[str]], header: Sequence[str], title: str | None) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
        for r in [header, *rows] if any(header) else rows:
            print("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())
        return
    table = Table(title=title, show_header=any(header), box=None, pad_edge=False)
    for name in header:
        table.add_column(name, overflow="fold")
    for r in rows:
        table.add_row(*r)
    recorder = Console(width=max(100, _terminal_width()), file=io.StringIO(), record=True)
    recorder.print(table)
    for line in recorder.export_text().splitlines():  # (rich pads every cell of the last column to the width)
        print(line.rstrip())


def _terminal_width() -> int:
    try:
        return os.get_terminal_size().columns
    except OSError:
        return 140
