"""PyTorch's ``varlen_attn`` on the CPU, forward and backward: :func:`varlen_attn`, with the signature and semantics
of ``torch.nn.attention.varlen.varlen_attn`` (torch 2.13, whose CPU build has no kernel for it:
``aten::_flash_attention_forward``).

Sequences are packed along the first axis, ``(T, H, D)``: sequence ``i`` holds queries ``cu_seq_q[i]:cu_seq_q[i+1]``
and keys ``cu_seq_k[i]:cu_seq_k[i+1]`` (its first ``seqused_k[i]`` of them where given; from the pages
``block_table[i]`` of a paged cache where given). Each sequence attends within itself, as a call of its own: its
result is exactly that sequence alone (:func:`attnkit.scaled_dot_product_attention` on it), forward and backward,
whatever the others hold (NaN included). A window ``(left, right)`` is flash-attention's, aligned to the bottom
right: query ``t`` of a sequence of ``n`` queries and ``m`` keys stands at key ``p = t + m - n`` and sees keys
``p - left .. p + right`` (``-1``: no bound on that side); ``(-1, 0)`` is causal.

Where attnkit's rules differ from flash-attention's: a query that sees no key (a sequence without keys, a window
that holds none) gives zeros and an ``lse`` of ``-inf`` (flash-attention leaves ``+inf`` there). Gradients flow
with ``seqused_k`` and ``block_table`` too (torch's are inference-only). ``num_splits`` (split-KV scheduling on the
GPU) is accepted and changes nothing. On any device but the CPU, torch's own runs.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import torch
from torch import Tensor

from attnkit import mods
from attnkit._validate import check_torch_heads, describe
from attnkit.integrations._statistics import with_statistics

__all__ = ["varlen_attn"]

# T packed tokens (Tq queries, Tk keys), H query heads, Hkv key/value heads, D head dim, Dv value head dim,
# N sequences, n/m one sequence's queries/keys, P pages of S tokens each


def varlen_attn(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    cu_seq_q: Tensor,
    cu_seq_k: Tensor | None,
    max_q: int,
    max_k: int,
    *,
    return_aux: Any = None,
    scale: float | None = None,
    window_size: tuple[int, int] = (-1, -1),
    enable_gqa: bool = False,
    seqused_k: Tensor | None = None,
    block_table: Tensor | None = None,
    num_splits: int | None = None,
    is_causal: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention within each of ``N`` packed sequences (see the module docstring).

    Args:
        query: ``(Tq, H, D)``.
        key, value: ``(Tk, Hkv, D)`` and ``(Tk, Hkv, Dv)``; with ``block_table``, a pool of pages ``(P, S, Hkv, D)``
            and ``(P, S, Hkv, Dv)``.
        cu_seq_q: ``(N + 1,)`` integers from 0, never decreasing, ending at ``Tq``.
        cu_seq_k: ``(N + 1,)`` likewise, ending at ``Tk``; with ``block_table``, ``None`` or any such tensor of
            ``N + 1`` entries (the pages and ``seqused_k`` say where each sequence's keys are).
        max_q, max_k: at least the longest sequence's queries and keys (flash-attention sizes its grid by them).
        return_aux: ``torch.nn.attention.varlen.AuxRequest(lse=True)``: also return each query's log-sum-exp,
            ``(H, Tq)`` float32 (float64 for float64 inputs).
        scale: ``1 / sqrt(D)`` when ``None``.
        window_size: ``(left, right)``, ``-1`` for no bound: ``(-1, 0)`` causal, ``(W, 0)`` a causal window of
            ``W + 1`` keys.
        enable_gqa: let ``H`` be a multiple of ``Hkv``.
        seqused_k: ``(N,)``: sequence ``i`` uses its first ``seqused_k[i]`` keys.
        block_table: ``(N, pages)`` integer page numbers: sequence ``i``'s keys are pages ``block_table[i, 0]``,
            ``block_table[i, 1]``, ... of the pool, its first ``seqused_k[i]`` tokens (needs ``seqused_k``).
        num_splits: split-KV on the GPU; accepted, changes nothing here.
        is_causal: the same as ``window_size=(-1, 0)`` (torch 2.10's spelling).

    Returns:
        ``(Tq, H, Dv)``, or ``(output, lse)`` when ``return_aux.lse``.

    Raises:
        TypeError, ValueError: naming the argument and its values: ``cu_seq`` not from 0, decreasing, or not ending
            at ``T``; ``max_q``/``max_k`` below a sequence's length; ``seqused_k`` past a sequence's keys;
            ``block_table`` naming a page out of range or too few pages; heads that do not fit.

    Example:
        >>> import torch, attnkit
        >>> q = k = v = torch.randn(10, 2, 8, requires_grad=True)
        >>> cu = torch.tensor([0, 3, 10], dtype=torch.int32)
        >>> out = attnkit.varlen_attn(q, k, v, cu, cu, 7, 7, window_size=(-1, 0))
        >>> alone = attnkit.varlen_attn(q[3:], k[3:], v[3:], cu[1:] - 3, cu[1:] - 3, 7, 7, window_size=(-1, 0))
        >>> torch.equal(out[3:], alone)
        True
    """
    if isinstance(query, Tensor) and query.device.type != "cpu":
        from torch.nn.attention import varlen  # (imported here: it takes about 1.8 s, registering its ops)

        kwargs = {"return_aux": return_aux, "scale": scale, "window_size": window_size, "enable_gqa": enable_gqa}
        kwargs |= {"seqused_k": seqused_k, "block_table": block_table, "num_splits": num_splits}
        if is_causal:
            kwargs["window_size"] = (-1, 0)
        return varlen.varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, **kwargs)  # type: ignore[no-any-return]
    check_torch_heads({"query": query, "key": key, "value": value}, 1, 1, enable_gqa)
    left, right = _window(window_size, is_causal)
    paged = block_table is not None
    if paged and seqused_k is None:
        raise ValueError("block_table needs seqused_k: how many tokens of its pages each sequence uses")
    if query.dim() != 3:
        raise ValueError(f"query must be (Tq, H, D), got shape {tuple(query.shape)}")
    want = 4 if paged else 3
    for name, t in (("key", key), ("value", value)):
        if t.dim() != want:
            shape = "(P, S, Hkv, D) pages (block_table given)" if paged else "(Tk, Hkv, D)"
            raise ValueError(f"{name} must be {shape}, got shape {tuple(t.shape)}")
    H, Hkv = query.shape[1], key.shape[-2]
    check_torch_heads({}, H, Hkv, enable_gqa)
    if not query.is_floating_point() or key.dtype != query.dtype or value.dtype != query.dtype:
        raise TypeError(
            f"query, key and value must share one floating dtype, got {query.dtype}, {key.dtype}, {value.dtype}"
        )
    if key.shape[-1] != query.shape[-1]:
        raise ValueError(
            f"query and key must have the same head size D, got query {tuple(query.shape)} and key {tuple(key.shape)}"
        )
    if value.shape[:-1] != key.shape[:-1]:
        raise ValueError(
            f"key and value must agree but in their last dim, got {tuple(key.shape)} and {tuple(value.shape)}"
        )
    starts_q = _cumulative("cu_seq_q", cu_seq_q, query.shape[0])
    N = len(starts_q) - 1
    if paged:
        pages = _block_table(block_table, N)
        capacity = [len(p) * key.shape[1] for p in pages]
        if cu_seq_k is not None:
            _cumulative("cu_seq_k", cu_seq_k, None, count=N + 1)
    else:
        if cu_seq_k is None:
            raise ValueError("cu_seq_k is needed without a block_table")
        starts_k = _cumulative("cu_seq_k", cu_seq_k, key.shape[0], count=N + 1)
        capacity = [starts_k[i + 1] - starts_k[i] for i in range(N)]
    used = capacity if seqused_k is None else _seqused(seqused_k, capacity)
    if paged:
        _check_pages(pages, used, key.shape[1], key.shape[0])
    lengths_q = [starts_q[i + 1] - starts_q[i] for i in range(N)]
    for name, bound, lengths in (("max_q", max_q, lengths_q), ("max_k", max_k, used)):
        if not isinstance(bound, numbers.Integral) or isinstance(bound, bool):
            raise TypeError(f"{name} must be an int, got {describe(bound)}")
        if lengths and bound < max(lengths):
            raise ValueError(f"{name}={bound} is below the longest sequence's {max(lengths)}")
    if return_aux is not None and (isinstance(return_aux, bool) or not hasattr(return_aux, "lse")):
        raise TypeError(
            f"return_aux must be an AuxRequest (torch.nn.attention.varlen) or None, got {describe(return_aux)}"
        )
    want_lse = return_aux is not None and bool(return_aux.lse)
    if num_splits is not None and (not isinstance(num_splits, numbers.Integral) or num_splits < 0):
        raise ValueError(f"num_splits must be None or a whole number, got {num_splits!r}")

    qs = query.split(lengths_q, dim=0)  # N x (n, H, D): one split, whose backward writes each piece once
    if paged:
        ks = [_gather(key, p, m) for p, m in zip(pages, used, strict=True)]  # N x (m, Hkv, D)
        vs = [_gather(value, p, m) for p, m in zip(pages, used, strict=True)]  # N x (m, Hkv, Dv)
    else:
        ks = [t[:m] for t, m in zip(key.split(capacity, dim=0), used, strict=True)]  # N x (m, Hkv, D)
        vs = [t[:m] for t, m in zip(value.split(capacity, dim=0), used, strict=True)]  # N x (m, Hkv, Dv)
    outs, sums = [], []
    for q_, k_, v_ in zip(qs, ks, vs, strict=True):
        out, lse = _one(q_, k_, v_, left, right, scale, want_lse)  # (n, H, Dv), (H, n) | None
        outs.append(out)
        sums.append(lse)
    out = torch.cat(outs, dim=0) if outs else query.new_zeros((0, H, value.shape[-1]))  # (Tq, H, Dv)
    if not want_lse:
        return out
    dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    lse = torch.cat([s for s in sums if s is not None], dim=1) if sums else query.new_zeros((H, 0), dtype=dtype)
    return out, lse.to(dtype)  # (Tq, H, Dv), (H, Tq)


def _one(
    q: Tensor, k: Tensor, v: Tensor, left: int, right: int, scale: float | None, want_lse: bool
) -> tuple[Tensor, Tensor | None]:
    """One sequence: ``q (n, H, D)`` over ``k (m, Hkv, D)``, ``v (m, Hkv, Dv)``; its output ``(n, H, Dv)`` and lse
    ``(H, n)`` (``None`` unless asked)."""
    from attnkit.functional import Masks

    n, H = q.shape[0], q.shape[1]
    m = k.shape[0]
    if n == 0 or m == 0:  # no query, or no key: zeros, and no key to give a row a sum
        empty = torch.full((H, n), -float("inf"), dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
        return q.new_zeros((n, H, v.shape[-1])), empty if want_lse else None  # (n, H, Dv), (H, n)
    q4, k4, v4 = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # (1, H|Hkv, n|m, D|Dv)
    masks = Masks(**_mask(left, right))
    out, lse, _ = with_statistics(q4, k4, v4, masks, scale, lse=want_lse, max_scores=False)
    return out[0].transpose(0, 1), None if lse is None else lse[0]  # (n, H, Dv), (H, n)


def _mask(left: int, right: int) -> dict[str, Any]:
    """The masking arguments of a window ``(left, right)`` (aligned to the bottom right)."""
    if left < 0 and right < 0:
        return {}
    if right == 0:
        return {"is_causal": True} if left < 0 else {"mask_mod": mods.sliding_window(left + 1)}
    return {"mask_mod": _band(left, right)}


@dataclasses.dataclass(frozen=True, eq=False)
class _band(mods.MaskMod):  # noqa: N801 - a function-like name, as the built-ins
    """Keys ``left`` before and ``right`` after query ``t``'s key position ``p = t + offset`` (``-1``: no bound on
    that side), aligned to the bottom right as the built-ins are (``offset = Lk - Lq``, set when bound to a call);
    knows its blocks from their index ranges, so the tile engine skips the hidden ones."""

    left: int
    right: int
    offset: int = 0

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        d = kv_idx - (q_idx + self.offset)  # (1, 1, n, m): key minus the query's position
        seen = d <= self.right if self.right >= 0 else torch.ones_like(d, dtype=torch.bool)
        return seen & (d >= -self.left) if self.left >= 0 else seen

    def tiles(self, rows: Tensor, cols: Tensor) -> mods.Tiles:
        p0, p1 = rows[:, 0, None] + self.offset, rows[:, 1, None] - 1 + self.offset  # (nq, 1) first, last position
        j0, j1 = cols[None, :, 0], cols[None, :, 1] - 1  # (1, nk) first, last key
        low, high = j0 - p1, j1 - p0  # (nq, nk) the smallest and largest key minus position in the block
        always = torch.ones_like(low, dtype=torch.bool)
        some = (high >= -self.left if self.left >= 0 else always) & (low <= self.right if self.right >= 0 else always)
        every = (low >= -self.left if self.left >= 0 else always) & (high <= self.right if self.right >= 0 else always)
        return mods.Tiles(some=some, every=every)

    def depends_on(self, batch: int, heads: int) -> tuple[int, int]:
        return 1, 1


def _window(window_size: Any, is_causal: Any) -> tuple[int, int]:
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be True or False, got {is_causal!r}")
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be (left, right), got {window_size!r}") from None
    for name, value in (("left", left), ("right", right)):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < -1:
            raise ValueError(f"window_size's {name} must be a whole number or -1 (no bound), got {window_size!r}")
    if is_causal:
        if (left, right) not in ((-1, -1), (-1, 0)):
            raise ValueError(f"is_causal=True with window_size={tuple(window_size)}: give one or the other")
        return -1, 0
    return int(left), int(right)


def _cumulative(name: str, cu: Any, total: int | None, count: int | None = None) -> list[int]:
    """``cu`` as a list of starts: 1-dim integers from 0, never decreasing, ending at ``total`` (when given)."""
    if not isinstance(cu, Tensor) or cu.is_floating_point() or cu.is_complex() or cu.dtype == torch.bool:
        raise TypeError(f"{name} must be an integer tensor, got {describe(cu)}")
    if cu.dim() != 1 or len(cu) < 1:
        raise ValueError(f"{name} must be (N + 1,) cumulative lengths, got shape {tuple(cu.shape)}")
    if count is not None and len(cu) != count:
        raise ValueError(f"{name} has {len(cu)} entries, cu_seq_q {count}: one more than the sequences, each")
    starts = [int(x) for x in cu.tolist()]
    if starts[0] != 0:
        raise ValueError(f"{name} must start at 0, got {starts[:4]}")
    drops = [i for i in range(len(starts) - 1) if starts[i + 1] < starts[i]]
    if drops:
        i = drops[0]
        raise ValueError(f"{name} must never decrease, got {starts[i]} then {starts[i + 1]} at entries {i}, {i + 1}")
    if total is not None and starts[-1] != total:
        raise ValueError(f"{name} must end at the {total} packed tokens, got {starts[-1]}")
    return starts


def _seqused(seqused_k: Any, capacity: list[int]) -> list[int]:
    if not isinstance(seqused_k, Tensor) or seqused_k.is_floating_point() or seqused_k.dtype == torch.bool:
        raise TypeError(f"seqused_k must be an integer tensor, got {describe(seqused_k)}")
    if seqused_k.shape != (len(capacity),):
        raise ValueError(f"seqused_k must be ({len(capacity)},), one per sequence, got shape {tuple(seqused_k.shape)}")
    used = [int(x) for x in seqused_k.tolist()]
    for i, (u, c) in enumerate(zip(used, capacity, strict=True)):
        if not 0 <= u <= c:
            raise ValueError(f"seqused_k[{i}]={u} is outside [0, {c}], the keys sequence {i} has")
    return used


def _block_table(block_table: Any, N: int) -> list[list[int]]:
    """Each sequence's pages, as lists."""
    if not isinstance(block_table, Tensor) or block_table.is_floating_point() or block_table.dtype == torch.bool:
        raise TypeError(f"block_table must be an integer tensor, got {describe(block_table)}")
    if block_table.dim() != 2 or block_table.shape[0] != N:
        raise ValueError(f"block_table must be ({N}, pages), a row per sequence, got shape {tuple(block_table.shape)}")
    return block_table.tolist()  # type: ignore[no-any-return]


def _check_pages(pages: list[list[int]], used: list[int], size: int, pool: int) -> None:
    """The pages each sequence reads (its first ``ceil(used / size)``; the rest of its row is not read) are in the
    pool."""
    for i, (row, u) in enumerate(zip(pages, used, strict=True)):
        bad = [p for p in row[: -(-u // size)] if not 0 <= p < pool]
        if bad:
            raise ValueError(f"block_table[{i}] names pages {bad[:4]} outside the pool's [0, {pool})")


def _gather(pool: Tensor, pages: list[int], used: int) -> Tensor:
    """A sequence's first ``used`` tokens from its ``pages`` of ``pool (P, S, Hkv, D)``: ``(used, Hkv, D)``."""
    S = pool.shape[1]
    needed = -(-used // S)
    index = torch.tensor(pages[:needed], dtype=torch.long, device=pool.device)
    return pool.index_select(0, index).flatten(0, 1)[:used]  # (used, Hkv, D)
