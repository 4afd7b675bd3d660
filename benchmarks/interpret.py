"""Rollout and head ablation on SmolLM2-135M-Instruct (issue 52), measured.

* ``--rollout``: ``attnkit.rollout`` for 4 targets through all 30 layers at ``--length`` tokens (8,192), against the
  plain forward: time and extra peak resident memory, each in a fresh process (targets: at most 3x the time, at most
  512 MiB above the forward's peak).
* ``--sweep``: ``attnkit.head_sweep`` at ``--sweep-length`` tokens (1,024) over the heads of ``--sweep-layers``
  layers (all 30: 270 heads), against as many plain forwards run the same way (target: at most 1.2x).

Usage::

    python benchmarks/interpret.py --rollout --json docs/interpret.json
    python benchmarks/interpret.py --sweep --sweep-layers 30
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import torch

import attnkit
from attnkit.integrations import smollm2
from attnkit.tools.bench import peak_memory

TARGETS = [-1, -2, -3, -4]


def _ids(tokenizer: Any, length: int) -> torch.Tensor:
    """``(1, length)`` tokens of Debian's license texts (natural English), as benchmarks/presses.py reads them."""
    sys.path.insert(0, os.path.dirname(__file__))
    from presses import heldout_ids

    return heldout_ids(tokenizer, length)[:, :length]


def child(mode: str, length: int) -> None:
    torch.set_num_threads(os.cpu_count() or 1)
    model, tokenizer = smollm2.load(quiet=True)
    ids = _ids(tokenizer, length)
    with torch.no_grad():
        model(ids[:, :64])  # warm: kernels built, allocator primed

    def run() -> None:
        with torch.no_grad():
            if mode == "rollout":
                with attnkit.rollout(model, TARGETS) as found:
                    model(ids, use_cache=False)
                assert found.relevance is not None and found.relevance.shape == (1, 4, length)
            else:
                model(ids, use_cache=False)

    start = time.perf_counter()
    peak = peak_memory(run)
    print(json.dumps({"seconds": time.perf_counter() - start, "peak_mib": peak / 2**20}))


def rollout(length: int) -> dict[str, Any]:
    found = {}
    for mode in ("plain", "rollout"):
        out = subprocess.run(
            [sys.executable, __file__, "--child", mode, "--length", str(length)],
            capture_output=True,
            text=True,
            check=True,
        )
        found[mode] = json.loads(out.stdout.strip().splitlines()[-1])
        print(mode, found[mode], file=sys.stderr)
    plain, ours = found["plain"], found["rollout"]
    found["time_ratio"] = ours["seconds"] / plain["seconds"]
    found["extra_peak_mib"] = ours["peak_mib"] - plain["peak_mib"]
    return found


def sweep(length: int, layers: int) -> dict[str, Any]:
    torch.set_num_threads(os.cpu_count() or 1)
    model, tokenizer = smollm2.load(quiet=True)
    ids = _ids(tokenizer, length)
    names = [f"model.layers.{i}.self_attn" for i in range(layers)]
    pattern = "model.layers.*.self_attn" if layers == 30 else f"model.layers.[0-{layers - 1}].self_attn"
    with torch.no_grad():
        token = int(model(ids).logits[0, -1].argmax())  # the model's own next token: the logit an answer needs
        start = time.perf_counter()
        for _ in range(layers * 9 + 1):  # as many forwards as the sweep runs (one plain, then one a head)
            model(ids).logits[0, -1, token].item()
        plain = time.perf_counter() - start
    start = time.perf_counter()
    found = attnkit.head_sweep(model, ids, token, layers=pattern)
    ours = time.perf_counter() - start
    assert found.names == names, found.names
    largest = found.change.abs().flatten().topk(5)
    top = [(names[int(i) // 9], int(i) % 9, float(found.change.flatten()[i])) for i in largest.indices]
    return {"heads": layers * 9, "sweep_s": ours, "plain_s": plain, "ratio": ours / plain, "largest": top}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollout", action="store_true")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--sweep-length", type=int, default=1024)
    parser.add_argument("--sweep-layers", type=int, default=30, choices=[*range(1, 11), 30], metavar="1..10 or 30")
    parser.add_argument("--child", choices=["plain", "rollout"])
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.length)
        return
    if not (args.rollout or args.sweep):
        parser.error("say what to measure: --rollout and/or --sweep")
    found: dict[str, Any] = {}
    if args.rollout:
        found["rollout"] = rollout(args.length)
        print(json.dumps(found["rollout"]))
    if args.sweep:
        found["sweep"] = sweep(args.sweep_length, args.sweep_layers)
        print(json.dumps(found["sweep"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(found, f, indent=1)


if __name__ == "__main__":
    main()
