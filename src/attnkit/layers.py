"""Attention layers: DotProductAttention, AdditiveAttention, MultiHeadAttention.

Keyword-friendly modules on top of :mod:`attnkit.functional`. Inputs are batch first, ``(B, L, features)``;
inside, one layout ``(B, H, L, d)``. Masks follow :mod:`attnkit.masks` (``True`` = may attend). Each layer reports
its weights to :func:`attnkit.record_weights` (:mod:`attnkit.recording`), computed beside the fast path only while
a recording is open.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from attnkit import _projection, dispatch, mods, stats, trace
from attnkit._validate import check_dropout, check_qkv, check_sizes
from attnkit.cache import CrossKVCache, KVCache, Positions
from attnkit.functional import Masks, attend, attention_weights
from attnkit.plan import Plan
from attnkit.recording import is_recording, report_weights, wants_stats

__all__ = ["AdditiveAttention", "DotProductAttention", "MultiHeadAttention"]

# Where they were before recording had a module of its own (attnkit.recording): kept for code that imports them here.
from attnkit.recording import WeightRecord as WeightRecord  # noqa: E402
from attnkit.recording import record_weights as record_weights  # noqa: E402

# B batch, H heads, Hkv key/value heads, Lq/Lk query/key length, d head dim, h hidden size


class _Attention(nn.Module):
    """What the attention layers share: the backend, dropout only in training, and recording."""

    _attnkit_traced = True  # attnkit.trace names this module and attributes its steps to it

    def __init__(self, dropout: float, backend: str, sink_heads: int | None = None) -> None:
        super().__init__()
        self.dropout = check_dropout(dropout)
        dispatch.check_name(backend)  # a misspelt name is said when the layer is made, not at its first call
        self.backend = backend
        # One learned attention-sink logit per head (gpt-oss), starting at 0; None without sinks.
        self.sinks = None if sink_heads is None else nn.Parameter(torch.zeros(sink_heads))

    def _dropout_p(self) -> float:
        return self.dropout if self.training else 0.0

    def _scoring(self, queries: Tensor, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """What the call scores: ``(q, k, w_v)`` from the inputs (``w_v`` for additive scoring, else None)."""
        return queries, keys, None

    def forward(
        self,
        queries: Tensor,
        keys: Tensor,
        values: Tensor,
        valid_lens: Tensor | None = None,
        *,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
        mask_mod: mods.MaskFn | None = None,
        score_mod: mods.ScoreFn | None = None,
        plan: Plan | None = None,
    ) -> Tensor:
        """Args: queries ``(B, [H,] Lq, d)`` (``(B, Lq, query_size)`` for additive attention), keys
        ``(B, [Hkv,] Lk, d)`` (``(B, Lk, key_size)``), values ``(B, [Hkv,] Lk, dv)``; valid_lens ``(B,)`` or
        ``(B, Lq)``; attn_mask, is_causal, mask_mod, score_mod, plan as in
        :func:`attnkit.scaled_dot_product_attention`. Returns ``(B, [H,] Lq, dv)``."""
        masks = Masks(valid_lens, attn_mask, is_causal, mask_mod, score_mod, plan)
        q, k, w_v = self._scoring(queries, keys, values)
        out, _, lse = attend(
            q,
            k,
            values,
            masks,
            w_v=w_v,
            sinks=self.sinks,
            dropout_p=self._dropout_p(),
            backend=self.backend,
            need_lse=wants_stats(self),
        )  # (B, [H,] Lq, dv), (B, H, Lq) or None
        self._record(q, k, masks, w_v, lse=lse)
        return out

    def _record(
        self,
        q: Tensor,
        k: Tensor,
        masks: Masks,
        w_v: Tensor | None = None,
        positions: Positions | None = None,
        lse: Tensor | None = None,
    ) -> None:
        """Compute the weights beside the fast path, or their statistics: detached, without the output (see the
        module docstring); ``positions``: where a cache's queries and keys stand; ``lse (B, H, Lq)``: each row's
        log-sum-exp, when the fast path gave it."""
        if not is_recording():  # the cost while nothing records: one lookup
            return

        def weights() -> Tensor:
            with torch.no_grad(), trace.paused():
                return attention_weights(q, k, w_v=w_v, sinks=self.sinks, **masks._asdict())

        def parts() -> stats.Parts:
            query_positions, key_positions = positions or (None, None)
            with torch.no_grad(), trace.paused():
                found, three_d = stats.parts(q, k, w_v=w_v, sinks=self.sinks, **masks._asdict())
            return found._replace(query_positions=query_positions, key_positions=key_positions, lse=lse)

        report_weights(self, weights, kv_heads=k.shape[1] if k.dim() == 4 else None, parts=parts)


class DotProductAttention(_Attention):
    """Scaled dot-product attention, ``softmax(q k^T / sqrt(d)) v``.

    Args:
        dropout: on the weights, in training mode only.
        backend: ``"auto"`` or a backend name (see :mod:`attnkit.dispatch`).
        sinks: learn one attention-sink logit per head for this many heads (``self.sinks``, ``(H,)``, starting at
            0; 1 for 3-dim inputs): ``a[i, j] = exp(s_ij) / (exp(sink_h) + sum_j exp(s_ij))``. ``None``: no sinks.

    Example:
        >>> attn = DotProductAttention(0.5).eval()
        >>> attn(torch.ones(2, 1, 2), torch.ones(2, 10, 2), torch.ones(2, 10, 4), torch.tensor([2, 6])).shape
        torch.Size([2, 1, 4])
    """

    def __init__(self, dropout: float = 0.0, *, backend: str = "auto", sinks: int | None = None) -> None:
        if isinstance(sinks, bool):
            raise TypeError(
                f"DotProductAttention(sinks=H) takes the number of heads to learn a sink for (1 for 3-dim inputs), "
                f"got {sinks!r}: this layer cannot know its heads before its first call"
            )
        if sinks is not None:
            check_sizes(sinks=sinks)
        super().__init__(dropout, backend, sinks)


class AdditiveAttention(_Attention):
    """Additive (Bahdanau) attention: ``s[i, j] = w_v . tanh(W_q q_i + W_k k_j)``.

    Args:
        num_hiddens: ``h``, the size of the projected queries and keys.
        dropout: on the weights, in training mode only.
        query_size, key_size: input feature sizes; inferred at the first call when ``None``.
        backend: ``"auto"`` (the tile engine when the ``(B, Lq, Lk, h)`` features would be large) or a name.

    Example:
        >>> attn = AdditiveAttention(8, query_size=20, key_size=2).eval()
        >>> attn(torch.ones(2, 1, 20), torch.ones(2, 10, 2), torch.ones(2, 10, 4), torch.tensor([2, 6])).shape
        torch.Size([2, 1, 4])
    """

    def __init__(
        self,
        num_hiddens: int,
        dropout: float = 0.0,
        *,
        query_size: int | None = None,
        key_size: int | None = None,
        backend: str = "auto",
    ) -> None:
        super().__init__(dropout, backend)
        check_sizes(num_hiddens=num_hiddens, query_size=query_size, key_size=key_size)
        self.num_hiddens = num_hiddens
        self.W_q = _projection.make(query_size, num_hiddens, bias=False)
        self.W_k = _projection.make(key_size, num_hiddens, bias=False)
        self.w_v = nn.Linear(num_hiddens, 1, bias=False)

    def _scoring(self, queries: Tensor, keys: Tensor, values: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
        """``queries (B, Lq, query_size)``, ``keys (B, Lk, key_size)`` projected: ``(B, Lq, h)``, ``(B, Lk, h)``,
        and ``w_v (h,)``."""
        check_qkv(queries, keys, values, ("queries", "keys", "values"), same_features=False)
        _projection.check_features("queries", queries, self.W_q)
        _projection.check_features("keys", keys, self.W_k)
        q = self.W_q(queries)  # (B, Lq, h)
        k = self.W_k(keys)  # (B, Lk, h)
        return q, k, self.w_v.weight[0]  # w_v: (1, h) -> (h,)


class MultiHeadAttention(_Attention):
    """Multi-head attention, with grouped-query attention (``num_kv_heads``) and cross-attention.

    ``W_q, W_k, W_v, W_o`` are named as in the book, so a book ``state_dict`` loads unchanged.

    Args:
        num_hiddens: output size, ``H * d``.
        num_heads: ``H``; must divide ``num_hiddens``.
        dropout: on the weights, in training mode only.
        query_size, key_size, value_size: input feature sizes; inferred at the first call when ``None``.
        num_kv_heads: ``Hkv`` key/value heads (``H`` by default; 1 is multi-query attention); must divide ``H``.
        bias: biases in the four projections.
        backend: ``"auto"`` or a backend name.
        sinks: learn one attention-sink logit per head (``self.sinks``, ``(H,)``, starting at 0; gpt-oss):
            ``a[i, j] = exp(s_ij) / (exp(sink_h) + sum_j exp(s_ij))``, so a head may attend to nothing.

    Raises:
        ValueError: ``num_hiddens % num_heads != 0`` or ``num_heads % num_kv_heads != 0``.

    Example:
        >>> mha = MultiHeadAttention(512, 8, dropout=0.1)
        >>> x = torch.randn(10, 60, 512)
        >>> mha(x, x, x).shape
        torch.Size([10, 60, 512])
    """

    def __init__(
        self,
        num_hiddens: int,
        num_heads: int,
        dropout: float = 0.0,
        *,
        query_size: int | None = None,
        key_size: int | None = None,
        value_size: int | None = None,
        num_kv_heads: int | None = None,
        bias: bool = False,
        backend: str = "auto",
        sinks: bool = False,
    ) -> None:
        if not isinstance(sinks, bool):
            raise TypeError(f"sinks must be True or False, got {sinks!r}")
        check_sizes(num_heads=num_heads)
        super().__init__(dropout, backend, num_heads if sinks else None)
        num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        check_sizes(
            num_hiddens=num_hiddens,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            query_size=query_size,
            key_size=key_size,
            value_size=value_size,
        )
        if num_hiddens % num_heads:
            raise ValueError(f"num_hiddens ({num_hiddens}) must be a multiple of num_heads ({num_heads})")
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_hiddens, self.num_heads, self.num_kv_heads = num_hiddens, num_heads, num_kv_heads
        self.head_dim = num_hiddens // num_heads
        kv_hiddens = num_kv_heads * self.head_dim
        self.bias = bias
        self.W_q = _projection.make(query_size, num_hiddens, bias=bias)
        self.W_k = _projection.make(key_size, kv_hiddens, bias=bias)
        self.W_v = _projection.make(value_size, kv_hiddens, bias=bias)
        self.W_o = nn.Linear(num_hiddens, num_hiddens, bias=bias)
        self._stacked = _projection.Stacked()  # the q/k/v weights stacked, for decode steps

    def forward(
        self,
        queries: Tensor,
        keys: Tensor,
        values: Tensor,
        valid_lens: Tensor | None = None,
        *,
        attn_mask: Tensor | None = None,
        is_causal: bool = False,
        mask_mod: mods.MaskFn | None = None,
        score_mod: mods.ScoreFn | None = None,
        cache: KVCache | CrossKVCache | None = None,
        plan: Plan | None = None,
    ) -> Tensor:
        """Args: queries ``(B, Lq, query_size)``, keys ``(B, Lk, key_size)``, values ``(B, Lk, value_size)``;
        valid_lens ``(B,)`` or ``(B, Lq)``; attn_mask ``(Lq, Lk)``, ``(B, Lq, Lk)`` or ``(B, H, Lq, Lk)``;
        mask_mod, score_mod, plan as in :func:`attnkit.scaled_dot_product_attention` (``h`` is the query head; one
        plan serves every layer and call of its lengths, :func:`attnkit.make_plan`);
        cache: a :class:`~attnkit.KVCache` (self-attention: this call's keys and values are appended to it and the
        queries attend over all it holds; ``valid_lens (B,)`` then counts each row's real new tokens, and
        ``is_causal`` places query ``i`` at its row's position ``length_b + i``; no other mask) or a
        :class:`~attnkit.CrossKVCache` (keys and values projected at its first call, reused at the later ones,
        with the ``valid_lens`` of the first). Returns ``(B, Lq, num_hiddens)``."""
        check_qkv(queries, keys, values, ("queries", "keys", "values"), same_features=False)
        if queries.dim() != 3:
            raise ValueError(f"queries must be (B, Lq, query_size), got {tuple(queries.shape)}")
        for name, x, proj in (("queries", queries, self.W_q), ("keys", keys, self.W_k), ("values", values, self.W_v)):
            _projection.check_features(name, x, proj)
        if isinstance(cache, KVCache):
            cache.check_new(queries, keys)
        elif isinstance(cache, CrossKVCache):
            cache.check_batch(queries)
        B, Lq, _ = queries.shape
        Lk = keys.shape[1]
        H, Hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        tracer = trace.active()
        zeros_past = None  # (B,): a KVCache's keys and values are zeros past each row's length
        positions: Positions | None = None  # where a KVCache's queries and keys stand, for recording
        if isinstance(cache, CrossKVCache) and cache.keys is not None and cache.values is not None:
            q_flat = _projection.linear(queries, self.W_q)  # (B, Lq, H*d)
            k, v, valid_lens = cache.keys, cache.values, cache.valid_lens  # projected at the first call
            kv_split = []
        else:
            if isinstance(cache, KVCache) and _projection.same(queries, keys) and _projection.same(keys, values):
                # decoding self-attention: one product, the weights stacked (made again at each generation)
                projections = (self.W_q, self.W_k, self.W_v)
                q_flat, k_flat, v_flat = self._stacked(queries, projections, cache=cache)
            else:
                q_flat = _projection.linear(queries, self.W_q)  # (B, Lq, H*d)
                k_flat, v_flat = _projection.linear(keys, self.W_k), _projection.linear(values, self.W_v)
            k = k_flat.view(B, Lk, Hkv, d).transpose(1, 2)  # (B, Hkv, Lk, d)
            v = v_flat.view(B, Lk, Hkv, d).transpose(1, 2)  # (B, Hkv, Lk, d)
            kv_split = [("keys", k_flat, k), ("values", v_flat, v)]
        q = q_flat.view(B, Lq, H, d).transpose(1, 2)  # (B, H, Lq, d)
        split = [("queries", q_flat, q), *kv_split]
        if tracer is not None:
            for name, flat, heads in split:
                tracer.add("split heads", [flat], heads, f"{name}: (B, L, H*d) -> (B, H, L, d)")
        if isinstance(attn_mask, Tensor) and attn_mask.dim() == 3:  # anything else: the mask checks name it
            attn_mask = attn_mask.unsqueeze(1)  # (B, Lq, Lk) -> (B, 1, Lq, Lk)
        if isinstance(cache, CrossKVCache):
            if cache.keys is None:
                cache.fill(k, v, valid_lens)
        elif isinstance(cache, KVCache):
            if attn_mask is not None or mask_mod is not None or score_mod is not None or plan is not None:
                raise ValueError(
                    "with a KVCache, the masks are valid_lens (B,) (each row's real new tokens) and is_causal; "
                    "attn_mask, mask_mod, score_mod and plan are not supported (their positions would not be the rows' "
                    "own)"
                )
            k, v, valid_lens, attn_mask, zeros_past, positions = cache.update(k, v, valid_lens, is_causal)
            if valid_lens is not None or attn_mask is not None:
                is_causal = False  # now in valid_lens or attn_mask, by each row's own positions
        elif cache is not None:
            raise TypeError(f"cache must be an attnkit.KVCache or attnkit.CrossKVCache, got {type(cache).__name__}")
        masks = Masks(valid_lens, attn_mask, is_causal, mask_mod, score_mod, plan)
        made = isinstance(cache, KVCache)  # its lengths, as update() made them
        out, lse = self._attend(q, k, v, masks, zeros_past, wants_stats(self), made)  # (B, H, Lq, d), (B, H, Lq)
        self._record(q, k, masks, positions=positions, lse=lse)
        merged = out.transpose(1, 2).reshape(B, Lq, H * d)  # (B, H, Lq, d) -> (B, Lq, H*d)
        if tracer is not None:
            tracer.add("merge heads", [out], merged, "(B, H, Lq, d) -> (B, Lq, H*d)")
        return _projection.linear(merged, self.W_o)  # (B, Lq, num_hiddens)

    def _apply(self, fn: Any, recurse: bool = True) -> MultiHeadAttention:
        self._stacked.clear()  # derived from the parameters, which .to(), .double(), .cuda() replace
        return super()._apply(fn, recurse)

    def _attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        masks: Masks,
        zeros_past: Tensor | None,
        need_lse: bool = False,
        lengths_made: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Attention on the split heads: ``(B, H, Lq, d)``, ``(B, Hkv, Lk, d)`` twice -> ``(B, H, Lq, d)``, and
        each row's log-sum-exp ``(B, H, Lq)`` where ``need_lse`` and the backend had it (else ``None``);
        ``zeros_past (B,)``: a KVCache's promise (:meth:`attnkit.KVCache.update`)."""
        out, _, lse = attend(
            q,
            k,
            v,
            masks,
            sinks=self.sinks,
            dropout_p=self._dropout_p(),
            backend=self.backend,
            zeros_past=zeros_past,
            need_lse=need_lse,
            lengths_made=lengths_made,
        )  # (B, H, Lq, d), (B, H, Lq) or None
        return out, lse

    @classmethod
    def from_torch(cls, m: nn.MultiheadAttention, *, batch_first: bool | None = None) -> MultiHeadAttention:
        """An equal attnkit module from a ``torch.nn.MultiheadAttention``.

        Packed ``in_proj_weight`` or separate q/k/v weights (``kdim``/``vdim``), with or without biases.

        attnkit layers are always batch first, ``(B, L, E)``. A layer made with ``batch_first=False`` takes
        ``(L, B, E)``, and the same tensors fed to the new module would be read with batch and length swapped, a
        silently wrong result: such a layer is refused unless ``batch_first=True`` says that the caller will feed
        the new module ``(B, L, E)`` (``x.transpose(0, 1)`` of what the old one took).

        Masks: torch's ``key_padding_mask`` ``(B, Lk)`` is ``True`` = *ignore*; here ``True`` = *may attend*, so
        pass ``attn_mask=~key_padding_mask[:, None, None, :]`` (or ``valid_lens`` when the padding is at the
        end). torch's boolean ``attn_mask`` is also ``True`` = ignore: pass ``~attn_mask``; a float one as is.

        Raises:
            ValueError: for ``add_bias_kv`` or ``add_zero_attn``, which have no attnkit equivalent; for a
                ``batch_first=False`` layer unless ``batch_first=True`` is given; for ``batch_first=False``.
        """
        if m.bias_k is not None or m.add_zero_attn:
            raise ValueError("from_torch: add_bias_kv and add_zero_attn have no attnkit equivalent")
        if batch_first is False:
            raise ValueError("from_torch: attnkit layers take (B, L, E) only; batch_first=False is not supported")
        if not m.batch_first and batch_first is None:
            raise ValueError(
                "from_torch: this torch.nn.MultiheadAttention has batch_first=False, so it takes (L, B, E); attnkit "
                "layers take (B, L, E). Feed the new module x.transpose(0, 1) and pass batch_first=True to say so"
            )
        E = m.embed_dim
        has_bias = m.in_proj_bias is not None
        new = cls(E, m.num_heads, m.dropout, query_size=E, key_size=m.kdim, value_size=m.vdim, bias=has_bias).to(
            device=m.out_proj.weight.device, dtype=m.out_proj.weight.dtype
        )
        with torch.no_grad():
            if m.in_proj_weight is not None:
                w_q, w_k, w_v = m.in_proj_weight.chunk(3)  # (3E, E) -> 3 x (E, E)
            else:
                w_q, w_k, w_v = m.q_proj_weight, m.k_proj_weight, m.v_proj_weight
            for proj, w in ((new.W_q, w_q), (new.W_k, w_k), (new.W_v, w_v), (new.W_o, m.out_proj.weight)):
                proj.weight.copy_(w)
            if has_bias:
                for proj, b in zip((new.W_q, new.W_k, new.W_v), m.in_proj_bias.chunk(3), strict=True):
                    proj.bias.copy_(b)
                new.W_o.bias.copy_(m.out_proj.bias)
        return new.train(m.training)

    def to_torch(self, *, batch_first: bool = True) -> nn.MultiheadAttention:
        """The equal ``torch.nn.MultiheadAttention`` (see :meth:`from_torch` for the masks).

        Raises:
            ValueError: with ``num_kv_heads != num_heads`` or a query size other than ``num_hiddens``, which
                torch cannot express, or with sizes not yet inferred.
        """
        if self.num_kv_heads != self.num_heads:
            raise ValueError(
                f"to_torch: torch.nn.MultiheadAttention has no grouped-query attention "
                f"(num_kv_heads={self.num_kv_heads}, num_heads={self.num_heads})"
            )
        if self.sinks is not None:
            raise ValueError("to_torch: torch.nn.MultiheadAttention has no attention sinks (this layer has sinks=True)")
        projections = (self.W_q, self.W_k, self.W_v)
        if any(isinstance(p, nn.LazyLinear) and p.has_uninitialized_params() for p in projections):
            raise ValueError("to_torch: input sizes are not known yet; call the module once or give the sizes")
        sizes = [p.weight.shape[1] for p in projections]
        E = self.num_hiddens
        if sizes[0] != E:
            raise ValueError(f"to_torch: torch needs query_size == num_hiddens ({E}), got {sizes[0]}")
        weight = self.W_o.weight
        m = nn.MultiheadAttention(
            E,
            self.num_heads,
            dropout=self.dropout,
            bias=self.bias,
            kdim=sizes[1],
            vdim=sizes[2],
            batch_first=batch_first,
            device=weight.device,
            dtype=weight.dtype,
        )
        with torch.no_grad():
            if m.in_proj_weight is not None:
                m.in_proj_weight.copy_(torch.cat([self.W_q.weight, self.W_k.weight, self.W_v.weight]))  # (3E, E)
            else:
                m.q_proj_weight.copy_(self.W_q.weight)
                m.k_proj_weight.copy_(self.W_k.weight)
                m.v_proj_weight.copy_(self.W_v.weight)
            m.out_proj.weight.copy_(self.W_o.weight)
            if self.bias:
                m.in_proj_bias.copy_(torch.cat([self.W_q.bias, self.W_k.bias, self.W_v.bias]))  # (3E,)
                m.out_proj.bias.copy_(self.W_o.bias)
        return m.train(self.training)
