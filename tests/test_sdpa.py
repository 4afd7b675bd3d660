"""The sdpa engine (attnkit.backends.sdpa, PyTorch's fused kernels): a padded batch as one call per run of equal
lengths on its real keys, and when that pays; queries not contiguous; torch.func's transforms. Its guarded backward
(hidden huge values) is in test_reach.py, its agreement with float64 in test_agreement.py."""

from __future__ import annotations

import pytest
import torch

import attnkit
from agreement import bounds
from cases import make_inputs
from mathref import attention as math_attention
from mathref import max_err

OUT_TOL, GRAD_TOL = bounds("sdpa", torch.float32)


def _run(backend, q, k, v, kw, grad_out=None):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out, _ = attnkit.scaled_dot_product_attention(q, k, v, backend=backend, **kw)
    if grad_out is None:
        return out, None
    grads = torch.autograd.grad(out, (q, k, v), grad_out.to(out.dtype))
    return out, grads


@pytest.mark.parametrize("causal", [False, True])
def test_padded_batches_run_by_length_and_match_the_math(causal):
    """1-D valid_lens alone (or with causal self-attention): sdpa runs one call per length on the real keys."""
    q, k, v, g = make_inputs(57, 57, 16, 2, seed=13)
    q, k, v = torch.cat([q, q]), torch.cat([k, k]), torch.cat([v, v])  # B = 4
    kw = {"valid_lens": torch.tensor([57, 20, 0, 20]), "is_causal": causal}
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    truth, _ = math_attention(q64, k64, v64, **kw)
    grad_out = torch.randn(truth.shape, generator=g, dtype=torch.float64)
    true_grads = torch.autograd.grad(truth, (q64, k64, v64), grad_out)
    out, grads = _run("sdpa", q, k, v, kw, grad_out)
    assert max_err(out, truth) <= OUT_TOL
    assert (out[2] == 0).all()
    for grad, true in zip(grads, true_grads, strict=True):
        assert max_err(grad, true) <= GRAD_TOL * max(1.0, true.abs().max().item())


def test_padded_batches_group_only_when_the_skipped_work_pays_for_the_calls(monkeypatch):
    """One call per run of equal lengths skips the padding's work but adds calls: a decode step (one query) over
    a few hundred keys runs as one masked call, a batch of long padded rows as one call per length; both match."""
    from attnkit.backends import sdpa

    calls = []
    kernel = sdpa.fused  # every call of the fused kernel goes through it
    monkeypatch.setattr(sdpa, "fused", lambda *a, **kw: calls.append(1) or kernel(*a, **kw))
    g = torch.Generator().manual_seed(5)
    for Lq, Lk, expected_calls in ((1, 400, 1), (512, 512, 8)):
        q = torch.randn(8, 4, Lq, 64, generator=g)
        k, v = torch.randn(8, 4, Lk, 64, generator=g), torch.randn(8, 4, Lk, 64, generator=g)
        lens = Lk // 2 + torch.arange(8) * (Lk // 16)  # (8,) distinct lengths in [Lk/2, Lk)
        calls.clear()
        out = attnkit.scaled_dot_product_attention(q, k, v, valid_lens=lens, backend="sdpa").output
        assert len(calls) == expected_calls, (Lq, Lk, len(calls))
        truth, _ = math_attention(q.double(), k.double(), v.double(), valid_lens=lens)
        assert max_err(out, truth) <= OUT_TOL


@pytest.mark.parametrize("backend", ["auto", "sdpa"])
def test_queries_whose_rows_are_not_contiguous_are_read_as_they_are(backend):
    """A transposed or strided q in a causal call under autograd (PyTorch's flash kernel through its own ops reads
    each row as contiguous: it gave outputs off by 1e36)."""
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(2, 2, 16, 33, generator=g), torch.randn(2, 2, 16, 33, generator=g)
    for q in (
        torch.randn(2, 2, 33, 16, generator=g).transpose(-1, -2),
        torch.randn(2, 2, 16, 66, generator=g)[..., ::2],
    ):
        leaf = q.clone().requires_grad_() if q.is_contiguous() else q.requires_grad_()
        out = attnkit.scaled_dot_product_attention(leaf, k, v, is_causal=True, backend=backend).output
        truth, _ = math_attention(q.double(), k.double(), v.double(), is_causal=True)
        assert max_err(out, truth) <= OUT_TOL


def test_torch_func_grad_of_a_causal_call_runs_on_the_fused_kernel():
    """torch.func.grad of a causal call (it raised: an autograd.Function needs setup_context under torch.func's
    transforms, and the guarded backward reads values): those calls keep PyTorch's own kernel (torch 2.13's
    ``torch._C._are_functorch_transforms_active``, which sdpa.fused reads: this test fails if it moves)."""
    assert torch._C._are_functorch_transforms_active() is False
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 9, 8, generator=g) for _ in range(3))

    def loss(q):
        return attnkit.scaled_dot_product_attention(q, k, v, is_causal=True).output.sum()

    found = torch.func.grad(loss)(q)
    leaf = q.clone().requires_grad_()
    out = attnkit.scaled_dot_product_attention(leaf, k, v, is_causal=True, backend="reference").output
    (expected,) = torch.autograd.grad(out.sum(), leaf)
    assert max_err(found, expected) <= GRAD_TOL
