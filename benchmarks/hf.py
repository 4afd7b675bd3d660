"""attnkit inside a Hugging Face transformers model (docs/benchmarks.md, "transformers").

A Llama-shaped model built from a config with random weights (4 layers, hidden 512, 8 heads, 2 key/value heads,
feed-forward 1408, vocabulary 1000), float32, forward and backward of the mean logit:

* ``speed``: B=4, L=1024, median of rounds, contenders in turn: transformers' ``sdpa``; attnkit; attnkit inside
  ``attnkit.record_weights`` (every layer's weights kept, the output from the fused path); transformers' ``eager``
  with ``output_attentions=True`` (its only way to weights). Targets: attnkit within 5% of ``sdpa``; attnkit with
  weights at most 0.5x the time of eager with weights.
* ``memory``: the peak resident-set increase of the same step, each contender in a fresh process
  (:func:`attnkit.tools.bench.peak_memory`): at B=4, L=1024 with weights (target: attnkit with weights at most 1/4 of
  eager's peak), and at B=1 and longer contexts without weights, eager against attnkit: a length where eager does
  not fit in this machine's memory (or would not, by its measured growth) while attnkit completes.

Usage::

    python benchmarks/hf.py [--json FILE] [--only speed|memory ...]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

import attnkit
from results import finish

TARGETS = {"attnkit_vs_sdpa": 1.05, "recorded_vs_eager_weights": 0.5, "recorded_memory_vs_eager": 0.25}
CONTENDERS = ("sdpa", "attnkit", "attnkit + record_weights", "eager + output_attentions")
LONG_LENGTHS = (2048, 8192, 16384)  # B=1
B, L = 4, 1024


def model(impl: str) -> Any:
    import transformers

    from attnkit.integrations import transformers as attnkit_hf

    attnkit_hf.register()
    config = transformers.LlamaConfig(
        vocab_size=1000,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=max(LONG_LENGTHS),
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM._from_config(config, attn_implementation=impl).train()


def step(contender: str, batch: int, length: int) -> Callable[[], None]:
    """One forward and backward of ``contender`` on random tokens (a fresh model of the same weights)."""
    impl = contender.split(" ")[0]
    m = model(impl)
    ids = torch.randint(0, 1000, (batch, length), generator=torch.Generator().manual_seed(1))

    def run() -> None:
        m.zero_grad(set_to_none=True)
        if contender == "attnkit + record_weights":
            with attnkit.record_weights(m) as rec:
                out = m(ids)
            assert len(rec) == 4
        else:
            out = m(ids, output_attentions=contender.endswith("output_attentions"))
        out.logits.mean().backward()

    return run


def measure_speed(repeats: int = 3) -> dict[str, Any]:
    runs = {c: step(c, B, L) for c in CONTENDERS}
    times: dict[str, list[float]] = {c: [] for c in CONTENDERS}
    for run in runs.values():
        run()  # warm-up
    for _ in range(repeats):
        for c, run in runs.items():
            start = time.perf_counter()
            run()
            times[c].append(time.perf_counter() - start)
    med = {c: statistics.median(t) for c, t in times.items()}
    return {
        "seconds": med,
        "attnkit_vs_sdpa": med["attnkit"] / med["sdpa"],
        "recorded_vs_eager_weights": med["attnkit + record_weights"] / med["eager + output_attentions"],
    }


def memory_child(contender: str, batch: int, length: int) -> dict[str, Any]:
    from attnkit.tools.bench import peak_memory

    step(contender, 1, 64)()  # warm-up: thread pools, lazy imports
    run = step(contender, batch, length)
    start = time.perf_counter()
    peak = peak_memory(run)
    return {"peak_bytes": peak, "seconds": time.perf_counter() - start}


def available_bytes() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))


def in_child(contender: str, batch: int, length: int) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, __file__, "--memory-child", json.dumps([contender, batch, length])],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:  # killed for memory, or an error: say so, do not stop the run
        return {"failed": (proc.stderr.strip().splitlines() or [f"exit status {proc.returncode}"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure_memory() -> dict[str, Any]:
    weights = {c: in_child(c, B, L) for c in ("eager + output_attentions", "attnkit + record_weights", "sdpa")}
    budget = available_bytes()
    growth: dict[str, dict[int, Any]] = {"eager": {}, "attnkit": {}}
    for length in LONG_LENGTHS:
        for contender, by_length in growth.items():
            done = [n for n in by_length if "peak_bytes" in by_length[n]]
            if done:  # eager's saved weights grow with L^2: do not start what cannot fit
                n = max(done)
                estimate = by_length[n]["peak_bytes"] * (length / n) ** 2
                if contender == "eager" and estimate > 0.8 * budget:
                    by_length[length] = {"skipped": f"needs ~{estimate / 2**30:.0f} GiB by its growth from L={n}"}
                    continue
            by_length[length] = in_child(contender, 1, length)
    return {
        "available_bytes": budget,
        "weights": weights,
        "growth": growth,
        "recorded_memory_vs_eager": weights["attnkit + record_weights"]["peak_bytes"]
        / weights["eager + output_attentions"]["peak_bytes"],
    }


def report(r: dict[str, Any]) -> str:
    lines = [f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, forward + backward", ""]
    if "speed" in r:
        s = r["speed"]
        lines += [f"Llama-shaped, 4 layers, hidden 512, 8 heads / 2 kv heads, B={B}, L={L}:", ""]
        lines += ["| contender | seconds |", "|---|---:|"]
        lines += [f"| {c} | {t:.2f} |" for c, t in s["seconds"].items()]
        lines += [
            "",
            f"attnkit / sdpa: {s['attnkit_vs_sdpa']:.3f} (target <= {TARGETS['attnkit_vs_sdpa']})",
            f"attnkit + record_weights / eager + output_attentions: {s['recorded_vs_eager_weights']:.2f} "
            f"(target <= {TARGETS['recorded_vs_eager_weights']})",
            "",
        ]
    if "memory" in r:
        m = r["memory"]
        lines += [
            f"peak memory increase of the step, B={B}, L={L}:",
            "",
            "| contender | peak | seconds |",
            "|---|---:|---:|",
        ]
        lines += [f"| {c} | {_cell(x)} |" for c, x in m["weights"].items()]
        lines += [
            "",
            f"attnkit + record_weights / eager + output_attentions: {m['recorded_memory_vs_eager']:.2f} "
            f"(target <= {TARGETS['recorded_memory_vs_eager']})",
            "",
            f"long contexts, B=1, no weights asked (available memory {m['available_bytes'] / 2**30:.1f} GiB):",
            "",
            "| contender | " + " | ".join(f"L={n}" for n in LONG_LENGTHS) + " |",
            "|---|" + "---:|" * len(LONG_LENGTHS),
        ]
        for c, by_length in m["growth"].items():
            cells = [_cell(by_length.get(n, by_length.get(str(n), {})), sep=", ") for n in LONG_LENGTHS]
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _cell(x: dict[str, Any], sep: str = " | ") -> str:
    if "peak_bytes" in x:
        return f"{x['peak_bytes'] / 2**20:.0f} MiB{sep}{x['seconds']:.1f} s"
    return x.get("skipped") or f"failed: {x.get('failed')}"


def missed_targets(r: dict[str, Any]) -> list[str]:
    missed = []
    for part, key in (
        ("speed", "attnkit_vs_sdpa"),
        ("speed", "recorded_vs_eager_weights"),
        ("memory", "recorded_memory_vs_eager"),
    ):
        if part in r and r[part][key] > TARGETS[key]:
            missed.append(f"{key} {r[part][key]:.3f} > {TARGETS[key]}")
    return missed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=("speed", "memory"), action="append")
    parser.add_argument("--json")
    parser.add_argument("--memory-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_child:
        print(json.dumps(memory_child(*json.loads(args.memory_child))))
        return 0
    wanted = args.only or ["speed", "memory"]
    measures = {"speed": measure_speed, "memory": measure_memory}
    results = {name: measures[name]() for name in wanted}
    return finish(results, report(results), missed_targets(results), args.json)


if __name__ == "__main__":
    sys.exit(main())
