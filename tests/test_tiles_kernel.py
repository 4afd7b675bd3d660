"""The kernel backend (attnkit's own C++ kernel, float32) against the float64 math of tests/mathref.py: outputs and
every gradient (q, k, v, sinks), at sizes that make several blocks of queries (256) and spans of keys (512) with
ragged ends; NaN where no query may see; infinite keys and values; empty shapes; a kernel that cannot be built;
what ``auto`` picks.

The kernel runs float32 only: its results are held to the float32 accuracy it declares (``SUPPORTS.accuracy``:
outputs within 1e-5, gradients within 3e-5 of the largest), the float64 math computed from the same float32 values."""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

import attnkit
import mathref
from agreement import bounds
from attnkit import csrc, dispatch, mods
from attnkit.backends.tiles import kernel
from attnkit.masks import Mask
from mathref import max_err

# B batch, H heads, Hkv key/value heads, Lq/Lk query/key length, D head dim, Dv value head dim

B, H, HKV, D, DV = 2, 4, 2, 8, 5
OUT_TOL, GRAD_TOL = bounds("tiles:kernel", torch.float32)
CAP = 2.0  # a small cap, so that the cap bends most scores

pytestmark = pytest.mark.skipif(csrc.ensure("flash") is not None, reason="the C++ kernel cannot be built here")


def _inputs(seed: int, Lq: int, Lk: int, b: int = B) -> list[torch.Tensor]:
    """float32 q, k, v as float64 leaves (the math's inputs; attnkit's call takes them cast to float32)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, H, Lq, D, generator=g) * 2
    k, v = torch.randn(b, HKV, Lk, D, generator=g), torch.randn(b, HKV, Lk, DV, generator=g)
    return [t.double().requires_grad_() for t in (q, k, v)]


def _flash(leaves: list[torch.Tensor], backend: str = "tiles:kernel", **kw) -> torch.Tensor:
    """attnkit's call on float32 copies of the leaves (and float32 sinks), its output as float64: autograd carries
    the gradients back to the float64 leaves through the casts, which are exact."""
    q, k, v = (t.float() for t in leaves[:3])
    if "sinks" in kw:
        kw = {**kw, "sinks": kw["sinks"].float()}
    out = attnkit.scaled_dot_product_attention(q, k, v, backend=backend, **kw).output
    assert out.dtype == torch.float32
    return out.double()


def _agree(ours: dict, math: dict, leaves: list[torch.Tensor], names: list[str], *, peer: bool = False) -> None:
    """Outputs and gradients within OUT_TOL and GRAD_TOL of the math's; with ``peer``, within twice chunked's own
    error on the same float32 inputs beyond that (ALiBi: float32 rounds a far key's score of -190 to 1.5e-5, in
    every backend, and the slopes take the sum over pairs of each score's gradient times its distance, up to 6e-4
    off at 255 queries where the true gradient is 0)."""
    q, k, v = leaves[:3]
    out = _flash(leaves, **ours)
    want, _ = mathref.attention_mods(q, k, v, **math)
    dout = torch.randn_like(out)
    got, expected = torch.autograd.grad(out, leaves, dout), torch.autograd.grad(want, leaves, dout)
    out_tol, grad_tols = OUT_TOL, [GRAD_TOL * max(1.0, b.abs().max().item()) for b in expected]
    if peer:
        theirs = _flash(leaves, backend="tiles:online", **ours)
        out_tol += 2 * max_err(theirs, want)
        peer = torch.autograd.grad(theirs, leaves, dout)
        grad_tols = [t + 2 * max_err(a, b) for t, a, b in zip(grad_tols, peer, expected, strict=True)]
    assert max_err(out, want) <= out_tol
    for name, a, b, tol in zip(names, got, expected, grad_tols, strict=True):
        assert max_err(a, b) <= tol, name


@hypothesis_settings(max_examples=60, deadline=None)
@given(
    case=st.fixed_dictionaries(
        {
            "Lq": st.sampled_from([1, 9, 255, 257, 300, 530]),
            "Lk": st.sampled_from([1, 9, 256, 300, 513, 700]),
            "score": st.sampled_from(["none", "softcap", "table", "buckets", "alibi"]),
            "mask": st.sampled_from(
                ["none", "causal", "window", "user stripes", "valid_lens", "float mask", "bool mask", "band"]
            ),
            "sinks": st.booleans(),
            "seed": st.integers(0, 2**16),
        }
    )
)
def test_flash_equals_the_math_outputs_and_gradients(case):
    Lq, Lk = case["Lq"], case["Lk"]
    leaves = _inputs(case["seed"], Lq, Lk)
    names = ["q", "k", "v"]
    g = torch.Generator().manual_seed(case["seed"])
    ours: dict = {}
    math: dict = {}
    if case["score"] == "softcap":
        ours["score_mod"], math["score_mod"] = mods.softcap(CAP), mathref.softcap(CAP)
    elif case["score"] in ("table", "buckets"):  # a learned bias on q_idx - kv_idx: the kernel's distance bias
        table = (torch.randn(H, Lq + Lk - 1, generator=g) * 2).double().requires_grad_()
        ours["score_mod"], math["score_mod"] = _table_mod(table.float(), Lk, case), _table_mod(table, Lk, case)
        leaves.append(table)
        names.append("table")
    elif case["score"] == "alibi":
        slopes = torch.rand(H, generator=g).double().requires_grad_()
        ours["score_mod"], math["score_mod"] = mods.alibi(slopes.float()), mathref.alibi(slopes, Lq, Lk)
        leaves.append(slopes)
        names.append("slopes")
    if case["mask"] == "causal":
        ours["is_causal"] = math["is_causal"] = True
    elif case["mask"] == "window":
        ours["mask_mod"], math["mask_mod"] = mods.sliding_window(40), mathref.sliding_window(40, Lq, Lk)
    elif case["mask"] == "user stripes":
        ours["mask_mod"] = math["mask_mod"] = lambda b, h, i, j: (j // 3) % 2 == 0
    elif case["mask"] == "valid_lens":
        ours["valid_lens"] = math["valid_lens"] = torch.randint(0, Lk + 1, (B,), generator=g)
    elif case["mask"] == "float mask":
        ours["attn_mask"] = torch.randn(B, 1, Lq, Lk, generator=g)
        math["attn_mask"] = ours["attn_mask"].double()
    elif case["mask"] == "bool mask":
        ours["attn_mask"] = math["attn_mask"] = torch.rand(B, H, Lq, Lk, generator=g) < 0.7
    elif case["mask"] == "band":  # each 64 rows a kernel computes together see a narrow band, or nothing at all
        i, j = torch.arange(Lq)[:, None], torch.arange(Lk)[None]
        ours["attn_mask"] = math["attn_mask"] = ((i - j).abs() < 30) & (i // 64 % 3 != 1)
    if case["sinks"]:
        ours["sinks"] = math["sinks"] = torch.randn(H, generator=g).double().requires_grad_()
        leaves.append(ours["sinks"])
        names.append("sinks")
    _agree(ours, math, leaves, names, peer=case["score"] == "alibi")


def _table_mod(table: torch.Tensor, Lk: int, case: dict):
    """A caller's score_mod on the distance: ``table[h, q_idx - kv_idx + Lk - 1]``, or T5-like buckets of it."""
    if case["score"] == "table":
        return lambda score, b, h, q_idx, kv_idx: score + table[h, q_idx - kv_idx + Lk - 1]
    return lambda score, b, h, q_idx, kv_idx: score + table[h, ((q_idx - kv_idx).abs() // 7).clamp(max=20)] * 0.5


def test_nan_where_no_query_may_see_reaches_nothing():
    """NaN in the keys and values past each example's length, over several blocks and spans: outputs and gradients
    are those of the call with zeros there, bit for bit."""
    Lq = Lk = 600
    q, k, v = (t.detach().float() for t in _inputs(7, Lq, Lk))
    lens = torch.tensor([600, 345])

    def run(k, v):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attnkit.scaled_dot_product_attention(
            *leaves, valid_lens=lens, is_causal=True, score_mod=mods.softcap(CAP), backend="tiles:kernel"
        ).output
        out.backward(torch.ones_like(out))
        return [out.detach()] + [t.grad for t in leaves]

    unseen = [(1, slice(None), slice(345, None))]
    mathref.assert_unseen_nan_reaches_nothing(run, k, v, unseen, ["out", "dq", "dk", "dv"], tol=0.0)


def test_an_infinite_key_or_value_reaches_only_the_rows_that_may_see_it():
    """inf in a value and in a key that causal rows of the same block and span may not see (rows before them): those
    rows stay finite and equal the math's, forward and backward (0 * inf would be NaN in their products)."""
    Lq = Lk = 300
    q, k, v = (t.detach().float() for t in _inputs(3, Lq, Lk, b=1))
    v[:, :, 280] = float("inf")
    k[:, :, 290] = float("inf")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attnkit.scaled_dot_product_attention(*leaves, is_causal=True, backend="tiles:kernel").output
    clean = [t.clone().double().requires_grad_() for t in (q, k, v)]
    clean[2].detach()[:, :, 280] = 0.0  # the math of the rows before 280, which never see key 280 nor 290
    clean[1].detach()[:, :, 290] = 0.0
    want, _ = mathref.attention_mods(*clean, is_causal=True)
    assert max_err(out[:, :, :280].double(), want[:, :, :280]) <= OUT_TOL
    assert out[:, :, 280:].isnan().any()  # (rows that see inf: inf - inf, as the math's)
    dout = torch.zeros_like(out)
    dout[:, :, :280] = torch.randn(1, H, 280, DV)
    got = torch.autograd.grad(out, leaves[:1], dout)[0]  # dq of the rows before 280: finite, the math's
    expected = torch.autograd.grad(want, clean[:1], dout.double())[0]
    assert max_err(got[:, :, :280].double(), expected[:, :, :280]) <= GRAD_TOL * max(1.0, expected.abs().max().item())


@pytest.mark.parametrize(("b", "Lq", "Lk"), [(0, 5, 5), (2, 0, 5), (2, 5, 4)])
def test_empty_shapes_give_empty_or_zero_results(b, Lq, Lk):
    """No example, no query, or rows that see no key (valid_lens of 0: zeros, with a sink too), forward and
    backward."""
    q, k, v = (t.detach().float().requires_grad_() for t in _inputs(1, Lq, Lk, b=b))
    sinks = torch.zeros(H, requires_grad=True)
    for kw in ({}, {"sinks": sinks}):
        lens = torch.zeros(b, dtype=torch.long)
        out = attnkit.scaled_dot_product_attention(
            q, k, v, valid_lens=lens, score_mod=mods.softcap(CAP), backend="tiles:kernel", **kw
        )
        assert out.output.shape == (b, H, Lq, DV) and not out.output.any()
        out.output.sum().backward()
        assert all(t.grad is not None and not t.grad.any() for t in (q, k, v))


def test_auto_picks_flash_for_softcap_in_float32_only():
    """softcap in float32 over a block of queries: flash; in float64, or a decode step's few queries: not."""
    q, k, v = (t.detach() for t in _inputs(2, 64, 64))
    for dtype, Lq, expected in ((torch.float32, 64, True), (torch.float64, 64, False), (torch.float32, 1, False)):
        with dispatch.watch(implementations=True) as ran, torch.no_grad():
            attnkit.scaled_dot_product_attention(
                q[:, :, :Lq].to(dtype), k.to(dtype), v.to(dtype), score_mod=mods.softcap(CAP)
            )
        assert (ran == ["tiles:kernel"]) == expected, (dtype, Lq, ran)


def test_a_second_derivative_is_refused():
    leaves = [t.detach().float().requires_grad_() for t in _inputs(4, 20, 20)]
    out = attnkit.scaled_dot_product_attention(*leaves, score_mod=mods.softcap(CAP), backend="tiles:kernel").output
    with pytest.raises(RuntimeError, match="kernel backend's backward cannot be differentiated again"):
        torch.autograd.grad(out.sum(), leaves[0], create_graph=True)


def test_a_kernel_that_cannot_be_built_says_so_once_and_auto_goes_elsewhere(monkeypatch):
    """The loader raising (no compiler): one RuntimeWarning naming the error; ``auto`` runs softcap on another
    engine with the math's result, and ``backend='tiles:kernel'`` is refused saying why. ATTNKIT_FLASH_KERNEL=0: no
    build tried, no warning."""
    from torch.utils import cpp_extension

    def fail(*args, **kwargs):
        raise RuntimeError("no compiler here\nmore lines")

    monkeypatch.delenv("ATTNKIT_FLASH_KERNEL", raising=False)
    monkeypatch.setattr(csrc, "_LOADED", {})
    monkeypatch.setattr(cpp_extension, "load", fail)
    leaves = _inputs(6, 40, 40)
    q, k, v = (t.detach().float() for t in leaves)
    want, _ = mathref.attention_mods(*(t.detach() for t in leaves), score_mod=mathref.softcap(CAP))
    with pytest.warns(RuntimeWarning, match="could not be built .RuntimeError: no compiler here.") as caught:
        with dispatch.watch(implementations=True) as ran:
            out = attnkit.scaled_dot_product_attention(q, k, v, score_mod=mods.softcap(CAP)).output
        attnkit.scaled_dot_product_attention(q, k, v, score_mod=mods.softcap(CAP))
    assert len([w for w in caught if "could not be built" in str(w.message)]) == 1
    assert ran and ran != ["tiles:kernel"] and max_err(out.double(), want) <= OUT_TOL
    with pytest.raises(ValueError, match="build failed: RuntimeError: no compiler here"):
        attnkit.scaled_dot_product_attention(q, k, v, score_mod=mods.softcap(CAP), backend="tiles:kernel")
    monkeypatch.setattr(csrc, "_LOADED", {})
    monkeypatch.setenv("ATTNKIT_FLASH_KERNEL", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert "ATTNKIT_FLASH_KERNEL" in (csrc.ensure("flash") or "")
        with dispatch.watch(implementations=True) as ran:
            attnkit.scaled_dot_product_attention(q, k, v, score_mod=mods.softcap(CAP))
    assert ran != ["tiles:kernel"] and csrc._LOADED == {}


def test_a_subclass_of_softcap_or_a_cap_float32_cannot_hold_is_not_run_as_softcap():
    """The kernel reads only ``cap``: a subclass that computes something else, or a cap below float32's normal
    numbers (0, or an infinite reciprocal, in float32), is refused by name and not picked by ``auto``."""

    class Halved(mods.softcap):
        def __call__(self, score, b, h, q_idx, kv_idx):
            return super().__call__(score, b, h, q_idx, kv_idx) * 0.5

    leaves = _inputs(8, 30, 30)
    q, k, v = (t.detach().float() for t in leaves)
    for score_mod in (Halved(CAP), mods.softcap(1e-46)):
        with pytest.raises(ValueError, match="attnkit.mods.softcap itself"):
            attnkit.scaled_dot_product_attention(q, k, v, score_mod=score_mod, backend="tiles:kernel")
        with dispatch.watch(implementations=True) as ran:
            out = attnkit.scaled_dot_product_attention(q, k, v, score_mod=score_mod).output
        want = attnkit.scaled_dot_product_attention(q, k, v, score_mod=score_mod, backend="reference").output
        assert ran != ["tiles:kernel"] and max_err(out, want) <= OUT_TOL


def test_a_query_that_holds_nan_puts_nan_only_in_the_gradients_of_keys_it_may_see():
    """Row 5 (causal) holds NaN and its output gradient is 0: dv stays finite past key 5, as the reference's (its
    weights on hidden keys are 0 exactly, not exp(-inf - NaN))."""
    q, k, v = (t.detach().float() for t in _inputs(9, 300, 300, b=1))
    q[:, 0, 5, 0] = float("nan")
    grads = {}
    for backend in ("tiles:kernel", "reference"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = attnkit.scaled_dot_product_attention(*leaves, is_causal=True, backend=backend).output
        dout = torch.ones_like(out)
        dout[:, :, 5] = 0.0
        out.backward(dout)
        grads[backend] = leaves[2].grad
    for backend, dv in grads.items():
        assert torch.isfinite(dv[:, :, 6:]).all(), backend


def test_auto_picks_flash_for_a_bias_on_the_distance_from_its_size(monkeypatch):
    """A caller's table on q_idx - kv_idx, and ALiBi, from DISTANCE_FROM scores on: flash. A function that is not a
    bias on the distance: not. A smaller call: not, and its function is not traced at all."""
    L = 1024  # B H L L = 2^23 scores, over DISTANCE_FROM
    assert B * H * L * L >= dispatch.DISTANCE_FROM > B * H * 64 * 64
    q, k, v = (t.detach().float() for t in _inputs(11, L, L))
    table = torch.randn(2 * L - 1)
    cases = {
        "table": (lambda s, b, h, q_idx, kv_idx: s + table[q_idx - kv_idx + L - 1], True),
        "alibi": (mods.alibi(mods.alibi_slopes(H)), True),
        "not on the distance": (lambda s, b, h, q_idx, kv_idx: s + table[kv_idx], False),
    }
    for name, (score_mod, expected) in cases.items():
        with dispatch.watch(implementations=True) as ran, torch.no_grad():
            attnkit.scaled_dot_product_attention(q, k, v, score_mod=score_mod, is_causal=True)
        assert (ran == ["tiles:kernel"]) == expected, (name, ran)
    traced = []
    monkeypatch.setattr(mods, "is_distance_bias", lambda fn: traced.append(fn) or True)
    with dispatch.watch(implementations=True) as ran, torch.no_grad():
        attnkit.scaled_dot_product_attention(
            q[..., :64, :], k[..., :64, :], v[..., :64, :], score_mod=cases["table"][0]
        )
    assert ran != ["tiles:kernel"] and traced == []


def test_nan_in_a_distance_bias_no_query_may_see_reaches_nothing():
    """A causal call whose table holds NaN at every negative distance (keys after the query), over several blocks
    and spans: outputs and every gradient equal those with zeros there bit for bit, and those entries get 0."""
    L = 600
    q, k, v = (t.detach().float() for t in _inputs(12, L, L))
    clean = torch.randn(2 * L - 1)
    poisoned = clean.clone()
    poisoned[: L - 1] = float("nan")  # table[d + L - 1] for d = q_idx - kv_idx < 0

    def run(values):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, values)]
        table = leaves[3]
        out = attnkit.scaled_dot_product_attention(
            *leaves[:3],
            is_causal=True,
            score_mod=lambda s, b, h, q_idx, kv_idx: s + table[q_idx - kv_idx + L - 1],
            backend="tiles:kernel",
        ).output
        out.backward(torch.ones_like(out))
        return [out.detach()] + [t.grad for t in leaves]

    got, want = run(poisoned), run(clean)
    for name, a, b in zip(["out", "dq", "dk", "dv", "dtable"], got, want, strict=True):
        assert torch.equal(a, b), name
    assert torch.equal(got[4][: L - 1], torch.zeros(L - 1))


@pytest.mark.parametrize("name", ["softcap", "table"])
def test_packed_documents_keep_softcap_and_a_distance_bias_on_flash(name):
    """Packed documents (mods.document, causal) with softcap, or with a caller's table on q_idx - kv_idx, run on
    kernel (the pieces' score_mod: softcap unchanged, the table moved to each piece's positions), equal the float64
    reference; NaN in one document changes nothing in the others, bit for bit."""
    lengths = [300, 5, 420, 299]
    L = sum(lengths)
    ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[None]  # (1, L)
    q, k, v = (t.detach().float()[:1] for t in _inputs(13, L, L))
    table = torch.randn(H, 2 * L - 1)

    def run(q, k, v, backend="auto"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v, table.to(q.dtype))]
        t = leaves[3]
        score_mod = mods.softcap(CAP) if name == "softcap" else lambda s, b, h, i, j: s + t[h, i - j + L - 1]
        out = attnkit.scaled_dot_product_attention(
            *leaves[:3], is_causal=True, mask_mod=mods.document(ids), score_mod=score_mod, backend=backend
        ).output
        out.backward(torch.ones_like(out))
        return [out.detach()] + [t.grad for t in leaves]

    with dispatch.watch(implementations=True) as ran:
        got = run(q, k, v)
    assert ran == ["tiles:kernel", "tiles:online", "tiles:kernel", "tiles:kernel"], (
        ran
    )  # (5 queries: a decode step's few)
    want = run(q.double(), k.double(), v.double(), backend="reference")
    names = ["out", "dq", "dk", "dv", "dtable"][: 5 if name == "table" else 4]
    for what, a, b in zip(names, got, want, strict=False):
        assert max_err(a.double(), b) <= GRAD_TOL * max(1.0, b.abs().max().item()), what
    third = slice(305, 725)  # document 2
    poisoned = [t.clone() for t in (q, k, v)]
    for t in poisoned:
        t[:, :, third] = float("nan")
    bad = run(*poisoned)
    keep = torch.ones(L, dtype=torch.bool)
    keep[third] = False
    for what, a, b in zip(["out", "dq", "dk", "dv"], bad, got, strict=False):
        assert torch.equal(a[:, :, keep], b[:, :, keep]), what  # (the shared table takes document 2's NaN too)


def test_a_cap_beyond_float32_is_refused():
    """float32 rounds it to inf, and inf * tanh(score / inf) is NaN for every score."""
    with pytest.raises(ValueError, match="cap must be at most 3.4028234663852886e.38"):
        mods.softcap(1e39)
    assert mods.softcap(3e38).cap == 3e38


def test_tiny_values_keep_float32_precision():
    """Values of 1e-34 (outputs far above float32's smallest normal number, 1.2e-38): within float32's error of the
    math, relative to their size (flushing subnormal products to zero, as the kernel once did, lost 3.6e-4 here:
    tester's finding)."""
    leaves = _inputs(14, 300, 300)
    q, k, v = (t.detach() for t in leaves)
    v = v * 1e-34
    out = attnkit.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), is_causal=True, backend="tiles:kernel"
    ).output
    want, _ = mathref.attention_mods(q, k, v.float().double(), is_causal=True)
    assert max_err(out.double() / 1e-34, want / 1e-34) <= OUT_TOL


def test_the_masks_kept_for_the_backward_stay_within_their_budget(monkeypatch):
    """A mask of new tensors larger than KEEP_BYTES (here made small) is made again in the backward, a block at a
    time, so that memory stays linear in L (reviewer's finding: every block's tiles were kept, H L^2 bytes); the
    results are the same either way."""
    Lq = Lk = 600
    leaves = [t.detach().float() for t in _inputs(15, Lq, Lk)]
    mask_mod = lambda b, h, i, j: (i + j + h) % 5 != 0  # noqa: E731  (new tiles per block: reads h and both positions)

    def run():
        xs = [t.clone().requires_grad_() for t in leaves]
        out = attnkit.scaled_dot_product_attention(*xs, mask_mod=mask_mod, backend="tiles:kernel").output
        out.backward(torch.ones_like(out))
        return [out.detach()] + [t.grad for t in xs]

    made = []
    spans = kernel._spans
    monkeypatch.setattr(kernel, "_spans", lambda mask, rows: made.append(rows.r0) or spans(mask, rows))
    kept = run()
    assert made == [0, 256, 512]  # the forward's only
    made.clear()
    monkeypatch.setattr(kernel, "KEEP_BYTES", 1024)
    again = run()
    assert made == [0, 256, 512] * 2  # the backward's too
    for a, b in zip(kept, again, strict=True):
        assert torch.equal(a, b)


def test_a_kept_plans_masks_are_made_once_for_the_calls_after(monkeypatch):
    """A mask that is a function of the indices alone (a built-in window) keeps its tiles' masks with its plan, on
    the mask_mod the caller holds: the next call with it (the next layer, the next step) makes none, and gives the
    same results, bit for bit. A new mask_mod object plans anew: nothing is kept anywhere else."""
    leaves = [t.detach().float() for t in _inputs(16, 700, 700)]
    made = []
    tile = Mask.tile
    monkeypatch.setattr(Mask, "tile", lambda self, *a, **kw: made.append(a[:4]) or tile(self, *a, **kw))
    window = mods.sliding_window(77, offset=3)

    def run(mask_mod):
        xs = [t.clone().requires_grad_() for t in leaves]
        out = attnkit.scaled_dot_product_attention(*xs, mask_mod=mask_mod, backend="tiles:kernel")
        out.output.backward(torch.ones_like(out.output))
        return [out.output.detach()] + [t.grad for t in xs]

    first = run(window)
    assert made  # the window's edges
    made.clear()
    again = run(window)
    assert not [m for m in made if m[3] - m[2] < 700]  # no masked tile made again (a full one returns None at once)
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a, b)
    run(mods.sliding_window(77, offset=3))
    assert [m for m in made if m[3] - m[2] < 700]


def _stripes(b, h, i, j):  # new tiles per block: reads h and both positions
    return (i + j + h) % 5 != 0


def test_the_forward_holds_at_most_two_groups_of_masks_at_once(monkeypatch):
    """A mask of new tensors run in several groups: the forward lets each group's masks go once the next one runs
    (reviewer's finding: every group was held to the end, the H L^2 bytes the groups exist to avoid)."""
    monkeypatch.setattr(kernel, "KEEP_BYTES", 4 * 300 * 256)  # one block of 256 rows a group
    alive, most = [], [0]
    spans = kernel._spans

    def spy(mask, rows):
        gc.collect()
        most[0] = max(most[0], sum(r() is not None for r in alive))
        found, allowed, bias = spans(mask, rows)
        alive.extend(weakref.ref(a) for a in allowed if a is not None)
        return found, allowed, bias

    monkeypatch.setattr(kernel, "_spans", spy)
    q, k, v = (torch.randn(1, 4, 2000, 8).requires_grad_() for _ in range(3))
    attnkit.scaled_dot_product_attention(q, k, v, mask_mod=_stripes, backend="tiles:kernel")
    per_block = len(alive) // 8  # 8 blocks of queries
    assert 0 < most[0] <= 2 * per_block, (most[0], len(alive))


def test_the_masks_kept_for_the_backward_never_pass_keep_bytes(monkeypatch):
    """One group whose masks pass KEEP_BYTES (a single block larger than it, or its last block over it) is made
    again in the backward (reviewer's finding: one group was kept whatever its size)."""
    monkeypatch.setattr(kernel, "KEEP_BYTES", 700_000)  # block 0: 614,400 bytes; both: 720,000
    made = []
    spans = kernel._spans
    monkeypatch.setattr(kernel, "_spans", lambda mask, rows: made.append(rows.r0) or spans(mask, rows))
    for Lq, expected in ((300, [0, 256] * 2), (200, [0])):
        made.clear()
        q, k, v = (torch.randn(1, 4, L, 8).requires_grad_() for L in (Lq, 600, 600))
        out = attnkit.scaled_dot_product_attention(q, k, v, mask_mod=_stripes, backend="tiles:kernel").output
        out.sum().backward()
        assert made == expected, Lq
    monkeypatch.setattr(kernel, "KEEP_BYTES", 400_000)  # one block of 200 x 600 x 4 heads: over
    made.clear()
    q, k, v = (torch.randn(1, 4, L, 8).requires_grad_() for L in (200, 600, 600))
    attnkit.scaled_dot_product_attention(q, k, v, mask_mod=_stripes, backend="tiles:kernel").output.sum().backward()
    assert made == [0, 0]


# bfloat16 inputs: the kernel's products run on the CPU's bfloat16 dot products where it has them (bf16.h), float32
# sums, the softmax in float32; held to twice the error of the same math computed in bfloat16 (FlashAttention's rule,
# SUPPORTS.accuracy.low_precision), plus the float32 bounds.
BF16 = kernel.bf16_products()
needs_bf16 = pytest.mark.skipif(not BF16, reason="no AVX512-BF16 on this CPU: the kernel computes bfloat16 in float32")


BF16_MASKS = ["none", "causal", "window", "user stripes", "valid_lens", "bool mask", "band"]


@needs_bf16
@pytest.mark.parametrize("mask", BF16_MASKS)
@pytest.mark.parametrize(
    "shape",  # (Lq, Lk, D, score_mod, sinks): every mask at odd lengths and both head dims, softcap and sinks
    [(300, 513, 7, "softcap", True), (255, 257, 8, "none", False), (9, 1, 7, "none", True)],
    ids=["300x513 D7 softcap sinks", "255x257 D8", "9x1 D7 sinks"],
)
def test_bfloat16_products_stay_within_twice_the_error_of_the_math_in_bfloat16(mask, shape):
    """Odd lengths, head dims and window edges put pieces of tiles at odd keys and rows, whose pairs the products
    pad (bf16.h): outputs and the gradients of q, k, v and sinks against float64 math from the same values."""
    Lq, Lk, Dh, score, sinks = shape
    case = {"score": score, "mask": mask, "sinks": sinks}
    g = torch.Generator().manual_seed(Lq + Lk + Dh)
    values = [
        torch.randn(B, H, Lq, Dh, generator=g) * 2,
        torch.randn(B, HKV, Lk, Dh, generator=g),
        torch.randn(B, HKV, Lk, DV, generator=g),
    ]
    kw: dict = {}
    math: dict = {}
    if case["score"] == "softcap":
        kw["score_mod"], math["score_mod"] = mods.softcap(CAP), mathref.softcap(CAP)
    if case["mask"] == "causal":
        kw["is_causal"] = True
    elif case["mask"] == "window":
        kw["mask_mod"], math["mask_mod"] = mods.sliding_window(40), mathref.sliding_window(40, Lq, Lk)
    elif case["mask"] == "user stripes":
        kw["mask_mod"] = math["mask_mod"] = lambda b, h, i, j: (j // 3) % 2 == 0
    elif case["mask"] == "valid_lens":
        kw["valid_lens"] = torch.randint(0, Lk + 1, (B,), generator=g)
    elif case["mask"] == "bool mask":
        kw["attn_mask"] = torch.rand(B, H, Lq, Lk, generator=g) < 0.7
    elif case["mask"] == "band":
        i, j = torch.arange(Lq)[:, None], torch.arange(Lk)[None]
        kw["attn_mask"] = ((i - j).abs() < 30) & (i // 64 % 3 != 1)
    math.update({name: kw[name] for name in ("is_causal", "valid_lens", "attn_mask") if name in kw})
    if case["sinks"]:
        values.append(torch.randn(H, generator=g))
    values = [t.bfloat16() for t in values]  # the inputs: bfloat16 values, exact in every dtype below
    dout = torch.randn(B, H, Lq, DV, generator=g).bfloat16()

    def run(dtype: torch.dtype, ours: bool) -> list[torch.Tensor]:
        leaves = [t.to(dtype).requires_grad_() for t in values]
        extra = {"sinks": leaves[3]} if case["sinks"] else {}
        if ours:
            out = attnkit.scaled_dot_product_attention(*leaves[:3], backend="tiles:kernel", **kw, **extra).output
            assert out.dtype == torch.bfloat16
        else:
            out = mathref.attention_mods(*leaves[:3], dtype=dtype, **math, **extra)[0]
        return [out.detach().double(), *(t.double() for t in torch.autograd.grad(out, leaves, dout.to(out.dtype)))]

    ours, truth, low = run(torch.bfloat16, True), run(torch.float64, False), run(torch.bfloat16, False)
    with torch.no_grad():  # without autograd the weights are rounded once (flash.cpp): the same bound
        extra = {"sinks": values[3]} if case["sinks"] else {}
        alone = attnkit.scaled_dot_product_attention(*values[:3], backend="tiles:kernel", **kw, **extra).output
    assert max_err(alone.double(), truth[0]) <= OUT_TOL + 2 * max_err(low[0], truth[0])
    names = ["out", "dq", "dk", "dv", "dsinks"]
    for name, a, want, math_low in zip(names, ours, truth, low, strict=False):
        base = OUT_TOL if name == "out" else GRAD_TOL * max(1.0, want.abs().max().item())
        limit = base + 2 * max_err(math_low, want)
        assert max_err(a, want) <= limit, (name, max_err(a, want), limit)


@needs_bf16
def test_bfloat16_inputs_run_on_bfloat16_products_not_float32():
    """The same values in bfloat16 and in float32 give different results (the weights rounded to bfloat16 for the
    products that read them), both close to the float64 math: the bfloat16 path ran (without it both would be the
    float32 computation, equal once rounded)."""
    q, k, v = (t.detach().float().bfloat16() for t in _inputs(4, 300, 513))
    out = {}
    for dtype in (torch.bfloat16, torch.float32):
        leaves = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        o = attnkit.scaled_dot_product_attention(*leaves, is_causal=True, backend="tiles:kernel").output
        out[dtype] = [o.detach(), *torch.autograd.grad(o, leaves, torch.ones_like(o))]
    assert not torch.equal(out[torch.bfloat16][0], out[torch.float32][0].bfloat16())
    assert not torch.equal(out[torch.bfloat16][2], out[torch.float32][2].bfloat16())  # dk


@needs_bf16
@pytest.mark.parametrize(
    "Lq, Lk, Dh, Dv, score", [(300, 513, 7, 5, "none"), (129, 131, 64, 33, "softcap")], ids=["odd", "D64 Dv33 softcap"]
)
def test_bfloat16_inputs_read_as_they_are_give_the_bits_their_float32_copies_give(monkeypatch, Lq, Lk, Dh, Dv, score):
    """Finite bfloat16 inputs go to the kernel as they are, without float32 copies, and its output comes back in
    bfloat16: the same bits as from float32 copies (the packing rounds those to the same values), output and every
    gradient, at odd lengths and head dims (the packing's pairs, its vectors of 16 columns and their tails), grouped
    heads, sinks, a window and softcap."""
    g = torch.Generator().manual_seed(Lq + Dh)
    q = torch.randn(B, H, Lq, Dh, generator=g).bfloat16()
    k = torch.randn(B, HKV, Lk, Dh, generator=g).bfloat16()
    v = torch.randn(B, HKV, Lk, Dv, generator=g).bfloat16()
    sinks, dout = torch.randn(H, generator=g), torch.randn(B, H, Lq, Dv, generator=g).bfloat16()
    score_mod = mods.softcap(CAP) if score == "softcap" else None
    as_they_are = kernel._as_they_are

    def run(copies: bool) -> tuple[list[torch.Tensor], set[torch.dtype]]:
        monkeypatch.setattr(kernel, "_as_they_are", lambda low, guard: as_they_are(low, guard) and not copies)
        saved: set[torch.dtype] = set()  # the dtypes of what the kernel's Function keeps for its backward

        def pack(t: torch.Tensor) -> torch.Tensor:
            saved.add(t.dtype)
            return t

        leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = attnkit.scaled_dot_product_attention(
                *leaves[:3],
                sinks=leaves[3],
                mask_mod=mods.sliding_window(40),
                score_mod=score_mod,
                backend="tiles:kernel",
            ).output
        return [out.detach(), *torch.autograd.grad(out, leaves, dout)], saved

    (raw, saved_raw), (copied, saved_copies) = run(copies=False), run(copies=True)
    assert torch.bfloat16 in saved_raw and torch.bfloat16 not in saved_copies  # (each arm ran as it says)
    for name, a, b in zip(["out", "dq", "dk", "dv", "dsinks"], raw, copied, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), name


@needs_bf16
def test_a_bfloat16_output_changed_in_place_still_has_its_gradients():
    """The output of bfloat16 inputs, written by the kernel in bfloat16, may be changed in place before the backward
    (``out += residual``), as the other backends allow: the backward of bfloat16 products reads no output (the
    tester's finding: it was saved, and autograd refused)."""
    q, k, v = (t.detach().bfloat16() for t in _inputs(5, 40, 40))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attnkit.scaled_dot_product_attention(*leaves, is_causal=True, backend="tiles:kernel").output
    want = torch.autograd.grad(out, leaves, torch.ones_like(out))
    out = attnkit.scaled_dot_product_attention(*leaves, is_causal=True, backend="tiles:kernel").output
    out += 1.0
    got = torch.autograd.grad(out, leaves, torch.ones_like(out))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_the_kernel_says_it_computes_bfloat16_on_the_cpus_dot_products_where_pytorch_sees_them():
    """The kernel's check (its own, of the CPU) and the dispatcher's (PyTorch's CPU information) agree, so that
    ``auto`` sends bfloat16 calls to the kernel exactly where its products run in bfloat16."""
    assert BF16 == dispatch._bf16_dot_products()


@needs_bf16
def test_float32_parameters_beside_bfloat16_inputs_get_float32_gradients_through_bfloat16_products():
    """ALiBi's slopes and sinks in float32 with bfloat16 q, k, v under a window: their gradients, sums over every
    score of each row's softmax gradient, are as close as float32's (the tester's finding: with the weights of p v
    in one bfloat16 part the backward's rows no longer summed to 0, and the slopes were 5e-3 off, relative)."""
    Lq, Lk = 300, 513
    g = torch.Generator().manual_seed(22)
    q, k, v = (torch.randn(1, 2, L, d, generator=g).bfloat16() for L, d in ((Lq, 8), (Lk, 8), (Lk, 5)))
    params = [torch.rand(2, generator=g) * 0.5, torch.randn(2, generator=g)]  # slopes, sinks (float32)
    dout = torch.randn(1, 2, Lq, 5, generator=g).bfloat16()  # (the same values for the math)

    def grads(ours: bool) -> list[torch.Tensor]:
        slopes, sinks = (
            t.clone().double().requires_grad_() if not ours else t.clone().requires_grad_() for t in params
        )
        if ours:
            out = attnkit.scaled_dot_product_attention(
                q,
                k,
                v,
                score_mod=mods.alibi(slopes),
                sinks=sinks,
                mask_mod=mods.sliding_window(33),
                backend="tiles:kernel",
            ).output
        else:
            out = mathref.attention_mods(
                q.double(),
                k.double(),
                v.double(),
                score_mod=mathref.alibi(slopes, Lq, Lk),
                sinks=sinks,
                mask_mod=mathref.sliding_window(33, Lq, Lk),
            )[0]
        return [t.double() for t in torch.autograd.grad(out, (slopes, sinks), dout.to(out.dtype))]

    for got, want in zip(grads(True), grads(False), strict=True):
        assert max_err(got, want) <= 1e-4 * want.abs().max().item()
