"""What every engine does alike, beyond agreeing with the math (test_agreement.py): rows with no key give exact
zeros with finite gradients; padding, NaN included, never reaches an output; a float mask adds to the scores; causal
is aligned bottom right; weights are those before dropout; a backward that recomputes refuses a second derivative."""

from __future__ import annotations

import pytest
import torch

import attnkit
from agreement import ENGINES_HERE, Run, assert_agrees, bounds, has_autograd, runs_dtype
from attnkit.backends.tiles import online
from cases import make_inputs, make_masking
from mathref import attention as math_attention
from mathref import max_err

# the engines that run here under autograd, eagerly (tiles:compiled compiles per shape: test_tiles_compiled.py)
BACKENDS = tuple(e for e in ENGINES_HERE if has_autograd(e) and e != "tiles:compiled")
OUT_TOL, GRAD_TOL = bounds("reference", torch.float32)  # every engine declares the same float32 bounds (test below)


def _run(backend, q, k, v, kw, grad_out=None, block_size=64):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    with online.settings(block_size=block_size):  # several blocks and a partial last one at Lk=203, 257
        out, _ = attnkit.scaled_dot_product_attention(q, k, v, backend=backend, **kw)
    if grad_out is None:
        return out, None
    grads = torch.autograd.grad(out, (q, k, v), grad_out.to(out.dtype))
    return out, grads


def test_weights_and_output_of_the_reference():
    q, k, v, g = make_inputs(7, 203, 40, 2, seed=11)
    kw = make_masking("valid_lens_1d+causal", 7, 203, g)
    truth, true_w = math_attention(q.double(), k.double(), v.double(), **kw)
    out, w = attnkit.scaled_dot_product_attention(q, k, v, need_weights=True, **kw)
    assert w is not None and w.shape == (2, 8, 7, 203)
    assert max_err(w, true_w) <= OUT_TOL
    assert max_err(out, truth) <= OUT_TOL


@pytest.mark.parametrize(
    ("backend", "dtype"),
    [(e, d) for e in BACKENDS for d in (torch.float32, torch.bfloat16, torch.float16) if runs_dtype(e, d)],
)
@pytest.mark.parametrize("how", ["valid_lens", "causal", "bool_mask", "float_mask"])
def test_fully_masked_rows_are_exactly_zero_and_finite(dtype, backend, how):
    q, k, v, g = make_inputs(5, 3, 8, 2, seed=5, dtype=dtype)
    if how == "valid_lens":
        kw = {"valid_lens": torch.tensor([0, 2])}  # example 0 has no key at all
        dead = torch.zeros(2, 8, 5, dtype=torch.bool)
        dead[0] = True
    elif how == "causal":
        kw = {"is_causal": True}  # Lq=5 > Lk=3: queries 0 and 1 see no key
        dead = torch.zeros(2, 8, 5, dtype=torch.bool)
        dead[:, :, :2] = True
    else:
        allowed = torch.rand(2, 8, 5, 3, generator=g) < 0.7
        allowed[:, :, 1] = False
        allowed[1, 3, 4] = False
        dead = ~allowed.any(-1)
        kw = {"attn_mask": allowed}
        if how == "float_mask":
            kw = {"attn_mask": torch.randn(2, 8, 5, 3, generator=g).masked_fill(~allowed, float("-inf"))}
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    need = backend == "reference"
    out, w = attnkit.scaled_dot_product_attention(*leaves, backend=backend, need_weights=need, **kw)
    out.backward(torch.ones_like(out))
    assert torch.isfinite(out).all()
    assert (out[dead] == 0).all()
    assert (out[~dead] != 0).any()
    if w is not None:
        assert (w[dead] == 0).all() and torch.isfinite(w).all()
    for leaf in leaves:
        assert torch.isfinite(leaf.grad).all()
    assert (leaves[0].grad[dead] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lens_dims", [1, 2])
def test_padding_never_leaks(backend, lens_dims):
    q, k, v, g = make_inputs(7, 203, 40, 2, seed=7)
    if lens_dims == 1:
        lens = torch.tensor([150, 37])
        longest = lens
    else:
        lens = torch.randint(1, 120, (2, 7), generator=g)
        longest = lens.amax(dim=1)
    dirty_k, dirty_v = k.clone(), v.clone()
    for b, n in enumerate(longest.tolist()):
        dirty_k[b, :, n:] = float("nan")
        dirty_v[b, :, n:] = float("nan")
    clean, clean_grads = _run(backend, q, k, v, {"valid_lens": lens}, torch.ones(2, 8, 7, 43))
    dirty, dirty_grads = _run(backend, q, dirty_k, dirty_v, {"valid_lens": lens}, torch.ones(2, 8, 7, 43))
    assert torch.isfinite(dirty).all()
    torch.testing.assert_close(dirty, clean, rtol=0, atol=0)
    for dirty_grad in dirty_grads:
        assert torch.isfinite(dirty_grad).all()
    torch.testing.assert_close(dirty_grads[0], clean_grads[0], rtol=0, atol=0)


SINK_ENGINES = ("reference", "graph", "tiles:online", "tiles:kernel", "tiles:compiled")


def _first_rows_of_example_0_hidden(score, b, h, q_idx, kv_idx):
    return torch.where((b == 0) & (q_idx < 3), float("-inf"), score)


def _three_or_more_back(score, b, h, q_idx, kv_idx):  # a bias on the distance (the C++ kernel takes it): rows 0-2
    return score + torch.where(q_idx - kv_idx < 3, float("-inf"), 0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", [e for e in ENGINES_HERE if has_autograd(e)])
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("emptied_by", ["valid_lens", "score_mod", "distance bias"])
def test_the_output_gradient_of_a_row_that_sees_no_key_reaches_nothing(backend, sinks, dtype, emptied_by):
    """A row with no key is zeros whatever the inputs hold: NaN in its output gradient (``torch.where``'s backward
    through a ``sqrt`` at 0 gives it) reaches no gradient (a tester's finding: dv and dsinks were NaN on reference
    and tiles), and the others are those of a finite gradient there; so too where a score_mod's -inf hides every key
    from the row (a function of the call's indices, or a bias on the distance, which the C++ kernel takes)."""
    if sinks and backend not in SINK_ENGINES:
        pytest.skip(f"{backend} takes no sinks")
    if not runs_dtype(backend, dtype):
        pytest.skip(f"{backend} does not run {dtype}")
    # (2, 8, 6, 16), (2, 4, 40, 16), (2, 4, 40, 19): 12 queries a key/value head, graph's unfused path as well
    q, k, v, g = make_inputs(6, 40, 16, 2, seed=11)
    lens = torch.randint(1, 41, (2, 6), generator=g)
    leaves = [t.to(dtype).detach().requires_grad_() for t in (q, k, v)]
    kw: dict = {"valid_lens": lens}
    dead = (0, slice(None), slice(0, 3))  # queries 0-2 of the first example see no key
    if emptied_by == "valid_lens":
        lens[0, :3] = 0
    elif emptied_by == "score_mod":
        kw["score_mod"] = _first_rows_of_example_0_hidden
    else:
        kw["score_mod"] = _three_or_more_back
        dead = (slice(None), slice(None), slice(0, 3))  # queries 0-2 of each example
    if sinks:
        leaves.append(torch.randn(8, generator=g).requires_grad_())
        kw["sinks"] = leaves[3]
    grad_out = torch.randn(2, 8, 6, v.shape[-1], generator=g).to(dtype)  # (2, 8, 6, Dv)
    dirty = grad_out.clone()
    dirty[dead] = float("nan")
    found = []
    for gout in (grad_out, dirty):
        try:
            out = attnkit.scaled_dot_product_attention(*leaves[:3], backend=backend, **kw).output
        except ValueError as error:
            if emptied_by != "valid_lens" and "cannot run this call" in str(error):
                pytest.skip(f"{backend} takes no such score_mod")
            raise
        found.append(torch.autograd.grad(out, leaves, gout))
    for name, clean, got in zip(["q", "k", "v", "sinks"], *found, strict=False):
        assert torch.isfinite(got).all(), f"d{name} on {backend}"
        torch.testing.assert_close(got, clean, rtol=0, atol=0, msg=f"d{name} on {backend}")


def _huge_or_nan_hidden(score, b, h, q_idx, kv_idx):  # hides by value: a zero query's scores it would not hide, and
    return torch.where(score.isnan() | (score.abs() > 1e4), float("-inf"), score + 200.0)  # exp(200) overflows


@pytest.mark.parametrize("backend", ["auto", *(e for e in ENGINES_HERE if has_autograd(e))])
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("additive", [False, True])
@pytest.mark.parametrize("hides", ["by index", "by value"])
def test_a_nan_query_in_a_row_a_score_mod_leaves_no_key_reaches_nothing(backend, sinks, additive, hides):
    """A row whose every key a score_mod hides is zeros, whatever its query holds: NaN there reaches no gradient
    (as in a row the mask empties, whose query is zeroed), and the gradients are those of a finite query (a
    reviewer's finding: ``0 * NaN`` reached dk through the hidden scores on every engine). By value: the finite
    query is huge (its scores hidden too), and a zero query's scores would be seen: the backward must keep the rows
    the forward found empty hidden whatever their scores are then (a reviewer's mutant passed the index case)."""
    if additive and hides == "by value":
        pytest.skip("additive scores are bounded by w_v: no query's are huge")
    if sinks and (additive or backend not in (*SINK_ENGINES, "auto")):
        pytest.skip(f"{backend} takes no sinks" + (" with additive scores" if additive else ""))
    # (2, 8, 6, 16), (2, 4, 40, 16), (2, 4, 40, 19); additive: (2, 6, 16), (2, 40, 16), (2, 40, 19)
    q, k, v, g = make_inputs(6, 40, 16, 2, seed=13, heads=not additive)
    extra = [torch.randn(16, generator=g)] if additive else [torch.randn(8, generator=g)] if sinks else []
    grad_out = torch.randn(*q.shape[:-1], v.shape[-1], generator=g)  # (2, 8, 6, Dv) or (2, 6, Dv)
    dirty = q.clone()
    dirty[0, ..., :3, :] = float("nan")  # the rows _first_rows_of_example_0_hidden empties
    score_mod = _first_rows_of_example_0_hidden
    if hides == "by value":
        q = q.clone()
        q[0, ..., :3, :] = 1e8  # every score of those rows about 1e8: hidden
        score_mod = _huge_or_nan_hidden
    found = []
    for query in (q, dirty):
        leaves = [t.detach().requires_grad_() for t in (query, k, v, *extra)]
        kw: dict = {"backend": backend, "score_mod": score_mod}
        try:
            if additive:
                out = attnkit.additive_attention(*leaves, **kw).output  # (2, 6, Dv)
            else:
                out = attnkit.scaled_dot_product_attention(*leaves[:3], sinks=leaves[3] if sinks else None, **kw)
                out = out.output  # (2, 8, 6, Dv)
        except ValueError as error:
            if "cannot run this call" in str(error):
                pytest.skip(f"{backend} takes no such call")
            raise
        assert (out[0, ..., :3, :] == 0).all(), backend  # the rows the score_mod empties
        found.append(torch.autograd.grad(out, leaves, grad_out))
    # (additive: the compiled engine picks its form of tanh by the range of the queries, which NaN changes; the
    # same gradients then within float32's rounding)
    tol = {"rtol": 1.3e-6, "atol": 1e-5} if additive else {"rtol": 0, "atol": 0}
    for name, clean, got in zip(["q", "k", "v", "w_v" if additive else "sinks"], *found, strict=False):
        assert torch.isfinite(got).all(), f"d{name} on {backend}"
        torch.testing.assert_close(got, clean, **tol, msg=f"d{name} on {backend}")


@pytest.mark.parametrize("backend", ["auto", *(e for e in ENGINES_HERE if has_autograd(e))])
@pytest.mark.parametrize("sinks", [False, True])
def test_the_output_gradient_of_a_row_whose_scores_overflow_to_minus_infinity_reaches_nothing(backend, sinks):
    """Finite inputs whose products overflow to -inf for every key of one row: the row sees no key (as a mask's -inf
    would hide them) and NaN in its output gradient reaches nothing (a reviewer's finding: reference, sdpa and the
    C++ kernel passed it on)."""
    if sinks and backend not in (*SINK_ENGINES, "auto"):
        pytest.skip(f"{backend} takes no sinks")
    g = torch.Generator().manual_seed(3)
    q, v = torch.randn(1, 2, 6, 4, generator=g), torch.randn(1, 2, 6, 4, generator=g)
    k = torch.randn(1, 2, 6, 4, generator=g).abs() + 0.5
    q[0, 0, 2] = -1e38  # (every score of row 2, head 0: -inf in float32)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    kw = {}
    if sinks:
        leaves.append(torch.zeros(2, requires_grad=True))
        kw["sinks"] = leaves[3]
    grad_out = torch.randn(1, 2, 6, 4, generator=g)
    dirty = grad_out.clone()
    dirty[0, 0, 2] = float("nan")
    found = []
    for gout in (grad_out, dirty):
        out = attnkit.scaled_dot_product_attention(*leaves[:3], backend=backend, **kw).output
        assert (out[0, 0, 2] == 0).all(), backend
        found.append(torch.autograd.grad(out, leaves, gout))
    for name, clean, got in zip(["q", "k", "v", "sinks"], *found, strict=False):
        assert torch.isfinite(got).all(), f"d{name} on {backend}"
        torch.testing.assert_close(got, clean, rtol=0, atol=0, msg=f"d{name} on {backend}")


FAR_BELOW = -(2.0**100)  # about -1.3e30, the same number in float32 and float64


def _far_below(score, b, h, q_idx, kv_idx):  # every score about -1.3e30: a row's log-sum-exp less its largest score
    return score * 1e-3 + FAR_BELOW  # is lost in a float32 sum (max + log l), but not in its weights


def _far_below_by_distance(score, b, h, q_idx, kv_idx):  # a bias on the distance (the C++ kernel takes it)
    return score + (FAR_BELOW + (q_idx - kv_idx) * 1e-3)


@pytest.mark.parametrize("backend", ["auto", *(e for e in ENGINES_HERE if has_autograd(e))])
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("score_mod", [_far_below, _far_below_by_distance], ids=["scaled", "by distance"])
def test_gradients_when_every_score_of_a_row_is_far_below_zero(backend, sinks, score_mod):
    """A score_mod that shifts every score to about -1.3e30: softmax is as without the shift, and so is each gradient
    (a reviewer's finding: the online softmax's backward made its weights from ``m + log l`` in float32, which rounds
    to ``m``, and gave gradients 23 times too large)."""
    if sinks and backend not in (*SINK_ENGINES, "auto"):
        pytest.skip(f"{backend} takes no sinks")
    q, k, v, g = make_inputs(6, 40, 16, 2, seed=12)
    leaves = [q, k, v] + ([torch.randn(8, generator=g) * 1e-3 + FAR_BELOW] if sinks else [])  # sinks far below too
    names = ["q", "k", "v", "sinks"][: len(leaves)]
    grad_out = torch.randn(2, 8, 6, v.shape[-1], generator=g)  # (2, 8, 6, Dv)

    def ran(engine: str, dtype: torch.dtype) -> Run:
        typed = [t.to(dtype).detach().requires_grad_() for t in leaves]
        extra = {"sinks": typed[3]} if sinks else {}
        try:
            out = attnkit.scaled_dot_product_attention(
                *typed[:3], score_mod=score_mod, backend=engine, **extra
            ).output  # (2, 8, 6, Dv)
        except ValueError as error:
            if "cannot run this call" in str(error):
                pytest.skip(f"{engine} takes no such score_mod")
            raise
        return Run(out, None, torch.autograd.grad(out, typed, grad_out.to(dtype)), tuple(names))

    truth, ours = ran("reference", torch.float64), ran(backend, torch.float32)
    # (auto: held to the reference's bounds, which every engine declares for float32)
    assert_agrees("reference" if backend == "auto" else backend, ours, truth, torch.float32, "scores at -1.3e30")


def test_padding_never_leaks_into_additive_attention():
    q, k, v, g = make_inputs(7, 203, 16, 1, seed=8, heads=False)
    w_v = torch.randn(16, generator=g)
    lens = torch.tensor([150, 37])
    dirty_k, dirty_v = k.clone(), v.clone()
    dirty_k[1, 37:] = float("nan")
    dirty_v[1, 37:] = float("inf")
    for backend in ("reference", "tiles:online"):
        clean = attnkit.additive_attention(q, k, v, w_v, valid_lens=lens, backend=backend).output
        dirty = attnkit.additive_attention(q, dirty_k, dirty_v, w_v, valid_lens=lens, backend=backend).output
        torch.testing.assert_close(dirty, clean, rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_float_mask_adds_to_the_scores(backend):
    q, k, v, g = make_inputs(7, 9, 8, 1, seed=9)
    alibi = -torch.arange(9.0).abs().expand(7, 9)  # (Lq, Lk), broadcast over batch and heads
    truth, _ = math_attention(q.double(), k.double(), v.double(), attn_mask=alibi)
    out, _ = _run(backend, q, k, v, {"attn_mask": alibi})
    assert max_err(out, truth) <= OUT_TOL


def test_causal_is_aligned_bottom_right_for_decoding():
    """One new query against a cache of keys sees the whole cache."""
    q, k, v, _ = make_inputs(1, 203, 8, 1, seed=10)
    for backend in BACKENDS:
        causal, _ = _run(backend, q, k, v, {"is_causal": True})
        plain, _ = _run(backend, q, k, v, {})
        torch.testing.assert_close(causal, plain)


def test_dropout_weights_are_before_dropout():
    q, k, v, _ = make_inputs(7, 9, 8, 1, seed=12)
    torch.manual_seed(0)
    out, w = attnkit.scaled_dot_product_attention(q, k, v, dropout_p=0.5, need_weights=True)
    plain, w_plain = attnkit.scaled_dot_product_attention(q, k, v, need_weights=True)
    torch.testing.assert_close(w, w_plain)
    assert not torch.allclose(out, plain)
    sdpa_out, _ = attnkit.scaled_dot_product_attention(q, k, v, dropout_p=0.5, backend="sdpa")
    assert not torch.allclose(sdpa_out, plain)


@pytest.mark.parametrize("backend", ["tiles:online", "tiles:kernel", "tiles:compiled"])
def test_a_second_derivative_through_a_recomputing_backward_is_refused_not_wrong(backend):
    """A gradient penalty (create_graph=True) through a backend whose backward recomputes outside autograd: an error
    naming the backend and the reference, never a second derivative silently missing the attention's share (the
    compiled, triton and ring backwards share the same check)."""
    q, k, v, _ = make_inputs(7, 20, 8, 2, seed=0)
    q, v = q.requires_grad_(), v[..., :8]
    out = attnkit.scaled_dot_product_attention(q, k, v, is_causal=True, backend=backend).output
    with pytest.raises(
        RuntimeError, match=rf"the {backend} backend's backward cannot be differentiated again.*'reference'"
    ):
        torch.autograd.grad(out.sum(), q, create_graph=True)
    out = attnkit.scaled_dot_product_attention(q, k, v, is_causal=True, backend="reference").output
    (dq,) = torch.autograd.grad(out.sum(), q, create_graph=True)
    assert dq.requires_grad  # the reference differentiates twice


def test_every_engine_declares_the_same_float32_bounds():
    """The constants above hold for every engine these tests run."""
    assert all(bounds(e, torch.float32) == (OUT_TOL, GRAD_TOL) for e in BACKENDS)
