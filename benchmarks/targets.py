"""The project's performance targets, checked against one saved run of ``attnkit bench``.

The targets are this project's goals for attnkit against ``torch.nn.MultiheadAttention`` and the book's code, not
something the installed library carries: ``attnkit bench`` measures and prints its table, and this script reads a
run saved with ``--json`` and says which targets it meets. Every target is a ratio of two measurements of that
one run (or of a GFLOP/s rate to the matmul rate measured in it), so runs on different machines compare.

It prints one Markdown table (the one in docs/guide/performance.md and docs/benchmarks.md) and exits with status 0
when every target is met, 1 when one is missed or the run did not measure it (``--quick`` measures only the tiny-input
target; ``--no-memory`` leaves out the memory one), 2 when the file is not a saved run.

    make bench                                              # attnkit bench --json bench.json ..., then this
    python benchmarks/targets.py bench.json
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any

from attnkit.tools import bench


@dataclass
class Target:
    """One of the performance targets, checked against a report."""

    what: str
    measured: float | None  # None: the run did not measure it
    limit: float
    at_most: bool  # True: measured <= limit; False: measured >= limit

    @property
    def met(self) -> bool | None:
        if self.measured is None:
            return None
        return self.measured <= self.limit if self.at_most else self.measured >= self.limit


def targets(report: bench.Report) -> list[Target]:
    """The targets of the performance issue, from the rows of one run (ratios of times measured in that run)."""

    def time(**match: Any) -> float | None:
        row = report.find(**match)
        return row.seconds if row is not None else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a and b else None

    found: list[Target] = []
    mha = {"kind": "mha", "B": 8}
    for L, mode, limit in ((512, "train", 0.95), (2048, "train", 0.80), (2048, "infer", 0.5)):
        for mask in bench.MASKS:
            t = ratio(
                time(**mha, L=L, mode=mode, mask=mask, contender="attnkit"),
                time(**mha, L=L, mode=mode, mask=mask, contender="torch"),
            )
            found.append(Target(f"attnkit / torch, L={L} {mode} {mask}", t, limit, True))
    for L, limit in ((512, 2.3), (2048, 4.0)):
        for mask in bench.MASKS:
            t = ratio(
                time(**mha, L=L, mode="train", mask=mask, contender="book"),
                time(**mha, L=L, mode="train", mask=mask, contender="attnkit"),
            )
            found.append(Target(f"book / attnkit (speed-up), L={L} train {mask}", t, limit, False))
    own = time(**mha, L=2048, mode="train", mask="none", contender="attnkit")
    recorded = time(**mha, L=2048, mode="train", mask="none", contender="attnkit+weights")
    found.append(Target("attnkit+weights / attnkit, L=2048 train", ratio(recorded, own), 1.5, True))
    torch_weights = time(**mha, L=2048, mode="train", mask="none", contender="torch+weights")
    found.append(Target("attnkit+weights / torch+weights, L=2048 train", ratio(recorded, torch_weights), 0.6, True))
    for mode in bench.MODES:
        padded = time(**mha, L=2048, mode=mode, mask="valid_lens", contender="attnkit")
        full = time(**mha, L=2048, mode=mode, mask="none", contender="attnkit")
        found.append(Target(f"attnkit valid_lens / no mask, L=2048 {mode}", ratio(padded, full), 0.8, True))
    row = report.find(**mha, L=2048, mode="train", mask="none", contender="attnkit")
    share = row.gflops / report.matmul_gflops if row is not None and row.gflops and report.matmul_gflops else None
    found.append(Target("attnkit GFLOP/s / matmul GFLOP/s, L=2048 train", share, 0.65, False))
    add = {"kind": "additive", "L": bench.ADDITIVE_FULL["L"]}
    ours, book = report.find(**add, contender="attnkit"), report.find(**add, contender="book")
    seconds = ratio(ours.seconds, book.seconds) if ours is not None and book is not None else None
    found.append(Target("additive: attnkit / book time", seconds, 1.0, True))
    memory = ratio(ours.peak_bytes, book.peak_bytes) if ours is not None and book is not None else None
    found.append(Target("additive: attnkit / book peak memory", memory, 1 / 8, True))
    found.append(
        Target(
            "tiny inputs: attnkit / book forward",
            ratio(time(kind="overhead", contender="attnkit"), time(kind="overhead", contender="book")),
            1.3,
            True,
        )
    )
    return found


def markdown(checks: list[Target]) -> str:
    """The targets as a Markdown table: what, measured, limit, met (``yes``, ``**no**`` or ``not measured``)."""
    lines = ["| target | measured | limit | met |", "|---|---|---|---|"]
    for t in checks:
        measured = "" if t.measured is None else f"{t.measured:.2f}"
        met = {True: "yes", False: "**no**", None: "not measured"}[t.met]
        lines.append(f"| {t.what} | {measured} | {'<=' if t.at_most else '>='} {t.limit:.2f} | {met} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", help="a run saved with `attnkit bench --json FILE`")
    args = parser.parse_args(argv)
    try:
        report = bench.load_json(args.results)
    except (OSError, ValueError) as e:
        parser.error(f"{args.results}: not results saved with `attnkit bench --json` ({e})")
    checks = targets(report)
    print(
        f"{args.results}: torch {report.torch_version}, {report.threads} threads,"
        f" float32 matmul {report.matmul_gflops:.0f} GFLOP/s"
    )
    print(markdown(checks))
    missed = sum(t.met is False for t in checks)
    unmeasured = sum(t.met is None for t in checks)
    met = len(checks) - missed - unmeasured
    print(f"{met} of {len(checks)} targets met, {missed} missed, {unmeasured} not measured", end="")
    print(
        " (the grid of a full run, with memory: `attnkit bench` without --quick or --no-memory)" if unmeasured else ""
    )
    return 0 if missed == unmeasured == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
