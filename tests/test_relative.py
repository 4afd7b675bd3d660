"""attnkit.mods.relative: which score_mods are a bias on the distance q_idx - kv_idx (proved from their traced
graph, never guessed), and the values and gradients of that bias (the flash backend's tests run it in the kernel)."""

from __future__ import annotations

import concurrent.futures
import gc
import logging
import weakref

import pytest
import torch

from attnkit import mods
from attnkit.mods import relative

L, H = 8, 3
TABLE = torch.randn(2 * L - 1)
BY_HEAD = torch.randn(H, 2 * L - 1)
KEYS = torch.randn(5)

DISTANCE = {
    "a table": lambda s, b, h, q, kv: s + TABLE[q - kv + L - 1],
    "a table per head, clamped": lambda s, b, h, q, kv: s + BY_HEAD[h, (q - kv).clamp(-L + 1, L - 1) + L - 1] * 2.0,
    "alibi as a function": lambda s, b, h, q, kv: s - (h + 1) * 0.5 * (q - kv).abs(),
    "kv - q": lambda s, b, h, q, kv: s + (kv - q) * 0.1,
    "both moved": lambda s, b, h, q, kv: s + TABLE[(q + 3) - (kv + 3) + L - 1],
    "twice the distance": lambda s, b, h, q, kv: s + (2 * q - 2 * kv),
    "a square": lambda s, b, h, q, kv: s + (q - kv) * (q - kv),
    "T5-like buckets": lambda s, b, h, q, kv: s + BY_HEAD[h, torch.log1p((q - kv).abs().float()).long().clamp(max=5)],
    "floor division": lambda s, b, h, q, kv: s + TABLE[((q - kv).abs() // 3).clamp(max=2 * L - 2)],
    "a constant": lambda s, b, h, q, kv: s + 1.0,
    "score - bias": lambda s, b, h, q, kv: s - TABLE[q - kv + L - 1],
}

NOT_DISTANCE = {
    "the score alone": lambda s, b, h, q, kv: s,
    "the score scaled": lambda s, b, h, q, kv: s * 2 + (q - kv),
    "the query's position": lambda s, b, h, q, kv: s + q * 0.1,
    "a bias per key": lambda s, b, h, q, kv: s + KEYS[kv],
    "a tensor broadcast against the block": lambda s, b, h, q, kv: s + KEYS,
    "tanh of the score": lambda s, b, h, q, kv: torch.tanh(s) + (q - kv),
    "Python if on a value": lambda s, b, h, q, kv: s + 1 if (q > 1).any() else s,
    "random": lambda s, b, h, q, kv: s + torch.rand_like(s) * (q - kv),
    "a comparison of positions": lambda s, b, h, q, kv: torch.where(q >= kv, s, s - 1),
    "in place": lambda s, b, h, q, kv: s.add_(q - kv),
    "a slice of a table": lambda s, b, h, q, kv: s + BY_HEAD[:, q - kv].sum(0),
    "2q - kv": lambda s, b, h, q, kv: s + (2 * q - kv),
    "a reduction": lambda s, b, h, q, kv: s + (q - kv).float().mean(),
    "softcap": mods.softcap(30.0),
    "a wrong signature": lambda s, b, h: s,
    # a size read off the block is a constant in one trace: the function differs between blocks (tester's finding)
    "ALiBi's slopes from score.size(1)": lambda s, b, h, q, kv: (
        s - torch.exp2(-8.0 * (h + 1) / s.size(1)) * (q - kv).abs()
    ),
    "an offset from kv_idx.shape": lambda s, b, h, q, kv: s + TABLE[(q - kv + kv.shape[-1]).clamp(0, 2 * L - 2)],
    "a scale from numel()": lambda s, b, h, q, kv: s + (q - kv) / q.numel(),
}


@pytest.mark.parametrize("name", list(DISTANCE))
def test_a_bias_on_the_distance_is_proved(name):
    assert mods.is_distance_bias(DISTANCE[name])


@pytest.mark.parametrize("name", list(NOT_DISTANCE))
def test_anything_else_is_not(name, caplog, capfd):
    """And says nothing while finding out (FakeTensor logs a failed operation's traceback as an error)."""
    with caplog.at_level(logging.DEBUG, logger="torch._subclasses.fake_tensor"):
        assert not mods.is_distance_bias(NOT_DISTANCE[name])
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert capfd.readouterr().err == ""


def test_a_function_found_not_to_be_one_is_not_traced_again(monkeypatch):
    """Made again (a lambda in a layer's forward) with the same code and closure: remembered."""
    traced = []
    real = relative._traced_form
    monkeypatch.setattr(relative, "_traced_form", lambda fn: traced.append(fn) or real(fn))
    monkeypatch.setattr(relative, "_NOT_DISTANCE", weakref.WeakKeyDictionary())

    def make(table):
        return lambda s, b, h, q, kv: s + table[kv]

    assert not mods.is_distance_bias(make(KEYS)) and not mods.is_distance_bias(make(KEYS))
    assert len(traced) == 1
    assert not mods.is_distance_bias(make(KEYS.clone()))  # another tensor: asked again
    assert len(traced) == 2
    assert mods.is_distance_bias(DISTANCE["a table"]) and mods.is_distance_bias(DISTANCE["a table"])
    assert len(traced) == 4  # one that is: traced at each call


def test_what_is_remembered_holds_no_tensor_and_goes_with_it(monkeypatch):
    """The memory of a function found not to be one keeps neither its tensors nor its code alive: a table freed
    is freed, and a function made over a new table is traced again."""
    traced = []
    real = relative._traced_form
    monkeypatch.setattr(relative, "_traced_form", lambda fn: traced.append(None) or real(fn))
    monkeypatch.setattr(relative, "_NOT_DISTANCE", weakref.WeakKeyDictionary())

    def make(table):
        return lambda s, b, h, q, kv: s + table[kv]

    table = KEYS.clone()
    alive = weakref.ref(table)
    assert not mods.is_distance_bias(make(table))
    del table
    gc.collect()
    assert alive() is None
    assert not mods.is_distance_bias(make(KEYS.clone())) and len(traced) == 2
    code = make(KEYS).__code__
    assert code in relative._NOT_DISTANCE
    assert len(relative._NOT_DISTANCE[code]) <= relative._REMEMBERED


def test_threads_asking_at_once_get_the_same_answers_and_leave_the_logger_alone():
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level, filters = logger.level, list(logger.filters)
    names = ["a table", "T5-like buckets"] * 4
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        found = list(pool.map(lambda n: mods.is_distance_bias(DISTANCE[n]), names))
        refused = list(pool.map(lambda n: mods.is_distance_bias(NOT_DISTANCE[n]), ["in place", "random"] * 4))
    assert all(found) and not any(refused)
    assert logger.level == level and logger.filters == filters


def test_a_subclass_of_alibi_that_computes_something_else_is_not_one():
    class Doubled(mods.alibi):
        def __call__(self, score, b, h, q_idx, kv_idx):
            return 2 * super().__call__(score, b, h, q_idx, kv_idx)

    assert mods.is_distance_bias(mods.alibi(torch.ones(H))) and not mods.is_distance_bias(Doubled(torch.ones(H)))


def test_a_bound_alibi_is_one():
    bound = mods.bind(mods.alibi(mods.alibi_slopes(H)), batch=2, heads=H, num_queries=5, num_keys=9, device=None)
    assert mods.is_distance_bias(bound)


def test_the_bias_is_the_function_at_each_distance_and_carries_its_gradient():
    """f(b, h, d) for d in [d0, d1), computed by the function (with the bottom-right offset of a bound ALiBi too),
    and autograd takes its gradient to the table it reads."""
    table = TABLE.clone().requires_grad_()
    fn = lambda s, b, h, q, kv: s + table[q - kv + L - 1]  # noqa: E731
    rel = mods.distance_bias(fn, batch=2, heads=H, distances=(-3, 5), device="cpu")
    assert rel.shape == (1, 1, 8) and rel.dtype == torch.float32
    assert torch.equal(rel[0, 0], TABLE[torch.arange(-3, 5) + L - 1])
    rel.sum().backward()
    assert torch.equal(table.grad, ((torch.arange(2 * L - 1) >= L - 4) & (torch.arange(2 * L - 1) < L + 4)).float())
    slopes = torch.tensor([1.0, 0.5, 0.25])
    bound = mods.bind(mods.alibi(slopes), batch=2, heads=H, num_queries=5, num_keys=9, device=None)  # offset 4
    rel = mods.distance_bias(bound, batch=2, heads=H, distances=(-8, 5), device="cpu")
    d = torch.arange(-8, 5)
    assert rel.shape == (1, H, 13)
    assert torch.equal(rel[0], -slopes[:, None] * (d + 4).abs())


def test_a_function_that_returns_no_scores_is_a_type_error():
    with pytest.raises(TypeError, match="floating point"):
        mods.distance_bias(lambda s, b, h, q, kv: q - kv, batch=1, heads=1, distances=(0, 3), device="cpu")
