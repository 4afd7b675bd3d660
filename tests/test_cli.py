"""The `attnkit` command, run as a user would: in a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys

import matplotlib.image
import numpy as np
import pytest
import torch


def attnkit(*args, cwd=None, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "attnkit", *args], capture_output=True, text=True, timeout=timeout, check=False, cwd=cwd
    )


def assert_one_line_error(result, *fragments):
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("attnkit: error: ")
    assert result.stderr.count("\n") == 1, result.stderr
    assert "Traceback" not in result.stderr
    for fragment in fragments:
        assert fragment in result.stderr


def test_info_names_versions_and_backends():
    result = attnkit("info")
    assert result.returncode == 0, result.stderr
    for word in ("attnkit", "torch", "python", "threads", "backend reference", "backend sdpa", "backend chunked"):
        assert word in result.stdout
    ring = [line for line in result.stdout.splitlines() if line.startswith("ring attention")]
    assert len(ring) == 1 and "over gloo" in ring[0], result.stdout  # every CPU build of torch has gloo


def test_trace_multihead_book_view_as_json():
    result = attnkit("trace", "multihead", "--book", "--format", "json")
    assert result.returncode == 0, result.stderr
    steps = json.loads(result.stdout)
    assert {"step": "transpose_qkv", "shapes_in": [[2, 4, 100]], "shape_out": [10, 4, 20]}.items() <= steps[1].items()
    assert any(s["note"] == "[3, 2] -> [3, 3, 3, 3, 3, 2, 2, 2, 2, 2]" for s in steps)


@pytest.mark.parametrize("kind", ["dot", "additive", "multihead"])
def test_trace_text_and_markdown(kind):
    text = attnkit("trace", kind, "--batch", "3", "--valid-lens", "1,6,2", "--causal")
    assert text.returncode == 0, text.stderr
    assert "scores" in text.stdout and "valid_lens [1, 6, 2]; causal" in text.stdout
    markdown = attnkit("trace", kind, "--format", "markdown")
    assert markdown.stdout.startswith("| module | step | shape in | shape out | note |")


def test_heatmap_from_torch_and_numpy_files(tmp_path):
    weights = torch.softmax(torch.randn(2, 5, 7), -1)
    torch.save(weights, tmp_path / "w.pt")
    np.save(tmp_path / "w.npy", weights[0].numpy())
    for source, out in (("w.pt", "heads.png"), ("w.npy", "one.svg")):
        result = attnkit("heatmap", str(tmp_path / source), "--out", str(tmp_path / out), "--title", "t")
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == str(tmp_path / out)
    assert matplotlib.image.imread(tmp_path / "heads.png").shape[2] in (3, 4)
    assert (tmp_path / "one.svg").read_text().startswith("<?xml")
    torch.save(torch.softmax(torch.randn(2, 3, 4, 5), -1), tmp_path / "grid.pt")
    assert attnkit("heatmap", str(tmp_path / "grid.pt"), "--out", str(tmp_path / "grid.pdf")).returncode == 0


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (("bogus",), ["invalid choice: 'bogus'"]),
        ((), ["required: COMMAND"]),
        (("info", "--nope"), ["unrecognized arguments: --nope"]),
        (("trace", "dot", "--batch", "x"), ["--batch", "positive whole number", "'x'"]),
        (("trace", "dot", "--keys", "0"), ["--keys", "got 0"]),
        (("trace", "dot", "--valid-lens", "3,9"), ["at most the number of keys (6)", "9"]),
        (("trace", "dot", "--valid-lens", "3,a"), ["--valid-lens", "'3,a'"]),
        (("trace", "dot", "--valid-lens", "1,2,3"), ["--valid-lens has 3 values but --batch is 2"]),
        (("trace", "multihead", "--num-heads", "3"), ["num_hiddens (100) must be a multiple of num_heads (3)"]),
        (("heatmap", "missing.pt", "--out", "x.png"), ["missing.pt: no such file"]),
        (("demo", "--seed", "zero"), ["--seed", "invalid int value"]),
        (("trace", "multihead", "--queries", "100000000"), ["--queries", "from 1 to 100000"]),
        (("trace", "dot", "--batch", "99999999999999999999", "--valid-lens", ""), ["--batch", "from 1 to 100000"]),
    ],
)
def test_user_mistakes_print_one_line_and_exit_2(args, fragments):
    assert_one_line_error(attnkit(*args), *fragments)


def test_heatmap_mistakes_with_files(tmp_path):
    (tmp_path / "junk.pt").write_bytes(b"not a tensor file")
    assert_one_line_error(
        attnkit("heatmap", str(tmp_path / "junk.pt"), "--out", str(tmp_path / "a.png")), "cannot read weights"
    )
    torch.save({"w": torch.ones(2, 2)}, tmp_path / "dict.pt")
    assert_one_line_error(
        attnkit("heatmap", str(tmp_path / "dict.pt"), "--out", str(tmp_path / "a.png")), "expected one tensor"
    )
    torch.save(torch.ones(2, 2), tmp_path / "ok.pt")
    assert_one_line_error(
        attnkit("heatmap", str(tmp_path / "ok.pt"), "--out", str(tmp_path / "nowhere" / "a.png")), "does not exist"
    )
    assert_one_line_error(attnkit("heatmap", str(tmp_path / "ok.pt"), "--out", str(tmp_path / "a.txt")), "extension")
    torch.save(torch.ones(0, 3), tmp_path / "empty.pt")
    assert_one_line_error(attnkit("heatmap", str(tmp_path / "empty.pt"), "--out", str(tmp_path / "a.png")), "empty")
    torch.save(torch.ones(2, 2, dtype=torch.bool), tmp_path / "bool.pt")
    assert_one_line_error(
        attnkit("heatmap", str(tmp_path / "bool.pt"), "--out", str(tmp_path / "a.png")), "dtype torch.bool"
    )
    assert_one_line_error(
        attnkit("heatmap", str(tmp_path / "ok.pt"), "--out", str(tmp_path / "ok.pt" / "a.png")), "is not a folder"
    )
    torch.save(torch.ones(5), tmp_path / "flat.pt")
    assert_one_line_error(attnkit("heatmap", str(tmp_path / "flat.pt"), "--out", str(tmp_path / "a.png")), "2, 3 or 4")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "bool.pt",
        "dict.pt",
        "empty.pt",
        "flat.pt",
        "junk.pt",
        "ok.pt",
    ]


def test_demo_output_folder_that_cannot_be_written(tmp_path):
    (tmp_path / "a-file").write_text("")
    assert_one_line_error(attnkit("demo", "--quick", "--out", str(tmp_path / "a-file" / "sub")), "cannot write")
