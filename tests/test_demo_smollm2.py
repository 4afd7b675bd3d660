"""``attnkit demo --smollm2`` (attnkit.tools.demo.smollm2): the heads it names are the ones its measures define (on
weights built to have them), and on SmolLM2 itself it finds the sink, previous-token and induction heads the guide's
pictures show and writes pages a browser can open."""

from __future__ import annotations

import pytest
import torch

from attnkit.tools import cli
from attnkit.tools.demo import smollm2


def _built(L: int, induction_pairs: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Two layers of 3 heads: (0, 1) looks at the previous token, (1, 0) at the first, (1, 2) at the keys given for
    each query in ``induction_pairs`` (evenly), the first token otherwise; every other head spreads evenly."""
    causal = torch.tril(torch.ones(L, L, dtype=torch.float64))
    even = causal / causal.sum(-1, keepdim=True)  # (L, L)
    layers = [even.repeat(3, 1, 1).clone() for _ in range(2)]  # (3, L, L) each
    layers[0][1] = torch.eye(L, dtype=torch.float64).roll(-1, dims=1).tril()  # (L, L): key i - 1
    layers[0][1][0, 0] = 1.0
    layers[1][0] = 0.0
    layers[1][0][:, 0] = 1.0
    induction = torch.zeros(L, L, dtype=torch.float64)
    induction[:, 0] = 1.0
    for i in {i for i, _ in induction_pairs}:
        keys = [k for q, k in induction_pairs if q == i]
        induction[i] = 0.0
        induction[i, keys] = 1.0 / len(keys)
    layers[1][2] = induction
    return layers


def test_find_heads_names_the_heads_built_to_be_each_kind():
    ids = [5, 6, 7, 8, 5, 6, 7, 8, 5]
    # written out: each query whose token came before (not just before), and the keys that followed it those times
    pairs = [(4, 1), (5, 2), (6, 3), (7, 4), (8, 1), (8, 5)]
    found = smollm2.find_heads(_built(len(ids), pairs), ids)
    assert found.heads == 6
    assert found.sink[:2] == (1, 0) and found.sink[2] == pytest.approx(1.0)
    assert (1, 0) in found.sinks and (1, 2) not in found.sinks  # the induction head's repeats are off the first
    assert found.previous[:2] == (0, 1) and found.previous[2] == pytest.approx(1.0)
    assert found.induction is not None and found.induction[:2] == (1, 2)
    assert found.induction[2] == pytest.approx(1.0)
    # query 8's weight on one of its two earlier successors counts whole; on the first token instead, nothing
    found = smollm2.find_heads(_built(len(ids), pairs[:-1]), ids)
    assert found.induction is not None and found.induction[2] == pytest.approx(1.0)
    found = smollm2.find_heads(_built(len(ids), pairs[:4]), ids)
    assert found.induction is not None and found.induction[2] == pytest.approx(4 / 5)


def test_a_previous_token_head_is_no_induction_head_and_without_repeats_there_is_none():
    ids = [7, 8, 7, 9]  # query 2's token came before at 0, whose next token is query 2's previous one: left out
    found = smollm2.find_heads(_built(4, []), ids)
    assert found.induction is None and found.previous[:2] == (0, 1)
    assert smollm2.find_heads(_built(4, []), [1, 2, 3, 4]).induction is None


def test_find_heads_refuses_what_is_not_a_layer_of_weights_over_the_ids():
    with pytest.raises(ValueError, match="ids: 1 token"):
        smollm2.find_heads([torch.ones(1, 1, 1)], [3])
    with pytest.raises(ValueError, match="weights: no layer"):
        smollm2.find_heads([], [1, 2])
    with pytest.raises(ValueError, match=r"weights\[0\]: \(1, 3, 4, 4\), expected \(H, 4, 4\)"):
        smollm2.find_heads([torch.ones(1, 3, 4, 4)], [1, 2, 3, 4])  # a record's (1, H, L, L), not (H, L, L)
    with pytest.raises(ValueError, match=r"weights\[1\]: \(3, 5, 5\), expected \(H, 4, 4\) for 4 ids"):
        smollm2.find_heads([torch.ones(3, 4, 4), torch.ones(3, 5, 5)], [1, 2, 3, 4])
    for wrong in (float("nan"), float("inf"), -0.5):
        with pytest.raises(ValueError, match=r"weights\[0\]: attention weights are finite and at least 0"):
            smollm2.find_heads([torch.full((2, 3, 3), wrong)], [1, 2, 1])


@pytest.fixture(scope="module")
def installed():
    from test_presses_smollm2 import smollm2 as model_files  # (it skips the module where the model is not installed)

    return model_files


def test_the_demo_on_smollm2_names_its_heads_and_writes_its_pages(installed, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(smollm2, "NEEDLE_TOKENS", 300)  # the needle page's forward, shorter (the heads come first)
    assert cli.main(["demo", "--smollm2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    # what the guide's pictures show: SmolLM2's strongest induction and previous-token heads on the sentence
    assert "induction head: model.layers.17.self_attn, head 5" in out, out
    assert "previous-token head: model.layers.16.self_attn, head 0" in out, out
    assert "108 of 270 heads put at least 50% of their weight on the first token" in out, out
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(smollm2.PICTURES)
    assert (tmp_path / "smollm2-heads.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (tmp_path / "smollm2-attention.html").read_text()
    assert "a sentence said twice" in page and "model.layers.29.self_attn" in page
    stats = (tmp_path / "smollm2-stats.html").read_text()
    assert "relevance" in stats and "a needle in" in stats
