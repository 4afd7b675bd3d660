"""The cost model of ring attention (docs/ring_cost_model.md), from what benchmarks/ring_cost.py measured.

    python benchmarks/ring_cost_model.py docs/ring_cost/w1.json docs/ring_cost/w2.json ...

Prints, as Markdown: the link fitted from the W = 2 ping-pong (latency ``a`` and bandwidth ``bw``), the attention
throughput of one rank fitted from the block times, the model against every measured ring run (W = 2..4 on this
machine), and the model's W = 2..64 for a long sequence on this machine's numbers and on stated GPU assumptions.
A mistake in the files (missing, not the script's JSON, a W = 1 or W = 2 run missing, runs of other shapes) is
one line and status 2.

The model. A causal zig-zag ring of W ranks, ``n = L / W`` positions per rank. The forward and the backward pass
each go round the ring, W steps each: step 0 on the rank's own block (causal: ``c0`` of the phase's compute),
every other step on half of an ``n x n`` block (``c``), while the block moves on: forward one message, the
key/value block (``2 B Hkv n D s`` bytes, ``s`` bytes an element); backward two, the block again and its gradient
(``2 B Hkv n D 4``: float32). The next block is received while the current one is scored, so a phase takes
``c0 + (W - 1) * max(c, m)`` with ``m`` its messages' time, and the backward pass adds its last gradient block's
way home (``t_home = a + 2 B Hkv n D 4 / bw``), which no compute covers::

    T(W) = sum over the two phases of k * (c0 + (W - 1) * max(c, m / k))  +  t_home       k = max(1, W / cores)

``k`` is this machine's: W ranks of one thread on ``cores`` cores share them. The compute of a phase: forward 2
matmuls, backward 5 (with the recomputed scores), of ``2 n^2 D`` FLOPs each a head on a full block, so
``c = 2 B H n^2 D / F`` forward and ``5 B H n^2 D / F`` backward at throughput ``F``; for this machine's measured
points, the measured block times split 2 : 5 between the phases. The exchange hides behind the compute when
``m <= c`` in both phases, that is for ``n >= n*``, the larger of the phases' roots of ``c(n) = m(n)``.
"""

from __future__ import annotations

import json
import sys

# B batch, H heads, Hkv key/value heads, D head dim, L whole length, W ranks, n = L / W


def _fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares ``y = a + b x``."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def _interpolate(table: dict[int, float], n: float) -> float:
    """``table`` (seconds by length) at ``n``, log-log linear between the measured lengths."""
    import math

    ns = sorted(table)
    lo = max([x for x in ns if x <= n], default=ns[0])
    hi = min([x for x in ns if x >= n], default=ns[-1])
    if lo == hi:
        return table[lo] * (n / lo) ** 2
    t = (math.log(n) - math.log(lo)) / (math.log(hi) - math.log(lo))
    return math.exp(math.log(table[lo]) * (1 - t) + math.log(table[hi]) * t)


def _t(seconds: float) -> str:
    return f"{seconds:.3g} s" if seconds >= 1 else f"{seconds * 1e3:.3g} ms"


# The phases: (name, share of a block's FLOPs, messages a step, bytes an element-pair of each: s for the key/value
# block, 4 for a float32 gradient)
FORWARD, BACKWARD = (2 / 7, 1), (5 / 7, 2)


def _step_comm(phase: tuple[float, int], a: float, bw: float, s: int, B: int, Hkv: int, n: float, D: int) -> float:
    share, messages = phase
    per_element = s if messages == 1 else s + 4  # backward: the block and its float32 gradient
    return messages * a + 2 * B * Hkv * n * D * per_element / bw


def _hidden_from(F: float, bw: float, a: float, s: int, H: int, Hkv: int, D: int) -> float:
    """The ``n`` (positions per rank) above which no phase's exchange takes longer than its compute: the larger
    of the positive roots of ``14 share H n^2 D / F = m(n)`` (B = 1)."""
    roots = []
    for phase in (FORWARD, BACKWARD):
        share, messages = phase
        qa = 14 * share * H * D / F / 2  # half a block a step
        qb = _step_comm(phase, 0.0, bw, s, 1, Hkv, 1.0, D)  # bytes' time per position
        qc = messages * a
        roots.append((qb + (qb * qb + 4 * qa * qc) ** 0.5) / (2 * qa))
    return max(roots)


def _ring(W: int, k: float, c0: float, c: float, comms: tuple[float, float], home: float) -> tuple[float, float]:
    """``T(W)`` with the exchange overlapped and without: each phase's ``c0`` and ``c`` are its share (2 : 5) of
    the step-0 and other-step compute ``c0``, ``c``; ``comms`` the two phases' exchange a step."""
    overlapped = serial = home
    for (share, _), m in zip((FORWARD, BACKWARD), comms, strict=True):
        overlapped += k * (share * c0 + (W - 1) * max(share * c, m / k))
        serial += k * share * (c0 + (W - 1) * c) + (W - 1) * m
    return overlapped, serial


class _Mistake(Exception):
    pass


def _load(paths: list[str]) -> list[dict]:
    runs = []
    for p in paths:
        try:
            with open(p) as f:
                runs.append(json.load(f))
        except (OSError, ValueError) as e:
            raise _Mistake(f"cannot read {p}: {e}") from e
        if not isinstance(runs[-1], dict) or "world_size" not in runs[-1]:
            raise _Mistake(f"{p} is not what benchmarks/ring_cost.py writes (no world_size)")
    sizes = {r["world_size"] for r in runs}
    if 1 not in sizes or 2 not in sizes:
        raise _Mistake(
            f"give the W = 1 run (block times) and the W = 2 run (the link) at least; got W = {sorted(sizes)}"
        )
    shapes = {(r.get("B"), r.get("H"), r.get("D"), r.get("dtype")) for r in runs}
    if len(shapes) != 1 or next(iter(shapes))[3] != "float32":
        raise _Mistake(f"every run must be of one shape, float32 (B, H, D, dtype): got {sorted(map(str, shapes))}")
    return runs


def main(paths: list[str]) -> int:
    try:
        runs = _load(paths)
    except _Mistake as e:
        print(f"ring_cost_model: {e}", file=sys.stderr)
        return 2
    blocks = next(r for r in runs if r["world_size"] == 1)
    B, H, D, cores = blocks["B"], blocks["H"], blocks["D"], blocks["cores"]
    Hkv, s = H, 4  # the measured runs: no grouped heads (ring_cost.py), float32 (checked)
    causal = {int(n): t for n, t in blocks["causal_block_seconds"].items()}
    full = {int(n): t for n, t in blocks["full_block_seconds"].items()}
    rings = [r for r in runs if r["world_size"] >= 2]
    # the link from W = 2 alone: with more ranks than cores a rank waits for its partner to be scheduled
    pings = [(int(b), t) for r in rings if r["world_size"] == 2 for b, t in r["one_way_seconds"].items()]
    a, per_byte = _fit_line([b for b, _ in pings], [t for _, t in pings])
    bw = 1 / per_byte
    n_big = max(full)
    F = 14 * B * H * n_big**2 * D / full[n_big]  # FLOP/s of one rank (one thread) on a full block
    print(f"Link (gloo, ping-pong, {len(pings)} points): latency a = {a * 1e6:.0f} us, bandwidth = {bw / 1e9:.2f} GB/s")
    print(f"One rank (one thread), full {n_big}-position block, forward and backward: F = {F / 1e9:.1f} GFLOP/s")
    n_star = _hidden_from(F, bw, a, s, H, Hkv, D)
    print(f"Communication hides when n = L / W >= n* = {n_star:.0f} positions per rank (this machine)\n")

    print("| W | L | n = L/W | k | model, overlapped | model, not overlapped | measured | measured / overlapped |")
    print("|--:|--:|--:|--:|--:|--:|--:|--:|")
    for r in sorted(rings, key=lambda r: r["world_size"]):
        W = r["world_size"]
        k = max(1.0, W / cores)
        for L_text, measured in r["ring_seconds"].items():
            n = int(L_text) / W
            comms = (_step_comm(FORWARD, a, bw, s, B, Hkv, n, D), _step_comm(BACKWARD, a, bw, s, B, Hkv, n, D))
            home = a + 2 * B * Hkv * n * D * 4 / bw
            model, serial = _ring(W, k, _interpolate(causal, n), _interpolate(full, n) / 2, comms, home)
            print(
                f"| {W} | {L_text} | {n:.0f} | {k:g} | {_t(model)} | {_t(serial)} | {_t(measured)} "
                f"| {measured / model:.2f} |"
            )

    print()
    scenarios = [
        # name, L, F (FLOP/s per rank, forward and backward), bw (bytes/s), a (s), s (bytes), H, Hkv, D
        ("This machine's rank and link (measured), a device each", 32768, F, bw, a, 4, 8, 8, 64),
        ("GPU, NVLink (assumed: 300 TFLOP/s, 150 GB/s, 10 us)", 131072, 300e12, 150e9, 10e-6, 2, 32, 8, 128),
        ("GPU, 400 Gb/s InfiniBand (assumed: 300 TFLOP/s, 45 GB/s, 20 us)", 131072, 300e12, 45e9, 20e-6, 2, 32, 8, 128),
    ]
    for name, L, F_, bw_, a_, s_, H_, Hkv_, D_ in scenarios:
        print(f"{name}: L = {L}, B = 1, H = {H_}, Hkv = {Hkv_}, D = {D_}, {8 * s_}-bit")
        print("\n| W | n = L/W | compute a step | exchange a step | hidden | ring, fwd + bwd | vs one device |")
        print("|--:|--:|--:|--:|:-:|--:|--:|")
        t1 = 7 * H_ * L**2 * D_ / F_  # W = 1: the causal call, half of an L x L block, forward and backward
        for W in (2, 4, 8, 16, 32, 64):
            n = L / W
            c = 7 * H_ * n**2 * D_ / F_  # half of an n x n block, forward and backward
            comms = (
                _step_comm(FORWARD, a_, bw_, s_, 1, Hkv_, n, D_),
                _step_comm(BACKWARD, a_, bw_, s_, 1, Hkv_, n, D_),
            )
            total, _ = _ring(W, 1.0, c, c, comms, a_ + 2 * Hkv_ * n * D_ * 4 / bw_)
            hidden = all(m <= share * c for (share, _), m in zip((FORWARD, BACKWARD), comms, strict=True))
            row = f"| {W} | {n:.0f} | {_t(c)} | {_t(sum(comms))} | {'yes' if hidden else 'no'} | {_t(total)} "
            print(row + f"| {t1 / total:.1f}x |")
        star = _hidden_from(F_, bw_, a_, s_, H_, Hkv_, D_)
        print(f"\nn* = {star:.0f} positions per rank: hidden up to W = {L / star:.0f} at this L\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
