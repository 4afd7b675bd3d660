"""What shape tracing costs while no trace is open.

Each traced step checks ``attnkit.trace.active() is not None``; a ``MultiHeadAttention`` forward makes two such
checks (one in the layer, one in the functional call). This measures the cost of those checks against the
forward of a tiny layer (B=2, L=4, num_hiddens=100, 5 heads), where any overhead would show most, and, for
comparison, the same forward with a trace open.

    python benchmarks/trace_overhead.py
"""

from __future__ import annotations

import torch
from torch.utils import benchmark

import attnkit
from attnkit import trace

CHECKS_PER_FORWARD = 2


def main() -> None:
    torch.manual_seed(0)
    mha = attnkit.MultiHeadAttention(100, 5).eval()
    x = torch.randn(2, 4, 100)
    lens = torch.tensor([3, 2])

    def forward() -> None:
        with torch.no_grad():
            mha(x, x, x, lens)

    def traced() -> None:
        with torch.no_grad(), attnkit.trace_shapes():
            mha(x, x, x, lens)

    closed = benchmark.Timer("forward()", globals={"forward": forward}).blocked_autorange(min_run_time=2)
    opened = benchmark.Timer("traced()", globals={"traced": traced}).blocked_autorange(min_run_time=2)
    check = benchmark.Timer("trace.active() is not None", globals={"trace": trace}).blocked_autorange(min_run_time=1)
    cost = CHECKS_PER_FORWARD * check.median
    print(f"forward, no trace open:   {closed.median * 1e6:8.1f} us (median)")
    print(f"forward, trace open:      {opened.median * 1e6:8.1f} us")
    print(f"the checks, no trace:     {cost * 1e9:8.1f} ns = {cost / closed.median:.4%} of the forward")


if __name__ == "__main__":
    main()
