"""Fitting text into a matplotlib figure: wrapping a title to a width in inches, measuring labels (for
:mod:`attnkit.tools.plot`; matplotlib is imported only when a text is measured)."""

from __future__ import annotations

import functools
import textwrap
from collections.abc import Callable, Sequence

SLACK = 0.95  # a title is wrapped to this much of its width: Agg draws up to 2% wider than font metrics measure


def fill(text: str, inches: float, points: float | str) -> str:
    """``text`` wrapped (:func:`textwrap.wrap`, which also breaks a word too long for a line) to the most characters
    a line can have and still be at most ``inches`` wide in a ``points`` font; lines the text breaks itself stay.

    The layout engine keeps a text inside the figure by moving the panels, but cannot make a text narrower than
    the figure; ``wrap=True`` on a text does, at spaces only. Widths are measured, not counted in characters:
    ``"W" * 40`` at 10 pt is 5.5 inches, ``"i" * 40`` 1.6.
    """
    width = measure(points)
    for chars in range(len(text), 1, -1):  # the widest that fits: a title is short, this is a few hundred tries
        lines = [line for part in text.split("\n") for line in textwrap.wrap(part, chars) or [""]]
        if all(width(line) <= inches for line in lines):
            return "\n".join(lines)
    return "\n".join(line for part in text.split("\n") for line in textwrap.wrap(part, 1) or [""])


def inches(labels: Sequence[str], points: float | str) -> float:
    """How wide the widest of ``labels`` is, in inches, in a ``points`` font (0 for none)."""
    return max(map(measure(points), set(labels)), default=0.0)


def measure(points: float | str) -> Callable[[str], float]:
    """A function giving the width in inches of one line of text in a ``points`` font (a size in points, or a name
    such as ``"medium"``): the sum of its characters' widths as matplotlib's font metrics give them. Kerning is
    left out, which can only make a sum a little wider than the line. Per character, so that thousands of token
    labels take milliseconds to measure (a call per label took 1.9 s for 10,000 labels on this 2-core machine)."""
    from matplotlib.font_manager import FontProperties
    from matplotlib.textpath import text_to_path

    font = FontProperties(size=points)

    @functools.cache
    def char(c: str) -> float:
        return text_to_path.get_text_width_height_descent(c, font, ismath=False)[0] / 72

    return lambda text: sum(map(char, text))
