"""The package's layout as its docstrings say: the core never imports the tools built on it (the command line, the
viewer, pictures, the demo, the benchmark), nor torch's compiler at import (tests/test_imports.py)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "attnkit"

# The one place outside the tools that reaches into them, inside a function: the book's show_heatmaps, which
# attnkit.d2l keeps for the book's cells, draws with the tools' plotting (needs matplotlib).
ALLOWED = {("attnkit.d2l.functions", "attnkit.tools.plot")}


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Every module a file imports, at its top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def test_nothing_in_the_core_imports_the_tools():
    reached = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module(path)
        if module.startswith("attnkit.tools") or module == "attnkit.__main__":
            continue
        for name in _imports(path):
            if name.startswith("attnkit.tools") and not any(module == m and name.startswith(t) for m, t in ALLOWED):
                reached.append(f"{module} imports {name}")
    assert reached == []
