"""``attnkit bench``: attnkit against ``torch.nn.MultiheadAttention`` and the book's formulas, same weights.

Timing uses ``torch.utils.benchmark`` (warm-up, the process's thread count, adaptive repeats; the median is
reported). Peak memory is measured per configuration in a fresh subprocess, as the increase of the peak
resident set size over the process's size after building the inputs (``VmHWM``, reset through
``/proc/self/clear_refs``; Linux).

Contenders, on the same shapes with the same weights:

* ``attnkit``: :class:`attnkit.MultiHeadAttention`, ``backend="auto"``, and each backend by name;
* ``attnkit+weights``: the same inside :func:`attnkit.record_weights` (weights kept for every call);
* ``torch``: ``torch.nn.MultiheadAttention(batch_first=True)`` with ``need_weights=False``, and
  ``torch+weights`` with ``need_weights=True`` (``average_attn_weights=False``);
* ``book``: the book's own classes (``attnkit.tools.book``, its code as the book writes it): ``transpose_qkv``,
  ``bmm`` scores, the ``-1e6`` masked softmax written into the scores (causal as the book's decoder does it: 2-D
  ``valid_lens`` ``1..L``); for additive attention, the book's ``AdditiveAttention`` on the projected queries
  and keys that :func:`attnkit.additive_attention` takes;
* ``d2l``: :class:`attnkit.d2l.MultiHeadAttention`, the drop-in for the book's class, called as ``book`` is
  (its ``x book``: what swapping the import costs or saves; ``benchmarks/d2l_vs_book.py`` times the two alone).

Masks: ``none``; ``valid_lens`` with lengths uniform in ``[L/4, L]`` (torch: ``key_padding_mask``); ``causal``.
Modes: ``infer`` (forward under ``torch.inference_mode()``) and ``train`` (forward and backward).
GFLOP/s count the dense work: ``8 B L h^2`` for the four projections and ``4 B L^2 h`` for the scores and the
weighted sum, three times that for forward and backward; ``peak`` compares them with this machine's float32
matmul rate, measured in the same run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.utils import benchmark

import attnkit
from attnkit import d2l
from attnkit.tools import book
from attnkit.tools.bench.report import HEADS, HIDDENS, Report, Row
from attnkit.tools.bench.report import load_json as load_json
from attnkit.tools.bench.report import plot_report as plot_report
from attnkit.tools.bench.report import save_json as save_json
from attnkit.tools.bench.report import table as table

# B batch, L sequence length, h num_hiddens, H heads, d head dim

FULL_GRID = [(8, 128), (8, 512), (8, 2048), (1, 8192)]
QUICK_GRID = [(2, 128)]
MASKS = ("none", "valid_lens", "causal")
QUICK_MASKS = ("none", "valid_lens")
MODES = ("infer", "train")
BACKENDS = ("sdpa", "tiles:online", "reference")
ADDITIVE_FULL = {"B": 8, "L": 1024, "h": 128}
ADDITIVE_QUICK = {"B": 2, "L": 128, "h": 32}


# ---------------------------------------------------------------------------------------------- the calls


def _lengths(B: int, L: int, seed: int = 0) -> Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(max(1, L // 4), L + 1, (B,), generator=g)


def make_call(kind: str, B: int, L: int, mode: str, mask: str, contender: str) -> Callable[[], None]:
    """A function that runs one configuration once (forward, or forward and backward)."""
    return _wrap(make_forward(kind, B, L, mask, contender, train=mode == "train"), mode == "train")


def make_forward(kind: str, B: int, L: int, mask: str, contender: str, *, train: bool) -> Callable[[], Tensor]:
    """A function that runs one contender's forward and returns its output; every contender gets the same inputs
    and the same weights, so their outputs agree (tests check it)."""
    torch.manual_seed(0)
    if kind == "overhead":
        B, L, h, heads = 2, 4, 100, 5
    elif kind == "additive":
        spec = ADDITIVE_FULL if L == ADDITIVE_FULL["L"] else ADDITIVE_QUICK
        h = spec["h"]
    else:
        h, heads = HIDDENS, HEADS
    lens = _lengths(B, L) if mask == "valid_lens" else None

    if kind == "additive":
        q, k = torch.randn(B, L, h, requires_grad=train), torch.randn(B, L, h, requires_grad=train)
        v, w_v = torch.randn(B, L, h, requires_grad=train), torch.randn(h, requires_grad=train)
        if contender == "book":  # the book's class, its W_q and W_k left out: q and k come projected
            additive = book.AdditiveAttention(h, h, h, 0.0)
            additive.W_q = additive.W_k = nn.Identity()
            additive.w_v.weight = nn.Parameter(w_v.detach()[None, :], requires_grad=train)  # (1, h)
            return lambda: additive(q, k, v, lens)
        backend = contender.partition(":")[2] or "auto"
        return lambda: attnkit.additive_attention(q, k, v, w_v, valid_lens=lens, backend=backend).output

    x = torch.randn(B, L, h, requires_grad=train)
    ours = attnkit.MultiHeadAttention(h, heads, query_size=h, key_size=h, value_size=h)
    if contender.startswith("torch"):
        m = ours.to_torch(batch_first=True)
        kpm = None if lens is None else torch.arange(L)[None, :] >= lens[:, None]  # (B, L), True = ignore
        causal = nn.Transformer.generate_square_subsequent_mask(L) if mask == "causal" else None
        need = contender == "torch+weights"

        def run() -> Tensor:
            out, _ = m(
                x,
                x,
                x,
                key_padding_mask=kpm,
                attn_mask=causal,
                is_causal=causal is not None,
                need_weights=need,
                average_attn_weights=False,
            )
            return out

        return run
    if contender in ("book", "d2l"):
        book_lens = lens
        if mask == "causal":
            book_lens = torch.arange(1, L + 1).repeat(B, 1)  # (B, L): the book decoder's causal mask
        if contender == "d2l":
            drop_in = d2l.MultiHeadAttention(h, h, h, h, heads, 0.0)
            drop_in.load_state_dict(ours.state_dict())
            return lambda: drop_in(x, x, x, book_lens)
        books = book.MultiHeadAttention(h, h, h, h, heads, 0.0)
        books.load_state_dict(ours.state_dict())
        return lambda: books(x, x, x, book_lens)
    ours.backend = contender.partition(":")[2] or "auto"
    causal_flag = mask == "causal"
    if contender == "attnkit+weights":

        def recorded() -> Tensor:
            with attnkit.record_weights(ours):
                return ours(x, x, x, lens, is_causal=causal_flag)

        return recorded
    return lambda: ours(x, x, x, lens, is_causal=causal_flag)


def _wrap(run: Callable[[], Tensor], train: bool) -> Callable[[], None]:
    if train:

        def step() -> None:
            run().sum().backward()

        return step

    def infer() -> None:
        with torch.inference_mode():
            run()

    return infer


def flops(kind: str, B: int, L: int, mode: str) -> float:
    if kind != "mha":
        return 0.0
    h = HIDDENS
    forward = 8 * B * L * h * h + 4 * B * L * L * h
    return forward * (3 if mode == "train" else 1)


def matmul_gflops(n: int = 2048) -> float:
    """This machine's float32 matmul rate (GFLOP/s), the yardstick for ``peak``."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    t = benchmark.Timer("a @ b", globals={"a": a, "b": b}, num_threads=torch.get_num_threads())
    return 2 * n**3 / t.blocked_autorange(min_run_time=1.0).median / 1e9


def time_call(call: Callable[[], None], min_run_time: float) -> float:
    timer = benchmark.Timer("call()", globals={"call": call}, num_threads=torch.get_num_threads())
    return timer.blocked_autorange(min_run_time=min_run_time).median


# ------------------------------------------------------------------------------------------------ memory


def measure_memory(row: Row) -> int | None:
    """Peak memory of one call of ``row``'s configuration, in a fresh subprocess; None if it failed."""
    spec = json.dumps([row.kind, row.B, row.L, row.mode, row.mask, row.contender])
    child = subprocess.run(
        [sys.executable, "-m", "attnkit.tools.bench", "--memory-child", spec],
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    if child.returncode != 0:
        return None
    return int(child.stdout.strip().splitlines()[-1])


def peak_memory(fn: Callable[[], object], device: torch.device | str = "cpu") -> int:
    """How many bytes the peak memory rose above its level at the start while ``fn()`` ran.

    On CUDA, the peak of ``torch.cuda.memory_allocated``. On the CPU, the process's peak resident set size
    (``VmHWM``, reset to the current size through ``/proc/self/clear_refs``; Linux): not
    ``getrusage().ru_maxrss``, which Linux keeps across ``execve``, so a child started by a large parent would
    report the parent's size.
    """
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return max(0, torch.cuda.max_memory_allocated(device) - before)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak is now the current size: what exists before fn() is not counted
    with open("/proc/self/statm") as f:
        before = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    fn()
    with open("/proc/self/status") as f:
        peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    return max(0, peak - before)


def _memory_child(spec: str) -> None:
    kind, B, L, mode, mask, contender = json.loads(spec)
    print(peak_memory(make_call(kind, B, L, mode, mask, contender)))


# -------------------------------------------------------------------------------------------------- grid


def contenders(kind: str, L: int, quick: bool = False) -> list[str]:
    if kind == "additive":
        return ["attnkit", "book"] if quick else ["attnkit", "attnkit:tiles:online", "book"]
    if kind == "overhead":
        return ["attnkit", "book"]
    if quick:
        return ["attnkit", "torch", "book"]
    names = ["attnkit", *(f"attnkit:{b}" for b in BACKENDS), "attnkit+weights", "torch", "torch+weights", "book", "d2l"]
    if L > 2048:  # one long sequence: the linear-memory contenders and the peer
        names = ["attnkit", "attnkit:tiles:online", "torch"]
    return names


def plan(quick: bool) -> list[Row]:
    """The grid: every (B, L) x mode x mask x contender, then additive attention and the tiny-input overhead."""
    rows = []
    for B, L in QUICK_GRID if quick else FULL_GRID:
        for mode in MODES:
            for mask in QUICK_MASKS if quick else MASKS:
                for c in contenders("mha", L, quick):
                    rows.append(Row("mha", B, L, mode, mask, c))
    spec = ADDITIVE_QUICK if quick else ADDITIVE_FULL
    for c in contenders("additive", spec["L"], quick):
        rows.append(Row("additive", spec["B"], spec["L"], "train", "none", c))
    for c in contenders("overhead", 4):
        rows.append(Row("overhead", 2, 4, "infer", "none", c))
    return rows


def run(quick: bool, memory: bool, on_row: Callable[[int, int, Row], None] | None = None) -> Report:
    start = time.perf_counter()
    report = Report(threads=torch.get_num_threads(), torch_version=torch.__version__)
    report.matmul_gflops = matmul_gflops(512 if quick else 2048)
    rows = plan(quick)
    min_run_time = 0.05 if quick else 0.3
    for i, row in enumerate(rows):
        if on_row is not None:
            on_row(i, len(rows), row)
        try:
            row.seconds = time_call(make_call(row.kind, row.B, row.L, row.mode, row.mask, row.contender), min_run_time)
        except (RuntimeError, ValueError) as e:
            row.note = f"failed: {type(e).__name__}"
            continue
        fl = flops(row.kind, row.B, row.L, row.mode)
        row.gflops = fl / row.seconds / 1e9 if fl else None
        if memory:
            row.peak_bytes = measure_memory(row)
        report.rows.append(row)
    report.seconds = time.perf_counter() - start
    return report


# ------------------------------------------------------------------------------------------------ output
