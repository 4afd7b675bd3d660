"""The viewer's screenshots in the README: docs/viewer-heads.png, viewer-average.png, viewer-model.png and
viewer-decode.png, remade from the demo's Transformer (seed 0: the page in docs/demo/multihead-attention.html,
rebuilt with this checkout's viewer).

    .venv/bin/python docs/screenshots.py [--out DIR]

Trains the demo (about 10 s on 2 cores), writes its viewer page into a temporary folder, opens it from disk in
Debian's headless chromium (/usr/bin/chromium, driven by playwright, network off) at a 1280 x 900 window and
saves each view, cut to what it shows. The same seed gives the same pictures.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from playwright.sync_api import Page, sync_playwright

from attnkit.tools import demo

CHROMIUM = "/usr/bin/chromium"
WIDTH, HEIGHT = 1280, 900

# file name, address (#...) of the view, what the README's caption says
SHOTS = [
    ("viewer-heads.png", "#layer=5&lines=heads", "the head view, decoder.1.cross_attention, a line per head"),
    ("viewer-average.png", "#layer=5&lines=average", "the same layer, the average of its heads"),
    ("viewer-model.png", "#view=model", "the model view: every layer x head, the whole sequences"),
    (
        "viewer-decode.png",
        "#view=model&layer=4&step={mid}",
        "the model view halfway through decoding: the steps stacked",
    ),
]


def demo_page(folder: Path) -> Path:
    """The demo's Transformer page (as ``attnkit demo`` writes it), in ``folder``."""
    result = demo.train("multihead", seed=0)
    demo.draw({"multihead": result}, folder)
    return folder / "multihead-attention.html"


def shoot(page: Page, path: Path) -> None:
    """The visible part of the page down to the end of what the open view draws."""
    bottom = page.evaluate(
        """() => {
            const view = [...document.querySelectorAll("main section")].find((s) => !s.hidden);
            let bottom = 0;
            for (const e of view.querySelectorAll("*")) bottom = Math.max(bottom, e.getBoundingClientRect().bottom);
            return Math.ceil(bottom + window.scrollY);
        }"""
    )
    page.screenshot(path=str(path), clip={"x": 0, "y": 0, "width": WIDTH, "height": min(HEIGHT, bottom + 16)})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent, help="folder (default: docs)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp, sync_playwright() as p:
        html = demo_page(Path(tmp))
        browser = p.chromium.launch(executable_path=CHROMIUM)
        try:
            context = browser.new_context(viewport={"width": WIDTH, "height": HEIGHT}, offline=True)
            page = context.new_page()
            url = html.resolve().as_uri()
            requests: list[str] = []
            errors: list[str] = []
            page.on("request", lambda r: requests.append(r.url))
            page.on("console", lambda m: errors.append(m.text) if m.type in ("error", "warning") else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(url)
            page.wait_for_selector("html[data-ready]", state="attached")
            last = int(page.get_attribute("#step", "max") or 0)  # the whole sequence, then a call per step
            for name, fragment, caption in SHOTS:
                page.goto("about:blank")  # a new address with only its fragment changed would not reload the page
                page.goto(url + fragment.format(mid=(last + 1) // 2))
                page.wait_for_selector("html[data-ready]", state="attached")
                shoot(page, args.out / name)
                print(f"{args.out / name}: {caption}")
            assert set(requests) == {url}, requests  # the page asked for nothing but itself
            assert not errors, errors
        finally:
            browser.close()


if __name__ == "__main__":
    main()
