"""``python -m attnkit.tools.bench --memory-child SPEC``: one configuration's peak memory, in a fresh process, for
:func:`attnkit.tools.bench.measure_memory`."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from attnkit.tools.bench import _memory_child


def main(argv: Sequence[str] | None = None) -> None:
    """``python -m attnkit.tools.bench --memory-child SPEC``: one configuration's peak memory, for
    :func:`measure_memory`."""
    parser = argparse.ArgumentParser(prog="python -m attnkit.tools.bench")
    parser.add_argument("--memory-child", required=True)
    _memory_child(parser.parse_args(argv).memory_child)


if __name__ == "__main__":
    main()
