"""What adversarial testing found in the modifiers (issue 22, findings a, b, c, d), one test each, named after the
behaviour: a key a score_mod hides from every query is one no query may see; what a modifier returns or closes over
is never written to; one packed document's content never changes another's; the chunked backward's watch finds
the tensors a mask_mod reads however the function holds them, or refuses what it cannot inspect."""

from __future__ import annotations

import functools

import pytest
import torch

import attnkit
from attnkit import dispatch, mods
from attnkit.backends.tiles import online
from mathref import max_err

# B batch, H heads, L length, D head dim

B, H, L, D = 2, 2, 8, 4
HIDDEN = 3  # the key a score_mod hides from every query


def _hide_key(s, b, h, q_idx, kv_idx):
    return torch.where(kv_idx == HIDDEN, float("-inf"), s)


def _grads(backend, q, k, v, grad_out):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = attnkit.scaled_dot_product_attention(*leaves, score_mod=_hide_key, backend=backend).output
    return (out, *torch.autograd.grad(out, leaves, grad_out))


@pytest.mark.parametrize("backend", ["reference", "tiles:online", "auto"])
@pytest.mark.parametrize("where", ["key", "value", "both"])
def test_a_key_a_score_mod_hides_from_every_query_never_leaks_its_nan(backend, where):
    """NaN in the key or value that a score_mod's -inf hides from every query: the output and every gradient are
    finite and equal those of clean inputs, and that key gets zero gradients (finding a)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, generator=g, dtype=torch.float64) for _ in range(3))
    grad_out = torch.randn(B, H, L, D, generator=g, dtype=torch.float64)
    dirty_k, dirty_v = k.clone(), v.clone()
    if where in ("key", "both"):
        dirty_k[:, :, HIDDEN] = float("nan")
    if where in ("value", "both"):
        dirty_v[:, :, HIDDEN] = float("nan")
    with online.settings(block_size=3):
        clean = _grads(backend, q, k, v, grad_out)
        dirty = _grads(backend, q, dirty_k, dirty_v, grad_out)
    for name, a, b in zip(("out", "dq", "dk", "dv"), clean, dirty, strict=True):
        assert torch.isfinite(b).all(), name
        assert max_err(b, a) <= 1e-12, name
    assert not dirty[2][:, :, HIDDEN].any() and not dirty[3][:, :, HIDDEN].any()
    with torch.no_grad():
        out = attnkit.scaled_dot_product_attention(q, dirty_k, dirty_v, score_mod=_hide_key, backend=backend).output
    assert max_err(out, clean[0]) <= 1e-12


@pytest.mark.parametrize("backend", ["reference", "tiles:online", "auto"])
@pytest.mark.parametrize("view", [False, True], ids=["the tensor", "a view of it"])
def test_what_a_score_mod_returns_and_closes_over_is_never_written_to(backend, view):
    """A score_mod that returns a tensor it closes over (or a plain view of one) of exactly the block's shape: the
    backends used to write into it in place without autograd (finding b)."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(B, H, L, D, generator=g) for _ in range(3))
    table = torch.randn(B, H, L, L, generator=g)
    kept = table.clone()

    def score_mod(s, b, h, q_idx, kv_idx):
        return table.view(B, H, L, L) if view else table

    want = torch.softmax(table.double(), dim=-1) @ v.double()  # the scores are the table
    with torch.no_grad(), online.settings(block_size=L):  # one block: its shape is the table's
        for _ in range(2):
            out = attnkit.scaled_dot_product_attention(q, k, v, score_mod=score_mod, backend=backend).output
            assert torch.equal(table, kept)
            assert max_err(out, want) <= 1e-5


@pytest.mark.parametrize("backend", ["reference", "sdpa", "tiles:online", "auto"])
def test_one_documents_huge_content_never_changes_anothers(backend):
    """Packed documents: finite but huge content (|x| near 1e38) in one document made the other documents' outputs
    NaN on sdpa/auto (a cross-document score overflows to inf inside the kernel and meets the mask's -inf; finding
    c). Each document's outputs equal those of the document alone: packed documents run as one call per document
    (attnkit.varlen), so sdpa runs this call too."""
    g = torch.Generator().manual_seed(2)
    ids = torch.tensor([[0] * 12 + [1] * 4])  # one large document and a small one
    q, k, v = (torch.randn(1, H, 16, D, generator=g) for _ in range(3))
    q[:, :, 12:], k[:, :, 12:], v[:, :, 12:] = 1e38, -1e38, 1.0  # the second document's content
    out = attnkit.scaled_dot_product_attention(q, k, v, mask_mod=mods.document(ids), backend=backend).output
    alone = attnkit.scaled_dot_product_attention(q[:, :, :12], k[:, :, :12], v[:, :, :12], backend="reference")
    assert torch.isfinite(out[:, :, :12]).all()
    assert max_err(out[:, :, :12], alone.output) <= 1e-5


@pytest.mark.parametrize("how", ["lru_cache", "an attribute made at the first call"])
@pytest.mark.parametrize("backend", ["reference", "tiles:online"])
def test_a_tensor_a_score_mod_keeps_where_it_cannot_be_found_is_never_written_to(how, backend):
    """The table a score_mod returns may be held where no walk finds it (an lru_cache, an attribute it makes at its
    first call): a result held anywhere else is copied before anything writes into it (finding b)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(B, H, L, D, generator=g) for _ in range(3))

    @functools.lru_cache
    def table() -> torch.Tensor:
        return torch.randn(B, H, L, L, generator=torch.Generator().manual_seed(4))

    class Lazy:
        def __call__(self, s, b, h, q_idx, kv_idx):
            if not hasattr(self, "table"):
                self.table = table().clone()
            return self.table

    score_mod = Lazy() if how != "lru_cache" else (lambda s, b, h, q_idx, kv_idx: table())
    with torch.no_grad(), online.settings(block_size=L):
        first = attnkit.scaled_dot_product_attention(q, k, v, score_mod=score_mod, backend=backend).output
        held = table().clone() if how == "lru_cache" else score_mod.table.clone()
        second = attnkit.scaled_dot_product_attention(q, k, v, score_mod=score_mod, backend=backend).output
    assert torch.equal(held, table() if how == "lru_cache" else score_mod.table)
    assert torch.equal(first, second)
    assert torch.equal(table(), torch.randn(B, H, L, L, generator=torch.Generator().manual_seed(4)))


class _Threshold:
    """A mask_mod as a callable object: it reads a tensor it holds."""

    def __init__(self, lens: torch.Tensor) -> None:
        self.lens = lens

    def __call__(self, b, h, q_idx, kv_idx):
        return kv_idx < self.lens[b]


def _below(lens, b, h, q_idx, kv_idx):
    return kv_idx < lens[b]


class _Holder:
    def __init__(self, lens: torch.Tensor) -> None:
        self.lens = lens

    def mask(self, b, h, q_idx, kv_idx):
        return kv_idx < self.lens[b]


class _Config:
    """A mask_mod's tensor kept as a class attribute (read through the class, or through an instance)."""

    lens = torch.zeros(2, dtype=torch.long)

    def mask(self, b, h, q_idx, kv_idx):
        return kv_idx < self.lens[b]


def _class_attribute(b, h, q_idx, kv_idx):
    return kv_idx < _Config.lens[b]


def _holders(lens: torch.Tensor) -> dict[str, mods.MaskFn]:
    _Config.lens = lens

    def closure(b, h, q_idx, kv_idx):
        return kv_idx < lens[b]

    return {
        "closure in and_masks": mods.and_masks(mods.sliding_window(6), closure),
        "closure in or_masks": mods.or_masks(closure, mods.sliding_window(1)),
        "callable object": _Threshold(lens),
        "functools.partial": functools.partial(_below, lens),
        "bound method": _Holder(lens).mask,
        "nested compositions": mods.and_masks(mods.or_masks(mods.and_masks(_Threshold(lens))), mods.sliding_window(8)),
        "a global class's attribute": _class_attribute,
        "a class attribute through self": _Config().mask,
    }


@pytest.mark.parametrize("how", list(_holders(torch.zeros(1))))
def test_the_chunked_backward_sees_a_tensor_a_mask_mod_reads_however_it_is_held(how):
    """The chunked backward recomputes with what the mask_mod reads: changed in place after the forward pass, the
    backward raises instead of silently using the new values (it missed functions inside and_masks/or_masks and
    callable objects: dq off by 57 in the probe). Finding d."""
    lens = torch.tensor([5, 3])
    q = torch.randn(B, H, L, D, requires_grad=True)
    mask_mod = _holders(lens)[how]
    out = attnkit.scaled_dot_product_attention(q, q, q, mask_mod=mask_mod, backend="tiles:online").output
    lens[0] = 8  # a reused buffer, refilled before the backward pass
    with pytest.raises(RuntimeError, match="modified in place between the forward and the backward"):
        out.sum().backward()


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_a_mask_mod_whose_state_cannot_be_inspected_is_refused_with_how_to_pass_it():
    """A callable whose tensors cannot be found (TorchScript, C code with state) cannot be watched for changes
    between the forward and the backward pass: the chunked backend declares so under autograd (named, it says how
    to pass the function instead; auto runs another backend), and runs it without autograd."""
    lens = torch.tensor([5, 3])
    opaque = torch.jit.script(_ScriptedMask(lens))
    q = torch.randn(B, H, L, D, requires_grad=True)
    with pytest.raises(ValueError, match="tiles:online: under autograd, it must see the tensors a mask_mod"):
        attnkit.scaled_dot_product_attention(q, q, q, mask_mod=opaque, backend="tiles:online")
    want = attnkit.scaled_dot_product_attention(q, q, q, mask_mod=_ScriptedMask(lens), backend="reference").output
    with dispatch.watch(implementations=True) as ran:
        out = attnkit.scaled_dot_product_attention(q, q, q, mask_mod=opaque).output
    assert ran and ran != ["tiles:online"] and max_err(out, want) <= 1e-6
    with torch.no_grad():
        out = attnkit.scaled_dot_product_attention(q, q, q, mask_mod=opaque, backend="tiles:online").output
    assert max_err(out, want) <= 1e-6


class _ScriptedMask(torch.nn.Module):
    def __init__(self, lens: torch.Tensor) -> None:
        super().__init__()
        self.lens = lens  # a plain attribute, not a buffer: TorchScript keeps it where Python cannot see it

    def forward(self, b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return kv_idx < self.lens[b]


@pytest.mark.parametrize("backend", ["reference", "tiles:online", "auto"])
def test_a_score_mod_whose_result_needs_no_gradient_trains(backend):
    """A score_mod that ignores the score and reads nothing requiring grad (a fixed bias table): the scores get no
    gradient through it; the chunked backward used to fail asking autograd for one."""
    g = torch.Generator().manual_seed(5)
    table = torch.randn(L, L, generator=g, dtype=torch.float64)
    q = torch.randn(B, H, L, D, generator=g, dtype=torch.float64, requires_grad=True)
    grads = {}
    for name in (backend, "reference"):
        out = attnkit.scaled_dot_product_attention(
            q, q, q, score_mod=lambda s, b, h, q_idx, kv_idx: table[q_idx, kv_idx], backend=name
        ).output
        (grads[name],) = torch.autograd.grad(out.square().sum(), q)
    assert max_err(grads[backend], grads["reference"]) <= 1e-10


@pytest.mark.parametrize("backend", ["tiles:online", "auto"])
def test_a_score_mod_that_writes_into_its_scores_trains_as_the_reference(backend):
    """``score.mul_(0.5)``: the reference runs it; the chunked backward gave it a leaf and failed ("a leaf Variable
    that requires grad is being used in an in-place operation"). It now works on a copy."""
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(B, H, L, D, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    grads = {}
    for name in (backend, "reference"):
        out = attnkit.scaled_dot_product_attention(
            q, k, v, is_causal=True, score_mod=lambda s, b, h, q_idx, kv_idx: s.mul_(0.5), backend=name
        ).output
        grads[name] = torch.autograd.grad(out.square().sum(), (q, k, v))
    for mine, want in zip(grads[backend], grads["reference"], strict=True):
        assert max_err(mine, want) <= 1e-10
