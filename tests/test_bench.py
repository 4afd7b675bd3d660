"""attnkit bench: the contenders compute the same thing, and `attnkit bench --quick` gives its table (not speed);
benchmarks/targets.py, run as a script on saved results, says which of the project's targets a run meets."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import matplotlib.image
import pytest
import torch

from attnkit.tools import bench

TARGETS_SCRIPT = Path(__file__).parents[1] / "benchmarks" / "targets.py"


@pytest.mark.parametrize("mask", bench.MASKS)
def test_contenders_compute_the_same_attention(mask):
    """Same inputs, same weights: torch's module and the book's formulas give attnkit's output."""
    reference = bench.make_forward("mha", 2, 16, mask, "attnkit:reference", train=False)()
    for contender in ("attnkit", "attnkit:sdpa", "attnkit:tiles:online", "attnkit+weights", "torch", "book"):
        out = bench.make_forward("mha", 2, 16, mask, contender, train=False)()
        torch.testing.assert_close(out, reference, rtol=0, atol=1e-5, msg=f"{contender}, {mask}")


def test_additive_contenders_agree():
    reference = bench.make_forward("additive", 2, 128, "none", "attnkit", train=False)()
    book = bench.make_forward("additive", 2, 128, "none", "book", train=False)()
    torch.testing.assert_close(book, reference, rtol=0, atol=1e-5)


@pytest.mark.slow  # about a minute on 2 cores (two runs of the grid): make test-all
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


def _check_targets(path):
    """benchmarks/targets.py on a saved run, as `make bench` runs it (a script: tests never import benchmarks/)."""
    return _check_targets_at_once([path])[0]


def _check_targets_at_once(paths):
    """``_check_targets`` of each of ``paths``, the processes run side by side (each spends most of its time
    importing torch): their results in order."""
    commands = [[sys.executable, str(TARGETS_SCRIPT), str(path)] for path in paths]
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for c in commands]
    results = []
    for command, proc in zip(commands, procs, strict=True):
        out, err = proc.communicate(timeout=120)
        results.append(subprocess.CompletedProcess(command, proc.returncode, out, err))
    return results


def _run_meeting_every_target():
    """A full run's rows, with times and rates that meet every target."""
    seconds = {"attnkit": 1.0, "attnkit+weights": 1.2, "torch": 4.0, "torch+weights": 4.0, "book": 5.0}
    rows = [
        bench.Row("mha", 8, L, mode, mask, c, seconds=s * (0.7 if (c, mask) == ("attnkit", "valid_lens") else 1))
        for L in (512, 2048)
        for mode in bench.MODES
        for mask in bench.MASKS
        for c, s in seconds.items()
    ]
    rows[[r.key() for r in rows].index("mha|8|2048|train|none|attnkit")].gflops = 70.0
    L = bench.ADDITIVE_FULL["L"]
    rows += [bench.Row("additive", 8, L, "train", "none", "attnkit", seconds=1.0, peak_bytes=2**20)]
    rows += [bench.Row("additive", 8, L, "train", "none", "book", seconds=2.0, peak_bytes=2**30)]
    rows += [bench.Row("overhead", 2, 4, "infer", "none", c, seconds=1e-4) for c in ("attnkit", "book")]
    return bench.Report(rows=rows, matmul_gflops=100.0, threads=2, torch_version="x", seconds=1.0)


def test_targets_script_exits_zero_only_when_every_target_is_measured_and_met(tmp_path):
    report = _run_meeting_every_target()
    bench.save_json(report, str(tmp_path / "met.json"))
    report.find(kind="overhead", contender="attnkit").seconds = 2e-4  # twice the book's: the limit is 1.3x
    bench.save_json(report, str(tmp_path / "missed.json"))
    quick = bench.Report(rows=[r for r in report.rows if r.kind == "overhead"], matmul_gflops=100.0)
    bench.save_json(quick, str(tmp_path / "quick.json"))
    met, missed, unmeasured = _check_targets_at_once(
        [tmp_path / "met.json", tmp_path / "missed.json", tmp_path / "quick.json"]
    )

    assert met.returncode == 0, met.stdout + met.stderr
    assert "| target | measured | limit | met |" in met.stdout and "23 of 23 targets met, 0 missed" in met.stdout

    assert missed.returncode == 1
    assert "| tiny inputs: attnkit / book forward | 2.00 | <= 1.30 | **no** |" in missed.stdout
    assert "22 of 23 targets met, 1 missed, 0 not measured" in missed.stdout

    assert unmeasured.returncode == 1
    assert "| attnkit / torch, L=512 train none |  | <= 0.95 | not measured |" in unmeasured.stdout
    assert "0 of 23 targets met, 1 missed, 22 not measured" in unmeasured.stdout


def test_targets_script_refuses_what_bench_did_not_save(tmp_path):
    (tmp_path / "other.json").write_text('{"rows": null}')
    refused = _check_targets(tmp_path / "other.json")
    assert refused.returncode == 2 and "not results saved with `attnkit bench --json`" in refused.stderr


def test_plot_report_draws_the_batch_size_a_quick_report_has(tmp_path, monkeypatch):
    from attnkit.tools import plot

    rows = [
        bench.Row("mha", 2, L, "train", "none", c, seconds=0.01 * L, peak_bytes=2**20 * L)
        for L in (16, 32)
        for c in ("attnkit", "torch", "book")
    ]
    rows.append(bench.Row("mha", 8, 16, "infer", "none", "attnkit", seconds=0.1))  # not a training row
    drawn = []
    real = plot.save_figure

    def keep(fig, path, **kwargs):
        drawn.append([(line.get_label(), list(line.get_xdata())) for ax in fig.axes for line in ax.get_lines()])
        drawn.append(fig.get_suptitle())
        return real(fig, path, **kwargs)

    monkeypatch.setattr(plot, "save_figure", keep)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # matplotlib's "No artists with labels found to put in legend"
        bench.plot_report(bench.Report(rows=rows), str(tmp_path / "b.png"))
    lines, title = drawn
    assert [label for label, xs in lines[:3]] == ["attnkit", "torch", "book"]
    assert len(lines) == 6 and all(xs == [16, 32] for _, xs in lines)  # time and memory, one line per contender
    assert "B=2" in title
    assert (tmp_path / "b.png").exists()
