"""Decoding with key/value caches: a step against the memory-bandwidth limit, generation against the book's loop
(docs/benchmarks.md, "Decoding").

* ``step``: one decode step of ``MultiHeadAttention(512, 8)`` at a context of 4096 (a growing cache prefilled in
  one call), B=1, float32, no grad; against (a) the time to read the cache and the layer's weights once at this
  machine's read bandwidth, measured in the same run (``x.sum()`` over 1 GiB after each round of 10 steps: the
  physical limit of a step is reading what it must read; the median of the rounds' ratios), target at most 2x;
  and (b) recomputing the full causal forward over the 4097 positions, target at least 20x slower than the step.
* ``generate``: a 2-layer decoder-only model (hidden 512 and 8 heads, the step's layer; and hidden 256, 4 heads,
  reported beside it), B=8 ragged prompts of 128-256 tokens (right-padded, no left padding), 256 tokens generated
  greedily: with a ``KVCache`` per layer, against the book's loop, which keeps every layer's raw inputs and
  re-projects them all at each step. Target: at least 5x (on the first model), with identical tokens.
* ``layout``: why caches keep keys and values positions last from 4096 positions on CPU: one decode step's
  attention (8 heads of 64, no grad) from memory (a 64 MiB read before each call evicts the L3 cache) over keys and
  values stored positions last (attnkit's two products) and stored ``(B, H, L, D)`` (PyTorch's SDPA kernel), at
  several contexts and batches; a 4096-query causal prefill over positions-last keys, by SDPA on them as they are
  and on a contiguous copy; and the stacked q/k/v projection of one row, ``(1, 512) @ (512, 1536)``, three ways.
* ``gqa``: the cache of ``num_kv_heads=2`` of 8 heads holds a quarter of the bytes of the full-head cache.
* ``demo``: the Transformer of ``attnkit demo`` (untrained: the timing does not depend on the weights) generating
  21 tokens for 256 sources, with its caches and by decoding the whole prefix again at every step.

Times are medians; contenders run in turn, round after round. Exit status 1 when a target is missed.

Usage::

    python benchmarks/decode.py [--json FILE] [--only step|generate|layout|gqa|demo ...]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

import attnkit
from results import finish

TARGETS = {"step_vs_bandwidth": 2.0, "full_vs_step": 20.0, "book_vs_cached": 5.0}

# B batch, L positions, E hidden size, V vocabulary


def median_seconds(run: Callable[[], object], repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@torch.no_grad()
def measure_step(context: int = 4096, rounds: int = 21, steps_per_round: int = 10) -> dict[str, Any]:
    """Rounds of ``steps_per_round`` decode steps back to back, each round followed by one read of 1 GiB: this
    machine's bandwidth moves (a shared host), so each round's step is set against the bandwidth measured beside
    it, and the ratio is the median of the rounds'. Steps back to back are one layer decoding alone: its 20 MiB
    may stay partly in the 32 MiB L3 cache from one step to the next.

    Reported beside it, in each round: cold steps (a 64 MiB read, untimed, before each: a layer among others,
    whose cache comes from memory), and reading as many bytes as a step reads from memory (one of four such
    buffers in turn, after the same untimed 64 MiB read), which the cold step is set against."""
    torch.manual_seed(0)
    mha = attnkit.MultiHeadAttention(512, 8).eval()
    total = rounds * (2 * steps_per_round + 1) + 1
    x = torch.randn(1, context + total, 512)  # (1, L, E)
    cache = attnkit.KVCache()
    mha(x[:, :context], x[:, :context], x[:, :context], is_causal=True, cache=cache)  # prefill
    steps = iter(range(context, context + total))

    def step() -> None:
        t = next(steps)
        xt = x[:, t : t + 1]  # (1, 1, E)
        mha(xt, xt, xt, is_causal=True, cache=cache)

    weights = sum(p.nbytes for p in mha.parameters())
    cache_bytes = 2 * 8 * (context + total // 2) * 64 * 4  # keys and values a step reads: (1, 8, L, 64) float32
    big, evict = torch.ones(2**28), torch.ones(2**24)  # 1 GiB; 64 MiB, twice the L3 cache
    buffers = [torch.ones((cache_bytes + weights) // 4) for _ in range(4)]
    turn = iter(range(10**9))

    def read_same_bytes() -> None:
        buffers[next(turn) % len(buffers)].sum()

    big.sum()
    step_times, bandwidths, cold_times, read_times = [], [], [], []
    for _ in range(rounds):
        step_times.append(median_seconds(step, steps_per_round))
        start = time.perf_counter()
        big.sum()
        bandwidths.append(big.nbytes / (time.perf_counter() - start))
        cold_times.append(cold_seconds(step, evict, steps_per_round - 1))
        read_times.append(cold_seconds(read_same_bytes, evict, steps_per_round - 1))
    needed = cache_bytes + weights
    ratios = [s * b / needed for s, b in zip(step_times, bandwidths, strict=True)]
    cold_ratios = [s * b / needed for s, b in zip(cold_times, bandwidths, strict=True)]
    read_ratios = [s / r for s, r in zip(cold_times, read_times, strict=True)]
    full = x[:, : context + 1]
    full_s = median_seconds(lambda: mha(full, full, full, is_causal=True), 3)
    step_s, bandwidth = statistics.median(step_times), statistics.median(bandwidths)
    return {
        "step_s": step_s,
        "step_s_range": [min(step_times), max(step_times)],
        "cold_step_s": statistics.median(cold_times),
        "full_forward_s": full_s,
        "bandwidth_gb_s": bandwidth / 1e9,
        "bandwidth_gb_s_range": [min(bandwidths) / 1e9, max(bandwidths) / 1e9],
        "bytes_read": needed,
        "read_once_s": needed / bandwidth,
        "step_vs_bandwidth": statistics.median(ratios),
        "step_vs_bandwidth_rounds": ratios,
        "cold_step_vs_bandwidth": statistics.median(cold_ratios),
        "read_same_bytes_s": statistics.median(read_times),
        "cold_step_vs_reading_same_bytes": statistics.median(read_ratios),
        "full_vs_step": full_s / step_s,
    }


def cold_seconds(run: Callable[[], object], evict: Tensor, repeats: int) -> float:
    """The median time of ``run`` with the L3 cache evicted (``evict.sum()``, untimed) before each call."""
    run()
    times = []
    for _ in range(repeats):
        evict.sum()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class TinyLM(nn.Module):
    """A decoder-only model: embedding, pre-norm blocks of causal self-attention and a feed-forward, a head."""

    def __init__(self, vocab: int = 1000, hidden: int = 256, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.position = nn.Embedding(1024, hidden)
        self.norms = nn.ModuleList(nn.LayerNorm(hidden) for _ in range(2 * layers))
        self.attention = nn.ModuleList(attnkit.MultiHeadAttention(hidden, heads) for _ in range(layers))
        self.ffn = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
            for _ in range(layers)
        )
        self.head = nn.Linear(hidden, vocab)

    def inputs(self, tokens: Tensor, positions: Tensor) -> Tensor:
        return self.embed(tokens) + self.position(positions)  # (B, L, E)

    def block(self, i: int, x: Tensor, attend: Callable[[nn.Module, Tensor], Tensor]) -> Tensor:
        x = x + attend(self.attention[i], self.norms[2 * i](x))
        return x + self.ffn[i](self.norms[2 * i + 1](x))


@torch.no_grad()
def generate_cached(model: TinyLM, prompts: Tensor, lens: Tensor, steps: int) -> Tensor:
    """Prefill the ragged prompts, then one token a step, each layer with its KVCache. Returns ``(B, steps)``."""
    caches = [attnkit.KVCache() for _ in model.attention]
    B, P = prompts.shape
    x = model.inputs(prompts, torch.arange(P).expand(B, P))  # (B, P, E)
    for i, cache in enumerate(caches):
        x = model.block(i, x, lambda m, h, c=cache: m(h, h, h, lens, is_causal=True, cache=c))
    last = x[torch.arange(B), lens - 1]  # (B, E): each row's last real position
    token = model.head(last).argmax(-1, keepdim=True)  # (B, 1)
    out, position = [token], lens.clone()
    for _ in range(steps - 1):
        x = model.inputs(token, position[:, None])  # (B, 1, E)
        for i, cache in enumerate(caches):
            x = model.block(i, x, lambda m, h, c=cache: m(h, h, h, is_causal=True, cache=c))
        token = model.head(x[:, 0]).argmax(-1, keepdim=True)
        out.append(token)
        position += 1
    return torch.cat(out, dim=1)  # (B, steps)


@torch.no_grad()
def generate_book(model: TinyLM, prompts: Tensor, lens: Tensor, steps: int) -> Tensor:
    """The book's loop: every layer keeps its raw inputs so far (``state[2][i]``, right-padded per row here) and
    re-projects all of them as keys and values at every step; the queries are the new positions."""
    B, P = prompts.shape
    x = model.inputs(prompts, torch.arange(P).expand(B, P))  # (B, P, E)
    seen = []  # per layer: (B, P + steps, E) raw inputs, row b valid up to its length
    for i in range(len(model.attention)):
        raw = x.new_zeros(B, P + steps, x.shape[-1])
        raw[:, :P] = model.norms[2 * i](x)
        seen.append(raw)
        x = model.block(i, x, lambda m, h: m(h, h, h, lens, is_causal=True))
    token = model.head(x[torch.arange(B), lens - 1]).argmax(-1, keepdim=True)
    out, position = [token], lens.clone()
    for _ in range(steps - 1):
        x = model.inputs(token, position[:, None])  # (B, 1, E)
        for i in range(len(model.attention)):
            raw = seen[i]

            def attend(m: nn.Module, h: Tensor, raw: Tensor = raw, at: Tensor = position) -> Tensor:
                raw[torch.arange(B), at] = h[:, 0]  # this step's input at each row's own position
                n = int(at.max()) + 1
                return m(h, raw[:, :n], raw[:, :n], at + 1)  # keys [0, at_b] of each row

            x = model.block(i, x, attend)
        token = model.head(x[:, 0]).argmax(-1, keepdim=True)
        out.append(token)
        position += 1
    return torch.cat(out, dim=1)


# The models generating: (hidden, heads). The target is checked on the first, whose layer is the step's
# MultiHeadAttention(512, 8); the second, smaller one is reported beside it.
GENERATORS = ((512, 8), (256, 4))


def measure_generate(repeats: int = 3) -> dict[str, Any]:
    return {f"{hidden}x{heads}": measure_generator(hidden, heads, repeats) for hidden, heads in GENERATORS}


def measure_generator(hidden: int, heads: int, repeats: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model = TinyLM(hidden=hidden, heads=heads).eval()
    B, P, steps = 8, 256, 256
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(128, P + 1, (B,), generator=g)
    prompts = torch.randint(0, 1000, (B, P), generator=g)
    cached = generate_cached(model, prompts, lens, steps)
    book = generate_book(model, prompts, lens, steps)
    times: dict[str, list[float]] = {"cached": [], "book": []}
    for _ in range(repeats):
        for name, run in (("cached", generate_cached), ("book", generate_book)):
            start = time.perf_counter()
            run(model, prompts, lens, steps)
            times[name].append(time.perf_counter() - start)
    cached_s, book_s = statistics.median(times["cached"]), statistics.median(times["book"])
    return {
        "hidden": hidden,
        "heads": heads,
        "prompt_lens": lens.tolist(),
        "identical_tokens": bool(torch.equal(cached, book)),
        "cached_s": cached_s,
        "book_s": book_s,
        "book_vs_cached": book_s / cached_s,
    }


@torch.no_grad()
def measure_layout(repeats: int = 15) -> dict[str, Any]:
    from attnkit.backends.decode import positions_last

    torch.manual_seed(0)
    evict = torch.ones(2**24)  # 64 MiB, twice the L3 cache
    H, D = 8, 64
    steps = {}
    for B, L in ((1, 512), (1, 2048), (1, 4096), (1, 8192), (8, 400), (8, 1024)):
        q = torch.randn(B, H, 1, D)
        kv = [torch.randn(B, H, 2 * L, D) for _ in range(2)]  # a grown cache: capacity 2L, L held
        rows = [t[:, :, :L] for t in kv]  # (B, H, L, D) memory: SDPA's kernel
        last = [positions_last(t)[:, :, :L] for t in kv]  # positions last: the two products
        sdpa_s = cold_seconds(
            lambda q=q, r=rows: attnkit.scaled_dot_product_attention(q, *r, backend="sdpa"), evict, repeats
        )
        last_s = cold_seconds(
            lambda q=q, r=last: attnkit.scaled_dot_product_attention(q, *r, backend="decode"), evict, repeats
        )
        steps[f"B={B} L={L}"] = {"sdpa_kernel_s": sdpa_s, "positions_last_s": last_s, "ratio": last_s / sdpa_s}
    q = torch.randn(1, H, 4096, D)
    last = [positions_last(torch.randn(1, H, 4096, D)) for _ in range(2)]
    as_is = cold_seconds(lambda: F.scaled_dot_product_attention(q, *last, is_causal=True), evict, 3)
    copied = cold_seconds(
        lambda: F.scaled_dot_product_attention(q, *(t.contiguous() for t in last), is_causal=True), evict, 3
    )
    x, weight = torch.randn(1, 512), torch.randn(1536, 512)  # the stacked (O, E) weights of MultiHeadAttention(512, 8)
    x2 = x.view(1, 1, 512).expand(2, 1, 512)  # (2, 1, E)
    halves = weight.view(2, 768, 512).transpose(1, 2)  # (2, E, O/2) over (O, E) memory
    halves_t = weight.t().contiguous().view(512, 2, 768).permute(1, 0, 2)  # (2, E, O/2) over (E, O) memory
    projection = {
        "F.linear": cold_seconds(lambda: F.linear(x, weight), evict, repeats),
        "two halves of (O, E)": cold_seconds(lambda: torch.bmm(x2, halves), evict, repeats),
        "two halves of (E, O) (attnkit)": cold_seconds(lambda: torch.bmm(x2, halves_t), evict, repeats),
    }
    return {
        "decode_step": steps,
        "prefill_4096_s": {"sdpa on positions-last keys": as_is, "sdpa on a contiguous copy (attnkit)": copied},
        "projection_s": projection,
    }


def measure_gqa() -> dict[str, Any]:
    sizes = {}
    x = torch.randn(1, 4096, 512)
    with torch.no_grad():
        for hkv in (8, 2):
            cache = attnkit.KVCache()
            attnkit.MultiHeadAttention(512, 8, num_kv_heads=hkv).eval()(x, x, x, is_causal=True, cache=cache)
            sizes[hkv] = cache.nbytes
    assert sizes[2] * 4 == sizes[8], sizes
    return {"full_heads_bytes": sizes[8], "gqa_2_of_8_bytes": sizes[2], "ratio": sizes[2] / sizes[8]}


def measure_demo(repeats: int = 3) -> dict[str, Any]:
    from attnkit.tools import demo

    torch.manual_seed(0)
    model = demo.models.TransformerSeq2Seq(max_positions=64).eval()
    g = torch.Generator().manual_seed(0)
    src = torch.randint(3, 13, (256, 20), generator=g)
    lens = torch.randint(5, 21, (256,), generator=g)
    src[torch.arange(20)[None] >= lens[:, None]] = demo.models.PAD
    same = torch.equal(demo.models.greedy(model, src, lens, 21), demo.models.greedy(model, src, lens, 21, cache=False))
    times = {
        name: median_seconds(lambda c=cache: demo.models.greedy(model, src, lens, 21, cache=c), repeats)
        for name, cache in (("with the cache", True), ("without (whole prefix each step)", False))
    }
    return {"identical_tokens": same, "seconds": times}


def report(r: dict[str, Any]) -> str:
    lines = [f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, no grad", ""]
    if "step" in r:
        s = r["step"]
        lines += [
            "MultiHeadAttention(512, 8), context 4096, B=1, one decode step:",
            "",
            "| what | value |",
            "|---|---:|",
            f"| decode step (median of the rounds' medians) | {s['step_s'] * 1e3:.2f} ms "
            f"({s['step_s_range'][0] * 1e3:.2f}-{s['step_s_range'][1] * 1e3:.2f}) |",
            f"| read bandwidth (x.sum() over 1 GiB after each round) | {s['bandwidth_gb_s']:.1f} GB/s "
            f"({s['bandwidth_gb_s_range'][0]:.1f}-{s['bandwidth_gb_s_range'][1]:.1f}) |",
            f"| bytes a step must read (cache + weights) | {s['bytes_read'] / 2**20:.1f} MiB |",
            f"| reading them once at that bandwidth | {s['read_once_s'] * 1e3:.2f} ms |",
            f"| decode step from memory (a 64 MiB read before each) | {s['cold_step_s'] * 1e3:.2f} ms |",
            f"| reading as many bytes from memory (sum(), a 64 MiB read before each) | "
            f"{s['read_same_bytes_s'] * 1e3:.2f} ms |",
            f"| full causal forward over 4097 positions | {s['full_forward_s'] * 1e3:.0f} ms |",
            "",
            f"step / reading once: {s['step_vs_bandwidth']:.2f}x, median of the rounds "
            f"({min(s['step_vs_bandwidth_rounds']):.2f}-{max(s['step_vs_bandwidth_rounds']):.2f}) "
            f"(target <= {TARGETS['step_vs_bandwidth']})",
            f"step from memory / reading once: {s['cold_step_vs_bandwidth']:.2f}x (reported)",
            f"step from memory / reading as many bytes from memory: {s['cold_step_vs_reading_same_bytes']:.2f}x "
            "(reported)",
            f"full forward / step: {s['full_vs_step']:.0f}x (target >= {TARGETS['full_vs_step']})",
            "",
        ]
    if "generate" in r:
        gens = list(r["generate"].values())
        lines += [
            f"256 tokens after ragged prompts {gens[0]['prompt_lens']}, B=8, 2 layers:",
            "",
            "| model | cached | book's loop (re-projects all inputs each step) | book / cached | same tokens |",
            "|---|---:|---:|---:|---|",
        ]
        lines += [
            f"| hidden {g['hidden']}, {g['heads']} heads | {g['cached_s']:.2f} s | {g['book_s']:.2f} s | "
            f"{g['book_vs_cached']:.1f}x | {g['identical_tokens']} |"
            for g in gens
        ]
        lines += ["", f"target: book / cached >= {TARGETS['book_vs_cached']} for hidden 512, 8 heads", ""]
    if "layout" in r:
        lay = r["layout"]
        lines += [
            "One decode step's attention from memory (8 heads of 64, a cache of capacity 2L holding L):",
            "",
            "| batch, context | SDPA kernel, (B, H, L, D) memory | two products, positions last | ratio |",
            "|---|---:|---:|---:|",
        ]
        lines += [
            f"| {name} | {t['sdpa_kernel_s'] * 1e3:.3f} ms | {t['positions_last_s'] * 1e3:.3f} ms | {t['ratio']:.2f} |"
            for name, t in lay["decode_step"].items()
        ]
        lines += ["", "Causal prefill of 4096 queries over positions-last keys and values:", ""]
        lines += [f"* {name}: {sec * 1e3:.0f} ms" for name, sec in lay["prefill_4096_s"].items()]
        lines += ["", "Stacked q/k/v projection of one row, (1, 512) @ (512, 1536), weights from memory:", ""]
        lines += [f"* {name}: {sec * 1e3:.3f} ms" for name, sec in lay["projection_s"].items()]
        lines += [""]
    if "gqa" in r:
        q = r["gqa"]
        lines += [
            f"cache bytes at 4096 positions: 8 of 8 heads {q['full_heads_bytes'] / 2**20:.0f} MiB, 2 of 8 "
            f"{q['gqa_2_of_8_bytes'] / 2**20:.0f} MiB ({q['ratio']:.2f})",
            "",
        ]
    if "demo" in r:
        d = r["demo"]
        lines += ["attnkit demo's Transformer, 256 sources, 21 tokens, greedy:", "", "| | seconds |", "|---|---:|"]
        lines += [f"| {name} | {s:.3f} |" for name, s in d["seconds"].items()]
        lines += ["", f"identical tokens: {d['identical_tokens']}"]
    return "\n".join(lines)


def missed_targets(r: dict[str, Any]) -> list[str]:
    missed = []
    if "step" in r and r["step"]["step_vs_bandwidth"] > TARGETS["step_vs_bandwidth"]:
        missed.append(f"step / reading once {r['step']['step_vs_bandwidth']:.2f} > {TARGETS['step_vs_bandwidth']}")
    if "step" in r and r["step"]["full_vs_step"] < TARGETS["full_vs_step"]:
        missed.append(f"full forward / step {r['step']['full_vs_step']:.0f} < {TARGETS['full_vs_step']}")
    if "generate" in r:
        hidden, heads = GENERATORS[0]
        gen = r["generate"][f"{hidden}x{heads}"]
        if gen["book_vs_cached"] < TARGETS["book_vs_cached"]:
            missed.append(f"book / cached {gen['book_vs_cached']:.1f} < {TARGETS['book_vs_cached']}")
        for name, g in r["generate"].items():
            if not g["identical_tokens"]:
                missed.append(f"{name}: the cached generation's tokens differ from the book loop's")
    return missed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("step", "generate", "layout", "gqa", "demo"), action="append")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    wanted = args.only or ["step", "generate", "layout", "gqa", "demo"]
    measures = {
        "step": measure_step,
        "generate": measure_generate,
        "layout": measure_layout,
        "gqa": measure_gqa,
        "demo": measure_demo,
    }
    results = {name: measures[name]() for name in wanted}
    return finish(results, report(results), missed_targets(results), args.json)


if __name__ == "__main__":
    sys.exit(main())
