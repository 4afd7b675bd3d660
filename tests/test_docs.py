"""The API reference (`make docs`: Sphinx, from the docstrings, into site/api/): it builds with no warning, a
cross-reference that resolves to nothing fails the build, every public name has an entry, and no page asks the
network for anything (it must open from disk, offline)."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "docs" / "api"
PUBLIC = ["attnkit", "attnkit.masks", "attnkit.mods", "attnkit.d2l", "attnkit.stats", "attnkit.tools.plot",
          "attnkit.distributed", "attnkit.packing", "attnkit.trace", "attnkit.dispatch",
          "attnkit.integrations.transformers"]  # fmt: skip

if os.environ.get("CI"):  # CI installs the docs extra: missing there is a failure, not a skip
    import sphinx  # noqa: F401
else:
    pytest.importorskip("sphinx")


def build(source: Path, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    """sphinx-build as `make docs` runs it: -n (every cross-reference must resolve), -W (a warning fails)."""
    command = [sys.executable, "-m", "sphinx", "-q", "-n", "-W", "--keep-going", "-b", "html", *extra]
    return subprocess.run([*command, str(source), str(out)], capture_output=True, text=True, timeout=600, check=False)


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = build(SOURCE, out)
    assert done.returncode == 0, done.stderr[-4000:]
    return out


def test_the_api_reference_builds_with_no_warning_and_lists_every_public_name(site):
    assert (site / "index.html").is_file()
    from sphinx.util.inventory import InventoryFile

    with open(site / "objects.inv", "rb") as f:
        inventory = InventoryFile.load(f, "", lambda base, uri: uri)
    documented = {name for entries in inventory.values() for name in entries}
    missing = [
        f"{module}.{name}"
        for module in PUBLIC
        for name in importlib.import_module(module).__all__
        if not name.startswith("_") and f"{module}.{name}" not in documented
    ]
    assert not missing, f"public names with no entry in the API reference: {missing}"


def test_no_page_of_the_api_reference_needs_the_network(site):
    loads = re.compile(r"<(?:script|link|img|iframe)\b[^>]*\b(?:src|href)=\"(?:https?:)?//", re.IGNORECASE)
    offenders = [p.name for p in site.rglob("*.html") if loads.search(p.read_text(encoding="utf-8"))]
    assert not offenders, f"pages that load something from the network: {offenders}"


def test_a_cross_reference_to_nothing_fails_the_build(tmp_path):
    """The configuration's exemptions (names outside attnkit) must not swallow a broken reference of attnkit's."""
    (tmp_path / "index.rst").write_text(
        "Broken\n======\n\nSee :func:`attnkit.no_such_function` and :class:`attnkit.masks.NoSuchMask`.\n"
    )
    done = build(tmp_path, tmp_path / "out", "-c", str(SOURCE))
    assert done.returncode != 0
    assert "attnkit.no_such_function" in done.stderr and "attnkit.masks.NoSuchMask" in done.stderr, done.stderr
