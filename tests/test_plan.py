"""attnkit.plan, the tiles of a call's mask (which are skipped, which need no mask, which are exactly causal), what
it learns of the mask on the way and where it is kept; and the tile engine that runs on it (``backend="tiles"``)
against the float64 math of tests/mathref.py: outputs and every gradient, with tiles of 8 so that small calls have
hidden, full and partial tiles, for every kind of mask, sinks, grouped key/value heads and Lq != Lk; NaN where no query
may see."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import settings as hypothesis_settings
from hypothesis import strategies as st

import attnkit
import mathref
from agreement import bounds
from attnkit import csrc, dispatch, functional, mods, plan
from attnkit._validate import ranges
from attnkit.masks import Mask
from attnkit.plan import CAUSAL, FULL, MASKED, Rows, Run, plan_of
from mathref import max_err

# B batch, H heads, Hkv key/value heads, Lq/Lk query/key length, D head dim

H, HKV, D = 4, 2, 8
OUT_TOL64, GRAD_TOL64 = bounds("tiles:online", torch.float64)


@pytest.fixture(autouse=True)
def _small_tiles(monkeypatch):
    """Tiles of 8 x 8, and one thread (tiny tensors: threads only add synchronisation on a busy 2-core machine)."""
    monkeypatch.setattr(plan, "BLOCK", 8)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@st.composite
def _cases(draw) -> dict:
    B = draw(st.integers(1, 2))
    Lq = draw(st.integers(1, 40))
    Lk = Lq if draw(st.booleans()) else draw(st.integers(1, 40))
    return {
        "B": B,
        "Lq": Lq,
        "Lk": Lk,
        "is_causal": draw(st.booleans()),
        "valid_lens": draw(st.sampled_from([None, "per example", "per query"])),
        "attn_mask": draw(st.sampled_from([None, "bool", "float"])),
        "mask_mod": draw(st.sampled_from([None, "window", "prefix", "user causal", "user stripes", "per head"])),
        "sinks": draw(st.booleans()),
        "alibi": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**16)),
    }


def _arguments(case: dict) -> tuple[dict, dict, list[torch.Tensor]]:
    """attnkit's keyword arguments, mathref's, and the leaves: q, k, v (float64, requiring grad), the sinks."""
    g = torch.Generator().manual_seed(case["seed"])
    B, Lq, Lk = case["B"], case["Lq"], case["Lk"]
    q = torch.randn(B, H, Lq, D, generator=g, dtype=torch.float64).requires_grad_()
    k, v = (torch.randn(B, HKV, Lk, D, generator=g, dtype=torch.float64).requires_grad_() for _ in range(2))
    ours: dict = {"is_causal": case["is_causal"]}
    if case["valid_lens"] is not None:
        shape = (B,) if case["valid_lens"] == "per example" else (B, Lq)
        ours["valid_lens"] = torch.randint(0, Lk + 1, shape, generator=g)
    if case["attn_mask"] == "bool":
        ours["attn_mask"] = torch.rand(B, 1, Lq, Lk, generator=g) < 0.7
    elif case["attn_mask"] == "float":  # a bias (without gradient: the backend does not differentiate one)
        ours["attn_mask"] = torch.randn(B, H, Lq, Lk, generator=g, dtype=torch.float64)
    math = dict(ours)
    prefix = torch.randint(0, Lk + 1, (B,), generator=g)
    mask_mod, math_mod = {
        None: (None, None),
        "window": (mods.sliding_window(5), mathref.sliding_window(5, Lq, Lk)),
        "prefix": (mods.prefix_lm(prefix), mathref.prefix_lm(prefix, Lq, Lk)),
        "user causal": ((lambda b, h, i, j: i >= j),) * 2,
        "user stripes": ((lambda b, h, i, j: (j // 3) % 2 == 0),) * 2,  # partial tiles with whole columns hidden
        "per head": ((lambda b, h, i, j: (i - j).abs() <= 2 * h + b),) * 2,
    }[case["mask_mod"]]
    if mask_mod is not None:
        ours["mask_mod"], math["mask_mod"] = mask_mod, math_mod
    if case.get("alibi"):  # steep slopes, so that the split of the bias meets large parts
        slopes = torch.rand(H, generator=g, dtype=torch.float64) * 2
        ours["score_mod"], math["score_mod"] = mods.alibi(slopes), mathref.alibi(slopes, Lq, Lk)
    leaves = [q, k, v]
    if case["sinks"]:
        ours["sinks"] = math["sinks"] = torch.randn(H, generator=g, dtype=torch.float64).requires_grad_()
        leaves.append(ours["sinks"])
    return ours, math, leaves


def _agree_with_the_math(ours: dict, math: dict, leaves: list[torch.Tensor]) -> None:
    """The tile engine's output and the gradients of every leaf (q, k, v, the sinks) against mathref's."""
    q, k, v = leaves[:3]
    out = attnkit.scaled_dot_product_attention(q, k, v, backend="tiles", **ours).output
    want, _ = mathref.attention_mods(q, k, v, **math)
    mathref.assert_agrees(out, want, leaves, ["q", "k", "v", "sinks"][: len(leaves)], OUT_TOL64, GRAD_TOL64)


@hypothesis_settings(max_examples=60, deadline=None)
@given(case=_cases())
def test_the_tile_engine_equals_the_math_outputs_and_gradients(case):
    ours, math, leaves = _arguments(case)
    q, k, v = leaves[:3]
    _agree_with_the_math(ours, math, leaves)


@hypothesis_settings(max_examples=40, deadline=None)
@given(
    case=st.fixed_dictionaries(
        {
            "B": st.integers(1, 2),
            "Lq": st.integers(17, 40),
            "shift": st.sampled_from([0, 0, 5, 8]),  # Lk - Lq
            "mask": st.sampled_from(["none", "causal", "window", "user causal", "causal window"]),
            "sinks": st.booleans(),
            "seed": st.integers(0, 2**16),
        }
    )
)
def test_alibi_over_tiles_with_and_without_a_mask_equals_the_math(case):
    """ALiBi over tiles that run without a mask beside others (below and above the diagonal), steep slopes: the
    output, the gradients, and the log-sum-exp the statistics read (each row's over its scores, sinks included)."""
    g = torch.Generator().manual_seed(case["seed"])
    B, Lq = case["B"], case["Lq"]
    Lk = Lq + case["shift"]
    q = torch.randn(B, H, Lq, D, generator=g, dtype=torch.float64).requires_grad_()
    k, v = (torch.randn(B, HKV, Lk, D, generator=g, dtype=torch.float64).requires_grad_() for _ in range(2))
    slopes = torch.rand(H, generator=g, dtype=torch.float64) * 2
    ours: dict = {"score_mod": mods.alibi(slopes), "is_causal": case["mask"] in ("causal", "causal window")}
    math: dict = {"score_mod": mathref.alibi(slopes, Lq, Lk), "is_causal": ours["is_causal"]}
    if "window" in case["mask"]:
        ours["mask_mod"], math["mask_mod"] = mods.sliding_window(20), mathref.sliding_window(20, Lq, Lk)
    elif case["mask"] == "user causal":
        ours["mask_mod"] = math["mask_mod"] = lambda b, h, i, j: i + (Lk - Lq) >= j
    leaves = [q, k, v]
    if case["sinks"]:
        ours["sinks"] = math["sinks"] = torch.randn(H, generator=g, dtype=torch.float64).requires_grad_()
        leaves.append(ours["sinks"])
    _agree_with_the_math(ours, math, leaves)
    # the log-sum-exp the statistics read: the part for each query is back in it
    masks = functional.Masks(is_causal=ours["is_causal"], mask_mod=ours.get("mask_mod"), score_mod=ours["score_mod"])
    with torch.no_grad():
        got_lse = functional.attend(q, k, v, masks, sinks=ours.get("sinks"), backend="tiles", need_lse=True).lse
        scores = mathref.scores_from_mod(math["score_mod"], q @ k.repeat_interleave(H // HKV, 1).mT / D**0.5)
        allowed = mathref.allowed_mask(B, H, Lq, Lk, is_causal=ours["is_causal"])  # (B|1, H|1, Lq, Lk)
        if "mask_mod" in math:
            allowed = allowed & mathref.mask_from_mod(math["mask_mod"], B, H, Lq, Lk)
        terms = scores.masked_fill(~allowed, float("-inf"))  # (B, H, Lq, Lk)
        if "sinks" in ours:
            terms = torch.cat([terms, ours["sinks"].view(1, H, 1, 1).expand(B, H, Lq, 1)], dim=-1)
        want_lse = torch.logsumexp(terms, dim=-1)  # (B, H, Lq); every row sees its own key
    assert got_lse is not None and max_err(got_lse, want_lse) <= OUT_TOL64


def test_alibi_slopes_that_require_grad_get_their_gradient_from_the_engine():
    """ALiBi whose slopes require grad: the tile engine's kernel gives them their gradient (float32, where built: its
    bias on the distance, summed back per head), else SDPA (the bias dense, small), as the math's."""
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, H, 20, D, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3))
    slopes = mods.alibi_slopes(H).double().requires_grad_()
    for dtype in (torch.float64, torch.float32):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v, slopes)]
        with dispatch.watch(implementations=True) as chosen:
            out = attnkit.scaled_dot_product_attention(
                *leaves[:3], score_mod=mods.alibi(leaves[3]), is_causal=True
            ).output
        kernel = dtype == torch.float32 and csrc.ensure("flash") is None
        assert chosen == ["tiles:kernel" if kernel else "sdpa"], dtype
        want, _ = mathref.attention_mods(q, k, v, score_mod=mathref.alibi(slopes, 20, 20), is_causal=True)
        tol = (OUT_TOL64, GRAD_TOL64) if dtype == torch.float64 else (1e-5, 1e-4)
        (found,) = torch.autograd.grad(out.sum(), leaves[3])
        (expected,) = torch.autograd.grad(want.sum(), slopes)
        assert max_err(found, expected) <= tol[1] * max(1.0, expected.abs().max().item()), dtype
        assert max_err(out, want) <= tol[0], dtype


@hypothesis_settings(max_examples=30, deadline=None)
@given(case=_cases())
def test_nan_where_no_query_may_see_reaches_nothing(case):
    """NaN in every key and value no query may see and in every query that sees no key: the outputs and gradients
    of everything else are those of the call with zeros there."""
    ours, math, leaves = _arguments(case)
    q, k, v = (t.detach() for t in leaves[:3])
    B, Lq, Lk = case["B"], case["Lq"], case["Lk"]
    mask = Mask.build(
        batch=B,
        heads=H,
        num_queries=Lq,
        num_keys=Lk,
        valid_lens=ours.get("valid_lens"),
        attn_mask=ours.get("attn_mask"),
        is_causal=ours["is_causal"],
        mask_mod=ours.get("mask_mod"),
    )
    allowed = mathref.allowed_mask(B, H, Lq, Lk, **{n: ours[n] for n in ("valid_lens", "attn_mask") if n in ours})
    if "mask_mod" in math:
        allowed = allowed & mathref.mask_from_mod(math["mask_mod"], B, H, Lq, Lk)
    if ours["is_causal"]:
        allowed = allowed & mathref.allowed_mask(B, H, Lq, Lk, is_causal=True)
    del mask
    dead_rows = ~allowed.any(dim=-1)  # (B, H, Lq)
    dead_keys = ~allowed.unflatten(1, (HKV, -1)).any(dim=(2, 3))  # (B, Hkv, Lk)
    poison = [
        torch.where(dead_rows[..., None], float("nan"), q),
        torch.where(dead_keys[..., None], float("nan"), k),
        torch.where(dead_keys[..., None], float("nan"), v),
    ]
    clean = [torch.where(dead_rows[..., None], 0.0, q), *(torch.where(dead_keys[..., None], 0.0, t) for t in (k, v))]
    got = [t.requires_grad_() for t in poison]
    want_in = [t.requires_grad_() for t in clean]
    out = attnkit.scaled_dot_product_attention(*got, backend="tiles", **ours).output
    want = attnkit.scaled_dot_product_attention(*want_in, backend="reference", **ours).output
    assert torch.isfinite(out).all()
    assert max_err(out, want) <= OUT_TOL64
    dout = torch.randn_like(out)
    grads, expected = torch.autograd.grad(out, got, dout), torch.autograd.grad(want, want_in, dout)
    for name, a, b in zip("qkv", grads, expected, strict=True):
        assert torch.isfinite(a).all(), name
        assert max_err(a, b) <= GRAD_TOL64, name


def test_a_query_that_holds_nan_gives_nan_across_the_runs_it_sees():
    """A row that sees several runs (a window's partial and full tiles) and whose query holds NaN: its output is NaN,
    as the reference's (the merge of the runs made it zeros), and the other rows are those of a clean call."""
    L = 60
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, H, L, D, generator=g) for _ in range(3))
    q[0, 1, 40, 0] = float("nan")
    kw = {"mask_mod": mods.sliding_window(20), "backend": "tiles"}
    out = attnkit.scaled_dot_product_attention(q, k, v, **kw).output
    clean = attnkit.scaled_dot_product_attention(q.nan_to_num(0.0), k, v, **kw).output
    assert torch.isnan(out[0, 1, 40]).all()
    keep = torch.ones(L, dtype=torch.bool)
    keep[40] = False
    assert torch.equal(out[0, 1, keep], clean[0, 1, keep]) and torch.equal(out[:, [0, 2, 3]], clean[:, [0, 2, 3]])


def test_a_user_causal_mask_plans_as_is_causal_does_and_runs_as_it():
    """Evaluated once per tile, a causal mask_mod gives the plan of is_causal: tiles below the diagonal run without a
    mask, those above are skipped, the diagonal ones are causal; the plan says the whole mask is causal, and auto
    runs the call as is_causal (PyTorch's fused kernel), with the math's result."""
    L = 40
    user = Mask.build(batch=1, heads=H, num_queries=L, num_keys=L, mask_mod=lambda b, h, i, j: i >= j)
    by_fn, by_flag = (
        plan_of(user),
        plan_of(Mask.build(batch=1, heads=H, num_queries=L, num_keys=L, is_causal=True)),
    )
    assert by_fn.rows == by_flag.rows
    assert by_fn.rows[2] == Rows(16, 24, (Run(0, 16, FULL), Run(16, 24, CAUSAL)))
    assert by_fn.causal_throughout and by_flag.causal_throughout
    q, k, v = (torch.randn(1, H, L, D, dtype=torch.float64) for _ in range(3))
    with dispatch.watch(implementations=True) as ran:
        out = attnkit.scaled_dot_product_attention(q, k, v, mask_mod=lambda b, h, i, j: i >= j).output
    assert ran == ["sdpa"]
    assert max_err(out, mathref.attention(q, k, v, is_causal=True)[0]) <= OUT_TOL64


@pytest.mark.parametrize(
    ("kw", "kinds"),
    [
        # a window narrower than a tile: the diagonal tile hides more than its upper half (one run with the one before)
        ({"mask_mod": mods.sliding_window(5)}, [MASKED]),
        # a window of two tiles: the tile before the diagonal is partial, the diagonal one causal
        ({"mask_mod": mods.sliding_window(16), "is_causal": True}, [MASKED, FULL, CAUSAL]),
        # causal, then a padded key in the diagonal tile: no longer exactly causal there
        (
            {"is_causal": True, "valid_lens": torch.tensor([[20] * 16 + [22] * 8 + [40] * 16])},
            [FULL, MASKED],
        ),
    ],
)
def test_only_exactly_causal_diagonal_tiles_are_causal(kw, kinds):
    L = 40
    mask = Mask.build(batch=1, heads=H, num_queries=L, num_keys=L, **kw)
    found = plan_of(mask)
    assert [run.kind for run in found.rows[2].runs] == kinds
    assert not found.causal_throughout  # the tiles stay


def test_causal_tiles_need_the_diagonal_of_the_call():
    """Lq != Lk: the kernel's is_causal hides the upper half of a square call, so a tile is causal only where it
    sits on the call's diagonal (bottom-right aligned); the tiles of a shift that is not a multiple of the tile
    size never are, and the call never runs as one."""
    aligned = Mask.build(batch=1, heads=H, num_queries=16, num_keys=32, is_causal=True)
    assert [r.runs for r in plan_of(aligned).rows] == [
        (Run(0, 16, FULL), Run(16, 24, CAUSAL)),
        (Run(0, 24, FULL), Run(24, 32, CAUSAL)),
    ]
    assert not plan_of(aligned).causal_throughout
    shifted = Mask.build(batch=1, heads=H, num_queries=16, num_keys=35, is_causal=True)
    assert CAUSAL not in {run.kind for r in plan_of(shifted).rows for run in r.runs}


def test_classify_learns_the_liveness_the_scan_would_find():
    g = torch.Generator().manual_seed(0)
    lens = torch.randint(0, 30, (2, 33), generator=g)

    def build() -> Mask:
        return Mask.build(
            batch=2,
            heads=H,
            num_queries=33,
            num_keys=30,
            valid_lens=lens,
            mask_mod=lambda b, h, i, j: (i + j + h) % 5 != 0,
        )

    scanned = build().liveness
    mask = build()
    mask.classify(ranges(0, 33, 8), ranges(0, 30, 8))
    learned = mask.__dict__["liveness"]
    for a, b in zip(scanned, learned, strict=True):
        assert (a is None and b is None) or torch.equal(a.expand_as(b), b.expand_as(a))


def test_a_tensor_the_mask_reads_changed_before_the_backward_is_refused():
    lens = torch.tensor([8])
    q = torch.randn(1, 2, 16, 8, requires_grad=True)
    out = attnkit.scaled_dot_product_attention(q, q, q, mask_mod=mods.prefix_lm(lens), backend="tiles").output
    lens[0] = 2
    with pytest.raises(RuntimeError, match="modified in place between the forward and the backward"):
        out.sum().backward()


def test_auto_takes_the_tile_engine_for_a_sparse_mask_mod_in_any_dtype_and_head_size():
    """A narrow window: float32 on the C++ kernel where it builds, float64 (or float32 where it cannot be built) on
    the eager steps; values of another head size than the queries' too."""
    q = torch.randn(1, H, 64, D)
    for dtype in (torch.float64, torch.float32):
        with dispatch.watch(implementations=True) as ran:
            attnkit.scaled_dot_product_attention(*(q.to(dtype),) * 3, mask_mod=mods.sliding_window(8))
        flash_here = dtype == torch.float32 and csrc.ensure("flash") is None
        assert ran == ["tiles:kernel" if flash_here else "tiles:online"], dtype
    v = torch.randn(1, H, 64, D + 1)
    out = attnkit.scaled_dot_product_attention(q, q, v, mask_mod=mods.sliding_window(8), backend="tiles").output
    want, _ = mathref.attention_mods(q.double(), q.double(), v.double(), mask_mod=mathref.sliding_window(8, 64, 64))
    assert max_err(out, want) <= 1e-5


@pytest.mark.parametrize(
    "mask_mod",
    [
        lambda b, h, i, j: i % 2 == 0,  # no key axis
        lambda b, h, i, j: b == 0,
        lambda b, h, i, j: h == 0,
        lambda b, h, i, j: torch.tensor(True),  # a 0-dim result (PyTorch's noop_mask)
    ],
    ids=["queries only", "examples only", "heads only", "0-dim"],
)
def test_mask_mods_that_ignore_some_indices(mask_mod):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, H, 30, D, generator=g, dtype=torch.float64) for _ in range(3))
    out = attnkit.scaled_dot_product_attention(q, k, v, mask_mod=mask_mod, backend="tiles").output
    want, _ = mathref.attention_mods(q, k, v, mask_mod=mask_mod)
    assert max_err(out, want) <= OUT_TOL64


def test_plans_of_masks_of_the_indices_alone_are_kept_on_the_mask_mod_for_the_next_calls():
    """A built-in window (with or without is_causal) is the same function of the indices at every layer and step: its
    plan, its liveness and its masked tiles' masks are found once, and kept on the mask_mod object the caller holds
    (its copies bound to each call point back to it). Another object plans anew (nothing is kept anywhere else), and
    masks that read tensors, or a user's function, whose contents may change between calls, are planned each call."""
    L = 40
    window = mods.sliding_window(12)

    def build(**kw) -> Mask:
        return Mask.build(batch=1, heads=H, num_queries=L, num_keys=L, **kw)

    first, second = build(mask_mod=window), build(mask_mod=window)
    assert plan_of(first) is plan_of(second)
    assert second.__dict__["liveness"] is first.__dict__["liveness"]
    assert plan_of(build(mask_mod=mods.sliding_window(12))) is not plan_of(first)  # another object
    assert plan_of(build(mask_mod=window, is_causal=True)) is not plan_of(first)
    assert plan_of(build(mask_mod=window, is_causal=True)) is plan_of(build(mask_mod=window, is_causal=True))
    user = lambda b, h, i, j: i >= j  # noqa: E731
    assert plan_of(build(mask_mod=user)) is not plan_of(build(mask_mod=user))
    lens = torch.tensor([30])
    assert plan_of(build(valid_lens=lens)) is not plan_of(build(valid_lens=lens))

    q, k, v = (torch.randn(1, H, L, D) for _ in range(3))
    once = attnkit.scaled_dot_product_attention(q, k, v, mask_mod=window, backend="tiles:kernel").output
    assert plan_of(second)._masks  # the masked tiles' masks, found by the call above
    looks = []
    original = Mask.allowed_tile
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Mask, "allowed_tile", lambda self, *a: looks.append(a) or original(self, *a))
        again = attnkit.scaled_dot_product_attention(q, k, v, mask_mod=window, backend="tiles:kernel").output
    assert looks == []  # the second call evaluates the window nowhere
    want, _ = mathref.attention_mods(q.double(), k.double(), v.double(), mask_mod=mathref.sliding_window(12, L, L))
    assert max_err(once, want) <= 1e-5 and torch.equal(once, again)


def test_a_plan_made_once_serves_every_call_that_shares_its_mask():
    """make_plan, as FlexAttention's create_block_mask: the calls given it (plan=), a layer's too, take their mask
    from it, look at none of its tiles again after the first, and give the math's result; one made for other
    lengths, or given beside another mask, is refused by name."""
    L = 40
    made = attnkit.make_plan(L, L, mask_mod=mods.sliding_window(6), is_causal=True)
    q, k, v = (torch.randn(2, H, L, D) for _ in range(3))
    attnkit.scaled_dot_product_attention(q, k, v, plan=made)  # the first call finds the masked tiles' masks
    looks = []
    original = Mask.allowed_tile
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(Mask, "allowed_tile", lambda self, *a: looks.append(a) or original(self, *a))
        out = attnkit.scaled_dot_product_attention(q, k, v, plan=made).output
        layer = attnkit.MultiHeadAttention(H * D, H)
        layer(q.transpose(1, 2).flatten(2), k.transpose(1, 2).flatten(2), v.transpose(1, 2).flatten(2), plan=made)
    assert not [a for a in looks if a[1] - a[0] == 8 and a[3] - a[2] == 8]  # no tile of the plan looked at again
    want, _ = mathref.attention_mods(
        q.double(), k.double(), v.double(), mask_mod=mathref.sliding_window(6, L, L), is_causal=True
    )
    assert max_err(out, want) <= 1e-5
    with pytest.raises(ValueError, match="plan was made for 40 queries and 40 keys.*this call has 20 and 20"):
        attnkit.scaled_dot_product_attention(q[:, :, :20], k[:, :, :20], v[:, :, :20], plan=made)
    with pytest.raises(ValueError, match="plan is the call's whole mask, and valid_lens was given beside it"):
        attnkit.scaled_dot_product_attention(q, k, v, plan=made, valid_lens=torch.tensor([3, 4]))
    with pytest.raises(TypeError, match="plan must be what attnkit.make_plan makes"):
        attnkit.scaled_dot_product_attention(q, k, v, plan="window")


@pytest.mark.parametrize("backend", ["tiles", "tiles:kernel"])
def test_a_call_under_inference_mode_keeps_nothing_a_training_call_cannot_save(backend):
    """An evaluation step under ``torch.inference_mode()`` then a training step with the same window and shapes
    (tester's finding: the kept plan's liveness, made under inference mode, could not be saved for the backward:
    RuntimeError). Plans and masks made under inference mode are not kept."""
    if backend == "tiles:kernel" and csrc.ensure("flash") is not None:
        pytest.skip("the flash kernel cannot be built here")
    g = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(1, 2, 30, D, generator=g), torch.randn(1, 2, 100, D, generator=g), torch.randn(1, 2, 100, D)
    window = mods.sliding_window(5)  # Lq != Lk: keys no query sees, dead
    with torch.inference_mode():
        before = attnkit.scaled_dot_product_attention(q, k, v, mask_mod=window, backend=backend).output
    xs = [t.clone().requires_grad_() for t in (q, k, v)]
    out = attnkit.scaled_dot_product_attention(*xs, mask_mod=window, backend=backend).output
    out.sum().backward()
    assert torch.equal(out.detach(), before) and all(x.grad is not None for x in xs)


@pytest.mark.parametrize("slope", [1.0, 2.0])
def test_alibi_in_float32_is_as_accurate_as_the_eager_steps(monkeypatch, slope):
    """Tiles of 256: the tile engine's ALiBi in float32 on its C++ kernel (a bias on the distance) loses no more than
    the eager steps' (split at the middle query, a kernel's bias lost up to 18x as much)."""
    monkeypatch.setattr(plan, "BLOCK", 256)
    g = torch.Generator().manual_seed(0)
    L = 1024
    q, k, v = (torch.randn(1, 1, L, 64, generator=g) for _ in range(3))
    slopes = torch.tensor([slope])
    want, _ = mathref.attention_mods(
        q.double(), k.double(), v.double(), is_causal=True, score_mod=mathref.alibi(slopes.double(), L, L)
    )
    if csrc.ensure("flash") is not None:
        pytest.skip("the C++ kernel cannot be built here")
    errors = {}
    for backend in ("tiles:kernel", "tiles:online"):
        out = attnkit.scaled_dot_product_attention(
            q, k, v, is_causal=True, score_mod=mods.alibi(slopes), backend=backend
        ).output
        errors[backend] = max_err(out.double(), want)
    assert errors["tiles:kernel"] <= 2 * errors["tiles:online"], errors


def test_a_last_tile_of_one_query_keeps_the_call_causal_but_never_drops_a_bias():
    """L = 8k + 1: the last tile, 1 x 1, is visible in full, and the mask is still causal throughout; a float mask
    there (L = 1) is a bias a causal call would not add, so it is not."""
    causal = Mask.build(batch=1, heads=H, num_queries=17, num_keys=17, is_causal=True)
    assert plan_of(causal).causal_throughout
    biased = Mask.build(batch=1, heads=H, num_queries=1, num_keys=1, attn_mask=torch.ones(1, 1))
    assert not plan_of(biased).causal_throughout


def test_alibi_in_packed_documents_equals_the_math():
    """Packed documents run one piece per document (attnkit.varlen), whose ALiBi is the call's moved to the piece's
    positions: the result is the math's."""
    g = torch.Generator().manual_seed(5)
    lengths = [11, 20, 6]
    ids = torch.arange(len(lengths)).repeat_interleave(torch.tensor(lengths))[None]  # (1, L)
    L = sum(lengths)
    q = torch.randn(1, H, L, D, generator=g, dtype=torch.float64).requires_grad_()
    k, v = (torch.randn(1, HKV, L, D, generator=g, dtype=torch.float64).requires_grad_() for _ in range(2))
    slopes = torch.rand(H, generator=g, dtype=torch.float64) * 2
    ours = {"score_mod": mods.alibi(slopes), "mask_mod": mods.document(ids), "is_causal": True}
    math = {"score_mod": mathref.alibi(slopes, L, L), "mask_mod": mathref.document(ids), "is_causal": True}
    _agree_with_the_math(ours, math, [q, k, v])


def test_a_plan_of_a_function_of_yours_serves_any_batch_and_heads_on_the_default_device():
    """make_plan with the defaults (batch and heads 1: the mask depends on neither; device None: PyTorch's default)
    serves calls of any B and H there, a layer's too, and keeps its partly visible tiles: the calls after look at
    none (reviewer's and tester's findings: refused as 'on cpu ... on cpu', and each call evaluated them again)."""
    L = 600
    near = lambda b, h, q_idx, kv_idx: (q_idx - kv_idx).abs() < 40  # noqa: E731
    made = attnkit.make_plan(L, L, mask_mod=near)
    g = torch.Generator().manual_seed(3)
    for B_, H_ in ((1, 1), (2, H), (3, 2)):
        q, k, v = (torch.randn(B_, H_, L, D, generator=g) for _ in range(3))
        attnkit.scaled_dot_product_attention(q, k, v, plan=made)  # (the first call of a B, H finds its tiles)
        looks = []
        original = Mask.allowed_tile
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(Mask, "allowed_tile", lambda self, *a, seen=looks, f=original: seen.append(a) or f(self, *a))
            out = attnkit.scaled_dot_product_attention(q, k, v, plan=made).output
        assert not looks, (B_, H_)
        want, _ = mathref.attention_mods(q.double(), k.double(), v.double(), mask_mod=near)
        assert max_err(out, want) <= bounds("reference", torch.float32)[0], (B_, H_)
    ids = torch.tensor([[0] * 300 + [1] * 300, [0] * 100 + [1] * 500])  # (2, L): a mask that reads the example
    with pytest.raises(ValueError, match=r"make_plan's batch and heads are the calls' B and H"):
        attnkit.make_plan(L, L, mask_mod=mods.document(ids))
    per_example = attnkit.make_plan(L, L, mask_mod=mods.document(ids), batch=2)
    q, k, v = (torch.randn(2, H, L, D, generator=g) for _ in range(3))
    out = attnkit.scaled_dot_product_attention(q, k, v, plan=per_example).output
    want, _ = mathref.attention_mods(q.double(), k.double(), v.double(), mask_mod=mathref.document(ids))
    assert max_err(out, want) <= bounds("reference", torch.float32)[0]
    with pytest.raises(ValueError, match=r"ids_q must have shape \(B, Lq\) = \(3, 600\) or \(1, 600\), got \(2, 600\)"):
        attnkit.scaled_dot_product_attention(*(torch.randn(3, H, L, D) for _ in range(3)), plan=per_example)


def test_a_plan_made_under_inference_mode_serves_a_training_call():
    """Its tensors (which keys and rows are live) are made outside inference mode (tester's finding: a training
    call could not save them)."""
    with torch.inference_mode():
        made = attnkit.make_plan(100, 500, mask_mod=mods.sliding_window(64))  # keys no query sees: dead
    xs = [torch.randn(1, 2, n, D, requires_grad=True) for n in (100, 500, 500)]
    attnkit.scaled_dot_product_attention(*xs, plan=made).output.sum().backward()
    assert all(x.grad is not None for x in xs)


@pytest.mark.parametrize(
    ("kw", "error", "match"),
    [
        ({"num_queries": -1}, ValueError, "num_queries must be at least 0, got -1"),
        ({"num_queries": 3.5}, TypeError, "num_queries must be a whole number, got 3.5"),
        ({"num_keys": "10"}, TypeError, "num_keys must be a whole number, got '10'"),
        ({"batch": 0}, ValueError, "batch must be positive, got 0"),
        ({"is_causal": 1}, TypeError, "is_causal must be True or False, got 1"),
        ({"device": "meta"}, ValueError, "device must hold values to plan from"),
        ({"device": "nowhere"}, ValueError, "device must name a device"),
    ],
)
def test_make_plan_names_an_argument_that_is_not_what_it_says(kw, error, match):
    with pytest.raises(error, match=match):
        attnkit.make_plan(**{"num_queries": 10, "num_keys": 12, **kw})


def test_the_kept_plans_of_a_mask_mod_go_least_recently_used_first(monkeypatch):
    """A mask_mod keeps KEPT_PLANS plans; one used again moves to the back, so a model's lengths in turn keep
    theirs (reviewer's finding: the first made went first, however often used)."""
    monkeypatch.setattr(plan, "KEPT_PLANS", 2)
    window = mods.sliding_window(4)
    made = []
    original = plan.Plan.build
    monkeypatch.setattr(plan.Plan, "build", classmethod(lambda cls, *a, **kw: made.append(1) or original(*a, **kw)))
    for L in (40, 50, 40, 60, 40):
        q = torch.randn(1, 1, L, D)
        attnkit.scaled_dot_product_attention(q, q, q, mask_mod=window)
    assert len(made) == 3  # 40, 50, 60; 40 kept throughout
