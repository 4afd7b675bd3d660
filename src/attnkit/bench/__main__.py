"""``python -m attnkit.bench --memory-child SPEC``: one configuration's peak memory, in a fresh process, for
:func:`attnkit.bench.measure_memory`."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from attnkit.bench import _memory_child


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m attnkit.bench --memory-child SPEC``: one configuration's peak memory, for :func:`measure_memory`."""
    parser = argparse.ArgumentParser(prog="python -m attnkit.bench")
    parser.add_argument("--memory-child", required=True)
    _memory_child(parser.parse_args(argv).memory_child)


if __name__ == "__main__":
    main()
