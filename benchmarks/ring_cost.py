"""The measured inputs and points of the ring-attention cost model (docs/ring_cost_model.md).

Run under torchrun; every rank uses one thread (so W ranks on C cores share them when W > C)::

    torchrun --nproc-per-node 1 benchmarks/ring_cost.py --json docs/ring_cost/w1.json   # block times
    torchrun --nproc-per-node 2 benchmarks/ring_cost.py --json docs/ring_cost/w2.json   # + link, ring
    torchrun --nproc-per-node 3 benchmarks/ring_cost.py --json docs/ring_cost/w3.json
    torchrun --nproc-per-node 4 benchmarks/ring_cost.py --json docs/ring_cost/w4.json
    python benchmarks/ring_cost_model.py docs/ring_cost/w*.json                   # the model against them

What each run measures (medians of ``--repeats`` after a warm-up; B=1, H=Hkv=8, D=64, float32):

* ``W == 1``: the compute of one ring step: ring attention on one rank (no exchange, the ring's own code) of
  ``n`` positions, forward and backward, causal (``t_causal(n)``: a zig-zag rank's first step, on its own
  block) and not (``t_full(n)``: every other step of a causal zig-zag ring scores two of the four
  ``n/2 x n/2`` quarters of a block, ``t_full(n) / 2``). Lengths ``--block-lengths``.
* ``W >= 2``: the link between ranks 0 and 1 (gloo send/receive ping-pong, one-way seconds per message size;
  the others wait), then the whole ring (zig-zag, causal, forward and backward) for each of ``--lengths``, each
  rank timing its own call; the slowest rank's median is the ring's time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from attnkit.distributed import ring_attention, shard_sequence

# B batch, H heads, L whole length, n = L / W positions per rank, D head dim

B, H, D = 1, 8, 64
MESSAGE_BYTES = [2**p for p in range(12, 27, 2)]  # 4 KiB .. 64 MiB


def _median_seconds(fn, repeats: int) -> float:  # noqa: ANN001
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def ring_seconds(L: int, repeats: int, causal: bool = True) -> float:
    """This rank's median seconds of a zig-zag ring call over ``L`` positions, forward and backward."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, generator=g) for _ in range(3))  # (B, H, L, D) whole, the same everywhere
    q, k, v = (shard_sequence(x, layout="zigzag").requires_grad_() for x in (q, k, v))  # (B, H, n, D)
    dout = torch.randn_like(q)

    def once() -> None:
        out = ring_attention(q, k, v, is_causal=causal, layout="zigzag")  # (B, H, n, D)
        torch.autograd.grad(out, (q, k, v), dout)

    return _median_seconds(once, repeats)


def one_way_seconds(nbytes: int, repeats: int) -> float | None:
    """Ranks 0 and 1: half the median round trip of ``nbytes`` over gloo (send, then receive it back)."""
    rank = dist.get_rank()
    buf = torch.zeros(nbytes // 4)  # float32

    def once() -> None:
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        elif rank == 1:
            dist.recv(buf, 0)
            dist.send(buf, 0)

    seconds = _median_seconds(once, repeats)
    return seconds / 2 if rank in (0, 1) else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="256,1024,4096,8192", help="whole lengths of the ring runs (W >= 2)")
    parser.add_argument(
        "--block-lengths", default="64,85,128,256,341,512,1024,1365,2048,2731,4096", help="n of the W = 1 runs"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="where rank 0 writes what was measured")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    W, rank = dist.get_world_size(), dist.get_rank()
    seen: dict = {"world_size": W, "B": B, "H": H, "D": D, "dtype": "float32", "threads_per_rank": 1}
    seen["cores"] = len(os.sched_getaffinity(0))
    if W == 1:
        lengths = [int(n) for n in args.block_lengths.split(",")]
        seen["causal_block_seconds"] = {n: ring_seconds(n, args.repeats) for n in lengths}
        seen["full_block_seconds"] = {n: ring_seconds(n, args.repeats, causal=False) for n in lengths}
    else:
        seen["one_way_seconds"] = {b: one_way_seconds(b, max(args.repeats, 9)) for b in MESSAGE_BYTES}
        ring = {}
        for L in map(int, args.lengths.split(",")):
            mine = torch.tensor([ring_seconds(L, args.repeats)], dtype=torch.float64)
            every = [torch.zeros(1, dtype=torch.float64) for _ in range(W)]
            dist.all_gather(every, mine)
            ring[L] = max(float(t) for t in every)
        seen["ring_seconds"] = ring
    if rank == 0:
        text = json.dumps(seen, indent=1)
        print(text)
        if args.json:
            with open(args.json, "w") as f:
                f.write(text + "\n")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
