"""torch's flexible-attention APIs on attnkit, same-run ratios (docs/benchmarks.md, "torch's flex_attention and
varlen_attn on CPU"; issue 51's numbers).

B=1, H=8, D=64, float32, forward + backward, at ``--length`` (8192):

* ``blockmask``: ``attnkit.flex_attention`` with a ``BlockMask`` from ``create_block_mask`` (built in every timed
  call, as a training step does), against attnkit's own ``mask_mod``/``score_mod`` path on the same functions
  (``attnkit.scaled_dot_product_attention``), for causal, a causal window of 1024, packed documents (causal;
  benchmarks/flex.py's log-normal lengths) and softcap (causal; ``mods.softcap(30)``, which is a torch score_mod as
  well). ``create_block_mask`` compiled, as torch advises and transformers does (``_compile=True``): the target row,
  at most 1.1x; and eagerly (``eager create``), where torch's evaluation of every pair alone takes about as long as
  attnkit's whole step on a window (reported, no target).
* ``forward``: the same calls' forward alone against compiled ``torch.flex_attention``'s CPU forward on the same
  BlockMask (compiling takes a minute here; ``--no-flex`` leaves it out). Target: at most 1.0x.
* ``bf16``: causal and the window in bfloat16, against attnkit's float32 time on the same call; the peer, PyTorch's
  causal SDPA in bfloat16 against its float32. Target: at most 0.7x.
* ``varlen``: ``attnkit.varlen_attn`` on 8 causal sequences of 256-2048 tokens packed, against
  ``scaled_dot_product_attention`` run per sequence (``is_causal``). Target: at most 1.2x.

Times are medians of ``--repeats`` rounds, the contenders of one row in turn within each round (benchmarks/flex.py's
``timed_rounds``). Exit status 1 when a target is missed.

Usage::

    python benchmarks/torch_apis.py --repeats 3 --json docs/torch_apis.json
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

import attnkit
from attnkit import mods
from flex import document_lengths, timed_rounds
from results import finish

B, H, D = 1, 8, 64
WINDOW = 1024
TARGETS = {"blockmask": 1.1, "forward": 1.0, "bf16": 0.7, "varlen": 1.2}
VARLEN = [256, 2048, 512, 1024, 768, 1536, 384, 1792]  # 8 sequences, 8,320 tokens

# B batch, H heads, L length, D head dim, T packed tokens


def causal(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
    return q_idx >= kv_idx


def window(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
    return (q_idx >= kv_idx) & (q_idx - kv_idx < WINDOW)


def documents(length: int) -> Callable[..., Any]:
    lengths = document_lengths()
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:length]  # (L,)
    ids = torch.cat([ids, torch.full((length - len(ids),), len(lengths))])

    def mask(b, h, q_idx, kv_idx):  # type: ignore[no-untyped-def]
        return (ids[q_idx] == ids[kv_idx]) & (q_idx >= kv_idx)

    return mask


def cases(length: int) -> dict[str, tuple[Callable[..., Any], Any]]:
    """Each row's mask_mod and score_mod."""
    return {
        "causal": (causal, None),
        "window": (window, None),
        "documents": (documents(length), None),
        "softcap": (causal, mods.softcap(30.0)),
    }


def step(run: Callable[[], torch.Tensor], leaves: list[torch.Tensor]) -> Callable[[], None]:
    def go() -> None:
        for t in leaves:
            t.grad = None
        run().sum().backward()

    return go


def measure(length: int, repeats: int, compiled_flex: bool) -> dict[str, Any]:
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, length, D, requires_grad=True) for _ in range(3))  # (B, H, L, D)
    found: dict[str, Any] = {}
    compiled = torch.compile(flex_attention)
    qd, kd, vd = q.detach(), k.detach(), v.detach()  # (torch's CPU flex refuses inputs that require grad)
    for name, (mask_mod, score_mod) in cases(length).items():

        def with_block_mask(mask_mod=mask_mod, score_mod=score_mod, q=q, k=k, v=v, compile=True):  # type: ignore[no-untyped-def]
            block_mask = create_block_mask(mask_mod, None, None, length, length, device="cpu", _compile=compile)
            return attnkit.flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)

        def eager_create(mask_mod=mask_mod, score_mod=score_mod, q=q, k=k, v=v):  # type: ignore[no-untyped-def]
            return with_block_mask(mask_mod, score_mod, q, k, v, compile=False)

        def own(mask_mod=mask_mod, score_mod=score_mod, q=q, k=k, v=v):  # type: ignore[no-untyped-def]
            return attnkit.scaled_dot_product_attention(q, k, v, mask_mod=mask_mod, score_mod=score_mod).output

        contenders = {"blockmask": with_block_mask, "eager create": eager_create, "own": own}
        times = timed_rounds({n: step(f, [q, k, v]) for n, f in contenders.items()}, repeats)
        found[f"blockmask {name}"] = {
            **times,
            "ratio": times["blockmask"] / times["own"],
            "eager create ratio": times["eager create"] / times["own"],
        }
        print(f"blockmask {name}: {found[f'blockmask {name}']}", file=sys.stderr)
        if compiled_flex:
            block_mask = create_block_mask(mask_mod, None, None, length, length, device="cpu")
            with torch.no_grad():
                times = timed_rounds(
                    {
                        "attnkit": lambda bm=block_mask, sm=score_mod: attnkit.flex_attention(
                            qd, kd, vd, score_mod=sm, block_mask=bm
                        ),
                        "torch compiled": lambda bm=block_mask, sm=score_mod: compiled(
                            qd, kd, vd, score_mod=sm, block_mask=bm
                        ),
                    },
                    repeats,
                )
            found[f"forward {name}"] = {**times, "ratio": times["attnkit"] / times["torch compiled"]}
            print(f"forward {name}: {found[f'forward {name}']}", file=sys.stderr)
    for name, mask_mod in (("causal", causal), ("window", window)):
        block_mask = create_block_mask(mask_mod, None, None, length, length, device="cpu")
        low = [t.detach().bfloat16().requires_grad_() for t in (q, k, v)]

        def run(tensors, bm=block_mask):  # type: ignore[no-untyped-def]
            return lambda: attnkit.flex_attention(*tensors, block_mask=bm)

        contenders = {"bf16": step(run(low), low), "fp32": step(run([q, k, v]), [q, k, v])}
        if name == "causal":
            contenders["sdpa bf16"] = step(lambda low=low: F.scaled_dot_product_attention(*low, is_causal=True), low)
            contenders["sdpa fp32"] = step(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), [q, k, v])
        times = timed_rounds(contenders, repeats)
        row = {**times, "ratio": times["bf16"] / times["fp32"]}
        if name == "causal":
            row["sdpa ratio"] = times["sdpa bf16"] / times["sdpa fp32"]
        found[f"bf16 {name}"] = row
        print(f"bf16 {name}: {row}", file=sys.stderr)
    T = sum(VARLEN)
    pq, pk, pv = (torch.randn(T, H, D, requires_grad=True) for _ in range(3))  # (T, H, D)
    cu = torch.tensor([0, *torch.tensor(VARLEN).cumsum(0).tolist()], dtype=torch.int32)

    def per_sequence() -> torch.Tensor:
        outs = []
        for a, b_, c in zip(pq.split(VARLEN), pk.split(VARLEN), pv.split(VARLEN), strict=True):
            q4, k4, v4 = (t.transpose(0, 1)[None] for t in (a, b_, c))  # (1, H, n, D)
            outs.append(F.scaled_dot_product_attention(q4, k4, v4, is_causal=True)[0].transpose(0, 1))
        return torch.cat(outs)  # (T, H, D)

    times = timed_rounds(
        {
            "varlen": step(
                lambda: attnkit.varlen_attn(pq, pk, pv, cu, cu, 2048, 2048, window_size=(-1, 0)), [pq, pk, pv]
            ),
            "sdpa per sequence": step(per_sequence, [pq, pk, pv]),
        },
        repeats,
    )
    found["varlen causal"] = {**times, "ratio": times["varlen"] / times["sdpa per sequence"]}
    return found


def report(found: dict[str, Any]) -> str:
    lines = ["| row | times (s) | ratio | target |", "|---|---|---|---|"]
    for name, row in found.items():
        kind = name.split()[0]
        times = ", ".join(f"{k} {v:.3f}" for k, v in row.items() if "ratio" not in k)
        ratio = f"{row['ratio']:.2f}x" + (f" (sdpa {row['sdpa ratio']:.2f}x)" if "sdpa ratio" in row else "")
        if "eager create ratio" in row:
            ratio += f" (eager create {row['eager create ratio']:.2f}x)"
        lines.append(f"| {name} | {times} | {ratio} | {TARGETS[kind]}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-flex", action="store_true", help="leave out compiled torch.flex_attention's forward")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.length < 1 or args.repeats < 1:
        parser.error("--length and --repeats must be at least 1")
    found = measure(args.length, args.repeats, not args.no_flex)
    missed = [
        f"{name}: {row['ratio']:.2f}x > {TARGETS[name.split()[0]]}x"
        for name, row in found.items()
        if row["ratio"] > TARGETS[name.split()[0]]
    ]
    found["command"] = " ".join(["python benchmarks/torch_apis.py", *(argv if argv is not None else sys.argv[1:])])
    rows = {k: v for k, v in found.items() if k != "command"}
    return finish(found, report(rows), missed, args.json)


if __name__ == "__main__":
    sys.exit(main())
