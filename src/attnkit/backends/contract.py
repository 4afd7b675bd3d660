"""The backend contract: one object describing a call, and what a backend supports, as data.

Every backend module (and each implementation of the tile engine, :mod:`attnkit.backends.tiles`) defines::

    NAME: str                                           # "sdpa", or "tiles:kernel" for an implementation
    SUPPORTS: Supports                                  # what it can run, declared
    def attention(call: Call) -> tuple[Tensor, Tensor | None]
    def attention_with_lse(call: Call) -> tuple[Tensor, Tensor] | None   # optional: also each row's log-sum-exp

:func:`attnkit.dispatch.choose` is the only place that chooses: it asks ``SUPPORTS.why_not(call)`` of each
engine, which says, one reason per line of the declaration, why that engine cannot run the call.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from attnkit import mods
from attnkit.masks import Mask, compute_dtype

__all__ = ["Accuracy", "Call", "Supports", "Unavailable"]


def _read(fn: object) -> tuple[Tensor, ...] | None:
    if fn is None:
        return ()
    try:
        return tuple(mods.read_tensors(fn))
    except mods.Uninspectable:
        return None


# B batch, H heads, Hkv key/value heads, Lq/Lk query/key length, D head dim, Dv value head dim

DOT, ADDITIVE = "dot-product", "additive"


@dataclass(frozen=True)
class Call:
    """One attention call, validated (``H % Hkv == 0``, shapes and dtypes fit, the mask checked).

    ``q (B, H, Lq, D)``, ``k (B, Hkv, Lk, D)``, ``v (B, Hkv, Lk, Dv)``; ``mask`` the combined mask, kept as its
    parts (a ``mask_mod`` among them); ``w_v (D,)`` for additive scoring, ``None`` for dot-product scoring (then
    scaled by ``scale``); ``score_mod(score, b, h, q_idx, kv_idx)`` applied to the scaled (or additive) scores,
    built-ins bound to the call; ``sinks (H,)`` one sink logit per query head, in ``q.dtype``
    (``a[i, j] = exp(s_ij) / (exp(sink_h) + sum_j exp(s_ij))``); ``zeros_past (B,)`` lengths past which each
    example's keys and values are zeros (a :class:`~attnkit.KVCache`'s promise), or ``None``.
    A backend returns the output ``(B, H, Lq, Dv)`` in ``q.dtype``, and the pre-dropout weights
    ``(B, H, Lq, Lk)`` when ``need_weights`` (else ``None``).
    """

    q: Tensor
    k: Tensor
    v: Tensor
    mask: Mask
    w_v: Tensor | None = None
    scale: float = 1.0
    dropout_p: float = 0.0
    need_weights: bool = False
    score_mod: mods.ScoreFn | None = None
    sinks: Tensor | None = None
    zeros_past: Tensor | None = None

    def tensors_read(self, fn: object) -> tuple[Tensor, ...] | None:
        """The tensors this call's ``mask_mod`` or ``score_mod`` (``fn``) reads from outside
        (:func:`attnkit.mods.closure.read_tensors`), looked for once a call; ``None`` when the function cannot be
        looked into."""
        if fn is self.mask.mask_mod:
            return self._mask_mod_reads
        assert fn is self.score_mod, "tensors_read answers for this call's own modifiers"
        return self._score_mod_reads

    @functools.cached_property
    def _mask_mod_reads(self) -> tuple[Tensor, ...] | None:
        return _read(self.mask.mask_mod)

    @functools.cached_property
    def _score_mod_reads(self) -> tuple[Tensor, ...] | None:
        return _read(self.score_mod)

    @property
    def modifiers_inspectable(self) -> bool:
        """Whether the tensors its mask_mod and score_mod read can all be found (True without modifiers)."""
        return all(self.tensors_read(f) is not None for f in (self.mask.mask_mod, self.score_mod) if f is not None)

    @functools.cached_property
    def distance_bias(self) -> bool:
        """The score_mod is a function of the caller's that is ``score + f(b, h, q_idx - kv_idx)`` element by element,
        as its graph shows (``attnkit.mods.relative.is_distance_bias``, traced once a call)."""
        return self.score_mod is not None and mods.is_distance_bias(self.score_mod)

    @property
    def scoring(self) -> str:
        return DOT if self.w_v is None else ADDITIVE

    @property
    def score_bias(self) -> bool:
        """The score_mod is a bias on the scores (a built-in that says so, e.g. ALiBi), or there is none."""
        return self.score_mod is None or (
            isinstance(self.score_mod, mods.ScoreMod) and type(self.score_mod).bias is not mods.ScoreMod.bias
        )

    @property
    def dense_mask_elements(self) -> int:
        """Elements of the mask_mod's mask over the whole call, ``(B|1) (H|1) Lq Lk``, as one dense tensor."""
        mask_mod, B, H = self.mask.mask_mod, self.q.shape[0], self.q.shape[1]
        b, h = mask_mod.depends_on(B, H) if isinstance(mask_mod, mods.MaskMod) else (B, H)
        return b * h * self.mask.num_queries * self.mask.num_keys

    @property
    def differentiates_bias(self) -> bool:
        """A float ``attn_mask`` that requires grad, while autograd records."""
        bias = self.mask.bias
        return bias is not None and bias.requires_grad and torch.is_grad_enabled()

    @property
    def differentiates_score_mod(self) -> bool:
        """A built-in score_mod reads a tensor that requires grad (ALiBi's slopes), while autograd records."""
        if not isinstance(self.score_mod, mods.ScoreMod) or not torch.is_grad_enabled():
            return False
        return any(t.requires_grad for t in self.score_mod.tensors())

    @property
    def needs_grad(self) -> bool:
        """Whether autograd records and something the output depends on requires grad (the inputs, the float mask,
        the sinks, or a tensor a score_mod reads)."""
        if not torch.is_grad_enabled():
            return False
        if self.score_mod is not None and not isinstance(self.score_mod, mods.ScoreMod):
            return True  # a function of the caller's may read a tensor that requires grad: assume it does
        tensors = [self.q, self.k, self.v, self.w_v, self.mask.bias, self.sinks]
        if isinstance(self.score_mod, mods.ScoreMod):
            tensors += self.score_mod.tensors()
        return any(t is not None and t.requires_grad for t in tensors)

    @functools.cached_property
    def hidden_scores_may_overflow(self) -> bool:
        """Whether a score a mask other than a plain causal one (``Lq == Lk``) hides could overflow the compute
        dtype, by the bound ``|scale| * D * max|q| * max|k|`` over the keys some query may see (dot-product scoring,
        NaN aside): a kernel that adds that mask as ``-inf`` would meet ``+inf - inf``, NaN, in a row that may not
        see that key. Worked out once a call (two reductions and one read of the result), and only where needed:
        nothing hidden, causal alone, or inputs whose dtype cannot reach the bound (float16) need none."""
        mask, q, k = self.mask, self.q.detach(), self.k.detach()
        if mask.is_empty or mask.is_plain_causal or self.w_v is not None or not q.numel() or not k.numel():
            return False
        limit = torch.finfo(compute_dtype(q.dtype)).max
        growth = abs(self.scale) * q.shape[-1]
        if growth == 0 or torch.finfo(q.dtype).max < math.sqrt(limit / growth):
            return False  # (float16: 65504^2 * D * scale stays far below float32's range)
        lens = mask.valid_lens  # (B, 1, 1 | Lq, 1): no query sees a key past the longest (a static cache's storage)
        if lens is not None and lens.numel():
            k = k[:, :, : int(lens.max())]  # (B, Hkv, n, D)
        if not k.numel():
            return False
        peak = largest_score(q, k, self.scale)
        # NaN (where no query may see, zeroed by every backend first; or the caller's own, which shows anyway)
        # leaves the bound as it is
        return not math.isnan(peak) and peak >= limit

    @property
    def queries_per_kv_head(self) -> int:
        """``H / Hkv * Lq``: the queries that read each key/value head (grouped query heads count each)."""
        return self.q.shape[1] // self.k.shape[1] * self.q.shape[2]


class Unavailable(RuntimeError):
    """An engine found, as it began a call, that it cannot run here after all (a kernel whose build failed just
    then): :func:`attnkit.functional.attend` asks the dispatcher again, whose ``missing`` now knows; a backend named
    explicitly says why instead."""


def largest_score(q: Tensor, k: Tensor, scale: float) -> float:
    """A bound on ``|scale * q[i] . k[j]|`` and on the product before the scale, ``|q[i] . k[j]|``, over
    ``q (..., Lq, D)`` and ``k (..., Lk, D)`` (both not empty): ``max(1, |scale|) * D * max|q| * max|k|``, from one
    read of each (aminmax is the fastest reduction here); NaN where either holds NaN, ``inf`` where either holds an
    infinity. (The product overflows first where the scale is below 1: 3.3e18 x -3.3e18 x 64 is -inf in float32,
    a score of -8.7e37 once scaled by 1/8, a tester's finding.)"""
    q_lo, q_hi, k_lo, k_hi = torch.stack([*q.detach().aminmax(), *k.detach().aminmax()]).tolist()
    return max(1.0, abs(scale)) * q.shape[-1] * max(-q_lo, q_hi) * max(-k_lo, k_hi)  # type: ignore[no-any-return]


def scores_bounded(q: Tensor, k: Tensor, scale: float, dtype: torch.dtype) -> bool:
    """Whether no score of ``q`` and ``k`` (nor its product before the scale) can reach half the range of the compute
    ``dtype``, by :func:`largest_score`: then none is infinite, and a bias (clamped to the other half) keeps it so.
    True with nothing to score; False with NaN or an infinity in either, and while ``torch.compile`` traces (it
    cannot read values): the safe side, where the caller looks at the scores themselves for ``-inf``."""
    if not q.numel() or not k.numel():
        return True
    if torch.compiler.is_compiling():
        return False
    return largest_score(q, k, scale) < torch.finfo(dtype).max / 2


@dataclass(frozen=True)
class Accuracy:
    """How close a backend promises to be to the attention math computed in float64 from the same inputs (the
    agreement tests, ``tests/agreement.py``, hold every backend to its own): ``output`` the largest difference in an
    output, ``grads`` in a gradient, as a multiple of ``max(1, max |true gradient|)`` (a gradient sums up to
    ``Lq * H / Hkv`` terms), for float32 and for float64 inputs; for float16 and bfloat16 inputs, at most
    ``low_precision`` times the error of that math computed in the input's own precision, plus the float32 bounds
    (flash-attention's rule: backends compute in float32)."""

    output: tuple[float, float] = (1e-5, 1e-12)  # (float32, float64)
    grads: tuple[float, float] = (3e-5, 1e-10)
    low_precision: float = 2.0

    def bounds(self, dtype: torch.dtype) -> tuple[float, float]:
        """``(output, grads)`` for inputs of ``dtype`` (float16 and bfloat16: float32's floor)."""
        i = 1 if dtype == torch.float64 else 0
        return self.output[i], self.grads[i]


@dataclass(frozen=True)
class Supports:
    """What a backend can run: the scoring kinds, returning weights, dropout, gradients to a float ``attn_mask``,
    an ``attn_mask`` at all (boolean or float), the modifiers: a ``mask_mod`` (``dense_mask_limit``: only by
    building the whole mask, of at most that many
    elements), a ``score_mod`` (``"any"``, ``"bias"``: only one that is a bias, such as ALiBi, or ``"none"``),
    ``sinks``; ``devices``: the device types it runs on (``None``: any); ``dtypes``: the input dtypes (``None``:
    any floating point); ``grad``: calls whose output needs a gradient; ``max_queries``: at most that many queries
    per key/value head (``None``: any number); ``huge_scores``: a hidden score that overflows is hidden all the
    same (False: the mask is added as ``-inf``, where an overflowing hidden score would give NaN);
    ``opaque_modifiers``: modifiers whose tensors cannot be found, under autograd (False: its backward reads them
    again and must check they did not change); ``value_dim``: values of another head size than the queries';
    ``score_mod_grad``: gradients to the tensors a built-in score_mod reads (ALiBi's slopes); ``needs``: what this
    machine lacks for it (a package, with how to install it), or ``None``; ``missing(call)``: the same, or what this
    call lacks for it, found only when a call it could run asks (asked last, where nothing else refuses; it builds
    nothing: a kernel that fails to build as it runs raises :class:`Unavailable`), or ``None``; ``accuracy``: how
    close to float64 math it promises to be (:class:`Accuracy`).
    ``score_mod="kernel"``: the score_mods a kernel computes itself: attnkit's own :class:`~attnkit.mods.softcap`,
    or a bias on the distance, ``score + f(b, h, q_idx - kv_idx)`` (``attnkit.mods.relative.is_distance_bias``)."""

    scoring: frozenset[str] = frozenset({DOT, ADDITIVE})
    weights: bool = True
    dropout: bool = True
    bias_grad: bool = True
    attn_mask: bool = True
    mask_mod: bool = True
    dense_mask_limit: int | None = None
    score_mod: str = "any"
    sinks: bool = True
    devices: frozenset[str] | None = None
    dtypes: frozenset[torch.dtype] | None = None
    grad: bool = True
    max_queries: int | None = None
    huge_scores: bool = True
    opaque_modifiers: bool = True
    value_dim: bool = True
    score_mod_grad: bool = True
    needs: str | None = None
    missing: Callable[[Call], str | None] | None = None
    accuracy: Accuracy = Accuracy()

    def why_not(self, call: Call) -> list[str]:
        """Each reason this declaration refuses ``call``; ``[]`` when it can run it."""
        reasons = []
        if self.needs is not None:
            reasons.append(f"needs {self.needs}")
        if self.devices is not None and call.q.device.type not in self.devices:
            where = " or ".join(sorted(self.devices)) or "no device here (this PyTorch lacks it)"
            reasons.append(f"runs on {where} only (the inputs are on {call.q.device.type})")
        if self.dtypes is not None and call.q.dtype not in self.dtypes:
            reasons.append(f"{_dtypes(self.dtypes)} only (the inputs are {_dtypes({call.q.dtype})})")
        if self.max_queries is not None and call.queries_per_kv_head > self.max_queries:
            reasons.append(
                f"at most {self.max_queries} queries per key/value head (this call has {call.queries_per_kv_head})"
            )
        if not self.value_dim and call.v.shape[-1] != call.q.shape[-1]:
            reasons.append(f"values of the queries' head size only (D={call.q.shape[-1]}, Dv={call.v.shape[-1]})")
        if not self.grad and call.needs_grad:
            tensors = (call.q, call.k, call.v, call.w_v, call.mask.bias, call.sinks)
            if any(t is not None and t.requires_grad for t in tensors) or isinstance(call.score_mod, mods.ScoreMod):
                reasons.append("no autograd (the output of this call needs a gradient)")
            else:
                reasons.append(
                    "no autograd (a score_mod of yours may read a tensor that requires grad: under torch.no_grad() "
                    "it runs)"
                )
        if call.scoring not in self.scoring:
            reasons.append(f"{' or '.join(sorted(self.scoring))} scoring only (this call is {call.scoring})")
        if call.need_weights and not self.weights:
            reasons.append("never returns weights (need_weights=True)")
        if call.dropout_p > 0 and not self.dropout:
            reasons.append(f"no dropout (dropout_p={call.dropout_p})")
        if call.differentiates_bias and not self.bias_grad:
            reasons.append("does not differentiate a float attn_mask that requires grad")
        mask = call.mask
        if not self.attn_mask and (mask.bool_mask is not None or mask.bias is not None):
            reasons.append("no attn_mask (valid_lens and is_causal only)")
        if mask.mask_mod is not None:
            if not self.mask_mod:
                reasons.append("no mask_mod")
            elif self.dense_mask_limit is not None:
                elements = call.dense_mask_elements
                if elements > self.dense_mask_limit:
                    reasons.append(
                        f"runs a mask_mod as one dense mask, here of {elements} elements, over its limit of "
                        f"{self.dense_mask_limit}"
                    )
        if call.score_mod is not None:
            if self.score_mod == "none":
                reasons.append("no score_mod")
            elif self.score_mod == "kernel" and not (_float32_softcap(call.score_mod) or call.distance_bias):
                reasons.append(
                    "a score_mod only when it is attnkit.mods.softcap itself (not a subclass), with a cap float32 "
                    "holds as a normal number (at least 1.2e-38), or a bias on the distance, score + f(b, h, q_idx - "
                    "kv_idx), element-wise (this one's graph shows something else)"
                )
            elif self.score_mod == "bias" and not call.score_bias:
                reasons.append("a score_mod only when it is a bias on the scores (attnkit.mods.alibi)")
            elif self.score_mod == "bias" and self.dense_mask_limit is not None:
                elements = call.q.shape[1] * call.mask.num_queries * call.mask.num_keys  # (1, H, Lq, Lk)
                if elements > self.dense_mask_limit:
                    reasons.append(
                        f"adds a score_mod as one dense bias, here of {elements} elements, over its limit of "
                        f"{self.dense_mask_limit}"
                    )
        if not self.score_mod_grad and call.differentiates_score_mod:
            reasons.append("does not differentiate the tensors a score_mod reads (here one requires grad)")
        if call.sinks is not None and not self.sinks:
            reasons.append("no sinks")
        if not self.opaque_modifiers and call.needs_grad and not call.modifiers_inspectable:
            reasons.append(
                "under autograd, it must see the tensors a mask_mod or score_mod reads (its backward reads them "
                "again), and this one hides them (TorchScript, or C code with state of its own): pass a Python "
                "function, a callable object or functools.partial(fn, tensor)"
            )
        if not self.huge_scores and not reasons and call.hidden_scores_may_overflow:  # (the costly one, last)
            reasons.append(
                "adds the mask as -inf, and a hidden score could overflow here (|scale| * D * max|q| * max|k| beyond "
                "the largest float): inf - inf would be NaN in rows that may not see that key"
            )
        # last, and only where nothing else refuses (it may look into the call's score_mod); it builds nothing
        if self.needs is None and self.missing is not None and not reasons and (lacking := self.missing(call)):
            reasons.append(f"needs {lacking}")
        return reasons

    def describe(self) -> str:
        """One line for ``attnkit info``."""
        can = [" and ".join(sorted(self.scoring)) + " scoring"]
        can += [what for what, ok in (("weights", self.weights), ("dropout", self.dropout)) if ok]
        can += ["gradients to a float attn_mask"] if self.bias_grad else []
        can += [] if self.attn_mask else ["no attn_mask"]
        if self.mask_mod:
            can.append("mask_mod" if self.dense_mask_limit is None else "mask_mod (as one dense mask)")
        can += {
            "any": ["score_mod"],
            "bias": ["score_mod (a bias: alibi)"],
            "kernel": ["score_mod (softcap, or a bias on q_idx - kv_idx)"],
            "none": [],
        }[self.score_mod]
        can += ["sinks"] if self.sinks else []
        if self.devices is not None:
            can.append(f"on {' or '.join(sorted(self.devices)) or 'no device (this PyTorch lacks it)'} only")
        if self.dtypes is not None:
            can.append(f"{_dtypes(self.dtypes)} only")
        if not self.grad:
            can.append("no autograd")
        if self.max_queries is not None:
            can.append(f"at most {self.max_queries} queries per key/value head")
        if not self.huge_scores:
            can.append("masks only scores that cannot overflow")
        if not self.opaque_modifiers:
            can.append("under autograd, modifiers whose tensors it can find (its backward reads them again)")
        if not self.value_dim:
            can.append("values of the queries' head size")
        if self.score_mod != "none" and not self.score_mod_grad:
            can.append("no gradients to a score_mod's tensors")
        if self.needs is not None:
            can.append(f"needs {self.needs}")
        return ", ".join(can)


def _dtypes(dtypes: frozenset[torch.dtype] | set[torch.dtype]) -> str:
    return " or ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))


def _float32_softcap(score_mod: object) -> bool:
    """attnkit's :class:`~attnkit.mods.softcap` itself (a subclass may compute something else), whose cap is a
    normal float32 number (a smaller one would be 0, or its reciprocal infinite, in a float32 kernel)."""
    return type(score_mod) is mods.softcap and score_mod.cap >= torch.finfo(torch.float32).tiny
