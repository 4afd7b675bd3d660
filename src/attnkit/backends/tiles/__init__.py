"""The tile engine: one online softmax over the tiles of a call's plan (:class:`attnkit.plan.Plan`: hidden tiles never
touched, visible ones without a mask), in four implementations, each a module that declares what it runs
(``SUPPORTS``), chosen by :mod:`attnkit.dispatch`:

* ``tiles:kernel``: attnkit's C++ kernel (CPU, float32, 16-bit inputs computed in float32: every mask, sinks,
  ``softcap``, a bias on the distance such as ALiBi or a learned table), where it builds
  (:mod:`~attnkit.backends.tiles.kernel`);
* ``tiles:flex``: PyTorch's FlexAttention (CUDA: a ``mask_mod`` or ``score_mod``; :mod:`~attnkit.backends.tiles.flex`);
* ``tiles:compiled``: the online softmax's steps compiled by ``torch.compile`` (CPU: score_mods the kernel does not
  run, additive scoring, in calls large enough to repay compiling; :mod:`~attnkit.backends.tiles.compiled`);
* ``tiles:online``: the online softmax in torch ops, eagerly, on any device and dtype, with every modifier, sinks and
  additive scoring (:mod:`~attnkit.backends.tiles.online`), over the math of :mod:`~attnkit.backends.tiles.softmax`.

``backend="tiles"`` runs a call on the implementation the policy prefers among those that can run it;
``backend="tiles:online"`` (or another's name) runs that one. None returns weights or applies dropout, and all are
linear in memory.

Earns its place (``benchmarks/fused.py``, docs/benchmarks.md): ``auto`` chooses it for flexible masks and modifiers,
where nothing else comes within 10%: a sliding window at L=8192 in 0.15x the time of SDPA without a mask (forward and
backward), ALiBi, softcap and a learned bias table at 1.0-1.1x SDPA's causal call, additive scoring at 0.03x the
book's formula; and it is the only engine of linear memory with sinks, a ``score_mod``, or additive scoring.
"""

from attnkit.backends.tiles import compiled, flex, kernel, online

NAME = "tiles"

#: Its implementations, by name, in the order ``backend="tiles"`` tries them where the policy prefers none (compiled
#: steps last: compiling takes seconds, which only a large call repays).
IMPLEMENTATIONS = {m.NAME: m for m in (kernel, flex, online, compiled)}

#: What the engine runs: its most general implementation's (``tiles:online``).
SUPPORTS = online.SUPPORTS

__all__ = ["IMPLEMENTATIONS", "NAME", "SUPPORTS", "compiled", "flex", "kernel", "online"]
