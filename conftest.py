"""Doctests in src/attnkit see `torch` without importing it in each example."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _doctest_torch(doctest_namespace):
    doctest_namespace["torch"] = torch
