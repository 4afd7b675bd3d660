"""The viewer's screenshots in the README and the guides (docs/viewer-*.png), remade from SmolLM2-135M-Instruct's
pages as ``attnkit demo --smollm2`` writes them (attnkit.tools.demo.smollm2: a sentence said twice, then a needle
in 1,024 tokens), with this checkout's viewer.

    .venv/bin/python docs/screenshots.py [--out DIR]

Loads the model (converted once, by make venv), writes its pages into a temporary folder, opens each from disk in
Debian's headless chromium (/usr/bin/chromium, driven by playwright, network off) at a 1280 x 900 window and saves
each view, cut to what it shows. The heads named in the addresses are the ones the demo finds (the strongest
induction and previous-token heads); the same model and text give the same pictures.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from playwright.sync_api import Page, sync_playwright

from attnkit.integrations import smollm2 as model_files
from attnkit.tools.demo import smollm2

CHROMIUM = "/usr/bin/chromium"
WIDTH, HEIGHT = 1280, 900


def shots(found: smollm2.Found, heads: int) -> list[tuple[str, str, str, str]]:
    """(page, file name, address (#...) of the view, what it shows) for each screenshot, of a model of ``heads``
    heads a layer."""
    kind = "the induction head" if found.induction is not None else "the previous-token head"
    layer, head, _ = found.induction or found.previous
    others = ",".join(str(h) for h in range(heads) if h != head)
    p_layer, p_head, _ = found.previous
    return [
        (
            "smollm2-attention.html",
            "viewer-heads.png",
            f"#layer={layer}&lines=heads&off={others}",
            f"the head view of layer {layer}, its head {head} alone: {kind}",
        ),
        (
            "smollm2-attention.html",
            "viewer-matrix.png",
            f"#view=matrix&layer={p_layer}&head={p_head}",
            f"the matrix view of layer {p_layer}, head {p_head}: the previous-token head",
        ),
        ("smollm2-attention.html", "viewer-model.png", "#view=model", "the model view: every layer x head"),
        (
            "smollm2-attention.html",
            "viewer-decode.png",
            f"#view=model&step={smollm2.STEPS}",
            "the model view at the last decoding step: the steps stacked",
        ),
        ("smollm2-stats.html", "viewer-stats.png", "", "the statistics page of the needle, with the rollout"),
    ]


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
    model, tokenizer = model_files.load(quiet=True)
    seen = smollm2.read(model, tokenizer)
    with tempfile.TemporaryDirectory() as tmp, sync_playwright() as p:
        smollm2.draw(seen, Path(tmp))
        browser = p.chromium.launch(executable_path=CHROMIUM)
        try:
            context = browser.new_context(viewport={"width": WIDTH, "height": HEIGHT}, offline=True)
            page = context.new_page()
            requests: list[str] = []
            errors: list[str] = []
            page.on("request", lambda r: requests.append(r.url))
            page.on("console", lambda m: errors.append(m.text) if m.type in ("error", "warning") else None)
            page.on("pageerror", lambda e: errors.append(str(e)))
            heads = seen["record"][seen["names"][0]][0].shape[1]
            for html, name, fragment, caption in shots(seen["found"], heads):
                page.goto("about:blank")  # a new address with only its fragment changed would not reload the page
                page.goto((Path(tmp) / html).resolve().as_uri() + fragment)
                page.wait_for_selector("html[data-ready]", state="attached")
                shoot(page, args.out / name)
                print(f"{args.out / name}: {caption}")
            assert {r for r in requests if r != "about:blank"} <= {
                (Path(tmp) / html).resolve().as_uri() for html in smollm2.PICTURES
            }, requests  # the pages asked for nothing but themselves
            assert not errors, errors
        finally:
            browser.close()


if __name__ == "__main__":
    main()
