"""The demo: it learns reversal, attends along the anti-diagonal, repeats itself, and draws its pictures."""

from __future__ import annotations

import subprocess
import sys

import matplotlib.image
import numpy as np
import pytest
import torch

from attnkit.tools import cli, demo, viewer
from pages import blob, payload


@pytest.fixture(scope="module")
def quick_results():
    return {kind: demo.train(kind, seed=0, quick=True) for kind in demo.KINDS}


@pytest.mark.parametrize("kind", demo.KINDS)
def test_quick_training_reaches_its_target_and_attends_along_the_anti_diagonal(quick_results, kind):
    result = quick_results[kind]
    assert result.accuracy >= 0.90
    ex = result.example
    weights = ex["weights"]  # (H, T, S)
    n = len(ex["source"])
    assert weights.shape[1:] == (n + 1, len(ex["source_labels"])) and len(ex["source_labels"]) > n
    assert ex["source_labels"][n:] == ["<pad>"] * (len(ex["source_labels"]) - n)
    assert (weights[..., n:] == 0).all()  # padding: exactly zero
    # output t copies source n - 1 - t: where the weights (averaged over heads) peak
    peaks = weights.mean(0)[:n].argmax(-1)
    assert (peaks == torch.arange(n - 1, -1, -1)).float().mean() >= 0.8


def test_same_seed_same_numbers(quick_results):
    again = demo.train("multihead", seed=0, quick=True)
    first = quick_results["multihead"]
    assert again.losses == first.losses and again.accuracies == first.accuracies and again.steps == first.steps
    assert torch.equal(again.example["weights"], first.example["weights"])


def test_progress_is_reported_and_threads_are_restored():
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # (under make test's workers the count is already 1, which training sets)
    seen = []
    try:
        result = demo.train("additive", seed=1, quick=True, on_progress=seen.append)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
    assert seen[-1]["done"] and seen[-1]["step"] == result.steps
    assert all(not p["done"] for p in seen[:-1])
    assert {"step", "total", "loss", "accuracy", "elapsed", "done"} <= set(seen[0])


def test_demo_command_quick(tmp_path):
    out = tmp_path / "pictures"
    result = subprocess.run(
        [sys.executable, "-m", "attnkit", "demo", "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "masked_softmax(torch.rand(2, 2, 4), torch.tensor([2, 3]))" in text
    assert "transpose_qkv" in text and "[3, 2] -> [3, 3, 3, 3, 3, 2, 2, 2, 2, 2]" in text
    for kind in demo.KINDS:
        line = next(line for line in text.splitlines() if line.startswith(f"{kind}: "))
        assert float(line.split("%")[0].split()[-1]) >= 90.0
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        "additive-attention.html",
        "additive-attention.png",
        "multihead-attention.html",
        "multihead-attention.png",
        "training.png",
    ]
    for name in names:
        assert str(out / name) in text
        if name.endswith(".html"):  # a viewer page of every attention module (tests/test_view_browser.py opens one)
            layers = payload(out / name)["layers"]
            assert len(layers) == (1 if name.startswith("additive") else 6)
            continue
        image = matplotlib.image.imread(out / name)
        assert image.shape[0] > 200 and image.shape[1] > 300 and image[..., :3].std() > 0.05


def test_the_largest_seed_torch_takes_trains_and_larger_ones_are_refused():
    result = demo.train("additive", seed=2**64 - 1, quick=True)  # the held-out seed wraps around, as torch's do
    assert result.accuracy >= 0.9
    for seed in (2**64, -(2**63) - 1, 10**20, 1.5, True):
        with pytest.raises(ValueError, match=r"seed must be a whole number from -9223372036854775808 to 1844"):
            demo.train("additive", seed=seed, quick=True)


def test_the_transformer_generates_with_its_caches_the_tokens_of_whole_prefix_decoding():
    """The demo's greedy decoding uses key/value caches (self- and cross-attention); the tokens are those of
    decoding the whole prefix again at every step."""
    torch.manual_seed(0)
    model = demo.models.TransformerSeq2Seq(max_positions=16).eval()
    g = torch.Generator().manual_seed(0)
    src = torch.randint(3, 13, (6, 8), generator=g)
    lens = torch.tensor([8, 3, 5, 1, 8, 6])
    src[torch.arange(8)[None] >= lens[:, None]] = demo.models.PAD
    assert torch.equal(demo.models.greedy(model, src, lens, 9), demo.models.greedy(model, src, lens, 9, cache=False))


@pytest.mark.parametrize("kind", demo.KINDS)
def test_attnkit_view_shows_the_record_of_each_demo_model(quick_results, kind, tmp_path, capsys):
    """The example's record: the encoder, the decoder reading its greedy output whole, then (the Transformer) the
    same decoding step by step through its caches, whose rows are those of the whole call; `attnkit view` reads it
    saved with torch.save, and the demo's tokens label each module's queries and keys."""
    ex = quick_results[kind].example
    torch.save(ex["record"], tmp_path / "record.pt")
    code = cli.main(["view", str(tmp_path / "record.pt"), "--out", str(tmp_path / "page.html")])
    assert (code, capsys.readouterr().err) == (0, "")
    data = payload(tmp_path / "page.html")
    T, S = len(ex["source"]) + 1, len(ex["source_labels"])
    calls = {layer["name"]: layer["calls"] for layer in data["layers"]}
    if kind == "additive":
        assert list(calls) == ["attention"] and [(c["lq"], c["lk"]) for c in calls["attention"]] == [(T, S)]
    else:
        blocks = ("encoder.0.attention", "encoder.1.attention")
        decoder = [f"decoder.{i}.{part}" for i in range(2) for part in ("self_attention", "cross_attention")]
        assert list(calls) == [*blocks, *decoder]
        assert all([(c["lq"], c["lk"]) for c in calls[name]] == [(S, S)] for name in blocks)
        steps = calls["decoder.1.self_attention"]
        assert [(c["lq"], c["lk"]) for c in steps] == [(T, T), *((1, t + 1) for t in range(T))]
        whole = np.frombuffer(blob(data, steps[0]["data"]), dtype="<f4").reshape(4, T, T)
        for t in range(T):
            step = np.frombuffer(blob(data, steps[1 + t]["data"]), dtype="<f4").reshape(4, t + 1)
            np.testing.assert_allclose(step, whole[:, t, : t + 1], atol=1e-5)
        assert [(c["lq"], c["lk"]) for c in calls["decoder.1.cross_attention"]] == [(T, S), *[(1, S)] * T]
    labelled = payload(viewer.view(ex["record"], layer_tokens=ex["layer_tokens"]))
    read = ["<bos>", *(str(d) for d in ex["prediction"])][:T]
    for layer in labelled["layers"]:
        for c in layer["calls"]:
            queries = labelled["tokens"][c["q"]][c["qoff"] : c["qoff"] + c["lq"]]
            keys = labelled["tokens"][c["k"]][: c["lk"]]
            if layer["name"].startswith("encoder"):
                assert queries == keys == ex["source_labels"]
            else:
                assert keys == (
                    ex["source_labels"] if "cross" in layer["name"] or kind == "additive" else read[: c["lk"]]
                )
                assert queries == read[c["qoff"] : c["qoff"] + c["lq"]]
