"""The `attnkit` command: in-process through `cli.main(argv)`, and end to end in a subprocess as a user runs it.

Each process spends seconds importing torch, so the cases run in-process; what only a real process shows (the exit
status of ``python -m attnkit``, nothing else on stderr, a closed or full stdout) keeps a test or two end to end:
info and trace here, heatmap's pictures, a refused ``bench`` in tests/test_bench.py and ``demo`` in
tests/test_demo.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import matplotlib.image
import numpy as np
import pytest
import torch

from attnkit.tools import bench, cli, demo, files


def attnkit(*args, cwd=None, timeout=120):
    return subprocess.run(
        [sys.executable, "-m", "attnkit", *args], capture_output=True, text=True, timeout=timeout, check=False, cwd=cwd
    )


def test_info_names_versions_and_backends():
    result = attnkit("info")
    assert result.returncode == 0, result.stderr
    for word in ("attnkit", "torch", "python", "threads", "backend reference", "backend sdpa", "backend tiles:online"):
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
def test_trace_text_and_markdown(capsys, kind):
    code, out, err = main(capsys, "trace", kind, "--batch", "3", "--valid-lens", "1,6,2", "--causal")
    assert code == 0, err
    assert "scores" in out and "valid_lens [1, 6, 2]; causal" in out
    code, out, err = main(capsys, "trace", kind, "--format", "markdown")
    assert code == 0, err
    assert out.startswith("| module | step | shape in | shape out | note |")


def test_heatmap_from_torch_and_numpy_files(capsys, tmp_path):
    """The torch file end to end, as a user runs it; the numpy file and the grid in-process."""
    weights = torch.softmax(torch.randn(2, 5, 7), -1)
    torch.save(weights, tmp_path / "w.pt")
    np.save(tmp_path / "w.npy", weights[0].numpy())
    result = attnkit("heatmap", str(tmp_path / "w.pt"), "--out", str(tmp_path / "heads.png"), "--title", "t")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(tmp_path / "heads.png")
    code, out, err = main(capsys, "heatmap", tmp_path / "w.npy", "--out", tmp_path / "one.svg", "--title", "t")
    assert code == 0, err
    assert out.strip() == str(tmp_path / "one.svg")
    assert matplotlib.image.imread(tmp_path / "heads.png").shape[2] in (3, 4)
    assert (tmp_path / "one.svg").read_text().startswith("<?xml")
    torch.save(torch.softmax(torch.randn(2, 3, 4, 5), -1), tmp_path / "grid.pt")
    code, _, err = main(capsys, "heatmap", tmp_path / "grid.pt", "--out", tmp_path / "grid.pdf")
    assert code == 0, err


USER_MISTAKES = [
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
]


@pytest.mark.parametrize(("args", "fragments"), USER_MISTAKES)
def test_user_mistakes_print_one_line_and_exit_2(capsys, no_work, tmp_path, monkeypatch, args, fragments):
    monkeypatch.chdir(tmp_path)
    code, out, err = main(capsys, *args)
    assert_one_line(code, err, *fragments)
    assert out == "" and list(tmp_path.iterdir()) == []


def test_heatmap_mistakes_with_files(capsys, tmp_path):
    (tmp_path / "junk.pt").write_bytes(b"not a tensor file")
    torch.save({"w": torch.ones(2, 2)}, tmp_path / "dict.pt")
    torch.save(torch.ones(2, 2), tmp_path / "ok.pt")
    torch.save(torch.ones(0, 3), tmp_path / "empty.pt")
    torch.save(torch.ones(2, 2, dtype=torch.bool), tmp_path / "bool.pt")
    torch.save(torch.ones(5), tmp_path / "flat.pt")
    png = str(tmp_path / "a.png")
    cases = [
        ((str(tmp_path / "junk.pt"), "--out", png), "cannot read weights"),
        ((str(tmp_path / "dict.pt"), "--out", png), "expected one tensor"),
        ((str(tmp_path / "ok.pt"), "--out", str(tmp_path / "nowhere" / "a.png")), "does not exist"),
        ((str(tmp_path / "ok.pt"), "--out", str(tmp_path / "a.txt")), "extension"),
        ((str(tmp_path / "empty.pt"), "--out", png), "empty"),
        ((str(tmp_path / "bool.pt"), "--out", png), "dtype torch.bool"),
        ((str(tmp_path / "ok.pt"), "--out", str(tmp_path / "ok.pt" / "a.png")), "is not a folder"),
        ((str(tmp_path / "flat.pt"), "--out", png), "2, 3 or 4"),
    ]
    for args, fragment in cases:
        code, _, err = main(capsys, "heatmap", *args)
        assert_one_line(code, err, fragment)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "bool.pt",
        "dict.pt",
        "empty.pt",
        "flat.pt",
        "junk.pt",
        "ok.pt",
    ]


def test_demo_output_folder_that_cannot_be_written(capsys, no_work, tmp_path):
    (tmp_path / "a-file").write_text("")
    code, _, err = main(capsys, "demo", "--quick", "--out", tmp_path / "a-file" / "sub")
    assert_one_line(code, err, "cannot write")


# In-process: cli.main(argv), its return code, one line on stderr, and nothing left behind -----------------------

ON_LINUX_PROC = os.path.isdir("/proc/self")


def main(capsys, *argv):
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line(code, err, *fragments):
    assert code == 2, err
    assert err.startswith("attnkit: error: ") and err.count("\n") == 1, err
    assert len(err) < 400, err
    for fragment in fragments:
        assert fragment in err, err


@pytest.fixture
def no_work(monkeypatch):
    """Fail the test if a command starts its work (training, benchmarking) instead of refusing first."""

    def started(*args, **kwargs):
        raise AssertionError("the command started its work before checking its arguments")

    for module, name in ((demo, "replay_book_examples"), (demo, "train"), (bench, "run")):
        monkeypatch.setattr(module, name, started)


@pytest.fixture
def weights_file(tmp_path):
    path = tmp_path / "w.pt"
    torch.save(torch.softmax(torch.randn(2, 3, 4), -1), path)
    return path


@pytest.mark.parametrize(
    ("argv", "fragments"),
    [
        (("trace", "dot", "--valid-lens", "100000000000000000000,2"), ["--valid-lens", "from 0 to 100000"]),
        (("trace", "dot", "--valid-lens=-1,2"), ["--valid-lens", "from 0 to 100000", "got -1"]),
        (("trace", "dot", "--valid-lens", "3,,2"), ["--valid-lens", "'3,,2'"]),
        (("trace", "dot", "--batch", "9" * 5000), ["--batch", "invalid int value", "..."]),
        (("trace", "dot", "--keys", "-5"), ["--keys", "got -5"]),
        (("demo", "--seed", str(10**20)), ["--seed", f"from {-(2**63)} to {2**64 - 1}"]),
        (("demo", "--seed", str(-(2**63) - 1)), ["--seed", f"from {-(2**63)} to {2**64 - 1}"]),
        (("trace", "additive", "--queries", "10000", "--keys", "10000"), ["additive features", "at most"]),
        (
            ("trace", "multihead", "--batch", "1000", "--queries", "1000", "--keys", "1000", "--valid-lens", ""),
            ["scores"],
        ),
    ],
)
def test_numbers_out_of_range_are_refused_when_parsed(capsys, no_work, tmp_path, monkeypatch, argv, fragments):
    monkeypatch.chdir(tmp_path)
    code, _, err = main(capsys, *argv)
    assert_one_line(code, err, *fragments)
    assert list(tmp_path.iterdir()) == []  # the demo made no folder


def test_demo_takes_every_seed_torch_takes(capsys, tmp_path, monkeypatch):
    seeds = []
    monkeypatch.setattr(demo, "replay_book_examples", lambda echo: None)
    monkeypatch.setattr(demo, "train", lambda kind, *, seed, **kwargs: seeds.append(seed) or fake_result(kind))
    for seed in (-(2**63), 2**64 - 1):
        code, _, err = main(capsys, "demo", "--quick", "--seed", seed, "--out", tmp_path / "out")
        assert code == 0, err
    assert seeds == [-(2**63)] * len(demo.KINDS) + [2**64 - 1] * len(demo.KINDS)


def fake_result(kind):
    """A DemoResult as train gives it, without the training: for tests of what the command does around it."""
    weights = torch.softmax(torch.randn(1, 4, 4), -1)
    weights[..., 3:] = 0  # the padding column
    example = {
        "source": [1, 2, 3],
        "prediction": [3, 2, 1],
        "weights": weights,
        "source_labels": ["1", "2", "3", "<pad>"],
        "target_labels": ["3", "2", "1", "<eos>"],
        "record": {"attention": [weights]},
        "layer_tokens": {"attention": (["<bos>", "3", "2", "1"], ["1", "2", "3", "<pad>"])},
    }
    return demo.DemoResult(kind, 1.0, 0.1, 10, [(5, 1.0), (10, 0.5)], [(10, 1.0)], example)


BAD_OUTPUTS = {  # what --out/--json/--plot name -> a fragment of the one line that refuses it
    "an existing folder": ("folder", "names a folder"),
    "a missing folder": ("missing/x", "does not exist"),
    "a file as folder": ("a-file/x", "is not a folder"),
    "an empty name": ("", "empty"),
    "a folder under /proc": ("/proc/x", "cannot write into folder '/proc'"),
}


OUTPUT_OPTIONS = {  # the command line that writes to a name, and the extension it wants
    "heatmap --out": ("heatmap", "w.pt", "--out", ".png"),
    "bench --json": ("bench", "--quick", "--json", ".json"),
    "bench --plot": ("bench", "--quick", "--plot", ".png"),
}


@pytest.mark.parametrize("option", list(OUTPUT_OPTIONS))
@pytest.mark.parametrize("case", list(BAD_OUTPUTS))
def test_every_output_file_is_checked_before_any_work(
    capsys, no_work, tmp_path, monkeypatch, weights_file, option, case
):
    if case == "a folder under /proc" and not ON_LINUX_PROC:
        pytest.skip("no /proc here")
    monkeypatch.chdir(tmp_path)
    for folder in ("folder.png", "folder.json"):
        (tmp_path / folder).mkdir()
    (tmp_path / "a-file").write_text("")
    before = sorted(tmp_path.rglob("*"))
    *argv, suffix = OUTPUT_OPTIONS[option]
    name, fragment = BAD_OUTPUTS[case]
    code, out, err = main(capsys, *argv, name + suffix if name else "")
    assert_one_line(code, err, fragment)
    assert out == "" and sorted(tmp_path.rglob("*")) == before


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (("heatmap", "w.pt", "--out", "DIR"), "--out DIR: names a folder; name a file, such as DIR/out.png"),
        (("heatmap", "w.pt", "--out", "w.txt"), "the extension must be one of .png"),
        (("heatmap", "w.pt", "--out", "w.pt"), "the extension must be one of .png"),
        (("bench", "--json", "run.txt"), "--json run.txt: the extension must be .json"),
        (("bench", "--plot", "run.svg"), "--plot run.svg: the extension must be .png"),
    ],
)
def test_wrong_extensions_are_refused(capsys, no_work, tmp_path, monkeypatch, weights_file, argv, fragment):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "DIR").mkdir()
    code, _, err = main(capsys, *argv)
    assert_one_line(code, err, fragment)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["DIR", "w.pt"]


def test_heatmap_of_a_huge_grid_is_refused_at_once_with_the_fix(capsys, tmp_path):
    torch.save(torch.rand(30, 30, 2, 2), tmp_path / "grid.pt")
    torch.save(torch.rand(100, 3, 3), tmp_path / "heads.pt")
    start = time.perf_counter()
    code, _, err = main(capsys, "heatmap", tmp_path / "grid.pt", "--out", tmp_path / "grid.png")
    assert_one_line(code, err, "(30, 30, 2, 2)", "900 panels", "w[:8, :8]")
    code, _, err = main(capsys, "heatmap", tmp_path / "heads.pt", "--out", tmp_path / "heads.png")
    assert_one_line(code, err, "(100, 3, 3)", "100 panels", "w[:8]")
    assert time.perf_counter() - start < 30  # before: more than 4 minutes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["grid.pt", "heads.pt"]


def test_heatmap_of_long_sequences_draws(capsys, tmp_path):
    torch.save(torch.softmax(torch.randn(2, 2, 1024, 1024), -1), tmp_path / "long.pt")
    code, out, err = main(capsys, "heatmap", tmp_path / "long.pt", "--out", tmp_path / "long.png", "--title", "t")
    assert code == 0, err
    assert out.strip() == str(tmp_path / "long.png")
    assert matplotlib.image.imread(tmp_path / "long.png").shape[0] > 200


@pytest.mark.parametrize(
    ("weights", "fragment"),
    [
        (torch.full((3, 4), float("nan")), "no finite entry"),
        (torch.full((2, 2, 3, 4), float("inf")), "no finite entry"),
    ],
)
def test_heatmap_of_weights_with_nothing_finite_is_one_line(capsys, tmp_path, weights, fragment):
    torch.save(weights, tmp_path / "w.pt")
    code, _, err = main(capsys, "heatmap", tmp_path / "w.pt", "--out", tmp_path / "w.png")
    assert_one_line(code, err, fragment)
    assert [p.name for p in tmp_path.iterdir()] == ["w.pt"]


def test_heatmap_draws_weights_with_some_nan(capsys, tmp_path):
    weights = torch.softmax(torch.randn(2, 3, 4), -1)
    weights[0, 0, 0] = float("nan")
    torch.save(weights, tmp_path / "w.pt")
    code, _, err = main(capsys, "heatmap", tmp_path / "w.pt", "--out", tmp_path / "w.png")
    assert code == 0, err


def test_heatmap_title_that_matplotlib_cannot_typeset_is_one_line(capsys, weights_file):
    out = weights_file.parent / "w.png"
    code, _, err = main(capsys, "heatmap", weights_file, "--out", out, "--title", "$\\foo$")
    assert_one_line(code, err, "cannot draw", "Unknown symbol")
    assert not out.exists() and [p.name for p in weights_file.parent.iterdir()] == ["w.pt"]


def test_heatmap_grid_takes_the_title(capsys, tmp_path):
    torch.save(torch.softmax(torch.randn(2, 2, 3, 4), -1), tmp_path / "grid.pt")
    code, _, err = main(
        capsys, "heatmap", tmp_path / "grid.pt", "--out", tmp_path / "grid.svg", "--title", "layer x head"
    )
    assert code == 0, err
    assert "layer x head" in (tmp_path / "grid.svg").read_text()


@pytest.mark.parametrize(
    ("source", "fragment"),
    [("folder", "is a folder, not a file"), ("missing.pt", "no such file"), ("/dev/null", "is not a regular file")],
)
def test_files_to_read_must_be_regular_files(capsys, no_work, tmp_path, monkeypatch, source, fragment):
    if source.startswith("/dev/") and not os.path.exists(source):
        pytest.skip("no /dev/null here")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "folder").mkdir()
    code, _, err = main(capsys, "heatmap", source, "--out", "w.png")
    assert_one_line(code, err, fragment)
    code, _, err = main(capsys, "bench", "--compare", source)
    assert_one_line(code, err, fragment)


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (b"null", 'expected a JSON object with "rows", a list, got null'),
        (b'"a string"', 'got "a string"'),
        (b"[1, 2]", "got [1, 2]"),
        (b'{"rows": 3}', 'got {"rows": 3}'),
        (b'{"rows": [null]}', "rows[0] must be a JSON object, got null"),
        (b'{"rows": [{"kind": "mha"}]}', 'rows[0] has no "B"'),
        (
            b'{"rows": [{"kind": "mha", "B": "8", "L": 8, "mode": "", "mask": "", "contender": ""}]}',
            'rows[0]["B"] must be int, got "8"',
        ),
        (b'{"rows": [], "threads": "two"}', 'the results["threads"] must be int, got "two"'),
        (b'{"rows": [], "seconds": null}', 'the results["seconds"] must be float, got null'),
        (b"{not json", "Expecting property name"),
        (b"\xff\xfe\x00", "utf-8"),
    ],
)
def test_bench_compare_checks_the_saved_structure(capsys, no_work, tmp_path, content, fragment):
    saved = tmp_path / "saved.json"
    saved.write_bytes(content)
    code, _, err = main(capsys, "bench", "--quick", "--compare", saved)
    assert_one_line(code, err, f"--compare {saved}: not results saved with `attnkit bench --json`", fragment)


def test_bench_compare_reads_what_bench_json_saved(tmp_path):
    report = bench.Report(rows=[bench.Row("mha", 2, 128, "train", "none", "torch", seconds=0.5)], threads=2)
    bench.save_json(report, str(tmp_path / "r.json"))
    data = json.loads((tmp_path / "r.json").read_text())
    data["added_later"] = 1  # a key from a newer attnkit is ignored
    data["rows"][0]["also_later"] = "x"
    (tmp_path / "r.json").write_text(json.dumps(data))
    assert bench.load_json(str(tmp_path / "r.json")) == report


def small_report(**kwargs):
    rows = [
        bench.Row("mha", 8, L, "train", "none", contender, seconds=0.5, peak_bytes=2**20)
        for L in (128, 512)
        for contender in ("attnkit", "torch")
    ]
    return bench.Report(rows=rows, matmul_gflops=100.0, threads=2, torch_version="x", seconds=1.0)


def test_bench_writes_its_json_and_picture_whole(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "run", small_report)
    code, out, err = main(capsys, "bench", "--json", tmp_path / "r.json", "--plot", tmp_path / "r.png")
    assert code == 0, err
    assert out.splitlines()[-2:] == [str(tmp_path / "r.json"), str(tmp_path / "r.png")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json", "r.png"]
    assert bench.load_json(str(tmp_path / "r.json")) == small_report()
    assert (tmp_path / "r.json").stat().st_mode & 0o777 == 0o666 & ~_umask()


def test_bench_that_fails_writing_leaves_no_partial_file(capsys, tmp_path, monkeypatch):
    def disk_full(data, f, **kwargs):  # the real save_json, on a disk that fills up halfway through the file
        f.write('{"rows": [')
        f.flush()
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(bench, "run", small_report)
    monkeypatch.setattr(bench.json, "dump", disk_full)
    (tmp_path / "r.json").write_text("an earlier run")
    code, _, err = main(capsys, "bench", "--json", tmp_path / "r.json")
    assert_one_line(code, err, "r.json: cannot write (No space left on device)")
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]
    assert (tmp_path / "r.json").read_text() == "an earlier run"


def test_demo_makes_no_folder_until_the_pictures_are_drawn(capsys, tmp_path, monkeypatch):
    out = tmp_path / "new" / "nested" / "pictures"
    seen = []
    monkeypatch.setattr(demo, "replay_book_examples", lambda echo: seen.append(out.parent.parent.exists()))
    monkeypatch.setattr(
        demo, "train", lambda kind, **kwargs: seen.append(out.parent.parent.exists()) or fake_result(kind)
    )
    code, stdout, err = main(capsys, "demo", "--quick", "--out", out)
    assert code == 0, err
    assert seen == [False] * (1 + len(demo.KINDS))
    names = sorted(demo.PICTURES)  # the heatmaps, the training curves and a viewer page per model
    assert sorted(p.name for p in out.iterdir()) == names
    assert all(str(out / name) in stdout for name in names)
    assert [p.name for p in tmp_path.iterdir()] == ["new"] and [p.name for p in out.parent.iterdir()] == ["pictures"]
    assert oct(out.stat().st_mode & 0o777) == oct(0o777 & ~_umask())  # not mkdtemp's private 0o700


def _umask():
    mask = os.umask(0)
    os.umask(mask)
    return mask


def failing_draw(results, folder):
    (folder / "additive-attention.png").write_bytes(b"\x89PNG half")
    raise OSError(28, "No space left on device")


def test_demo_that_fails_drawing_leaves_no_folder_behind(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(demo, "replay_book_examples", lambda echo: None)
    monkeypatch.setattr(demo, "train", lambda kind, **kwargs: fake_result(kind))
    monkeypatch.setattr(demo, "draw", failing_draw)
    code, _, err = main(capsys, "demo", "--quick", "--out", tmp_path / "new" / "pictures")
    assert_one_line(code, err, "cannot write the pictures", "No space left on device")
    assert list(tmp_path.iterdir()) == []


def test_demo_that_fails_drawing_leaves_an_existing_folder_as_it_was(capsys, tmp_path, monkeypatch):
    (tmp_path / "training.png").write_bytes(b"an earlier run")
    monkeypatch.setattr(demo, "replay_book_examples", lambda echo: None)
    monkeypatch.setattr(demo, "train", lambda kind, **kwargs: fake_result(kind))
    monkeypatch.setattr(demo, "draw", failing_draw)
    code, _, err = main(capsys, "demo", "--quick", "--out", tmp_path)
    assert_one_line(code, err, "cannot write the pictures")
    assert [p.name for p in tmp_path.iterdir()] == ["training.png"]
    assert (tmp_path / "training.png").read_bytes() == b"an earlier run"


def test_demo_interrupted_while_training_leaves_no_folder(capsys, tmp_path, monkeypatch):
    def interrupted(kind, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "replay_book_examples", lambda echo: None)
    monkeypatch.setattr(demo, "train", interrupted)
    code, _, err = main(capsys, "demo", "--out", tmp_path / "pictures")
    assert code == 130 and err == "attnkit: interrupted\n"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "argv", [("heatmap", "w.pt", "--out", "w.png"), ("demo", "--quick"), ("bench", "--plot", "b.png")]
)
def test_commands_that_draw_say_what_to_install_without_matplotlib(
    capsys, no_work, tmp_path, monkeypatch, weights_file, argv
):
    monkeypatch.chdir(weights_file.parent)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    code, _, err = main(capsys, *argv)
    assert_one_line(code, err, "needs matplotlib", "pip install -e '.[plot]' in attnkit's checkout")
    assert [p.name for p in weights_file.parent.iterdir()] == ["w.pt"]


# As the issue reported them: each was a traceback ----------------------------------------------------------------


def test_the_reported_tracebacks_are_one_line_errors(capsys, no_work, tmp_path, monkeypatch):
    torch.save(torch.softmax(torch.randn(3, 4), -1), tmp_path / "w.pt")
    (tmp_path / "DIR").mkdir()
    (tmp_path / "null.json").write_text("null")
    (tmp_path / "string.json").write_text('"results"')
    torch.save(torch.rand(30, 30, 2, 2), tmp_path / "grid.pt")
    cases = [
        (("trace", "dot", "--valid-lens", "100000000000000000000,2"), "--valid-lens"),
        (("heatmap", "w.pt", "--out", "DIR"), "names a folder"),
        (("heatmap", "w.pt", "--out", "/proc/a.png"), "cannot write into folder '/proc'"),
        (("demo", "--quick", "--seed", str(10**20)), "--seed"),
        (("bench", "--compare", "null.json"), "got null"),
        (("bench", "--compare", "string.json"), 'got "results"'),
        (("heatmap", "grid.pt", "--out", "grid.png"), "900 panels"),
    ]
    if not ON_LINUX_PROC:
        cases = [c for c in cases if "/proc/a.png" not in c[0]]
    monkeypatch.chdir(tmp_path)
    for args, fragment in cases:
        code, _, err = main(capsys, *args)
        assert_one_line(code, err, fragment)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["DIR", "grid.pt", "null.json", "string.json", "w.pt"]
    assert list((tmp_path / "DIR").iterdir()) == []


def test_a_reader_that_goes_away_gets_no_traceback():
    """`attnkit trace multihead --format json | head -0`: the pipe is closed before attnkit writes; it stops quietly
    (rich's tables exit 1 on their own, plain output exits 141 as a shell reports SIGPIPE)."""
    argvs = (["trace", "multihead", "--format", "json"], ["info"])
    procs = []
    for argv in argvs:  # side by side: each process spends most of its time importing torch
        script = f"import sys; from attnkit.tools.cli import main; sys.exit(main({argv!r}))"
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        proc.stdout.close()  # the reader is gone before anything is written
        procs.append(proc)
    for argv, proc in zip(argvs, procs, strict=True):
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=120) in (1, 141), err
        assert err == "", argv


def test_weights_that_are_not_a_dense_cpu_tensor_are_one_line_errors(capsys, tmp_path):
    sparse, meta = tmp_path / "s.pt", tmp_path / "m.pt"
    torch.save(torch.rand(3, 3).to_sparse(), sparse)
    torch.save(torch.empty(3, 3, device="meta"), meta)
    for path, fragment in ((sparse, "sparse_coo"), (meta, "on meta")):
        code, _, err = main(capsys, "heatmap", path, "--out", tmp_path / "a.png")
        assert_one_line(code, err, "weights must be a dense tensor", fragment)
    assert not (tmp_path / "a.png").exists()


def test_a_big_endian_numpy_file_is_read(capsys, tmp_path):
    np.save(tmp_path / "be.npy", np.full((3, 3), 0.25, dtype=">f4"))
    code, _, err = main(capsys, "heatmap", tmp_path / "be.npy", "--out", tmp_path / "be.png")
    assert code == 0, err
    assert (tmp_path / "be.png").is_file()


def test_compare_nested_too_deep_is_a_one_line_error(capsys, no_work, tmp_path):
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    code, _, err = main(capsys, "bench", "--quick", "--compare", deep)
    assert_one_line(code, err, "--compare", "not results saved")


def test_names_too_long_and_links_to_nothing_are_refused_before_any_work(capsys, no_work, tmp_path, weights_file):
    long_name = "a" * 300
    code, _, err = main(capsys, "demo", "--quick", "--out", tmp_path / "new" / long_name)
    assert_one_line(code, err, "longer than this file system allows")
    code, _, err = main(capsys, "heatmap", weights_file, "--out", tmp_path / f"{long_name}.png")
    assert_one_line(code, err, "--out")
    assert "too long" in err or "longer than this file system allows" in err
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere" / "dir")
    code, _, err = main(capsys, "demo", "--quick", "--out", tmp_path / "dangling")
    assert_one_line(code, err, "is a symbolic link to nothing")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling", "w.pt"]


def test_a_demo_picture_name_taken_by_a_folder_is_refused_before_training(capsys, no_work, tmp_path):
    (tmp_path / "ex" / demo.PICTURES[1]).mkdir(parents=True)
    code, _, err = main(capsys, "demo", "--quick", "--out", tmp_path / "ex")
    assert_one_line(code, err, "exists and is not a file")
    assert [p.name for p in (tmp_path / "ex").iterdir()] == [demo.PICTURES[1]]


def test_filling_a_folder_is_all_or_nothing(tmp_path):
    """Files moved into an existing folder: a name taken by a folder stops it before anything moves; a failure midway
    puts back what was replaced and removes what was added."""
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "b.png").write_text("old b")
    (folder / "c.png").mkdir()
    with pytest.raises(cli.UsageError, match="exists and is not a regular file"), files.filling(folder) as staging:
        for name in ("a.png", "b.png", "c.png"):
            (staging / name).write_text("new")
    assert sorted(p.name for p in folder.iterdir()) == ["b.png", "c.png"] and (folder / "b.png").read_text() == "old b"
    (folder / "c.png").rmdir()
    real_replace = os.replace

    def fail_on_c(src, dst):
        if str(dst).endswith("c.png"):
            raise OSError(28, "No space left on device")
        return real_replace(src, dst)

    with pytest.MonkeyPatch.context() as mp, pytest.raises(OSError), files.filling(folder) as staging:
        mp.setattr(files.os, "replace", fail_on_c)
        for name in ("a.png", "b.png", "c.png"):
            (staging / name).write_text("new")
    assert sorted(p.name for p in folder.iterdir()) == ["b.png"] and (folder / "b.png").read_text() == "old b"


def test_an_output_that_cannot_be_written_is_one_line_without_traceback():
    argvs = (["info"], ["trace", "dot", "--format", "json"])
    procs = []
    for argv in argvs:  # side by side: each process spends most of its time importing torch
        script = f"import sys; from attnkit.tools.cli import main; sys.exit(main({argv!r}))"
        with open("/dev/full", "w") as full:
            procs.append(subprocess.Popen([sys.executable, "-c", script], stdout=full, stderr=subprocess.PIPE))
    for proc in procs:
        _, err = proc.communicate(timeout=120)
        err = err.decode()
        assert proc.returncode == 1 and err == "attnkit: error: cannot write the output (No space left on device)\n", (
            err
        )


def test_no_command_lists_the_commands_in_its_one_line(capsys):
    code, out, err = main(capsys)
    assert_one_line(code, err, "required: COMMAND", "one of " + ", ".join(cli.COMMANDS), "attnkit COMMAND -h")
    assert out == ""


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (("--tokens", "a b"), "tokens has 2 tokens but layer '(model)' has 6 keys in its longest call"),
        (("--tokens", "a b c d e f", "--kv-heads", "3"), "kv_heads do not apply to a page of statistics"),
        (("--query-tokens", "a b c d e f"), "query_tokens do not apply to a page of statistics"),
    ],
)
def test_a_statistics_page_refuses_what_does_not_fit_it(capsys, tmp_path, args, fragment):
    """A page of a record_stats record: tokens of another length, and the options that do not apply to it, are a
    one-line mistake (they were ignored, exit 0) and leave no file."""
    import attnkit

    mha = attnkit.MultiHeadAttention(16, 4)
    x = torch.randn(1, 6, 16)
    with attnkit.record_stats(mha, topk=3) as rec:
        mha(x, x, x)
    rec.save(tmp_path / "stats.pt")
    out = tmp_path / "page.html"
    code, _, err = main(capsys, "view", tmp_path / "stats.pt", "--out", out, *args)
    assert_one_line(code, err, fragment)
    assert not out.exists()
    code, printed, _ = main(capsys, "view", tmp_path / "stats.pt", "--out", out, "--tokens", "a b c d e f")
    assert code == 0 and out.exists()


@pytest.mark.parametrize("installed", [True, False])
def test_the_demo_offers_smollm2_only_where_it_is_installed(capsys, tmp_path, monkeypatch, installed):
    from attnkit.tools.demo import smollm2

    monkeypatch.setattr(demo, "replay_book_examples", lambda echo: None)
    monkeypatch.setattr(demo, "train", lambda kind, **kwargs: fake_result(kind))
    monkeypatch.setattr(smollm2, "installed", lambda: installed)
    code, stdout, err = main(capsys, "demo", "--quick", "--out", tmp_path / "pictures")
    assert code == 0, err
    assert ("attnkit demo --smollm2" in stdout) == installed, stdout


def test_demo_smollm2_where_it_is_not_installed_is_one_line_naming_what_is_missing(
    capsys, no_work, tmp_path, monkeypatch
):
    from attnkit.integrations import smollm2 as model_files

    def missing():
        raise ModuleNotFoundError(f"SmolLM2 needs accelerate: {model_files.INSTALL}")

    monkeypatch.setattr(model_files, "check_installed", missing)
    code, _, err = main(capsys, "demo", "--smollm2", "--out", tmp_path / "pictures")
    assert_one_line(code, err, "--smollm2", "needs accelerate", "pip install")
    assert list(tmp_path.iterdir()) == []


def test_demo_smollm2_that_fails_drawing_leaves_no_folder_behind(capsys, tmp_path, monkeypatch):
    from attnkit.integrations import smollm2 as model_files
    from attnkit.tools.demo import smollm2

    def failing(seen, folder):
        (folder / smollm2.PICTURES[0]).write_text("<html>half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(model_files, "check_installed", lambda: None)
    monkeypatch.setattr(model_files, "load", lambda **kwargs: (None, None))
    monkeypatch.setattr(smollm2, "read", lambda model, tokenizer: {})
    monkeypatch.setattr(smollm2, "describe", lambda seen: ["found"])
    monkeypatch.setattr(smollm2, "draw", failing)
    code, _, err = main(capsys, "demo", "--smollm2", "--out", tmp_path / "new" / "pictures")
    assert_one_line(code, err, "cannot write the pictures", "No space left on device")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("extra", "named"), [(["--seed", "3"], "--seed"), (["--quick"], "--quick"), (["--quick", "--seed", "0"], "--seed")]
)
def test_demo_smollm2_refuses_the_training_options(capsys, no_work, tmp_path, extra, named):
    code, _, err = main(capsys, "demo", "--smollm2", *extra, "--out", tmp_path / "pictures")
    assert_one_line(code, err, "--smollm2 trains nothing", named)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("error", "fragments"),
    [
        (ModuleNotFoundError("SmolLM2 needs accelerate: pip install ..."), ("--smollm2", "accelerate")),
        (PermissionError(13, "Permission denied"), ("cannot convert or load the model in", "Permission denied")),
        (RuntimeError("Error while deserializing header: incomplete metadata"), ("remove a broken conversion",)),
    ],
)
def test_demo_smollm2_that_cannot_load_the_model_is_one_line(capsys, tmp_path, monkeypatch, error, fragments):
    from attnkit.integrations import smollm2 as model_files

    def failing(**kwargs):
        raise error

    monkeypatch.setattr(model_files, "check_installed", lambda: None)
    monkeypatch.setattr(model_files, "load", failing)
    code, _, err = main(capsys, "demo", "--smollm2", "--out", tmp_path / "pictures")
    assert_one_line(code, err, *fragments)
    assert list(tmp_path.iterdir()) == []
