"""The book's attention layers: ``DotProductAttention``, ``AdditiveAttention`` and ``MultiHeadAttention`` (see
:mod:`attnkit.d2l` for what they do differently from the book, on purpose, and what they add)."""

from __future__ import annotations

import math
from contextvars import ContextVar
from typing import Any

import torch
from torch import Tensor, nn

from attnkit import _context_parallel, _projection, _scoped_state, functional, trace
from attnkit._validate import as_lengths, check_dropout, describe, listed
from attnkit.cache import CrossKVCache, KVCache, Positions
from attnkit.d2l.functions import transpose_output, transpose_qkv
from attnkit.d2l.signatures import bind, check_book_inputs, check_valid_lens, unbuilt
from attnkit.recording import is_recording, report_weights

__all__ = ["AdditiveAttention", "DotProductAttention", "MultiHeadAttention"]

# B batch, H heads, Lq/Lk query/key length, d head dim

# Where the calls of a MultiHeadAttention's inner attention stand while it attends through a KVCache: that inner
# module, the cache's positions ((B, Lq), (B, Lk)), and the heads folded into its batch. For recording only (it
# changes no output), so scoped state rather than an argument: a replaced .attention (the book's exercises swap in
# their own) need not take one, and the identity check keeps it from any module that .attention calls in turn.
_INNER_POSITIONS: ContextVar[tuple[nn.Module, Positions, int] | None] = ContextVar(
    "attnkit_d2l_inner_positions", default=None
)


def _positions_of(module: nn.Module) -> Positions | None:
    """Where the call of ``module`` stands for the statistics recorded of it: a KVCache's positions, one row per
    folded head ``(B*H, L)``, while a :class:`MultiHeadAttention` calls it through one (a ring's slots hold positions
    out of order); ``None``, the default positions, otherwise or while nothing records."""
    found = _scoped_state.read(_INNER_POSITIONS, None)
    if found is None or found[0] is not module or not is_recording():
        return None
    _, (queries, keys), heads = found
    folded = [None if p is None else p.repeat_interleave(heads, dim=0) for p in (queries, keys)]  # (B*H, L) each
    return folded[0], folded[1]


class DotProductAttention(nn.Module):
    """The book's scaled dot-product attention, ``DotProductAttention(dropout)``.

    ``forward(queries (B, Lq, d), keys (B, Lk, d), values (B, Lk, dv), valid_lens=None) -> (B, Lq, dv)``;
    sets ``.attention_weights (B, Lq, Lk)``; ``.scores (B, Lq, Lk)`` gives the last call's scaled scores, before
    masking, computed when first read. Beyond the book, keyword-only, as in
    :func:`attnkit.scaled_dot_product_attention`: ``attn_mask`` (boolean, ``True`` = may attend, or float,
    broadcastable to ``(B, Lq, Lk)``) and ``is_causal`` (query ``i`` sees key ``j`` when ``j <= i + Lk - Lq``);
    ``zeros_past`` ``(B,)``, which :class:`MultiHeadAttention` passes over a :class:`~attnkit.KVCache`: the keys
    and values are zeros from that position on in each row (the cache's promise, see :func:`attnkit.functional.attend`).

    Raises:
        ValueError: naming the argument, with the shapes, before any work: inputs that are not 3-dim (the book
            folds heads into the batch: :func:`transpose_qkv`), or that do not fit together.

    Example:
        >>> attention = DotProductAttention(0.5).eval()
        >>> values = torch.arange(40, dtype=torch.float32).reshape(1, 10, 4).repeat(2, 1, 1)
        >>> out = attention(torch.ones(2, 1, 2), torch.ones(2, 10, 2), values, torch.tensor([2, 6]))
        >>> torch.allclose(out, torch.tensor([[[2.0, 3, 4, 5]], [[10, 11, 12, 13]]]))
        True
        >>> attention.attention_weights[1, 0, 4:8]
        tensor([0.1667, 0.1667, 0.0000, 0.0000])
    """

    _attnkit_traced = True  # attnkit.trace names this module and attributes its steps to it

    def __init__(self, dropout: float, num_heads: int | None = None) -> None:
        # num_heads: accepted as in the book's newer signature, which does not use it either
        super().__init__()
        check_dropout(dropout)
        self.dropout = nn.Dropout(dropout)
        self.attention_weights: Tensor | None = None
        # The last call's queries and keys (detached, not copied) and their version counters, for .scores
        self._scored: tuple[Tensor, Tensor, int, int] | None = None
        self._scores: Tensor | None = None

    @property
    def scores(self) -> Tensor | None:
        """The last call's scores ``queries @ keys^T / sqrt(d)``, before masking, ``(B, Lq, Lk)``; ``None`` before
        the first call and after a call inside :func:`attnkit.distributed.context_parallel`.

        Computed when first read, from the queries and keys that call kept, so a forward does only the book's two
        matmuls (``attnkit bench``, contender ``d2l``). Raises ``RuntimeError`` if they were modified in place
        since the call (which ``torch.inference_mode`` tensors, keeping no version counter, cannot tell).
        """
        if self._scores is None and self._scored is not None:
            q, k, q_version, k_version = self._scored
            now = [-1 if t.is_inference() else t._version for t in (q, k)]
            if now != [q_version, k_version]:
                raise RuntimeError(
                    "scores: the queries or keys of the last call were modified in place since; read .scores "
                    "before changing them"
                )
            self._scores = torch.bmm(q, k.transpose(1, 2)) / math.sqrt(q.shape[-1])  # (B, Lq, Lk)
        return self._scores

    def forward(
        self,
        queries: Tensor,
        keys: Tensor,
        values: Tensor,
        valid_lens: Tensor | None = None,
        *,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
        zeros_past: Tensor | None = None,
    ) -> Tensor:
        check_book_inputs(queries, keys, values, same_features=True)
        out, weights, _ = functional.attend(
            queries,
            keys,
            values,
            functional.Masks(valid_lens, attn_mask, is_causal),
            dropout_p=self.dropout.p if self.training else 0.0,
            need_weights=_context_parallel.active() is None,  # inside context_parallel no rank holds them: None
            zeros_past=zeros_past,
        )
        q, k = queries.detach(), keys.detach()
        # inference tensors keep no version counter (-1: a change after the call cannot be told, see .scores)
        # (nor, to dynamo, do tensors while torch.compile traces: a change after a compiled call cannot be told)
        traced = torch.compiler.is_compiling()
        q_version, k_version = (-1 if traced or t.is_inference() else t._version for t in (q, k))
        # inside context_parallel q and k are one shard's: no rank holds the whole sequence's scores (None, as the
        # weights)
        self._scored = (q, k, q_version, k_version) if _context_parallel.active() is None else None
        self._scores = None
        # For looking at, as in the book; detached, so it holds no graph (copy.deepcopy works, memory is freed).
        self.attention_weights = weights.detach() if weights is not None else None
        report_weights(self, weights, positions=_positions_of(self))  # for attnkit.record_weights and record_stats
        return out


class AdditiveAttention(nn.Module):
    """The book's additive attention, in both of its forms.

    ``AdditiveAttention(key_size, query_size, num_hiddens, dropout)`` (explicit sizes) or
    ``AdditiveAttention(num_hiddens, dropout)`` (sizes inferred at the first call).
    ``forward(queries (B, Lq, query_size), keys (B, Lk, key_size), values (B, Lk, dv), valid_lens)``; sets
    ``.attention_weights (B, Lq, Lk)``.

    Parameters are made as the book makes them, so that the same seed gives the book's initial weights: ``nn.Linear``
    in the explicit form, drawn when the module is built; ``nn.LazyLinear`` in the inferred form, drawn at the first
    call in the book's order (``W_q``, ``W_k``, then ``w_v``).

    Raises:
        TypeError: at construction, a size that is not a whole number.
        ValueError: at construction, a size below 1 or ``dropout`` outside ``[0, 1)``; at a call, naming the
            argument, with the shapes, before any work: inputs that are not 3-dim, that do not fit together, or
            whose feature size is not the one the layer was built or first called with.

    Example:
        >>> attention = AdditiveAttention(key_size=2, query_size=20, num_hiddens=8, dropout=0.1).eval()
        >>> values = torch.arange(40, dtype=torch.float32).reshape(1, 10, 4).repeat(2, 1, 1)
        >>> queries, keys = torch.normal(0, 1, (2, 1, 20)), torch.ones((2, 10, 2))
        >>> out = attention(queries, keys, values, torch.tensor([2, 6]))
        >>> torch.allclose(out, torch.tensor([[[2.0, 3, 4, 5]], [[10, 11, 12, 13]]]))
        True
    """

    _attnkit_traced = True  # attnkit.trace names this module and attributes its steps to it

    # the book's two signatures: with explicit sizes, and the newer one that infers them
    _EXPLICIT = ("key_size", "query_size", "num_hiddens", "dropout")
    _INFERRED = ("num_hiddens", "dropout")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        sizes = bind("AdditiveAttention", args, kwargs, explicit=self._EXPLICIT, inferred=self._INFERRED)
        h, inferred = sizes["num_hiddens"], "key_size" not in sizes
        self.W_k = _projection.make(sizes.get("key_size"), h, bias=False)
        self.W_q = _projection.make(sizes.get("query_size"), h, bias=False)
        self.w_v = _projection.make(None if inferred else h, 1, bias=False)
        self.dropout = nn.Dropout(sizes["dropout"])
        self.attention_weights: Tensor | None = None

    def forward(self, queries: Tensor, keys: Tensor, values: Tensor, valid_lens: Tensor | None) -> Tensor:
        check_book_inputs(queries, keys, values, same_features=False)
        _projection.check_features("queries", queries, self.W_q)
        _projection.check_features("keys", keys, self.W_k)
        q = self.W_q(queries)  # (B, Lq, h); the book calls W_q before W_k
        k = self.W_k(keys)  # (B, Lk, h)
        if unbuilt(self.w_v):
            # The book's lazy w_v draws its weight at its first call, after W_q and W_k: a call on no rows draws
            # it at that same point, and turns it into an nn.Linear, as the book's becomes.
            with torch.no_grad(), trace.paused():
                self.w_v(q.new_empty(0, q.shape[-1]))  # (0, h) -> (0, 1)
        out, weights = functional.additive_attention(
            q,
            k,
            values,
            self.w_v.weight[0],  # (1, h) -> (h,)
            valid_lens=valid_lens,
            dropout_p=self.dropout.p if self.training else 0.0,
            need_weights=True,
        )
        self.attention_weights = weights.detach() if weights is not None else None  # as in DotProductAttention
        # for attnkit.record_weights and record_stats
        report_weights(self, self.attention_weights, positions=_positions_of(self))
        return out


class MultiHeadAttention(nn.Module):
    """The book's multi-head attention, in both of its forms.

    ``MultiHeadAttention(key_size, query_size, value_size, num_hiddens, num_heads, dropout, bias=False)`` or
    ``MultiHeadAttention(num_hiddens, num_heads, dropout, bias=False)`` (sizes inferred at the first call).
    ``forward(queries, keys, values, valid_lens) -> (B, Lq, num_hiddens)``; the heads are folded into the batch
    with :func:`transpose_qkv`, as in the book, so ``.attention.attention_weights`` is ``(B*H, Lq, Lk)``.

    Beyond the book, keyword-only, meaning what they mean in :class:`attnkit.MultiHeadAttention`:

    * ``cache``: an :class:`attnkit.KVCache` for self-attention. ``keys`` and ``values`` are this call's new
      positions only (as ``queries``: ``attention(X, X, X, None, cache=c)``); they are projected, appended to each
      row of the cache, and the queries attend over all the cache holds. ``valid_lens`` is then ``(B,)``, each
      row's real new tokens (right padding after), or ``None`` for all of them; the cache builds the lengths over
      its keys itself, so the book's ``(B, Lq)`` lengths are refused (``is_causal`` is the causal mask).
      Or an :class:`attnkit.CrossKVCache` for cross-attention: the keys and values (the encoder's outputs) are
      projected at its first call and reused, with that call's ``valid_lens``, at the later ones.
    * ``is_causal``: query ``i`` sees key ``j`` when ``j <= i + Lk - Lq`` (with a :class:`~attnkit.KVCache`: the
      row's keys up to the query's own position in its row). ``False``, the default, is the book's eval-mode call
      ``attention(X, key_values, key_values, None)``: every query sees every key of its row, so one new token per
      call (the book's ``predict_step``) is causal either way; a prefill of several tokens needs ``True``, which
      is the book's training-mode ``dec_valid_lens = arange(1, Lq + 1)`` on an empty cache.

    Parameters are made as the book makes them, so that the same seed gives the book's initial weights: four
    ``nn.Linear`` in the explicit form, drawn when the module is built; four ``nn.LazyLinear`` in the inferred
    form, drawn at the first call in the order they are called (``W_q``, ``W_k``, ``W_v``, then ``W_o``).

    Raises:
        TypeError, ValueError: as :class:`AdditiveAttention`, and a ``num_hiddens`` that is not a multiple of
            ``num_heads``, or a cache that does not fit the call.

    Example:
        >>> attention = MultiHeadAttention(100, 100, 100, 100, 5, 0.5).eval()
        >>> X, Y = torch.ones((2, 4, 100)), torch.ones((2, 6, 100))
        >>> attention(X, Y, Y, torch.tensor([3, 2])).shape
        torch.Size([2, 4, 100])

        With a cache, each step projects only its new token:

        >>> import attnkit
        >>> cache = attnkit.KVCache()
        >>> for t in range(3):
        ...     x = torch.randn(2, 1, 100)  # (B, 1, features): this step's token
        ...     y = attention(x, x, x, None, cache=cache)
        >>> cache.lengths.tolist(), attention.attention.attention_weights.shape
        ([3, 3], torch.Size([10, 1, 3]))
    """

    _attnkit_traced = True  # attnkit.trace names this module and attributes its steps to it

    # the book's two signatures: with explicit sizes, and the newer one that infers them
    _EXPLICIT = ("key_size", "query_size", "value_size", "num_hiddens", "num_heads", "dropout", "bias")
    _INFERRED = ("num_hiddens", "num_heads", "dropout", "bias")

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        names = {"explicit": self._EXPLICIT, "inferred": self._INFERRED}
        sizes = bind("MultiHeadAttention", args, kwargs, **names, defaults={"bias": False})
        h, bias = sizes["num_hiddens"], sizes["bias"]
        if h % sizes["num_heads"]:
            raise ValueError(f"num_hiddens ({h}) must be a multiple of num_heads ({sizes['num_heads']})")
        self.num_heads = sizes["num_heads"]
        self.attention = DotProductAttention(sizes["dropout"])
        self.W_q = _projection.make(sizes.get("query_size"), h, bias=bias)
        self.W_k = _projection.make(sizes.get("key_size"), h, bias=bias)
        self.W_v = _projection.make(sizes.get("value_size"), h, bias=bias)
        self.W_o = _projection.make(None if "key_size" not in sizes else h, h, bias=bias)

    def forward(
        self,
        queries: Tensor,
        keys: Tensor,
        values: Tensor,
        valid_lens: Tensor | None,
        *,
        is_causal: bool = False,
        cache: KVCache | CrossKVCache | None = None,
    ) -> Tensor:
        check_book_inputs(queries, keys, values, same_features=False)
        for name, x, proj in (("queries", queries, self.W_q), ("keys", keys, self.W_k), ("values", values, self.W_v)):
            _projection.check_features(name, x, proj)
        if not isinstance(is_causal, bool):
            raise TypeError(f"is_causal must be True or False, got {is_causal!r}")
        # before the projections: a lazy layer draws nothing on a mistake
        self._check_cache(cache, queries, keys, valid_lens)
        if valid_lens is not None and not isinstance(cache, KVCache):
            check_valid_lens(valid_lens, queries.shape[0], queries.shape[1], keys.shape[1])
        B, Lq, H = queries.shape[0], queries.shape[1], self.num_heads
        attn_mask = zeros_past = None
        positions: Positions | None = None  # where a KVCache's queries and keys stand, for record_stats
        queries = self.transpose_qkv(self.W_q(queries))  # (B, Lq, h) -> (B*H, Lq, h/H)
        if isinstance(cache, CrossKVCache) and cache.keys is not None and cache.values is not None:
            # projected at the first call; (B, H, Lk, d) -> (B*H, Lk, d) is a view
            keys, values, valid_lens = cache.keys.flatten(0, 1), cache.values.flatten(0, 1), cache.valid_lens
        else:
            keys = self.transpose_qkv(self.W_k(keys))  # (B*H, Lk, h/H)
            values = self.transpose_qkv(self.W_v(values))  # (B*H, Lk, h/H)
            if isinstance(cache, CrossKVCache):
                # (B*H, Lk, d) -> (B, H, Lk, d) twice
                cache.fill(keys.unflatten(0, (B, H)), values.unflatten(0, (B, H)), valid_lens)
            elif isinstance(cache, KVCache):
                # The cache's own logic (one copy of it): append each row's new positions, return all it holds
                k, v, valid_lens, attn_mask, zeros_past, positions = cache.update(
                    keys.unflatten(0, (B, H)), values.unflatten(0, (B, H)), valid_lens, is_causal
                )  # (B, H, Lk', d) twice; valid_lens (B, Lq) or attn_mask (B, 1, Lq, Lk') over them; zeros_past (B,)
                keys, values = k.flatten(0, 1), v.flatten(0, 1)  # (B*H, Lk', d): views, the heads are contiguous
                if zeros_past is not None:
                    zeros_past = zeros_past.repeat_interleave(H)  # (B*H,): the cache's promise, per folded head
                if valid_lens is not None or attn_mask is not None:
                    is_causal = False  # now in valid_lens or attn_mask, by each row's own positions
                # else the rows are aligned (all hold Lk' keys): is_causal as given, bottom right, is exact
        tracer = trace.active()
        if valid_lens is not None:
            repeated = torch.repeat_interleave(valid_lens, repeats=H, dim=0)  # (B*H,) or (B*H, Lq)
            if tracer is not None:
                note = f"{listed(valid_lens, limit=12)} -> {listed(repeated, limit=24)}"
                tracer.add("repeat valid_lens", [valid_lens], repeated, note)
            valid_lens = repeated
        if attn_mask is not None:  # a sliding cache's mask, by position
            folded = attn_mask.expand(B, H, Lq, keys.shape[1]).flatten(0, 1)  # (B, 1, Lq, Lk') -> (B*H, Lq, Lk')
            if tracer is not None:
                tracer.add("repeat attn_mask", [attn_mask], folded, "(B, 1, Lq, Lk) -> (B*H, Lq, Lk)")
            attn_mask = folded
        extra = {} if zeros_past is None else {"zeros_past": zeros_past}  # (a replaced .attention need not take it)
        # the inner attention's statistics stand at the cache's positions, not at its slots
        # (for recording only: compiled code, where nothing records, sets nothing)
        token = (
            None if positions is None or not is_recording() else _INNER_POSITIONS.set((self.attention, positions, H))
        )
        try:
            output = self.attention(
                queries, keys, values, valid_lens, attn_mask=attn_mask, is_causal=is_causal, **extra
            )  # (B*H, Lq, h/H)
        finally:
            if token is not None:
                _INNER_POSITIONS.reset(token)
        # for attnkit.record_weights and record_stats, in its layout
        report_weights(self, self._weights_by_head, positions=positions)
        output_concat = self.transpose_output(output)  # (B*H, Lq, h/H) -> (B, Lq, h)
        return self.W_o(output_concat)

    def _check_cache(self, cache: object, queries: Tensor, keys: Tensor, valid_lens: Tensor | None) -> None:
        """A cache fits this call: its heads, head size and batch, and a :class:`~attnkit.KVCache`'s new positions
        and their lengths."""
        if cache is None:
            return
        if not isinstance(cache, (KVCache, CrossKVCache)):
            raise TypeError(f"cache must be an attnkit.KVCache or attnkit.CrossKVCache, got {type(cache).__name__}")
        B, Lq, H = queries.shape[0], queries.shape[1], self.num_heads
        d = self.W_q.out_features // H
        held = cache.keys
        if held is not None and (held.shape[0], held.shape[1], held.shape[3]) != (B, H, d):
            raise ValueError(
                f"this cache holds keys (B, H, L, d) = {tuple(held.shape)}, but this call has B={B}, "
                f"num_heads={H}, d={d} (queries {tuple(queries.shape)}): one cache per layer and batch "
                f"(cache.reset() empties it for a new batch)"
            )
        if isinstance(cache, CrossKVCache):
            if held is not None and cache.valid_lens is not None:
                check_valid_lens(cache.valid_lens, B, Lq, held.shape[2], "the CrossKVCache's valid_lens")
            return
        cache.check_new(queries, keys)
        if valid_lens is not None:
            if not isinstance(valid_lens, Tensor) or valid_lens.shape != (B,):
                raise ValueError(
                    f"with a KVCache, valid_lens must have shape (B,) = ({B},), each row's real new tokens "
                    f"(right-padded), or None; the cache masks its keys itself (is_causal=True for a causal "
                    f"mask), got {describe(valid_lens)}"
                )
            as_lengths(valid_lens, "valid_lens", Lq)  # whole numbers in [0, Lq], shown as given

    def _weights_by_head(self) -> Tensor:
        """The weights of the last call in attnkit's layout: ``.attention.attention_weights``, heads unfolded."""
        weights = self.attention.attention_weights
        assert weights is not None  # set by the call that just ran
        return weights.reshape(weights.shape[0] // self.num_heads, self.num_heads, *weights.shape[1:])  # (B, H, Lq, Lk)

    def transpose_qkv(self, X: Tensor) -> Tensor:
        """The book's newer method form of :func:`transpose_qkv`."""
        return transpose_qkv(X, self.num_heads)

    def transpose_output(self, X: Tensor) -> Tensor:
        """The book's newer method form of :func:`transpose_output`."""
        return transpose_output(X, self.num_heads)
