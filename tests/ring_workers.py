"""What each rank runs in tests/test_distributed.py (imported by the spawned processes, so torch and attnkit only).

Every rank builds the same whole-sequence inputs from a seed, runs single-process attention on them, then runs
ring attention on its shard, and reports how far its shard of the output and gradients is from the
single-process shard.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

import attnkit
from attnkit import mods
from attnkit.backends.tiles import online
from attnkit.distributed import (
    RingMultiHeadAttention,
    gather_sequence,
    ring,
    ring_attention,
    shard_sequence,
    sum_gradients,
)
from attnkit.masks import Mask

# B batch, H heads, Hkv key/value heads, Lq/Lk whole lengths, D/Dv head dims


@dataclass(frozen=True)
class Case:
    Lq: int
    Lk: int | None = None  # None: self-attention, Lk = Lq
    masking: str = "none"  # none, causal, valid_lens, causal+valid_lens
    layout: str = "contiguous"
    H: int = 2
    Hkv: int = 2
    dtype: torch.dtype = torch.float32
    mod: str = "none"  # a mask_mod (see mask_mod below): none, window, document, document+window, window+user,
    # user, dead

    def __str__(self) -> str:
        kv = "" if self.Hkv == self.H else f" Hkv={self.Hkv}"
        lk = "" if self.Lk is None else f" Lk={self.Lk}"
        mod = "" if self.mod == "none" else f" mask_mod={self.mod}"
        return f"Lq={self.Lq}{lk} {self.masking}{mod} {self.layout}{kv} {self.dtype}".replace("torch.", "")


def mask_mod(case: Case, B: int, Lq: int, Lk: int, g: torch.Generator) -> mods.MaskFn | None:
    """The case's mask_mod over the whole sequence (document ids: the whole sequence's, as every rank passes)."""
    if case.mod == "none":
        return None
    ids_k = torch.randint(0, 3, (B, Lk), generator=g).sort(dim=1).values  # (B, Lk): packed documents
    document = mods.document(ids_k[:, Lk - Lq :], ids_k) if Lq <= Lk else None  # queries are the last keys
    if case.mod == "window":
        return mods.sliding_window(3)
    if case.mod == "document":
        return document
    if case.mod == "document+window":
        return mods.and_masks(document, mods.sliding_window(4))
    if case.mod == "window+user":  # a built-in that skips far steps, with a function only evaluation tells of
        return mods.and_masks(mods.sliding_window(5), lambda b, h, q_idx, kv_idx: (q_idx + kv_idx + h) % 4 != 0)
    if case.mod == "user":  # a function of one's own, by example and head: nothing is known before evaluating it
        return lambda b, h, q_idx, kv_idx: (q_idx + 2 * kv_idx + b + h) % 3 != 1
    if case.mod == "dead":  # queries 1, 5, 9, ... see no key, keys 2, 7, 12, ... are seen by no query
        return lambda b, h, q_idx, kv_idx: (q_idx % 4 != 1) & (kv_idx % 5 != 2) & ((q_idx - kv_idx + h) % 3 != 0)
    raise ValueError(case.mod)


def everything(rank: int, world_size: int, cases: list[Case]) -> dict:
    """One launch of the processes for all the checks that need a healthy group (launching costs seconds)."""
    report = {
        "cases": check_against_single_process(rank, world_size, cases),
        "sends": {layout: count_sends(rank, world_size, layout) for layout in ("contiguous", "zigzag")},
        "scored": {
            (layout, mod): count_scored(rank, world_size, layout, mod)
            for layout in ("contiguous", "zigzag")
            for mod in ("causal", "window", "document")
        },
        "module": {
            layout: module_against_single_process(rank, world_size, layout) for layout in ("contiguous", "zigzag")
        },
        "subgroup": in_a_subgroup(rank, world_size) if world_size > 2 else [],
        "training": train_together(rank, world_size),
    }
    dist.barrier()  # rank 0 hosts the store the others still use: it leaves last
    return report


def in_a_subgroup(rank: int, world_size: int) -> list[tuple[str, str, float, bool]]:
    """Ring attention among ranks 1..W-1 only (a process group that is not the default one); rank 0 stays out."""
    group = dist.new_group(list(range(1, world_size)))  # every rank takes part in making it
    if rank == 0:
        return []
    with online.settings(block_size=3):
        return _check_case(Case(Lq=5 * world_size + 2, masking="causal+valid_lens", layout="zigzag"), 0, group)


def check_against_single_process(rank: int, world_size: int, cases: list[Case]) -> list[tuple[str, str, float, bool]]:
    """For each case and each of output, dq, dk, dv: (case, name, max |ring - single|, within tolerance)."""
    rows = []
    with online.settings(block_size=3):  # several key blocks inside each ring block, and a partial last one
        for i, case in enumerate(cases):
            rows += _check_case(case, seed=i)
    return rows


def _check_case(case: Case, seed: int, group: object | None = None) -> list[tuple[str, str, float, bool]]:
    B, D, Dv = 2, 5, 3
    Lq, Lk = case.Lq, case.Lk or case.Lq
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, case.H, Lq, D, generator=g, dtype=case.dtype)
    k = torch.randn(B, case.Hkv, Lk, D, generator=g, dtype=case.dtype)
    v = torch.randn(B, case.Hkv, Lk, Dv, generator=g, dtype=case.dtype)
    dout = torch.randn(B, case.H, Lq, Dv, generator=g, dtype=case.dtype)
    valid_lens = None
    if "valid_lens" in case.masking:
        valid_lens = torch.tensor([0, Lk // 2] if "empty" in case.masking else [Lk - 2, max(1, Lk // 3)])
        for b, n in enumerate(valid_lens.tolist()):  # padding holds NaN: it must never reach a result
            k[b, :, n:] = v[b, :, n:] = float("nan")
            if n == 0:
                q[b] = float("nan")  # queries with no key to see: neither may they
    is_causal = "causal" in case.masking
    if is_causal and Lq > Lk:
        q[:, :, : Lq - Lk] = float("nan")  # causal queries before the first key see none
    mod = mask_mod(case, B, Lq, Lk, g)
    masks = {"valid_lens": valid_lens, "is_causal": is_causal}
    if mod is not None:  # against the reference, the spec; NaN in every query that sees no key and key none sees
        masks.update(mask_mod=mod, backend="reference")
        allowed = Mask.build(
            batch=B, heads=case.H, num_queries=Lq, num_keys=Lk, valid_lens=valid_lens, is_causal=is_causal, mask_mod=mod
        ).full()[0]
        assert allowed is not None
        allowed = allowed.expand(B, case.H, Lq, Lk)  # (B, H, Lq, Lk)
        q[~allowed.any(dim=-1)] = float("nan")  # (B, H, Lq) dead rows
        dead_keys = ~allowed.any(dim=-2).unflatten(1, (case.Hkv, -1)).any(dim=2)  # (B, Hkv, Lk)
        k[dead_keys], v[dead_keys] = float("nan"), float("nan")
    # and in the output gradient of every row that sees no key (its output is zeros whatever it holds)
    dout = dout.masked_fill(q.isnan().any(dim=-1, keepdim=True), float("nan"))  # (B, H, Lq, Dv)

    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want = attnkit.scaled_dot_product_attention(*full, **masks).output
    want_grads = torch.autograd.grad(want, full, dout)
    truths = (None,) * 4

    def shard(t: torch.Tensor) -> torch.Tensor:
        return shard_sequence(t, layout=case.layout, group=group)

    mine = [shard(t).requires_grad_() for t in (q, k, v)]
    before = [(t.clone(), t._version) for t in mine]
    out = ring_attention(
        *mine, valid_lens=valid_lens, is_causal=is_causal, layout=case.layout, timeout=30, group=group, mask_mod=mod
    )
    grads = torch.autograd.grad(out, mine, shard(dout))
    untouched = all(
        t._version == n and torch.equal(t.nan_to_num(), c.nan_to_num()) for t, (c, n) in zip(mine, before, strict=True)
    )

    if case.dtype == torch.bfloat16:
        # Against the float64 truth: at most twice the error of single-process attention in bfloat16.
        full64 = [t.double().requires_grad_() for t in (q, k, v)]
        truth = attnkit.scaled_dot_product_attention(*full64, **masks).output
        truths = (truth, *torch.autograd.grad(truth, full64, dout.double()))
    rows = []
    names = ("output", "dq", "dk", "dv")
    for name, got, expected, true in zip(names, (out, *grads), (want, *want_grads), truths, strict=True):
        expected = shard(expected)
        if case.dtype == torch.bfloat16:
            true = shard(true)
            err = (got.double() - true).abs().max().item()
            ok = err <= 2 * (expected.double() - true).abs().max().item() + 1e-6
        else:
            err = (got - expected).abs().max().item()
            atol, rtol = (2e-6, 1e-5) if case.dtype == torch.float32 else (1e-12, 1e-10)
            ok = torch.allclose(got, expected, atol=atol, rtol=rtol)
        rows.append((str(case), name, err, ok))
    # and back: gather_sequence undoes shard_sequence
    rows.append((str(case), "inputs unchanged", 0.0, untouched))
    whole = gather_sequence(out.detach(), layout=case.layout, timeout=30, group=group)
    back = torch.equal(shard(whole), out.detach()) and whole.shape == want.shape
    rows.append((str(case), "gather_sequence", (whole - want).abs().max().item(), back and rows[0][3]))
    return rows


def count_sends(rank: int, world_size: int, layout: str) -> dict[str, int]:
    """Point-to-point sends of this rank during one forward and one backward, counted at torch.distributed."""
    counted = {"forward": 0, "backward": 0}
    phase = ["forward"]
    real = dist.batch_isend_irecv

    def counting(ops: list) -> list:
        counted[phase[0]] += sum(op.op is dist.isend for op in ops)
        return real(ops)

    dist.batch_isend_irecv = counting
    try:
        L = 4 * world_size + 1
        q, k, v = (shard_sequence(torch.randn(2, 2, L, 4), layout=layout).requires_grad_() for _ in range(3))
        out = ring_attention(q, k, v, is_causal=True, layout=layout, timeout=30)
        phase[0] = "backward"
        out.sum().backward()
    finally:
        dist.batch_isend_irecv = real
    return counted


def count_scored(rank: int, world_size: int, layout: str, mod: str) -> dict[str, int]:
    """What this rank's forward pass scores, counted where ring hands each step to the chunked backend: the steps
    that reach it (a skipped step does not) and the (query, key) pairs of the key blocks it is given. Causal
    attention over 256 positions per rank in key blocks of 16, alone or with a sliding window of 4 or two
    documents."""
    counted = {"steps": 0, "pairs": 0}
    real = ring.accumulate

    def counting(state, q, k, v, mask, scorer, spans):  # noqa: ANN001
        counted["steps"] += 1
        counted["pairs"] += sum((r1 - r0) * (j1 - j0) for j0, j1, r0, r1, _ in spans)
        return real(state, q, k, v, mask, scorer, spans)

    L = 256 * world_size
    halves = (torch.arange(L) >= L // 2).long()[None]  # (1, L): two documents
    mask_mod = {"causal": None, "window": mods.sliding_window(4), "document": mods.document(halves)}[mod]
    ring.accumulate = counting
    try:
        with online.settings(block_size=16):
            q, k, v = (shard_sequence(torch.randn(1, 1, L, 4), layout=layout) for _ in range(3))
            ring_attention(q, k, v, is_causal=True, layout=layout, timeout=30, mask_mod=mask_mod)
    finally:
        ring.accumulate = real
    return counted


def die_or_hang_mid_run(rank: int, world_size: int, how: str, timeout: float) -> None:
    """Three training steps (forward and backward); rank 1 dies (``how="die"``) or stops answering
    (``how="hang"``) at the second ring step of the second forward. The others must raise, not wait."""
    calls = [0]
    if rank == 1 and how == "die before backward":

        def die(ctx, dout):  # noqa: ANN001
            os._exit(3)

        ring.RingAttention.backward = staticmethod(die)
    elif rank == 1:
        real = ring._forward_block

        def fail_mid_forward(state, q, kv, src, plan):  # noqa: ANN001
            calls[0] += 1
            if calls[0] == world_size + 2:
                if how == "hang":
                    # silent past the others' timeout and past the test's bound on their time (timeout + 2 s), then gone
                    time.sleep(2 * timeout)
                os._exit(3)
            real(state, q, kv, src, plan)

        ring._forward_block = fail_mid_forward
    L = 6 * world_size
    q, k, v = (torch.randn(1, 2, L // world_size, 4, requires_grad=True) for _ in range(3))
    for _ in range(3):
        ring_attention(q, k, v, timeout=timeout, is_causal=True).sum().backward()


def mismatches(rank: int, world_size: int, whats: list[str]) -> list[tuple[str, str, str]]:
    """Each of ``whats`` in turn (a ValueError on every rank leaves the group in step for the next):
    ``(what, error type, first line of the message)``, or ``(what, "", "")`` when nothing was raised."""
    seen = []
    for what in whats:
        try:
            mismatched(rank, world_size, what)
            seen.append((what, "", ""))
        except Exception as e:  # noqa: BLE001 - reported
            seen.append((what, type(e).__name__, str(e).splitlines()[0]))
    dist.barrier()  # rank 0 hosts the store: it leaves last
    return seen


def mismatched(rank: int, world_size: int, what: str) -> None:
    """Rank 2 passes something that does not fit the others (or its own other inputs)."""
    if what == "gather_sequence shapes":
        gather_sequence(torch.zeros(2, 3, 4 if rank == 2 else 5), dim=1, timeout=30)
    if what == "gather_sequence own arguments":
        gather_sequence(torch.zeros(2, 3, 5), dim=5 if rank == 2 else 1, timeout=30)
    if what == "attn_mask on one rank":
        layer = RingMultiHeadAttention(4, 2, query_size=4, key_size=4, value_size=4)
        x = torch.randn(2, 3, 4)
        layer(x, x, x, attn_mask=torch.ones(3, 9, dtype=torch.bool) if rank == 2 else None)
    if what == "score_mod on one rank":
        layer = RingMultiHeadAttention(4, 2, query_size=4, key_size=4, value_size=4)
        x = torch.randn(2, 3, 4)
        layer(x, x, x, score_mod=mods.softcap(5.0) if rank == 2 else None)
    if what == "sum_gradients":
        layer = torch.nn.Linear(2, 2, bias=rank != 2)
        layer(torch.randn(3, 2)).sum().backward()
        sum_gradients(layer, timeout=30)
    if what == "gather_sequence lengths":  # 3 + 3 + 5 is not how 11 positions split over 3 ranks
        gather_sequence(torch.zeros(2, 5 if rank == 2 else 3, 5), dim=1, timeout=30)
    B, H, Lr, D = 2, 2, 4, 4
    shapes = {"q": (B, H, Lr, D), "k": (B, H, Lr, D), "v": (B, H, Lr, D)}
    dtype = torch.float32
    kwargs: dict = {}
    if rank == 2:
        if what == "head dim":
            shapes = {name: (B, H, Lr, D + 1) for name in shapes}
        elif what == "own inputs":
            shapes["v"] = (B, H, Lr - 1, D)
        elif what == "length":
            shapes = {name: (B, H, Lr + 2, D) for name in shapes}
        elif what == "dtype":
            dtype = torch.float64
        elif what == "is_causal":
            kwargs["is_causal"] = True
        elif what == "valid_lens":
            kwargs["valid_lens"] = torch.tensor([3, 4])
        elif what == "mask_mod":
            kwargs["mask_mod"] = mods.sliding_window(3)
        elif what == "document ids":  # its own shard's ids, where every rank needs the whole sequence's
            kwargs["mask_mod"] = mods.document(torch.tensor([[0, 0, 1, 1]]))
    if what == "valid_lens" and rank != 2:
        kwargs["valid_lens"] = torch.tensor([3, 5])
    if what == "mask_mod" and rank != 2:
        kwargs["mask_mod"] = mods.sliding_window(2)
    if what == "document ids" and rank != 2:
        kwargs["mask_mod"] = mods.document(torch.tensor([[0] * 6 + [1] * 6]))
    if what == "document ids everywhere":  # the same on every rank, but a shard's length, not the sequence's 12
        kwargs["mask_mod"] = mods.document(torch.zeros(1, 4, dtype=torch.long))
    if what == "valid_lens too long":  # the same on every rank, but past the 12 keys they hold together
        kwargs["valid_lens"] = torch.tensor([13, 5])
    q, k, v = (torch.randn(shapes[name], dtype=dtype) for name in ("q", "k", "v"))
    ring_attention(q, k, v, timeout=30, **kwargs)


def module_against_single_process(rank: int, world_size: int, layout: str) -> list[tuple[str, float, bool]]:
    """RingMultiHeadAttention on shards vs MultiHeadAttention on the whole sequence: output, input gradient and
    parameter gradients (summed over ranks, as data-parallel training would)."""
    torch.manual_seed(0)
    single = attnkit.MultiHeadAttention(12, 3, num_kv_heads=1, bias=True, query_size=6, key_size=6, value_size=6)
    model = RingMultiHeadAttention(
        12, 3, num_kv_heads=1, bias=True, query_size=6, key_size=6, value_size=6, layout=layout
    )
    model.load_state_dict(single.state_dict())
    x = torch.randn(2, 4 * world_size + 3, 6)
    valid_lens = torch.tensor([x.shape[1] - 1, 5])
    dout = torch.randn(2, x.shape[1], 12)

    rows = []
    for window in (None, mods.sliding_window(3)):  # the layer passes a mask_mod on, in whole-sequence positions
        xs = x.clone().requires_grad_()
        want = single(xs, xs, xs, valid_lens, is_causal=True, mask_mod=window)
        want.backward(dout)

        xr = shard_sequence(x, layout=layout, dim=1).requires_grad_()
        out = model(xr, xr, xr, valid_lens, is_causal=True, mask_mod=window)
        out.backward(shard_sequence(dout, layout=layout, dim=1))
        named = "" if window is None else "window: "
        rows += [
            (f"{named}output", out, shard_sequence(want, layout=layout, dim=1)),
            (f"{named}dx", xr.grad, shard_sequence(xs.grad, layout=layout, dim=1)),
        ]
    sum_gradients(model, timeout=30)
    for (name, p), p_single in zip(model.named_parameters(), single.parameters(), strict=True):
        rows.append((f"summed {name}.grad", p.grad, p_single.grad))
    return [(name, (a - b).abs().max().item(), torch.allclose(a, b, atol=2e-6, rtol=1e-5)) for name, a, b in rows]


def train_together(rank: int, world_size: int) -> list[tuple[str, float, bool]]:
    """Five Adam steps of RingMultiHeadAttention with sum_gradients == five steps on the whole sequence."""
    torch.manual_seed(1)
    single = attnkit.MultiHeadAttention(8, 2, query_size=4, key_size=4, value_size=4)
    model = RingMultiHeadAttention(8, 2, query_size=4, key_size=4, value_size=4, layout="zigzag")
    model.load_state_dict(single.state_dict())
    x, target = torch.randn(2, 3 * world_size + 1, 4), torch.randn(2, 3 * world_size + 1, 8)
    x_r, target_r = (shard_sequence(t, layout="zigzag", dim=1) for t in (x, target))
    opt_single, opt = torch.optim.Adam(single.parameters(), lr=0.1), torch.optim.Adam(model.parameters(), lr=0.1)
    for _ in range(5):
        opt_single.zero_grad()
        ((single(x, x, x, is_causal=True) - target) ** 2).sum().backward()
        opt_single.step()
        opt.zero_grad()
        ((model(x_r, x_r, x_r, is_causal=True) - target_r) ** 2).sum().backward()  # this rank's share of the loss
        sum_gradients(model, timeout=30)
        opt.step()
    return [
        (name, (a - b).abs().max().item(), torch.allclose(a, b, atol=1e-5, rtol=1e-4))
        for (name, a), b in zip(model.named_parameters(), single.parameters(), strict=True)
    ]
