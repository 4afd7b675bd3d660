"""``attnkit.d2l.MultiHeadAttention`` against the book's own code, forward and backward: the drop-in's cost.

The two contenders are the ``d2l`` and ``book`` rows of ``attnkit bench`` (:func:`attnkit.tools.bench.make_call`: same
inputs, same weights, the book's 2-D ``valid_lens`` for causal). On a shared machine one timing of each is not
enough to tell a few per cent apart: single calls are timed in pairs, one of each (who goes first alternates),
``--pairs`` times, and the report gives each one's median time and the median (with the quartiles) of the
per-pair ratios ``d2l / book``, below 1 when the drop-in is faster. A burst of load from elsewhere slows both
calls of a pair, and leaves their ratio alone.

    python benchmarks/d2l_vs_book.py                 # B=8, L in (128, 512), every mask, train
    python benchmarks/d2l_vs_book.py --L 128 --pairs 101 --mode infer
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from attnkit.tools import bench

CONTENDERS = ("book", "d2l")


def paired_times(calls: dict, pairs: int, warmup: int = 3) -> dict[str, list[float]]:
    """Seconds of single calls, one of each contender in turn (who goes first alternates), ``pairs`` times."""
    for _ in range(warmup):
        for call in calls.values():
            call()
    times: dict[str, list[float]] = {c: [] for c in calls}
    for i in range(pairs):
        for c in CONTENDERS if i % 2 == 0 else CONTENDERS[::-1]:
            start = time.perf_counter()
            calls[c]()
            times[c].append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--B", type=int, default=8)
    parser.add_argument("--L", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--mask", nargs="+", default=list(bench.MASKS), choices=bench.MASKS)
    parser.add_argument("--mode", default="train", choices=bench.MODES)
    parser.add_argument("--pairs", type=int, default=41)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    rate = bench.matmul_gflops(512)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32 matmul {rate:.0f} GFLOP/s")
    print("| B | L | mode | mask | book ms | d2l ms | d2l / book | quartiles of the ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for L in args.L:
        for mask in args.mask:
            calls = {c: bench.make_call("mha", args.B, L, args.mode, mask, c) for c in CONTENDERS}
            times = paired_times(calls, args.pairs)
            ratios = [d / b for d, b in zip(times["d2l"], times["book"], strict=True)]
            q1, q2, q3 = statistics.quantiles(ratios, n=4)
            book_ms, d2l_ms = (statistics.median(times[c]) * 1e3 for c in CONTENDERS)
            config = f"| {args.B} | {L} | {args.mode} | {mask} |"
            print(f"{config} {book_ms:.3g} | {d2l_ms:.3g} | {q2:.3f} | {q1:.3f} - {q3:.3f} |", flush=True)


if __name__ == "__main__":
    main()
