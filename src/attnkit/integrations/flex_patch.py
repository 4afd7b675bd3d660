"""Code written against ``torch.nn.attention.flex_attention.flex_attention`` on attnkit, unchanged:
:func:`patch_flex_attention` points torch's name, and every loaded module's copy of it, at
:func:`attnkit.flex_attention` for CPU tensors (torch's own on other devices), until the last patch closes.

A module's attribute is the process's: the patch is process-wide state (a count of open patches under a lock), not a
scope's; what it changed is listed when the last one closes, by looking for attnkit's function again.
"""

from __future__ import annotations

import sys
import threading
import warnings
from typing import Any

import torch
from torch import Tensor

from attnkit.integrations.torch_flex import TORCH_FLEX_ATTENTION, _torch_flex, flex_attention

__all__ = ["original", "patch_flex_attention"]


class _Patch:
    """The patch's process-wide state (a module's attribute is the process's): how many patches are open (the last to
    close gives torch's function back to every module that holds attnkit's), and the eager wrapper the patched name
    calls on the CPU."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.open = 0
        self.active = False  # open > 0, changed only as the first opens and the last closes (what compiled code reads)
        self.eager: Any = None  # torch.compiler.disable(flex_attention), made by the first patch (the decorator
        # imports torch._dynamo, seconds that `import attnkit` must not spend)


_PATCH = _Patch()


def original() -> Any:
    """torch's own ``flex_attention``, patched or not."""
    return TORCH_FLEX_ATTENTION


def _patched(*args: Any, **kwargs: Any) -> Any:
    """What torch's name runs under :func:`patch_flex_attention`: attnkit's on CPU tensors, torch's on any other
    device (and once no patch is open: a module imported inside the block may still hold this function). Under
    ``torch.compile`` (transformers compiles the name it holds) the CPU call is a graph break around an eager call,
    the others compile as torch's own."""
    query = kwargs["query"] if "query" in kwargs else (args[0] if args else None)
    if not isinstance(query, Tensor) or query.device.type != "cpu" or not _PATCH.active:
        return original()(*args, **kwargs)
    return _PATCH.eager(*args, **kwargs)


class _Patched:
    """A patch in force: a context manager whose exit ends it (a plain call leaves it for the process)."""

    def __init__(self) -> None:
        self.closed = False

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """End this patch; the last one open gives torch's function back to every module that holds attnkit's
        (those imported while it was open included)."""
        with _PATCH.lock:
            if self.closed:
                return
            self.closed = True
            _PATCH.open -= 1
            if _PATCH.open:
                return
            _PATCH.active = False
            for module, name in _holders(_patched):
                setattr(module, name, TORCH_FLEX_ATTENTION)
            _recompile_transformers()


def _holders(fn: Any) -> list[tuple[Any, str]]:
    """Every ``(module, name)`` of a loaded module that holds ``fn``."""
    found: list[tuple[Any, str]] = []
    for module in list(sys.modules.values()):
        name_ = getattr(module, "__name__", "")
        if name_ == "attnkit" or name_.startswith("attnkit."):
            continue  # (attnkit's own names: this module's, and the CUDA engine's hold on torch's, stay as they are)
        names = getattr(module, "__dict__", None)
        if isinstance(names, dict):
            found.extend((module, name) for name, value in list(names.items()) if value is fn)
    return found


def patch_flex_attention() -> _Patched:
    """Run ``torch.nn.attention.flex_attention.flex_attention`` on attnkit for CPU tensors (forward and backward;
    torch's own on other devices): from this call on, for the process, or to the end of a ``with`` block::

        with attnkit.patch_flex_attention():
            loss = model(**batch).loss  # transformers' attn_implementation="flex_attention", on the CPU
            loss.backward()

    Every loaded module that holds torch's function under a name (``from torch.nn.attention.flex_attention import
    flex_attention``: transformers does) is pointed at attnkit's too, and transformers' compiled copy of it
    (``WrappedFlexAttention``, transformers 5.23) is made again at its next call; when the last patch closes, each
    gets torch's function back. A module imported while the patch is open that copies the name gets attnkit's.

    Returns:
        The patch in force, which a ``with`` block ends at its end and ``.close()`` ends by hand.
    """
    with _PATCH.lock:
        if not _PATCH.open:
            if _PATCH.eager is None:  # (once: a new one each patch would make compiled callers recompile)
                _PATCH.eager = torch.compiler.disable(flex_attention)
            if _torch_flex().flex_attention is not TORCH_FLEX_ATTENTION:
                warnings.warn(
                    "torch.nn.attention.flex_attention.flex_attention is not torch's function of attnkit's import "
                    "(something replaced it since): patch_flex_attention leaves it as it is",
                    stacklevel=2,
                )
            for module, name in _holders(TORCH_FLEX_ATTENTION):
                setattr(module, name, _patched)
            _recompile_transformers()
        _PATCH.open += 1
        _PATCH.active = True
    return _Patched()


def _recompile_transformers() -> None:
    """transformers keeps ``torch.compile(flex_attention)`` made at its first call (``WrappedFlexAttention``, a
    singleton, transformers 5.23, ``tests/test_torch_flex.py`` checks the name): marked stale, it compiles the
    function its module holds now at the next call."""
    module = sys.modules.get("transformers.integrations.flex_attention")
    wrapped = getattr(module, "WrappedFlexAttention", None)
    if wrapped is not None and hasattr(wrapped, "_is_flex_compiled"):
        wrapped._is_flex_compiled = False
        instance = getattr(wrapped, "_instance", None)
        if instance is not None:
            instance._is_flex_compiled = False
