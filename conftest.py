"""Doctests in src/attnkit see `torch` without importing it in each example.

Without a GPU, Triton's kernels run in its interpreter (numpy on the host: tests/test_triton.py). Triton fixes that
mode when it is first imported, which torch._dynamo does, so it is set here, before any test imports attnkit.

Under pytest-xdist (`make test`: one worker process per core, at most 4) each worker runs torch on one thread, and
so do the processes its tests start: two workers of
two threads each on a 2-core machine took 10.9 CPU minutes against 7.4 for one process (measured, warm caches).
"""

import os
import warnings

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
def _compiled_tiles_compiler(request, monkeypatch):
    """The compiled tile engine (``tiles:compiled``) gives its steps to Inductor, whose C++ costs about 2 s of CPU a
    graph in a clean clone: in ``make test`` the calls of tests not marked ``inductor`` compile them with
    "aot_eager_decomp_partition" (dynamo's graphs and AOTAutograd's forward and backward, decomposed and partitioned
    as for Inductor, run by PyTorch's eager kernels), so that the engine's tiles, masks and gradients are checked on
    every test and Inductor's code on the tests marked ``inductor``; ``make test-all`` runs all of them on Inductor."""
    marked = request.node.get_closest_marker("inductor") is not None
    if not marked and not os.environ.get("ATTNKIT_TESTS_ON_INDUCTOR"):
        from attnkit.backends.tiles import compiled_steps

        monkeypatch.setattr(compiled_steps, "COMPILER", "aot_eager_decomp_partition")
    with warnings.catch_warnings():
        if marked:  # Inductor's code, never the steps run eagerly after a failure to compile them
            warnings.filterwarnings(
                "error", message="attnkit: the blocks of .* cannot be compiled", category=RuntimeWarning
            )
        yield


@pytest.fixture(autouse=True)
def _doctest_torch(doctest_namespace):
    doctest_namespace["torch"] = torch
