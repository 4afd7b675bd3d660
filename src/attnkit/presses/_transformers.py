"""A press on transformers' cache (imported only when a press meets one): which layers it compresses, and the
compressed layer, which decoding then appends to in place.

transformers' ``DynamicLayer`` concatenates its whole cache anew at every decoding step (``torch.cat``, checked
against 5.23): at 8,192 positions that copy costs more than the attention that reads the cache. A compressed layer
keeps its keys and values at the front of a buffer with room to grow (doubling when full, as attnkit's KVCache),
and a step writes its pair into that room: ``benchmarks/presses.py --speed`` measures a decode step both ways."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from transformers.cache_utils import DynamicLayer

__all__ = ["Compressed", "compressible", "keep"]

# B batch, Hkv key/value heads, n positions held, D head dim, C capacity


class Compressed(DynamicLayer):
    """transformers' ``DynamicLayer`` (every method of it, same attributes) whose ``keys`` and ``values`` are the
    front of ``room_keys`` / ``room_values (B, Hkv, C, D)``. Under ``torch.no_grad()`` a step's new pair is written
    into the room; with gradients, or after something replaced ``keys`` (``reorder_cache``, a press), it goes as
    ``DynamicLayer`` goes (the room is made again at the next step without gradients)."""

    room_keys: Tensor | None = None
    room_values: Tensor | None = None

    def hold(self, keys: Tensor, values: Tensor, room: int) -> None:
        """Hold ``keys (B, Hkv, n, D)`` and ``values``, copied into new buffers with ``room`` more positions."""
        B, Hkv, n, D = keys.shape
        self.room_keys = keys.new_empty(B, Hkv, n + room, D)  # (B, Hkv, C, D)
        self.room_values = values.new_empty(B, Hkv, n + room, values.shape[-1])  # (B, Hkv, C, Dv)
        self.room_keys[:, :, :n] = keys
        self.room_values[:, :, :n] = values
        self.keys, self.values = self.room_keys[:, :, :n], self.room_values[:, :, :n]  # (B, Hkv, n, D|Dv)

    def _fronts(self) -> bool:
        """Whether ``keys`` and ``values`` are still the front of the buffers (a crop keeps them so)."""
        room_k, room_v, k, v = self.room_keys, self.room_values, self.keys, self.values
        if room_k is None or room_v is None or k is None or v is None:
            return False
        return all(
            x.data_ptr() == room.data_ptr() and x.stride() == room.stride() and x.shape[:2] == room.shape[:2]
            for x, room in ((k, room_k), (v, room_v))
        )

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        if torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad):
            self.room_keys = self.room_values = None
            return super().update(key_states, value_states, *args, **kwargs)
        keys, values = self.keys, self.values
        assert keys is not None and values is not None  # (a press made this layer from a filled one)
        n, new = keys.shape[-2], key_states.shape[-2]
        if not self._fronts() or self.room_keys is None or n + new > self.room_keys.shape[-2]:
            self.hold(keys, values, max(n, 16) + new)  # doubling: a step copies nothing, amortised
        room_k, room_v = self.room_keys, self.room_values
        assert room_k is not None and room_v is not None
        room_k[:, :, n : n + new] = key_states  # (B, Hkv, new, D) into (B, Hkv, C, D)
        room_v[:, :, n : n + new] = value_states
        self.keys, self.values = room_k[:, :, : n + new], room_v[:, :, : n + new]  # (B, Hkv, n + new, D|Dv)
        return self.keys, self.values


def compressible(layer: object) -> bool:
    """transformers' plain ``DynamicLayer`` (not a sliding or quantized one, which keep their own rules), or one
    a press compressed."""
    return type(layer) in (DynamicLayer, Compressed)


def keep(layer: Any, kept: Tensor) -> None:
    """Keep positions ``kept (B, Hkv, n)`` of each row and key/value head of ``layer``, which becomes a
    :class:`Compressed` layer (its class changed in place: the cache holds the same object)."""
    index = kept[..., None]  # (B, Hkv, n, 1)
    keys = layer.keys.gather(2, index.expand(-1, -1, -1, layer.keys.shape[-1]))  # (B, Hkv, n, D)
    values = layer.values.gather(2, index.expand(-1, -1, -1, layer.values.shape[-1]))  # (B, Hkv, n, Dv)
    if type(layer) is DynamicLayer:
        layer.__class__ = Compressed
    layer.hold(keys, values, max(16, kept.shape[-1] // 8))
