"""Attention backends, one contract (:mod:`attnkit.backends.contract`), six engines:

* ``reference``: the specification, the reference's math written plainly; the only one that returns weights;
* ``sdpa``: PyTorch's fused kernels (``scaled_dot_product_attention``; a padded batch one call per run of lengths);
* ``decode``: a decode step, a few queries over a cache's keys, as two matrix products;
* ``tiles``: attnkit's tile engine over a call's plan (:mod:`attnkit.backends.tiles`): its C++ kernel, FlexAttention
  on CUDA, or the online softmax in torch ops, eager or compiled;
* ``graph``: what runs while ``torch.compile`` traces: the reference's math with no value read on the host;
* ``triton``: additive attention as Triton kernels (CUDA).

Each backend module defines ``NAME``, ``SUPPORTS`` (a :class:`~attnkit.backends.contract.Supports`: what it can run,
as data) and ``attention(call: Call) -> (output, weights or None)``; the tile engine defines ``IMPLEMENTATIONS``
instead, each such a module. The choice between them is made in :mod:`attnkit.dispatch` only.
"""

from attnkit.backends import decode, graph, reference, sdpa, tiles, triton
from attnkit.backends.contract import Call, Supports

ALL = (reference, sdpa, decode, tiles, graph, triton)

__all__ = ["ALL", "Call", "Supports", "decode", "graph", "reference", "sdpa", "tiles", "triton"]
