"""Issue 28's GPU rows in one run: attnkit against PyTorch's own kernels on CUDA, in bfloat16 and float16.

    python benchmarks/gpu.py                        # every row, both dtypes, on CUDA
    python benchmarks/gpu.py --rows mha,decode --json gpu.json
    python benchmarks/gpu.py --smoke                # tiny sizes on CPU in float32: the script itself checked

Rows (each a ratio of contenders measured in turn in the same run, medians of ``--repeats``, CUDA synchronised):

* ``mha``: ``attnkit.MultiHeadAttention`` against the same four projections written by hand around
  ``F.scaled_dot_product_attention``, causal, forward and backward (target: within 5%);
* ``flex``: the tile engine on CUDA (``tiles:flex``, a sliding-window ``mask_mod``) against PyTorch's compiled
  ``flex_attention`` with the same block mask made once, forward and backward;
* ``decode``: one decode step of ``MultiHeadAttention`` over a static ``KVCache`` at context 32,768, against the
  time to read the cache and the layer's weights once at the bandwidth a device copy reaches in the same run;
* ``stats``: ``record_stats(topk=16)`` beside the same forward without it (``MultiHeadAttention(512, 8)``, causal,
  L=16,384, no grad).

The additive kernel's row is ``benchmarks/triton_additive.py``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import attnkit
from attnkit import mods
from results import finish
from triton_additive import timed

# B batch, H heads, Hkv key/value heads, L length, E model width, D head dim, C cache capacity
ROWS = ("mha", "flex", "decode", "stats")
WINDOW = 256


class HandWritten(nn.Module):
    """Four projections around ``F.scaled_dot_product_attention``: what the ``mha`` row compares against."""

    def __init__(self, E: int, H: int) -> None:
        super().__init__()
        self.H = H
        self.W_q, self.W_k, self.W_v, self.W_o = (nn.Linear(E, E, bias=False) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        B, L, E = x.shape
        q, k, v = (w(x).view(B, L, self.H, E // self.H).transpose(1, 2) for w in (self.W_q, self.W_k, self.W_v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, H, L, D)
        return self.W_o(out.transpose(1, 2).reshape(B, L, E))  # (B, L, E)


def mha_row(device: str, dtype: torch.dtype, smoke: bool) -> dict[str, Callable[[], None]]:
    B, L, E, H = (2, 64, 32, 4) if smoke else (8, 2048, 1024, 16)
    ours = attnkit.MultiHeadAttention(E, H, query_size=E, key_size=E, value_size=E).to(device, dtype)
    theirs = HandWritten(E, H).to(device, dtype)
    x = torch.randn(B, L, E, device=device, dtype=dtype, requires_grad=True)  # (B, L, E)

    def attnkit_mha() -> None:
        ours(x, x, x, is_causal=True).sum().backward()

    def projections_and_sdpa() -> None:
        theirs(x).sum().backward()

    return {"attnkit MultiHeadAttention": attnkit_mha, "projections + F.sdpa": projections_and_sdpa}


def flex_row(device: str, dtype: torch.dtype, smoke: bool) -> dict[str, Callable[[], None]]:
    from torch.nn.attention import flex_attention as fa

    B, H, L, D = (1, 2, 256, 16) if smoke else (4, 16, 4096, 64)
    q, k, v = (torch.randn(B, H, L, D, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    window = mods.sliding_window(WINDOW)

    def in_window(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (q_idx >= kv_idx) & (q_idx - kv_idx < WINDOW)

    block_mask = fa.create_block_mask(in_window, None, None, L, L, device=device)
    compiled = torch.compile(fa.flex_attention)

    def attnkit_flex() -> None:
        attnkit.scaled_dot_product_attention(q, k, v, mask_mod=window, backend="tiles:flex").output.sum().backward()

    def torch_flex() -> None:
        compiled(q, k, v, block_mask=block_mask).sum().backward()

    return {"attnkit backend='tiles:flex'": attnkit_flex, "compiled flex_attention": torch_flex}


def bandwidth(device: str, sync: Callable[[], None]) -> float:
    """Bytes a second a device copy moves (read and write), median of 5."""
    n = 2**28 if device == "cuda" else 2**24
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = timed({"copy": lambda: dst.copy_(src)}, 5, sync)["copy"]
    return 2 * n / seconds


def decode_row(device: str, dtype: torch.dtype, smoke: bool) -> tuple[dict[str, Callable[[], None]], int]:
    E, H, Hkv, C = (64, 4, 2, 512) if smoke else (4096, 32, 8, 32768)
    model = attnkit.MultiHeadAttention(E, H, num_kv_heads=Hkv, query_size=E, key_size=E, value_size=E)
    model = model.to(device, dtype).eval()
    cache = attnkit.KVCache(max_len=C + 64)
    token = torch.randn(1, 1, E, device=device, dtype=dtype)  # (B, 1, E)
    with torch.no_grad():
        for start in range(0, C, 4096):  # the context in pieces (a prefill of 32k at once holds L x L scores here)
            piece = torch.randn(1, min(4096, C - start), E, device=device, dtype=dtype)  # (B, n, E)
            model(piece, piece, piece, is_causal=True, cache=cache)
    assert cache.lengths is not None
    lengths = cache.lengths.clone()

    def step() -> None:
        with torch.no_grad():
            model(token, token, token, is_causal=True, cache=cache)
        cache.lengths.copy_(lengths)  # (back to the context: every step reads the same C positions)

    read = 2 * Hkv * C * (E // H) * dtype.itemsize + sum(p.numel() for p in model.parameters()) * dtype.itemsize
    return {"decode step": step}, read


def stats_row(device: str, dtype: torch.dtype, smoke: bool) -> dict[str, Callable[[], None]]:
    L = 256 if smoke else 16384
    model = attnkit.MultiHeadAttention(512, 8, query_size=512, key_size=512, value_size=512).to(device, dtype)
    x = torch.randn(1, L, 512, device=device, dtype=dtype)  # (B, L, E)

    def plain() -> None:
        with torch.no_grad():
            model(x, x, x, is_causal=True)

    def with_stats() -> None:
        with torch.no_grad(), attnkit.record_stats(model, topk=16):
            model(x, x, x, is_causal=True)

    return {"forward": plain, "forward + record_stats(topk=16)": with_stats}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {', '.join(ROWS)}")
    parser.add_argument("--dtypes", default="bfloat16,float16")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes on CPU in float32 (no flex row)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    rows = [r for r in args.rows.split(",") if r]
    unknown = sorted(set(rows) - set(ROWS))
    if unknown:
        parser.error(f"--rows: no row {', '.join(unknown)} (rows: {', '.join(ROWS)})")
    if args.smoke:
        device, dtypes, rows, args.repeats = "cpu", [torch.float32], [r for r in rows if r != "flex"], 1
    elif not torch.cuda.is_available():
        print("needs CUDA (or --smoke)", file=sys.stderr)
        return 2
    else:
        device = "cuda"
        try:
            dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
        except AttributeError as e:
            parser.error(f"--dtypes: {e}")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu (smoke)"
    results: dict[str, Any] = {"device": name, "torch": torch.__version__, "rows": {}}
    lines = [f"{name}, torch {torch.__version__}, medians of {args.repeats}", ""]
    lines += ["| row | dtype | contender | seconds | ratio |", "|---|---|---|--:|--:|"]
    per_second = bandwidth(device, sync) if "decode" in rows else None
    for dtype in dtypes:
        for row in rows:
            bound = None
            if row == "decode":
                contenders, read = decode_row(device, dtype, args.smoke)
                assert per_second is not None
                bound = read / per_second
            else:
                contenders = {"mha": mha_row, "flex": flex_row, "stats": stats_row}[row](device, dtype, args.smoke)
            seconds = timed(contenders, args.repeats, sync)
            first = next(iter(seconds.values()))
            found = {"seconds": seconds}
            for contender, s in seconds.items():
                ratio = first / s if bound is None else s / bound
                lines.append(f"| {row} | {str(dtype).removeprefix('torch.')} | {contender} | {s:.5f} | {ratio:.2f} |")
            if bound is not None:
                found["bandwidth_bound_s"] = bound
                lines.append(
                    f"| {row} | | (the cache and weights read once at {per_second / 1e9:.0f} GB/s) | {bound:.5f} | |"
                )
            results["rows"][f"{row} {dtype}"] = found
    lines += ["", "ratio: the first contender's time over each (decode: the step's time over the bandwidth bound)"]
    return finish(results, "\n".join(lines), [], args.json)


if __name__ == "__main__":
    raise SystemExit(main())
