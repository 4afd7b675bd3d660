"""What every press shares: the context manager that hooks a model's attention layers, the view of one layer's
prefill that a press scores (:class:`Layer`), and the compression that keeps each key/value head's best-scored
positions (:mod:`attnkit.presses` says what a press is and lists them)."""

from __future__ import annotations

import contextlib
import inspect
import math
import sys
import threading
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import torch
from torch import Tensor, nn

from attnkit import recording, stats
from attnkit._validate import describe
from attnkit.cache import KVCache
from attnkit.masks import compute_dtype

__all__ = ["Layer", "Press", "viewers"]

# B batch, H query heads, Hkv key/value heads, G = H // Hkv, L keys of the prefill, n kept, D head dim


class Layer:
    """One attention layer's prefill, as a press scores it: its ``index``, its cached ``keys (B, Hkv, L, D)``
    (RoPE applied, as cached), ``lengths (B,)`` (the keys each row holds: a :class:`~attnkit.KVCache`'s ragged
    rows; all ``L`` otherwise) and ``heads`` (query heads ``H``), with the exact attention it computed, asked for
    only by the presses that need it: :meth:`column_sums`, :meth:`weights` of chosen rows, :meth:`entropy` and
    :meth:`viewers`, from the call's queries, keys and masks (:mod:`attnkit.stats`: no ``L x L`` matrix)."""

    def __init__(self, index: int, keys: Tensor, lengths: Tensor | None, parts: stats.Parts) -> None:
        self.index, self.parts = index, parts
        L = parts.k.shape[2] if lengths is None or not len(lengths) else int(lengths.max())
        self.keys = keys[:, :, :L]  # (B, Hkv, L, D): a static cache's prefill holds more slots than positions
        self.heads = parts.q.shape[1]
        self.lengths = lengths  # (B,) or None
        self._stats: stats.AttentionStats | None = None
        self._viewers: Tensor | None = None

    @property
    def length(self) -> int:
        """``L``, the positions scored: the prefill's (the longest row's, in a KVCache of ragged rows)."""
        return int(self.keys.shape[2])

    def aligned(self, press: object) -> int:
        """``L``, after checking that every row holds ``L`` positions, the prefill's last queries being each row's
        own (a press that reads a window of the last queries, or the most recent positions).

        Raises:
            ValueError: a KVCache of rows of different lengths, naming ``press`` and them.
        """
        if self.lengths is not None and bool((self.lengths != self.length).any()):
            raise ValueError(
                f"{press!r} reads each row's last queries or positions: it presses rows of one length, got a "
                f"KVCache with rows of {self.lengths.tolist()} positions (ObservedAttention, KNorm and Random "
                "press ragged rows)"
            )
        return self.length

    def _computed(self) -> stats.AttentionStats:
        if self._stats is None:
            self._stats = stats.compute(self.parts, 1, kv_heads=self.keys.shape[1])
        return self._stats

    def column_sums(self) -> Tensor:
        """``(B, H, L)``: the weight each key received, summed over the prefill's queries, per query head."""
        return self._computed().column_sum[..., : self.length]

    def entropy(self) -> Tensor:
        """``(B, H, Lq)``: each query row's entropy, in nats (0 for a row that sees no key)."""
        return self._computed().entropy

    def weights(self, rows: list[int]) -> Tensor:
        """``(B, H, len(rows), L)``: the whole weights of the query ``rows`` (sorted, distinct), in the compute
        dtype (float32 for float16/bfloat16)."""
        return stats.rows_of(self.parts, rows)[..., : self.length]

    def viewers(self) -> Tensor:
        """``(B|1, H|1, L)``: how many of the prefill's queries may see each key (its mask's column counts)."""
        if self._viewers is None:
            self._viewers = viewers(self.parts)[..., : self.length]  # (computed once: presses and H2O ask)
        return self._viewers


def viewers(parts: stats.Parts, rows_at_once: int = 512) -> Tensor:
    """``(B|1, H|1, Lk)`` float: the number of queries the call's combined mask lets see each key. A plain causal
    mask gives ``Lq - j`` at once; any other is counted a block of ``rows_at_once`` rows at a time."""
    mask = parts.mask
    Lq, Lk = mask.num_queries, mask.num_keys
    dtype = compute_dtype(parts.q.dtype)
    if mask.is_plain_causal:
        return torch.arange(Lk, 0, -1, dtype=dtype, device=parts.q.device).view(1, 1, Lk)  # (1, 1, Lk)
    counts = torch.zeros(1, 1, Lk, dtype=dtype, device=parts.q.device)  # (B|1, H|1, Lk), grown by broadcasting
    for r0 in range(0, Lq, rows_at_once):
        r1 = min(Lq, r0 + rows_at_once)
        allowed = mask.allowed_tile(r0, r1, 0, Lk)  # broadcastable to (B, H, n, Lk), or None: all seen
        if allowed is None:
            counts = counts + (r1 - r0)
            continue
        while allowed.dim() < 4:
            allowed = allowed.unsqueeze(0)  # (1.., n|1, Lk)
        seen = allowed.sum(dim=-2, dtype=dtype) * (r1 - r0 if allowed.shape[-2] == 1 else 1)  # (B|1, H|1, Lk)
        counts = counts + seen
    return counts


def kept_count(length: int, compression_ratio: float) -> int:
    """kvpress's ``int(L * (1 - compression_ratio))`` positions, and at least one."""
    return max(1, int(length * (1 - compression_ratio)))


class Press:
    """A way to compress a key/value cache: :meth:`score` gives each cached position of each key/value head a
    score (higher: kept), and the ``compression_ratio`` share of the positions with the lowest scores is removed,
    per layer and key/value head, when a layer's cache is first filled (the prefill). Subclasses define
    :meth:`score` from the :class:`Layer` it is given (its keys, and the exact attention of its prefill).

    ``with press(model):`` hooks every attention layer of ``model`` until the block ends (also on an exception):
    a Hugging Face model whose attention is attnkit's (:mod:`attnkit.integrations.transformers`), its
    ``DynamicCache`` compressed in place, or a module holding attnkit's :class:`~attnkit.MultiHeadAttention`
    layers called with a :class:`~attnkit.KVCache`. What it decided is kept by layer index:
    ``press.scores[i] (B, Hkv, L)`` and ``press.kept[i] (B, Hkv, n)``, the positions kept, ascending, int64 (with
    ragged rows of a KVCache, ``-1`` past each row's count).

    Args:
        compression_ratio: the share of key/value pairs removed, in ``[0, 1)`` (kvpress's meaning): each layer
            keeps ``max(1, int(L * (1 - compression_ratio)))`` of its ``L`` positions.

    Raises:
        TypeError: ``compression_ratio`` is not a number.
        ValueError: ``compression_ratio`` outside ``[0, 1)``.
    """

    reads_attention = True  # whether score() reads the prefill's attention (then the call keeps each row's lse)

    def __init__(self, compression_ratio: float = 0.0) -> None:
        if isinstance(compression_ratio, bool) or not isinstance(compression_ratio, (int, float)):
            raise TypeError(f"compression_ratio must be a number in [0, 1), got {describe(compression_ratio)}")
        if not 0 <= compression_ratio < 1:  # (NaN fails too)
            raise ValueError(
                f"compression_ratio must be in [0, 1) (the share of pairs removed), got {compression_ratio}"
            )
        self.compression_ratio = float(compression_ratio)
        self.scores: dict[int, Tensor] = {}
        self.kept: dict[int, Tensor] = {}
        self._open = False

    def __repr__(self) -> str:
        names = [n for n in inspect.signature(type(self).__init__).parameters if n != "self"]
        shown = ", ".join(f"{n}={getattr(self, n)!r}" for n in names if hasattr(self, n))
        return f"{type(self).__name__}({shown})"

    def _reset(self) -> None:
        """What a press records, emptied as a block opens."""
        self.scores, self.kept = {}, {}

    def score(self, layer: Layer) -> Tensor:
        """``(B, Hkv, L)``: each cached position's score in ``layer``'s prefill; the highest are kept."""
        raise NotImplementedError

    def choose(self, layer: Layer, scores: Tensor) -> tuple[Tensor, Tensor]:
        """The positions kept ``(B, Hkv, n)`` (ascending; ``-1`` past a row's count) and each row's count ``(B,)``,
        from ``scores (B, Hkv, L)``: the ``n`` best of each row's own positions."""
        B, Hkv, L = scores.shape
        device = scores.device
        lengths = torch.full((B,), L, device=device) if layer.lengths is None else layer.lengths.to(device)
        counts = torch.tensor([kept_count(int(n), self.compression_ratio) if n else 0 for n in lengths.tolist()])
        counts = counts.to(device)  # (B,)
        outside = torch.arange(L, device=device) >= lengths[:, None, None]  # (B, 1, L): past a row's keys
        ranked = scores.masked_fill(outside, -math.inf)  # (B, Hkv, L)
        n = int(counts.max()) if B else 0
        best = ranked.topk(n, dim=-1).indices  # (B, Hkv, n), best first
        real = torch.arange(n, device=device) < counts[:, None, None]  # (B, 1, n)
        best = torch.where(real, best, L)  # past a row's count: sorted last, then marked -1
        kept = best.sort(dim=-1).values  # (B, Hkv, n)
        return torch.where(real, kept, -1), counts

    # the hooks: a layer's prefill is scored and its cache compressed right after its attention call

    def __call__(self, model: nn.Module) -> contextlib.AbstractContextManager[Press]:
        """Press ``model``'s caches inside the block (see the class docstring). The block belongs to the thread or
        task that opened it; a call of the model made in another thread meanwhile (a ``generate`` with a streamer)
        is pressed too.

        Raises:
            TypeError: ``model`` is not a ``torch.nn.Module``.
            ValueError: ``model`` has no attention layer a press knows, is encoder-only, or is a transformers
                model whose attention is not attnkit's; when the block opens, the press is already in a block or
                another press is pressing the model.
        """
        if not isinstance(model, nn.Module):
            raise TypeError(f"a press compresses the caches of a torch.nn.Module, got {describe(model)}")
        return self._pressing(model, _attention_layers(model))

    @contextlib.contextmanager
    def _pressing(self, model: nn.Module, layers: list[tuple[int, nn.Module]]) -> Iterator[Press]:
        if self._open:
            raise ValueError(f"{self!r} is already pressing a model: a press is entered once at a time")
        pressed = _PRESSED.get()
        modules = {id(m) for _, m in layers}
        if modules & pressed:
            raise ValueError(
                f"another press is pressing this {type(model).__name__} already: one press at a time (a second "
                "would score the first one's compressed cache against the whole prefill)"
            )
        self._open = True
        self._reset()
        observer = _Observer(self.reads_attention)
        hooks: list[Any] = []
        transformers = any(_is_layer(m) for _, m in layers)
        _PRESSED.set(pressed | modules)
        try:
            with contextlib.ExitStack() as stack:
                if transformers:
                    from attnkit.presses import _transformers

                    stack.enter_context(_transformers.hiding())
                for index, module in layers:
                    hooks.append(module.register_forward_pre_hook(_before(observer, index), with_kwargs=True))
                    hooks.append(module.register_forward_hook(self._after(observer, index), with_kwargs=True))
                stack.enter_context(recording.observe(model, observer, "press"))
                yield self
        finally:
            for hook in hooks:
                hook.remove()
            observer.pending.clear()
            # (not a reset to the value before: blocks may close in any order)
            _PRESSED.set(_PRESSED.get() - modules)
            self._open = False

    def _after(self, observer: _Observer, index: int) -> Callable[..., None]:
        def after(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            call = observer.pending.pop((threading.get_ident(), id(module)), None)
            if call is None:
                return
            recording.leave(call.joined)
            if call.found is None:
                if call.prefill:  # (attnkit's attention always reports: a module that does not is no attnkit's)
                    raise ValueError(
                        f"the press saw layer {index}'s prefill but not its attention: {type(module).__name__} did "
                        "not report it to attnkit (its attention implementation is not attnkit's)"
                    )
                return
            with torch.no_grad():
                self._on_call(index, module, kwargs, call)

        return after

    def _on_call(self, index: int, module: nn.Module, kwargs: dict, call: _Call) -> None:
        """After one attention call: a prefill (its cache empty before) is scored and compressed."""
        if not call.prefill:
            return
        parts = call.parts()
        if parts is None:
            return
        cache = _cache_of(module, kwargs)
        layer = self._layer(index, cache, parts)
        scores = self.score(layer)  # (B, Hkv, L)
        B, Hkv, L = layer.keys.shape[:3]
        if not isinstance(scores, Tensor) or tuple(scores.shape) != (B, Hkv, L):
            got = tuple(scores.shape) if isinstance(scores, Tensor) else describe(scores)
            raise ValueError(f"{type(self).__name__}.score must give (B, Hkv, L) = {(B, Hkv, L)}, got {got}")
        kept, counts = self.choose(layer, scores)  # (B, Hkv, n), (B,)
        self.scores[index], self.kept[index] = scores, kept
        if cache is not None:
            _keep(cache, kept, counts, self._hidden(index))
        self._chosen(index, module, cache, layer)

    def _layer(self, index: int, cache: Any, parts: stats.Parts) -> Layer:
        """The :class:`Layer` a prefill's call gives, after checking its cache is as the prefill left it."""
        if cache is None:
            return Layer(index, parts.k, None, parts)
        if not isinstance(cache, KVCache):
            if cache.keys.shape[2] != parts.k.shape[2]:
                raise ValueError(
                    f"layer {index}'s cache holds {cache.keys.shape[2]} positions after a prefill of "
                    f"{parts.k.shape[2]}: something else compressed it (another press's hook)"
                )
            if not parts.mask.is_plain_causal and bool((viewers(parts) == 0).any()):  # a key no query sees
                raise ValueError(
                    f"this batch has padding (layer {index}'s prefill {tuple(parts.q.shape[:3])} has keys no query "
                    "sees), and a press cannot compress transformers' cache of a padded batch: the attention_mask "
                    "of the calls after (generate extends it) would no longer line up with the positions kept. "
                    "Press one sequence at a time, or use attnkit's KVCache, whose rows keep their own lengths"
                )
            return Layer(index, cache.keys, None, parts)
        if cache.window is not None:  # (before anything is scored: its ring holds the last window, by position)
            raise ValueError("a sliding KVCache keeps its last window of positions already: it cannot be pressed")
        assert cache.keys is not None
        return Layer(index, cache.keys, cache.lengths, parts)

    def _hidden(self, index: int) -> Tensor | None:
        """``(B, Hkv, n)``: the kept slots the attention hides inside the block (AdaptiveBudget's), or None."""
        return None

    def _chosen(self, index: int, module: nn.Module, cache: Any, layer: Layer) -> None:
        """After a prefill's compression (a subclass's hook)."""


# The attention modules some press is pressing, in this thread or task (by id, held while its block is open).
_PRESSED: ContextVar[frozenset[int]] = ContextVar("attnkit_pressed", default=frozenset())


class _Call:
    """One observed attention call: whether its layer's cache was empty before it, its statistics parts, and the
    press's block joined for it (a call in another thread)."""

    def __init__(self, prefill: bool, joined: Any) -> None:
        self.prefill, self.joined = prefill, joined
        self.found: Callable[[], stats.Parts | None] | None = None

    def parts(self) -> stats.Parts | None:
        """The call's parts, computed at the first ask (``None``: the attention reported none)."""
        return None if self.found is None else self.found()


class _Observer(recording.Observer):
    """Hands a press each hooked layer's call, by thread and module, between its pre-hook and its hook."""

    def __init__(self, wants_lse: bool) -> None:
        super().__init__()
        self.wants_lse = wants_lse
        self.pending: dict[tuple[int, int], _Call] = {}

    def observe(
        self, name: str, module: nn.Module, parts: Callable[[], stats.Parts | None], kv_heads: int | None
    ) -> None:
        call = self.pending.get((threading.get_ident(), id(module)))
        if call is not None:
            call.found = parts


def _before(observer: _Observer, index: int) -> Callable[..., None]:
    def before(module: nn.Module, args: tuple, kwargs: dict) -> None:
        cache = _cache_of(module, kwargs)
        if _is_layer(module):
            from attnkit.presses import _transformers

            _transformers.show(module, cache)  # the slots this call hides, if its cache holds any
            # no cache: scored, nothing compressed; a cache: a prefill when empty before
            prefill = cache is None or not cache.is_initialized or cache.get_seq_length() == 0
        else:  # attnkit's layers: a call with a KVCache that holds nothing yet
            prefill = isinstance(cache, KVCache) and cache.is_empty
        call = _Call(prefill, recording.join(observer))
        observer.pending[threading.get_ident(), id(module)] = call

    return before


def _cache_of(module: nn.Module, kwargs: dict) -> Any:
    """The cache this call of ``module`` fills: a KVCache, a transformers cache layer, or ``None``."""
    cache = kwargs.get("cache")
    if isinstance(cache, KVCache):
        return cache
    cache = kwargs.get("past_key_values")
    index = getattr(module, "layer_idx", None)
    if cache is None or index is None or not hasattr(cache, "layers") or index >= len(cache.layers):
        return None
    layer = cache.layers[index]
    from attnkit.presses import _transformers

    if not _transformers.compressible(layer):
        raise ValueError(
            f"a press compresses transformers' DynamicCache (its DynamicLayer), got a {type(layer).__name__} at "
            f"layer {index}: give the model no cache of another kind (no StaticCache, no "
            "generate(cache_implementation=...)), or a DynamicCache()"
        )
    return layer


def _keep(cache: Any, kept: Tensor, counts: Tensor, hidden: Tensor | None = None) -> None:
    if isinstance(cache, KVCache):
        cache.keep(kept, counts)
        return
    from attnkit.presses import _transformers

    _transformers.keep(cache, kept, hidden)  # a DynamicCache's rows are all of length L: no -1 in kept


def _attention_layers(model: nn.Module) -> list[tuple[int, nn.Module]]:
    """``(layer index, module)`` of each attention layer a press hooks: a transformers model's (their
    ``layer_idx``) or attnkit's MultiHeadAttention layers (in ``named_modules()`` order)."""
    from attnkit.layers import MultiHeadAttention

    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "_attn_implementation"):
        if getattr(config, "is_encoder_decoder", False) or not _causal(model):
            raise ValueError(
                f"a press compresses a decoder's cache; this {type(model).__name__} is an encoder (its attention "
                "is not causal, and it keeps no cache to generate with)"
            )
        implementation = config._attn_implementation
        if not _is_attnkit(implementation):
            raise ValueError(
                f"this model's attention is {implementation!r}, not attnkit's: a press reads the attention that "
                "attnkit computes. Switch it: attnkit.integrations.transformers.register(); "
                "model.set_attn_implementation('attnkit')"
            )
        found = [(int(m.layer_idx), m) for m in model.modules() if _is_layer(m) and m.is_causal]  # type: ignore[arg-type]
    else:
        found = [(i, m) for i, m in enumerate(m for m in model.modules() if isinstance(m, MultiHeadAttention))]
    if not found:
        raise ValueError(
            f"{type(model).__name__} holds no attention layer a press can compress: a transformers decoder with "
            "attnkit's attention, or attnkit.MultiHeadAttention layers called with a KVCache"
        )
    return found


def _is_layer(module: nn.Module) -> bool:
    """A transformers attention module: it knows its layer's index and whether it is causal."""
    return isinstance(getattr(module, "layer_idx", None), int) and hasattr(module, "is_causal")


def _causal(model: nn.Module) -> bool:
    return any(m.is_causal for m in model.modules() if _is_layer(m))


def _is_attnkit(implementation: object) -> bool:
    """Whether ``implementation`` is a name :func:`attnkit.integrations.transformers.register` gave (nothing was
    registered if that module was never imported)."""
    integration = sys.modules.get("attnkit.integrations.transformers")
    return isinstance(implementation, str) and integration is not None and implementation in integration._REGISTERED
