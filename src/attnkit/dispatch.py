"""The only place that chooses where a call runs: the engines, the policy as data, and its thresholds.

An engine is a backend (``BACKENDS``: ``reference``, ``sdpa``, ``decode``, ``tiles``, ``graph``, ``triton``) or one
of the tile engine's implementations (``tiles:kernel``, ``tiles:flex``, ``tiles:compiled``, ``tiles:online``), each
a module that declares what it can run (``SUPPORTS``). ``backend="auto"`` walks :data:`POLICY`, an ordered list of
rules: the first whose condition holds and whose engine can run the call runs it. A condition reads the call and its
plan (:class:`attnkit.plan.Plan`, made before dispatch for a call with a ``mask_mod``) and the thresholds below;
choosing builds nothing and reaches into no engine (a kernel is built when it first runs: where that fails, the
call is chosen for again, the kernel now known to be missing).

A backend named explicitly runs the call or raises a ``ValueError`` that gives every engine's reasons; it never
falls back. ``backend="tiles"`` runs the call on the implementation the policy prefers among those that can run it,
else on the first that can; ``backend="tiles:online"`` (or another's name) on that one. The names of the backends
merged into the tile engine (``chunked``, ``compiled``, ``flash``, ``flex``) say what replaced them.

While ``torch.compile`` traces a call, ``graph`` runs it (the only engine that reads no value on the host; a backend
named explicitly runs outside the graph instead: :func:`attnkit.functional.attend`). ``triton`` runs only when named:
its speed against the tile engine is yet to be measured on a GPU (``benchmarks/triton_additive.py``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from types import ModuleType
from typing import NamedTuple

import torch

from attnkit import _scoped_state, mods
from attnkit.backends import ALL, decode, tiles
from attnkit.backends.contract import Call

__all__ = [
    "ADDITIVE_CHUNK_ELEMENTS",
    "ADDITIVE_FROM",
    "BF16_KERNEL_FROM",
    "BACKENDS",
    "COMPILE_FROM",
    "DISTANCE_FROM",
    "ENGINES",
    "FEWEST_QUERIES",
    "POLICY",
    "REPLACED",
    "SPARSE_BELOW",
    "Rule",
    "available_backends",
    "choose",
    "watch",
]

#: Every backend module, by its name.
BACKENDS: dict[str, ModuleType] = {b.NAME: b for b in ALL}

#: Every engine a call can run on, by name (the backends, and the tile engine's implementations).
ENGINES: dict[str, ModuleType] = {
    **{name: b for name, b in BACKENDS.items() if name != tiles.NAME},
    **tiles.IMPLEMENTATIONS,
}

#: The names of the backends the tile engine took in, and what replaced each.
REPLACED = {"chunked": "tiles:online", "compiled": "tiles:compiled", "flash": "tiles:kernel", "flex": "tiles:flex"}

# ---------------------------------------------------------------------------------------------------- thresholds

# Additive scoring's (B, H, Lq, Lk, D) features from which the reference's dense formula gives way to the tile
# engine's blocks: 2**22 float32 elements = 16 MiB for one copy of them (the reference keeps several).
ADDITIVE_CHUNK_ELEMENTS = 2**22

# Additive scoring goes to compiled steps from this many features per call (B H Lq Lk D): compiling takes about
# 11 s here, and the eager steps' time at B=4, L=1024, D=128 (2^29, 2.4 s a training step against 0.17 s) repays it
# in five.
ADDITIVE_FROM = 2**28

# A score_mod the C++ kernel does not run goes to compiled steps from this many scores per call (B H Lq Lk):
# compiling them takes about 4 s forward and 5 s backward here, which the eager steps' time at H=8, L=8192 (4.6 s a
# call) repays at once.
COMPILE_FROM = 2**27

# ... and with at least this many queries: fewer are padded to a block of queries all the same (the eager steps ran
# Lq=1 over 65536 keys 6.7x faster).
FEWEST_QUERIES = 256

# A function of the caller's as score_mod is looked into (its graph traced twice: 12-42 ms on this machine) for the
# C++ kernel's bias on the distance from this many scores (B H Lq Lk) on, where the kernel and the tracing took 2-5x
# less time than the eager steps (at L=1024); smaller calls run it eagerly.
DISTANCE_FROM = 2**22

# A mask whose visible tiles hold at most this share of the Lq x Lk pairs goes to the tile engine before SDPA, whose
# kernels score every pair of a dense mask (docs/benchmarks.md, "Flexible attention").
SPARSE_BELOW = 0.5

# bfloat16 calls of at least this many scores (B H Lq Lk) go to the C++ kernel where the CPU has bfloat16 dot
# products (AVX512-BF16), whose products run on them; smaller ones to SDPA (which computes bfloat16 in float32).
BF16_KERNEL_FROM = 2**22

# A score_mod that is a bias (ALiBi) runs on SDPA as one dense ``(H, Lq, Lk)`` bias below this many elements, on the
# tile engine from it (float64, H=8, L=1024, forward and backward: 187 ms against SDPA's 225 ms, a third the memory;
# a decode step's bias is a row of the keys).
DENSE_BIAS_FROM = 2**20

# ------------------------------------------------------------------------------------------------ the conditions


def _traced(call: Call) -> bool:
    """torch.compile traces the call."""
    return call.mask.traced


def _wants_weights(call: Call) -> bool:
    """The weights are wanted."""
    return call.need_weights


def _additive(call: Call) -> bool:
    """Additive scoring."""
    return call.w_v is not None


def _additive_features(call: Call) -> int:
    B, H, Lq, D = call.q.shape
    return B * H * Lq * call.k.shape[2] * D


def _additive_large(call: Call) -> bool:
    """Additive scoring whose features would be large held whole (``ADDITIVE_CHUNK_ELEMENTS``)."""
    return call.w_v is not None and _additive_features(call) >= ADDITIVE_CHUNK_ELEMENTS


def _additive_compiles(call: Call) -> bool:
    """Additive scoring on the CPU, large enough to repay compiling its steps (``ADDITIVE_FROM`` features,
    ``FEWEST_QUERIES`` queries)."""
    return (
        call.w_v is not None
        and call.q.device.type == "cpu"
        and call.q.shape[2] >= FEWEST_QUERIES
        and _additive_features(call) >= ADDITIVE_FROM
    )


def _modifiers_on_cuda(call: Call) -> bool:
    """A mask_mod or score_mod on CUDA."""
    return call.q.device.type == "cuda" and (call.mask.mask_mod is not None or call.score_mod is not None)


def _few_queries(call: Call) -> bool:
    """A decode step's few queries per key/value head, as the decode engine declares (on the CPU)."""
    return call.q.device.type == "cpu" and call.queries_per_kv_head <= (decode.SUPPORTS.max_queries or 0)


def _sparse(call: Call) -> bool:
    """A mask_mod whose plan's visible tiles hold at most ``SPARSE_BELOW`` of the pairs."""
    plan = call.mask.plan
    return call.mask.mask_mod is not None and plan is not None and plan.share <= SPARSE_BELOW  # type: ignore[attr-defined]


def _decode_step(call: Call) -> bool:
    """A decode step: few queries over a cache's keys stored positions last, or with a mask (where SDPA would read
    the whole cache once more to bound the scores it masks by adding -inf); not a sparse mask (the tile engine
    visits its band only), no sinks, no score_mod but a bias."""
    if not _few_queries(call) or call.sinks is not None or not call.score_bias or _sparse(call):
        return False
    return decode.is_positions_last(call.k, call.v) or not call.mask.is_empty


def _kernel_worth(call: Call) -> bool:
    """On the CPU (float32, or bfloat16 and float16 computed in float32: eager bfloat16 steps took 2.3x the
    kernel's float32 time on a window, docs/benchmarks.md), over more queries than a decode step's (planning tiles
    costs more there than a few eager steps): a mask_mod (a window took 0.15x SDPA without a mask), sinks,
    ``softcap``, or a score_mod that is a bias on the distance (ALiBi, a caller's table), looked for in calls of at
    least ``DISTANCE_FROM`` scores (it traces the function) or in a built-in that declares itself one."""
    if call.q.device.type != "cpu" or call.q.dtype == torch.float64 or call.w_v is not None or _few_queries(call):
        return False
    score_mod = call.score_mod
    if score_mod is None:
        return call.mask.mask_mod is not None or call.sinks is not None
    if type(score_mod) is mods.softcap:
        return True
    B, H, Lq, _ = call.q.shape
    if B * H * Lq * call.k.shape[2] < DISTANCE_FROM and not mods.declares_distance_bias(score_mod):
        return False  # (a packed document's piece asks the call's function, traced once for all its pieces)
    return call.distance_bias


@functools.cache
def _bf16_dot_products() -> bool:
    """This CPU has bfloat16 dot products (AVX512-BF16), as PyTorch's CPU information says (read once)."""
    found = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    return bool(found is not None and found())


def _bf16_products(call: Call) -> bool:
    """bfloat16 dot-product attention on a CPU with bfloat16 dot products, over more queries than a decode step's
    and at least ``BF16_KERNEL_FROM`` scores: the C++ kernel's products run on them (causal at L=8,192, forward and
    backward: 0.6-0.7x its float32 time, where SDPA, computing bfloat16 in float32 here, takes its float32 time)."""
    if call.q.device.type != "cpu" or call.q.dtype != torch.bfloat16 or call.w_v is not None or _few_queries(call):
        return False
    B, H, Lq, _ = call.q.shape
    return B * H * Lq * call.k.shape[2] >= BF16_KERNEL_FROM and _bf16_dot_products()


def _compile_worth(call: Call) -> bool:
    """A score_mod the C++ kernel does not run (not a bias, or a bias whose tensors need a gradient), on the CPU, in
    a call large enough to repay compiling its steps (``COMPILE_FROM`` scores, ``FEWEST_QUERIES`` queries)."""
    if call.q.device.type != "cpu" or call.w_v is not None or call.score_mod is None:
        return False
    if call.score_bias and not call.differentiates_score_mod:
        return False
    B, H, Lq, _ = call.q.shape
    return Lq >= FEWEST_QUERIES and B * H * Lq * call.k.shape[2] >= COMPILE_FROM


def _needs_the_engine(call: Call) -> bool:
    """Sinks, a score_mod that is not a bias or a bias of at least ``DENSE_BIAS_FROM`` elements held dense, or a
    sparse mask: what SDPA cannot run, or runs dense."""
    if call.score_mod is not None and (not call.score_bias or _dense_bias_elements(call) >= DENSE_BIAS_FROM):
        return True
    return call.sinks is not None or _sparse(call)


def _dense_bias_elements(call: Call) -> int:
    return call.q.shape[1] * call.mask.num_queries * call.mask.num_keys


def _dot_product(call: Call) -> bool:
    """Dot-product scoring."""
    return call.w_v is None


def _always(call: Call) -> bool:
    """Any call."""
    return True


class Rule(NamedTuple):
    """One step of the policy: ``engine`` runs the call when ``when(call)`` holds and it can."""

    engine: str
    when: Callable[[Call], bool]


#: The policy of ``backend="auto"`` (the first rule whose condition holds and whose engine can run the call runs it).
POLICY: tuple[Rule, ...] = (
    Rule("graph", _traced),
    Rule("reference", _wants_weights),
    Rule("tiles:compiled", _additive_compiles),
    Rule("tiles:online", _additive_large),
    Rule("reference", _additive),
    Rule("tiles:flex", _modifiers_on_cuda),
    Rule("decode", _decode_step),
    Rule("tiles:kernel", _kernel_worth),
    Rule("tiles:kernel", _bf16_products),
    Rule("tiles:compiled", _compile_worth),
    Rule("tiles:online", _needs_the_engine),
    Rule("sdpa", _dot_product),
    Rule("tiles:online", _always),
    Rule("reference", _always),
)

# The watch() blocks open in this thread or task, outermost first.
_WATCHERS: ContextVar[tuple[_Watch, ...]] = ContextVar("attnkit_watchers", default=())


def available_backends(device: str | torch.device | None = None, *, implementations: bool = False) -> list[str]:
    """Names of attnkit's backends that run on ``device`` (a device type such as ``"cpu"`` or ``"cuda"``, or a
    device), or, when ``None``, on some device this machine has (and whose packages it has: ``Supports.needs``; a
    kernel built on first use is listed before it is built, and a call it cannot run says why); with
    ``implementations``, the tile engine's implementations in its place (``"tiles:online"``, ...).
    What a backend cannot run is declared in its ``SUPPORTS`` and said per call, and a backend named explicitly
    lists every backend's reasons.

    Example:
        >>> available_backends("cpu")
        ['reference', 'sdpa', 'decode', 'tiles', 'graph']
    """
    here = {"cpu", "cuda"} if torch.cuda.is_available() else {"cpu"}
    types = here if device is None else {torch.device(device).type}
    found = [(name, b.SUPPORTS) for name, b in (ENGINES if implementations else BACKENDS).items()]
    return [name for name, s in found if s.needs is None and (s.devices is None or types & s.devices)]


def describe_backends() -> dict[str, str]:
    """For each backend and each of the tile engine's implementations, what it can run, as it declares (``attnkit
    info`` shows them)."""
    return {name: engine.SUPPORTS.describe() for name, engine in {**BACKENDS, **ENGINES}.items()}


@contextlib.contextmanager
def watch(*, implementations: bool = False) -> Iterator[list[str]]:
    """Collect the names of the backends that run inside the ``with`` block, in order (with ``implementations``,
    the tile engine's as ``"tiles:kernel"`` and the like).

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
    entry = _Watch(seen, implementations)
    _WATCHERS.set((*_WATCHERS.get(), entry))
    try:
        with _scoped_state.counted("watch"):
            yield seen
    finally:  # blocks may close in any order (contextlib.ExitStack): remove this one, keep the others
        entry.open = False  # an asyncio task made inside the block holds a copy of the tuple: it sees nothing more
        _WATCHERS.set(tuple(w for w in _WATCHERS.get() if w is not entry))


def choose(backend: str, call: Call) -> ModuleType:
    """The engine that will run ``call`` (see the module docstring for the policy).

    Raises:
        ValueError: ``backend`` is not an engine's name (a replaced one says what replaced it), or the engine named
            cannot run the call (the message gives every engine's reasons, from what each declares in its
            ``SUPPORTS``).
    """
    if call.mask.traced:  # torch.compile traces this call: only the graph backend reads no value
        return ENGINES["graph"]
    if backend == "auto":
        found = _first(POLICY, call)
        if found is None:
            raise ValueError("no backend can run this call: " + all_reasons(call))
        return found
    check_name(backend)
    if backend == tiles.NAME:  # the policy's own reasons first, then the first implementation that can run it
        general = (_always, _needs_the_engine)
        preferred = tuple(rule for rule in POLICY if rule.engine in tiles.IMPLEMENTATIONS and rule.when not in general)
        everyone = tuple(Rule(name, _always) for name in tiles.IMPLEMENTATIONS)
        found = _first(preferred, call) or _first(everyone, call)
    else:
        found = None if ENGINES[backend].SUPPORTS.why_not(call) else ENGINES[backend]
    if found is None:
        raise ValueError(f"backend={backend!r} cannot run this call: " + all_reasons(call, backend))
    return found


def _first(rules: tuple[Rule, ...], call: Call) -> ModuleType | None:
    for rule in rules:
        engine = ENGINES[rule.engine]
        if rule.when(call) and not engine.SUPPORTS.why_not(call):
            return engine
    return None


def check_name(backend: object) -> None:
    """``backend`` is ``"auto"``, a backend's name, or a tile engine implementation's (``"tiles:online"``).

    Raises:
        TypeError: not a string. ValueError: not a name, listing the names (or saying what replaced it).
    """
    names = sorted([*BACKENDS, *tiles.IMPLEMENTATIONS])
    if not isinstance(backend, str):
        raise TypeError(f"backend must be 'auto' or one of {names}, got {backend!r}")
    if backend in REPLACED:
        raise ValueError(
            f"backend={backend!r} is now part of the tile engine: backend={REPLACED[backend]!r} runs what it ran "
            "(or backend='tiles', which picks among the engine's implementations)"
        )
    if backend != "auto" and backend not in BACKENDS and backend not in tiles.IMPLEMENTATIONS:
        raise ValueError(f"backend must be 'auto' or one of {names}, got {backend!r}")


def all_reasons(call: Call, first: str | None = None) -> str:
    """Every engine's reasons not to run ``call``, the engine named ``first`` first. Asking an engine may run the
    caller's score_mod (``tiles:compiled`` looks at whether it takes blocks): what it raises is that engine's
    reason, not the answer."""
    parts = []
    for name in sorted(ENGINES, key=lambda n: n != first):
        try:
            reasons = ENGINES[name].SUPPORTS.why_not(call)
        except (TypeError, ValueError) as error:
            reasons = [f"asking raised {type(error).__name__}: {error}"]
        parts.append(f"{name}: {'; '.join(reasons) if reasons else 'can run it'}")
    return " | ".join(parts)


def ran(engine: ModuleType) -> None:
    """Tell the open :func:`watch` blocks that ``engine`` ran a call."""
    for entry in _scoped_state.read(_WATCHERS, ()):
        if entry.open:
            entry.seen.append(engine.NAME if entry.implementations else engine.NAME.split(":")[0])


def ran_elsewhere(name: str) -> None:
    """Tell the open :func:`watch` blocks that ``name`` runs a call the dispatcher did not choose for: ``"ring"``
    for every call inside :func:`attnkit.distributed.context_parallel`."""
    for entry in _scoped_state.read(_WATCHERS, ()):
        if entry.open:
            entry.seen.append(name)


class _Watch:
    """One open watch() block: the list it fills, while it is open, and whether it names implementations."""

    def __init__(self, seen: list[str], implementations: bool) -> None:
        self.seen, self.implementations, self.open = seen, implementations, True
