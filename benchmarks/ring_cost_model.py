"""The cost model of ring attention (docs/ring_cost_model.md), from what benchmarks/ring_cost.py measured.

    python benchmarks/ring_cost_model.py docs/ring_cost/w1.json docs/ring_cost/w2.json ...

Prints, as Markdown: the link fitted from the ping-pong (latency ``a`` and bandwidth ``bw``), the attention
throughput of one rank fitted from the block times, the model against every measured ring run (W = 2..4 on this
machine), and the model's W = 2..64 for a long sequence on this machine's numbers and on stated GPU assumptions.

The model. A causal zig-zag ring of W ranks, ``n = L / W`` positions per rank, forward and backward. Each rank
runs W steps; step 0 on its own block costs ``t_causal(n)``, every other step scores half of an ``n x n`` block,
``t_full(n) / 2``, and meanwhile sends the block on: the key/value block forward and again backward
(``2 B Hkv n D s`` bytes each, ``s`` bytes an element) and, backward, its gradient (``2 B Hkv n D 4``: float32),
three messages, so ``t_comm(n) = 3 a + 2 B Hkv n D (2 s + 4) / bw`` a step. The
exchange overlaps the compute (the next block is received while the current one is scored)::

    T(W) = k * (t_causal(n) + (W - 1) * max(t_full(n) / 2, t_comm(n) / k)) + t_home(n)      k = max(1, W / cores)

where ``t_home(n) = a + 2 B Hkv n D 4 / bw`` is the last gradient block's way home, after all the compute.

``k`` is this machine's: W ranks of one thread on ``cores`` cores share them. Communication hides behind
computation when ``t_comm(n) <= t_full(n) / 2``; with ``t_full(n) = 14 B H n^2 D / F`` (fwd 2 matmuls, bwd 5, of
``2 n^2 D`` FLOPs each) that is ``n >= n*``, the root of ``7 H n^2 D / F = 3 a + 2 Hkv n D (2 s + 4) / bw``
(about ``2 Hkv (2 s + 4) F / (7 H bw)`` when the latency is small against the messages).
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


def _hidden_from(F: float, bw: float, a: float, s: int, H: int, Hkv: int, D: int) -> float:
    """The ``n`` (positions per rank) above which a step's exchange takes no longer than its compute: the positive
    root of ``7 H n^2 D / F = 3 a + 2 Hkv n D (2 s + 4) / bw`` (B = 1)."""
    qa, qb, qc = 7 * H * D / F, 2 * Hkv * D * (2 * s + 4) / bw, 3 * a
    return (qb + (qb * qb + 4 * qa * qc) ** 0.5) / (2 * qa)


def main(paths: list[str]) -> int:
    runs = [json.load(open(p)) for p in paths]  # noqa: SIM115 - read whole
    blocks = next(r for r in runs if r["world_size"] == 1)
    B, H, D, cores = blocks["B"], blocks["H"], blocks["D"], blocks["cores"]
    Hkv, s = H, 4  # the measured runs: no grouped heads, float32
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
            comm = 3 * a + 2 * B * Hkv * n * D * (2 * s + 4) / bw
            home = a + 2 * B * Hkv * n * D * 4 / bw  # the last gradient block's way home: after all compute
            compute = k * (_interpolate(causal, n) + (W - 1) * _interpolate(full, n) / 2)
            model = k * (_interpolate(causal, n) + (W - 1) * max(_interpolate(full, n) / 2, comm / k)) + home
            serial = compute + (W - 1) * comm + home  # the exchange not hidden at all
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
        t1 = 7 * H_ * L**2 * D_ / F_  # W = 1: the causal call, half of an L x L block
        for W in (2, 4, 8, 16, 32, 64):
            n = L / W
            compute = 7 * H_ * n**2 * D_ / F_  # half of an n x n block, forward and backward
            comm = 3 * a_ + 2 * Hkv_ * n * D_ * (2 * s_ + 4) / bw_  # the gradient travels in float32
            total = compute + (W - 1) * max(compute, comm) + a_ + 2 * Hkv_ * n * D_ * 4 / bw_  # + its way home
            hidden = "yes" if comm <= compute else "no"
            print(f"| {W} | {n:.0f} | {_t(compute)} | {_t(comm)} | {hidden} | {_t(total)} | {t1 / total:.1f}x |")
        star = _hidden_from(F_, bw_, a_, s_, H_, Hkv_, D_)
        print(f"\nn* = {star:.0f} positions per rank: hidden up to W = {L / star:.0f} at this L\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
