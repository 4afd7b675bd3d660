"""The statistics' tile kernel (``tile.cpp``): one float32 tile of :mod:`attnkit.stats.tiled`'s pass, each row of
its scores reduced while it is in cache, where the same steps as torch ops read the whole tile a dozen times. Built
with PyTorch's C++ extension loader on first use (a C++ compiler and ninja; ~7 s, then cached:
:func:`build_directory`); where it cannot be built, the pass runs its torch ops (the same results, slower) and says
so once.

``ATTNKIT_STATS_KERNEL=0`` in the environment, or :func:`disabled`, keeps the torch ops.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import warnings
from collections.abc import Iterator
from contextvars import ContextVar
from pathlib import Path

import torch
from torch import Tensor

try:
    import fcntl
except ImportError:  # Windows: no flock; PyTorch's loader's own lock file alone
    fcntl = None  # type: ignore[assignment]

__all__ = ["available", "build_directory", "disabled", "failed", "tile"]

_SOURCE = Path(__file__).with_name("tile.cpp")
# Instruction sets PyTorch dispatches its own CPU kernels to, and the compiler flags that build for the same: the
# extension's name carries the set, so that a build cache shared by unlike machines never runs one on another.
_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw", "-mfma", "-mavx2", "-mprefer-vector-width=512"],
    "AVX2": ["-mavx2", "-mfma"],
}
_LOCK = threading.Lock()
_state: dict[str, bool] = {}  # "built": the op is registered; "failed": the build failed (said once)
_OFF: ContextVar[bool] = ContextVar("attnkit_stats_kernel_off", default=False)


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Within it, the tiled pass runs its torch ops, not the kernel (the tests hold the two equal)."""
    token = _OFF.set(True)
    try:
        yield
    finally:
        _OFF.reset(token)


def available() -> bool:
    """Whether the kernel runs here: built (now, the first time) and not turned off."""
    if _OFF.get() or os.environ.get("ATTNKIT_STATS_KERNEL", "1") == "0":
        return False
    with _LOCK:
        if not _state:
            _state.update(_build())
    return _state.get("built", False)


def build_directory(name: str) -> Path:
    """Where the kernel is built: under ``TORCH_EXTENSIONS_DIR`` (or ``~/.cache/torch_extensions``), apart for each
    Python and PyTorch version (the loader's own cache tells its builds apart by source and flags, not by the
    PyTorch they link against)."""
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    return root / f"attnkit-{python}-torch{torch.__version__.replace('+', '-')}" / name


@contextlib.contextmanager
def _building(directory: Path) -> Iterator[None]:
    """Hold the build directory against attnkit's other processes (``fcntl.flock``, released by the system if this
    one dies), and remove the loader's own lock file if one is there: under the flock it was left by a build that
    died (the loader would wait for it forever). The ``ninja`` installed with attnkit goes first on ``PATH``, where
    the loader looks for it (an environment's ``bin`` is on ``PATH`` only when it is activated)."""
    path = os.environ.get("PATH", "")
    with contextlib.suppress(ImportError):
        import ninja

        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, path])
    try:
        with open(directory / "attnkit.flock", "w") as handle:
            if fcntl is not None:
                fcntl.flock(handle, fcntl.LOCK_EX)
            with contextlib.suppress(FileNotFoundError):
                (directory / "lock").unlink()
            yield
    finally:
        os.environ["PATH"] = path


def _build() -> dict[str, bool]:
    capability = torch.backends.cpu.get_cpu_capability()
    # -fno-trapping-math lets the loops of tile.cpp vectorize (floor, selects); -fopenmp makes at::parallel_for
    # run on PyTorch's own OpenMP threads (its libgomp.so.1, loaded already, serves the extension's)
    flags = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", *_FLAGS.get(capability, [])]
    name = f"attnkit_stats_{capability.lower().replace(' ', '_')}"
    try:
        from torch.utils import cpp_extension

        directory = build_directory(name)
        directory.mkdir(parents=True, exist_ok=True)
        with _building(directory), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the loader's notes on compiler versions: the build works or raises
            cpp_extension.load(
                name,
                [str(_SOURCE)],
                extra_cflags=flags,
                extra_ldflags=["-fopenmp"],
                build_directory=str(directory),
                is_python_module=False,
                verbose=False,
            )
        return {"built": True}
    except Exception as error:  # no compiler, no ninja, a build error: the torch ops instead
        _warn("could not be built", error)
        return {"failed": True}


def failed(error: Exception) -> None:
    """The kernel raised while it ran (a runtime unlike the one it was built for): say so, and use the torch ops
    from now on."""
    with _LOCK:
        _state.clear()
        _state["failed"] = True
    _warn("failed", error)


def _warn(what: str, error: Exception) -> None:
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
    warnings.warn(
        f"attnkit: the statistics' tile kernel {what} ({type(error).__name__}: {first_line}); record_stats runs "
        "its torch ops instead (the same results, slower; ATTNKIT_STATS_KERNEL=0 skips the kernel)",
        RuntimeWarning,
        stacklevel=5,
    )


def tile(
    t: Tensor,
    shift: Tensor,
    qpos: Tensor,
    a: int,
    real: int,
    causal: bool,
    sink_keys: int,
    n: int,
    sums: Tensor,
    column: Tensor,
    top: tuple[Tensor, Tensor, Tensor],
) -> None:
    """One tile (``tile.cpp`` says what each argument is; ``top``: the top-k's scores, values and indices); only
    where :func:`available`."""
    torch.ops.attnkit_stats.tile(t, shift, qpos, a, real, causal, sink_keys, n, sums, column, *top)
