"""Small helpers shared by the backends."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from attnkit import mods
from attnkit.backends.contract import Call, scores_bounded
from attnkit.masks import Mask, all_finite, compute_dtype

# B batch, H heads, Hkv key/value heads, L length, D head dim


def repeat_kv(x: Tensor, heads: int) -> Tensor:
    """Give each of ``heads`` query heads its key/value head: head ``h`` uses ``h // (heads // Hkv)``.

    The same grouping as ``torch.nn.functional.scaled_dot_product_attention(enable_gqa=True)``.
    """
    group = heads // x.shape[1]
    return x if group == 1 else x.repeat_interleave(group, dim=1)  # (B, Hkv, L, D) -> (B, H, L, D)


def additive_scores(q: Tensor, k: Tensor, w_v: Tensor) -> tuple[Tensor, Tensor]:
    """Bahdanau scores ``s[i, j] = w_v . tanh(q[i] + k[j])`` and the ``tanh`` features they came from."""
    pre = q[..., :, None, :] + k[..., None, :, :]  # (B, H, Lq, Lk, D)
    # In place when autograd does not need `pre`: the largest tensor of additive attention, held once.
    features = pre.tanh() if pre.requires_grad else pre.tanh_()  # (B, H, Lq, Lk, D)
    return features @ w_v, features  # (B, H, Lq, Lk), (B, H, Lq, Lk, D)


def dense_mask(call: Call, dtype: torch.dtype) -> tuple[Tensor | None, Tensor | None]:
    """The whole mask of ``call`` as ``allowed`` and a float ``bias`` (the mask's, plus a score_mod that is a bias,
    such as ALiBi), each ``(B|1, H|1, Lq|1, Lk)`` in ``dtype`` or ``None``: for the backends that take it dense."""
    allowed, bias = call.mask.full(dtype)
    if call.score_mod is not None:
        assert isinstance(call.score_mod, mods.ScoreMod)  # the backends that call this support only a bias
        B, H = call.q.shape[:2]
        rows, cols = (0, call.mask.num_queries), (0, call.mask.num_keys)
        score_bias = bias_of(call.score_mod, mods.indices(B, H, rows, cols, call.q.device), dtype)
        bias = score_bias if bias is None else bias + score_bias  # (B|1, H|1, Lq, Lk)
    return allowed, bias


def bias_of(score_mod: mods.ScoreMod, idx: tuple, dtype: torch.dtype) -> Tensor:
    """A score_mod that is a bias, over the block of the index tensors ``idx``
    (:func:`attnkit.mods.evaluate.indices`), in ``dtype``: broadcastable to ``(B, H, n, m)``."""
    found = score_mod.bias(*idx)
    if found is None:  # a ScoreMod subclass that overrides bias() and returns None
        raise TypeError(f"{type(score_mod).__name__}.bias() returned None: return the bias, or do not override it")
    return found.to(dtype)


def zero_dead(
    q: Tensor, k: Tensor, v: Tensor, mask: Mask, zeros_past: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Zero the keys and values no query may see (padding) and the queries that may see no key (empty rows),
    as the one combined mask says (:meth:`attnkit.masks.Mask.liveness`), so that whatever they hold, NaN included,
    reaches neither the output nor any gradient (``0 * NaN`` in ``p @ v`` or ``dS^T Q`` is NaN). Returns new tensors
    where something is dead; the inputs are left as they were, and the zeroed positions get zero gradients.

    ``zeros_past (B,)``: each example's keys and values are zeros from that position on (``Call.zeros_past``, a
    :class:`~attnkit.KVCache`'s promise), so dead keys there need no check. On a ragged decode step that check
    was the largest cost after the products.

    Every backend calls this before it computes.
    """
    live_keys, live_rows = mask.liveness  # (B|1, H|1, Lk), (B|1, H|1, Lq), or None when all are live
    if live_rows is None and live_keys is None:
        return q, k, v  # (a decode step's common case: no allocation)
    zero = torch.zeros((), dtype=q.dtype, device=q.device)
    if live_rows is not None:
        q = torch.where(live_rows[..., None], q, zero)  # (B, H, Lq, D)
    if live_keys is not None:
        Hkv = k.shape[1]
        if live_keys.shape[1] not in (1, Hkv):
            # a per-query-head mask with grouped key/value heads: a key/value head is live if any of its group is
            live_keys = live_keys.unflatten(1, (Hkv, -1)).any(dim=2)  # (B|1, Hkv, Lk)
        if not _finite_suffixes(mask, k, v, zeros_past):
            k = torch.where(live_keys[..., None], k, zero)  # (B, Hkv, Lk, D)
            v = torch.where(live_keys[..., None], v, zero)  # (B, Hkv, Lk, Dv)
    return q, k, v


def no_gradient_from_empty_rows(mask: Mask, out: Tensor) -> Tensor:
    """``out (B, H, Lq, Dv)``, its rows that the mask lets see no key passing no gradient back. Those rows are zeros
    whatever q, k, v and the sinks hold, so their output gradient must reach none of them; an engine's backward
    multiplies it by their zero weights, and NaN there (``torch.where``'s backward through a ``sqrt`` at 0 gives
    it) would fill dv and dsinks (a tester's finding: reference and tiles). The values are unchanged. Called on every
    engine's output (:func:`attnkit.functional.attend`), outside a traced graph: the graph backend, which runs
    there, zeroes such rows itself. Rows a score_mod's -inf empties are not the mask's: each engine that takes a
    score_mod keeps their output gradient from its backward itself (it knows them once it has summed the row)."""
    if not (torch.is_grad_enabled() and out.requires_grad) or torch.compiler.is_compiling():
        return out
    live_rows = mask.liveness[1]  # (B|1, H|1, Lq) or None when every row sees some key
    if live_rows is None:
        return out
    return torch.where(live_rows[..., None], out, torch.zeros((), dtype=out.dtype, device=out.device))


def _finite_suffixes(mask: Mask, k: Tensor, v: Tensor, zeros_past: Tensor | None) -> bool:
    """True when the dead keys form a suffix of each example (only ``valid_lens`` and ``is_causal`` hide keys:
    padding, a cache past each row's length) and hold only finite keys and values: then they need no zeroing
    (``0 * finite`` is 0, and a hidden key gets no gradient). Only the band from the shortest example's end on is
    read, not the whole cache (a decode step of a ragged batch would otherwise copy all of it)."""
    if torch.is_grad_enabled() and (k.requires_grad or v.requires_grad):
        return False  # zeroed, so that a dead key's gradient is exactly zero whatever it holds
    counts = mask.live_key_counts  # (B|1, 1, 1) or None
    if counts is None:
        return False
    if zeros_past is not None and bool((counts.view(-1) >= zeros_past).all()):
        return True  # every dead key lies past its example's length: zeros
    shortest = int(counts.min())
    # one reduction: a sum is finite only if every term is (a finite sum that overflows reads as not: zeroed)
    return bool(torch.isfinite(k[:, :, shortest:].sum() + v[:, :, shortest:].sum()))


def kernel_backward_safe(q: Tensor, v: Tensor, dout: Tensor) -> bool:
    """Whether a fused kernel's backward (PyTorch's CPU flash kernel's) meets no ``0 * inf`` and no NaN at a pair a
    row may not see: it recomputes that pair's weight as ``exp(score - inf - lse)`` and multiplies it by
    ``dout . v - delta``. So every query must be finite (``-inf + NaN`` is NaN, and a query that holds NaN would put
    it into the values' gradients of keys it may not see), and every ``dout . v`` bounded below the largest number
    (so is each row's delta, ``|out| <= max |v|``): one read of each. False sends the backward to
    :func:`attnkit.backends.tiles.softmax.exact_grads`."""
    return all_finite(q) and scores_bounded(dout, v, 1.0, compute_dtype(q.dtype))


def nan_rows_stay_nan(call: Call, out: Tensor) -> Tensor:
    """``out (B, H, Lq, Dv)`` NaN in the rows whose query holds NaN and sees some key. PyTorch's CPU kernel gives
    such a row zeros at some sizes (its largest score, NaN, reads as a row with no key); the reference and the math
    give NaN, which says where the input went wrong. One read of the queries."""
    nan_rows = call.q.detach().sum(dim=-1).isnan()  # (B, H, Lq): those, and finite rows whose sum overflows
    if not bool(nan_rows.any()):
        return out
    nan_rows = nan_rows & call.q.detach().isnan().any(dim=-1)  # (B, H, Lq): NaN itself (a reviewer's finding)
    live_rows = call.mask.liveness[1]  # (B|1, H|1, Lq) or None: a row that sees no key is zeros, NaN or not
    if live_rows is not None:
        nan_rows = nan_rows & live_rows  # (B, H, Lq)
    return out.masked_fill(nan_rows[..., None], float("nan"))


def first_order_only(backend: str) -> None:
    """Called first in the backward of a backend whose backward recomputes outside autograd: under
    ``create_graph=True`` (a gradient penalty, a Hessian-vector product) autograd would record nothing of it and a
    second derivative would silently miss its share, so it raises instead. Outside ``create_graph`` autograd runs a
    backward without grad, so the rest of it records nothing. (``once_differentiable`` raises only when the incoming
    gradient requires grad, which a gradient penalty's does not, and it hides ``create_graph`` from this check.)

    Raises:
        RuntimeError: naming the backend and the one that differentiates twice.
    """
    if torch.is_grad_enabled():
        raise RuntimeError(
            f"the {backend} backend's backward cannot be differentiated again (create_graph=True): for second "
            "derivatives run the call with backend='reference'"
        )


def probe(dtype: torch.dtype, device: torch.device) -> tuple[Tensor, ...]:
    """One score, of query 0 and key 0 of example 0 and head 0: the arguments to run a score_mod on once
    (:func:`attnkit.mods.closure.grad_inputs`)."""
    zero = torch.zeros((1, 1, 1, 1), dtype=torch.long, device=device)
    return (torch.zeros((1, 1, 1, 1), dtype=dtype, device=device), zero, zero, zero, zero)


class Watched:
    """The tensors the backward pass reads again through the mask and the modifiers (lengths, masks, a mask_mod's
    ids, what a score_mod closes over), with their versions at the forward pass: the recomputing backward would
    silently use new values if one were changed in place in between, where autograd raises."""

    def __init__(self, tensors: list[Tensor]) -> None:
        self.versions = [(t, t._version) for t in tensors]

    @classmethod
    def of(cls, call: Call) -> Watched:
        mask = call.mask
        tensors = [t for t in (mask.valid_lens, mask.bool_mask, mask.bias) if t is not None]
        for fn in (mask.mask_mod, call.score_mod):
            if fn is not None:
                read = call.tensors_read(fn)
                assert read is not None  # SUPPORTS: refused under autograd otherwise
                tensors += read
        return cls(tensors)

    def check(self, backend: str) -> None:
        for t, version in self.versions:
            if t._version != version:
                raise RuntimeError(
                    f"a tensor of shape {tuple(t.shape)} that this attention call reads (a mask, lengths, or what its "
                    f"mask_mod or score_mod closes over) was modified in place between the forward and the backward "
                    f"pass; the {backend} backend reads it again to recompute: clone it before changing it"
                )


def row_sinks(sinks: Tensor, mask: Mask, shape: torch.Size, dtype: torch.dtype) -> Tensor:
    """Each query row's sink logit (:meth:`~attnkit.masks.Mask.sink_logits`) in ``dtype``, ``(B, H, Lq)`` for inputs
    of ``shape`` ``(B, H, Lq, ...)``: a view where it can be (copy it before writing to it)."""
    B, H, Lq = shape[:3]
    return mask.sink_logits(sinks.to(dtype))[..., 0].expand(B, H, Lq)  # (B|1, H, Lq|1, 1) -> (B, H, Lq)


def sinks_grad(sinks: Tensor, mask: Mask, lse: Tensor | Sequence[Tensor | None], delta: Tensor) -> Tensor:
    """The gradient of the sinks ``(H,)`` from each row's log-sum-exp ``lse`` and ``delta = sum(dout * out)``
    ``(B, H, Lq)``: d lse / d sink is the sink's weight, ``exp(sink - lse)``, and d out / d sink is minus that weight
    times the output, so each row adds ``-weight * delta`` (the backends that recompute the weights share this).
    ``lse``: one tensor, or terms to subtract in turn (:class:`~attnkit.backends.tiles.softmax.LogSumExp`; ``None``
    is none)."""
    terms = (lse,) if isinstance(lse, Tensor) else tuple(t for t in lse if t is not None)
    logit = row_sinks(sinks, mask, delta.shape, delta.dtype)  # (B, H, Lq)
    for term in terms:
        logit = logit - term  # (B, H, Lq)
    return -(torch.exp(logit) * delta).sum(dim=(0, 2)).to(sinks.dtype)  # (H,)
