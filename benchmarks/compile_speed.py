"""Compiled against eager: a Transformer block's training step and a static cache's decode step (issue 26's rows).

    python benchmarks/compile_speed.py            # one table; --json out.json also writes the figures

* training step: ``x + MHA(LN(x))`` then ``+ MLP(LN(.))`` (attnkit ``MultiHeadAttention``, E=256, 4 heads, MLP 4E),
  B=4, L=512, causal with ``valid_lens``, forward + backward + an SGD step; ``torch.compile(block)`` against the
  same block eagerly, and the same block with PyTorch's ``nn.MultiheadAttention`` (masked SDPA) as a peer;
* decode step: ``MultiHeadAttention(256, 8, num_kv_heads=2)`` over a static ``KVCache(max_len=...)`` holding 4096
  positions, B=1, one token, no grad; ``torch.compile(step, fullgraph=True)`` against eager.

Medians of interleaved repeats (this machine is shared and noisy), after warm-up (compiling happens there).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch import nn

import attnkit

# B batch, L length, E features


class Block(nn.Module):
    def __init__(self, E: int, heads: int, torch_attention: bool = False) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(E), nn.LayerNorm(E)
        self.torch_attention = torch_attention
        if torch_attention:
            self.attn: nn.Module = nn.MultiheadAttention(E, heads, batch_first=True)
        else:
            self.attn = attnkit.MultiHeadAttention(E, heads, query_size=E, key_size=E, value_size=E)
        self.mlp = nn.Sequential(nn.Linear(E, 4 * E), nn.GELU(), nn.Linear(4 * E, E))

    def forward(self, x: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)  # (B, L, E)
        if self.torch_attention:
            L = x.shape[1]
            causal = torch.ones(L, L, dtype=torch.bool, device=x.device).triu(1)  # True = hidden
            padding = torch.arange(L, device=x.device) >= lens[:, None]  # (B, L): True = hidden
            a = self.attn(h, h, h, attn_mask=causal, key_padding_mask=padding, need_weights=False)[0]
        else:
            a = self.attn(h, h, h, lens, is_causal=True)  # (B, L, E)
        x = x + a
        return x + self.mlp(self.ln2(x))  # (B, L, E)


def _median(fn: Callable[[], object], reps: int) -> float:
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def training(reps: int) -> dict[str, float]:
    torch.manual_seed(0)
    B, L, E = 4, 512, 256
    x = torch.randn(B, L, E)
    lens = torch.tensor([512, 400, 300, 450])
    steps: dict[str, Callable[[], None]] = {}
    for name, model in (
        ("attnkit eager", Block(E, 4)),
        ("attnkit compiled", torch.compile(Block(E, 4))),
        ("torch nn.MultiheadAttention eager", Block(E, 4, torch_attention=True)),
        ("torch nn.MultiheadAttention compiled", torch.compile(Block(E, 4, torch_attention=True))),
    ):
        opt = torch.optim.SGD(model.parameters(), lr=1e-4)

        def step(model: nn.Module = model, opt: torch.optim.Optimizer = opt) -> None:
            opt.zero_grad(set_to_none=True)
            out = model(x, lens)
            out[:, :, 0].sum().backward()
            opt.step()

        for _ in range(3):  # warm-up: compiling, allocators
            step()
        steps[name] = step
    found: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(reps):  # interleaved: the machine's noise falls on every row alike
        for name, step in steps.items():
            found[name].append(_median(step, 1))
    return {name: statistics.median(ts) for name, ts in found.items()}


def decode(reps: int, context: int = 4096) -> dict[str, float]:
    torch.manual_seed(0)
    E = 256
    model = attnkit.MultiHeadAttention(E, 8, num_kv_heads=2, query_size=E, key_size=E, value_size=E).eval()
    prompt = torch.randn(1, context, E)
    token = torch.randn(1, 1, E)
    found = {}
    with torch.no_grad():
        for name in ("eager", "tiles:compiled"):
            cache = attnkit.KVCache(max_len=context + 4 * reps + 64)
            model(prompt, prompt, prompt, is_causal=True, cache=cache)

            def eager(cache: attnkit.KVCache = cache) -> torch.Tensor:
                return model(token, token, token, is_causal=True, cache=cache)

            step = eager if name == "eager" else torch.compile(eager, fullgraph=True)
            for _ in range(5):
                step()
            found[name] = _median(step, reps)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads\n")
    train = training(args.reps)
    base = train["attnkit eager"]
    print("| training step, B=4 L=512 E=256, causal + valid_lens | median ms | / attnkit eager |")
    print("|---|--:|--:|")
    for name, t in train.items():
        print(f"| {name} | {t * 1e3:.1f} | {t / base:.2f} |")
    dec = decode(max(args.reps * 4, 40))
    print("\n| decode step, static cache, context 4096 | median ms | eager / this |")
    print("|---|--:|--:|")
    for name, t in dec.items():
        print(f"| {name} | {t * 1e3:.3f} | {dec['eager'] / t:.2f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"training_s": train, "decode_s": dec, "torch": torch.__version__}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
