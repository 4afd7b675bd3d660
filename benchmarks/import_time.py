"""How long ``import attnkit`` takes beyond ``import torch``: each in a fresh interpreter, alternating, medians of
``--repeats`` (issue 49's target: at most 0.5 s more than torch, median of 5).

Usage::

    python benchmarks/import_time.py --repeats 5
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from results import finish

TARGET = 0.5


def _seconds(module: str) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", f"import {module}"], check=True)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    _seconds("attnkit")  # warm the file cache
    runs: dict[str, list[float]] = {"torch": [], "attnkit": []}
    for _ in range(args.repeats):
        for module in runs:
            runs[module].append(_seconds(module))
    median = {module: statistics.median(s) for module, s in runs.items()}
    extra = median["attnkit"] - median["torch"]
    report = (
        f"import torch {median['torch']:.2f} s, import attnkit {median['attnkit']:.2f} s (medians of {args.repeats}): "
        f"{extra:+.2f} s (target <= +{TARGET} s)"
    )
    missed = [] if extra <= TARGET else [f"import attnkit {extra:+.2f} s over torch"]
    return finish({"seconds": runs, "median": median, "extra": extra}, report, missed, args.json)


if __name__ == "__main__":
    sys.exit(main())
