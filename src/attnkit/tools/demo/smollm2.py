"""``attnkit demo --smollm2``: what a real pretrained model attends to, drawn. SmolLM2-135M-Instruct (installed
offline, :mod:`attnkit.integrations.smollm2`) reads a sentence said twice and goes on from it; its heads are
measured on that text and the ones that show something are named:

* **sink heads**: heads whose queries put at least half their weight on the first token (an attention sink), on
  average over the queries after it;
* the strongest **previous-token head**: the most weight, on average, on the key just before the query;
* the strongest **induction head**: on the queries whose token came before (not just before), the most weight, on
  average, on the tokens that followed it those times (what lets a model continue a repeated sequence).

Then a needle in a haystack of ``NEEDLE_TOKENS`` tokens is read with :func:`attnkit.record_stats` and
:func:`attnkit.rollout` from the answer's position: a statistics page of every layer and head, with the rollout
drawn. Nothing is trained; the same text gives the same pages.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor

__all__ = ["NEEDLE_TOKENS", "PICTURES", "STEPS", "TEXT", "Found", "describe", "draw", "find_heads", "installed", "read"]

# H heads, L the text's tokens, P (query, key) pairs of the induction measure

TEXT = "The cat sat on the mat because it was warm. Later, the cat sat on the mat again, because it was warm."
NEEDLE_TOKENS = 1024  # the needle page's context (a forward with statistics and rollout: a few seconds here)
STEPS = 10  # decoding steps after TEXT, each a call on the page's slider reading one generated token
SINK_SHARE = 0.5  # the threshold of the statistics page's "sink" kind (which measures the first 4 keys, not 1)
PICTURES = ("smollm2-attention.html", "smollm2-heads.png", "smollm2-stats.html")


class Found(NamedTuple):
    """What :func:`find_heads` measured, each head as ``(layer index, head)``.

    Attributes:
        sinks: the heads whose queries put at least ``SINK_SHARE`` of their weight on the first token (mean over
            the queries after it).
        sink: ``(layer, head, mean weight on the first token)`` of the head that puts the most there.
        heads: every head there is.
        previous: ``(layer, head, mean weight on the previous token)`` of the strongest previous-token head.
        induction: ``(layer, head, mean weight on the tokens that followed the query's token before)`` of the
            strongest induction head; ``None`` when no token comes back (other than right after itself).
    """

    sinks: list[tuple[int, int]]
    sink: tuple[int, int, float]
    heads: int
    previous: tuple[int, int, float]
    induction: tuple[int, int, float] | None


def installed() -> bool:
    """Whether SmolLM2 and all that loads it are installed (the demo then offers ``--smollm2``)."""
    from attnkit.integrations import smollm2

    try:
        smollm2.check_installed()
    except ModuleNotFoundError:
        return False
    return True


def find_heads(weights: list[Tensor], ids: list[int]) -> Found:
    """Sink, previous-token and induction heads of one sequence.

    Args:
        weights: one ``(H, L, L)`` tensor of causal attention weights per layer, of the sequence's ``L`` tokens.
        ids: the sequence's ``L`` token ids.

    Returns:
        A :class:`Found`. The induction measure reads, for each query whose token came before at positions ``e``
        (other than the position just before it), its weight summed over the keys ``e + 1`` that followed those
        times, leaving out the key just before the query (a previous-token head's); then the mean over such queries.

    Raises:
        ValueError: no layer, fewer than 2 tokens, or a layer whose weights are not ``(H, L, L)`` for ``L = len(ids)``
            (naming the layer and its shape), or are negative or not finite.
    """
    L = len(ids)
    if not weights:
        raise ValueError("weights: no layer; one (H, L, L) tensor per layer")
    if L < 2:
        raise ValueError(f"ids: {L} token(s); the heads are measured on at least 2")
    for layer, w in enumerate(weights):
        if w.dim() != 3 or w.shape[1:] != (L, L):
            raise ValueError(f"weights[{layer}]: {tuple(w.shape)}, expected (H, {L}, {L}) for {L} ids")
        if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
            raise ValueError(f"weights[{layer}]: attention weights are finite and at least 0")
    pairs = []  # (query, key): the token after an earlier occurrence of the query's token, not the query's previous
    for i in range(L):
        pairs += [(i, e + 1) for e in range(i - 2) if ids[e] == ids[i]]
    queries = torch.arange(1, L)  # (L - 1,): every query but the first
    sinks, best_sink, best_previous, best_induction = [], (0, 0, -1.0), (0, 0, -1.0), None
    for layer, w in enumerate(weights):
        w = w.double()  # (H, L, L)
        first = w[:, 1:, 0].mean(dim=1)  # (H,)
        previous = w[:, queries, queries - 1].mean(dim=1)  # (H,)
        sinks += [(layer, h) for h in range(w.shape[0]) if first[h] >= SINK_SHARE]
        h = int(first.argmax())
        if first[h] > best_sink[2]:
            best_sink = (layer, h, float(first[h]))
        h = int(previous.argmax())
        if previous[h] > best_previous[2]:
            best_previous = (layer, h, float(previous[h]))
        if pairs:
            q, k = torch.tensor(pairs).T  # (P,), (P,)
            on = torch.zeros(w.shape[0], L, dtype=torch.float64).index_add_(1, q, w[:, q, k])  # (H, L): per query
            asked = torch.unique(q)  # the queries whose token came before
            induction = on[:, asked].mean(dim=1)  # (H,)
            h = int(induction.argmax())
            if best_induction is None or induction[h] > best_induction[2]:
                best_induction = (layer, h, float(induction[h]))
    return Found(sinks, best_sink, sum(w.shape[0] for w in weights), best_previous, best_induction)


def read(model: Any, tokenizer: Any) -> dict[str, Any]:
    """SmolLM2 reads :data:`TEXT` and generates ``STEPS`` tokens greedily, its weights recorded; then the needle
    page's statistics and rollout. Returns what :func:`draw` draws."""
    import attnkit
    from attnkit.integrations import smollm2

    ids = tokenizer(TEXT, return_tensors="pt").input_ids  # (1, L)
    with torch.no_grad(), attnkit.record_weights(model) as steps:  # (the last token generated is never read)
        out = model.generate(
            ids, max_new_tokens=STEPS + 1, do_sample=False, pad_token_id=tokenizer.eos_token_id
        )  # (1, L + STEPS + 1)
    record = {name: steps.calls(name) for name in steps}  # {layer: [(1, H, L, L), then (1, H, 1, L + t) per step]}
    found = find_heads([calls[0][0] for calls in record.values()], ids[0].tolist())
    needle = smollm2.needle(tokenizer, NEEDLE_TOKENS)
    with torch.no_grad(), attnkit.record_stats(model) as stats, attnkit.rollout(model, targets=-1) as flow:
        model(needle.ids)
    return {
        "record": record,
        "tokens": [tokenizer.decode(t) for t in out[0, :-1]],  # the last token generated is never read
        "names": list(record),
        "found": found,
        "stats": stats,
        "rollout": flow,
        "needle": needle,
        "needle_tokens": [tokenizer.decode(t) for t in needle.ids[0]],
    }


def describe(seen: dict[str, Any]) -> list[str]:
    """What the pages show, a line each."""
    found, names = seen["found"], seen["names"]
    layer, h, share = found.sink
    lines = [
        f"{len(found.sinks)} of {found.heads} heads put at least {SINK_SHARE:.0%} of their weight on the first token;"
        f" the most, {names[layer]}, head {h} ({share:.0%})"
    ]
    layer, h, share = found.previous
    lines.append(f"previous-token head: {names[layer]}, head {h} ({share:.0%} on the token before)")
    if found.induction is not None:
        layer, h, share = found.induction
        lines.append(f"induction head: {names[layer]}, head {h} ({share:.0%} on what followed its token before)")
    relevance = seen["rollout"].relevance[0, 0]  # (L,)
    lines.append(f"rollout from the needle question's answer: the first token gets {float(relevance[0]):.2%}")
    return lines


def draw(seen: dict[str, Any], out_dir: Path) -> list[Path]:
    """The pages and the picture of :data:`PICTURES`, written into ``out_dir``. Returns the paths."""
    from attnkit.tools import plot, viewer

    found, names, tokens = seen["found"], seen["names"], seen["tokens"]
    prompt = len(seen["record"][names[0]][0][0, 0])  # the text's tokens, before the generated ones
    paths = [out_dir / name for name in PICTURES]
    viewer.view(seen["record"], tokens=tokens, title="SmolLM2-135M-Instruct: a sentence said twice", path=paths[0])
    chosen = [found.sink[:2], found.previous[:2]]
    kinds = ["sink", "previous token", "induction"]
    if found.induction is not None:
        chosen.append(found.induction[:2])
    panels = torch.stack([seen["record"][names[layer]][0][0, h] for layer, h in chosen])  # (panels, L, L)
    plot.plot_attention(
        panels,
        query_labels=tokens[:prompt],
        key_labels=tokens[:prompt],
        path=paths[1],
        title="SmolLM2-135M-Instruct reading a sentence said twice",
        head_titles=[f"{kind}: layer {layer}, head {h}" for kind, (layer, h) in zip(kinds, chosen, strict=False)],
    )
    viewer.view(
        seen["stats"],
        seen["needle_tokens"],
        rollout=seen["rollout"],
        title=f"SmolLM2-135M-Instruct: a needle in {seen['needle'].ids.shape[1]} tokens",
        path=paths[2],
    )
    return paths
