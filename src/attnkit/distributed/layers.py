"""RingMultiHeadAttention: multi-head attention whose projections run on this rank's shard of the sequence and
whose attention runs over the ring (:func:`attnkit.distributed.ring_attention`)."""

from __future__ import annotations

import zlib
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor, nn

from attnkit.distributed import comm
from attnkit.distributed.agree import Request, agree
from attnkit.distributed.ring import RingAttention
from attnkit.distributed.sequence import check_layout
from attnkit.functional import Masks
from attnkit.layers import MultiHeadAttention
from attnkit.recording import StatsRecord, recorder

__all__ = ["RingMultiHeadAttention", "sum_gradients"]

# B batch, H heads, Hkv key/value heads, L_r positions of this rank, d head dim


class RingMultiHeadAttention(MultiHeadAttention):
    """:class:`attnkit.MultiHeadAttention` over a sequence split across the ranks of a process group.

    Every rank holds the same parameters (the names of :class:`~attnkit.MultiHeadAttention`, so its
    ``state_dict`` loads unchanged) and calls the module with its shard ``(B, L_r, features)`` of the
    sequence, cut by :func:`~attnkit.distributed.shard_sequence` with ``dim=1`` and the same ``layout``. The
    projections are local; the attention is :func:`~attnkit.distributed.ring_attention`.

    Args:
        num_hiddens, num_heads, query_size, key_size, value_size, num_kv_heads, bias: as
            :class:`~attnkit.MultiHeadAttention`.
        dropout: must be 0: the ring has no dropout on the weights.
        group: a ``torch.distributed`` process group; the default group when ``None``.
        layout: ``"contiguous"`` or ``"zigzag"`` (balanced work with ``is_causal``).
        timeout: seconds (or a ``timedelta``) any one wait for another rank may take.

    Masks: ``valid_lens`` ``(B,)`` in global positions, ``is_causal`` and a ``mask_mod`` (in global positions, the
    same on every rank: ``document(ids)`` takes the whole sequence's ids; a sliding window or documents let the
    ring skip the steps they hide). ``attn_mask``, ``score_mod`` and sinks are refused, and so is
    :func:`attnkit.record_weights` (the weights span the whole sequence, which no rank holds).

    Training: start every rank from the same parameters (one seed, or a broadcast), and after ``backward()``
    call :func:`sum_gradients`: each rank's parameter gradients cover its own positions only.

    Example:
        On each rank: ``RingMultiHeadAttention(64, 4, layout="zigzag")(x_r, x_r, x_r, is_causal=True)``
        with ``x_r = shard_sequence(x, layout="zigzag", dim=1)``; then ``loss.backward()``,
        ``sum_gradients(model)``, ``optimizer.step()``.
    """

    def __init__(
        self,
        num_hiddens: int,
        num_heads: int,
        dropout: float = 0.0,
        *,
        query_size: int | None = None,
        key_size: int | None = None,
        value_size: int | None = None,
        num_kv_heads: int | None = None,
        bias: bool = False,
        group: object | None = None,
        layout: str = "contiguous",
        timeout: float | timedelta | None = None,
    ) -> None:
        if dropout != 0:
            raise ValueError(f"RingMultiHeadAttention has no dropout on the weights, got dropout={dropout}")
        check_layout(layout)
        super().__init__(
            num_hiddens,
            num_heads,
            query_size=query_size,
            key_size=key_size,
            value_size=value_size,
            num_kv_heads=num_kv_heads,
            bias=bias,
        )
        self.group, self.layout, self.timeout = group, layout, timeout

    def _attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        masks: Masks,
        zeros_past: Tensor | None,
        need_lse: bool = False,
        lengths_made: bool = False,
    ) -> tuple[Tensor, None]:
        refused = None  # refused after the ranks agree, so that a rank alone in its mistake stops the others too
        if masks.attn_mask is not None:
            refused = (
                "RingMultiHeadAttention takes valid_lens (B,) and is_causal, not attn_mask "
                f"(got attn_mask of shape {tuple(masks.attn_mask.shape)})"
            )
        elif masks.score_mod is not None:
            refused = "RingMultiHeadAttention takes valid_lens, is_causal and mask_mod, not a score_mod"
        elif (recorded := recorder(self)) is not None:
            kind = "record_stats" if isinstance(recorded[0], StatsRecord) else "record_weights"
            refused = (
                f"{kind} cannot record {recorded[1] or 'the model'!r}: the weights of "
                "RingMultiHeadAttention span the whole sequence, which no rank holds"
            )
        elif self._dropout_p() > 0:
            refused = f"RingMultiHeadAttention has no dropout on the weights, got dropout={self.dropout}"
        ring = comm.Ring(self.group)
        request = Request(q, k, v, masks.valid_lens, masks.is_causal, None, self.layout, masks.mask_mod)
        plan = agree(ring, request, self.timeout, refused=refused)
        return RingAttention.apply(q, k, v, plan), None  # (B, H, L_r, d); no recording, so no lse


def sum_gradients(module: nn.Module, *, group: object | None = None, timeout: float | timedelta | None = None) -> None:
    """Sum the parameter gradients of ``module`` over the ranks of ``group``, in place.

    With the sequence split across ranks, each rank's backward pass gives the gradient of its own positions'
    share of the loss; the gradient of the whole sequence is their sum. Call this after ``backward()`` and
    before the optimizer step, so that every rank takes the same step and the parameters stay equal.

    Args:
        module: every parameter with a ``.grad`` takes part; the ranks must agree on which those are.
        group: a ``torch.distributed`` process group; the default group when ``None``.
        timeout: seconds (or a ``timedelta``) to wait for the other ranks.

    Raises:
        ValueError: on every rank, when the ranks' gradients differ in number, sizes or dtypes.
        RingError: a rank failed or did not answer within ``timeout``.

    Example:
        ``loss.backward(); sum_gradients(model); optimizer.step()`` on every rank.
    """
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    rank, _ = comm.rank_and_size(group)
    wait = comm.as_timeout(timeout)
    digest = zlib.crc32(repr([(tuple(g.shape), str(g.dtype)) for g in grads]).encode())  # the same in every process
    device = grads[0].device if grads else torch.device("cpu")
    rows = comm.gather_checked(
        [len(grads), digest], None, size=2, who="sum_gradients", group=group, timeout=wait, device=device
    )
    for r, row in enumerate(rows):
        if row != rows[rank]:
            raise ValueError(
                f"sum_gradients: rank {r} and rank {rank} hold different gradients: rank {r} has {row[0]} "
                f"parameters with gradients, rank {rank} has {len(grads)} (or their shapes or dtypes differ)"
            )
    step = "sum_gradients: all-reduce of the parameter gradients"
    with comm.named_failures(step, wait):
        works = [dist.all_reduce(g, group=group, async_op=True) for g in grads]  # type: ignore[arg-type]
    comm.wait(works, wait, step)
