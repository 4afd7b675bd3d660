"""Flexible attention against PyTorch's fused CPU kernel, same-run ratios (docs/benchmarks.md, "Flexible attention
at the fused kernel's speed"; issue 24's rows).

B=1, H=8, D=64, float32, forward + backward, attnkit's default backend (``auto``) at each ``--lengths``:

* ``causal mask_mod``: causal given as a user ``mask_mod`` (``q_idx >= kv_idx``), against SDPA ``is_causal``.
  Target: at most 1.2x.
* ``window`` and ``window + causal``: ``sliding_window(1024)``, alone and with ``is_causal``, against SDPA without a
  mask. Target: at most 0.18x.
* ``softcap``, ``alibi``, ``bias table``: ``softcap(30)``, ALiBi, a learned table of relative-position biases, all
  causal, against SDPA ``is_causal``. Target: at most 1.5x.
* ``packed``: documents of log-normal lengths (at most 2048, 16384 tokens; benchmarks/flex.py's), packed with a causal
  document mask, against one SDPA ``is_causal`` call per document. Target: at most 1.2x.
* ``additive``: additive attention, B=4, L=1024, h=128, forward + backward, against the book's dense formula (its
  ``AdditiveAttention``, the projections left out: attnkit's ``additive_attention`` takes projected queries and
  keys). Target: at most 0.25x. Its memory (``--additive-memory 1024,2048,4096``) in a fresh process as below.
* ``forward``: the window's, the causal mask_mod's and softcap's forward against compiled FlexAttention's forward on
  the same mask and score_mod (``--flex``; compiling takes a minute here). Target: at most 1.0x.
* memory (``--memory 8192,16384,32768``): the peak resident-set increase of one forward and backward of the causal
  mask_mod, the window, ALiBi and softcap (those of ``--rows`` when given), each in a fresh process
  (:func:`attnkit.tools.bench.peak_memory`; softcap's steps compiled in a warm-up first): linear in ``L``.

Each measurement's contenders run in turn, round after round (benchmarks/flex.py's ``timed_rounds``), so that load
from elsewhere on a shared machine falls on all of them alike; ratios compare contenders of one run.

Usage::

    python benchmarks/fused.py --lengths 8192,16384 --repeats 3 --flex --memory 8192,16384,32768 \
        --additive-memory 1024,2048,4096
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

import attnkit
from attnkit import mods
from attnkit.tools import book
from flex import document_lengths, timed_rounds
from results import finish

B, H, D = 1, 8, 64
WINDOW = 1024
TARGETS = {
    "causal mask_mod": 1.2,
    "window": 0.18,
    "window + causal": 0.18,
    "softcap": 1.5,
    "alibi": 1.5,
    "bias table": 1.5,
    "packed": 1.2,
    "additive": 0.25,
    "forward window": 1.0,
    "forward causal mask_mod": 1.0,
    "forward softcap": 1.0,
}
PEER = {
    "window": "sdpa, no mask",
    "window + causal": "sdpa, no mask",
    "packed": "sdpa per document",
    "additive": "book additive",
}
ADDITIVE_B, ADDITIVE_H = 4, 128  # batch, features (h)

# B batch, H heads, L length, D head dim


def contenders(length: int) -> dict[str, Callable[[], None]]:
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, length, D, requires_grad=True) for _ in range(3))  # (B, H, L, D) each
    dout = torch.randn(B, H, length, D)  # (B, H, L, D)
    table = torch.zeros(2 * length - 1, requires_grad=True)  # a learned bias per distance

    def relative(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return score + table[q_idx - kv_idx + length - 1]

    def sdpa(**kw: Any) -> Callable[[], None]:
        return lambda: F.scaled_dot_product_attention(q, k, v, **kw).backward(dout)

    def ours(**kw: Any) -> Callable[[], None]:
        return lambda: attnkit.scaled_dot_product_attention(q, k, v, **kw).output.backward(dout)

    return {
        "sdpa is_causal": sdpa(is_causal=True),
        "sdpa, no mask": sdpa(),
        "causal mask_mod": ours(mask_mod=lambda b, h, q_idx, kv_idx: q_idx >= kv_idx),
        "window": ours(mask_mod=mods.sliding_window(WINDOW)),
        "window + causal": ours(mask_mod=mods.sliding_window(WINDOW), is_causal=True),
        "softcap": ours(score_mod=mods.softcap(30.0), is_causal=True),
        "alibi": ours(score_mod=mods.alibi(mods.alibi_slopes(H)), is_causal=True),
        "bias table": ours(score_mod=relative, is_causal=True),
    }


def packed_contenders() -> dict[str, Callable[[], None]]:
    lengths = document_lengths()
    torch.manual_seed(0)
    n = sum(lengths)
    q, k, v = (torch.randn(B, H, n, D, requires_grad=True) for _ in range(3))  # (B, H, N, D) each
    dout = torch.randn(B, H, n, D)
    ids = torch.arange(len(lengths)).repeat_interleave(torch.tensor(lengths))[None]  # (1, N)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]

    def per_document() -> None:
        for a, m in zip(starts, lengths, strict=True):
            part = [t[:, :, a : a + m] for t in (q, k, v)]
            F.scaled_dot_product_attention(*part, is_causal=True).backward(dout[:, :, a : a + m])

    def packed() -> None:
        attnkit.scaled_dot_product_attention(q, k, v, is_causal=True, mask_mod=mods.document(ids)).output.backward(dout)

    return {"sdpa per document": per_document, "packed": packed}


def additive_contenders(length: int = 1024, backend: str = "auto") -> dict[str, Callable[[], None]]:
    torch.manual_seed(0)
    q, k, v = (torch.randn(ADDITIVE_B, length, ADDITIVE_H, requires_grad=True) for _ in range(3))  # (B, L, h) each
    w_v = torch.randn(ADDITIVE_H, requires_grad=True)  # (h,)
    dout = torch.randn(ADDITIVE_B, length, ADDITIVE_H)  # (B, L, h)
    books = book.AdditiveAttention(ADDITIVE_H, ADDITIVE_H, ADDITIVE_H, 0.0)
    books.W_q = books.W_k = torch.nn.Identity()  # q and k come projected, as additive_attention takes them
    books.w_v.weight = torch.nn.Parameter(w_v.detach()[None, :])  # (1, h)
    return {
        "book additive": lambda: books(q, k, v, None).backward(dout),
        "additive": lambda: attnkit.additive_attention(q, k, v, w_v, backend=backend).output.backward(dout),
    }


def forward_contenders(length: int) -> dict[str, Callable[[], None]]:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, length, D) for _ in range(3))
    compiled = torch.compile(flex_attention)

    def window_fn(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (q_idx - kv_idx >= 0) & (q_idx - kv_idx < WINDOW)

    def causal_fn(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return q_idx >= kv_idx

    def softcap_fn(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return torch.tanh(score / 30.0) * 30.0

    found = {}
    for name, fn, ours, score_mod in (
        ("window", window_fn, {"mask_mod": mods.sliding_window(WINDOW)}, None),
        ("causal mask_mod", causal_fn, {"mask_mod": causal_fn}, None),
        ("softcap", causal_fn, {"is_causal": True, "score_mod": mods.softcap(30.0)}, softcap_fn),
    ):
        block_mask = create_block_mask(fn, None, None, length, length, device="cpu")
        found[f"flex {name}"] = lambda bm=block_mask, sm=score_mod: compiled(q, k, v, score_mod=sm, block_mask=bm)
        found[f"forward {name}"] = lambda kw=ours: attnkit.scaled_dot_product_attention(q, k, v, **kw)
    return found


MEMORY_ROWS = ("causal mask_mod", "window", "alibi", "softcap")


def memory_child(name: str, length: int) -> dict[str, Any]:
    """In a fresh process: the peak resident-set increase of one forward and backward of row ``name``."""
    from attnkit.tools.bench import peak_memory

    if name == "additive":  # the compiled steps' graphs, the same at every length: compiled here, not counted
        additive_contenders(256, "tiles:compiled")["additive"]()
        inputs_bytes = 4 * 4 * ADDITIVE_B * length * ADDITIVE_H  # q, k, v and dout
        return {"peak_bytes": peak_memory(additive_contenders(length)["additive"]), "inputs_bytes": inputs_bytes}
    contenders(512)[name]()  # warm-up: thread pools, lazy imports
    if name == "softcap":  # the compiled steps' graphs, the same at every length (Inductor's compiling is not counted)
        q, k, v = (torch.randn(B, H, 512, D, requires_grad=True) for _ in range(3))
        out = attnkit.scaled_dot_product_attention(
            q, k, v, score_mod=mods.softcap(30.0), is_causal=True, backend="tiles:compiled"
        ).output
        out.sum().backward()
    run = contenders(length)[name]
    inputs_bytes = 4 * 4 * B * H * length * D  # q, k, v and dout
    return {"peak_bytes": peak_memory(run), "inputs_bytes": inputs_bytes}


def measure_memory(
    lengths: list[int], rows: set[str] | None = None, additive: list[int] | None = None
) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    todo = [(n, lengths) for n in MEMORY_ROWS if rows is None or n in rows]
    for name, at in todo + ([("additive", additive)] if additive else []):
        for length in at:
            child = [sys.executable, __file__, "--memory-child", name, str(length)]
            proc = subprocess.run(child, capture_output=True, text=True, check=True)
            results.setdefault(name, {})[str(length)] = json.loads(proc.stdout.strip().splitlines()[-1])
    return results


def measure(lengths: list[int], repeats: int, flex: bool, rows: set[str] | None = None) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for length in lengths:
        chosen = {n: run for n, run in contenders(length).items() if rows is None or n in rows or n.startswith("sdpa")}
        if not flex and all(n.startswith("sdpa") for n in chosen):
            continue  # (--rows names none of this length's rows)
        seconds = timed_rounds(chosen, repeats)
        ratios = {
            name: seconds[name] / seconds[PEER.get(name, "sdpa is_causal")]
            for name in seconds
            if not name.startswith("sdpa")
        }
        row: dict[str, Any] = {"seconds": seconds, "ratios": ratios}
        if flex:
            with torch.no_grad():
                forward = timed_rounds(forward_contenders(length), repeats)
            row["forward seconds"] = forward
            for name in ("window", "causal mask_mod", "softcap"):
                row["ratios"][f"forward {name}"] = forward[f"forward {name}"] / forward[f"flex {name}"]
        results[str(length)] = row
    if rows is None or "packed" in rows:
        packed = timed_rounds(packed_contenders(), repeats)
        results["packed"] = {"seconds": packed, "ratios": {"packed": packed["packed"] / packed["sdpa per document"]}}
    if rows is None or "additive" in rows:
        # its steps compiled first (the same graphs at every length)
        additive_contenders(256, "tiles:compiled")["additive"]()
        found = timed_rounds(additive_contenders(), repeats)
        results["additive"] = {"seconds": found, "ratios": {"additive": found["additive"] / found["book additive"]}}
    return results


def report(results: dict[str, Any]) -> str:
    lines = [f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32, B={B}, H={H}, D={D}", ""]
    lines += ["| row | L | seconds (median) | peer | ratio | target |", "|---|---:|---:|---|---:|---:|"]
    for length, row in results.items():
        seconds = {**row["seconds"], **row.get("forward seconds", {})}
        for name, ratio in row["ratios"].items():
            peer = PEER.get(name, "sdpa is_causal")
            if name.startswith("forward"):
                peer = "compiled flex_attention " + name.removeprefix("forward ")
            at = {"packed": "16384 tokens", "additive": f"1024, B={ADDITIVE_B}, h={ADDITIVE_H}"}.get(length, length)
            lines.append(f"| {name} | {at} | {seconds[name]:.3f} | {peer} | {ratio:.2f}x | <= {TARGETS[name]}x |")
    return "\n".join(lines)


def report_memory(memory: dict[str, dict[str, Any]]) -> str:
    lines = [
        "",
        "| row | L | peak memory increase | inputs and output gradient | per token |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, by_length in memory.items():
        for length, m in by_length.items():
            lines.append(
                f"| {name} | {length} | {m['peak_bytes'] / 2**20:.0f} MiB | {m['inputs_bytes'] / 2**20:.0f} MiB "
                f"| {m['peak_bytes'] / int(length) / 2**10:.1f} KiB |"
            )
    return "\n".join(lines)


def missed_targets(results: dict[str, Any]) -> list[str]:
    return [
        f"{name} at {length}: {ratio:.2f}x > {TARGETS[name]}x"
        for length, row in results.items()
        if length != "memory"
        for name, ratio in row["ratios"].items()
        if ratio > TARGETS[name]
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="8192,16384")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--flex", action="store_true", help="also the forward against compiled FlexAttention")
    parser.add_argument("--memory", help="also the peak memory of some rows at these lengths, e.g. 8192,16384,32768")
    parser.add_argument("--additive-memory", help="also additive attention's peak memory at these lengths")
    parser.add_argument("--rows", help="only these rows (and their peers), e.g. 'causal mask_mod,window,alibi'")
    parser.add_argument("--json")
    parser.add_argument("--memory-child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_child:
        print(json.dumps(memory_child(args.memory_child[0], int(args.memory_child[1]))))
        return 0
    rows = None if args.rows is None else set(args.rows.split(","))
    results = measure([int(n) for n in args.lengths.split(",")], args.repeats, args.flex, rows)
    text = report(results)
    if args.memory or args.additive_memory:
        lengths = [int(n) for n in args.memory.split(",")] if args.memory else []
        additive = [int(n) for n in args.additive_memory.split(",")] if args.additive_memory else None
        results["memory"] = measure_memory(lengths, rows, additive)
        text += "\n" + report_memory(results["memory"])
    return finish(results, text, missed_targets(results), args.json)


if __name__ == "__main__":
    sys.exit(main())
