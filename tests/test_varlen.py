"""Packed documents run as one call per document (attnkit.varlen): against the float64 math of tests/mathref.py, on
every backend, with document ids in any order (a document in several runs, documents without keys, ids per example
or shared, queries and keys of different lengths), crossed with is_causal, valid_lens, a boolean attn_mask, another
mask_mod, a score_mod that reads the call's own indices, sinks and grouped key/value heads. NaN or huge content in
one document never reaches another's outputs or gradients."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

import attnkit
import mathref
from attnkit import dispatch, mods
from attnkit.backends.tiles import online
from mathref import max_err

# B batch, H heads, Hkv key/value heads, Lq/Lk query/key length, D head dim

H, HKV, D = 4, 2, 6
BACKENDS = ("reference", "sdpa", "tiles:online", "tiles", "auto")
# float64 against float64 math: only the order of the sums differs.
OUT_TOL64, GRAD_TOL64 = 1e-12, 1e-10


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: intra-op threads only add synchronisation on a busy 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@st.composite
def _ids(draw, length: int) -> list[int]:
    """Runs of document ids 0..3 in any order (a document may come back in a later run)."""
    ids: list[int] = []
    while len(ids) < length:
        ids += [draw(st.integers(0, 3))] * draw(st.integers(1, 7))
    return ids[:length]


@st.composite
def _cases(draw) -> dict:
    B = draw(st.integers(1, 2))
    Lq = draw(st.integers(1, 20))
    Lk = Lq if draw(st.booleans()) else draw(st.integers(1, 20))
    rows_q = draw(st.integers(1, B))  # ids shared by every example, or one row each
    ids_q = torch.tensor([draw(_ids(Lq)) for _ in range(rows_q)])
    ids_k = None if Lk == Lq and draw(st.booleans()) else torch.tensor([draw(_ids(Lk)) for _ in range(rows_q)])
    return {
        "B": B,
        "Lq": Lq,
        "Lk": Lk,
        "ids_q": ids_q,
        "ids_k": ids_k,
        "is_causal": draw(st.booleans()),
        "valid_lens": draw(st.sampled_from([None, "per example", "per query"])),
        "attn_mask": draw(st.booleans()),
        "window": draw(st.sampled_from([None, 3])),
        "score_mod": draw(st.sampled_from([None, "table", "alibi"])),
        "sinks": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
    }


def _arguments(case: dict) -> tuple[dict, dict, torch.Tensor, torch.Tensor, torch.Tensor]:
    """attnkit's keyword arguments, mathref's, and q, k, v (float64, requiring grad)."""
    g = torch.Generator().manual_seed(case["seed"])
    B, Lq, Lk = case["B"], case["Lq"], case["Lk"]
    q = torch.randn(B, H, Lq, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, HKV, Lk, D, generator=g, dtype=torch.float64) for _ in range(2))
    doc = mods.document(case["ids_q"], case["ids_k"])
    ours: dict = {"is_causal": case["is_causal"]}
    math: dict = {"is_causal": case["is_causal"]}
    mask_mods, math_mods = [doc], [mathref.document(case["ids_q"], case["ids_k"])]
    if case["window"] is not None:
        mask_mods.append(mods.sliding_window(case["window"]))
        math_mods.append(mathref.sliding_window(case["window"], Lq, Lk))
    ours["mask_mod"] = mask_mods[0] if len(mask_mods) == 1 else mods.and_masks(*mask_mods)
    math["mask_mod"] = mathref.and_masks(*math_mods)
    if case["valid_lens"] is not None:
        shape = (B,) if case["valid_lens"] == "per example" else (B, Lq)
        ours["valid_lens"] = math["valid_lens"] = torch.randint(0, Lk + 1, shape, generator=g)
    if case["attn_mask"]:
        ours["attn_mask"] = math["attn_mask"] = torch.rand(B, 1, Lq, Lk, generator=g) < 0.8
    if case["score_mod"] == "table":  # reads the call's own indices: a piece must pass them on unchanged
        table = torch.randn(B, Lq, Lk, generator=g, dtype=torch.float64, requires_grad=True)

        def score_mod(s, b, h, i, j):
            return s + table[b, i, j]

        ours["score_mod"] = math["score_mod"] = score_mod
    elif case["score_mod"] == "alibi":
        slopes = mods.alibi_slopes(H).double().requires_grad_()
        ours["score_mod"], math["score_mod"] = mods.alibi(slopes), mathref.alibi(slopes, Lq, Lk)
    if case["sinks"]:
        ours["sinks"] = math["sinks"] = torch.randn(H, generator=g, dtype=torch.float64, requires_grad=True)
    return ours, math, *(t.requires_grad_() for t in (q, k, v))


def _run(backend: str, q, k, v, ours: dict):
    """The output, or None where the backend named cannot run the call (it says why: tested elsewhere)."""
    try:
        with online.settings(block_size=4):
            return attnkit.scaled_dot_product_attention(q, k, v, backend=backend, **ours).output
    except ValueError as error:
        if "cannot run this call" in str(error):
            return None
        raise


def _leaves(q, k, v, ours: dict) -> list[torch.Tensor]:
    """q, k, v and what else gets a gradient: the sinks, ALiBi's slopes, the table a score_mod closes over."""
    found = [q, k, v]
    if ours.get("sinks") is not None:
        found.append(ours["sinks"])
    score_mod = ours.get("score_mod")
    if isinstance(score_mod, mods.alibi):
        found.append(score_mod.slopes)
    elif score_mod is not None:
        found += mods.read_tensors(score_mod)
    return found


@pytest.mark.parametrize("backend", BACKENDS)
@hypothesis_settings(max_examples=25, deadline=None)
@given(case=_cases())
def test_packed_documents_equal_the_math_with_every_mask_and_modifier(backend, case):
    ours, math, q, k, v = _arguments(case)
    out = _run(backend, q, k, v, ours)
    if out is None:
        return
    want, _ = mathref.attention_mods(q, k, v, **math)
    assert max_err(out, want) <= OUT_TOL64
    leaves = _leaves(q, k, v, ours)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, leaves, dout, allow_unused=True)
    expected = torch.autograd.grad(want, leaves, dout, allow_unused=True)
    for name, a, b in zip(("q", "k", "v", "sinks or score_mod", "score_mod"), got, expected, strict=False):
        a = torch.zeros_like(b) if a is None and b is not None else a
        b = torch.zeros_like(a) if b is None and a is not None else b
        if a is not None:
            assert max_err(a, b) <= GRAD_TOL64, name


@pytest.mark.parametrize("content", ["nan", "huge"])
@pytest.mark.parametrize("backend", BACKENDS)
@hypothesis_settings(max_examples=20, deadline=None)
@given(case=_cases(), which=st.integers(0, 3))
def test_one_documents_content_never_reaches_another(backend, content, case, which):
    """NaN (or finite content near 1e38) in every query, key and value of one document: every other document's
    outputs and gradients are those of the call with that document's content zeroed, to float64 rounding."""
    ours, math, q, k, v = _arguments(case)
    if ours.get("score_mod") is not None and not isinstance(ours["score_mod"], mods.alibi):
        ours.pop("score_mod")  # the table would mix the poisoned document's entries into its gradient
    B = case["B"]
    ids_q = case["ids_q"].expand(B, -1)  # (B, Lq)
    ids_k = (case["ids_q"] if case["ids_k"] is None else case["ids_k"]).expand(B, -1)  # (B, Lk)
    in_q, in_k = (ids_q == which)[:, None, :, None], (ids_k == which)[:, None, :, None]  # (B, 1, L, 1)
    value = float("nan") if content == "nan" else 1e38
    pairs = ((q, in_q), (k, in_k), (v, in_k))
    poisoned = [torch.where(where, value, t.detach()).requires_grad_() for t, where in pairs]
    clean = [torch.where(where, 0.0, t.detach()).requires_grad_() for t, where in pairs]
    out = _run(backend, *poisoned, ours)
    if out is None:
        return
    want = _run("reference", *clean, ours)
    others = ~in_q.expand_as(out)
    assert torch.isfinite(out[others]).all()
    assert max_err(out[others], want[others]) <= OUT_TOL64
    dout = torch.where(others, torch.randn_like(out), 0.0)  # a loss on the other documents only
    got = torch.autograd.grad(out, poisoned, dout)
    expected = torch.autograd.grad(want, clean, dout)
    for name, a, b, where in zip("qkv", got, expected, (in_q, in_k, in_k), strict=True):
        keep = ~where.expand_as(a)
        assert torch.isfinite(a[keep]).all(), name
        assert max_err(a[keep], b[keep]) <= GRAD_TOL64, name


def test_weights_are_zero_between_documents_and_the_math_within():
    ids = torch.tensor([[0, 0, 1, 1, 1, 0, 2, 2]])  # document 0 comes back after document 1
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, H, 8, D, generator=g, dtype=torch.float64) for _ in range(3))
    out, weights = attnkit.scaled_dot_product_attention(
        q, k, v, is_causal=True, mask_mod=mods.document(ids), need_weights=True
    )
    want, want_weights = mathref.attention_mods(q, k, v, is_causal=True, mask_mod=mathref.document(ids))
    assert max_err(out, want) <= OUT_TOL64
    assert max_err(weights, want_weights) <= OUT_TOL64
    assert torch.equal(weights[..., 5, 2:5], torch.zeros_like(weights[..., 5, 2:5]))  # document 1, hidden exactly


def test_causal_packed_documents_run_as_plain_causal_calls_on_the_fused_kernel():
    """Each document is a plain causal call: auto sends every one to sdpa (PyTorch's fused kernel)."""
    ids = torch.tensor([[0] * 40 + [1] * 100 + [2] * 64])
    q = torch.randn(1, H, 204, D)
    with dispatch.watch(implementations=True) as ran:
        attnkit.scaled_dot_product_attention(q, q, q, is_causal=True, mask_mod=mods.document(ids))
    assert ran == ["sdpa"] * 3


def test_a_document_without_keys_gives_zeros_and_zero_gradients():
    ids_q = torch.tensor([[0, 0, 7, 7, 1]])  # document 7 has no key
    ids_k = torch.tensor([[0, 1, 1]])
    q = torch.randn(1, H, 5, D, dtype=torch.float64, requires_grad=True)
    k, v = (torch.randn(1, H, 3, D, dtype=torch.float64, requires_grad=True) for _ in range(2))
    sinks = torch.zeros(H, dtype=torch.float64, requires_grad=True)
    for backend in ("reference", "tiles:online", "tiles", "auto"):  # (sdpa has no sinks)
        out = attnkit.scaled_dot_product_attention(
            q, k, v, mask_mod=mods.document(ids_q, ids_k), sinks=sinks, backend=backend
        ).output
        want, _ = mathref.attention_mods(q, k, v, mask_mod=mathref.document(ids_q, ids_k), sinks=sinks)
        assert torch.equal(out[:, :, 2:4], torch.zeros_like(out[:, :, 2:4])), backend
        assert max_err(out, want) <= OUT_TOL64, backend
        (dq,) = torch.autograd.grad(out.sum(), q)
        assert torch.equal(dq[:, :, 2:4], torch.zeros_like(dq[:, :, 2:4])), backend


@pytest.mark.parametrize("order", ["outer first", "inner first"])
def test_every_document_mask_of_a_conjunction_isolates_its_documents(order):
    """Two document masks in and_masks (documents inside sessions, say): NaN in one document reaches no other,
    whichever comes first (the split is on pairs of ids)."""
    ids, outer = torch.tensor([[0] * 12 + [1] * 12]), torch.tensor([[0] * 6 + [1] * 18])
    docs = [mods.document(outer), mods.document(ids)]
    mask_mod = mods.and_masks(*(docs if order == "outer first" else docs[::-1]))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, 24, D, generator=g, dtype=torch.float64) for _ in range(3))
    poisoned = v.clone()
    poisoned[:, :, 15] = float("nan")  # document 1 of ids, session 1 of outer
    for backend in BACKENDS:
        out = attnkit.scaled_dot_product_attention(q, k, poisoned, mask_mod=mask_mod, backend=backend).output
        want, _ = mathref.attention_mods(q, k, v, mask_mod=mathref.and_masks(*map(mathref.document, (outer, ids))))
        assert torch.isfinite(out[:, :, :12]).all(), backend
        assert max_err(out[:, :, :12], want[:, :, :12]) <= OUT_TOL64, backend


def test_a_backend_named_that_cannot_run_a_document_says_which():
    ids = torch.tensor([[0] * 95 + [1] * 160])
    q = torch.randn(1, H, 255, D)
    with pytest.raises(ValueError, match=r"said of one packed document: queries \[0, 95\)"):
        attnkit.scaled_dot_product_attention(q, q, q, mask_mod=mods.document(ids), backend="decode")


def test_a_softcap_subclass_that_reads_positions_sees_the_calls_positions_in_packed_documents():
    """softcap reads no position, so packed documents pass it to each piece as it is; a subclass that adds a bias
    per key inherits that attribute but not the promise: it is moved like any other score_mod (reviewer's finding:
    it saw each piece's own positions, 1.26 off)."""

    table = torch.randn(300, dtype=torch.float64)

    class KeyBias(mods.softcap):
        def __call__(self, score, b, h, q_idx, kv_idx):
            return super().__call__(score, b, h, q_idx, kv_idx) + table[kv_idx]

    ids = torch.repeat_interleave(torch.arange(2), torch.tensor([100, 200]))[None]  # (1, 300)
    q, k, v = (torch.randn(1, 2, 300, 8, dtype=torch.float64) for _ in range(3))
    same_document = lambda b, h, i, j: ids[0, i] == ids[0, j]  # noqa: E731  (the same mask, not split)
    for backend in ("reference", "tiles:online"):
        split = attnkit.scaled_dot_product_attention(
            q, k, v, is_causal=True, mask_mod=mods.document(ids), score_mod=KeyBias(5.0), backend=backend
        ).output
        whole = attnkit.scaled_dot_product_attention(
            q, k, v, is_causal=True, mask_mod=same_document, score_mod=KeyBias(5.0), backend=backend
        ).output
        assert (split - whole).abs().max() <= 1e-12, backend
