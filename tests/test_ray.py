"""Ray Train with context_parallel (examples/ray_train.py): a TorchTrainer of 3 gloo workers (shards of 85 and 86
positions), DDP from Ray's prepare_model, trains as one process on the whole batch. Ray is an optional dependency
(``make ray`` installs it and runs the example); about a minute on 2 cores, so only ``make test-all`` runs it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.slow]
pytest.importorskip("ray.train", reason="Ray Train is optional: pip install -c constraints.txt -e '.[ray]'")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "ray_train.py"


def test_ray_workers_inside_context_parallel_train_as_one_process():
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--workers", "3", "--steps", "3"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("on 3 Ray workers") == 3, result.stdout


def test_a_mistake_in_the_arguments_is_one_line_and_status_2():
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--workers", "0"], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "--workers must be 1..128" in result.stderr and len(result.stderr.strip().splitlines()) == 1, result.stderr
