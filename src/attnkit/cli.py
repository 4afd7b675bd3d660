"""The ``attnkit`` command (also ``python -m attnkit``).

A user mistake prints one line, ``attnkit: error: ...``, and exits with status 2; never a traceback.
"""

from __future__ import annotations

import argparse
import platform
import sys
from collections.abc import Sequence

import torch

import attnkit
from attnkit import dispatch


class UsageError(Exception):
    """A mistake in how the command was called: one line on stderr, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="attnkit", description="Attention mechanisms done right.")
    parser.add_argument("--version", action="version", version=f"attnkit {attnkit.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    commands.required = True
    commands.add_parser("info", help="versions, threads, and which backends run here")
    return parser


def cmd_info(args: argparse.Namespace) -> None:
    rows = [
        ("attnkit", attnkit.__version__),
        ("torch", torch.__version__),
        ("python", platform.python_version()),
        ("threads", str(torch.get_num_threads())),
        ("cuda", torch.version.cuda if torch.cuda.is_available() else "not available"),
    ]
    for name, reasons in dispatch.unavailable_reasons().items():
        rows.append((f"backend {name}", "runs here" if not reasons else "no: " + "; ".join(reasons)))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}")


COMMANDS = {"info": cmd_info}


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        COMMANDS[args.command](args)
    except UsageError as e:
        print(f"attnkit: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
