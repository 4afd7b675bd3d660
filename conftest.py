"""Doctests in src/attnkit see `torch` without importing it in each example.

Without a GPU, Triton's kernels run in its interpreter (numpy on the host: tests/test_triton.py). Triton fixes that
mode when it is first imported, which torch._dynamo does, so it is set here, before any test imports attnkit.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _doctest_torch(doctest_namespace):
    doctest_namespace["torch"] = torch
