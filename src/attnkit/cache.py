"""Key/value caches for generation: project only the new positions, attend over everything cached.

One cache per attention layer, given to the layer's call::

    cache = attnkit.KVCache()                                           # sizes, dtype, device from the first call
    y = mha(prompt, prompt, prompt, prompt_lens, is_causal=True, cache=cache)   # prefill, right-padded prompts
    y = mha(x_new, x_new, x_new, is_causal=True, cache=cache)                  # then one token (or a few) a step

Each row of the batch keeps its own length: a prefill with ``valid_lens=(B,)`` stores row ``b``'s first
``valid_lens[b]`` positions, and every later call appends row ``b``'s new tokens at that row's own position (no
left padding, so no shifted position ids and no rows of NaN). Query ``i`` of a call stands at position
``length_b + i`` of its row and, with ``is_causal=True``, sees that row's keys up to itself.

Three kinds:

* growing (``KVCache()``): no size given; storage doubles when full (amortised: a step copies nothing);
* static (``KVCache(max_len=N)``): allocated once at ``N`` positions; every step has the same shapes, so a decode
  step compiled with ``torch.compile`` is not recompiled as the context grows;
* sliding (``KVCache(window=W)``): a ring buffer of the last ``W`` positions of each row; query ``p`` sees keys
  ``p - W < j <= p`` (Mistral's sliding window), for as long as the generation goes.

Grouped-query layers store only their ``num_kv_heads`` heads: :attr:`KVCache.nbytes` is
``2 * B * Hkv * capacity * D * itemsize``. :class:`CrossKVCache` keeps an encoder's projected keys and values (and
its ``valid_lens``) for cross-attention: projected once, reused every step.

Both hold keys and values as ``(B, Hkv, C, D)`` tensors, in the memory layout the decode backend reads fastest
(:func:`attnkit.backends.decode.storage`: on CPU, in float32 or float64, from a capacity of 4096 positions, each
head's features as rows of positions).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from attnkit._validate import as_lengths, describe
from attnkit._value_checks import checked, value_check
from attnkit.backends.decode import storage

__all__ = ["Attended", "CrossKVCache", "KVCache", "Positions"]

# B batch, Hkv key/value heads, D head dim, Lq new positions in this call, C capacity (positions stored), W window


# Where a call's queries ``(B, Lq)`` and keys ``(B, Lk)`` stand in their rows; ``None`` for the default of each.
Positions = tuple[Tensor | None, Tensor | None]


class Attended(NamedTuple):
    """What a call's queries attend over, as :meth:`KVCache.update` returns it (see there)."""

    keys: Tensor  # (B, Hkv, Lk, D)
    values: Tensor  # (B, Hkv, Lk, Dv)
    valid_lens: Tensor | None  # (B, Lq): the keys [0, n) each query sees
    attn_mask: Tensor | None  # (B, 1, Lq, Lk) bool: a sliding cache's mask, by position
    zeros_past: Tensor | None  # (B,): each row's keys and values are zeros from this position on
    # where the queries (B, Lq) and the keys (B, Lk) stand in their rows, each None where it is the default (keys at
    # their index, queries at Lk - Lq + i): for attention statistics (attnkit.stats), not for the mask
    positions: Positions = (None, None)


class KVCache:
    """The keys and values one attention layer has seen, row by row (see the module docstring).

    Args:
        max_len: a static cache of this many positions per row, allocated at the first call.
        window: a sliding cache that keeps the last ``window`` positions of each row.

    Raises:
        ValueError: both given, or a size that is not a positive whole number.

    Example:
        >>> import torch, attnkit
        >>> mha, cache = attnkit.MultiHeadAttention(16, 4).eval(), attnkit.KVCache()
        >>> x = torch.randn(2, 5, 16)
        >>> _ = mha(x, x, x, torch.tensor([5, 3]), is_causal=True, cache=cache)  # prompts of 5 and 3 tokens
        >>> y = mha(x[:, :1], x[:, :1], x[:, :1], is_causal=True, cache=cache)   # one more token each
        >>> cache.lengths.tolist(), y.shape
        ([6, 4], torch.Size([2, 1, 16]))
    """

    def __init__(self, max_len: int | None = None, *, window: int | None = None) -> None:
        if max_len is not None and window is not None:
            raise ValueError(f"give max_len (a static cache) or window (a sliding one), not both: {max_len}, {window}")
        for name, value in (("max_len", max_len), ("window", window)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive whole number, got {value!r}")
        self.max_len, self.window = max_len, window
        self.keys: Tensor | None = None  # (B, Hkv, C, D), as storage()
        self.values: Tensor | None = None  # (B, Hkv, C, Dv), as storage()
        self.lengths: Tensor | None = None  # (B,) int64: positions appended to each row so far
        self.slot_positions: Tensor | None = None  # sliding: (B, W) the position each slot holds, -1 if none
        self._aligned: int | None = None  # growing: the length every row has, when known without a device read
        self._empty = True  # nothing stored since it was made or reset

    @property
    def kind(self) -> str:
        return "sliding" if self.window is not None else "static" if self.max_len is not None else "growing"

    @property
    def capacity(self) -> int:
        """Positions stored per row (0 before the first call)."""
        return 0 if self.keys is None else self.keys.shape[2]

    @property
    def nbytes(self) -> int:
        """The bytes the stored keys and values take, ``2 * B * Hkv * capacity * D * itemsize``."""
        return 0 if self.keys is None or self.values is None else self.keys.nbytes + self.values.nbytes

    @property
    def is_empty(self) -> bool:
        """Whether nothing is stored since the cache was made or last reset (then the next call starts a generation)."""
        return self._empty

    def reset(self) -> None:
        """Empty the cache for a new batch of sequences (a static cache keeps its shapes, with zeros)."""
        self._empty = True
        if self.kind == "static" and self.lengths is not None and self.keys is not None and self.values is not None:
            # zeros past every row's length, as update() promises: nothing of the last batch, NaN included, stays.
            # New tensors of the same shapes, not written in place: the last batch's graph (a backward still to
            # come) or inference mode may hold the old ones.
            C = self.keys.shape[2]
            self.keys = storage(self.keys[:, :, :0].detach(), C)  # (B, Hkv, C, D)
            self.values = storage(self.values[:, :, :0].detach(), C)  # (B, Hkv, C, Dv)
            self.lengths = torch.zeros_like(self.lengths)  # (B,)
            return
        self.keys = self.values = self.lengths = self.slot_positions = None
        self._aligned = None

    def keep(self, positions: Tensor, counts: Tensor) -> None:
        """Keep only the chosen positions of each row and key/value head, in the order given (a press,
        :mod:`attnkit.presses`): row ``b`` then holds ``counts[b]`` positions, ``positions[b, h, :counts[b]]`` of
        what it held, and later calls append after them. The stored tensors are replaced, never written into
        (a graph or another holder of the old ones keeps them).

        Args:
            positions: ``(B, Hkv, n)`` int64 slots, each below its row's length (entries past ``counts[b]`` are
                not read).
            counts: ``(B,)`` how many each row keeps, at most ``n``.

        Raises:
            ValueError: a sliding cache (its ring keeps its window by position), an empty cache, or positions of
                another shape.
        """
        if self.window is not None:
            raise ValueError("a sliding KVCache keeps its last window of positions already: it cannot be pressed")
        if self.keys is None or self.values is None or self.lengths is None:
            raise ValueError("the KVCache is empty: there is nothing to keep")
        B, Hkv = self.keys.shape[:2]
        n = positions.shape[-1]
        if positions.dim() != 3 or tuple(positions.shape[:2]) != (B, Hkv) or tuple(counts.shape) != (B,):
            raise ValueError(
                f"positions must be (B, Hkv, n) = ({B}, {Hkv}, n) and counts (B,) = ({B},), got "
                f"{tuple(positions.shape)} and {tuple(counts.shape)}"
            )
        real = torch.arange(n, device=positions.device) < counts[:, None, None]  # (B, 1, n)
        index = torch.where(real, positions, 0)[..., None]  # (B, Hkv, n, 1)
        kept_k = self.keys.gather(2, index.expand(-1, -1, -1, self.keys.shape[3]))  # (B, Hkv, n, D)
        kept_v = self.values.gather(2, index.expand(-1, -1, -1, self.values.shape[3]))  # (B, Hkv, n, Dv)
        kept_k = torch.where(real[..., None], kept_k, 0.0)  # (B, Hkv, n, D): zeros past each row's count
        kept_v = torch.where(real[..., None], kept_v, 0.0)  # (B, Hkv, n, Dv)
        capacity = self.max_len if self.max_len is not None else max(n, 16)
        self.keys, self.values = storage(kept_k, capacity), storage(kept_v, capacity)  # (B, Hkv, C, D|Dv)
        self.lengths = counts.to(device=self.lengths.device, dtype=self.lengths.dtype).clone()  # (B,)
        shortest, longest = (int(c) for c in self.lengths.aminmax()) if B else (0, 0)
        self._aligned = longest if self.max_len is None and shortest == longest else None

    def __repr__(self) -> str:
        size = "" if self.keys is None else f", {tuple(self.keys.shape)}, {self.nbytes} bytes"
        return f"KVCache({self.kind}{size})"

    @staticmethod
    def check_new(queries: Tensor, keys: Tensor) -> None:
        """A self-attention call's keys (and values) are its new positions, as many as its queries ``(B, L, ...)``.

        Raises:
            ValueError: naming both, with their shapes.
        """
        if keys.shape[1] != queries.shape[1]:
            raise ValueError(
                f"with a KVCache, keys and values are the call's new positions, as queries: queries has "
                f"{queries.shape[1]} positions but keys {keys.shape[1]}: queries {tuple(queries.shape)}, keys "
                f"{tuple(keys.shape)}"
            )

    def update(self, k_new: Tensor, v_new: Tensor, new_lens: Tensor | None, is_causal: bool) -> Attended:
        """Store a call's new keys and values; return what its queries attend over.

        Args:
            k_new: ``(B, Hkv, Lq, D)``, v_new: ``(B, Hkv, Lq, Dv)``, projected, for the call's ``Lq`` positions.
            new_lens: ``(B,)``: how many of them are real in each row (right padding after); all when ``None``.
            is_causal: query ``i`` of row ``b`` sees that row's keys up to its own position ``length_b + i``.

        Returns:
            An :class:`~attnkit.cache.Attended`, ``keys (B, Hkv, Lk, D)``, ``values (B, Hkv, Lk, Dv)``, and the
            mask as the attention call takes it: ``valid_lens (B, Lq)`` (growing and static caches) or a boolean
            ``attn_mask (B, 1, Lq, Lk)`` (sliding), the other ``None``; both ``None`` when the rows are aligned (a
            growing cache whose rows all hold ``Lk`` keys, every new token real): then ``is_causal`` as given,
            aligned to the bottom right, is exact, and the attention call builds no mask (decoding one sequence
            always takes this path). Padded queries see no key (their output is zero). ``zeros_past``: each row's
            length, past which its keys and values are zeros (growing and static caches), which the attention call
            passes on.

        Raises:
            ValueError: keys and values that do not fit what the cache holds (another batch, heads, head size,
                device or dtype), or a static cache that is full.
        """
        attended = self._store(k_new, v_new, new_lens, is_causal)
        self._empty = False
        return attended

    def _store(self, k_new: Tensor, v_new: Tensor, new_lens: Tensor | None, is_causal: bool) -> Attended:
        B, Hkv, Lq, _ = k_new.shape
        self._start(k_new, v_new)
        assert self.lengths is not None
        if self._aligned is not None and new_lens is None:
            return self._append_aligned(k_new, v_new, self._aligned)
        real = self._new_lengths(new_lens, B, Lq, k_new.device)  # (B,)
        if self.window is None:  # (before the positions: under compile, the writes then wait for the check)
            self._make_room(_longest(self.lengths) + Lq if self.max_len is None else None, Lq)
        steps = torch.arange(Lq, device=k_new.device)  # (Lq,)
        positions = self.lengths[:, None] + steps  # (B, Lq): where each new token stands in its row
        is_real = steps < real[:, None]  # (B, Lq)
        if self.window is not None:
            return self._sliding(k_new, v_new, positions, is_real, is_causal)
        assert self.keys is not None and self.values is not None
        if new_lens is not None:
            # Padded tokens are written as zeros, past the row's new length: unseen, overwritten by the row's next
            # tokens, and finite, so that a backend has no dead key to zero (whatever the padding held, NaN too).
            k_new = torch.where(is_real[:, None, :, None], k_new, 0.0)  # (B, Hkv, Lq, D)
            v_new = torch.where(is_real[:, None, :, None], v_new, 0.0)  # (B, Hkv, Lq, Dv)
        self._writable(k_new, v_new)
        # index_put_, not scatter_: under torch.compile Inductor writes it in place, where it copied the whole cache
        # around a scatter_ (torch 2.13: a decode step at 4096 positions took 1.3x less time, `compile_speed.py`)
        rows = torch.arange(B, device=k_new.device)[:, None]  # (B, 1)
        self.keys[rows, :, positions] = k_new.transpose(1, 2)  # (B, Lq, Hkv, D) into (B, Hkv, C, D)
        self.values[rows, :, positions] = v_new.transpose(1, 2)  # (B, Lq, Hkv, Dv) into (B, Hkv, C, Dv)
        self.lengths = self.lengths + real  # (B,)
        # (B, Lq): causal, query i sees its row's keys [0, length_b + i]; else every key of its row
        seen = positions + 1 if is_causal else self.lengths[:, None].expand(B, Lq)
        seen = torch.where(is_real, seen, 0)  # (B, Lq): padded queries see nothing
        if self.max_len is not None:
            # static shapes: the whole storage
            return Attended(self.keys, self.values, seen, None, self.lengths, (positions, None))
        shortest, longest = (int(n) for n in self.lengths.aminmax()) if B else (0, 0)  # one sync for both
        # at least one key: a prefill where every row is empty gives zeros (its queries are all padding, they see none)
        Lk = max(longest, 1)
        keys, values = self.keys[:, :, :Lk], self.values[:, :, :Lk]  # (B, Hkv, Lk, D|Dv)
        self._aligned = longest if shortest == longest else None
        if new_lens is None and shortest == longest:
            return Attended(keys, values, None, None, self.lengths)  # aligned rows: no mask to build
        return Attended(keys, values, seen, None, self.lengths, (positions, None))

    def _append_aligned(self, k_new: Tensor, v_new: Tensor, length: int) -> Attended:
        """A growing cache whose rows all hold ``length`` positions, every new token real (decoding one sequence,
        or a batch whose prompts were of one length): the new keys are written as one slice, with no index
        tensors and no read of the lengths from the device, and the rows stay aligned."""
        assert self.lengths is not None
        Lq = k_new.shape[2]
        self._make_room(length + Lq, Lq)
        assert self.keys is not None and self.values is not None
        self._writable(k_new, v_new)
        self.keys[:, :, length : length + Lq] = k_new  # (B, Hkv, Lq, D) into (B, Hkv, C, D)
        self.values[:, :, length : length + Lq] = v_new  # (B, Hkv, Lq, Dv) into (B, Hkv, C, Dv)
        self.lengths = self.lengths + Lq  # (B,)
        self._aligned = length + Lq
        Lk = max(length + Lq, 1)
        return Attended(self.keys[:, :, :Lk], self.values[:, :, :Lk], None, None, self.lengths)  # is_causal exact

    def _start(self, k_new: Tensor, v_new: Tensor) -> None:
        """At the first call: sizes, dtype and device from it; later calls must fit them."""
        B, Hkv, Lq, D = k_new.shape
        Dv = v_new.shape[3]
        if self.keys is None or self.values is None or self.lengths is None:
            capacity = self.window or self.max_len or max(Lq, 16)
            self.keys = storage(k_new[:, :, :0].detach(), capacity)  # (B, Hkv, C, D)
            self.values = storage(v_new[:, :, :0].detach(), capacity)  # (B, Hkv, C, Dv)
            self.lengths = torch.zeros(B, dtype=torch.long, device=k_new.device)  # (B,)
            self._aligned = 0 if self.kind == "growing" else None
            if self.window is not None:
                self.slot_positions = torch.full((B, self.window), -1, dtype=torch.long, device=k_new.device)
            return
        if k_new.dtype != self.keys.dtype or v_new.dtype != self.values.dtype:
            raise ValueError(
                f"this cache holds {self.keys.dtype} keys and values, but the call brings {k_new.dtype} keys and "
                f"{v_new.dtype} values (a cache filled under autocast and stepped without it, or a layer converted "
                f"since): one dtype per cache ({self._start_over})"
            )
        want = (self.keys.shape[0], self.keys.shape[1], self.keys.shape[3], self.values.shape[3])
        if (B, Hkv, D, Dv) != want or k_new.device != self.keys.device:
            raise ValueError(
                f"this cache holds (B, Hkv, D, Dv) = {want} on {self.keys.device}, but the call brings keys "
                f"{tuple(k_new.shape)} and values {tuple(v_new.shape)} on {k_new.device}: one cache per layer and "
                f"batch ({self._start_over})"
            )

    @property
    def _start_over(self) -> str:
        """How to start over, for an error message: a static cache keeps its shapes and dtype across reset()."""
        if self.kind == "static":
            return "a static cache keeps its batch, shapes and dtype across reset(): make a new KVCache for others"
        return "cache.reset() empties it for a new batch"

    def _writable(self, k_new: Tensor, v_new: Tensor) -> None:
        """Under autograd, the keys and values an earlier call attended over belong to its graph: the new ones are
        written into copies, so that one backward through several calls gives the full forward's gradient (as
        transformers' caches, which concatenate), not autograd's in-place error. Without autograd: in place."""
        assert self.keys is not None and self.values is not None
        tracked = torch.is_grad_enabled() and any(t.requires_grad for t in (k_new, v_new, self.keys, self.values))
        # (filled under torch.inference_mode and stepped outside it: its tensors cannot be written there)
        # (dynamo cannot ask is_inference(): torch.compile traces no inference_mode, torch.no_grad does as well)
        frozen = (
            not torch.compiler.is_compiling() and self.keys.is_inference() and not torch.is_inference_mode_enabled()
        )
        if tracked or frozen:
            self.keys, self.values = self.keys.clone(), self.values.clone()  # (B, Hkv, C, D|Dv), the same layout
        if frozen and self.slot_positions is not None:
            self.slot_positions = self.slot_positions.clone()  # (B, W)

    def _new_lengths(self, new_lens: Tensor | None, B: int, Lq: int, device: torch.device) -> Tensor:
        if new_lens is None:
            return torch.full((B,), Lq, dtype=torch.long, device=device)
        if not isinstance(new_lens, Tensor) or new_lens.shape != (B,):
            raise ValueError(
                f"with a cache, valid_lens must have shape (B,) = ({B},), the real new tokens of each row "
                f"(right-padded), got {describe(new_lens)}"
            )
        return as_lengths(new_lens, "valid_lens", Lq, device, what="the call's new tokens")

    def _make_room(self, needed: int | None, Lq: int) -> None:
        """Growing: at least ``needed`` positions, doubling (amortised). Static: the call must fit."""
        assert self.keys is not None and self.values is not None and self.lengths is not None
        C = self.keys.shape[2]
        if needed is None:  # static: checked where the lengths are (as the compiled code runs, under compile)
            asked = torch.stack([self.lengths, torch.full_like(self.lengths, Lq)])  # (2, B): held, and brought
            self.lengths = checked(asked, "static room", "static cache", C, keep=self.lengths)
            return
        if needed <= C:
            return
        grown = max(needed, 2 * C)
        for name in ("keys", "values"):
            setattr(self, name, storage(getattr(self, name), grown))  # (B, Hkv, C', D)

    def _sliding(self, k_new: Tensor, v_new: Tensor, positions: Tensor, is_real: Tensor, is_causal: bool) -> Attended:
        """The ring's keys and the new ones together (the new ones may overwrite slots older queries of this call
        still see), masked by position; then the last ``W`` real ones of each row written into the ring."""
        assert self.keys is not None and self.values is not None and self.slot_positions is not None
        assert self.window is not None and self.lengths is not None
        W = self.window
        B, Hkv, Lq, _ = k_new.shape
        keys = storage(self.keys, W + Lq)  # (B, Hkv, W + Lq, D)
        values = storage(self.values, W + Lq)  # (B, Hkv, W + Lq, Dv)
        keys[:, :, W:], values[:, :, W:] = k_new, v_new
        new_positions = torch.where(is_real, positions, -1)  # (B, Lq)
        key_positions = torch.cat([self.slot_positions, new_positions], dim=1)  # (B, W + Lq)
        p = positions[:, :, None]  # (B, Lq, 1): each query's position
        j = key_positions[:, None, :]  # (B, 1, W + Lq)
        allowed = (j >= 0) & (j > p - W)  # (B, Lq, W + Lq): held, and within the window
        allowed = allowed & (j <= p) if is_causal else allowed & (j < (self.lengths + is_real.sum(1))[:, None, None])
        allowed = allowed & is_real[:, :, None]  # padded queries see nothing
        self._writable(k_new, v_new)
        assert self.slot_positions is not None
        for b in range(B):  # the last W real tokens of each row into their slots (distinct: W consecutive positions)
            n = int(is_real[b].sum())
            first = max(0, n - W)
            slots = positions[b, first:n] % W  # (n',)
            self.keys[b, :, slots] = k_new[b, :, first:n]
            self.values[b, :, slots] = v_new[b, :, first:n]
            self.slot_positions[b, slots] = positions[b, first:n]
        self.lengths = self.lengths + is_real.sum(dim=1)  # (B,)
        # attn_mask (B, 1, Lq, W + Lq); the ring's slots are not in order of position
        return Attended(keys, values, None, allowed[:, None], None, (positions, key_positions))


@value_check("static room")
def _room(asked: Tensor, name: str, capacity: int, what: str) -> None:
    """``asked (2, B)``: each row's length and the call's new positions (a tensor: a symbolic size under compile)."""
    longest, new = _longest(asked[0]), int(asked[1, 0]) if asked.shape[1] else 0
    if longest + new > capacity:
        raise ValueError(
            f"this static cache holds max_len={capacity} positions per row; a row already holds {longest} and the "
            f"call brings {new} more"
        )


def _longest(lengths: Tensor) -> int:
    """The longest row's length (0 for a batch of no rows)."""
    return int(lengths.max()) if lengths.numel() else 0


class CrossKVCache:
    """An encoder's projected keys and values for cross-attention, computed at the first call and reused at every
    later one (whatever keys and values those pass), with the encoder's ``valid_lens``.

    Example:
        >>> import torch, attnkit
        >>> cross, cache = attnkit.MultiHeadAttention(16, 4).eval(), attnkit.CrossKVCache()
        >>> memory, y = torch.randn(2, 7, 16), torch.randn(2, 1, 16)
        >>> _ = cross(y, memory, memory, torch.tensor([7, 4]), cache=cache)  # projects memory once
        >>> cache.keys.shape                                                   # (B, Hkv, Lk, D)
        torch.Size([2, 4, 7, 4])
    """

    def __init__(self) -> None:
        self.keys: Tensor | None = None  # (B, Hkv, Lk, D), as storage()
        self.values: Tensor | None = None  # (B, Hkv, Lk, Dv), as storage()
        self.valid_lens: Tensor | None = None  # the encoder's, as first given

    def check_batch(self, queries: Tensor) -> None:
        """The call's batch is the one whose encoder outputs this cache holds.

        Raises:
            ValueError: naming both batch sizes.
        """
        if self.keys is not None and self.keys.shape[0] != queries.shape[0]:
            raise ValueError(
                f"this CrossKVCache holds the projected encoder outputs of a batch of {self.keys.shape[0]}, but the "
                f"call brings queries {tuple(queries.shape)}: one cross cache per layer and batch (cache.reset() "
                f"empties it for a new batch)"
            )

    def fill(self, keys: Tensor, values: Tensor, valid_lens: Tensor | None) -> None:
        """Keep the projected ``keys (B, Hkv, Lk, D)``, ``values (B, Hkv, Lk, Dv)`` and the encoder's
        ``valid_lens`` for the later calls."""
        self.keys, self.values, self.valid_lens = storage(keys), storage(values), valid_lens

    @property
    def nbytes(self) -> int:
        return 0 if self.keys is None or self.values is None else self.keys.nbytes + self.values.nbytes

    def reset(self) -> None:
        self.keys = self.values = self.valid_lens = None

    def __repr__(self) -> str:
        size = "empty" if self.keys is None else f"{tuple(self.keys.shape)}, {self.nbytes} bytes"
        return f"CrossKVCache({size})"
