"""The viewer's size and speed: a synthetic record of 12 layers x 12 heads x L x L causal weights (sharp heads and
flat ones), written by ``attnkit.tools.viewer.view``, then opened from disk in headless Debian chromium (playwright
pointed at ``chromium`` on the PATH; ``make browser`` installs it) with the network off.

Time to interactive: from the start of loading the file to a click on a head answered (the head view's lines
redrawn without that head), the first load of a fresh browser context and the median of the next ones. Targets
(issue 13): under 25 MB and under 2 s at L = 1024.

    python benchmarks/viewer.py [--lengths 256 1024] [--loads 5] [--json viewer.json]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from attnkit.tools.viewer import view
from results import finish

LAYERS, HEADS = 12, 12
TARGET_MB, TARGET_S = 25.0, 2.0


def synthetic_record(L: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    hidden = ~torch.ones(L, L, dtype=torch.bool).tril()
    temperature = torch.linspace(0.5, 4.0, HEADS)[:, None, None]
    record = {}
    for layer in range(LAYERS):
        scores = torch.randn(1, HEADS, L, L, generator=g) * temperature  # (1, H, L, L)
        record[f"layers.{layer}.attention"] = scores.masked_fill(hidden, float("-inf")).softmax(-1)
    return record


def load(browser, path: Path) -> tuple[float, float]:
    """Seconds to the first view drawn and to a click on a head answered, from the start of loading."""
    context = browser.new_context(viewport={"width": 1200, "height": 900}, offline=True)
    try:
        page = context.new_page()
        start = time.perf_counter()
        page.goto(path.resolve().as_uri(), wait_until="commit")
        page.wait_for_selector("html[data-ready]", state="attached")
        ready = time.perf_counter() - start
        before = page.get_attribute("#hv-lines", "data-candidates")
        page.click("#head-toggles .head[data-head='0']")
        page.wait_for_selector(f"#hv-lines:not([data-candidates='{before}'])", state="attached")
        return ready, time.perf_counter() - start
    finally:
        context.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--loads", type=int, default=5, help="loads of each page (the first is reported apart)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    chromium = shutil.which("chromium")
    if chromium is None:
        print("chromium is not on the PATH: `make browser` installs Debian's", file=sys.stderr)
        return 2
    from playwright.sync_api import sync_playwright

    rows, results, missed = [], {}, []
    with tempfile.TemporaryDirectory() as folder, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium)
        for L in args.lengths:
            record = synthetic_record(L)
            start = time.perf_counter()
            page = view(record, path=Path(folder) / f"view-{L}.html")
            written = time.perf_counter() - start
            del record
            assert page.path is not None
            mb = page.path.stat().st_size / 1e6
            loads = [load(browser, page.path) for _ in range(args.loads)]
            first = loads[0]
            ready = statistics.median(t[0] for t in loads[1:]) if len(loads) > 1 else first[0]
            answered = statistics.median(t[1] for t in loads[1:]) if len(loads) > 1 else first[1]
            results[str(L)] = {
                "layers": LAYERS,
                "heads": HEADS,
                "L": L,
                "mb": mb,
                "write_s": written,
                "first_ready_s": first[0],
                "first_interactive_s": first[1],
                "ready_s": ready,
                "interactive_s": answered,
                "notes": list(page.notes),
            }
            rows.append(
                f"| {LAYERS} x {HEADS} x {L} x {L} | {mb:.1f} MB | {written:.1f} s | {first[0]:.2f} / {first[1]:.2f} s "
                f"| {ready:.2f} / {answered:.2f} s |"
            )
            if L >= 1024 and mb >= TARGET_MB:
                missed.append(f"L={L}: {mb:.1f} MB, target < {TARGET_MB} MB")
            if L >= 1024 and max(first[1], answered) >= TARGET_S:
                missed.append(f"L={L}: interactive after {max(first[1], answered):.2f} s, target < {TARGET_S} s")
        browser.close()
    header = (
        "| record | file | written in | first load: drawn / click answered | later loads (median) |\n"
        "|---|---|---|---|---|"
    )
    return finish(results, "\n".join([header, *rows]), missed, args.json)


if __name__ == "__main__":
    sys.exit(main())
