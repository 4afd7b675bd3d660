"""RingMultiHeadAttention: multi-head attention whose projections run on this rank's shard of the sequence and
whose attention runs over the ring (:func:`attnkit.distributed.ring_attention`)."""

from __future__ import annotations

from datetime import timedelta

from torch import Tensor

from attnkit.distributed.ring import ring_attention
from attnkit.distributed.sequence import check_layout
from attnkit.layers import Masks, MultiHeadAttention

__all__ = ["RingMultiHeadAttention"]

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

    Masks: ``valid_lens`` ``(B,)`` in global positions and ``is_causal``; ``attn_mask`` is refused, and so is
    :func:`attnkit.record_weights` (the weights span the whole sequence, which no rank holds).

    Example:
        On each rank: ``RingMultiHeadAttention(64, 4, layout="zigzag")(x_r, x_r, x_r, is_causal=True)``
        with ``x_r = shard_sequence(x, layout="zigzag", dim=1)``.
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

    def _attend(self, q: Tensor, k: Tensor, v: Tensor, masks: Masks) -> Tensor:
        if masks.attn_mask is not None:
            raise ValueError(
                "RingMultiHeadAttention takes valid_lens (B,) and is_causal, not attn_mask "
                f"(got attn_mask of shape {tuple(masks.attn_mask.shape)})"
            )
        if self._recorder is not None:
            raise ValueError(
                f"record_weights cannot record {self._recorder[1] or 'the model'!r}: the weights of "
                "RingMultiHeadAttention span the whole sequence, which no rank holds"
            )
        return ring_attention(
            q,
            k,
            v,
            group=self.group,
            valid_lens=masks.valid_lens,
            is_causal=masks.is_causal,
            layout=self.layout,
            timeout=self.timeout,
        )  # (B, H, L_r, d)
