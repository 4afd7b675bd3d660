"""PyTorch's ``flex_attention`` on the CPU, forward and backward: :func:`flex_attention` with torch's signature (and
:mod:`attnkit.integrations.flex_patch`, under which code written against torch's name runs on it unchanged).

PyTorch 2.13's own FlexAttention has no backward pass on the CPU (``NotImplementedError``), cannot return
``max_scores`` there, and materialises every score unless compiled. attnkit runs the same call on its tile engine:

* a ``BlockMask`` from ``torch.nn.attention.flex_attention.create_block_mask`` (or ``BlockMask.from_kv_blocks``) is
  read as torch reads it: a pair in a block the mask does not list is hidden, a pair in a block it lists as full is
  visible without its ``mask_mod``, a pair in a partial block is visible where the ``mask_mod`` says. Its block
  table becomes attnkit's plan (:class:`attnkit.Plan`) directly: the hidden and full blocks are known from the
  table, never evaluated; only partial blocks are. The plan is kept on the ``BlockMask`` (the object the caller
  holds and every layer passes again), one for each ``(B, H)`` it serves;
* the ``score_mod`` runs as attnkit runs any score_mod (:mod:`attnkit.mods`): on the scaled score, with gradients to
  the tensors it closes over;
* ``lse`` (``return_lse``, ``AuxRequest(lse=True)``) is each row's log-sum-exp of its modified scores, natural log,
  with gradients; ``max_scores`` each row's largest modified score, without gradient (as torch's).

Where attnkit's rules and torch's meet: a row that may see no key gives zeros, with ``lse`` and ``max_scores`` of
``-inf`` (torch's values too). Where they differ: a NaN or an infinity in a key or value no query may see reaches
nothing in attnkit (torch's ``0 * NaN`` can put NaN into a whole row); results are otherwise interchangeable.
Computed in float32 for bfloat16 and float16 inputs (returned in the input's dtype), float64 in float64.

On any device but the CPU, :func:`flex_attention` calls PyTorch's own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from attnkit import mods
from attnkit._validate import check_torch_heads, describe
from attnkit.integrations._statistics import with_statistics

__all__ = ["block_mask_mod", "flex_attention"]

# B batch, H query heads, Hkv key/value heads, Lq/Lk query/key length, D head dim, Dv value head dim,
# Bm/Hm a BlockMask's batch and heads (1: shared), nQ/nK its blocks of queries and of keys

# kernel_options that tune torch's GPU kernels (block sizes, warps, pipelines, TMA, ROCm's knobs, which kernel),
# each also given per pass with a "fwd_" or "bwd_" prefix: attnkit accepts and ignores them, since none changes
# what is computed; any other key is refused (FlexKernelOptions in torch 2.13).
_TUNING = frozenset(
    {
        "num_warps",
        "num_stages",
        "BLOCK_M",
        "BLOCK_N",
        "BLOCK_M1",
        "BLOCK_N1",
        "BLOCK_M2",
        "BLOCK_N2",
        "PRESCALE_QK",
        "ROWS_GUARANTEED_SAFE",
        "BLOCKS_ARE_CONTIGUOUS",
        "WRITE_DQ",
        "FORCE_USE_FLEX_ATTENTION",
        "USE_TMA",
        "kpack",
        "matrix_instr_nonkdim",
        "waves_per_eu",
        "BACKEND",
        "SAFE_HEAD_DIM",
        "IS_DIVISIBLE",
    }
)


def _torch_flex() -> Any:
    """torch's ``torch.nn.attention.flex_attention`` module."""
    from torch.nn.attention import flex_attention as module

    return module


# torch's function itself, taken at attnkit's import (a cheap import: torch.nn.attention's): patch_flex_attention
# points the module's name elsewhere, and calls on other devices go to this one
TORCH_FLEX_ATTENTION: Any = _torch_flex().flex_attention


@dataclasses.dataclass(frozen=True, eq=False)
class block_mask_mod(mods.MaskMod):  # noqa: N801 - a function-like name, as the other built-ins
    """A torch ``BlockMask`` as an attnkit mask_mod: the pair ``(q_idx, kv_idx)`` is visible when its block is full,
    or partial and ``mask_mod`` allows it (``mask_mod`` ``None``: torch's ``noop_mask``, every pair of a listed
    block). ``partial`` and ``full`` are ``(Bm, Hm, nQ, nK)`` booleans of blocks ``q_block x kv_block``; raw
    positions, never aligned (a BlockMask is made for one call's lengths)."""

    partial: Tensor
    full: Tensor
    q_block: int
    kv_block: int
    mask_mod: Callable[..., Tensor] | None

    @classmethod
    def of(cls, block_mask: Any, *, batch: int, heads: int, num_queries: int, num_keys: int) -> block_mask_mod:
        """The BlockMask ``block_mask`` for a call of ``batch`` examples, ``heads`` query heads, ``num_queries``
        queries and ``num_keys`` keys.

        Raises:
            ValueError: a BlockMask made for other lengths, examples or heads, or whose tables name blocks past
                its lengths.
        """
        flex = _torch_flex()
        if not isinstance(block_mask, flex.BlockMask):
            raise TypeError(
                f"block_mask must be a torch.nn.attention.flex_attention.BlockMask, got {describe(block_mask)}"
            )
        if block_mask.mask_mod is getattr(flex, "_sliced_mask_mod_error", None):
            raise ValueError(
                "block_mask was sliced (block_mask[...]): its mask_mod is gone; make it again for this call"
            )
        Lq, Lk = (int(n) for n in block_mask.seq_lengths)
        if (Lq, Lk) != (num_queries, num_keys):
            raise ValueError(
                f"block_mask was made for {Lq} queries and {Lk} keys (seq_lengths), the call has {num_queries} and "
                f"{num_keys}: make it for these lengths (create_block_mask(..., Q_LEN={num_queries}, "
                f"KV_LEN={num_keys}))"
            )
        QB, KB = (int(n) for n in block_mask.BLOCK_SIZE)
        counts = block_mask.kv_num_blocks  # (Bm, Hm, nQ)
        if counts.dim() != 3 or block_mask.kv_indices.dim() != 4:
            raise ValueError(
                f"block_mask's kv_num_blocks must be (B, H, q blocks) and kv_indices (B, H, q blocks, n), got "
                f"{tuple(counts.shape)} and {tuple(block_mask.kv_indices.shape)}"
            )
        Bm, Hm, nQ = counts.shape
        if Bm not in (1, batch) or Hm not in (1, heads):
            raise ValueError(
                f"block_mask is for B={Bm} and H={Hm} (kv_num_blocks {tuple(counts.shape)}), the call has B={batch} "
                f"and H={heads} query heads: each must be the call's or 1 (shared)"
            )
        rows, cols = -(-Lq // QB), -(-Lk // KB)
        if nQ < rows:
            raise ValueError(f"block_mask has {nQ} blocks of {QB} queries, {Lq} queries need {rows}")
        partial = _dense(counts, block_mask.kv_indices, rows, cols, "kv_indices")  # (Bm, Hm, rows, cols)
        full = torch.zeros_like(partial)
        if block_mask.full_kv_num_blocks is not None:
            full = _dense(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, rows, cols, "full_kv_indices")
        # (the two tables may be given for different examples and heads, one of them shared)
        partial, full = torch.broadcast_tensors(partial, full)  # (Bm, Hm, rows, cols) each
        user = None if block_mask.mask_mod is flex.noop_mask else block_mask.mask_mod
        if user is None:  # every pair of a listed block is visible
            full, partial = full | partial, torch.zeros_like(partial)
        return cls((partial & ~full).contiguous(), full.contiguous(), QB, KB, user)

    def bind(self, *, batch: int, heads: int, num_queries: int, num_keys: int, device: torch.device | None) -> Any:
        return self  # (raw positions: a BlockMask is made for one call's lengths, checked in of())

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        device = self.full.device
        zero = torch.zeros((), dtype=torch.long, device=device)  # (an example or head the tables share)
        bb = b.to(device) if self.full.shape[0] > 1 else zero  # (B, 1, 1, 1) or ()
        hh = h.to(device) if self.full.shape[1] > 1 else zero  # (1, H, 1, 1) or ()
        qb, kb = q_idx.to(device) // self.q_block, kv_idx.to(device) // self.kv_block  # (1, 1, n, 1), (1, 1, 1, m)
        full = self.full[bb, hh, qb, kb]  # (B|1, H|1, n, m)
        if self.mask_mod is None:
            return full
        partial = self.partial[bb, hh, qb, kb]  # (B|1, H|1, n, m)
        if not bool(partial.any()):
            return full
        return full | (partial & mods.evaluate_mask(self.mask_mod, b, h, q_idx, kv_idx))  # (B|1, H|1, n, m)

    def tiles(self, rows: Tensor, cols: Tensor) -> mods.Tiles:
        some = (self.partial | self.full).flatten(0, 1).any(0).cpu()  # (nQ, nK): listed for some example and head
        every = self.full.flatten(0, 1).all(0).cpu()  # (nQ, nK): full for every example and head
        q0, q1 = rows[:, 0] // self.q_block, (rows[:, 1] - 1) // self.q_block + 1  # (nq,) the blocks a range meets
        k0, k1 = cols[:, 0] // self.kv_block, (cols[:, 1] - 1) // self.kv_block + 1  # (nk,)
        area = (q1 - q0)[:, None] * (k1 - k0)[None, :]  # (nq, nk) blocks in each tile
        return mods.Tiles(
            some=_box_sums(some, q0, q1, k0, k1) > 0, every=_box_sums(every, q0, q1, k0, k1) == area
        )  # (nq, nk) each

    def tensors(self) -> tuple[Tensor, ...]:
        return (self.partial, self.full)

    def depends_on(self, batch: int, heads: int) -> tuple[int, int]:
        if self.mask_mod is not None:  # (a user's function may read b and h)
            return batch, heads
        return min(batch, self.full.shape[0]), min(heads, self.full.shape[1])

    @property
    def opaque(self) -> bool:
        return self.mask_mod is not None


def _no_op(block_mask: Any) -> bool:
    """Whether ``block_mask`` is torch's mask of every pair (``_create_empty_block_mask``: one block as large as any
    call, a ``noop_mask``), which torch takes for any lengths."""
    flex = _torch_flex()
    large = getattr(flex, "_LARGE_SPARSE_BLOCK_SIZE", None)
    return (
        isinstance(block_mask, flex.BlockMask)
        and large is not None
        and tuple(int(n) for n in block_mask.BLOCK_SIZE) == (large, large)
        and block_mask.mask_mod is flex.noop_mask
    )


def _dense(counts: Tensor, indices: Tensor, rows: int, cols: int, name: str) -> Tensor:
    """A BlockMask's ordered table (``counts (Bm, Hm, nQ)`` blocks listed first in ``indices (Bm, Hm, nQ, n)``) as
    ``(Bm, Hm, rows, cols)`` booleans."""
    counts, indices = counts[:, :, :rows].long(), indices[:, :, :rows].long()  # (Bm, Hm, rows), (Bm, Hm, rows, n)
    listed = torch.arange(indices.shape[-1], device=indices.device) < counts[..., None]  # (Bm, Hm, rows, n)
    named = indices[listed]
    if named.numel() and (int(named.min()) < 0 or int(named.max()) >= cols):
        raise ValueError(
            f"block_mask's {name} names key blocks {int(named.min())}..{int(named.max())}, the call's keys make "
            f"{cols} blocks: it was made for other lengths"
        )
    dense = torch.zeros((*indices.shape[:3], cols + 1), dtype=torch.bool, device=indices.device)
    dense.scatter_(-1, torch.where(listed, indices, cols), True)  # (Bm, Hm, rows, cols + 1); unlisted to the spare
    return dense[..., :cols]


def _box_sums(grid: Tensor, r0: Tensor, r1: Tensor, c0: Tensor, c1: Tensor) -> Tensor:
    """The number of ``True`` in ``grid[r0[a]:r1[a], c0[c]:c1[c]]`` for each ``(a, c)``: ``(nq, nk)``."""
    ps = torch.zeros(grid.shape[0] + 1, grid.shape[1] + 1, dtype=torch.int64)  # (nQ + 1, nK + 1) prefix sums
    ps[1:, 1:] = grid.long().cumsum(0).cumsum(1)
    r0, r1 = r0.clamp(max=grid.shape[0])[:, None], r1.clamp(max=grid.shape[0])[:, None]  # (nq, 1)
    c0, c1 = c0.clamp(max=grid.shape[1])[None, :], c1.clamp(max=grid.shape[1])[None, :]  # (1, nk)
    return ps[r1, c1] - ps[r0, c1] - ps[r1, c0] + ps[r0, c0]  # (nq, nk)


def _plan(block_mask: Any, mask_mod: block_mask_mod, B: int, H: int, Lq: int, Lk: int, device: torch.device) -> Any:
    """The plan of ``block_mask`` for calls of ``B`` examples and ``H`` heads, kept on the BlockMask the caller
    holds (a model's layers pass the same one) while its tables and what its mask_mod reads are as they were: torch
    evaluates a partial block's mask_mod at every call, so a tensor it reads that changed in place (a buffer of
    document ids) makes the plan again, as does a mask_mod that cannot be looked into."""
    from attnkit.plan import make_plan

    kept = block_mask.__dict__.setdefault("_attnkit_plans", {})
    key = (B, H, str(device), torch.is_inference_mode_enabled())
    reads = _versions(mask_mod.mask_mod)
    found, was = kept.get(key, (None, None))
    fresh = found is not None and reads is not None and reads == was
    if not (fresh and (found.mask.mask_mod is mask_mod or _same_tables(found.mask.mask_mod, mask_mod))):
        found = make_plan(Lq, Lk, mask_mod=mask_mod, batch=B, heads=H, device=device)
        kept[key] = (found, reads)
    return found


def _versions(fn: Any) -> tuple[tuple[int, int, int], ...] | None:
    """Which tensors ``fn`` reads and their state, ``(id, data pointer, version)`` each (a write in place moves
    the version); ``None`` when it cannot be looked into."""
    if fn is None:
        return ()
    try:
        read = mods.read_tensors(fn)
    except mods.Uninspectable:
        return None
    return tuple((id(t), t.data_ptr(), t._version) for t in read)


def _same_tables(one: Any, other: block_mask_mod) -> bool:
    return (
        isinstance(one, block_mask_mod)
        and one.mask_mod is other.mask_mod
        and torch.equal(one.partial, other.partial)
        and torch.equal(one.full, other.full)
    )


def _check_options(kernel_options: Any) -> None:
    if kernel_options is None:
        return
    if not isinstance(kernel_options, dict):
        raise TypeError(f"kernel_options must be a dict or None, got {describe(kernel_options)}")
    unknown = sorted(
        str(key)
        for key in kernel_options
        if not (isinstance(key, str) and key.removeprefix("fwd_").removeprefix("bwd_") in _TUNING)
    )
    if unknown:
        raise ValueError(
            f"kernel_options: {unknown} unknown to attnkit (it accepts, and ignores, torch's GPU tuning options: "
            f"{sorted(_TUNING)}, also with a fwd_ or bwd_ prefix)"
        )


def flex_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    score_mod: mods.ScoreFn | None = None,
    block_mask: Any = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    kernel_options: dict[str, Any] | None = None,
    *,
    return_aux: Any = None,
) -> Any:
    """``torch.nn.attention.flex_attention.flex_attention`` on the CPU, forward and backward (see the module
    docstring); PyTorch's own on any other device.

    Args:
        query: ``(B, H, Lq, D)``; key: ``(B, Hkv, Lk, D)``; value: ``(B, Hkv, Lk, Dv)``, floating point, one dtype.
        score_mod: ``score_mod(score, b, h, q_idx, kv_idx) -> score``, on ``scale * q . k``.
        block_mask: a ``BlockMask`` made for ``Lq`` queries and ``Lk`` keys, whose batch and heads are the call's
            or 1; ``None``: every key visible.
        scale: ``1 / sqrt(D)`` when ``None``.
        enable_gqa: let ``H`` be a multiple of ``Hkv`` (query head ``h`` uses key/value head ``h // (H / Hkv)``).
        return_lse: also return each row's log-sum-exp (torch's deprecated spelling of ``return_aux``).
        kernel_options: torch's GPU tuning options, accepted and ignored; an unknown key is refused.
        return_aux: ``AuxRequest(lse=..., max_scores=...)``: also return an ``AuxOutput`` with those.

    Returns:
        ``output (B, H, Lq, Dv)``; with ``return_aux``, ``(output, AuxOutput(lse, max_scores))``, each ``(B, H, Lq)``
        or ``None``; with ``return_lse``, ``(output, lse)``. ``lse`` and ``max_scores`` are float32 (float64 for
        float64 inputs).

    Raises:
        TypeError, ValueError: naming the argument and its values (torch's own checks, and a ``BlockMask`` made for
            other sizes, an unknown ``kernel_options`` key).

    Example:
        >>> import torch, attnkit
        >>> from torch.nn.attention.flex_attention import create_block_mask
        >>> causal = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, 256, 256, device="cpu")
        >>> q = k = v = torch.randn(1, 2, 256, 16, requires_grad=True)
        >>> out = attnkit.flex_attention(q, k, v, block_mask=causal)
        >>> out.sum().backward()
        >>> tuple(q.grad.shape)
        (1, 2, 256, 16)
    """
    flex = _torch_flex()
    if isinstance(query, Tensor) and query.device.type != "cpu":
        return TORCH_FLEX_ATTENTION(
            query,
            key,
            value,
            score_mod,
            block_mask,
            scale,
            enable_gqa,
            return_lse,
            kernel_options,
            return_aux=return_aux,
        )
    check_torch_heads({"query": query, "key": key, "value": value}, 1, 1, enable_gqa)
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        raise ValueError(
            f"query, key and value must be 4-dim (B, H, L, D), got {tuple(query.shape)}, {tuple(key.shape)} and "
            f"{tuple(value.shape)}"
        )
    B, H, Lq, _ = query.shape
    Hkv, Lk = key.shape[1], key.shape[2]
    check_torch_heads({}, H, Hkv, enable_gqa)
    if key.shape[0] != value.shape[0] or key.shape[0] not in (1, B):
        raise ValueError(
            f"key and value must have query's batch size or 1 (shared), got {B}, {key.shape[0]} and {value.shape[0]}"
        )
    if key.shape[0] != B:  # keys and values shared by every example (torch's broadcast)
        key, value = key.expand(B, *key.shape[1:]), value.expand(B, *value.shape[1:])  # (B, Hkv, Lk, D|Dv)
    if return_lse and return_aux is not None:
        raise ValueError("return_lse and return_aux given together: pass return_aux=AuxRequest(lse=True) alone")
    if return_aux is not None and not isinstance(return_aux, flex.AuxRequest):
        raise TypeError(f"return_aux must be an AuxRequest or None, got {describe(return_aux)}")
    _check_options(kernel_options)
    want_lse = bool(return_lse) or (return_aux is not None and return_aux.lse)
    want_max = return_aux is not None and return_aux.max_scores
    from attnkit.functional import Masks

    plan = None
    if block_mask is not None and _no_op(block_mask):
        block_mask = None  # (torch's own mask of every pair, for any lengths)
    if (
        block_mask is not None
        and hasattr(block_mask, "kv_num_blocks")
        and block_mask.kv_num_blocks.device != query.device
    ):
        raise ValueError(
            f"block_mask is on {block_mask.kv_num_blocks.device}, query on {query.device}: move it (.to())"
        )
    if block_mask is not None:
        mask_mod = block_mask_mod.of(block_mask, batch=B, heads=H, num_queries=Lq, num_keys=Lk)
        plan = _plan(block_mask, mask_mod, B, H, Lq, Lk, query.device)
    out, lse, largest = with_statistics(
        query, key, value, Masks(score_mod=score_mod, plan=plan), scale, lse=want_lse, max_scores=want_max
    )
    if return_aux is not None:
        return out, flex.AuxOutput(lse=lse if want_lse else None, max_scores=largest if want_max else None)
    if return_lse:
        return out, lse
    return out
