"""attnkit as an attention implementation of Hugging Face ``transformers`` (5.x).

Example::

    from attnkit.integrations import transformers as attnkit_hf

    attnkit_hf.register()  # once per process: "attnkit" in transformers' attention and mask interfaces
    model = AutoModelForCausalLM.from_config(config, attn_implementation="attnkit")
    model.set_attn_implementation("attnkit")  # or switch a loaded model

    with attnkit.record_weights(model) as rec:  # every layer's weights, the outputs from the fused backend
        model(input_ids, attention_mask=attention_mask)
    rec["model.layers.0.self_attn"]  # (B, H, Lq, Lk)

What the model passes and what attnkit makes of it:

* the attention mask: transformers builds it as for its ``sdpa`` implementation (boolean, ``True`` = may attend,
  ``(B, 1, Lq, Lk)``, or none at all where ``is_causal`` says everything), which is attnkit's own convention. A float
  mask (a model's own, or a 4-D mask a user passed) has transformers' "minimum float" entries read as hidden
  (``-inf``), the rest kept as a bias. Rows that may see nothing (the queries of left padding) give zeros, never
  NaN; eager gives them uniform weights over the padding, sdpa whatever its kernel gives.
* causality: the module's ``is_causal`` (or the call's), applied as transformers' sdpa does: only with several
  queries and no mask; a static cache's prefill (more key slots than queries, the rest empty) sees the first ``Lq``.
* ``scaling`` (``1/sqrt(d)`` when the model gives none), ``dropout`` (the model passes 0 in eval mode),
  grouped-query heads (``Hkv`` key/value heads, shared by ``H / Hkv`` query heads, never repeated in memory),
  ``softcap`` (Gemma 2: :class:`attnkit.mods.softcap`), ``s_aux`` (gpt-oss's attention sinks: attnkit's ``sinks``),
  ``position_bias`` (T5: a bias added to the scores, with gradients), ``sliding_window`` (already in the mask
  transformers builds; without a mask, :class:`attnkit.mods.sliding_window`).
* ``position_ids``: where they hold packed documents, each document keeps to itself, in every call whose keys are
  its queries' own positions, whatever mask comes with it: as transformers' own masks do without a cache, and as
  flash-attention-2 does. They are read as transformers reads them: a document starts wherever a position does not
  follow the one before. (DeepSpeed Ulysses drops every mask and passes the whole sequence's ``position_ids``.
  transformers' eager and sdpa attend across packed documents when a cache or a mask of one's own is passed, and
  in bidirectional models: there attnkit differs from them, on purpose.)
* the backend: attnkit's dispatch (``backend="auto"``), or the one :func:`register` names.
* weights: with ``output_attentions=True`` the layer also returns them (computed beside the fused output, in
  ``(B, H, Lq, Lk)``); inside :func:`attnkit.record_weights` every call reports them, detached, without changing
  how the output is computed; inside :func:`attnkit.record_stats` their statistics, a block of rows at a time
  (:mod:`attnkit.stats`: no ``Lq x Lk`` matrix, so a 32k-token prompt's every layer fits). Keys stand at
  their slot in the cache; a query through a cache at the last slot the mask lets it see (itself, in a causal
  model), so ``distance`` is right for prompts, growing and static caches, left padding and sliding windows (which
  keep their keys in order); ``sink_mass`` counts the first ``sink_keys`` slots, which once a sliding-window
  layer's cache has slid are no longer the first tokens. A static cache's prefill has ``column_sum`` over every
  slot, as its weights. (Top-k keys, entropy and column sums are exact everywhere.)

Not covered: paged attention (transformers' continuous batching), models whose attention does not go through
``AttentionInterface``, and flash-attention-only arguments (``cu_seq_lens``: packed batches go through the mask
or ``position_ids``).

Written and checked against transformers 5.23 (``constraints.txt``). Three of transformers' private names are
read, each named where it is used and guarded by a test that fails when it moves (``tests/test_transformers.py``):
``AttentionInterface._global_mapping`` (transformers' own implementations, whose names :func:`register` refuses),
``AutoModel._model_mapping`` (the model a config builds, whose code must look its attention up) and
``transformers.utils.output_capturing._active_collector`` (whether the model is collecting the attention weights).
"""

from __future__ import annotations

import functools
import sys
import warnings
from contextvars import ContextVar
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from attnkit import _context_parallel, _scoped_state, ablation, mods, stats
from attnkit.functional import Masks, attend, attention_weights
from attnkit.recording import report_weights, wants_stats

try:
    import transformers as _transformers  # noqa: F401 - checked here so that the error says what to install
except ImportError as err:  # pragma: no cover - the tests install it
    raise ImportError(
        "attnkit.integrations.transformers needs Hugging Face transformers: pip install -e '.[transformers]' in "
        "attnkit's checkout"
    ) from err

from attnkit.integrations import _sequence  # noqa: E402 - it imports transformers: after the check above

_collector: Any
try:  # the outputs a model's forward is collecting (a ContextVar): private, checked against transformers 5.23
    from transformers.utils.output_capturing import _active_collector as _collector
except ImportError:  # pragma: no cover - register() warns: only the output_attentions flag passed down is seen
    _collector = None

__all__ = ["NAME", "attention_forward", "register"]

# B batch, H heads, Hkv key/value heads, Lq/Lk query/key length, D head dim

#: The name attnkit registers under in transformers' AttentionInterface (``attn_implementation="attnkit"``).
NAME = "attnkit"

# Cache slots hidden from an attention module's next call, by the module's id: (B, Hkv, n) bool over the first n
# slots of its cache. Set by an open press (attnkit.presses.AdaptiveBudget) just before each call of the layers it
# hooks, from the cache that call is given; the press's block holds the dict (a ContextVar: its thread or task).
PRESS_HIDDEN: ContextVar[dict[int, Tensor] | None] = ContextVar("attnkit_press_hidden", default=None)


# The names register() gave: registering one again replaces it; transformers' own names are never replaced.
_REGISTERED: set[str] = set()

# Words transformers reads meaning into when they are part of an implementation's name (checked against 5.23:
# "sdpa" in it runs the SDPA checks, which some models refuse; "flash" and "flex_attention" the flash-attention and
# FlexAttention ones; "|" marks paged attention, "/" and ":" a kernel from the Hub).
_RESERVED_WORDS = ("sdpa", "flash", "flex_attention", "|", "/", ":")


def register(name: str = NAME, *, backend: str = "auto") -> str:
    """Register attnkit as the attention implementation ``name`` in transformers (its ``AttentionInterface``, and
    its ``AttentionMaskInterface`` with the masks it builds for ``sdpa``). Returns ``name``, for
    ``attn_implementation=name``. Registering again replaces the earlier one (another ``backend``).

    A model whose attention does not go through ``AttentionInterface`` (its code never looks the function up:
    Bloom, CodeGen, XGLM, ...) is refused at its first forward pass with a ValueError: it would build attnkit's
    masks and then add them to its own scores, unmasked.

    Raises:
        ValueError: an empty name, a name transformers already uses for its own implementation or holding a word
            transformers reads meaning into (``"sdpa"``, ``"flash"``, ``"flex_attention"``, ``"|"``, ``"/"``,
            ``":"``), or a backend attnkit does not have.

    Warns:
        UserWarning: this transformers has no output collector where 5.23 has it: weights are then returned only to
            models that pass ``output_attentions`` down to their attention function.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from attnkit.dispatch import check_name

    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    # AttentionInterface._global_mapping: transformers' own implementations (private; checked against 5.23)
    # ("eager" is transformers' own too, called by the models directly: not in the mapping)
    if (name in AttentionInterface._global_mapping or name == "eager") and name not in _REGISTERED:
        raise ValueError(f"{name!r} is one of transformers' own attention implementations: choose another name")
    reserved = [word for word in _RESERVED_WORDS if word in name]
    if reserved:
        raise ValueError(
            f"the name {name!r} holds {reserved[0]!r}, which transformers reads as naming one of its own kinds of "
            f"attention (it would treat attnkit as that one, and some models would refuse to build): choose a name "
            f"without {', '.join(repr(w) for w in _RESERVED_WORDS)}, such as 'attnkit'"
        )
    if _collector is None:
        warnings.warn(
            "attnkit was checked against transformers 5.23, whose transformers.utils.output_capturing."
            "_active_collector tells when a model collects its attention weights; this version has none: "
            "output_attentions=True gives weights only to models that pass the flag down to their attention",
            stacklevel=2,
        )
    check_name(backend)
    forward = functools.partial(attention_forward, backend=backend)
    functools.update_wrapper(forward, attention_forward)
    AttentionInterface.register(name, forward)
    AttentionMaskInterface.register(name, _mask)
    _REGISTERED.add(name)
    return name


def _mask(*args: Any, config: Any = None, **kwargs: Any) -> Tensor | None:
    """transformers' sdpa mask (boolean, ``True`` = may attend, or ``None`` where ``is_causal`` says it), after
    checking that the model's attention goes through ``AttentionInterface`` (the config names the model).

    Warns:
        UserWarning: attnkit cannot find the code of the model this config builds (a model of one's own that
            transformers' AutoModel does not know): it cannot tell whether that code looks its attention up.
    """
    from transformers.masking_utils import sdpa_mask

    if _context_parallel.active() is not None:
        return _sequence.split_mask(config, kwargs)
    through = None if config is None else _goes_through_the_interface(type(config))
    if through is False:
        raise ValueError(
            f"this {config.model_type!r} model computes its attention itself, not through transformers' "
            "AttentionInterface: attnkit cannot be its attention implementation (its mask would be added to the "
            "model's own scores, unmasked); use 'eager' or 'sdpa'"
        )
    if through is None and config is not None:
        warnings.warn(
            f"attnkit cannot find the model code of {type(config).__name__} in transformers' AutoModel, so it cannot "
            "tell whether its attention is looked up in ALL_ATTENTION_FUNCTIONS: if that code computes attention "
            "itself, attnkit's mask would be added to its scores unmasked",
            stacklevel=2,
        )
    return sdpa_mask(*args, config=config, **kwargs)


_THROUGH_THE_INTERFACE: dict[type, bool | None] = {}  # by config class


def _goes_through_the_interface(config_class: type) -> bool | None:
    """Whether the module of the model transformers maps this config to holds transformers' own
    ``ALL_ATTENTION_FUNCTIONS`` (the registry it looks attention implementations up in; Bloom, CodeGen, XGLM,
    GPT-J, GPT-Neo and MPT do not): ``None`` when no model is mapped to it. The classes'
    ``_supports_attention_backend`` cannot tell: BART, T5 and Whisper leave it False and go through the interface.

    ``AutoModel._model_mapping`` is private, checked against transformers 5.23: if it moves, the AttributeError
    says so here (never a silent "yes")."""
    from transformers import AutoModel
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if config_class not in _THROUGH_THE_INTERFACE:
        mapping = AutoModel._model_mapping
        model_class = mapping.get(config_class, None)
        module = None if model_class is None else sys.modules.get(model_class.__module__)
        _THROUGH_THE_INTERFACE[config_class] = (
            None if module is None else any(value is ALL_ATTENTION_FUNCTIONS for value in vars(module).values())
        )
    return _THROUGH_THE_INTERFACE[config_class]


def attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    softcap: float | None = None,
    s_aux: Tensor | None = None,
    position_bias: Tensor | None = None,
    sliding_window: int | None = None,
    *,
    backend: str = "auto",
    **kwargs: Any,
) -> tuple[Tensor, Tensor | None]:
    """transformers' attention-function signature: ``query (B, H, Lq, D)``, ``key (B, Hkv, Lk, D)``,
    ``value (B, Hkv, Lk, Dv)`` -> ``(output (B, Lq, H, Dv), weights (B, H, Lq, Lk) or None)``."""
    Lq, Lk = query.shape[2], key.shape[2]
    slots = Lk  # the weights come back over every key slot, as eager's
    model_causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    runner = _context_parallel.active()
    if runner is not None:  # inside attnkit.distributed.context_parallel: this rank's shard of the sequence
        if ablation.chooses(module):
            raise ValueError(
                "ablate_heads inside context_parallel is not supported: each rank holds a shard of the queries"
            )
        masks_given = (attention_mask, softcap, s_aux, position_bias, sliding_window, dropout, scaling)
        wanted = _weights_wanted(kwargs)
        return _sequence.split_attention(
            runner, module, query, key, value, model_causal, masks_given, backend, kwargs, wanted
        )
    causal = model_causal and Lq > 1 and attention_mask is None  # as transformers' sdpa: the mask says it otherwise
    if causal and Lk > Lq:
        # a static cache's prefill: the slots past the queries are empty; transformers' causal is top-left
        key, value = key[:, :, :Lq], value[:, :, :Lq]  # (B, Hkv, Lq, D|Dv)
        position_bias = None if position_bias is None else position_bias[..., :Lq]  # (B|1, H, Lq, Lq)
        Lk = Lq
    mask_mod: mods.MaskFn | None = _window(module, sliding_window) if sliding_window and causal else None
    score_mod: mods.ScoreFn | None = mods.softcap(softcap) if softcap else None
    if position_bias is not None and position_bias.requires_grad and backend == "tiles:online":
        # tiles:online differentiates what a score_mod closes over, not a dense float mask: the bias as a table
        score_mod, position_bias = _bias_table(position_bias, score_mod), None
    attn_mask = _as_attnkit_mask(attention_mask, position_bias, Lk)  # (B|1, H|1, Lq, Lk) or None
    pressed = _scoped_state.read(PRESS_HIDDEN, None)  # an open press's hidden slots (presses.AdaptiveBudget)
    hidden = None if pressed is None else pressed.get(id(module))  # (B, Hkv, n) or None
    if hidden is not None:
        attn_mask = _hide(attn_mask, hidden, query.shape[1], Lk)  # (B, H, Lq|1, Lk)
    if Lq == Lk > 1:  # the keys are the queries' own positions: packed documents as position_ids say
        mask_mod = _sequence.documents_in(kwargs.get("position_ids"), query.shape[0], Lq, mask_mod, attn_mask)
    masks: dict[str, Any] = {
        "attn_mask": attn_mask,
        "is_causal": causal,
        "mask_mod": mask_mod,
        "score_mod": score_mod,
        "sinks": s_aux,
        "scale": scaling,
    }
    out, _, lse = attend(
        query,
        key,
        value,
        Masks(None, masks["attn_mask"], causal, masks["mask_mod"], score_mod),
        scale=scaling,
        sinks=s_aux,
        dropout_p=float(dropout),
        backend=backend,
        need_lse=wants_stats(module),
    )  # (B, H, Lq, Dv), (B, H, Lq) or None

    def weights_over_slots() -> Tensor:
        w = attention_weights(query, key, **masks)  # (B, H, Lq, Lk)
        return w if Lk == slots else F.pad(w, (0, slots - Lk))  # (B, H, Lq, slots): empty slots weigh 0

    weights = weights_over_slots() if _weights_wanted(kwargs) else None

    def recorded() -> Tensor:  # called only inside attnkit.record_weights
        if weights is not None:
            return weights
        with torch.no_grad():
            return weights_over_slots()

    def parts() -> stats.Parts:  # called only inside attnkit.record_stats or a record_weights of chosen rows
        slots_seen = _query_slots(masks["attn_mask"], Lq, Lk) if model_causal else None
        call = stats.parts(query, key, **masks, query_positions=slots_seen)[0]
        return call._replace(slots=slots, lse=lse)

    report_weights(module, recorded, kv_heads=key.shape[1], parts=parts)
    out = ablation.ablated(module, out)  # (B, H, Lq, Dv): the heads an open ablate_heads chose, changed
    return out.transpose(1, 2).contiguous(), weights  # (B, Lq, H, Dv)


def _hide(attn_mask: Tensor | None, hidden: Tensor, heads: int, Lk: int) -> Tensor:
    """``attn_mask`` with the cache slots ``hidden (B, Hkv, n)`` (the first ``n`` of the ``Lk`` keys) hidden from
    every query head of their key/value head; the keys past them (appended after the press) stay seen."""
    B, Hkv, n = hidden.shape
    seen = ~hidden[..., :Lk]  # (B, Hkv, min(n, Lk))
    seen = F.pad(seen, (0, Lk - seen.shape[-1]), value=True)  # (B, Hkv, Lk)
    seen = seen.repeat_interleave(heads // Hkv, dim=1)[:, :, None]  # (B, H, 1, Lk)
    if attn_mask is None:
        return seen
    if attn_mask.dtype == torch.bool:
        return attn_mask & seen  # (B, H, Lq, Lk)
    return attn_mask.masked_fill(~seen, float("-inf"))  # (B, H, Lq, Lk): -inf hides a key in attnkit's float masks


def _query_slots(attn_mask: Tensor | None, Lq: int, Lk: int) -> Tensor | None:
    """Each query's own cache slot ``(B, Lq)`` in a causal model's call through a cache, for the statistics'
    distance: the last slot it may see (a causal query sees itself last), which a static cache's decode step, left
    padding and a sliding cache's window put elsewhere than the default ``i + Lk - Lq``. ``attn_mask`` is the call's
    attnkit mask (:func:`_as_attnkit_mask`: over the ``Lk`` keys, ``True`` or finite where a key may be seen);
    ``None`` without a cache or a mask (the default is right), or for a mask too large to read whole (a long chunk
    of prefill)."""
    if attn_mask is None or Lk <= Lq or attn_mask.dim() != 4 or attn_mask.numel() > _SLOT_SCAN:
        return None
    seen = attn_mask if attn_mask.dtype == torch.bool else ~torch.isneginf(attn_mask)  # (B|1, 1|H, Lq|1, Lk)
    seen = seen.any(dim=1).expand(-1, Lq, Lk)  # (B|1, Lq, Lk)
    last = torch.where(seen, torch.arange(Lk, device=seen.device), -1).amax(dim=-1)  # (B|1, Lq)
    default = torch.arange(Lk - Lq, Lk, device=seen.device)  # (Lq,)
    return torch.where(last >= 0, last, default)  # (B|1, Lq)


# The largest mask _query_slots reads (elements): a decode step's or a short chunk's.
_SLOT_SCAN = 2**24


def _weights_wanted(kwargs: dict[str, Any]) -> bool:
    """Whether the model asked for the weights (``output_attentions=True``): some models pass the flag down to the
    attention function, the others only collect the layers' outputs (transformers' output-capturing hooks, whose
    open collection says which outputs it wants)."""
    if kwargs.get("output_attentions"):
        return True
    collecting: dict[str, Any] = (_collector.get() if _collector is not None else None) or {}
    return any("attentions" in k for k in collecting)


def _bias_table(table: Tensor, then: mods.ScoreFn | None) -> mods.ScoreFn:
    """A score_mod adding ``table (B|1, H, Lq, Lk)`` (T5's position bias), after ``then`` if given."""
    one_example = table.shape[0] == 1

    def add_bias(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        score = score if then is None else then(score, b, h, q_idx, kv_idx)
        return score + table[b * 0 if one_example else b, h, q_idx, kv_idx]

    return add_bias


def _as_attnkit_mask(mask: Tensor | None, position_bias: Tensor | None, Lk: int) -> Tensor | None:
    """transformers' mask and T5's ``position_bias`` as one attnkit ``attn_mask``: boolean (``True`` = may
    attend) as it comes, or a float bias with ``-inf`` where transformers put its minimum float."""
    if mask is not None:
        mask = mask[..., :Lk]  # (B|1, 1|H, Lq, Lk): some models build it for the whole cache
        if mask.dtype != torch.bool:
            hidden = mask <= torch.finfo(mask.dtype).min / 2  # transformers' "minus infinity"
            bias = mask.masked_fill(hidden, 0.0)
            bias = bias if position_bias is None else bias + position_bias  # (B|1, 1|H, Lq, Lk)
            return bias.masked_fill(hidden, float("-inf"))  # (B|1, 1|H, Lq, Lk)
    if position_bias is None or mask is None:
        return position_bias if mask is None else mask
    return position_bias.masked_fill(~mask, float("-inf"))  # (B|1, H, Lq, Lk)


def _window(module: object, window: int) -> mods.sliding_window:
    """The layer's sliding window, one object for all its calls (kept on the attention module, which the model
    holds): its plans, kept on it by length (:mod:`attnkit.plan`, at most eight), serve the layer's next forward of
    the same length, where a new object a call would plan it again (32 ms at L=4096, 0.3 s at 32k). It is asked for
    only where transformers passes no mask of its own and the call is causal over several queries: a training or
    prefill forward without padding, whose mask transformers leaves to the attention (a decoding step, or a call
    with a dense mask, carries its window in that mask). Each layer keeps its own plans: memory a layer, the partly
    visible tiles of each length it has seen (the plan caps them at 16 MiB), for no state kept in a module of
    attnkit's."""
    kept = getattr(module, "__dict__", {}).get("_attnkit_window")
    if not isinstance(kept, mods.sliding_window) or kept.window != window:
        kept = mods.sliding_window(window)
        if hasattr(module, "__dict__"):
            module.__dict__["_attnkit_window"] = kept  # (beside nn.Module's registries: not a parameter or buffer)
    return kept
