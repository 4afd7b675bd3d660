"""``context_parallel``: PyTorch's context-parallel entry point, for attnkit's attention, on any device gloo reaches.

PyTorch's own ``torch.distributed.tensor.experimental.context_parallel`` swaps SDPA for its ring and shards the
buffers, but fails on CPU (torch 2.13: ``aten._scaled_dot_product_flash_attention_for_cpu ... does not have a
sharding strategy registered``). This one has its signature and meaning; inside it, every attnkit attention call
of this thread (the functions, the layers, ``attnkit.d2l`` and Hugging Face models with attnkit registered) runs
as :func:`~attnkit.distributed.ring_attention` over the mesh's process group::

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    fully_shard(model, mesh=mesh["dp", "cp"]._flatten("dp_cp"))   # FSDP2 over every rank
    with context_parallel(mesh["cp"], buffers=[tokens, labels], buffer_seq_dims=[1, 1]):
        loss = loss_fn(model(tokens), labels)                      # tokens, labels: this rank's shard
        loss.backward()                                            # inside the block too

The buffers are cut in place (each made to point at its shard: a view's base is not touched) in the zig-zag
layout (PyTorch's default head-tail balancing, which evens causal work; :mod:`attnkit.distributed.sequence`) and
put back on exit. Masks are given in whole-sequence positions, as on one
process: ``is_causal``, ``valid_lens (B,)``, a ``mask_mod`` (sliding windows, ``document(ids)`` with the whole
sequence's ids) and a ``score_mod`` (softcap, ALiBi, a function of the caller's: positions in the whole sequence;
one that reads tensors needing a gradient is refused). What a shard cannot say (a dense ``attn_mask`` of shard
positions, sinks, additive scoring, dropout on the weights, a KV cache, recorded weights) is refused, on every
rank at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from attnkit import _context_parallel, dispatch
from attnkit._validate import describe
from attnkit.distributed import comm
from attnkit.distributed.agree import Request, agree
from attnkit.distributed.ring import RingAttention
from attnkit.distributed.sequence import gather_sequence, segments, shard_sequence
from attnkit.functional import AttendResult, Masks
from attnkit.recording import is_recording

__all__ = ["LAYOUT", "context_parallel"]

# B batch, H heads, Hkv key/value heads, L_r positions of this rank, D head dim, Dv value head dim

LAYOUT = "zigzag"  # how the buffers are cut: balanced causal work, as PyTorch's head-tail load balancer


@contextlib.contextmanager
def context_parallel(
    mesh: Any,
    *,
    buffers: Sequence[Tensor] | None = None,
    buffer_seq_dims: Sequence[int] | None = None,
    no_restore_buffers: set[Tensor] | None = None,
    timeout: float | timedelta | None = None,
) -> Iterator[None]:
    """Shard ``buffers`` along their sequence dims and run every attnkit attention call inside as ring attention.

    Every rank of the mesh enters the block at the same time, with the same whole-sequence buffers.

    Args:
        mesh: a one-dimensional ``DeviceMesh`` (the context-parallel dimension of a larger one, ``mesh["cp"]``), or
            a ``torch.distributed`` process group.
        buffers: tensors that hold the whole sequence (tokens, labels, position ids): each is cut to this rank's
            shard in place (its shape changes inside the block) and restored on exit. Not parameters, and each once.
        buffer_seq_dims: the sequence dim of each buffer; every buffer has the same length along it.
        no_restore_buffers: buffers (of ``buffers``) left as shards on exit, to save the copy back.
        timeout: seconds (or a ``timedelta``) any one wait for another rank may take (5 minutes by default).

    Raises:
        ValueError, TypeError: arguments that do not fit together (named, with their values), on every rank at
            once (a rank's own mistake there, ``rank r rejected its inputs`` on the others); ranks whose buffers
            differ in length or number; fewer positions than ranks; a mesh of more than one dimension, or a
            ``context_parallel`` block already open in this thread (these two raised where they are found).

    Inside, an attention call's ``q``, ``k`` and ``v`` are this rank's shards ``(B, H, L_r, D)`` of the same
    positions; masks speak of whole-sequence positions (see the module docstring); ``backward`` must run inside
    the block too, in the same thread (it runs the same ring). The scope is this thread's: activation
    checkpointing that recomputes in another thread or after the block (reentrant checkpointing) would recompute
    attention on the shard alone, so it is not supported here. The buffers are not compared across ranks: give
    every rank the same ones. A rank that fails, dies or stays silent is a
    :class:`~attnkit.distributed.RingError` on the others, naming the step.

    Example:
        On each of 2 ranks, ``tokens`` ``(B, L)`` the same on both::

            with context_parallel(mesh, buffers=[tokens], buffer_seq_dims=[1]):
                tokens.shape  # (B, L / 2)
                out = mha(embed(tokens), ..., is_causal=True)  # this rank's positions of the exact output
    """
    group = _group(mesh)
    if _context_parallel.active() is not None:
        raise ValueError("context_parallel: a context_parallel block is already open in this thread; they do not nest")
    buffers, dims, wait = _agree_on_entry(group, buffers, buffer_seq_dims, no_restore_buffers, timeout)
    keep = no_restore_buffers or set()
    # Each buffer is pointed at its shard's own memory (set_), and back at its own on exit: a view's base and any
    # tensor sharing its memory stay as they were, and nothing is copied back.
    originals = [
        None if any(b is k for k in keep) else (b.untyped_storage(), b.storage_offset(), b.size(), b.stride())
        for b in buffers
    ]
    with torch.no_grad():
        shards = [shard_sequence(b, layout=LAYOUT, dim=d, group=group) for b, d in zip(buffers, dims, strict=True)]
    try:
        with torch.no_grad():
            for b, shard in zip(buffers, shards, strict=True):
                b.set_(shard.untyped_storage(), shard.storage_offset(), shard.size(), shard.stride())
        with _context_parallel.opened(_Ring(group, wait)):
            yield
    finally:
        with torch.no_grad():
            for b, original in zip(buffers, originals, strict=True):
                if original is not None:
                    b.set_(*original)


class _Ring:
    """The runner of a ``context_parallel`` block (:class:`attnkit._context_parallel.Runner`): one ring, its timeout."""

    def __init__(self, group: object | None, timeout: timedelta) -> None:
        self.group, self.timeout = group, timeout
        self.ring = comm.Ring(group)

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, masks: Masks, *, refused: str | None = None, **options: Any
    ) -> AttendResult:
        """``refused``: the caller's own reason to refuse the call (said on every rank, as this one's)."""
        refused = refused or _refusal(q, k, masks, **options)
        three_d = all(isinstance(t, Tensor) and t.dim() == 3 for t in (q, k, v))
        if three_d:
            q, k, v = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)  # (B, 1, L_r, D)
        request = Request(
            q, k, v, masks.valid_lens, masks.is_causal, options["scale"], LAYOUT, masks.mask_mod, masks.score_mod
        )
        plan = agree(self.ring, request, self.timeout, refused=refused)
        dispatch.ran_elsewhere("ring")
        out = RingAttention.apply(q, k, v, plan)  # (B, H, L_r, Dv)
        return AttendResult(out.squeeze(1) if three_d else out, None, None)  # (B, [H,] L_r, Dv)

    def refuse(self, what: str) -> None:
        raise ValueError(f"{what} inside context_parallel: {_WHOLE}")

    def whole(self, x: Tensor, dim: int) -> Tensor:
        """Every rank's shard of ``x`` put together in sequence order (the same tensor on every rank)."""
        return gather_sequence(x, layout=LAYOUT, dim=dim, group=self.group, timeout=self.timeout)


_WHOLE = "the weights span the whole sequence, which no rank holds"


def _refusal(
    q: Tensor,
    k: Tensor,
    masks: Masks,
    *,
    w_v: Tensor | None,
    scale: float | None,
    sinks: Tensor | None,
    dropout_p: float,
    need_weights: bool,
    backend: str,
    zeros_past: Tensor | None,
    need_lse: bool,
    lengths_made: bool = False,
) -> str | None:
    """Why this rank cannot run the call as ring attention, or ``None``: said through :func:`agree`, so that
    every rank raises it at once."""
    where = "inside context_parallel"
    if not isinstance(dropout_p, (int, float)) or isinstance(dropout_p, bool) or not 0 <= dropout_p < 1:
        return f"dropout_p must be a number in [0, 1), got {dropout_p!r}"
    if all(isinstance(t, Tensor) for t in (q, k)) and q.shape[-2] != k.shape[-2]:
        # keys not cut with the queries (an encoder's memory, whole on every rank) would be read as pieces of one
        # sequence W times as long: self-attention over the cut sequence only
        return (
            f"{where} queries and keys must be the same cut sequence, got {q.shape[-2]} query and {k.shape[-2]} key "
            "positions on this rank (cross-attention to keys that are not cut is not supported)"
        )
    if isinstance(masks.valid_lens, Tensor) and masks.valid_lens.dim() == 2:
        # (the book's per-query lengths; attnkit.d2l's MultiHeadAttention has folded the heads into their rows)
        return (
            f"valid_lens of one length per query (a 2-D tensor, here of shape {tuple(masks.valid_lens.shape)}) "
            f"cannot be given {where}: they would be of one shard's queries; give each row's length, valid_lens "
            "(B,), in whole-sequence positions, with is_causal for the decoder's triangle"
        )
    if w_v is not None:
        return f"additive attention cannot run {where}: ring attention scores by dot product"
    if masks.attn_mask is not None:
        return (
            f"attn_mask cannot be given {where} (got a tensor of shape {tuple(masks.attn_mask.shape)}): a mask of "
            "one shard's positions cannot say which whole-sequence positions meet; use is_causal, valid_lens (B,) "
            "and a mask_mod, in whole-sequence positions"
        )
    if masks.plan is not None:
        return (
            f"plan cannot be given {where}: ring attention plans its own steps; pass the plan's mask_mod and "
            "is_causal, in whole-sequence positions, instead"
        )
    if sinks is not None:
        return f"attention sinks cannot run {where}"
    if dropout_p > 0:
        return f"dropout on the weights cannot run {where}, got dropout_p={dropout_p} (put the model in eval mode)"
    if need_weights or need_lse or is_recording():
        return f"weights cannot be returned or recorded {where}: {_WHOLE}"
    if zeros_past is not None:
        return f"a KV cache cannot be used {where}"
    if backend != "auto":
        return f"backend={backend!r} cannot run {where}: every call runs as ring attention (use backend='auto')"
    return None


def _group(mesh: Any) -> Any:
    """The process group of a one-dimensional mesh (or the group itself)."""
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(mesh, DeviceMesh):
        if mesh.ndim != 1:
            names = mesh.mesh_dim_names
            raise ValueError(
                f"context_parallel takes a one-dimensional mesh, got {mesh.ndim} dims"
                + (f" {names}: pass its context-parallel dim, mesh[{names[-1]!r}]" if names else "")
            )
        return mesh.get_group()
    if isinstance(mesh, dist.ProcessGroup):
        return mesh
    raise TypeError(f"context_parallel takes a DeviceMesh or a ProcessGroup, got {describe(mesh)}")


def _agree_on_entry(
    group: Any, given: Any, given_dims: Any, keep: Any, timeout: float | timedelta | None
) -> tuple[list[Tensor], list[int], timedelta]:
    """Check the arguments on every rank at once: a rank's own mistake raises there and, named, on the others (never
    a wait for a rank that left), and the ranks must agree on the sequence's length and the number of buffers.
    Returns the buffers and their dims, as lists, and the timeout."""
    error: Exception | None = None
    try:
        wait = comm.as_timeout(timeout)
    except Exception as e:  # noqa: BLE001 - every rank must hear of it; gather_checked raises it here
        error, wait = e, comm.as_timeout(None)
    buffers: list[Tensor] = []
    dims: list[int] = []
    length = 0
    try:
        buffers = _as_list(given, "buffers")
        dims = _as_list(given_dims, "buffer_seq_dims")
        if keep is not None and not isinstance(keep, (set, frozenset, list, tuple)):
            raise TypeError(f"no_restore_buffers must be a set of buffers, got {describe(keep)}")
        length = _check_buffers(buffers, dims, list(keep or ()))
        if buffers:
            segments(length, comm.rank_and_size(group)[1], LAYOUT)  # enough positions for every rank
    except Exception as e:  # noqa: BLE001 - as above
        error = error or e
    device = buffers[0].device if buffers and isinstance(buffers[0], Tensor) else torch.device("cpu")
    if dist.get_backend(group) == "nccl" and device.type != "cuda":  # its collectives take CUDA tensors only
        device = torch.device("cuda", torch.cuda.current_device())
    seen = comm.gather_checked(
        None if error else [length, len(buffers)],
        error,
        size=2,
        who="context_parallel",
        group=group,
        timeout=wait,
        device=device,
    )
    if any(other != seen[0] for other in seen):
        said = ", ".join(f"rank {r}: {n} buffers of {L} positions" for r, (L, n) in enumerate(seen))
        raise ValueError(f"context_parallel: every rank must pass the same whole-sequence buffers, got {said}")
    return buffers, dims, wait


def _as_list(given: Any, name: str) -> list:
    if given is None:
        return []
    if isinstance(given, (Tensor, str)) or not isinstance(given, Sequence):
        raise TypeError(f"{name} must be a list (one entry per buffer), got {describe(given)}")
    return list(given)


def _check_buffers(buffers: list[Tensor], dims: list[int], keep: list[Tensor]) -> int:
    """The sequence's length (0 without buffers), after checking that the buffers and their dims fit together."""
    if len(buffers) != len(dims):
        raise ValueError(
            f"buffer_seq_dims must give one dim per buffer: {len(buffers)} buffers, {len(dims)} dims {dims}"
        )
    length = None
    for i, (b, d) in enumerate(zip(buffers, dims, strict=True)):
        if not isinstance(b, Tensor):
            raise TypeError(f"buffers[{i}] must be a tensor, got {describe(b)}")
        if isinstance(b, nn.Parameter) or b.requires_grad:
            raise TypeError(
                f"buffers[{i}] ({describe(b)}) is a parameter or requires grad: only data is cut along the sequence"
            )
        if any(b is other for other in buffers[:i]):
            raise ValueError(f"buffers[{i}] is the same tensor as an earlier buffer: each is cut once")
        if not isinstance(d, int) or isinstance(d, bool) or not -b.dim() <= d < b.dim():
            raise ValueError(f"buffer_seq_dims[{i}] must be a dim of buffers[{i}] ({describe(b)}), got {d!r}")
        if length is None:
            length = b.shape[d]
        elif b.shape[d] != length:
            raise ValueError(
                f"every buffer must have the sequence's length along its dim: buffers[0] has {length} positions, "
                f"buffers[{i}] ({describe(b)}) has {b.shape[d]} along dim {d}"
            )
    for b in keep:
        if not any(b is other for other in buffers):
            raise ValueError(f"no_restore_buffers must be a subset of buffers, got one not in it: {describe(b)}")
    return length or 0
