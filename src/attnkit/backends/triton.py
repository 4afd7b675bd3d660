"""Additive attention as Triton kernels on CUDA, forward and backward, memory linear in the length.

``s[i, j] = w_v . tanh(q[i] + k[j])`` is made and reduced a tile at a time inside the kernels
(:mod:`attnkit.backends.triton_kernels`), so the ``(B, H, Lq, Lk, D)`` features the book's formula stores are never
stored, and an online softmax over key blocks keeps one row's statistics, as FlashAttention does for dot products.
The backward recomputes each tile's features from the kept log-sum-exp: one kernel over key blocks (the keys',
values' and ``w_v``'s gradients), one over query blocks (the queries').

What it runs (``SUPPORTS``): additive scoring with ``valid_lens`` (``(B,)`` or ``(B, Lq)``) and ``is_causal``,
grouped key/value heads, float16, bfloat16, float32 and float64 (sums in float32, float64 for float64; for 16-bit
inputs the products of weights and values take float32 operands in TF32, whose 10 bits of mantissa are more than
the inputs'; FlashAttention's 16-bit products would be faster, to try on a GPU), on CUDA with the ``triton``
package. Not twice differentiable (a second backward raises). No ``attn_mask``,
``mask_mod``, ``score_mod``, sinks, dropout or weights. ``backend="auto"`` does not choose it yet: its speed
against the tile engine's is to be measured on a GPU (``benchmarks/triton_additive.py``, issue 28), and its CUDA results
are checked by the ``gpu`` tests in ``tests/test_triton.py``. On a machine without a GPU the same kernels run in
Triton's interpreter (``TRITON_INTERPRET=1``: numpy on the host, slow), which is how they are tested there.
"""

from __future__ import annotations

import contextlib
import importlib.util
import threading
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor

from attnkit.backends.common import first_order_only, zero_dead
from attnkit.backends.contract import ADDITIVE, Accuracy, Call, Supports

NAME = "triton"

# B batch, H heads, Hkv key/value heads, G = H / Hkv, Lq/Lk query/key length, D features (h), Dv value head dim

AVAILABLE = importlib.util.find_spec("triton") is not None

SUPPORTS = Supports(
    scoring=frozenset({ADDITIVE}),
    weights=False,
    dropout=False,
    bias_grad=False,
    attn_mask=False,
    mask_mod=False,
    score_mod="none",
    sinks=False,
    devices=frozenset({"cuda"}),
    dtypes=frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64}),
    needs=None if AVAILABLE else "the triton package (pip install -e '.[triton]')",
    accuracy=Accuracy(grads=(3e-5, 1e-11)),  # float64 gradients: tighter than the default (tests/test_triton.py)
)

#: A tile: ``BM`` query rows x ``BN`` keys, features reduced ``BD`` at a time (powers of two; ``BM`` and ``BN`` at
#: least 16, as ``tl.dot`` needs; to be tuned on a GPU: issue 28).
BLOCKS = MappingProxyType({"BM": 32, "BN": 32, "BD": 8})

# One launch at a time where the kernels run in Triton's interpreter (triton_kernels.INTERPRETED): two threads'
# launches at once gave wrong outputs in one and an error in the other.
_INTERPRETER = threading.Lock()


def attention(call: Call) -> tuple[Tensor, Tensor | None]:
    return run(call), None


def run(call: Call) -> Tensor:
    """The output of ``call`` through the kernels, at the tiles of :data:`BLOCKS`.

    With ``TRITON_INTERPRET=1`` in the environment before triton was first imported, the kernels run in Triton's
    interpreter, on CPU tensors (how the tests run them without a GPU).

    Returns:
        The output ``(B, H, Lq, Dv)`` in ``q.dtype``.
    """
    assert AVAILABLE and call.w_v is not None  # SUPPORTS: the triton package, additive scoring
    q, k, v, mask = call.q, call.k, call.v, call.mask
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    q, k, v = zero_dead(q, k, v, mask, call.zeros_past)
    if mask.valid_lens is None:
        lens = torch.full((B, Lq), Lk, dtype=torch.int32, device=q.device)  # (B, Lq)
    else:
        lens = mask.valid_lens.reshape(B, -1).expand(B, Lq).to(torch.int32).contiguous()  # (B, Lq)
    launch = _Launch(mask.is_causal, dict(BLOCKS))
    return _Additive.apply(q, k, v, call.w_v, lens, launch)  # type: ignore[no-any-return]


class _Launch:
    """How one call launches the kernels: the mask's causality and the tile sizes."""

    def __init__(self, causal: bool, blocks: dict[str, int]) -> None:
        from attnkit.backends import triton_kernels  # (imports triton: only when this backend runs)

        assert all(n & (n - 1) == 0 for n in blocks.values()) and min(blocks["BM"], blocks["BN"]) >= 16, blocks
        self.causal, self.blocks = causal, blocks
        self.interpreted = triton_kernels.INTERPRETED
        self.forward = triton_kernels._forward
        self.backward_keys = triton_kernels._backward_keys
        self.backward_queries = triton_kernels._backward_queries

    def args(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[list[Any], dict[str, Any]]:
        """The kernels' size arguments and compile-time constants for these inputs."""
        import triton.language as tl

        B, H, Lq, D = q.shape
        Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
        constants = {
            "CAUSAL": self.causal,
            "ACC": tl.float64 if q.dtype == torch.float64 else tl.float32,
            # products of weights and values in ACC: exact for float32 and float64; TF32 for 16-bit inputs (10 bits of
            # mantissa, more than bfloat16's or float16's)
            "PRECISION": "ieee" if q.dtype in (torch.float32, torch.float64) else "tf32",
            "BDV": max(16, 1 << (Dv - 1).bit_length()),
            **self.blocks,
        }
        return [H, H // Hkv, Lq, Lk, D, Dv, Lk - Lq], constants

    def on(self, device: torch.device) -> contextlib.AbstractContextManager[Any]:
        """Where and how the kernels launch: Triton launches on the current CUDA device, so make it the inputs';
        in the interpreter, one launch at a time."""
        if self.interpreted:
            return _INTERPRETER
        return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class _Additive(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, w_v: Tensor, lens: Tensor, launch: _Launch) -> Tensor:
        B, H, Lq, _ = q.shape
        q, k, v, w_v = q.contiguous(), k.contiguous(), v.contiguous(), w_v.contiguous()
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        # in ACC: the backward's delta = dO . O from the output before its rounding to a 16-bit dtype (from the
        # rounded one, bfloat16's dq was 4x the error of the math in bfloat16)
        out = torch.zeros((B, H, Lq, v.shape[3]), dtype=acc, device=q.device)  # (B, H, Lq, Dv)
        lse = torch.zeros((B, H, Lq), dtype=acc, device=q.device)  # (B, H, Lq): each row's log-sum-exp
        if out.numel():
            sizes, constants = launch.args(q, k, v)
            with launch.on(q.device):
                launch.forward[(B * H, _cdiv(Lq, constants["BM"]))](q, k, v, w_v, lens, out, lse, *sizes, **constants)
        ctx.save_for_backward(q, k, v, w_v, lens, out, lse)
        ctx.launch = launch
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        first_order_only(NAME)
        q, k, v, w_v, lens, out, lse = ctx.saved_tensors
        launch: _Launch = ctx.launch
        B, H, Lq, D = q.shape
        Hkv, Lk = k.shape[1], k.shape[2]
        acc = lse.dtype
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)  # (B, H, Lq, D)
        dk = torch.zeros((B, H, Lk, D), dtype=acc, device=q.device)  # (B, H, Lk, D): per query head
        dv = torch.zeros((B, H, Lk, v.shape[3]), dtype=acc, device=q.device)  # (B, H, Lk, Dv): per query head
        sizes, constants = launch.args(q, k, v)
        key_blocks = _cdiv(Lk, constants["BN"])
        dw = torch.zeros((B * H * key_blocks, D), dtype=acc, device=q.device)  # each key block's share of w_v's
        if out.numel() and Lk:
            delta = (dout.to(acc) * out).sum(-1)  # (B, H, Lq): dO_i . O_i
            keys = lens.amax(dim=1).to(torch.int32)  # (B,): the most keys a row of each example sees
            saved = (q, k, v, w_v, lens)
            with launch.on(q.device):
                launch.backward_keys[(B * H, key_blocks)](
                    *saved, keys, lse, delta, dout, dk, dv, dw, *sizes, **constants
                )
                launch.backward_queries[(B * H, _cdiv(Lq, constants["BM"]))](
                    *saved, lse, delta, dout, dq, *sizes, **constants
                )
        dk = dk.unflatten(1, (Hkv, H // Hkv)).sum(2)  # (B, Hkv, Lk, D): a group's query heads summed
        dv = dv.unflatten(1, (Hkv, H // Hkv)).sum(2)  # (B, Hkv, Lk, Dv)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), dw.sum(0).to(w_v.dtype), None, None


def _cdiv(n: int, block: int) -> int:
    return -(-n // block)
