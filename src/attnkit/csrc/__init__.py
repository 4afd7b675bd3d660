"""attnkit's C++ kernels, their sources in this folder (``common.h``, ``flash.cpp``, ``stats.cpp``), and the one loader.

:func:`load` registers a kernel's ops under ``torch.ops`` (``attnkit_flash``, ``attnkit_stats``):

* a kernel built ahead of time by ``pip install`` (``ATTNKIT_BUILD_KERNELS=1 pip install --no-build-isolation
  -e .``, README "Install") from these very sources, when there is one beside them;
* otherwise one built on first use with PyTorch's C++ extension loader (a C++ compiler and ninja: about 7-90 s),
  which says so, once, in one line on stderr, and is cached on disk (:func:`build_directory`) under the hash of its
  sources, the flags, Python's and PyTorch's versions and installations and the instruction set: checkouts of the
  same sources in one environment share a build, neither checkouts whose sources differ nor two environments rebuild
  each other's, and a changed source is built anew.

:func:`ensure` loads a kernel once a process and remembers what happened: the one place that knows whether a kernel
runs here (a loaded library is the process's). Where one cannot be built, it says so once, and its caller runs torch
ops or another implementation (``attnkit.backends.tiles.kernel``, ``attnkit.stats.kernel``). An environment variable
keeps each off: ``ATTNKIT_FLASH_KERNEL=0``, ``ATTNKIT_STATS_KERNEL=0``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import sys
import sysconfig
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

try:
    import fcntl
except ImportError:  # Windows: no flock; PyTorch's loader's own lock file alone
    fcntl = None  # type: ignore[assignment]

__all__ = ["KERNELS", "build_directory", "compile_flags", "ensure", "extension_name", "known", "load", "source_hash"]

HERE = Path(__file__).parent

#: Each kernel's source, beside the headers they include (each build hashes and copies both).
KERNELS = {"flash": "flash.cpp", "stats": "stats.cpp"}
HEADERS = ("common.h", "bf16.h")

# Instruction sets PyTorch dispatches its own CPU kernels to, and the compiler flags that build for the same: the
# build's name and hash carry the set, so that a build cache shared by unlike machines never runs one on another.
_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512dq", "-mavx512vl", "-mavx512bw", "-mfma", "-mavx2", "-mprefer-vector-width=512"],
    "AVX2": ["-mavx2", "-mfma"],
}

# One build at a time in this process: each puts ninja on PATH and restores it after (os.environ is the process's).
_IN_PROCESS = threading.Lock()

# Each kernel's variable that keeps it off ("0"), and what it offers where it runs (for the warning of a failed build).
SWITCHES = {"flash": "ATTNKIT_FLASH_KERNEL", "stats": "ATTNKIT_STATS_KERNEL"}
_INSTEAD = {
    "flash": "the tile engine runs its calls in torch ops instead (the same results, slower)",
    "stats": "record_stats runs its torch ops instead (the same results, slower)",
}

# What each kernel's load gave in this process: None, loaded; a reason, it cannot be (a process's state: a library
# is loaded into the process). Read and written under _LOADING.
_LOADED: dict[str, str | None] = {}
_LOADING = threading.Lock()


def known(name: str) -> str | None:
    """Why kernel ``name`` does not run here, as far as is known without building it: turned off, or its build
    failed before; ``None`` otherwise (loaded, or not tried yet). Builds nothing."""
    if os.environ.get(SWITCHES[name], "1") == "0":
        return f"{SWITCHES[name]} unset or 1 (it is 0 here)"
    with _LOADING:
        return _LOADED.get(name)


def ensure(name: str) -> str | None:
    """Load kernel ``name`` the first time it is asked (building it the first time on this machine: :func:`load`);
    ``None`` where it runs, else why it does not (said once, as a RuntimeWarning)."""
    off = known(name)
    if off is not None:
        return off
    with _LOADING:
        if name not in _LOADED:
            try:
                load(name)
                _LOADED[name] = None
            except Exception as error:  # no compiler, no ninja, a build error
                reason = str(error).strip().splitlines()[0] if str(error).strip() else ""
                _LOADED[name] = f"its C++ kernel built (the build failed: {type(error).__name__}: {reason})"
                advice = (  # a folder that cannot be written, or a build that cannot run
                    "TORCH_EXTENSIONS_DIR names a folder it may write to"
                    if isinstance(error, PermissionError) or getattr(error, "errno", None) == errno.EROFS
                    else "`make compiler` installs a C++ compiler"
                )
                warnings.warn(
                    f"attnkit: the {name} kernel could not be built ({type(error).__name__}: {reason}); "
                    f"{_INSTEAD[name]} ({advice})",
                    RuntimeWarning,
                    stacklevel=3,
                )
        return _LOADED[name]


def failed(name: str, error: Exception) -> None:
    """Kernel ``name`` raised as it ran (a runtime unlike the one it was built for): said once; it runs no more."""
    with _LOADING:
        _LOADED[name] = f"its C++ kernel ran (it raised {type(error).__name__}: {error})"
    warnings.warn(
        f"attnkit: the {name} kernel failed ({type(error).__name__}: {error}); {_INSTEAD[name]}",
        RuntimeWarning,
        stacklevel=3,
    )


def compile_flags() -> list[str]:
    """The compiler flags of every kernel on this machine: ``-O3``, OpenMP (``at::parallel_for`` then runs on
    PyTorch's own OpenMP threads: its libgomp, loaded already, serves the kernel's), ``-fno-trapping-math`` (the
    loops vectorize: floor, selects), and the instruction set PyTorch runs."""
    capability = torch.backends.cpu.get_cpu_capability()
    return ["-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", *_FLAGS.get(capability, [])]


def extension_name(name: str) -> str:
    """The kernel's extension name: ``attnkit_``, its name and the instruction set (``attnkit_flash_avx512``)."""
    return f"attnkit_{name}_{torch.backends.cpu.get_cpu_capability().lower().replace(' ', '_')}"


def source_hash(name: str) -> str:
    """What a build of kernel ``name`` depends on, hashed: its source and the headers, the flags, Python's and
    PyTorch's versions (12 hexadecimal digits); the name of a kernel built ahead of time carries it."""
    digest = hashlib.sha256()
    for part in (KERNELS[name], *HEADERS):
        digest.update((HERE / part).read_bytes())
    # (and the layout of the build: its sources copied beside it since this tag, so that an older folder, whose
    # commands named a checkout, is not reused, which would rebuild it without a word)
    versions = f"{sys.version_info[:2]} {torch.__version__} {' '.join(compile_flags())} sources-beside"
    digest.update(versions.encode())
    return digest.hexdigest()[:12]


def build_directory(name: str) -> Path:
    """Where kernel ``name`` is built on first use: under ``TORCH_EXTENSIONS_DIR`` (or ``~/.cache/torch_extensions``),
    a folder of its own for each :func:`source_hash` and each installation of PyTorch and Python. The build's
    commands name PyTorch's headers and libraries and Python's headers by their paths: two virtual environments
    sharing a folder would each rebuild it, without a word, after the other had used it; so would two compilers
    (``CXX``)."""
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    compiler = os.environ.get("CXX", "c++")  # (PyTorch's loader builds with $CXX)
    where = f"{source_hash(name)} {Path(torch.__file__).parent} {sysconfig.get_paths()['include']} {compiler}"
    key = hashlib.sha256(where.encode()).hexdigest()[:12]
    return root / f"{extension_name(name).replace('_', '-')}-{key}"


def prebuilt(name: str) -> Path | None:
    """The kernel ``pip install`` built ahead of time from these sources (``_<name>_<hash>*.so`` beside them), or
    ``None``."""
    found = sorted(HERE.glob(f"_{name}_{source_hash(name)}.*"))
    return next((p for p in found if p.suffix in (".so", ".pyd", ".dylib")), None)


def load(name: str) -> None:
    """Register the ops of kernel ``name`` (a key of :data:`KERNELS`) in this process: the one built ahead of time,
    else the one built on first use (said on stderr the first time, with how long it took).

    Raises:
        Exception: whatever the build raises (no compiler, no ninja, a build error).
    """
    found = prebuilt(name)
    if found is not None:
        with contextlib.suppress(OSError):  # (built for another runtime: build it here instead)
            torch.ops.load_library(str(found))
            return
    from torch.utils import cpp_extension

    directory = build_directory(name)
    directory.mkdir(parents=True, exist_ok=True)
    ext = extension_name(name)
    with _building(directory), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the loader's notes on compiler versions: the build works or raises
        built = sorted(directory.glob(f"{ext}.*so")) + sorted(directory.glob(f"{ext}.pyd"))
        fresh = not built
        before = {path: path.stat().st_mtime_ns for path in built}
        start = time.monotonic()
        if fresh:
            print(
                f"attnkit: building its C++ kernel {name!r} (once; cached in {directory}) ...",
                end="",
                file=sys.stderr,
                flush=True,
            )
        # the sources copied beside the build (the same bytes: the folder is keyed by their hash), so that the
        # build's commands name no checkout and every checkout of these sources shares one build
        for part in (KERNELS[name], *HEADERS):
            copy = directory / part
            if not copy.exists() or copy.read_bytes() != (HERE / part).read_bytes():
                copy.write_bytes((HERE / part).read_bytes())
        try:
            cpp_extension.load(
                ext,
                [str(directory / KERNELS[name])],
                extra_cflags=compile_flags(),
                extra_ldflags=["-fopenmp"],
                extra_include_paths=[str(directory)],
                build_directory=str(directory),
                is_python_module=False,
                verbose=False,
            )
        except BaseException:
            if fresh:
                print(" failed", file=sys.stderr, flush=True)
            raise
        if fresh:
            print(f" built in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
        elif any(path.stat().st_mtime_ns != mtime for path, mtime in before.items() if path.exists()):
            # ninja found the build's command changed (flags from the environment, say): it says so, after the fact
            print(
                f"attnkit: rebuilt its C++ kernel {name!r} in {directory}, whose build command had changed, in "
                f"{time.monotonic() - start:.0f} s",
                file=sys.stderr,
                flush=True,
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
