"""``attnkit demo --smollm2`` (attnkit.tools.demo.smollm2): the heads it names are the ones its measures define (on
weights built to have them), and on SmolLM2 itself it finds the sink, previous-token and induction heads the guide's
pictures show and writes pages a browser can open."""

from __future__ import annotations

import pytest
import torch

from attnkit.tools import cli
from attnkit.tools.demo import smollm2


def _built(L: int, ids: list[int]) -> list[torch.Tensor]:
    """Two layers of 3 heads: (0, 1) looks at the previous token, (1, 0) at the first, (1, 2) at the token after the
    query's token's earlier occurrence (else the first); every other head spreads evenly."""
    causal = torch.tril(torch.ones(L, L, dtype=torch.float64))
    even = causal / causal.sum(-1, keepdim=True)  # (L, L)
    layers = [even.repeat(3, 1, 1).clone() for _ in range(2)]  # (3, L, L) each
    layers[0][1] = torch.eye(L, dtype=torch.float64).roll(-1, dims=1).tril()  # (L, L): key i - 1
    layers[0][1][0, 0] = 1.0
    layers[1][0] = 0.0
    layers[1][0][:, 0] = 1.0
    induction = torch.zeros(L, L, dtype=torch.float64)
    induction[:, 0] = 1.0
    earlier: dict[int, int] = {}
    for i, token in enumerate(ids):
        if token in earlier and earlier[token] + 1 < i:
            induction[i] = 0.0
            induction[i, earlier[token] + 1] = 1.0
        earlier[token] = i
    layers[1][2] = induction
    return layers


def test_find_heads_names_the_heads_built_to_be_each_kind():
    ids = [5, 6, 7, 8, 5, 6, 7, 8]
    found = smollm2.find_heads(_built(len(ids), ids), ids)
    assert found.heads == 6
    assert found.sink[:2] == (1, 0) and found.sink[2] == pytest.approx(1.0)
    assert (1, 0) in found.sinks and (1, 2) not in found.sinks  # the induction head's repeats are off the first
    assert found.previous[:2] == (0, 1) and found.previous[2] == pytest.approx(1.0)
    assert found.induction is not None and found.induction[:2] == (1, 2)
    assert found.induction[2] == pytest.approx(1.0)


def test_find_heads_without_a_repeat_names_no_induction_head_and_refuses_one_token():
    ids = [1, 2, 3, 4]
    assert smollm2.find_heads(_built(4, ids), ids).induction is None
    with pytest.raises(ValueError, match="ids: 1 token"):
        smollm2.find_heads([torch.ones(1, 1, 1)], [3])


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
