"""attnkit's C++ kernels, built with PyTorch's C++ extension loader on first use (a C++ compiler and ninja; ~7 s,
then cached on disk: :func:`build_directory`), each registering its ops under ``torch.ops``. The statistics' tile
kernel (:mod:`attnkit.stats.kernel`) and the flash kernel (:mod:`attnkit.backends.flash`) are built here; where one
cannot be built, its caller runs torch ops or another backend instead and says so once.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

try:
    import fcntl
except ImportError:  # Windows: no flock; PyTorch's loader's own lock file alone
    fcntl = None  # type: ignore[assignment]

__all__ = ["build", "build_directory", "extension_name"]

# Instruction sets PyTorch dispatches its own CPU kernels to, and the compiler flags that build for the same: the
# extension's name carries the set, so that a build cache shared by unlike machines never runs one on another.
_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw", "-mfma", "-mavx2", "-mprefer-vector-width=512"],
    "AVX2": ["-mavx2", "-mfma"],
}


# One build at a time in this process: each puts ninja on PATH and restores it after (os.environ is the process's).
_IN_PROCESS = threading.Lock()


def extension_name(prefix: str) -> str:
    """``prefix`` and the instruction set this machine's PyTorch runs (``attnkit_stats_avx512``)."""
    return f"{prefix}_{torch.backends.cpu.get_cpu_capability().lower().replace(' ', '_')}"


def build_directory(name: str) -> Path:
    """Where a kernel is built: under ``TORCH_EXTENSIONS_DIR`` (or ``~/.cache/torch_extensions``), apart for each
    Python and PyTorch version (the loader's own cache tells its builds apart by source and flags, not by the
    PyTorch they link against)."""
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    python = f"py{sys.version_info.major}{sys.version_info.minor}"
    return root / f"attnkit-{python}-torch{torch.__version__.replace('+', '-')}" / name


def build(prefix: str, source: Path) -> None:
    """Build ``source`` (or load its cached build) and register its ops in this process.

    Raises:
        Exception: whatever the loader raises (no compiler, no ninja, a build error).
    """
    capability = torch.backends.cpu.get_cpu_capability()
    # -fno-trapping-math lets the loops vectorize (floor, selects); -fopenmp makes at::parallel_for run on
    # PyTorch's own OpenMP threads (its libgomp.so.1, loaded already, serves the extension's)
    flags = ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", *_FLAGS.get(capability, [])]
    name = extension_name(prefix)
    from torch.utils import cpp_extension

    directory = build_directory(name)
    directory.mkdir(parents=True, exist_ok=True)
    with _building(directory), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the loader's notes on compiler versions: the build works or raises
        cpp_extension.load(
            name,
            [str(source)],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            build_directory=str(directory),
            is_python_module=False,
            verbose=False,
        )


@contextlib.contextmanager
def _building(directory: Path) -> Iterator[None]:
    """Hold the builds against this process's other threads (one at a time) and the build directory against
    attnkit's other processes (``fcntl.flock``, released by the system if this one dies), and remove the loader's
    own lock file if one is there: under the flock it was left by a build that died (the loader would wait for it
    forever). The ``ninja`` installed with attnkit goes first on ``PATH``, where the loader looks for it (an
    environment's ``bin`` is on ``PATH`` only when it is activated)."""
    with _IN_PROCESS, _with_ninja(), open(directory / "attnkit.flock", "w") as handle:
        if fcntl is not None:
            fcntl.flock(handle, fcntl.LOCK_EX)
        with contextlib.suppress(FileNotFoundError):
            (directory / "lock").unlink()
        yield


@contextlib.contextmanager
def _with_ninja() -> Iterator[None]:
    """``PATH`` with the ``ninja`` installed with attnkit first, then as it was (under ``_IN_PROCESS``: a second
    thread's build would otherwise read the first's ``PATH`` and put it back after the first had restored it, or
    lose ``ninja`` while it builds)."""
    path = os.environ.get("PATH", "")
    with contextlib.suppress(ImportError):
        import ninja

        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, path])
    try:
        yield
    finally:
        os.environ["PATH"] = path
