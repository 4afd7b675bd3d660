"""What each press keeps of SmolLM2-135M-Instruct's cache, measured (issue 50): needle retrieval and next-token
agreement against the full cache, per press and compression ratio; and the cost of exact scores at 8k tokens.

Quality (``--lengths``, default 1024,2048):

* **needle**, RULER's ``niah_single_1`` form: a 7-digit value ("One of the special magic numbers for {key} is:
  {value}.") at depths 10-90% of a haystack of RULER's noise sentences, in SmolLM2's chat template; the context is
  prefilled and compressed, then the question and the answer prefix ("The special magic number for {key} mentioned
  in the provided text is") are fed over the kept cache at their own positions, and 10 tokens decoded greedily:
  correct when the value is among them. ``QuestionAware`` prefills the context with the question and compresses
  then (its window: the question's tokens), the rest as the others.
* **next tokens**: on held-out text (Debian's ``/usr/share/common-licenses``, natural English the model never saw
  here), the context compressed, then the next 32 real tokens fed over the kept cache one at a time (H2O
  evicts as it goes): the KL divergence of each step's next-token distribution from the full cache's, and
  the share of steps whose top-1 token agrees.

The prefill of a context is the same whatever the press (a press compresses a layer's cache after that layer's
attention has run), so each context is prefilled once, its every layer's queries, keys and values kept, and each
press scores and compresses from those with its own ``score`` and ``choose``; ``--check`` confirms, on one case,
that this keeps what ``with press(model): model(...)`` keeps. H2O, which acts at every decoding step, runs as a real
press in the next-token part only.

Speed (``--speed``): ObservedAttention's scoring of all 30 layers at 8,192 tokens (time and extra peak over the
same prefill, each in a fresh process), and a decode step over the cache compressed at ratio 0.5 against the full
cache's.

Usage::

    python benchmarks/presses.py --json presses.json --plot docs/pictures/presses.png    # 1k and 2k: ~10 min
    python benchmarks/presses.py --lengths 4096,8192 --depths 3                          # the long ones
    python benchmarks/presses.py --speed
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.nn import functional as F

from attnkit import presses, recording
from attnkit.integrations import smollm2

RATIOS = (0.25, 0.5, 0.75, 0.875)

# the presses of the quality table, each made for a ratio (StreamingLLM's default 4 sinks, SnapKV's 64 rows)
PRESSES = {
    "Random": lambda r: presses.Random(r, seed=0),
    "StreamingLLM": lambda r: presses.StreamingLLM(r),
    "KNorm": lambda r: presses.KNorm(r),
    "ObservedAttention": lambda r: presses.ObservedAttention(r),
    "SnapKV": lambda r: presses.SnapKV(r),
    "TOVA": lambda r: presses.TOVA(r),
}


class _Keep(recording.Observer):
    """Keeps each layer's statistics parts during one prefill."""

    def __init__(self) -> None:
        super().__init__()
        self.parts: dict[int, Any] = {}

    def observe(self, name, module, parts, kv_heads):
        self.parts[module.layer_idx] = parts()


def prefill(model, ids: torch.Tensor) -> tuple[Any, list[presses.Layer]]:
    """The full cache of ``ids`` and each layer's :class:`attnkit.presses.Layer` (its prefill's exact attention)."""
    keep = _Keep()
    with torch.no_grad(), recording.observe(model, keep, "benchmark"):
        cache = model(ids).past_key_values
    layers = [presses.Layer(i, cache.layers[i].keys, None, keep.parts[i]) for i in range(len(cache.layers))]
    return cache, layers


def compressed(
    cache, layers: list[presses.Layer], press: presses.Press, scores: list[torch.Tensor] | None = None
) -> tuple[Any, list[torch.Tensor]]:
    """A new DynamicCache holding what ``press`` keeps of ``cache``, and the kept positions of each layer
    (``scores``: each layer's, when already computed by another press of the same kind)."""
    from transformers import DynamicCache

    out, kept_all = DynamicCache(), []
    for i, layer in enumerate(layers):
        kept, _ = press.choose(layer, press.score(layer) if scores is None else scores[i])  # (1, Hkv, n)
        index = kept[..., None]
        k, v = cache.layers[i].keys, cache.layers[i].values
        out.update(
            k.gather(2, index.expand(-1, -1, -1, k.shape[-1])), v.gather(2, index.expand(-1, -1, -1, v.shape[-1])), i
        )
        kept_all.append(kept)
    return out, kept_all


ADAPTIVE = "AdaptiveBudget(ObservedAttention)"


class Variant(NamedTuple):
    """One compressed cache of a one-row prefill: its table key, each layer's kept ``(1, Hkv, n)`` positions and
    the slots it hides ``(1, Hkv, n)`` (AdaptiveBudget's; ``None``: none)."""

    key: tuple[str, float]
    kept: list[torch.Tensor]
    hidden: list[torch.Tensor] | None = None


def variants(layers: list[presses.Layer], with_full: bool = True) -> list[Variant]:
    """Every press of ``PRESSES`` at every ratio, and AdaptiveBudget(ObservedAttention), over one prefill (each
    press's scores computed once), with the full cache first."""
    found = []
    L = layers[0].length
    if with_full:
        found.append(Variant(("Full", 0.0), [torch.arange(L).expand(1, layer.keys.shape[1], L) for layer in layers]))
    scores = {name: _scores(name, make, layers) for name, make in PRESSES.items()}
    for ratio in RATIOS:
        for name, make in PRESSES.items():
            press, mine = make(ratio), scores[name]
            found.append(
                Variant(
                    (name, ratio),
                    [press.choose(x, press.score(x) if mine is None else mine[i])[0] for i, x in enumerate(layers)],
                )
            )
        budget = presses.AdaptiveBudget(presses.ObservedAttention(ratio))
        kept, hidden = [], []
        for i, layer in enumerate(layers):
            kept.append(budget.choose(layer, scores["ObservedAttention"][i])[0])
            assert budget._last is not None
            hidden.append(~budget._last[0])
        found.append(Variant((ADAPTIVE, ratio), kept, hidden))
    return found


def groups(cache, found: list[Variant]) -> list[tuple[list[tuple[str, float]], Any, list[torch.Tensor] | None]]:
    """The variants as batches of caches of one length (a batch's step costs about what one row's costs: it reads
    the weights once): ``(keys, DynamicCache, hidden slots per layer or None)`` each."""
    from transformers import DynamicCache

    by_length: dict[int, list[Variant]] = {}
    for v in found:
        by_length.setdefault(v.kept[0].shape[-1], []).append(v)
    out = []
    for batch in by_length.values():
        c = DynamicCache()
        for i, layer in enumerate(cache.layers):
            index = torch.cat([v.kept[i] for v in batch])[..., None]  # (P, Hkv, n, 1)
            k = layer.keys.expand(len(batch), -1, -1, -1).gather(2, index.expand(-1, -1, -1, layer.keys.shape[-1]))
            val = layer.values.expand(len(batch), -1, -1, -1).gather(
                2, index.expand(-1, -1, -1, layer.values.shape[-1])
            )
            c.update(k, val, i)  # (P, Hkv, n, D) each
        hidden = None
        if any(v.hidden is not None for v in batch):
            hidden = [
                torch.cat(
                    [
                        v.hidden[i] if v.hidden is not None else torch.zeros_like(v.kept[i], dtype=torch.bool)
                        for v in batch
                    ]
                )
                for i in range(len(cache.layers))
            ]  # (P, Hkv, n) each
        out.append(([v.key for v in batch], c, hidden))
    return out


@contextlib.contextmanager
def hiding(model, hidden: list[torch.Tensor] | None):
    """The slots ``hidden[i]`` of layer ``i``'s cache hidden from its attention, as an open AdaptiveBudget hides
    them (the integration's ContextVar, private: the benchmark compresses a prefill once for every press, outside
    their blocks)."""
    from attnkit.integrations import transformers as attnkit_hf

    if hidden is None:
        yield
        return
    by_module = {id(layer.self_attn): h for layer, h in zip(model.model.layers, hidden, strict=True)}
    token = attnkit_hf.PRESS_HIDDEN.set(by_module)
    try:
        yield
    finally:
        attnkit_hf.PRESS_HIDDEN.reset(token)


def full_copy(cache):
    from transformers import DynamicCache

    out = DynamicCache()
    for i, layer in enumerate(cache.layers):
        out.update(layer.keys, layer.values, i)
    return out


def greedy(model, cache, ids: torch.Tensor, start: int, steps: int) -> list[list[int]]:
    """Feed ``ids (1, n)`` at positions ``start...`` over each row of ``cache``, then decode ``steps`` tokens
    greedily in each row: each row's tokens."""
    rows = cache.layers[0].keys.shape[0]
    ids = ids.expand(rows, -1)
    out_tokens: list[list[int]] = [[] for _ in range(rows)]
    position = start
    with torch.no_grad():
        for _ in range(steps):
            n = ids.shape[1]
            positions = torch.arange(position, position + n)[None].expand(rows, -1)
            logits = model(ids, past_key_values=cache, position_ids=positions).logits
            position += n
            ids = logits[:, -1].argmax(-1, keepdim=True)  # (rows, 1)
            for b, token in enumerate(ids[:, 0].tolist()):
                out_tokens[b].append(token)
    return out_tokens


def needles(model, tokenizer, length: int, depths: int, table: dict) -> None:
    for d in range(depths):
        depth = 0.1 + 0.8 * d / max(1, depths - 1)
        value = str(1_000_000 + (7_919_993 * (d + 1) + length) % 9_000_000)
        context, q, rest, _ = smollm2.needle(tokenizer, length, depth, value)
        n = context.shape[1]
        cache, layers = prefill(model, context)

        def correct(c, ids, start, value=value) -> list[bool]:
            return [value in tokenizer.decode(t).replace(" ", "") for t in greedy(model, c, ids, start, 10)]

        tail = torch.cat([q, rest], dim=1)
        for keys, c, hidden in groups(cache, variants(layers)):
            with hiding(model, hidden):
                for key, ok in zip(keys, correct(c, tail, n), strict=True):
                    table.setdefault(key, []).append(ok)
        # the question before compression: prefilled with the context
        with_q = torch.cat([context, q], dim=1)
        cache, layers = prefill(model, with_q)
        scores = [presses.QuestionAware(0.5, question_tokens=q.shape[1]).score(layer) for layer in layers]
        for ratio in RATIOS:
            c, _ = compressed(cache, layers, presses.QuestionAware(ratio, question_tokens=q.shape[1]), scores)
            table.setdefault(("QuestionAware", ratio), []).extend(correct(c, rest, with_q.shape[1]))
        print(f"  needle L={length} depth={depth:.2f}: done", file=sys.stderr, flush=True)


def _scores(name: str, make, layers: list[presses.Layer]) -> list[torch.Tensor] | None:
    """Each layer's scores, once for every ratio (StreamingLLM's depend on the ratio: ``None``, each its own)."""
    if name == "StreamingLLM":
        return None
    press = make(0.5)
    return [press.score(layer) for layer in layers]


def heldout_ids(tokenizer, length: int) -> torch.Tensor:
    files = sorted(glob.glob("/usr/share/common-licenses/*"))
    texts = [Path(f).read_text(errors="replace") for f in files if os.path.isfile(f)]
    if not texts:  # not Debian: the project's own docs
        texts = [
            Path(f).read_text()
            for f in sorted(
                glob.glob(os.path.join(os.path.dirname(__file__), "..", "docs", "**", "*.md"), recursive=True)
            )
        ]
    ids = tokenizer("\n\n".join(texts), return_tensors="pt").input_ids
    if ids.shape[1] < length + 32:
        raise SystemExit(f"the held-out text has {ids.shape[1]} tokens, fewer than {length + 32}")
    return ids[:, : length + 32]


def next_tokens(model, tokenizer, length: int, table: dict) -> None:
    ids = heldout_ids(tokenizer, length)
    context, future = ids[:, :length], ids[:, length:]

    def run(c) -> torch.Tensor:
        """The next-token log-probabilities ``(rows, 32, V)`` of the 32 real tokens fed as one chunk over each row
        of ``c`` (causal within the chunk: the same as 32 steps, without a press that acts while decoding)."""
        rows = c.layers[0].keys.shape[0]
        pos = torch.arange(length, length + future.shape[1])[None].expand(rows, -1)
        with torch.no_grad():
            logits = model(future.expand(rows, -1), past_key_values=c, position_ids=pos).logits
        return F.log_softmax(logits.double(), -1)

    def stepwise(c) -> torch.Tensor:
        """As ``run``, a token at a time: H2O evicts at every step."""
        logps = []
        with torch.no_grad():
            for t in range(future.shape[1]):
                pos = torch.tensor([[length + t]])
                logits = model(future[:, t : t + 1], past_key_values=c, position_ids=pos).logits
                logps.append(F.log_softmax(logits[0, -1].double(), -1))
        return torch.stack(logps)[None]  # (1, 32, V)

    cache, layers = prefill(model, context)
    full = run(full_copy(cache))[0]  # (32, V)

    def score(logp: torch.Tensor) -> tuple[float, float]:
        kl = (full.exp() * (full - logp)).sum(-1).mean().item()
        top1 = (full.argmax(-1) == logp.argmax(-1)).double().mean().item()
        return kl, top1

    table[("Full", 0.0)] = score(full)
    for keys, c, hidden in groups(cache, variants(layers, with_full=False)):
        with hiding(model, hidden):
            for key, logp in zip(keys, run(c), strict=True):
                table[key] = score(logp)
    for ratio in RATIOS:  # H2O: a real press, evicting at every step
        press = presses.H2O(ratio)
        with press(model):
            with torch.no_grad():
                c = model(context).past_key_values
            table[("H2O", ratio)] = score(stepwise(c)[0])
    print(f"  next tokens L={length}: done", file=sys.stderr, flush=True)


def check(model, tokenizer) -> None:
    """The benchmark's shortcut (one prefill, every press scoring it) keeps what a real press keeps."""
    context = smollm2.needle(tokenizer, 1024, 0.5, "1234567").context
    cache, layers = prefill(model, context)
    for name, make in PRESSES.items():
        press = make(0.5)
        _, kept = compressed(cache, layers, press)
        real = make(0.5)
        with torch.no_grad(), real(model):
            model(context)
        same = all(torch.equal(kept[i], real.kept[i]) for i in range(len(kept)))
        print(f"check {name}: {'same kept sets' if same else 'DIFFERENT kept sets'}")
        if not same:
            raise SystemExit(1)


def speed() -> dict[str, Any]:
    """Each measurement in a fresh process: the prefill at 8,192 tokens plain, scored by ObservedAttention with
    nothing removed (ratio 0: the scoring's own cost) and pressed at ratio 0.5 (time, extra peak RSS); then, in one
    process, decode steps over the full cache, the compressed one and a 16-position one, taken in turn."""
    results = {}
    for mode in ("plain", "scored", "pressed", "decode"):
        out = subprocess.run(
            [sys.executable, __file__, "--speed-child", mode], capture_output=True, text=True, check=True
        )
        results[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    return results


def _repeated(cache, batch: int):
    """A DynamicCache of ``cache``'s one row repeated ``batch`` times (a decode step's cost at that batch), each
    layer of the kind the source's is: transformers' own, or the one a press leaves (it appends in place:
    ``attnkit.presses._transformers.Compressed``, made here by keeping every position)."""
    from transformers import DynamicCache

    from attnkit.presses import _transformers

    c = DynamicCache()
    for j, layer in enumerate(cache.layers):
        c.update(layer.keys.repeat(batch, 1, 1, 1), layer.values.repeat(batch, 1, 1, 1), j)
        if isinstance(layer, _transformers.Compressed):
            B, Hkv, n = c.layers[j].keys.shape[:3]
            _transformers.keep(c.layers[j], torch.arange(n).expand(B, Hkv, n))
    return c


def _in_place(cache):
    """``cache`` (transformers' own layers) as layers that append in place, as a press leaves them, all kept."""
    from attnkit.presses import _transformers

    c = full_copy(cache)
    for layer in c.layers:
        B, Hkv, n = layer.keys.shape[:3]
        _transformers.keep(layer, torch.arange(n).expand(B, Hkv, n))
    return c


def _steps(model, caches: dict[str, Any], batch: int, rounds: int = 15) -> dict[str, float]:
    """Median ms of a decode step over each cache (its row repeated ``batch`` times), the caches taken in turn
    each round; each step's new pair dropped after it (a fresh copy each round)."""
    times: dict[str, list[float]] = {name: [] for name in caches}
    token = torch.full((batch, 1), 42)
    with torch.no_grad():
        for _ in range(rounds):
            for name, (cache, start) in caches.items():
                c = _repeated(cache, batch)
                t = time.perf_counter()
                model(token, past_key_values=c, position_ids=torch.full((batch, 1), start))
                times[name].append(time.perf_counter() - t)
    return {name: 1000 * sorted(ts[1:])[len(ts[1:]) // 2] for name, ts in times.items()}


def speed_child(mode: str) -> None:
    from attnkit.tools.bench import peak_memory

    torch.set_num_threads(os.cpu_count() or 1)
    model, tokenizer = smollm2.load(quiet=True)
    ids = heldout_ids(tokenizer, 8192)[:, :8192]
    with torch.no_grad():
        model(ids[:, :64])  # warm: kernels built, allocator primed
    if mode == "decode":
        with torch.no_grad():
            full = model(ids).past_key_values
            with presses.ObservedAttention(0.5)(model):
                half = model(ids).past_key_values
            short = model(ids[:, :16]).past_key_values
        caches = {
            "full": (full, 8192),
            "full, in place": (_in_place(full), 8192),
            "compressed": (half, 8192),
            "16 positions": (short, 16),
        }
        found = {f"b{batch}": _steps(model, caches, batch) for batch in (1, 4)}
        print(json.dumps(found))
        return
    press = presses.ObservedAttention(0.5 if mode == "pressed" else 0.0)

    def forward():
        with torch.no_grad():
            if mode != "plain":
                with press(model):
                    return model(ids).past_key_values
            return model(ids).past_key_values

    made: list[Any] = []
    t = time.perf_counter()
    peak = peak_memory(lambda: made.append(forward()))
    seconds = time.perf_counter() - t
    print(json.dumps({"prefill_s": seconds, "peak_mib": peak / 2**20, "cache": made[0].layers[0].keys.shape[2]}))


def report(needle: dict, nxt: dict, lengths: list[int]) -> str:
    lines = [
        "| press | ratio | " + " | ".join(f"needle {n}" for n in lengths) + " | KL (nats) | top-1 |",
        "|---|---|" + "---|" * (len(lengths) + 2),
    ]
    keys = {k[1:] for k in needle} | {k[1:] for k in nxt}
    for key in sorted(keys, key=lambda k: (k[0] != "Full", k[0], k[1])):
        name, ratio = key
        cells = []
        for n in lengths:
            found = needle.get((n, *key))
            cells.append(f"{sum(found)}/{len(found)}" if found else "")
        kl = [nxt[(n, *key)] for n in lengths if (n, *key) in nxt]
        kl_text = " / ".join(f"{k:.3f}" for k, _ in kl)
        top_text = " / ".join(f"{t:.2f}" for _, t in kl)
        lines.append(f"| {name} | {ratio} | " + " | ".join(cells) + f" | {kl_text} | {top_text} |")
    return "\n".join(lines)


def plot(needle: dict, lengths: list[int], path: str) -> None:
    """Accuracy against ratio, a line per press, a panel per length; lines that coincide stay visible (each press
    its own marker size and line style), the legend beside the panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from attnkit._atomic import write_atomically

    fig, axes = plt.subplots(1, len(lengths), figsize=(4.6 * len(lengths) + 1.8, 3.6), squeeze=False)
    names = sorted({k[1] for k in needle if k[1] != "Full"})
    styles = ["-", "--", "-.", ":"]
    for ax, n in zip(axes[0], lengths, strict=True):
        full = needle.get((n, "Full", 0.0))
        if full:
            ax.axhline(sum(full) / len(full), color="black", linewidth=0.8, label="full cache")
        for i, name in enumerate(names):
            xs = [r for r in RATIOS if (n, name, r) in needle]
            ys = [sum(needle[(n, name, r)]) / len(needle[(n, name, r)]) for r in xs]
            ax.plot(xs, ys, marker="o", markersize=11 - 1.2 * i, fillstyle="none", linestyle=styles[i % 4], label=name)
        ax.set(
            title=f"needle retrieval, L = {n}",
            xlabel="compression_ratio (share removed)",
            ylabel="accuracy (10 depths)",
            ylim=(-0.05, 1.05),
        )
    axes[0][-1].legend(fontsize=8, loc="center left", bbox_to_anchor=(1.02, 0.5))
    fig.tight_layout()
    write_atomically(Path(path), lambda f: fig.savefig(f, format="png", dpi=110))


def _from_json(path: str) -> tuple[dict, dict, list[int]]:
    with open(path) as f:
        saved = json.load(f)

    def key(text: str) -> tuple:
        n, name, ratio = text.split("|")
        return int(n), name, float(ratio)

    needle = {key(k): v for k, v in saved["needle"].items()}
    nxt = {key(k): tuple(v) for k, v in saved["next"].items()}
    return needle, nxt, sorted({k[0] for k in needle})


def _lengths(text: str) -> list[int]:
    """``--lengths``: positive whole numbers, comma-separated (argparse says what is wrong, in one line)."""
    try:
        found = [int(n) for n in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated token counts such as 1024,2048, got {text!r}"
        ) from None
    if not found or min(found) < 64:
        raise argparse.ArgumentTypeError(f"each length must be at least 64 tokens, got {text!r}")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="1024,2048", type=_lengths, help="comma-separated token counts")
    parser.add_argument("--depths", type=int, default=10, choices=range(1, 101), metavar="1..100")
    parser.add_argument("--json")
    parser.add_argument("--plot")
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--speed", action="store_true")
    parser.add_argument("--speed-child")
    parser.add_argument("--replot", help="a --json file written before: its table and --plot again, nothing run")
    args = parser.parse_args(argv)
    if args.speed_child:
        speed_child(args.speed_child)
        return 0
    if args.speed:
        r = speed()
        p, z, q = r["plain"], r["scored"], r["pressed"]
        print(f"prefill of 8192 tokens: plain {p['prefill_s']:.1f} s, peak +{p['peak_mib']:.0f} MiB")
        for name, m in (("scored, nothing removed", z), ("pressed at 0.5", q)):
            print(
                f"  ObservedAttention {name}: {m['prefill_s']:.1f} s ({m['prefill_s'] / p['prefill_s']:.2f}x), "
                f"peak +{m['peak_mib']:.0f} MiB ({m['peak_mib'] - p['peak_mib']:+.0f} MiB)"
            )
        for batch, steps in r["decode"].items():
            full, in_place, half, floor = (steps[k] for k in ("full", "full, in place", "compressed", "16 positions"))
            print(
                f"decode step, batch {batch[1:]}: full cache (8192) {full:.1f} ms, the same appended in place "
                f"{in_place:.1f} ms, compressed (4096) {half:.1f} ms ({half / full:.2f}x the first, "
                f"{half / in_place:.2f}x the second); 16 positions {floor:.1f} ms ({floor / full:.2f}x)"
            )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(r, f, indent=1)
        return 0
    if args.replot:
        if not os.path.isfile(args.replot):
            parser.error(f"--replot: no file {args.replot!r} (a --json file an earlier run wrote)")
        needle, nxt, lengths = _from_json(args.replot)
        print(report(needle, nxt, lengths))
        if args.plot:
            plot(needle, lengths, args.plot)
        return 0
    torch.set_num_threads(os.cpu_count() or 1)
    model, tokenizer = smollm2.load(quiet=True)
    if args.check:
        check(model, tokenizer)
        return 0
    lengths = args.lengths
    start = time.perf_counter()
    needle: dict = {}
    nxt: dict = {}
    for n in lengths:
        table: dict = {}
        needles(model, tokenizer, n, args.depths, table)
        for key, found in table.items():
            needle[(n, *key)] = found
        table = {}
        next_tokens(model, tokenizer, n, table)
        for key, found in table.items():
            nxt[(n, *key)] = found
    took = time.perf_counter() - start
    print(report(needle, nxt, lengths))
    print(f"\n{len(lengths)} lengths, {args.depths} depths, {took / 60:.1f} min on {torch.get_num_threads()} threads")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "needle": {"|".join(map(str, k)): v for k, v in needle.items()},
                    "next": {"|".join(map(str, k)): v for k, v in nxt.items()},
                    "minutes": took / 60,
                },
                f,
                indent=1,
            )
    if args.plot:
        plot(needle, lengths, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
