"""Peak memory of each backend, forward and backward, as the sequence grows.

Measures ``attnkit.scaled_dot_product_attention(q, k, v, backend=NAME)`` followed by ``out.backward(dout)``
with ``B=1, H=8, D=64``, float32, ``Lq = Lk = L``, and ``q, k, v`` requiring grad.

How: every (backend, L) runs in a fresh subprocess (``--one BACKEND L``), so that no allocator cache or earlier
peak is carried over. The child runs a small warm-up call (one-time initialisation is not counted), creates the
inputs and the output gradient, makes the call, and reports how far its peak resident set size rose above the
size before the call (:func:`attnkit.tools.bench.peak_memory`: ``VmHWM`` after a reset through
``/proc/self/clear_refs``). This works on a CPU-only machine (Linux), where there is no
``torch.cuda.max_memory_allocated``. The time is one run of forward and backward.

A configuration is skipped, not run, when its memory estimate exceeds ``--budget-gib``: for ``reference``,
three copies of the ``(B, H, L, L)`` float32 scores/weights; for every backend, the peak measured at the
largest smaller ``L`` scaled by ``(L / L_smaller) ** 2`` (attention memory grows at most quadratically, so
this bounds it from above). A child that fails, times out or is killed is reported in its row.

Usage::

    python benchmarks/memory.py                          # all backends, L in 1024, 4096, 16384
    python benchmarks/memory.py --lengths 1024,4096 --backends sdpa,tiles:online --json memory.json
    python benchmarks/memory.py --block-size 128         # attnkit.backends.tiles.online.settings(block_size=128)
"""

from __future__ import annotations

import argparse
import gc
import json
import signal
import subprocess
import sys
import time
from typing import Any

B, H, D = 1, 8, 64
DTYPE = "float32"
BYTES_PER_ELEMENT = 4
LENGTHS = (1024, 4096, 16384)
BACKENDS = ("reference", "sdpa", "tiles:online")
BUDGET_GIB = 12.0
# Copies of the (B, H, L, L) scores/weights that the reference backend holds at its peak (forward + backward).
REFERENCE_COPIES = 3
WARMUP_LENGTH = 128
TIMEOUT_S = 3600
NOTE_WIDTH = 60  # characters of a failure note shown in the table

# B batch, H heads, L = Lq = Lk sequence length, D head dim


def weights_bytes(length: int) -> int:
    """What the ``(B, H, L, L)`` float32 weights alone take."""
    return B * H * length * length * BYTES_PER_ELEMENT


def format_bytes(n: float) -> str:
    if n >= 2**30:
        return f"{n / 2**30:.1f} GiB"
    return f"{n / 2**20:.0f} MiB"


# ---------------------------------------------------------------------------------------------- child process


def measure_one(backend: str, length: int, block_size: int | None) -> dict[str, Any]:
    """Forward and backward of one call in this process; the peak RSS increase and the time it took."""
    import torch

    import attnkit
    from attnkit.backends.tiles import online
    from attnkit.tools.bench import peak_memory

    def inputs(n: int) -> tuple[torch.Tensor, ...]:
        q, k, v = (torch.randn(B, H, n, D, requires_grad=True) for _ in range(3))  # (B, H, L, D) each
        dout = torch.randn(B, H, n, D)  # (B, H, L, D), the gradient of the output
        return q, k, v, dout

    def call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor) -> None:
        out = attnkit.scaled_dot_product_attention(q, k, v, backend=backend).output  # (B, H, L, D)
        out.backward(dout)

    torch.manual_seed(0)
    with online.settings(block_size=block_size):
        call(*inputs(WARMUP_LENGTH))  # thread pools, kernels, lazy imports: not part of the measurement
        gc.collect()
        q, k, v, dout = inputs(length)
        start = time.perf_counter()
        peak = peak_memory(lambda: call(q, k, v, dout))
        seconds = time.perf_counter() - start
    return {
        "peak_bytes": peak,
        "seconds": seconds,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }


# --------------------------------------------------------------------------------------------- parent process


def run_child(backend: str, length: int, block_size: int | None) -> dict[str, Any]:
    """Measure one configuration in a fresh interpreter; a failure becomes ``status="failed"`` with the reason."""
    cmd = [sys.executable, __file__, "--one", backend, str(length)]
    if block_size is not None:
        cmd += ["--block-size", str(block_size)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"status": "failed", "note": f"timed out after {TIMEOUT_S} s"}
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name
        hint = " (out of memory?)" if name == "SIGKILL" else ""
        return {"status": "failed", "note": f"killed by {name}{hint}"}
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        return {"status": "failed", "note": f"exit {proc.returncode}: {last}"}
    return {"status": "ok", **json.loads(proc.stdout.strip().splitlines()[-1])}


def estimate(backend: str, length: int, measured: dict[int, int]) -> tuple[int, str] | None:
    """An upper estimate of the peak, and where it came from; ``None`` when there is nothing to go on.

    ``measured`` maps the smaller lengths already measured for this backend to their peaks.
    """
    guesses: list[tuple[int, str]] = []
    if backend == "reference":
        guesses.append((REFERENCE_COPIES * weights_bytes(length), f"{REFERENCE_COPIES} x the L x L weights"))
    smaller = [n for n in measured if n < length]
    if smaller:
        n = max(smaller)
        guesses.append((measured[n] * length**2 // n**2, f"L={n} peak x (L / {n})^2"))
    return max(guesses) if guesses else None


def measure_all(
    backends: list[str], lengths: list[int], block_size: int | None, budget_bytes: int
) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    measured: dict[str, dict[int, int]] = {b: {} for b in backends}
    for length in sorted(lengths):  # ascending, so that each estimate can use the smaller lengths
        for backend in backends:
            row: dict[str, Any] = {
                "backend": backend,
                "L": length,
                "B": B,
                "H": H,
                "D": D,
                "dtype": DTYPE,
                "block_size": block_size,
                "weights_bytes": weights_bytes(length),
            }
            guess = estimate(backend, length, measured[backend])
            if guess is not None and guess[0] > budget_bytes:
                row.update(status="skipped", estimate_bytes=guess[0], note=f"estimate: {guess[1]}")
            else:
                print(f"measuring {backend} at L={length} ...", file=sys.stderr, flush=True)
                row.update(run_child(backend, length, block_size))
                if row["status"] == "ok":
                    measured[backend][length] = row["peak_bytes"]
            results.append(row)
    return results


def table(results: list[dict[str, Any]]) -> str:
    """One markdown table, a row per (L, backend)."""
    header = ["L", "backend", "L x L weights (fp32)", "peak memory (fwd+bwd)", "time (s)"]
    rows = []
    for r in results:
        if r["status"] == "ok":
            peak = format_bytes(r["peak_bytes"])
            seconds = f"{r['seconds']:.2f}"
        elif r["status"] == "skipped":
            peak = f"skipped (needs ~{r['estimate_bytes'] / 2**30:.0f} GiB)"
            seconds = "-"
        else:
            note = r["note"] if len(r["note"]) <= NOTE_WIDTH else r["note"][: NOTE_WIDTH - 3] + "..."
            peak, seconds = f"failed ({note})", "-"  # the whole note is in the JSON
        rows.append([str(r["L"]), r["backend"], format_bytes(r["weights_bytes"]), peak, seconds])
    widths = [max(len(line[i]) for line in [header, *rows]) for i in range(len(header))]
    right = {0, 2, 3, 4}

    def line(cells: list[str]) -> str:
        padded = (c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True)))
        return "| " + " | ".join(padded) + " |"

    rule = "|" + "|".join("-" * (w + 1) + ":" if i in right else "-" * (w + 2) for i, w in enumerate(widths)) + "|"
    return "\n".join([line(header), rule, *(line(r) for r in rows)])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help="comma-separated L (= Lq = Lk)")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="comma-separated backend names")
    parser.add_argument("--block-size", type=int, default=None, help="keys per block of tiles:online")
    parser.add_argument("--budget-gib", type=float, default=BUDGET_GIB, help="skip what is estimated above this")
    parser.add_argument("--json", metavar="FILE", help="also write the results to FILE")
    parser.add_argument("--one", nargs=2, metavar=("BACKEND", "L"), help=argparse.SUPPRESS)  # the child
    args = parser.parse_args(argv)

    if args.one is not None:
        backend, length = args.one
        print(json.dumps(measure_one(backend, int(length), args.block_size)))
        return

    lengths = [int(n) for n in args.lengths.split(",") if n]
    backends = [b for b in args.backends.split(",") if b]
    unknown = sorted(set(backends) - set(BACKENDS))
    if unknown:
        parser.error(f"unknown backends {unknown}; choose from {list(BACKENDS)}")

    start = time.perf_counter()
    results = measure_all(backends, lengths, args.block_size, int(args.budget_gib * 2**30))
    total = time.perf_counter() - start

    online_block = "default" if args.block_size is None else str(args.block_size)
    print(f"Peak memory, forward + backward: B={B}, H={H}, D={D}, {DTYPE}, Lq = Lk = L,")
    print(f"tiles:online block size {online_block}; peak RSS increase in a fresh process, one run.\n")
    print(table(results))
    print(f"\ntotal {total:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"total_seconds": total, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
