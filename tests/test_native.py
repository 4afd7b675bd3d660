"""attnkit._native: the C++ kernels' builds, as threads of one process meet them."""

from __future__ import annotations

import os
import threading
import time

import pytest

from attnkit import _native

ninja = pytest.importorskip("ninja")


def test_two_threads_building_at_once_each_see_ninja_and_leave_path_as_it_was(monkeypatch, tmp_path):
    """Two kernels built by two threads at once (the statistics' and the flash kernel's, first used from two
    threads): each build sees ninja on PATH, and PATH is as it was after both (each put back the PATH it had read,
    the other's included, before builds were one at a time)."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    seen: list[bool] = []
    first_in = threading.Event()

    def load(name, sources, **kw):  # the first build ends while the second builds (before: side by side)
        seen.append(os.environ["PATH"].split(os.pathsep)[0] == ninja.BIN_DIR)
        if name.startswith("one"):
            first_in.set()
            time.sleep(0.1)
        else:
            time.sleep(0.3)
        seen.append(os.environ["PATH"].split(os.pathsep)[0] == ninja.BIN_DIR)

    monkeypatch.setattr(cpp_extension, "load", load)
    one = threading.Thread(target=_native.build, args=("one", tmp_path / "one.cpp"))
    two = threading.Thread(target=_native.build, args=("two", tmp_path / "two.cpp"))
    one.start()
    first_in.wait(timeout=10)
    two.start()
    for thread in (one, two):
        thread.join()
    assert seen == [True] * 4
    assert os.environ["PATH"] == "/usr/bin:/bin"
