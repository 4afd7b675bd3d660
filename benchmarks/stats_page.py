"""The viewer's page of a 32k-token statistics record: its size, and how long a click takes in headless Chromium.

The record has the shape of benchmarks/stats.py's Llama row (8 layers x 8 heads x 32,768 queries, top-32, 2
key/value heads), filled with statistics of random causal rows whose keys stand up to 64 positions before their
query (the page deflates each key's offset from its query: how many keys a row keeps depends on where they are,
the rest of the page on the shapes only). Needs Debian's chromium and playwright (``make browser``).

Usage: ``python benchmarks/stats_page.py [--length 32768]``
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

import attnkit
import attnkit.tools.plot
from attnkit.recording import StatsRecord


def record(L: int, layers: int = 8, H: int = 8, k: int = 32) -> StatsRecord:
    g = torch.Generator().manual_seed(0)
    rec = StatsRecord(topk=k)
    for layer in range(layers):
        values = torch.rand(1, H, L, k, generator=g).sort(-1, descending=True).values
        values = values / values.sum(-1, keepdim=True)
        rows = torch.arange(L).view(1, 1, L, 1)
        indices = (rows - torch.randint(0, 64, (1, H, L, k), generator=g)).clamp_min(0)
        stats = attnkit.AttentionStats(
            values,
            indices,
            torch.rand(1, H, L, generator=g) * 5,
            torch.rand(1, H, L, generator=g) * 3,
            torch.rand(1, H, L, generator=g) * 100,
            torch.rand(1, H, L, generator=g),
            kv_heads=2,
        )
        rec.add(f"model.layers.{layer}.self_attn", stats, 2)
    return rec


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--length", type=int, default=32768)
    args = parser.parse_args()
    from playwright.sync_api import sync_playwright

    folder = Path(tempfile.mkdtemp())
    start = time.perf_counter()
    page_file = attnkit.tools.plot.view(record(args.length), path=folder / "stats.html").path
    built = time.perf_counter() - start
    size = page_file.stat().st_size
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=shutil.which("chromium"))
        page = browser.new_context(viewport={"width": 1400, "height": 900}, offline=True).new_page()
        start = time.perf_counter()
        page.goto(page_file.as_uri())
        page.wait_for_selector("html[data-ready]", state="attached")
        loaded = time.perf_counter() - start
        clicks = []
        for layer, head in ((7, 5), (3, 1), (0, 0)):
            start = time.perf_counter()
            page.locator(".st-grid").nth(0).locator("tr").nth(layer + 1).locator("td").nth(head).click()
            # answered: that head's strongest keys listed (its layer's keys inflated, if not yet)
            page.wait_for_selector(f"#st-keys[data-shown^='{layer} {head} ']", state="attached")
            clicks.append(time.perf_counter() - start)
        browser.close()
    print(
        f"L={args.length}: page {size / 1e6:.1f} MB, built in {built:.1f} s, interactive after {loaded:.2f} s, "
        f"a click answered in {sorted(clicks)[1]:.3f} s (median of 3)"
    )


if __name__ == "__main__":
    main()
