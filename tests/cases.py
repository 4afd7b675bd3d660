"""Inputs for the agreement tests: awkward sizes crossed with every way of masking."""

from __future__ import annotations

import itertools

import torch

B, H = 2, 8
LQ = (1, 7, 113)
LK = (1, 203, 257)
DIMS = (8, 40, 64)
GROUPS = (1, 2, 8)  # H / Hkv
MASKINGS = (
    "none",
    "valid_lens_1d",
    "valid_lens_2d",
    "bool_mask",
    "float_mask",
    "causal",
    "valid_lens_1d+causal",
    "valid_lens_2d+bool_mask",
    "bool_mask+float_mask+causal",
    "valid_lens_2d+bool_mask+float_mask+causal",
)
SHAPES = list(itertools.product(LQ, LK, DIMS, GROUPS))


def make_inputs(Lq, Lk, D, group, seed, *, dtype=torch.float32, heads=True):
    g = torch.Generator().manual_seed(seed)
    Hkv = H // group
    if heads:
        q = torch.randn(B, H, Lq, D, generator=g)
        k = torch.randn(B, Hkv, Lk, D, generator=g)
        v = torch.randn(B, Hkv, Lk, D + 3, generator=g)  # Dv != D on purpose
    else:
        q = torch.randn(B, Lq, D, generator=g)
        k = torch.randn(B, Lk, D, generator=g)
        v = torch.randn(B, Lk, D + 3, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype), g


def make_masking(name, Lq, Lk, g, *, heads=True):
    """Keyword arguments for one masking; lengths include 0 sometimes (rows with nothing to attend to)."""
    kw = {}
    parts = name.split("+")
    if "valid_lens_1d" in parts:
        kw["valid_lens"] = torch.randint(0, Lk + 1, (B,), generator=g)
        kw["valid_lens"][0] = max(1, Lk // 2)
    if "valid_lens_2d" in parts:
        kw["valid_lens"] = torch.randint(0, Lk + 1, (B, Lq), generator=g).float()  # whole-number floats
    mask_heads = (H,) if heads else ()
    if "bool_mask" in parts:
        kw["attn_mask"] = torch.rand((B, *mask_heads, Lq, Lk), generator=g) < 0.8
    if "float_mask" in parts:
        bias = torch.randn((1, *mask_heads, Lq, Lk), generator=g)
        if "attn_mask" in kw:  # both given: the float bias applies where the boolean mask allows
            bias = bias.masked_fill(~kw["attn_mask"], float("-inf"))
        kw["attn_mask"] = bias
    if "causal" in parts:
        kw["is_causal"] = True
    return kw
