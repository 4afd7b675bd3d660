"""attnkit bench: the contenders compute the same thing, and `attnkit bench --quick` gives its table (not speed)."""

from __future__ import annotations

import json
import subprocess
import sys

import matplotlib.image
import pytest
import torch

from attnkit import bench


@pytest.mark.parametrize("mask", bench.MASKS)
def test_contenders_compute_the_same_attention(mask):
    """Same inputs, same weights: torch's module and the book's formulas give attnkit's output."""
    reference = bench.make_forward("mha", 2, 16, mask, "attnkit:reference", train=False)()
    for contender in ("attnkit", "attnkit:sdpa", "attnkit:chunked", "attnkit+weights", "torch", "book"):
        out = bench.make_forward("mha", 2, 16, mask, contender, train=False)()
        torch.testing.assert_close(out, reference, rtol=0, atol=1e-5, msg=f"{contender}, {mask}")


def test_additive_contenders_agree():
    reference = bench.make_forward("additive", 2, 128, "none", "attnkit", train=False)()
    book = bench.make_forward("additive", 2, 128, "none", "book", train=False)()
    torch.testing.assert_close(book, reference, rtol=0, atol=1e-5)


def test_bench_quick_command(tmp_path):
    saved, picture = tmp_path / "run.json", tmp_path / "run.png"
    first = subprocess.run(
        [sys.executable, "-m", "attnkit", "bench", "--quick", "--json", str(saved), "--plot", str(picture)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert first.returncode == 0, first.stderr
    for word in ("contender", "x torch", "x book", "GFLOP/s", "peak", "memory", "torch", "book", "additive"):
        assert word in first.stdout
    assert "float32 matmul" in first.stdout
    data = json.loads(saved.read_text())
    rows = data["rows"]
    assert data["matmul_gflops"] > 0
    assert {r["contender"] for r in rows if r["kind"] == "mha"} == {"attnkit", "torch", "book"}
    assert all(r["seconds"] > 0 for r in rows)
    assert all(r["peak_bytes"] is not None for r in rows)
    assert matplotlib.image.imread(picture).shape[0] > 100

    second = subprocess.run(
        [sys.executable, "-m", "attnkit", "bench", "--quick", "--no-memory", "--compare", str(saved)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert second.returncode == 0, second.stderr
    assert "vs saved" in second.stdout


def test_bench_mistakes_are_one_line(tmp_path):
    bad = subprocess.run(
        [sys.executable, "-m", "attnkit", "bench", "--quick", "--compare", str(tmp_path / "none.json")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert bad.returncode == 2 and bad.stderr.startswith("attnkit: error: ") and bad.stderr.count("\n") == 1


def test_save_json_writes_whole_or_leaves_nothing(tmp_path, monkeypatch):
    report = bench.Report(rows=[])
    target = tmp_path / "bench.json"
    target.write_text("previous")

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(bench.json, "dump", broken)
    with pytest.raises(OSError):
        bench.save_json(report, str(target))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bench.json"] and target.read_text() == "previous"
    monkeypatch.undo()
    bench.save_json(report, str(target))
    assert bench.load_json(str(target)).rows == [] and sorted(p.name for p in tmp_path.iterdir()) == ["bench.json"]
