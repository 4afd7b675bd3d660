"""Attention backends, one file each, one contract (:mod:`attnkit.backends.contract`).

Each backend module defines ``NAME``, ``SUPPORTS`` (a :class:`~attnkit.backends.contract.Supports`: what it can
run, as data) and ``attention(call: Call) -> (output, weights or None)``. The choice between them is made in
:mod:`attnkit.dispatch` only.
"""

from attnkit.backends import chunked, compiled, decode, flash, flex, graph, reference, sdpa, tiles, triton
from attnkit.backends.contract import Call, Supports

ALL = (reference, sdpa, chunked, tiles, flash, compiled, decode, flex, triton, graph)

__all__ = [
    "ALL",
    "Call",
    "Supports",
    "chunked",
    "compiled",
    "decode",
    "flash",
    "flex",
    "graph",
    "reference",
    "sdpa",
    "tiles",
    "triton",
]
