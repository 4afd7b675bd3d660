"""Flexible attention: sliding windows and packed documents, time and memory (docs/benchmarks.md, "Flexible
attention").

Three measurements, forward and backward, float32, on this machine's threads:

* ``window``: ``sliding_window(256)`` at ``L=8192``, B=1, H=8, D=64, on ``tiles:online``, against full causal
  attention on the same backend and against ``torch.nn.functional.scaled_dot_product_attention`` given the same
  window as a dense boolean mask. Targets: at most 0.15x the causal time, at least 3x faster than the dense mask.
* ``memory``: the peak resident-set increase of the ``window`` call on ``tiles:online`` at each ``--lengths``, each in a
  fresh process (:func:`attnkit.tools.bench.peak_memory`): it must grow linearly with ``L``.
* ``accuracy``: every built-in and a user's score_mod (a learned table of relative-position biases), on awkward sizes
  (``Lq != Lk``, lengths not multiples of the block, grouped-query heads), ``tiles:online`` in float32 against the
  ``reference`` backend in float64: the largest error of the output and of every gradient (q, k, v, and the
  slopes, the table or the sinks where they are learned). The suite's float32 tolerances are 2e-5 (outputs) and
  1e-4 (gradients).
* ``packed``: documents of log-normal lengths (at most 2048, 16384 tokens in all) through
  ``MultiHeadAttention(512, 8)``: packed into one row with ``attnkit.pack`` and ``mask_mod=packed.document()``
  (causal), against the same documents padded to the longest with ``valid_lens`` (causal). Target: at most 0.7x.

Exit status 1 when a target is missed. Times are medians of ``--repeats`` runs; the contenders of one measurement
run in turn, round after round, so that load from elsewhere on a shared machine falls on all of them alike. Ratios
compare contenders of the same run.

Usage::

    python benchmarks/flex.py                       # all three, prints a table; --json FILE saves the numbers
    python benchmarks/flex.py --only window --repeats 3
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

import attnkit
from attnkit import mods
from results import finish

B, H, D = 1, 8, 64
WINDOW = 256
WINDOW_LENGTH = 8192
MEMORY_LENGTHS = (8192, 32768)
PACKED_TOKENS, PACKED_MAX, HIDDEN = 16384, 2048, 512
TARGETS = {"window_vs_causal": 0.15, "dense_mask_vs_window": 3.0, "packed_vs_padded": 0.7}

# B batch, H heads, L length, D head dim, E hidden size


def timed_rounds(contenders: dict[str, Callable[[], None]], repeats: int) -> dict[str, float]:
    """Median seconds of each contender, run in turn ``repeats`` times after one warm-up round."""
    for run in contenders.values():
        run()
    seconds: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(repeats):
        for name, run in contenders.items():
            start = time.perf_counter()
            run()
            seconds[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in seconds.items()}


def window_contenders(length: int) -> dict[str, Callable[[], None]]:
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, length, D, requires_grad=True) for _ in range(3))  # (B, H, L, D) each
    dout = torch.randn(B, H, length, D)  # (B, H, L, D)
    window = mods.sliding_window(WINDOW)

    def online(**kw: Any) -> Callable[[], None]:
        def run() -> None:
            attnkit.scaled_dot_product_attention(q, k, v, backend="tiles:online", **kw).output.backward(dout)

        return run

    positions = torch.arange(length)
    distance = positions[:, None] - positions[None, :]  # (L, L): p - j
    dense = (distance >= 0) & (distance < WINDOW)  # (L, L) bool, the same window

    def sdpa_dense() -> None:
        F.scaled_dot_product_attention(q, k, v, attn_mask=dense).backward(dout)

    return {
        "tiles:online sliding_window(256)": online(mask_mod=window),
        "tiles:online causal": online(is_causal=True),
        "F.sdpa dense window mask": sdpa_dense,
    }


def measure_window(repeats: int) -> dict[str, Any]:
    times = timed_rounds(window_contenders(WINDOW_LENGTH), repeats)
    return {
        "seconds": times,
        "window_vs_causal": times["tiles:online sliding_window(256)"] / times["tiles:online causal"],
        "dense_mask_vs_window": times["F.sdpa dense window mask"] / times["tiles:online sliding_window(256)"],
    }


def memory_child(length: int) -> dict[str, Any]:
    """In a fresh process: the peak RSS increase of one forward and backward of the window on tiles:online."""
    from attnkit.tools.bench import peak_memory

    torch.manual_seed(0)
    attnkit.scaled_dot_product_attention(
        *(torch.randn(B, H, 512, D, requires_grad=True) for _ in range(3)),
        mask_mod=mods.sliding_window(WINDOW),
        backend="tiles:online",
    ).output.sum().backward()  # warm-up: thread pools, lazy imports
    q, k, v = (torch.randn(B, H, length, D, requires_grad=True) for _ in range(3))  # (B, H, L, D)
    dout = torch.randn(B, H, length, D)
    inputs_bytes = 4 * 4 * B * H * length * D  # q, k, v and dout
    start = time.perf_counter()
    peak = peak_memory(
        lambda: attnkit.scaled_dot_product_attention(
            q, k, v, mask_mod=mods.sliding_window(WINDOW), backend="tiles:online"
        ).output.backward(dout)
    )
    return {"peak_bytes": peak, "inputs_bytes": inputs_bytes, "seconds": time.perf_counter() - start}


def measure_memory(lengths: list[int]) -> dict[int, dict[str, Any]]:
    results = {}
    for length in lengths:
        proc = subprocess.run(
            [sys.executable, __file__, "--memory-child", str(length)], capture_output=True, text=True, check=True
        )
        results[length] = json.loads(proc.stdout.strip().splitlines()[-1])
    return results


def document_lengths(seed: int = 0) -> list[int]:
    """Log-normal lengths (median 400, sigma 1), each in [1, PACKED_MAX], summing to PACKED_TOKENS."""
    g = torch.Generator().manual_seed(seed)
    lengths: list[int] = []
    while sum(lengths) < PACKED_TOKENS:
        n = int(torch.empty(1).log_normal_(math.log(400), 1.0, generator=g).clamp(1, PACKED_MAX))
        lengths.append(min(n, PACKED_TOKENS - sum(lengths)))
    return lengths


def packed_contenders(lengths: list[int]) -> dict[str, Callable[[], None]]:
    torch.manual_seed(0)
    mha = attnkit.MultiHeadAttention(HIDDEN, 8)
    longest = max(lengths)
    lens = torch.tensor(lengths)
    x = torch.randn(len(lengths), longest, HIDDEN)  # (B, L, E), padded to the longest document
    packed = attnkit.pack(x, lens)
    data = packed.data.detach().requires_grad_()  # (1, N, E)
    padded = x.requires_grad_()

    def run_packed() -> None:
        mha(data, data, data, is_causal=True, mask_mod=packed.document()).sum().backward()

    def run_padded() -> None:
        mha(padded, padded, padded, lens, is_causal=True).sum().backward()

    return {"packed (document mask)": run_packed, "padded to the longest": run_padded}


def measure_packed(repeats: int) -> dict[str, Any]:
    lengths = document_lengths()
    times = timed_rounds(packed_contenders(lengths), repeats)
    return {
        "documents": len(lengths),
        "longest": max(lengths),
        "padded_tokens": len(lengths) * max(lengths),
        "seconds": times,
        "packed_vs_padded": times["packed (document mask)"] / times["padded to the longest"],
    }


def accuracy_cases(Lq: int, Lk: int, H: int) -> dict[str, Callable[[dict[str, Tensor]], dict[str, Any]]]:
    """Each case: given the learned tensors (float32 or float64), the keyword arguments of the call."""
    ids_q = torch.arange(Lq).div(Lq // 3 + 1, rounding_mode="floor")[None]  # (1, Lq): three documents
    ids_k = torch.arange(Lk).div(Lk // 3 + 1, rounding_mode="floor")[None]  # (1, Lk)

    def relative(t: dict[str, Tensor]) -> dict[str, Any]:
        table = t["table"]

        def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return score + table[h, q_idx - kv_idx + Lk - 1]

        return {"score_mod": score_mod, "is_causal": True}

    return {
        "sliding_window(37)": lambda t: {"mask_mod": mods.sliding_window(37)},
        "alibi (learned slopes)": lambda t: {"score_mod": mods.alibi(t["slopes"]), "is_causal": True},
        "softcap(2)": lambda t: {"score_mod": mods.softcap(2.0)},
        "document": lambda t: {"mask_mod": mods.document(ids_q, ids_k)},
        "prefix_lm": lambda t: {"mask_mod": mods.prefix_lm(torch.tensor([11, 50]))},
        "and_masks(document, window)": lambda t: {
            "mask_mod": mods.and_masks(mods.document(ids_q, ids_k), mods.sliding_window(20))
        },
        "or_masks(window, prefix_lm)": lambda t: {
            "mask_mod": mods.or_masks(mods.sliding_window(9), mods.prefix_lm(torch.tensor([5, 30])))
        },
        "user score_mod (bias table)": relative,
        "sinks, causal": lambda t: {"sinks": t["sinks"], "is_causal": True},
    }


def measure_accuracy() -> dict[str, dict[str, float]]:
    from attnkit.backends.tiles import online

    B, H, Hkv, Lq, Lk, Dh = 2, 4, 2, 150, 203, 40  # lengths no multiple of the 64-key blocks used below
    g = torch.Generator().manual_seed(0)
    base = {
        "q": torch.randn(B, H, Lq, Dh, generator=g, dtype=torch.float64),
        "k": torch.randn(B, Hkv, Lk, Dh, generator=g, dtype=torch.float64),
        "v": torch.randn(B, Hkv, Lk, Dh, generator=g, dtype=torch.float64),
        "slopes": mods.alibi_slopes(H).double(),
        "table": 0.1 * torch.randn(H, Lq + Lk - 1, generator=g, dtype=torch.float64),
        "sinks": torch.randn(H, generator=g, dtype=torch.float64),
    }
    dout = torch.randn(B, H, Lq, Dh, generator=g, dtype=torch.float64)
    errors: dict[str, dict[str, float]] = {}
    for name, make in accuracy_cases(Lq, Lk, H).items():
        runs = []
        for dtype, backend in ((torch.float64, "reference"), (torch.float32, "tiles:online")):
            t = {n: x.to(dtype, copy=True).requires_grad_() for n, x in base.items()}
            with online.settings(block_size=64):
                out = attnkit.scaled_dot_product_attention(t["q"], t["k"], t["v"], backend=backend, **make(t)).output
            out.backward(dout.to(dtype))
            runs.append({"output": out.detach(), **{n: x.grad for n, x in t.items() if x.grad is not None}})
        errors[name] = {n: float((runs[1][n].double() - runs[0][n]).abs().max()) for n in runs[0]}
        errors[name].update(
            {f"|{n}|": float(runs[0][n].abs().max()) for n in ("slopes", "table", "sinks") if n in runs[0]}
        )
    return errors


def report(results: dict[str, Any]) -> str:
    lines = [f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, forward + backward", ""]
    if "window" in results:
        w = results["window"]
        lines += [f"sliding_window({WINDOW}), L={WINDOW_LENGTH}, B={B}, H={H}, D={D}:", ""]
        lines += ["| contender | seconds (median) |", "|---|---:|"]
        lines += [f"| {name} | {s:.3f} |" for name, s in w["seconds"].items()]
        lines += [
            "",
            f"window / causal on tiles:online: {w['window_vs_causal']:.3f} (target <= {TARGETS['window_vs_causal']})",
            f"dense-mask SDPA / window: {w['dense_mask_vs_window']:.2f}x (target >= {TARGETS['dense_mask_vs_window']})",
            "",
        ]
    if "memory" in results:
        lines += ["| L | peak memory increase | inputs and output gradient | seconds |", "|---:|---:|---:|---:|"]
        for length, m in results["memory"].items():
            lines.append(
                f"| {length} | {m['peak_bytes'] / 2**20:.0f} MiB | {m['inputs_bytes'] / 2**20:.0f} MiB "
                f"| {m['seconds']:.2f} |"
            )
        lines.append("")
    if "accuracy" in results:
        lines += [
            "tiles:online in float32 against reference in float64 "
            "(B=2, H=4, Hkv=2, Lq=150, Lk=203, D=40, 64-key blocks):",
            "",
            "| modifier | output | dq | dk | dv | gradient of the learned tensor |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for name, e in results["accuracy"].items():
            learned = next(
                (f"{e[n]:.1e} ({n}, largest {e[f'|{n}|']:.1e})" for n in ("slopes", "table", "sinks") if n in e), "-"
            )
            lines.append(f"| {name} | {e['output']:.1e} | {e['q']:.1e} | {e['k']:.1e} | {e['v']:.1e} | {learned} |")
        lines.append("")
    if "packed" in results:
        p = results["packed"]
        lines += [
            f"{p['documents']} documents, {PACKED_TOKENS} tokens, longest {p['longest']} "
            f"(padded: {p['padded_tokens']} positions), MultiHeadAttention({HIDDEN}, 8), causal:",
            "",
            "| contender | seconds (median) |",
            "|---|---:|",
        ]
        lines += [f"| {name} | {s:.3f} |" for name, s in p["seconds"].items()]
        lines += ["", f"packed / padded: {p['packed_vs_padded']:.2f} (target <= {TARGETS['packed_vs_padded']})"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("window", "memory", "accuracy", "packed"), action="append")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--lengths", default=",".join(map(str, MEMORY_LENGTHS)))
    parser.add_argument("--json")
    parser.add_argument("--memory-child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_child:
        print(json.dumps(memory_child(args.memory_child)))
        return 0
    wanted = args.only or ["window", "memory", "accuracy", "packed"]
    results: dict[str, Any] = {}
    if "window" in wanted:
        results["window"] = measure_window(args.repeats)
    if "memory" in wanted:
        results["memory"] = measure_memory([int(n) for n in args.lengths.split(",")])
    if "accuracy" in wanted:
        results["accuracy"] = measure_accuracy()
    if "packed" in wanted:
        results["packed"] = measure_packed(args.repeats)
    return finish(results, report(results), missed_targets(results), args.json)


def missed_targets(results: dict[str, Any]) -> list[str]:
    """The targets (:data:`TARGETS`) this run missed."""
    missed = []
    window, packed = results.get("window"), results.get("packed")
    if window and window["window_vs_causal"] > TARGETS["window_vs_causal"]:
        missed.append(f"window / causal {window['window_vs_causal']:.3f} > {TARGETS['window_vs_causal']}")
    if window and window["dense_mask_vs_window"] < TARGETS["dense_mask_vs_window"]:
        missed.append(
            f"dense-mask SDPA / window {window['dense_mask_vs_window']:.2f} < {TARGETS['dense_mask_vs_window']}"
        )
    if packed and packed["packed_vs_padded"] > TARGETS["packed_vs_padded"]:
        missed.append(f"packed / padded {packed['packed_vs_padded']:.2f} > {TARGETS['packed_vs_padded']}")
    return missed


if __name__ == "__main__":
    sys.exit(main())
