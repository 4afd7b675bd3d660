"""What the benchmark scripts share at their end: print the report, save the numbers, say which targets were
missed (exit status 1 when one was)."""

from __future__ import annotations

import json
from typing import Any


def finish(results: dict[str, Any], report: str, missed: list[str], json_path: str | None) -> int:
    """Print ``report``, write ``results`` to ``json_path`` when given, print each missed target; the exit status."""
    print(report)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(results, f, indent=1)
    for line in missed:
        print(f"target missed: {line}")
    return 1 if missed else 0
