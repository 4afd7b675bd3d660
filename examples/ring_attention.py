"""Ring attention on several processes, checked against single-process attention.

    torchrun --nproc-per-node 4 examples/ring_attention.py
    torchrun --nproc-per-node 2 examples/ring_attention.py --length 4096 --layout contiguous --no-causal

Every rank builds the same whole sequence from a seed and keeps its shard (``shard_sequence``). Each rank then
runs ring attention forward and backward on its shard and measures how far its peak memory rose above what
its inputs already took (``attnkit.tools.bench.peak_memory``: CUDA's peak allocation, or the process's peak resident
set size on the CPU). The output and gradients are gathered (``gather_sequence``), rank 0 compares them with
``attnkit.scaled_dot_product_attention`` on the whole sequence, and prints the largest errors and every rank's
peak memory. Exit status 1 when an error is past ``2e-6 + 1e-5 * max|single process|`` (float32; the two sum in
different orders, and a gradient of a key that many queries see sums many terms), 2 for a mistake in the
arguments.

gloo on the CPU, NCCL when CUDA is there (one GPU per rank, ``LOCAL_RANK``).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

import attnkit
from attnkit.distributed import LAYOUTS, gather_sequence, ring_attention, shard_sequence
from attnkit.tools.bench import peak_memory

# B batch, H heads, L whole sequence length, L_r the positions of one rank, D head dim

ATOL, RTOL = 2e-6, 1e-5


def whole_number(low: int):  # noqa: ANN201 - an argparse type
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value

    return parse


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=whole_number(1), default=1)
    p.add_argument("--heads", type=whole_number(1), default=8)
    p.add_argument("--head-dim", type=whole_number(1), default=64)
    p.add_argument("--length", type=whole_number(1), default=8192, help="whole sequence length L, at least W")
    p.add_argument("--layout", choices=LAYOUTS, default="zigzag")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--valid-len", type=whole_number(0), default=None, help="keys past this position are padding")
    p.add_argument("--timeout", type=seconds, default=120.0, help="seconds any rank waits for another")
    p.add_argument("--seed", type=whole_number(0), default=0)
    args = p.parse_args()
    if args.valid_len is not None and args.valid_len > args.length:
        p.error(f"--valid-len may be at most --length ({args.length}), got {args.valid_len}")
    world = int(os.environ.get("WORLD_SIZE", "1"))  # set by torchrun; every rank checks, so none waits alone
    if args.length < world:
        p.error(f"--length ({args.length}) must be at least the number of processes ({world})")
    return args


def whole_inputs(args: argparse.Namespace) -> list[torch.Tensor]:
    """q, k, v and the output gradient of the whole sequence: the same on every rank (one seed)."""
    g = torch.Generator().manual_seed(args.seed)
    shape = (args.batch, args.heads, args.length, args.head_dim)  # (B, H, L, D)
    return [torch.randn(shape, generator=g) for _ in range(4)]


def main() -> int:
    args = parse_args()
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    # The group's own timeout bounds this script's other collectives; ring_attention has its own (--timeout).
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if not cuda:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # ranks share the machine's cores
    kw = {
        "is_causal": args.causal,
        "layout": args.layout,
        "timeout": args.timeout,
        "valid_lens": None if args.valid_len is None else torch.full((args.batch,), args.valid_len, device=device),
    }

    # A small call first: thread pools, communicators and kernels are set up once, not part of the measurement.
    tiny = [torch.randn(1, 1, 2, 8, device=device, requires_grad=True) for _ in range(3)]
    ring_attention(*tiny, timeout=args.timeout).sum().backward()

    q, k, v, dout = (shard_sequence(t, layout=args.layout).to(device) for t in whole_inputs(args))  # (B, H, L_r, D)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    result: list[torch.Tensor] = []

    def forward_backward() -> None:
        out = ring_attention(q, k, v, **kw)  # (B, H, L_r, D)
        out.backward(dout)
        result.append(out.detach())

    start = time.perf_counter()
    peak = peak_memory(forward_backward, device)
    seconds = time.perf_counter() - start
    shards = [result[0], q.grad, k.grad, v.grad]
    gathered = [gather_sequence(t, layout=args.layout, timeout=args.timeout) for t in shards]  # (B, H, L, D)
    reports = [None] * world
    dist.all_gather_object(reports, (q.shape[2], peak, seconds))

    status = 0
    if rank == 0:
        q_all, k_all, v_all, dout_all = (t.to(device) for t in whole_inputs(args))
        q_all, k_all, v_all = (t.requires_grad_() for t in (q_all, k_all, v_all))
        want = attnkit.scaled_dot_product_attention(
            q_all, k_all, v_all, is_causal=args.causal, valid_lens=kw["valid_lens"]
        ).output  # (B, H, L, D)
        want.backward(dout_all)
        print(
            f"ring attention: W={world} ranks ({dist.get_backend()}), B={args.batch} H={args.heads} L={args.length} "
            f"D={args.head_dim}, layout={args.layout}, causal={args.causal}, valid_len={args.valid_len}"
        )
        for name, got, expected in zip(
            ("output", "dq", "dk", "dv"), gathered, (want, q_all.grad, k_all.grad, v_all.grad), strict=True
        ):
            err, scale = (got - expected).abs().max().item(), expected.abs().max().item()
            ok = err <= ATOL + RTOL * scale
            status |= not ok
            verdict = "ok" if ok else "TOO LARGE"
            print(f"  max |ring - single process| {name:6s} {err:.2e}  (max |single process| {scale:.2e})  {verdict}")
        print("  peak memory: how far it rose above the inputs during forward + backward")
        print("  rank  positions  peak memory  seconds")
        for r, (positions, peak_bytes, secs) in enumerate(reports):
            print(f"  {r:4d}  {positions:9d}  {peak_bytes / 2**20:7.1f} MiB  {secs:7.2f}")
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
