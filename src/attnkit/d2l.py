"""The attention code of *Dive into Deep Learning*, as a drop-in replacement.

Swap ``from d2l import torch as d2l`` for ``from attnkit import d2l`` in the attention chapters and the
notebooks keep working: same names, same signatures (the older explicit-size ones and the newer size-inferring
ones), same parameter names (``W_q``, ``W_k``, ``W_v``, ``W_o``, ``w_v``, so a book ``state_dict`` loads
unchanged), and ``.attention_weights`` set after every forward, as in the book. ``DotProductAttention`` also
keeps ``.scores``, the scaled scores before masking, to print beside the weights.

Where this differs from the book, on purpose:

* A row with nothing to attend to (``valid_lens`` of 0) gets all-zero weights and a zero output. The book
  fills masked scores with ``-1e6``, which gives such a row uniform weights over the padding.
* Nothing is written into the caller's tensors: the book's ``sequence_mask`` assigns into ``X`` (and so
  fails on a leaf tensor that requires grad); here it returns a new tensor.
* Padding never leaks: values past ``valid_lens`` holding NaN do not reach the output.
* Mistakes raise a ``ValueError`` that names the argument and shows the shapes, instead of a matmul error.

What the book does not have, as keywords after the book's arguments: ``MultiHeadAttention(..., cache=...)`` takes
an :class:`attnkit.KVCache` or :class:`attnkit.CrossKVCache`, so a book-style decoder projects each new token once
instead of re-projecting every input so far (``state[2]``) at every step; ``is_causal`` there and in
``DotProductAttention``, and ``attn_mask`` in ``DotProductAttention``, mean what they mean in attnkit's layers.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules.lazy import LazyModuleMixin

from attnkit import _projection, functional, masks, trace
from attnkit._checks import as_lengths, check_dropout, check_sizes, describe, listed
from attnkit.cache import CrossKVCache, KVCache
from attnkit.recording import report_weights

__all__ = [
    "AdditiveAttention",
    "DotProductAttention",
    "MultiHeadAttention",
    "masked_softmax",
    "sequence_mask",
    "show_heatmaps",
    "transpose_output",
    "transpose_qkv",
]

# B batch, H heads, Lq/Lk query/key length, d head dim


def sequence_mask(X: Tensor, valid_len: Tensor, value: float = 0) -> Tensor:
    """``X`` with the entries past ``valid_len`` (along axis 1) set to ``value``, as a new tensor.

    Args:
        X: ``(N, L, ...)`` or ``(N, L)``.
        valid_len: ``(N,)``, whole numbers in ``[0, L]``.

    Raises:
        TypeError: ``X`` or ``valid_len`` not a tensor, or ``valid_len`` not of whole numbers.
        ValueError: ``X`` with fewer than 2 dims, ``valid_len`` not ``(N,)``, or a length outside ``[0, L]``.

    Example:
        >>> sequence_mask(torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.tensor([1, 2]))
        tensor([[1, 0, 0],
                [4, 5, 0]])
    """
    if not isinstance(X, Tensor):
        raise TypeError(f"sequence_mask: X must be a tensor, got {type(X).__name__}")
    if X.dim() < 2:
        raise ValueError(f"sequence_mask: X must be (N, L) or (N, L, ...), got {tuple(X.shape)}")
    if not isinstance(valid_len, Tensor):
        raise TypeError(f"sequence_mask: valid_len must be a tensor of lengths, got {type(valid_len).__name__}")
    if valid_len.shape != X.shape[:1]:
        raise ValueError(
            f"sequence_mask: valid_len must have shape (N,) = ({X.shape[0]},), one length per row of X, got "
            f"valid_len {tuple(valid_len.shape)}, X {tuple(X.shape)}"
        )
    valid_len = as_lengths(valid_len, "valid_len", X.shape[1])  # whole numbers in [0, L]
    keep = masks.sequence_mask(valid_len, X.shape[1])  # (N, L)
    keep = keep.view(*keep.shape, *([1] * (X.dim() - 2)))  # (N, L, 1, ...)
    return X.masked_fill(~keep, value)


def masked_softmax(X: Tensor, valid_lens: Tensor | None) -> Tensor:
    """The book's ``masked_softmax(X, valid_lens)``: ``X (B, Lq, Lk)``, ``valid_lens (B,)`` or ``(B, Lq)``.

    Rows with no valid key are all zeros (the book gives them uniform weights); ``X`` is never modified.
    """
    return masks.masked_softmax(X, valid_lens)


def transpose_qkv(X: Tensor, num_heads: int) -> Tensor:
    """Split the hidden axis into heads and fold them into the batch: ``(B, L, H*d) -> (B*H, L, d)``.

    Raises:
        TypeError: ``num_heads`` not a whole number.
        ValueError: ``num_heads`` below 1, or ``X`` not 3-dim with a last axis a multiple of ``num_heads``.

    Example:
        >>> transpose_qkv(torch.zeros(2, 3, 8), 2).shape
        torch.Size([4, 3, 4])
    """
    check_sizes(num_heads=num_heads)
    if X.dim() != 3 or X.shape[-1] % num_heads:
        raise ValueError(
            f"transpose_qkv: X must be (B, L, num_heads * d) with num_heads={num_heads}, got {tuple(X.shape)}"
        )
    B, L, d = X.shape[0], X.shape[1], X.shape[2] // num_heads  # sizes named, not -1: B or L may be 0
    out = X.reshape(B, L, num_heads, d)  # (B, L, H, d)
    out = out.permute(0, 2, 1, 3)  # (B, H, L, d)
    out = out.reshape(B * num_heads, L, d)  # (B*H, L, d)
    tracer = trace.active()
    if tracer is not None:
        tracer.add("transpose_qkv", [X], out, "(B, L, H*d) -> (B*H, L, d)")
    return out


def transpose_output(X: Tensor, num_heads: int) -> Tensor:
    """Undo :func:`transpose_qkv`: ``(B*H, L, d) -> (B, L, H*d)``.

    Raises:
        TypeError: ``num_heads`` not a whole number.
        ValueError: ``num_heads`` below 1, or ``X`` not 3-dim with a first axis a multiple of ``num_heads``.

    Example:
        >>> X = torch.randn(2, 3, 8)
        >>> torch.equal(transpose_output(transpose_qkv(X, 2), 2), X)
        True
    """
    check_sizes(num_heads=num_heads)
    if X.dim() != 3 or X.shape[0] % num_heads:
        raise ValueError(
            f"transpose_output: X must be (B * num_heads, L, d) with num_heads={num_heads}, got {tuple(X.shape)}"
        )
    B, L, d = X.shape[0] // num_heads, X.shape[1], X.shape[2]  # sizes named, not -1: B or L may be 0
    out = X.reshape(B, num_heads, L, d)  # (B, H, L, d)
    out = out.permute(0, 2, 1, 3)  # (B, L, H, d)
    out = out.reshape(B, L, num_heads * d)  # (B, L, H*d)
    tracer = trace.active()
    if tracer is not None:
        tracer.add("transpose_output", [X], out, "(B*H, L, d) -> (B, L, H*d)")
    return out


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
        the first call.

        Computed when first read, from the queries and keys that call kept, so a forward does only the book's two
        matmuls (``attnkit bench``, contender ``d2l``). Raises ``RuntimeError`` if they were modified in place
        since the call.
        """
        if self._scores is None and self._scored is not None:
            q, k, q_version, k_version = self._scored
            if (q._version, k._version) != (q_version, k_version):
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
        _check_book_inputs(queries, keys, values, same_features=True)
        out, weights = functional.attend(
            queries,
            keys,
            values,
            functional.Masks(valid_lens, attn_mask, is_causal),
            dropout_p=self.dropout.p if self.training else 0.0,
            need_weights=True,
            zeros_past=zeros_past,
        )
        q, k = queries.detach(), keys.detach()
        self._scored, self._scores = (q, k, q._version, k._version), None
        # For looking at, as in the book; detached, so it holds no graph (copy.deepcopy works, memory is freed).
        self.attention_weights = weights.detach() if weights is not None else None
        report_weights(self, weights)  # for attnkit.record_weights
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

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        sizes = _bind(
            "AdditiveAttention",
            args,
            kwargs,
            explicit=("key_size", "query_size", "num_hiddens", "dropout"),
            inferred=("num_hiddens", "dropout"),
        )
        h, inferred = sizes["num_hiddens"], "key_size" not in sizes
        self.W_k = _projection.make(sizes.get("key_size"), h, bias=False)
        self.W_q = _projection.make(sizes.get("query_size"), h, bias=False)
        self.w_v = _projection.make(None if inferred else h, 1, bias=False)
        self.dropout = nn.Dropout(sizes["dropout"])
        self.attention_weights: Tensor | None = None

    def forward(self, queries: Tensor, keys: Tensor, values: Tensor, valid_lens: Tensor | None) -> Tensor:
        _check_book_inputs(queries, keys, values, same_features=False)
        _projection.check_features("queries", queries, self.W_q)
        _projection.check_features("keys", keys, self.W_k)
        q = self.W_q(queries)  # (B, Lq, h); the book calls W_q before W_k
        k = self.W_k(keys)  # (B, Lk, h)
        if _unbuilt(self.w_v):
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
        report_weights(self, self.attention_weights)  # for attnkit.record_weights
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
        TypeError: at construction, a size that is not a whole number.
        ValueError: at construction, a size below 1 or ``dropout`` outside ``[0, 1)``; at a call, naming the
            argument, with the shapes, before any work: inputs that are not 3-dim, that do not fit together, or
            whose feature size is not the one the layer was built or first called with.

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

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__()
        sizes = _bind(
            "MultiHeadAttention",
            args,
            kwargs,
            explicit=("key_size", "query_size", "value_size", "num_hiddens", "num_heads", "dropout", "bias"),
            inferred=("num_hiddens", "num_heads", "dropout", "bias"),
            defaults={"bias": False},
        )
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
        _check_book_inputs(queries, keys, values, same_features=False)
        for name, x, proj in (("queries", queries, self.W_q), ("keys", keys, self.W_k), ("values", values, self.W_v)):
            _projection.check_features(name, x, proj)
        if not isinstance(is_causal, bool):
            raise TypeError(f"is_causal must be True or False, got {is_causal!r}")
        # before the projections: a lazy layer draws nothing on a mistake
        self._check_cache(cache, queries, keys, valid_lens)
        if valid_lens is not None and not isinstance(cache, KVCache):
            _check_valid_lens(valid_lens, queries.shape[0], queries.shape[1], keys.shape[1])
        B, Lq, H = queries.shape[0], queries.shape[1], self.num_heads
        attn_mask = zeros_past = None
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
                k, v, valid_lens, attn_mask, zeros_past = cache.update(
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
        output = self.attention(queries, keys, values, valid_lens, attn_mask=attn_mask, is_causal=is_causal, **extra)
        report_weights(self, self._weights_by_head)  # for attnkit.record_weights, in its layout
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
                _check_valid_lens(cache.valid_lens, B, Lq, held.shape[2], "the CrossKVCache's valid_lens")
            return
        if keys.shape[1] != Lq:
            raise ValueError(
                f"with a KVCache, keys and values are the call's new positions, as queries: queries has {Lq} "
                f"positions but keys {keys.shape[1]}: queries {tuple(queries.shape)}, keys {tuple(keys.shape)}"
            )
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


def show_heatmaps(
    matrices: Any,
    xlabel: str,
    ylabel: str,
    titles: Any = None,
    figsize: tuple[float, float] = (2.5, 2.5),
    cmap: str = "Reds",
    path: Any = None,
) -> None:
    """The book's ``show_heatmaps(matrices, xlabel, ylabel, titles=None, figsize=(2.5, 2.5), cmap='Reds')``, with
    ``path`` to save; see :func:`attnkit.plot.show_heatmaps` (needs matplotlib: ``pip install attnkit[plot]``).

    ``figsize`` is the whole figure's size in inches, as in the book (``plt.subplots(rows, cols, figsize=figsize)``):
    the Transformer chapter's ``figsize=(7, 3.5)`` on a 4 x 4 grid gives a 7 x 3.5 inch figure. (It is divided
    among the panels here, since :func:`attnkit.plot.show_heatmaps` reads ``figsize`` per panel.) ``titles``: one
    per column (more are ignored, as in the book).

    Returns nothing, as the book's does: a notebook shows the figure once (a returned figure, as the cell's value,
    would be shown a second time). :func:`attnkit.plot.show_heatmaps` returns it; the figure stays open in pyplot
    (``plt.gcf()``), as the book's does.

    Raises:
        ValueError: fewer ``titles`` than columns, and what :func:`attnkit.plot.show_heatmaps` raises.
    """
    import numpy as np  # with matplotlib, which needs it; attnkit itself does not

    from attnkit.plot import show_heatmaps as draw

    shape = tuple(np.shape(matrices))
    if len(shape) in (2, 3, 4):
        rows, cols = ((1, 1) + shape[:-2])[-2:]  # 2-D and 3-D are one row, as in attnkit.plot.show_heatmaps
        if titles and len(titles) < cols:
            raise ValueError(
                f"titles must have one per column, {cols} for matrices {shape}, got {len(titles)}: {list(titles)!r}"
            )
        figsize = (figsize[0] / max(cols, 1), figsize[1] / max(rows, 1))  # the book's figure -> per panel
    draw(matrices, xlabel, ylabel, titles=titles, figsize=figsize, cmap=cmap, path=path)


def _check_book_inputs(queries: Tensor, keys: Tensor, values: Tensor, *, same_features: bool) -> None:
    """The book's layers take 3-dim ``(B, L, features)`` inputs; a ValueError naming the argument otherwise."""
    if not functional.check_qkv(queries, keys, values, ("queries", "keys", "values"), same_features=same_features):
        raise ValueError(
            "queries, keys and values must be 3-dim, (B, Lq, d), (B, Lk, d) and (B, Lk, dv), as in the book (heads "
            f"are folded into the batch: transpose_qkv), got queries {tuple(queries.shape)}, keys "
            f"{tuple(keys.shape)}, values {tuple(values.shape)}"
        )


def _unbuilt(module: nn.Module) -> bool:
    """A lazy layer whose parameters are not drawn yet."""
    return isinstance(module, LazyModuleMixin) and module.has_uninitialized_params()


def _bind(
    cls: str,
    args: tuple,
    kwargs: dict[str, Any],
    *,
    explicit: tuple[str, ...],
    inferred: tuple[str, ...],
    defaults: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Bind the book's arguments to its explicit-size signature or to its newer size-inferring one.

    The explicit form is recognised by its extra leading sizes: more arguments than the newer form takes, or
    any of ``key_size``/``query_size``/``value_size`` by name. The sizes and ``dropout`` are checked here, before
    the caller draws any parameter, with the messages of attnkit's layers.
    """
    defaults = defaults or {}
    sizes_named = any(name in kwargs for name in ("key_size", "query_size", "value_size"))
    names = explicit if sizes_named or len(args) + len(kwargs) > len(inferred) else inferred
    parameters = [
        inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=defaults.get(n, inspect.Parameter.empty))
        for n in names
    ]
    try:
        bound = inspect.Signature(parameters).bind(*args, **kwargs)
    except TypeError as e:
        raise TypeError(f"{cls}({', '.join(explicit)}) or {cls}({', '.join(inferred)}): {e}") from None
    bound.apply_defaults()
    sizes = dict(bound.arguments)
    check_sizes(**{n: v for n, v in sizes.items() if n not in ("dropout", "bias")})
    check_dropout(sizes["dropout"])
    return sizes


def _check_valid_lens(valid_lens: object, B: int, Lq: int, Lk: int, name: str = "valid_lens") -> None:
    """``valid_lens`` of the batch, checked before the heads are folded into it (a message in the caller's sizes
    and values)."""
    if not isinstance(valid_lens, Tensor):
        raise TypeError(f"{name} must be a tensor of lengths, got {type(valid_lens).__name__}")
    if valid_lens.shape not in ((B,), (B, Lq)):
        raise ValueError(
            f"{name} must have shape (B,) = ({B},) or (B, Lq) = ({B}, {Lq}), got {tuple(valid_lens.shape)}"
        )
    as_lengths(valid_lens, name, Lk)  # whole numbers in [0, Lk], shown as given
