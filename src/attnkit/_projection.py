"""The attention layers' projections, fast at the sizes of a decode step.

A decode step multiplies one row (or a few) by each weight matrix, and so reads every weight once for very little
arithmetic. On CPU, PyTorch hands a product of one row to a single-threaded matrix-vector routine that reads the
weights at a fraction of the machine's bandwidth, and a few rows fare little better (``python
benchmarks/decode.py --only layout`` times ``(1, 512) @ (512, 1536)`` with the weights from memory each way). Two
things help, with results equal up to float rounding:

* self-attention's three projections of one input as one product with the weights stacked (one call, one pass
  over the input), when decoding with a :class:`~attnkit.KVCache` (:class:`Stacked`, which the layer owns);
* on CPU, at most ``SMALL_ROWS`` rows: the weight split in two halves, multiplied as a batch of two, so that
  both cores read; the stacked weights are kept transposed, ``(E, O)``, which both cores read faster still
  (cold, ``(1, 512) @ (512, 1536)``: 0.18-0.20 ms, against 0.24 ms stacked untransposed or three products).

Only without autograd (inference, decoding) and for plain ``nn.Linear`` modules without hooks of their own and
with no global module hook registered (``torch.nn.modules.module.register_module_forward_hook`` and the others:
profilers, quantisers and LoRA tooling rely on them): anything else calls the modules as they are.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F

# B batch, L length, E features in, O features out

# Rows up to which a CPU product runs as two halves of the weight (decode steps of small batches).
SMALL_ROWS = 16

# Whether any global module hook (forward, forward pre-, backward, backward pre-) is registered: a private function
# of torch.nn.modules.module, checked against torch 2.13 (tests/test_projection.py fails when it moves). Without it,
# every call goes through the modules.
_has_global_hook = getattr(torch.nn.modules.module, "_has_any_global_hook", lambda: True)


def make(in_features: int | None, out_features: int, *, bias: bool) -> nn.Linear:
    """``nn.Linear``, or ``nn.LazyLinear`` (its input size inferred at the first call) when ``in_features`` is None."""
    if in_features is None:
        return _LazyLinear(out_features, bias=bias)
    return nn.Linear(in_features, out_features, bias=bias)


# The first calls of lazy projections draw their weights one at a time: a lock, not state (a module holding one could
# not be deep-copied).
_FIRST_CALL = threading.Lock()


class _LazyLinear(nn.LazyLinear):
    """``nn.LazyLinear`` whose first call may come from two threads at once. PyTorch's hook that draws the weights
    and turns the module into an ``nn.Linear`` is not safe so (the second thread finds the hook gone and fails):
    here it runs once, the other thread waiting, then finding the weights drawn."""

    def _infer_parameters(self, module: nn.Module, args: Any, kwargs: Any = None) -> None:
        with _FIRST_CALL:
            # (another thread may have done it while this one waited: the module is an nn.Linear then)
            if isinstance(module, nn.LazyLinear):
                super()._infer_parameters(module, args, kwargs)


def check_features(name: str, x: Tensor, proj: nn.Linear) -> None:
    """An input the projection cannot take is said before any work, not by a matmul error: a TypeError naming both
    dtypes when ``x`` is not in the weights' dtype (outside autocast, which casts both), a ValueError naming the
    expected size for a wrong feature size."""
    if isinstance(proj, nn.LazyLinear) and torch.compiler.is_compiling():
        return  # its first call under torch.compile: dynamo draws the weights when it calls it, not if read before
    weight = proj.weight  # an UninitializedParameter of a lazy layer has its dtype already
    if x.dtype != weight.dtype and not (x.is_floating_point() and torch.is_autocast_enabled(x.device.type)):
        raise TypeError(
            f"{name} is {x.dtype} but this layer's weights are {weight.dtype}: convert one to the other "
            f"(layer.to({x.dtype}) or {name}.to({weight.dtype}))"
        )
    if isinstance(proj, nn.LazyLinear) and proj.has_uninitialized_params():
        return
    expected = proj.weight.shape[1]
    if x.shape[-1] != expected:
        raise ValueError(
            f"{name} must have {expected} features (the size this layer was built or first called with), "
            f"got {x.shape[-1]}: {name} {tuple(x.shape)}"
        )


def plain(*modules: nn.Module) -> bool:
    """Whether the modules are plain ``nn.Linear`` layers without hooks (their own or global ones), and autograd is
    not needed through them: then their products may be computed here instead of by calling them."""
    if _has_global_hook():
        return False
    if any(
        type(m) is not nn.Linear
        or "forward" in vars(m)  # a forward replaced on the instance (accelerate's add_hook_to_module does so)
        or m._forward_hooks
        or m._forward_pre_hooks
        or m._backward_hooks
        or m._backward_pre_hooks
        for m in modules
    ):
        return False
    return not (torch.is_grad_enabled() and any(p.requires_grad for m in modules for p in m.parameters()))


def same(a: Tensor, b: Tensor) -> bool:
    """Whether two tensors are the same values: one object, or views of the same memory alike in every way
    (``x[:, t:t+1]`` written twice)."""
    return a is b or (
        a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
        and a.device == b.device
    )


def linear(x: Tensor, m: nn.Linear) -> Tensor:
    """``m(x)``: ``(..., E) -> (..., O)``."""
    if not plain(m):
        return m(x)
    return _product(x, m.weight, m.bias)


class Stacked:
    """Self-attention's q/k/v projections of one input as one product (``(..., E) -> [(..., O_i)]``, views of one
    tensor), with the weights stacked and kept transposed: what a layer owns for its decode steps.

    The stacked weights are made again at the start of each generation (the call finds its
    :class:`~attnkit.KVCache` empty) and whenever a parameter is replaced, moved or changed in place; a write
    through ``.data`` (an EMA update written so), which PyTorch does not count as a change, is seen from the next
    generation. They are dropped when a cache they served is gone, and by :meth:`clear` (the layer calls it when
    its parameters are moved or converted). Never saved, pickled or copied with the layer.
    """

    def __init__(self) -> None:
        self._kept: tuple[list[tuple], Tensor, Tensor | None] | None = None  # (key, weight (sum O_i, E), bias)
        self._served: weakref.WeakSet = weakref.WeakSet()  # the caches whose end drops the weights

    def clear(self) -> None:
        self._kept = None

    def __call__(self, x: Tensor, modules: tuple[nn.Linear, ...], *, cache: object) -> list[Tensor]:
        if not plain(*modules) or torch.compiler.is_compiling():  # (compiled: Inductor's own fusion; the key
            return [m(x) for m in modules]  # reads data pointers, which dynamo cannot compare)
        refresh = getattr(cache, "is_empty", True)
        params = [p for m in modules for p in (m.weight, m.bias) if p is not None]
        # the parameters themselves (replaced: another object) and where their data is and how often it changed in
        # place (`module.to()` swaps `.data`; an optimizer step bumps the version)
        key = [(p, p.data_ptr(), p._version, p.dtype, p.device) for p in params]
        if refresh or self._kept is None or not _same(self._kept[0], key):
            with torch.no_grad():
                weight = torch.cat([m.weight for m in modules], dim=0).t().contiguous().t()  # (sum O_i, E) over (E, O)
                bias = None
                if any(m.bias is not None for m in modules):
                    bias = torch.cat(
                        [m.bias if m.bias is not None else m.weight.new_zeros(m.out_features) for m in modules]
                    )  # (sum O_i,)
            self._kept = (key, weight, bias)
            if cache not in self._served:  # once per cache, however often it is reset
                self._served.add(cache)
                weakref.finalize(cache, _drop, weakref.ref(self))
        _, weight, bias = self._kept
        out = _product(x, weight, bias)  # (..., sum O_i)
        return list(out.split([m.out_features for m in modules], dim=-1))

    def __getstate__(self) -> dict:
        return {}  # derived from the parameters: nothing to save or copy

    def __setstate__(self, state: dict) -> None:
        self.__init__()  # type: ignore[misc]


def _drop(stacked: weakref.ref) -> None:
    """A cache the stacked weights served is gone: drop them (the next generation makes them again)."""
    alive = stacked()
    if alive is not None:
        alive.clear()


def _same(a: list[tuple], b: list[tuple]) -> bool:
    return len(a) == len(b) and all(x[0] is y[0] and x[1:] == y[1:] for x, y in zip(a, b, strict=True))


def _product(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    rows = x.numel() // max(1, x.shape[-1])
    out_features, E = weight.shape
    half = out_features // 2
    if x.device.type != "cpu" or rows > SMALL_ROWS or out_features % 2 or rows == 0:
        return F.linear(x, weight, bias)  # (..., O)
    # (2, E, O/2): views of the weight's memory, whichever way it is laid out
    halves = weight.t().unflatten(1, (2, half)).transpose(0, 1)
    x2 = x.reshape(1, rows, E).expand(2, rows, E)  # (2, rows, E)
    out = torch.bmm(x2, halves) if bias is None else torch.baddbmm(bias.view(2, 1, half), x2, halves)  # (2, rows, O/2)
    return out.transpose(0, 1).reshape(*x.shape[:-1], out_features)  # (..., O)
