"""Attention backends, one file each, one signature.

Every backend module defines::

    NAME: str
    def why_not(q, k, v, mask, *, w_v, scale, dropout_p, need_weights) -> list[str]   # [] = it can run this
    def attention(q, k, v, mask, *, w_v, scale, dropout_p, need_weights) -> tuple[Tensor, Tensor | None]

with ``q (B, H, Lq, D)``, ``k (B, Hkv, Lk, D)``, ``v (B, Hkv, Lk, Dv)`` already validated (``H % Hkv == 0``) and
with dead keys zeroed, ``mask`` an :class:`attnkit.masks.Mask`, ``w_v (D,)`` for additive scoring or ``None``
for dot-product scoring. ``attention`` returns the output ``(B, H, Lq, Dv)`` in ``q.dtype`` and the
pre-dropout weights ``(B, H, Lq, Lk)`` when ``need_weights`` (else ``None``). The choice between them is made
in :mod:`attnkit.dispatch` only.
"""

from attnkit.backends import chunked, reference, sdpa

ALL = (reference, sdpa, chunked)

__all__ = ["ALL", "chunked", "reference", "sdpa"]
