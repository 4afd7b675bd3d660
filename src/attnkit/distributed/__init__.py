"""Attention over a sequence split across processes: ring attention on ``torch.distributed``.

Not imported by ``import attnkit``::

    from attnkit.distributed import ring_attention, shard_sequence, gather_sequence

* :func:`ring_attention` ``(q, k, v, ...)``: each rank passes its shard ``(B, H, L_r, D)``, gets its shard of
  the exact output; differentiable, the backward pass runs the same ring. Masks: ``valid_lens``, ``is_causal``
  and a ``mask_mod`` (:mod:`attnkit.mods`) in whole-sequence positions; steps the masks hide are skipped.
* :func:`shard_sequence`, :func:`gather_sequence`: cut a sequence into the ranks' shards and put it back, in the
  ``"contiguous"`` or ``"zigzag"`` layout (:mod:`attnkit.distributed.sequence`).
* :class:`RingMultiHeadAttention`: the module form; :func:`sum_gradients` sums its parameter gradients over the
  ranks after ``backward()`` (each rank's cover its own positions only).
* :func:`context_parallel`: PyTorch's context-parallel block for attnkit: shards the buffers, and every attnkit
  attention call inside (layers, ``attnkit.d2l``, Hugging Face models with attnkit registered) runs as ring
  attention over the mesh; composes with FSDP2 and DDP (:mod:`attnkit.distributed.context`).
* :class:`RingError`: another rank failed, died or stayed silent past the timeout.

Inside, one concern a module: ``comm`` (messages and timeouts), ``sequence`` (who holds which positions),
``agree`` (the ranks check the call together before any block travels), ``plan`` (what each step may skip),
``ring`` (the ring math and its autograd), ``layers`` (the module form), ``context`` (the context-parallel
block).
"""

from attnkit.distributed.comm import DEFAULT_TIMEOUT, RingError
from attnkit.distributed.context import context_parallel
from attnkit.distributed.layers import RingMultiHeadAttention, sum_gradients
from attnkit.distributed.ring import ring_attention
from attnkit.distributed.sequence import LAYOUTS, gather_sequence, shard_sequence

__all__ = [
    "DEFAULT_TIMEOUT",
    "LAYOUTS",
    "RingError",
    "RingMultiHeadAttention",
    "context_parallel",
    "gather_sequence",
    "ring_attention",
    "shard_sequence",
    "sum_gradients",
]
