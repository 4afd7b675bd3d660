"""The only place that chooses a backend.

Policy for ``backend="auto"``, first backend that can run the call wins:

* while ``torch.compile`` traces the call: ``graph``, the only backend that reads no value on the host (a backend
  named explicitly runs outside the graph instead: :func:`attnkit.functional.attend`);
* weights wanted: ``reference`` (the only backend that returns them);
* on CUDA, a call with a ``mask_mod`` or ``score_mod``: ``flex`` (PyTorch's compiled FlexAttention) first,
  then as below;
* on CPU in float32, over more than a decode step's few queries: ``flash`` (attnkit's own C++ kernel, built on
  first use; where it cannot be built, as below) for a ``mask_mod`` (but one that is causal self-attention
  throughout, which ``tiles`` runs as one causal call), ``softcap``, and a ``score_mod`` that is a bias on the
  distance ``q_idx - kv_idx`` (ALiBi, a learned table: proved from its graph, in calls of ``DISTANCE_FROM``
  scores);
* on CPU, a large call (``compiled.COMPILE_FROM`` scores, ``compiled.FEWEST_QUERIES`` queries) with a
  ``score_mod`` that takes blocks of scores and is not a bias (``softcap``, a user's function), or a bias whose
  tensors need a gradient: ``compiled`` (the online softmax's steps compiled by ``torch.compile``), then as below;
* a ``mask_mod``, ``sinks`` or a ``score_mod`` that is a bias (ALiBi): ``tiles`` (PyTorch's fused CPU kernel on
  the tiles the mask shows, skipping the hidden ones; the bias as the kernel's float mask), then as below;
* a ``mask_mod`` that hides most of the scores (a sliding window: ``chunked`` visits at most ``SPARSE_BELOW`` of
  them), a ``score_mod`` other than a bias, or ``sinks``: ``chunked``, which skips what is hidden and takes them
  all, then ``sdpa`` (a mask_mod as one dense mask, when small), then ``reference``;
* dot-product scoring: ``sdpa`` (PyTorch's fused kernels), then ``chunked``, then ``reference``; ``decode`` first
  (a few queries without autograd: the decode step) over keys and values stored positions last (a
  :class:`~attnkit.KVCache`'s long context), and for a masked call of a few queries on CPU, which sdpa could run only
  after reading every key once more to bound the scores its kernels mask by adding ``-inf``;
* additive scoring: on CPU, ``compiled`` for a large call (``compiled.ADDITIVE_FROM`` features, ``FEWEST_QUERIES``
  queries; not once its steps failed to compile, which would run them eagerly, a tile of features at a time);
  then ``chunked`` when the ``(B, H, Lq, Lk, D)`` features would be large (``>= ADDITIVE_CHUNK_ELEMENTS``), else
  ``reference``, each falling back to the other.

``triton`` (additive attention as Triton kernels, CUDA) runs only when named: its speed against ``chunked`` is yet
to be measured on a GPU (``benchmarks/triton_additive.py``).

A backend named explicitly never falls back: if it cannot run the call, a ``ValueError`` lists every
backend's reasons.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from types import ModuleType

import torch

from attnkit import _scoped_state, mods
from attnkit.backends import ALL, chunked, compiled, decode, flash, online, tiles
from attnkit.backends.contract import Call

__all__ = ["ADDITIVE_CHUNK_ELEMENTS", "BACKENDS", "SPARSE_BELOW", "available_backends", "choose", "watch"]

#: Every backend module, by its name (``reference``, ``sdpa``, ``chunked``, ...).
BACKENDS: dict[str, ModuleType] = {b.NAME: b for b in ALL}

# 2**22 float32 elements = 16 MiB for one copy of the features; the reference keeps several.
ADDITIVE_CHUNK_ELEMENTS = 2**22

# A function of the caller's as score_mod is looked into (its graph traced twice: 12-42 ms on this machine) for the
# flash kernel's distance bias from this many scores (B H Lq Lk) on, where flash and the tracing took 2-5x less
# time than chunked (tester's runs at L=1024); smaller calls run it on chunked. A function found not to be one is
# not traced again (attnkit.mods.relative).
DISTANCE_FROM = 2**22

# A mask_mod under which chunked scores at most this share of the Lq x Lk pairs goes to chunked first: SDPA's
# kernels score every pair of a dense mask (docs/benchmarks.md, "Flexible attention").
SPARSE_BELOW = 0.5

# The watch() blocks open in this thread or task, outermost first.
_WATCHERS: ContextVar[tuple[_Watch, ...]] = ContextVar("attnkit_watchers", default=())


def available_backends(device: str | torch.device | None = None) -> list[str]:
    """Names of attnkit's backends that run on ``device`` (a device type such as ``"cpu"`` or ``"cuda"``, or a
    device), or, when ``None``, on some device this machine has (and whose packages it has: ``Supports.needs``; a
    kernel built on first use is listed before it is built, and a call it cannot run says why).
    What a backend cannot run is declared in its ``SUPPORTS`` and said per call, and a backend named explicitly
    lists every backend's reasons.

    Example:
        >>> available_backends("cpu")
        ['reference', 'sdpa', 'chunked', 'tiles', 'flash', 'compiled', 'decode', 'graph']
    """
    here = {"cpu", "cuda"} if torch.cuda.is_available() else {"cpu"}
    types = here if device is None else {torch.device(device).type}
    found = [(name, b.SUPPORTS) for name, b in BACKENDS.items()]
    return [name for name, s in found if s.needs is None and (s.devices is None or types & s.devices)]


def describe_backends() -> dict[str, str]:
    """For each backend, what it can run, as it declares (``attnkit info`` shows them)."""
    return {name: b.SUPPORTS.describe() for name, b in BACKENDS.items()}


@contextlib.contextmanager
def watch() -> Iterator[list[str]]:
    """Collect the names of the backends that run inside the ``with`` block, in order.

    Only the calls of the thread or asyncio task that opened it are seen. Blocks nest: a call is seen by
    every block open around it. Inside :func:`attnkit.distributed.context_parallel` every call is ``"ring"``.

    Example:
        >>> import torch, attnkit
        >>> with watch() as ran:
        ...     _ = attnkit.scaled_dot_product_attention(torch.ones(1, 2, 4), torch.ones(1, 3, 4),
        ...                                              torch.ones(1, 3, 4), need_weights=True)
        >>> ran
        ['reference']
    """
    seen: list[str] = []
    entry = _Watch(seen)
    _WATCHERS.set((*_WATCHERS.get(), entry))
    try:
        with _scoped_state.counted("watch"):
            yield seen
    finally:  # blocks may close in any order (contextlib.ExitStack): remove this one, keep the others
        entry.open = False  # an asyncio task made inside the block holds a copy of the tuple: it sees nothing more
        _WATCHERS.set(tuple(w for w in _WATCHERS.get() if w is not entry))


def choose(backend: str, call: Call) -> ModuleType:
    """The backend module that will run ``call`` (see the module docstring for the policy).

    Raises:
        ValueError: ``backend`` is not a backend's name, or the backend named cannot run the call (the message
            gives every backend's reasons, from what each declares in its ``SUPPORTS``).
    """
    if call.mask.traced:  # torch.compile traces this call: only the graph backend reads no value
        return _ran(BACKENDS["graph"])
    if backend == "auto":
        for name in _preferences(call):
            if not BACKENDS[name].SUPPORTS.why_not(call):
                return _ran(BACKENDS[name])
        raise ValueError("no backend can run this call: " + _all_reasons(call))
    check_name(backend)
    chosen = BACKENDS[backend]
    if chosen.SUPPORTS.why_not(call):
        raise ValueError(f"backend={backend!r} cannot run this call: " + _all_reasons(call))
    return _ran(chosen)


def check_name(backend: object) -> None:
    """``backend`` is ``"auto"`` or a backend's name.

    Raises:
        TypeError: not a string. ValueError: not a name, listing the names.
    """
    if not isinstance(backend, str):
        raise TypeError(f"backend must be 'auto' or one of {sorted(BACKENDS)}, got {backend!r}")
    if backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"backend must be 'auto' or one of {sorted(BACKENDS)}, got {backend!r}")


def _preferences(call: Call) -> tuple[str, ...]:
    if call.need_weights:
        return ("reference",)
    if call.w_v is None:
        flex: tuple[str, ...] = ()
        if call.q.device.type == "cuda" and (call.mask.mask_mod is not None or call.score_mod is not None):
            flex = ("flex",)
        bias_mod = call.score_mod is not None and call.score_bias
        fused = ("tiles",) if call.mask.mask_mod is not None or call.sinks is not None or bias_mod else ()
        if _compile_worth(call):
            fused = ("compiled", *fused)
        if _flash_worth(call):
            fused = ("flash", *fused)
        if call.sinks is not None or not call.score_bias or _sparse(call):
            return (*flex, *fused, "chunked", "sdpa", "reference")
        if decode.is_positions_last(call.k, call.v) or (_few_queries(call) and not call.mask.is_empty):
            # a KVCache's long context, laid out for the decode step; or a masked decode step over the usual
            # layout, where sdpa would first read the whole cache to bound its hidden scores (finding c)
            return (*flex, "decode", *fused, "sdpa", "chunked", "reference")
        if fused:
            return (*flex, *fused, "sdpa", "chunked", "reference")
        return (*flex, "sdpa", "chunked", "reference")
    B, H, Lq, D = call.q.shape
    features = B * H * Lq * call.k.shape[2] * D
    if features >= ADDITIVE_CHUNK_ELEMENTS:
        if _compile_worth(call):
            return ("compiled", "chunked", "reference")
        return ("chunked", "reference")
    return ("reference", "chunked")


def _flash_worth(call: Call) -> bool:
    """On CPU in float32, over more queries than a decode step's (planning tiles would cost more there than
    ``chunked``'s few steps), where the kernel is built (the first time, here): a ``mask_mod`` (a window
    took 0.12x SDPA without a mask there, 0.20x on ``tiles``; docs/benchmarks.md), unless the mask is causal
    self-attention throughout (``tiles`` runs that as one causal call of PyTorch's kernel); ``softcap``; or a
    score_mod that is a bias on the distance ``q_idx - kv_idx`` (ALiBi, a caller's table), looked for in calls of
    at least ``DISTANCE_FROM`` scores (proving it traces the function)."""
    if call.q.device.type != "cpu" or call.q.dtype != torch.float32 or call.w_v is not None or _few_queries(call):
        return False
    score_mod = call.score_mod
    if score_mod is None:
        if call.mask.mask_mod is None or tiles.causal_throughout(call.mask):
            return False
        return flash.missing() is None
    if type(score_mod) is mods.softcap:
        return flash.missing() is None
    B, H, Lq, _ = call.q.shape
    if B * H * Lq * call.k.shape[2] < DISTANCE_FROM and not mods.declares_distance_bias(score_mod):
        return False  # (a packed document's piece asks the call's function, traced once for all its pieces)
    return flash.missing() is None and call.distance_bias


def _compile_worth(call: Call) -> bool:
    """Additive scoring, or a score_mod the fused kernel cannot take (not a bias, or a bias whose tensors need a
    gradient), in a call large enough to repay compiling its steps (``compiled.ADDITIVE_FROM`` features,
    ``compiled.COMPILE_FROM`` scores), with a block of queries to fill (a decode step's few queries would be padded
    to a block: ``chunked`` ran Lq=1 over 65536 keys 6.7x faster)."""
    if call.q.device.type != "cpu":
        return False
    B, H, Lq, D = call.q.shape
    size, least = B * H * Lq * call.k.shape[2], compiled.COMPILE_FROM
    if call.w_v is not None:
        if compiled.failed(call):  # eagerly, its steps hold every tile's features: chunked
            return False
        size, least = size * D, compiled.ADDITIVE_FROM
    elif call.score_mod is None or (call.score_bias and not call.differentiates_score_mod):
        return False
    if Lq < compiled.FEWEST_QUERIES or size < least:
        return False
    return compiled.takes_blocks(call)  # (a function of single scores only cannot be compiled as a block)


def _few_queries(call: Call) -> bool:
    """A decode step's size, on the device it runs on (the decode backend refuses the rest with its reasons)."""
    return call.q.device.type == "cpu" and call.queries_per_kv_head <= decode.FEW_QUERIES


def _sparse(call: Call) -> bool:
    """A mask_mod under which chunked visits at most ``SPARSE_BELOW`` of the pairs (from index ranges alone)."""
    mask = call.mask
    if mask.mask_mod is None or not mask.num_queries or not mask.num_keys:
        return False
    spans = online.key_blocks(mask, mask.num_queries, (0, mask.num_keys), chunked.current_settings().block_size)
    visited = sum((s.r1 - s.r0) * (s.j1 - s.j0) for s in spans)
    return visited <= SPARSE_BELOW * mask.num_queries * mask.num_keys


def _all_reasons(call: Call) -> str:
    parts = []
    for name, b in BACKENDS.items():
        reasons = b.SUPPORTS.why_not(call)
        parts.append(f"{name}: {'; '.join(reasons) if reasons else 'can run it'}")
    return " | ".join(parts)


def _ran(backend: ModuleType) -> ModuleType:
    ran_elsewhere(backend.NAME)
    return backend


def ran_elsewhere(name: str) -> None:
    """Tell the open :func:`watch` blocks that ``name`` runs a call the dispatcher did not choose for: ``"ring"``
    for every call inside :func:`attnkit.distributed.context_parallel`."""
    for entry in _scoped_state.read(_WATCHERS, ()):
        if entry.open:
            entry.seen.append(name)


class _Watch:
    """One open watch() block: the list it fills, while it is open."""

    def __init__(self, seen: list[str]) -> None:
        self.seen, self.open = seen, True
