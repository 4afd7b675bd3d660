"""Head ablation on the fast path: chosen heads' outputs changed inside attnkit's attention call, nothing else.

``with attnkit.ablate_heads(model, {"model.layers.3.self_attn": [0, 5]}, mode="zero"): model(ids)`` runs the model
with heads 0 and 5 of that layer contributing zeros to the layer's output projection; the weights, the cache and every
other head are as without the block. The choice lives in a ``ContextVar`` (the block's thread or task), not on the
model: after the block, also after an exception inside it, the model is exactly as it was.

Modes, per chosen head ``h`` of a call's output ``(B, H, Lq, Dv)``:

* ``"zero"``: its output is 0 (zero ablation);
* ``"mean"``: its output at every query is its mean over the call's queries, per example (mean ablation over the
  positions of this input; a mean over a dataset is a ``scale`` of 0 plus a bias, left to the caller's hooks);
* a number ``s``: its output times ``s`` (``1.0`` changes nothing, ``0.0`` is ``"zero"``).

:func:`attnkit.head_sweep` ablates each head of each layer in turn and measures one logit's change: which heads an
answer needs. Supported models: transformers models whose attention is attnkit's (``attn_implementation="attnkit"``,
:mod:`attnkit.integrations.transformers`). A decoding step (one query) under ``"mean"`` keeps its head as it is: the
mean over one query is that query.
"""

from __future__ import annotations

import contextlib
import fnmatch
import numbers
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextvars import ContextVar
from typing import NamedTuple

import torch
from torch import Tensor, nn

from attnkit import _scoped_state
from attnkit._validate import describe
from attnkit._validate import indices as as_indices

__all__ = ["HeadSweep", "ablate_heads", "ablated", "chooses", "head_sweep"]

Mode = str | float


class _Ablation(NamedTuple):
    heads: dict[int, list[int]]  # by the attention module's id: its chosen heads
    mode: Mode
    modules: list[nn.Module]  # held while the block is open, so that no other module can take one of these ids


# The ablations open in this thread or task, outermost first.
_ABLATIONS: ContextVar[tuple[_Ablation, ...]] = ContextVar("attnkit_ablations", default=())


def chooses(module: nn.Module) -> bool:
    """Whether an :func:`ablate_heads` block open in this thread or task chose heads of ``module``."""
    return any(id(module) in a.heads for a in _scoped_state.read(_ABLATIONS, ()))


def ablated(module: nn.Module, out: Tensor) -> Tensor:
    """``out`` ``(B, H, Lq, Dv)``, one call of ``module``, with the heads every open :func:`attnkit.ablate_heads` block
    chose for ``module`` changed by its mode (``out`` itself when none did: the cost of asking, one lookup)."""
    open_here = _scoped_state.read(_ABLATIONS, ())
    if not open_here:
        return out
    for ablation in open_here:
        heads = ablation.heads.get(id(module))
        if heads is None:
            continue
        chosen = torch.zeros(out.shape[1], dtype=torch.bool, device=out.device)
        chosen[heads] = True
        chosen = chosen[:, None, None]  # (H, 1, 1)
        if ablation.mode == "zero":
            out = torch.where(chosen, torch.zeros((), dtype=out.dtype, device=out.device), out)  # (B, H, Lq, Dv)
        elif ablation.mode == "mean":
            out = torch.where(chosen, out.mean(dim=2, keepdim=True), out)  # (B, H, Lq, Dv)
        else:
            scale = torch.where(chosen, float(ablation.mode), 1.0).to(out.dtype)  # (H, 1, 1)
            out = out * scale  # (B, H, Lq, Dv)
    return out


@contextlib.contextmanager
def ablate_heads(model: nn.Module, heads: Mapping[str, int | Sequence[int]], mode: Mode = "zero") -> Iterator[None]:
    """Change the outputs of the chosen heads inside attnkit's attention call while the block is open.

    Args:
        model: a transformers model whose attention is attnkit's (``attn_implementation="attnkit"``).
        heads: attention module names (as ``model.named_modules()`` gives them, ``fnmatch`` patterns allowed:
            ``"model.layers.*.self_attn"``) to the head index or indices to change in each.
        mode: ``"zero"``, ``"mean"`` (over the call's queries, per example) or a number to scale by.

    Raises:
        TypeError: ``model`` is not a module, ``heads`` not a mapping of names to ints, ``mode`` of another kind.
        ValueError: a name that matches no attention module (the error lists them), a head past the layer's heads,
            no head at all, a mode not among those above, a model whose attention is not attnkit's.

    Example:
        >>> with attnkit.ablate_heads(model, {"model.layers.0.self_attn": [1]}):  # doctest: +SKIP
        ...     logits = model(ids).logits
    """
    chosen = _chosen_heads(model, heads, "ablate_heads")
    _check_mode(mode)
    ablation = _Ablation({id(m): h for m, h in chosen}, mode, [m for m, _ in chosen])
    _ABLATIONS.set((*_ABLATIONS.get(), ablation))
    try:
        with _scoped_state.counted("ablation"):
            yield
    finally:
        # not a reset to the value before: blocks may close in any order (contextlib.ExitStack, generators)
        _ABLATIONS.set(tuple(a for a in _ABLATIONS.get() if a is not ablation))


class HeadSweep(NamedTuple):
    """:func:`attnkit.head_sweep`'s result: ``change[i, h]``, the logit with head ``h`` of layer ``names[i]``
    ablated minus ``base``, the logit without."""

    names: list[str]
    change: Tensor  # (layers, H) float64
    base: float


@torch.no_grad()
def head_sweep(
    model: nn.Module,
    input_ids: Tensor,
    token: int,
    *,
    position: int = -1,
    mode: Mode = "zero",
    layers: str = "*",
) -> HeadSweep:
    """Ablate each head of each attention layer of ``model`` (those ``layers`` matches), one forward each, and
    measure the change of the logit of ``token`` at ``position`` of the first example: a layer-by-head table of
    what an answer needs. Runs without autograd; the model's mode (train or eval) is the caller's.

    Raises:
        ValueError, TypeError: as :func:`attnkit.ablate_heads`; ``token`` or ``position`` out of range.
    """
    found = _attention_modules(model, "head_sweep")
    names = [n for n, _ in found if fnmatch.fnmatchcase(n, layers)] if isinstance(layers, str) else None
    if names is None:
        raise TypeError(f"head_sweep(layers=...) takes a name or an fnmatch pattern, got {describe(layers)}")
    if not names:
        raise ValueError(f"head_sweep(layers={layers!r}) matches no attention module; they are: {_listed(found)}")
    _check_mode(mode)
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.dtype != torch.long:
        raise TypeError(f"head_sweep(input_ids=...) takes a (B, L) int64 tensor, got {describe(input_ids)}")
    L = input_ids.shape[1]
    if not -L <= position < L:
        raise ValueError(f"head_sweep(position={position}) is out of range for {L} tokens")

    def logit() -> float:
        logits = model(input_ids).logits  # (B, L, V)
        if not 0 <= token < logits.shape[-1]:
            raise ValueError(f"head_sweep(token={token}) is out of range for a vocabulary of {logits.shape[-1]}")
        return float(logits[0, position, token])

    base = logit()
    modules = dict(found)
    change = torch.zeros(len(names), max(_heads_of(modules[n]) for n in names), dtype=torch.float64)
    for i, name in enumerate(names):
        for h in range(_heads_of(modules[name])):
            with ablate_heads(model, {name: [h]}, mode):
                change[i, h] = logit() - base
    return HeadSweep(names, change, base)


def _check_mode(mode: object) -> None:
    if isinstance(mode, str):
        if mode not in ("zero", "mean"):
            raise ValueError(f"ablate_heads(mode=...) is 'zero', 'mean' or a number to scale by, got {mode!r}")
        return
    if isinstance(mode, bool) or not isinstance(mode, numbers.Real) or mode != mode or abs(mode) == float("inf"):
        raise TypeError(f"ablate_heads(mode=...) is 'zero', 'mean' or a finite number, got {describe(mode)}")


def _attention_modules(model: object, what: str) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of the attention modules of a transformers model whose attention is attnkit's."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"{what} changes the attention heads of a torch.nn.Module, got {describe(model)}")
    config = getattr(model, "config", None)
    implementation = getattr(config, "_attn_implementation", None)
    integration = sys.modules.get("attnkit.integrations.transformers")
    if config is None or implementation is None:
        raise ValueError(
            f"{what} runs inside attnkit's attention call of a transformers model; this {type(model).__name__} "
            "has no transformers config"
        )
    if integration is None or implementation not in integration._REGISTERED:
        raise ValueError(
            f"this model's attention is {implementation!r}, not attnkit's: {what} changes heads inside the attention "
            "attnkit computes. Switch it: attnkit.integrations.transformers.register(); "
            "model.set_attn_implementation('attnkit')"
        )
    found = [(n, m) for n, m in model.named_modules() if _heads_of(m) > 0]
    if not found:
        raise ValueError(f"{type(model).__name__} holds no attention module with a known number of heads")
    return found


def _heads_of(module: nn.Module) -> int:
    """A transformers attention module's query heads (0 for any other module)."""
    config = getattr(module, "config", None)
    if not isinstance(getattr(module, "layer_idx", None), int) or not hasattr(module, "head_dim"):
        return 0
    heads = getattr(module, "num_heads", None) or getattr(config, "num_attention_heads", None)
    return int(heads) if isinstance(heads, int) else 0


def _listed(found: list[tuple[str, nn.Module]]) -> str:
    shown = ", ".join(repr(n) for n, _ in found[:6])
    return shown + (f", ... ({len(found)} in all)" if len(found) > 6 else "")


def _chosen_heads(model: object, heads: object, what: str) -> list[tuple[nn.Module, list[int]]]:
    found = _attention_modules(model, what)
    if not isinstance(heads, Mapping):
        raise TypeError(f"{what}(heads=...) maps attention module names to head indices, got {describe(heads)}")
    if not heads:
        raise ValueError(f"{what}(heads=...) must name at least one module; the model's are: {_listed(found)}")
    chosen: dict[int, tuple[nn.Module, list[int]]] = {}
    for pattern, given in heads.items():
        if not isinstance(pattern, str):
            raise TypeError(f"{what}(heads=...): a key is a module name, got {describe(pattern)}")
        matched = [(n, m) for n, m in found if fnmatch.fnmatchcase(n, pattern)]
        if not matched:
            raise ValueError(f"{what}(heads=...): {pattern!r} names no attention module; they are: {_listed(found)}")
        items = as_indices(given)
        if items is None:
            raise TypeError(f"{what}(heads=...): {pattern!r} maps to a head index or a list of them, got {given!r}")
        if not items:
            raise ValueError(f"{what}(heads=...): {pattern!r} maps to no head")
        for name, module in matched:
            H = _heads_of(module)
            wrong = [i for i in items if not -H <= i < H]
            if wrong:
                raise ValueError(f"{what}(heads=...): head {wrong[0]} of {name!r}, which has {H} heads")
            kept = chosen.setdefault(id(module), (module, []))[1]
            kept.extend(sorted({i % H for i in items} - set(kept)))
    return list(chosen.values())
