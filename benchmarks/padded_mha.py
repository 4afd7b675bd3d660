"""A padded training step: ``attnkit.MultiHeadAttention`` with ``valid_lens`` against ``torch.nn.MultiheadAttention``
with ``key_padding_mask``, same weights and inputs (``attnkit bench``'s ``mha`` contenders), forward and backward.

B=4, L=1024, h=512, 8 heads, lengths uniform in [L/4, L], float32. The two run in turn, round after round
(benchmarks/flex.py's ``timed_rounds``), so that load from elsewhere falls on both; the ratio compares one run.
Target (issue 49): at most 0.85x torch.

Usage::

    python benchmarks/padded_mha.py --repeats 15
"""

from __future__ import annotations

import argparse
import sys

import torch

from attnkit.tools.bench import make_call
from flex import timed_rounds
from results import finish

B, L = 4, 1024
TARGET = 0.85


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    runs = {name: make_call("mha", B, L, "train", "valid_lens", name) for name in ("attnkit", "torch")}
    seconds = timed_rounds(runs, args.repeats)
    ratio = seconds["attnkit"] / seconds["torch"]
    report = (
        f"padded MHA training step, B={B}, L={L}: attnkit {seconds['attnkit'] * 1e3:.1f} ms, "
        f"torch {seconds['torch'] * 1e3:.1f} ms, ratio {ratio:.3f}x (target <= {TARGET}x)"
    )
    missed = [] if ratio <= TARGET else [f"padded MHA {ratio:.3f}x > {TARGET}x"]
    return finish({"seconds": seconds, "ratio": ratio}, report, missed, args.json)


if __name__ == "__main__":
    sys.exit(main())
