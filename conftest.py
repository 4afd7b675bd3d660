"""Doctests in src/attnkit see `torch` without importing it in each example.

Without a GPU, Triton's kernels run in its interpreter (numpy on the host: tests/test_triton.py). Triton fixes that
mode when it is first imported, which torch._dynamo does, so it is set here, before any test imports attnkit.

Under pytest-xdist (`make test`: one worker process per core, at most 4) each worker runs torch on one thread, and
so do the processes its tests start: two workers of
two threads each on a 2-core machine took 10.9 CPU minutes against 7.4 for one process (measured, warm caches).
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # and the processes its tests start (the command line, torchrun)
    # and Inductor compiles in the worker itself: a pool of compiling processes for each worker (one per core, each
    # importing torch) only competes with the other workers for the same cores
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")


@pytest.fixture(autouse=True)
def _doctest_torch(doctest_namespace):
    doctest_namespace["torch"] = torch


# The longest test files first (their seconds in a clean-clone CI run, where Inductor's caches are cold): pytest-xdist
# hands out whole files (--dist loadfile) in collection order, so one of these collected last, alphabetically, could
# leave one worker running it alone while the other has finished. A file not named keeps its place after them.
LONGEST_FIRST = (
    "test_compile.py",  # 127 s
    "test_tiles_compiled_additive.py",  # 45 s
    "test_readme.py",  # 43 s
    "test_tiles_compiled.py",  # 40 s
    "test_triton.py",  # 39 s
    "test_distributed.py",  # 38 s
    "test_view_browser.py",  # 31 s
    "test_stats_tiled.py",  # 30 s
    "test_plot.py",  # 26 s
    "test_functional.py",  # 26 s
)


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONGEST_FIRST)))  # (stable: the rest keep their order)
