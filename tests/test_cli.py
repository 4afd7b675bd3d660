"""The `attnkit` command, run as a user would: in a subprocess."""

from __future__ import annotations

import subprocess
import sys

import pytest


def attnkit(*args):
    return subprocess.run(
        [sys.executable, "-m", "attnkit", *args], capture_output=True, text=True, timeout=120, check=False
    )


def test_info_names_versions_and_backends():
    result = attnkit("info")
    assert result.returncode == 0, result.stderr
    for word in ("attnkit", "torch", "python", "threads", "backend reference", "backend sdpa", "backend chunked"):
        assert word in result.stdout


@pytest.mark.parametrize("args", [("bogus",), (), ("info", "--nope")])
def test_user_mistakes_print_one_line_and_exit_2(args):
    result = attnkit(*args)
    assert result.returncode == 2
    assert result.stderr.startswith("attnkit: error: ")
    assert result.stderr.count("\n") == 1
    assert "Traceback" not in result.stderr
