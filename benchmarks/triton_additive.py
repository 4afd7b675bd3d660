"""The triton backend's additive attention against ``tiles:online`` on a GPU (issue 28's row): forward and backward,
peak memory, and the largest error against float64 on a slice.

    python benchmarks/triton_additive.py                     # B=8, L=4096, h=256, bfloat16, on CUDA
    python benchmarks/triton_additive.py --json triton.json
    python benchmarks/triton_additive.py --smoke   # tiny sizes on CPU in Triton's interpreter: the script
                                                   # itself checked, no timing meant

Target (issue 28): the triton backend at least 3x faster than ``tiles:online`` for forward+backward at B=8, L=4096,
h=256, bfloat16, memory linear in L. Each contender runs in turn, ``--repeats`` times after a warm-up, timed with
CUDA synchronised; the ratio compares contenders of one run.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

if "--smoke" in sys.argv:  # the interpreter: set before triton is first imported (torch._dynamo imports it)
    os.environ.setdefault("TRITON_INTERPRET", "1")
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

import attnkit
from attnkit.backends import triton as triton_backend
from results import finish

# B batch, L length (queries = keys), h features, Dv value dim
TARGET = 3.0


def inputs(B: int, L: int, h: int, Dv: int, dtype: torch.dtype, device: str) -> list[Tensor]:
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(B, L, h, generator=g) for _ in range(2))  # (B, L, h) each: the book's layout
    v = torch.randn(B, L, Dv, generator=g)  # (B, L, Dv)
    w_v = torch.randn(h, generator=g) / h**0.5  # (h,)
    return [t.to(device=device, dtype=dtype).requires_grad_() for t in (q, k, v, w_v)]


def step(backend: str, leaves: list[Tensor], lens: Tensor) -> Callable[[], None]:
    q, k, v, w_v = leaves

    def run() -> None:
        out = attnkit.additive_attention(q, k, v, w_v, valid_lens=lens, backend=backend).output
        out.sum().backward()

    return run


def timed(contenders: dict[str, Callable[[], None]], repeats: int, sync: Callable[[], None]) -> dict[str, float]:
    """Median seconds of each contender, in turn, after one warm-up round."""
    for run in contenders.values():
        run()
    sync()
    seconds: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(repeats):
        for name, run in contenders.items():
            sync()
            start = time.perf_counter()
            run()
            sync()
            seconds[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in seconds.items()}


def peak_bytes(run: Callable[[], None], device: str) -> int | None:
    if device != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    run()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def error_against_float64(leaves: list[Tensor], lens: Tensor, rows: int) -> float:
    """The triton output's largest error against the float64 math on the first ``rows`` queries of example 0."""
    q, k, v, w_v = leaves
    out = attnkit.additive_attention(q, k, v, w_v, valid_lens=lens, backend="triton").output[0, :rows]
    q64, k64, v64 = (t.detach()[0].double().cpu() for t in (q, k, v))
    w64 = w_v.detach().double().cpu()
    n = int(lens[0])
    scores = torch.tanh(q64[:rows, None, :] + k64[None, :n, :]) @ w64  # (rows, n)
    want = torch.softmax(scores, dim=-1) @ v64[:n]  # (rows, Dv)
    return (out.double().cpu() - want).abs().max().item()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)  # (--smoke exactly:
    # it is read before triton is imported)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--value-dim", type=int, default=256)
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny sizes on CPU in Triton's interpreter (the sizes given are ignored)"
    )
    args = parser.parse_args(argv)
    for name in ("batch", "length", "features", "value_dim", "repeats"):
        if getattr(args, name) < (2 if name == "length" else 1):
            parser.error(f"--{name.replace('_', '-')} must be at least {2 if name == 'length' else 1}")
    device = "cuda"
    if args.smoke:
        args.batch, args.length, args.features, args.value_dim, args.repeats, device = 2, 40, 8, 4, 1, "cpu"
        # the backend declares CUDA only; the interpreter runs its kernels on CPU tensors
        triton_backend.SUPPORTS = dataclasses.replace(triton_backend.SUPPORTS, devices=None)
    elif not torch.cuda.is_available():
        print("needs CUDA (or --smoke: tiny sizes in Triton's interpreter on CPU)", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    B, L = args.batch, args.length
    leaves = inputs(B, L, args.features, args.value_dim, dtype, device)
    lens = torch.full((B,), L, device=device)
    lens[1::2] = L * 3 // 4  # every other example padded: valid_lens as the book's models give it
    contenders = {name: step(name, leaves, lens) for name in ("triton", "tiles:online")}
    seconds = timed(contenders, args.repeats, torch.cuda.synchronize if device == "cuda" else lambda: None)
    memory = {name: peak_bytes(run, device) for name, run in contenders.items()}
    half = inputs(B, L // 2, args.features, args.value_dim, dtype, device)  # memory linear in L: half the length
    memory[f"triton at L={L // 2}"] = peak_bytes(
        step("triton", half, torch.div(lens, 2, rounding_mode="floor")), device
    )
    del half
    error = error_against_float64(leaves, lens, rows=min(L, 64))
    ratio = seconds["tiles:online"] / seconds["triton"]
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)"
    results: dict[str, Any] = {
        "device": device_name,
        "torch": torch.__version__,
        "sizes": {"B": B, "L": L, "h": args.features, "Dv": args.value_dim, "dtype": args.dtype},
        "seconds": seconds,
        "peak_bytes": memory,
        "max_error_vs_float64": error,
        "online_over_triton": ratio,
    }
    lines = [
        f"{device_name}, torch {torch.__version__}; additive attention B={B} L={L} h={args.features} "
        f"Dv={args.value_dim} {args.dtype}, forward + backward, median of {args.repeats}",
        "",
        "| backend | seconds | peak memory |",
        "|---|--:|--:|",
    ]
    for name, peak in memory.items():
        s = seconds.get(name)
        shown = "-" if peak is None else f"{peak / 2**20:.0f} MiB"
        lines.append(f"| {name} | {'-' if s is None else f'{s:.4f}'} | {shown} |")
    lines += [
        "",
        f"tiles:online / triton: {ratio:.2f}x (target >= {TARGET}x); largest error against float64: {error:.2e}",
    ]
    if args.smoke:
        lines.append("(--smoke: tiny sizes in Triton's interpreter; its times say nothing of a GPU's)")
    missed = (
        [] if args.smoke or ratio >= TARGET else [f"triton {ratio:.2f}x faster than tiles:online, target {TARGET}x"]
    )
    return finish(results, "\n".join(lines), missed, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
