"""Two ideas measured and not taken (``docs/benchmarks.md`` says where each would have gone and why not).

* ``tile-step`` (issue 23, the statistics' tiled pass): one 512 x 1,024 tile of scores reduced as
  ``attnkit.stats.tiled`` does it, eager (the product, chunk maxima, shift, ``exp()``, entropy, row sums, column
  sums, distance moment), against the same reductions as one ``torch.compile``d graph (Inductor's C++), the weights
  written into a rotating store of 8 tiles as the pass's kept weights are; and ``exp()`` alone, eager against
  Inductor's, into a tile that stays in cache.
* ``bias-mask`` (issue 24, a learned table of relative-position biases): PyTorch's fused CPU kernel, forward and
  backward, run a block of 1,024 queries at a time with the block's biases as a float ``attn_mask`` (the causal part
  as ``-inf``), B=1, H=8, D=64, L=8192, float32, against SDPA's ``is_causal`` call in the same rounds. The table's own
  gradient is not computed: this is the cost before it.
* ``window-flip`` (issue 24, ``sliding_window(1024)`` at 8192, forward and backward): the ``tiles`` backend's three
  runs of the kernel per block of 256 queries written out bare (the window's partly visible tile with a float mask,
  the full keys, the causal diagonal tile), against the same with the partly visible tile as the kernel's own
  ``is_causal`` on queries and keys in reverse order (the tile moved one key later: ``0 <= p - j < 1024`` there is
  ``j >= i`` in the tile, the transpose of causal), beside ``attnkit`` itself and SDPA without a mask.

Usage::

    python benchmarks/tried.py tile-step
    python benchmarks/tried.py bias-mask
    python benchmarks/tried.py window-flip
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
import torch.nn.functional as F

from flex import timed_rounds

# r rows of a tile, w keys of a tile, C keys a chunk, G query heads per key/value head, n rows of each
R, W, C, G = 512, 1024, 32, 1


def medians(contenders: dict[str, Callable[[int], object]], rounds: int, calls: int) -> dict[str, float]:
    """Median seconds of one call of each contender (called with its call's number), ``calls`` calls a round,
    rounds interleaved (:func:`flex.timed_rounds`)."""

    def batch(f: Callable[[int], object]) -> Callable[[], None]:
        def run() -> None:
            for i in range(calls):
                f(i)

        return run

    found = timed_rounds({name: batch(f) for name, f in contenders.items()}, rounds)
    return {name: seconds / calls for name, seconds in found.items()}


def tile_step() -> None:
    torch.manual_seed(0)
    n = R // G
    q, k = torch.randn(R, 64), torch.randn(W, 64) * 0.125  # (r, 64), (w, 64)
    t, store = torch.empty(R, W), torch.empty(8, R, W)  # (r, w), (8, r, w)
    maxima = torch.empty(R, W // C)  # (r, c)
    shift = -(torch.randn(R, 1) + 8)  # (r, 1): -lse
    kpos = torch.arange(W, dtype=torch.float32)  # (w,)
    ones = torch.ones(G, 1, n)  # (G, 1, n)

    def eager(i: int) -> tuple:
        w = store[i % 8]  # (r, w)
        torch.mm(q, k.T, out=t)
        torch.amax(t.view(R, W // C, C), dim=-1, out=maxima)  # (r, c)
        t.add_(shift)
        torch.exp(t, out=w)
        entropy, mass = torch.linalg.vecdot(w, t), w.sum(-1)  # (r,) each
        return entropy, mass, torch.bmm(ones, w.view(G, n, W))[:, 0], w @ kpos  # (r,), (r,), (G, w), (r,)

    def step(t: torch.Tensor, shift: torch.Tensor, kpos: torch.Tensor, w: torch.Tensor) -> tuple:
        s = t + shift  # (r, w)
        e = torch.exp(s)
        w.copy_(e)
        column = e.view(G, n, W).sum(1)  # (G, w)
        maxima = t.view(R, W // C, C).amax(-1)  # (r, c)
        return (e * s).sum(-1), e.sum(-1), column, (e * kpos).sum(-1), maxima

    compiled = torch.compile(step, dynamic=False, fullgraph=True)

    def fused(i: int) -> tuple:
        torch.mm(q, k.T, out=t)
        return compiled(t, shift, kpos, store[i % 8])

    def product(i: int) -> None:
        torch.mm(q, k.T, out=t)

    hot, scores = torch.empty(R, W), torch.randn(R, W) - 8  # (r, w) each
    exp_graph = torch.compile(lambda x, out: out.copy_(torch.exp(x)), dynamic=False, fullgraph=True)
    found = medians(
        {
            "eager tile": eager,
            "compiled tile": fused,
            "product alone": product,
            "exp, eager": lambda i: torch.exp(scores, out=hot),
            "exp, compiled": lambda i: exp_graph(scores, hot),
        },
        rounds=15,
        calls=16,
    )
    for name, seconds in found.items():
        print(f"{name:>15}: {seconds * 1e6:7.0f} us")
    ours = (*eager(0), maxima.clone())  # entropy, mass, column sums, moment, chunk maxima
    apart = max(float((a - b).abs().max()) for a, b in zip(ours, fused(0), strict=True))
    print(f"largest difference between the two tiles' reductions: {apart:.1e}")


def bias_mask() -> None:
    torch.manual_seed(0)
    B, H, L, D, rows = 1, 8, 8192, 64, 1024
    q, k, v = (torch.randn(B, H, L, D, requires_grad=True) for _ in range(3))  # (B, H, L, D) each
    dout = torch.randn(B, H, L, D)  # (B, H, L, D)
    table = torch.randn(2 * L - 1) * 0.1  # (2L - 1,): a bias per distance
    forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

    def peer(i: int) -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(dout)

    def blocks(i: int) -> None:
        qd, kd, vd = q.detach(), k.detach(), v.detach()
        dq, dk, dv = torch.empty_like(qd), torch.zeros_like(kd), torch.zeros_like(vd)  # (B, H, L, D) each
        for r0 in range(0, L, rows):
            r1 = r0 + rows
            qi, kj = torch.arange(r0, r1)[:, None], torch.arange(0, r1)[None]  # (rows, 1), (1, r1)
            bias = table[qi - kj + L - 1].masked_fill(kj > qi, float("-inf"))[None, None]  # (1, 1, rows, r1)
            qb, kb, vb = qd[:, :, r0:r1], kd[:, :, :r1], vd[:, :, :r1]
            out, lse = forward(qb, kb, vb, 0.0, False, attn_mask=bias)[:2]  # (B, H, rows, D), (B, H, rows)
            g = backward(dout[:, :, r0:r1], qb, kb, vb, out, lse, 0.0, False, attn_mask=bias)
            dq[:, :, r0:r1] = g[0]
            dk[:, :, :r1] += g[1]
            dv[:, :, :r1] += g[2]

    found = medians({"sdpa is_causal": peer, "fused kernel, bias blocks": blocks}, rounds=3, calls=1)
    for name, seconds in found.items():
        print(f"{name:>26}: {seconds:.3f} s")
    print(f"ratio: {found['fused kernel, bias blocks'] / found['sdpa is_causal']:.2f}x (before the table's gradient)")


def window_flip() -> None:
    import attnkit
    from attnkit import mods

    torch.manual_seed(0)
    B, H, L, D, window, n = 1, 8, 8192, 64, 1024, 256
    q, k, v = (torch.randn(B, H, L, D, requires_grad=True) for _ in range(3))  # (B, H, L, D) each
    dout = torch.randn(B, H, L, D)  # (B, H, L, D)
    forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    i, j = torch.arange(n)[:, None], torch.arange(n)[None]  # (n, 1), (1, n)
    strict = torch.where(j > i, 0.0, float("-inf"))  # (n, n): the tile of keys [r0 - 1024, r0 - 768)
    seen = torch.arange(n) < n - 1  # (n,): the block's last query sees none of that tile's keys

    def runs(r0: int, flip: bool) -> list[tuple[int, int, str]]:
        a = r0 - window + (1 if flip else 0)  # the partly visible tile's first key
        found = [(a, a + n, "flipped" if flip else "masked")] if a >= 0 else []
        found.append((a + n if a >= 0 else 0, r0, "full"))
        found.append((r0, r0 + n, "causal"))
        return [run for run in found if run[1] > run[0]]

    def run_forward(kind: str, qb: torch.Tensor, kb: torch.Tensor, vb: torch.Tensor) -> tuple:
        if kind == "flipped":
            o, lse = forward(qb.flip(2), kb.flip(2), vb.flip(2), 0.0, True)[:2]  # (B, H, n, D), (B, H, n)
            return o.flip(2), lse.flip(2)
        if kind == "masked":
            o, lse = forward(qb, kb, vb, 0.0, False, attn_mask=strict)[:2]
            return o, torch.where(seen, lse, float("-inf"))  # (B, H, n)
        return forward(qb, kb, vb, 0.0, kind == "causal")[:2]

    def run_backward(kind: str, *tensors: torch.Tensor) -> list[torch.Tensor]:
        if kind == "flipped":
            return [g.flip(2) for g in backward(*(t.flip(2) for t in tensors), 0.0, True)[:3]]
        mask = strict if kind == "masked" else None
        return list(backward(*tensors, 0.0, kind == "causal", attn_mask=mask)[:3])

    def bare(flip: bool) -> tuple[torch.Tensor, ...]:
        qd, kd, vd = q.detach(), k.detach(), v.detach()
        out, lse = torch.empty_like(qd), torch.empty(B, H, L)  # (B, H, L, D), (B, H, L)
        for r0 in range(0, L, n):
            parts = [
                run_forward(kind, qd[:, :, r0 : r0 + n], kd[:, :, a:z], vd[:, :, a:z]) for a, z, kind in runs(r0, flip)
            ]
            total = torch.logsumexp(torch.stack([p[1] for p in parts]), dim=0)  # (B, H, n)
            out[:, :, r0 : r0 + n] = sum(o * torch.exp(part_lse - total)[..., None] for o, part_lse in parts)
            lse[:, :, r0 : r0 + n] = total
        dq, dk, dv = torch.zeros_like(qd), torch.zeros_like(kd), torch.zeros_like(vd)  # (B, H, L, D) each
        for r0 in range(0, L, n):
            rows = slice(r0, r0 + n)
            for a, z, kind in runs(r0, flip):
                block = (
                    dout[:, :, rows],
                    qd[:, :, rows],
                    kd[:, :, a:z],
                    vd[:, :, a:z],
                    out[:, :, rows],
                    lse[:, :, rows],
                )
                g = run_backward(kind, *block)
                dq[:, :, rows] += g[0]
                dk[:, :, a:z] += g[1]
                dv[:, :, a:z] += g[2]
        return out, dq, dk, dv

    def ours(i: int) -> None:
        attnkit.scaled_dot_product_attention(q, k, v, mask_mod=mods.sliding_window(window)).output.backward(dout)

    apart = max(float((a - b).abs().max()) for a, b in zip(bare(False), bare(True), strict=True))
    found = medians(
        {
            "sdpa, no mask": lambda i: F.scaled_dot_product_attention(q, k, v).backward(dout),
            "attnkit": ours,
            "bare runs, masked tile": lambda i: bare(False),
            "bare runs, flipped tile": lambda i: bare(True),
        },
        rounds=5,
        calls=1,
    )
    for name, seconds in found.items():
        print(f"{name:>24}: {seconds:.3f} s  {seconds / found['sdpa, no mask']:.3f}x")
    print(f"largest difference between the two bare forms (output, dq, dk, dv): {apart:.1e}")


IDEAS = {"tile-step": tile_step, "bias-mask": bias_mask, "window-flip": window_flip}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("idea", choices=list(IDEAS))
    IDEAS[parser.parse_args().idea]()


if __name__ == "__main__":
    main()
