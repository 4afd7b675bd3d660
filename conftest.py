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
