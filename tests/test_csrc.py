"""attnkit.csrc: the C++ kernels' one loader: a build on first use that says so once and is cached under its sources'
hash, one build at a time in a process, and a kernel built ahead of time by setup.py loaded without a build."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from attnkit import csrc

ninja = pytest.importorskip("ninja")


@pytest.fixture
def fake_loader(monkeypatch, tmp_path):
    """PyTorch's extension loader replaced by one that leaves the built file where the real one would, in a cache
    of the test's own; the builds it was asked for, by name."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(csrc, "prebuilt", lambda name: None)
    built: list[str] = []

    def load(name, sources, *, build_directory, extra_include_paths, **kw):
        built.append(name)
        # the build names only what lies in its own folder (no checkout's path): checkouts share it
        assert all(Path(p).parent == Path(build_directory) for p in sources), sources
        assert extra_include_paths == [build_directory], extra_include_paths
        assert all(Path(p).exists() for p in sources)
        library = Path(build_directory, f"{name}.so")
        if not library.exists():  # (as ninja: nothing to do where the build is there)
            library.touch()

    monkeypatch.setattr(cpp_extension, "load", load)
    return built


def test_the_first_build_says_so_in_one_line_and_the_next_load_says_nothing(fake_loader, capfd):
    csrc.load("stats")
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and err.startswith("attnkit: building its C++ kernel 'stats' (once; cached in "), err
    assert str(csrc.build_directory("stats")) in err and err.rstrip().endswith(" s"), err
    csrc.load("stats")
    assert capfd.readouterr().err == "" and len(fake_loader) == 2  # (the loader itself skips a build it has)


def test_a_rebuild_of_a_built_kernel_says_so(monkeypatch, fake_loader, capfd):
    """A build whose command changed (ninja rebuilds in a folder that holds a kernel) says so in one line."""
    from torch.utils import cpp_extension

    csrc.load("flash")
    capfd.readouterr()

    def rebuilds(name, sources, *, build_directory, **kw):
        time.sleep(0.01)  # (a newer modification time on any file system)
        Path(build_directory, f"{name}.so").write_bytes(b"rebuilt")

    monkeypatch.setattr(cpp_extension, "load", rebuilds)
    csrc.load("flash")
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and err.startswith("attnkit: rebuilt its C++ kernel 'flash' in "), err


def test_a_failed_build_ends_its_line_and_raises(monkeypatch, fake_loader, capfd):
    from torch.utils import cpp_extension

    def fails(*args, **kwargs):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(cpp_extension, "load", fails)
    with pytest.raises(RuntimeError, match="no compiler"):
        csrc.load("flash")
    assert capfd.readouterr().err.endswith(" ... failed\n")


def test_builds_are_cached_by_the_hash_of_their_sources(monkeypatch, tmp_path):
    """Two checkouts of the same sources share a build; a changed source (or the header) gets a folder of its own,
    so that two checkouts never rebuild each other's."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    here = csrc.build_directory("flash")
    other = tmp_path / "other"
    shutil.copytree(csrc.HERE, other, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    monkeypatch.setattr(csrc, "HERE", other)
    assert csrc.build_directory("flash") == here
    (other / "common.h").write_text((other / "common.h").read_text() + "\n// changed\n")
    changed = csrc.build_directory("flash")
    assert (
        changed != here
        and changed.parent == here.parent
        and csrc.build_directory("stats").name.startswith("attnkit-stats-")
    )


def test_two_environments_build_apart(monkeypatch, tmp_path):
    """A build's commands name PyTorch's headers and libraries by their paths: a PyTorch installed elsewhere (another
    virtual environment) gets a folder of its own, or ninja would rebuild the shared one, without a word, each time
    the other environment had used it."""
    import torch

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    here = csrc.build_directory("flash")
    named = csrc.source_hash("flash")
    monkeypatch.setattr(torch, "__file__", str(tmp_path / "elsewhere" / "torch" / "__init__.py"))
    assert csrc.build_directory("flash") != here
    assert csrc.source_hash("flash") == named  # (a kernel built ahead of time is named by its sources alone)
    monkeypatch.undo()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CXX", "clang++")  # another compiler: a folder of its own too
    assert csrc.build_directory("flash") != here


def test_two_threads_building_at_once_each_see_ninja_and_leave_path_as_it_was(monkeypatch, tmp_path):
    """Two kernels built by two threads at once (the statistics' and the flash kernel's, first used from two
    threads): each build sees ninja on PATH, and PATH is as it was after both (each put back the PATH it had read,
    the other's included, before builds were one at a time)."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    monkeypatch.setattr(csrc, "prebuilt", lambda name: None)
    seen: list[bool] = []
    first_in = threading.Event()

    def load(name, sources, **kw):  # the first build ends while the second builds (before: side by side)
        seen.append(os.environ["PATH"].split(os.pathsep)[0] == ninja.BIN_DIR)
        if "flash" in name:
            first_in.set()
            time.sleep(0.1)
        else:
            time.sleep(0.3)
        seen.append(os.environ["PATH"].split(os.pathsep)[0] == ninja.BIN_DIR)

    monkeypatch.setattr(cpp_extension, "load", load)
    one = threading.Thread(target=csrc.load, args=("flash",))
    two = threading.Thread(target=csrc.load, args=("stats",))
    one.start()
    first_in.wait(timeout=10)
    two.start()
    for thread in (one, two):
        thread.join()
    assert seen == [True] * 4
    assert os.environ["PATH"] == "/usr/bin:/bin"


def test_a_kernel_built_ahead_of_time_from_these_sources_is_loaded_without_a_build(tmp_path):
    """The file setup.py writes (``_flash_<hash>.so`` beside the sources) is what loads, in a process whose
    extension loader would fail: here the first-use build's own file, copied there; one of other sources is not."""
    if csrc.ensure("flash") is not None:
        pytest.skip(f"the flash kernel is not built here: {csrc.ensure('flash')}")
    built = next(csrc.build_directory("flash").glob(f"{csrc.extension_name('flash')}.*so"))
    sources = tmp_path / "csrc"
    shutil.copytree(csrc.HERE, sources, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    shutil.copy(built, sources / f"_flash_{csrc.source_hash('flash')}.cpython-x.so")
    shutil.copy(built, sources / "_flash_000000000000.cpython-x.so")  # another source's: never loaded
    code = f"""
import sys
from pathlib import Path
from torch.utils import cpp_extension
from attnkit import csrc
def refuse(*a, **k):
    raise AssertionError("built")
cpp_extension.load = refuse
csrc.HERE = Path({str(sources)!r})
csrc.load("flash")
import torch
print(torch.ops.attnkit_flash.forward)
"""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "empty")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0 and "attnkit_flash.forward" in done.stdout, done.stderr
    assert done.stderr == "" and not (tmp_path / "empty").exists()


@pytest.mark.slow
def test_setup_py_builds_the_kernels_ahead_of_time_where_the_loader_finds_them(tmp_path):
    """``ATTNKIT_BUILD_KERNELS=1``: setup.py builds each kernel beside its sources, named by their hash, and a fresh
    process loads them without building (a minute: make test-all)."""
    root = Path(__file__).resolve().parents[1]
    copy = tmp_path / "checkout"
    shutil.copytree(root, copy, ignore=shutil.ignore_patterns(".venv", ".git", "*.so", "__pycache__", "build"))
    env = {**os.environ, "ATTNKIT_BUILD_KERNELS": "1"}
    subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=copy, env=env, check=True, timeout=900
    )
    found = sorted(p.name.split(".")[0] for p in (copy / "src" / "attnkit" / "csrc").glob("_*.so"))
    assert found == sorted(f"_{name}_{csrc.source_hash(name)}" for name in csrc.KERNELS)
    env = {**os.environ, "PYTHONPATH": str(copy / "src"), "TORCH_EXTENSIONS_DIR": str(tmp_path / "empty")}
    code = "from attnkit import csrc; print(csrc.ensure('flash'), csrc.ensure('stats'))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.stdout.split() == ["None", "None"] and done.stderr == "", done.stderr
    assert not (tmp_path / "empty").exists()
