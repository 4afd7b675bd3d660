"""A press on transformers' cache (imported only when a press meets a transformers model): which layers it
compresses, the compressed layer, which decoding then appends to in place, and the slots AdaptiveBudget hides.

transformers' ``DynamicLayer`` concatenates its whole cache anew at every decoding step (``torch.cat``, checked
against 5.23): at 8,192 positions that copy costs more than the attention that reads the cache. A compressed layer
keeps its keys and values at the front of buffers with room to grow (doubling when full, as attnkit's KVCache),
and a step writes its pair into that room: ``benchmarks/presses.py --speed`` measures a decode step both ways."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn
from transformers.cache_utils import DynamicLayer

from attnkit.integrations.transformers import PRESS_HIDDEN

__all__ = ["Compressed", "compressible", "hiding", "keep", "show"]

# B batch, Hkv key/value heads, n positions held, D head dim, C capacity


class Compressed(DynamicLayer):
    """transformers' ``DynamicLayer`` (every method of it, same attributes) whose ``keys`` and ``values`` are the
    front of ``room_keys`` / ``room_values (B, Hkv, C, D)``, and ``hidden (B, Hkv, n)`` the slots an
    AdaptiveBudget hides (``None``: none). Under ``torch.no_grad()`` a step's new pair is written into the room,
    past every position a tensor it returned holds; with gradients, after something replaced or shortened ``keys``
    (``reorder_cache``, ``crop``, a press), or across inference mode, the buffers are made anew first (a copy, as
    ``DynamicLayer`` makes at every step), so no tensor handed out earlier is ever written into."""

    room_keys: Tensor | None = None
    room_values: Tensor | None = None
    held = 0  # positions written into the room so far: the returned views never reach past it
    room_owner: object = None  # the layer the room was made for (a shallow copy of this one makes its own)
    hidden: Tensor | None = None
    removed = 0  # tokens a press removed: the layer has seen `removed` more tokens than it holds
    pressed = 0  # the slots a press chose (the first ones): a crop may not reach into them
    reordered = False  # reorder_cache (beam search) moved its rows

    def hold(self, keys: Tensor, values: Tensor, room: int) -> None:
        """Hold ``keys (B, Hkv, n, D)`` and ``values``, copied into new buffers with ``room`` more positions."""
        B, Hkv, n, D = keys.shape
        self.room_keys = keys.new_empty(B, Hkv, n + room, D)  # (B, Hkv, C, D)
        self.room_values = values.new_empty(B, Hkv, n + room, values.shape[-1])  # (B, Hkv, C, Dv)
        self.room_keys[:, :, :n] = keys
        self.room_values[:, :, :n] = values
        self.keys, self.values = self.room_keys[:, :, :n], self.room_values[:, :, :n]  # (B, Hkv, n, D|Dv)
        self.held, self.room_owner = n, self

    def _appendable(self, new: int) -> bool:
        """Whether ``keys`` and ``values`` are still the whole written front of the buffers, with room for ``new``
        more, writable here (an inference tensor only in inference mode)."""
        room_k, room_v, k, v = self.room_keys, self.room_values, self.keys, self.values
        if room_k is None or room_v is None or k is None or v is None or self.room_owner is not self:
            return False
        if room_k.is_inference() and not torch.is_inference_mode_enabled():
            return False
        fronts = all(
            x.data_ptr() == room.data_ptr() and x.stride() == room.stride() and x.shape[2] == self.held
            for x, room in ((k, room_k), (v, room_v))
        )
        return fronts and self.held + new <= room_k.shape[2]

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        grads = torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad)
        if grads or not self.is_initialized or self.keys is None or self.values is None:
            self.room_keys = self.room_values = None  # (reset, or a graph to keep: transformers' own way)
            return super().update(key_states, value_states, *args, **kwargs)
        n, new = self.keys.shape[2], key_states.shape[2]
        if not self._appendable(new):
            self.hold(self.keys, self.values, max(n, 16) + new)  # doubling: a step copies nothing, amortised
        room_k, room_v = self.room_keys, self.room_values
        assert room_k is not None and room_v is not None
        room_k[:, :, n : n + new] = key_states  # (B, Hkv, new, D) into (B, Hkv, C, D)
        room_v[:, :, n : n + new] = value_states
        self.keys, self.values = room_k[:, :, : n + new], room_v[:, :, : n + new]  # (B, Hkv, n + new, D|Dv)
        self.held = n + new
        return self.keys, self.values

    # transformers counts a cache's length in tokens seen (the next position, which tokens of input_ids are new,
    # assisted decoding's crops): the tokens held and those removed. The mask of a later call is built over the keys
    # held, its key indices shifted by the tokens removed: a held key's index never passes its own position, and
    # those appended after the press stand at theirs, so a chunk of several tokens stays causal.

    def get_seq_length(self) -> int:
        held = super().get_seq_length()
        return held + self.removed if held or self.removed else 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return super().get_seq_length() + query_length, self.removed

    def reset(self) -> None:
        super().reset()
        self.removed, self.pressed, self.hidden, self.reordered = 0, 0, None, False

    def crop(self, tokens_to_remove: int) -> None:
        """As ``DynamicLayer.crop`` (the last tokens removed), refused where they reach into the positions a press
        chose: those are no longer the last tokens (assisted decoding and prompt lookup prefill their draft tokens
        with the prompt, then crop the rejected ones)."""
        held = super().get_seq_length()
        if tokens_to_remove < 0 and held + tokens_to_remove < self.pressed:
            raise ValueError(
                f"crop({tokens_to_remove}) would remove tokens from the {self.pressed} positions a press kept, which "
                "are not the last tokens: assisted decoding and prompt lookup (which prefill draft tokens) cannot "
                "run inside a press"
            )
        super().crop(tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self.reordered = True


def compressible(layer: object) -> bool:
    """transformers' plain ``DynamicLayer`` (not a sliding or quantized one, which keep their own rules), or one
    a press compressed."""
    return type(layer) in (DynamicLayer, Compressed)


def keep(layer: Any, kept: Tensor, hidden: Tensor | None = None) -> None:
    """Keep positions ``kept (B, Hkv, n)`` of each row and key/value head of ``layer``, which becomes a
    :class:`Compressed` layer (its class changed in place: the cache holds the same object); ``hidden
    (B, Hkv, n)``: the kept slots the attention hides while a press's block is open."""
    index = kept[..., None]  # (B, Hkv, n, 1)
    keys = layer.keys.gather(2, index.expand(-1, -1, -1, layer.keys.shape[-1]))  # (B, Hkv, n, D)
    values = layer.values.gather(2, index.expand(-1, -1, -1, layer.values.shape[-1]))  # (B, Hkv, n, Dv)
    seen = layer.get_seq_length()  # tokens seen, before
    if type(layer) is DynamicLayer:
        layer.__class__ = Compressed
    layer.hold(keys, values, max(16, kept.shape[-1] // 8))
    layer.hidden = hidden
    layer.removed, layer.pressed = seen - kept.shape[-1], kept.shape[-1]


@contextlib.contextmanager
def hiding() -> Iterator[None]:
    """A press's block: the slots its layers hide, set call by call (:func:`show`), gone when it ends."""
    token = PRESS_HIDDEN.set({})
    try:
        yield
    finally:
        PRESS_HIDDEN.reset(token)


def show(module: nn.Module, layer: Any) -> None:
    """Before a call of ``module`` over the cache layer ``layer`` (``None``: no cache): the slots the attention
    hides are that layer's own, if any (a new prefill, or a call without a cache, hides none)."""
    hidden = PRESS_HIDDEN.get()
    if hidden is None:
        return
    slots = getattr(layer, "hidden", None) if isinstance(layer, Compressed) and layer.keys is not None else None
    if slots is None or slots.shape[0] != layer.keys.shape[0]:  # (another batch: beam search reordered it)
        hidden.pop(id(module), None)
    else:
        hidden[id(module)] = slots
