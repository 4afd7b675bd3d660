"""Graph breaks of attnkit's layers under torch.compile, and why (issue 26: 0 in every row).

    python benchmarks/graph_breaks.py            # a table: case, graphs, breaks, the first reasons

``torch._dynamo.explain`` runs the forward of ``MultiHeadAttention(64, 4, num_kv_heads=2)`` (and of
``attnkit.d2l``'s) on B=2, L=32, inputs requiring grad, for each mask and modifier; each break's reason is
shortened to its first line.
"""

from __future__ import annotations

import collections
import sys

import torch

import attnkit
from attnkit import d2l, mods

# B batch, L length, E features

B, L, E = 2, 32, 64


def cases() -> dict[str, tuple[torch.nn.Module, dict]]:
    torch.manual_seed(0)
    mha = attnkit.MultiHeadAttention(E, 4, num_kv_heads=2)
    book = d2l.MultiHeadAttention(E, 4, 0.0)
    sinks = attnkit.MultiHeadAttention(E, 4, num_kv_heads=2, sinks=True)
    lens = torch.tensor([32, 20])
    return {
        "no mask": (mha, {}),
        "is_causal": (mha, {"is_causal": True}),
        "valid_lens": (mha, {"valid_lens": lens}),
        "causal + valid_lens": (mha, {"is_causal": True, "valid_lens": lens}),
        "attn_mask": (mha, {"attn_mask": torch.ones(L, L, dtype=torch.bool).tril()}),
        "sliding_window": (mha, {"is_causal": True, "mask_mod": mods.sliding_window(8)}),
        "a user mask_mod": (mha, {"mask_mod": lambda b, h, q, k: (q - k).abs() < 8}),
        "softcap": (mha, {"is_causal": True, "score_mod": mods.softcap(5.0)}),
        "alibi": (mha, {"is_causal": True, "score_mod": mods.alibi(mods.alibi_slopes(4))}),
        "float attn_mask": (mha, {"attn_mask": torch.randn(B, 1, L, L)}),
        "sinks + valid_lens": (sinks, {"valid_lens": lens}),
        "d2l valid_lens": (book, {"valid_lens": lens}),
    }


def explain(module: torch.nn.Module, masks: dict) -> tuple[int, int, list[str]]:
    x = torch.randn(B, L, E, requires_grad=True)  # (B, L, E)

    def step(x: torch.Tensor) -> torch.Tensor:  # the forward: dynamo does not trace .backward() itself
        if isinstance(module, d2l.MultiHeadAttention):
            return module(x, x, x, masks.get("valid_lens"))  # (B, L, E)
        return module(x, x, x, **masks)  # (B, L, E)

    torch._dynamo.reset()
    result = torch._dynamo.explain(step)(x)
    reasons = []
    for b in result.break_reasons:
        lines = [line for line in str(b.reason).splitlines() if line.strip()] or ["(no reason given)"]
        ours = [f for f in (b.user_stack or []) if "/attnkit/" in f.filename]
        where = f" at {ours[-1].filename.split('/attnkit/')[-1]}:{ours[-1].lineno}" if ours else ""
        reasons.append(lines[0].strip()[:80] + where)
    return result.graph_count, result.graph_break_count, reasons


def main() -> int:
    print(f"torch {torch.__version__}; MultiHeadAttention({E}, 4, num_kv_heads=2), B={B}, L={L}, forward\n")
    print("| case | graphs | breaks | most frequent reasons (count) |")
    print("|---|--:|--:|---|")
    for name, (module, masks) in cases().items():
        graphs, breaks, reasons = explain(module, masks)
        common = collections.Counter(reasons).most_common(4)
        said = "; ".join(f"{r} ({n})" for r, n in common).replace("|", "\\|")
        print(f"| {name} | {graphs} | {breaks} | {said} |")
    graphs, breaks, reasons = decode_step()
    said = "; ".join(f"{r} ({n})" for r, n in collections.Counter(reasons).most_common(4)).replace("|", "\\|")
    print(f"| decode step, static KVCache | {graphs} | {breaks} | {said} |")
    return 0


def decode_step() -> tuple[int, int, list[str]]:
    """One token over a static cache that a prompt filled eagerly (no grad, as generation runs)."""
    torch.manual_seed(0)
    mha = attnkit.MultiHeadAttention(E, 4, num_kv_heads=2).eval()
    cache = attnkit.KVCache(max_len=64)
    prompt, token = torch.randn(B, L, E), torch.randn(B, 1, E)
    with torch.no_grad():
        mha(prompt, prompt, prompt, torch.tensor([32, 20]), is_causal=True, cache=cache)
        torch._dynamo.reset()
        result = torch._dynamo.explain(lambda x: mha(x, x, x, is_causal=True, cache=cache))(token)
    reasons = [str(b.reason).splitlines()[0][:80] for b in result.break_reasons]
    return result.graph_count, result.graph_break_count, reasons


if __name__ == "__main__":
    sys.exit(main())
