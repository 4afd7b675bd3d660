"""An interactive attention viewer: one self-contained HTML file (``attnkit view``, :func:`attnkit.tools.plot.view`).

The page holds everything it needs: its script and style are inline, the weights are embedded in it, and a
Content-Security-Policy forbids it any request, so it opens from disk, offline, in any browser, and a notebook
shows it inline (``AttentionView._repr_html_``, in an iframe of its own). Every view takes the window's
width (and is laid out again when the window is resized). Three views of one record:

* **heads**: query tokens on the left, key tokens at the window's right edge, the lines across the width between
  them (rows of 18 px, taller, up to 40, when the window has room). A line per weight (opacity = weight; lines for
  weights under 0.01 are not drawn), drawn one of two ways (the page's "lines" toggle, or ``#lines=`` in the
  address): ``heads``, each head's lines in its colour; ``average``, a line per weight of the mean over the
  visible heads, in one colour (a weight a reduced page did not keep counts as 0). A page whose widest layer has 5
  heads or more opens in the average mode (a dozen heads' colours drawn over each other read as grey), one of 4 or
  fewer in the heads mode. Click a head to hide or show it (click its key/value group's label for the whole group):
  hidden heads leave the average too; hover a token to see only its lines, the tokens on the other side lit by
  weight (the largest of the visible heads', or their mean in the average mode), and the keys a mask hides hatched.
* **model**: a grid of small matrices, layers by heads, as large as the window's width (and height, to a point)
  allows; click one to open it in the matrix view. A row of a small matrix is drawn 12 px tall at least, so that a
  decoding step (1 query x ``Lk`` keys) is a strip, not a line of one pixel; and at a decoding step, a layer's
  steps so far (the calls of as many queries before it, each following the one before, as through a cache; not a
  prefill of more queries) are stacked, a row per step: a steps x keys matrix, each head scaled to its largest
  weight in those steps, grey where a step did not have that key yet.
* **matrix**: one head's weights, large (cells up to 40 px, as the window allows), with the tokens on the axes; the
  value under the mouse.

What it reads: a record of :func:`attnkit.record_weights` (or a mapping of module names to calls), a tensor, or
what a Hugging Face model returns with ``output_attentions=True``: ``outputs.attentions``, a tuple (or list) of
one ``(B, H, L, L)`` tensor per layer (``example`` picks the row of the batch; one example's ``(H, L, L)`` per
layer is read too), or ``generate(..., output_attentions=True, return_dict_in_generate=True).attentions``, a tuple
per step of those tuples: each layer's calls, the prompt then a step each, on the slider. Layers need not agree in
heads or lengths. A model that returned no weights (an empty tuple, or ``None`` for a layer: its attention was not
the eager one) is an error that says how to get them.

Padding and masked positions are drawn apart from low weights: attnkit gives a weight of exactly 0 where a
mask hides a key (and nowhere else, but for float32 underflow at scores more than about 100 below the row's
largest), so a cell of exactly 0 is drawn hatched grey, a key that no query sees (padding past ``valid_lens``)
is struck out, as is a query that sees no key. Heads that share a key/value head (``kv_heads``, grouped-query
attention) are grouped and coloured alike. Query and key tokens are separate lists (cross-attention). A
record's calls of one module (a whole sequence, then decoding steps through a cache) are browsed with a slider;
a module called fewer times shows its last call.

Token placement: a call's keys take the first ``Lk`` tokens and its queries, with self-attention tokens, the last
``Lq`` of those: right for whole sequences and for decoding one sequence through a growing cache
(:class:`attnkit.KVCache()`, transformers' default cache). A static cache (keys = every slot of ``max_len``), a
sliding one (keys in ring order) or a ragged batch's shorter rows (their queries stand at their own length, not at
the longest row's) are drawn with the positions of that rule, not the rows' own: view their weights per call, or a
batch of one.

The address may choose what the page opens on: ``page.html#view=matrix&layer=3&head=1``,
``#layer=5&step=2&hover=q3&off=0,1`` (the head view with query 3 hovered and heads 0 and 1 hidden), or
``#lines=average`` (``#lines=heads``) for the head view's lines.

Size: up to 1,048,576 weights in all, every weight is kept exactly (float32). Past that, each row keeps its
largest weights (as many as fit 4,000,000 in all, at least 1), rounded to 1/255 of its matrix's largest, with
their key positions; the page says so, and how much of each row's weight the kept ones hold. The model view's
small matrices are averaged to 64 cells a side at most. A 12 layers x 12 heads x 1024 x 1024 record makes a
file of 17 MB (docs/guide/viewer.md gives the measured size and time to interactive).
"""

from __future__ import annotations

import html
import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from attnkit._atomic import write_atomically
from attnkit.tools.viewer import _data, _encode, _stats
from attnkit.tools.viewer._data import EXACT_CELLS, MAX_ENTRIES, THUMB

__all__ = ["EXACT_CELLS", "MAX_ENTRIES", "THUMB", "AttentionView", "view"]


@dataclass(frozen=True)
class AttentionView:
    """A viewer page: ``html`` is the whole file; ``path`` where it was written (``None`` when not written);
    ``notes`` what the page says it reduced or left out."""

    html: str
    path: Path | None
    notes: tuple[str, ...]

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the page to ``path`` atomically (a temporary file beside it, renamed into place).

        Raises:
            ValueError: ``path`` does not end in ``.html`` or ``.htm`` (the page is HTML, whatever the name says).
            FileNotFoundError: when the folder does not exist (naming ``path``).
            OSError: when it cannot be written (nothing is left behind).
        """
        target = Path(path)
        if not target.is_dir() and target.suffix.lower() not in (".html", ".htm"):  # (a folder: write_atomically says)
            raise ValueError(f"path must end in .html or .htm (the page is one HTML file), got {str(path)!r}")
        return write_atomically(target, lambda f: f.write(self.html.encode("utf-8")))

    def _repr_html_(self) -> str:
        """The page in an iframe of its own (a notebook cell shows it inline; its script and style stay apart
        from the notebook's)."""
        return (
            f'<iframe srcdoc="{html.escape(self.html, quote=True)}" style="width: 100%; height: 720px; '
            'border: 1px solid #ccc" sandbox="allow-scripts"></iframe>'
        )


def view(
    weights: Any,
    tokens: Sequence[Any] | None = None,
    query_tokens: Sequence[Any] | None = None,
    key_tokens: Sequence[Any] | None = None,
    *,
    path: str | os.PathLike[str] | None = None,
    layer_tokens: Mapping[str, Any] | None = None,
    kv_heads: int | Mapping[str, int] | None = None,
    example: int = 0,
    title: str | None = None,
    rollout: Any = None,
    sweep: Any = None,
) -> AttentionView:
    """An interactive page of attention weights: head view, model view and matrix view, in one HTML file.

    Args:
        weights: a record from :func:`attnkit.record_stats` (or what its ``save`` wrote, loaded back): a page of
            per layer x head summaries (entropy, sink mass, attention distance) and each query's strongest keys,
            at any length (``query_tokens``, ``key_tokens``, ``layer_tokens`` and ``kv_heads`` do not apply; a
            call through a :class:`~attnkit.KVCache` labels its queries and keys with the tokens at their own
            positions, which the record keeps); or
            a record from :func:`attnkit.record_weights` (each module a layer, its calls on a slider; a
            mapping ``{name: (B, H, Lq, Lk) or (B, Lq, Lk) tensor, or a list of them, one per call}`` is read
            the same way, e.g. ``torch.save({n: rec.calls(n) for n in rec}, f)`` loaded back), or a tuple or list
            of one tensor per layer, ``(B, H, Lq, Lk)`` or ``(H, Lq, Lk)`` (Hugging Face's ``outputs.attentions``
            with ``output_attentions=True``; the layers are named ``"layer 0"``, ...), or a tuple of those per call
            (``generate``'s ``attentions``), or a tensor or array of weights ``(Lq, Lk)``, ``(H, Lq, Lk)`` or
            ``(layers, H, Lq, Lk)``. Weights are finite and ``>= 0``; exactly 0 is drawn as masked.
        tokens: the tokens of a self-attention sequence, for queries and keys. A call with ``Lk`` keys is labelled
            with the first ``Lk`` and its queries with the last ``Lq`` of those (a decoding step through a cache
            stands at the end of its keys), so the list must be as long as the longest call's keys.
        query_tokens, key_tokens: cross-attention: keys as above; a call's queries continue those of the layer's
            call before (a whole sequence, or a prefill, then steps of one), starting over when the list is used
            up; the list must be as long as the queries reach.
        path: write the page there, a ``.html`` or ``.htm`` file (atomically: a temporary file, renamed into
            place); ``None``: only return it.
        layer_tokens: ``{layer name: tokens or (query_tokens, key_tokens)}`` for models whose layers see
            different sequences (an encoder-decoder); other layers get ``tokens``/``query_tokens``/``key_tokens``.
        kv_heads: key/value heads (grouped-query attention), for every layer or ``{layer name: number}``: query
            head ``h`` shares key/value head ``h // (H // kv_heads)``; the page groups and colours them so. By
            default, what a ``record_weights`` record says of its layers (``record.kv_heads``).
        example: the row of a record's batch (or of a tuple of layers' batch) to show.
        title: the page's title.
        rollout, sweep: on a statistics page, what :func:`attnkit.rollout` found (each target's relevance over
            the positions, drawn) and what :func:`attnkit.head_sweep` returned (its layer x head table of logit
            changes, shaded).

    Returns:
        An :class:`AttentionView` (``.html``, ``.path``, ``.notes``; a notebook shows it inline).

    Raises:
        ValueError: a ``path`` that is not a ``.html`` or ``.htm`` file; ``query_tokens``, ``key_tokens``,
            ``layer_tokens`` or ``kv_heads`` given with a statistics record (they do not apply); for weights of
            another shape, empty, negative or not finite; a tuple of layers that is empty
            or holds ``None`` (a Hugging Face model whose attention returned no weights: the message says to load
            it with ``attn_implementation="eager"``), naming the layer; token lists that do not match
            the positions they label (naming the layer and the lengths); an ``example`` past the batch; a
            ``kv_heads`` that does not divide the heads; layer names that are not in the record.
        TypeError: for weights or tokens of the wrong type (a string where a list of tokens is wanted).
        FileNotFoundError, OSError: when ``path`` cannot be written (nothing is left behind).

    Example:
        >>> page = view(torch.softmax(torch.randn(2, 3, 3), -1), tokens=["the", "cat", "sat"])
        >>> page.html.startswith("<!DOCTYPE html>"), page.notes
        (True, ())
    """
    if _stats.is_stats(weights):  # a record_stats record (or one saved and loaded back): its own page
        if title is not None and not isinstance(title, str):
            raise TypeError(f"title must be a string, got {type(title).__name__}: {title!r}")
        given: dict[str, object] = {"query_tokens": query_tokens, "key_tokens": key_tokens}
        given |= {"layer_tokens": layer_tokens, "kv_heads": kv_heads}
        ignored = [name for name, value in given.items() if value is not None]
        if ignored:
            raise ValueError(
                f"{', '.join(ignored)} do not apply to a page of statistics (a record_stats record knows its "
                "key/value heads and its calls' positions): give tokens alone"
            )
        heading = title if title is not None else "attention statistics"
        payload = _stats.encode(weights, tokens, example, heading, rollout, sweep)
        page = AttentionView(_html(payload, heading, "stats_page.html", "stats.js"), None, tuple(payload["notes"]))
        return AttentionView(page.html, page.save(path), page.notes) if path is not None else page
    if rollout is not None or sweep is not None:
        raise ValueError("rollout and sweep are shown on a page of statistics (a record_stats record), not of weights")
    layers, notes = _data.collect(weights, example)
    if title is not None and not isinstance(title, str):
        raise TypeError(f"title must be a string, got {type(title).__name__}: {title!r}")
    layer_tokens, kv_heads = (_model_named(m) for m in (layer_tokens, kv_heads))
    _data.assign_tokens(layers, tokens, query_tokens, key_tokens, layer_tokens)
    if kv_heads is None:  # a record knows the grouped-query layers it recorded (those still shown)
        shown = {layer.name for layer in layers}
        known = {(n or "(model)"): k for n, k in getattr(weights, "kv_heads", {}).items()}  # as layers are named
        kv_heads = {n: k for n, k in known.items() if n in shown} or None
    _data.check_groups(layers, kv_heads)
    heading = title if title is not None else "attention"
    payload = _encode.encode(layers, heading, notes)
    page = AttentionView(_html(payload, heading), None, tuple(payload["notes"]))
    if path is not None:
        return AttentionView(page.html, page.save(path), page.notes)
    return page


def _asset(name: str) -> str:
    return resources.files("attnkit.tools.viewer").joinpath(name).read_text(encoding="utf-8")


def _model_named(per_layer: Any) -> Any:
    """A ``{layer name: ...}`` mapping with the record's name of the model itself, ``""``, as the page names it."""
    if not isinstance(per_layer, Mapping):
        return per_layer
    return {(name or "(model)") if isinstance(name, str) else name: value for name, value in per_layer.items()}


def _html(payload: dict[str, Any], title: str, page: str = "page.html", script: str = "viewer.js") -> str:
    # "<" as \u003c: no "</script>" or "<!--" inside the data can end or change its script element
    data = json.dumps(payload, separators=(",", ":"), allow_nan=False).replace("<", "\\u003c")
    parts = {
        "title": html.escape(title),
        "style": _asset("viewer.css"),
        "script": _asset(script),
        "data": data,
    }
    pieces = re.split(r"\{\{(\w+)\}\}", _asset(page))  # text, marker, text, marker, ..., text
    return "".join(parts[p] if i % 2 else p for i, p in enumerate(pieces))
