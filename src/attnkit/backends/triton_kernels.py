"""Triton kernels of additive attention, ``s[i, j] = w . tanh(q[i] + k[j])``: the features are made a chunk of
``BD`` at a time inside a ``BM x BN`` tile of scores and reduced at once, so the ``(Lq, Lk, D)`` features are never
stored; an online softmax over key blocks (FlashAttention's) keeps memory linear in the length.

Imported only when :mod:`attnkit.backends.triton` runs. With ``TRITON_INTERPRET=1`` in the environment when triton
is first imported, ``triton.jit`` gives Triton's interpreter instead (numpy on the host, CPU tensors): how the tests
check these kernels without a GPU. The math, per tile, with ``t = tanh(q_i + k_j)`` (per feature) and ``lse`` each
row's log-sum-exp::

    forward:   m, l, acc: the running maximum, normaliser and output of the online softmax
    backward:  p = exp(s - lse) where allowed, dp = dO v^T, ds = p (dp - delta), delta_i = dO_i . O_i
               dq_i = sum_j ds_ij w (1 - t^2),  dk_j = sum_i ds_ij w (1 - t^2),  dw = sum_ij ds_ij t,
               dv_j = sum_i p_ij dO_i

Which pairs are allowed: row ``i < Lq``, key ``j < lens[b, i]`` (``valid_lens``, ``Lk`` without), and with
``CAUSAL`` ``j <= i + Lk - Lq`` (bottom right). Inputs are contiguous ``(B, H, L, D)`` (keys and values
``(B, Hkv, L, D)``: ``GROUP = H / Hkv`` query heads share one); sums run in ``ACC`` (float32, or float64 for float64
inputs), ``tanh(x)`` as ``1 - 2 / (exp(2 x) + 1)`` (exact at both ends: ``exp`` overflows to ``inf`` or to 0).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton import knobs

#: Whether ``triton.jit`` made these kernels for Triton's interpreter (``TRITON_INTERPRET=1``): it patches
#: ``triton.language`` while a kernel runs, so two threads at once corrupt each other's results; launches are then
#: serialised (:mod:`attnkit.backends.triton`).
INTERPRETED = bool(knobs.runtime.interpret)

# B batch, H heads, Hkv key/value heads, Lq/Lk query/key length, D features (h), Dv value head dim;
# BM query rows, BN keys, BD features, BDV value columns of one tile (powers of two)


@triton.jit
def _tanh_chunk(q_base, k_base, w_ptr, rows, cols, row_ok, col_ok, d0, D, ACC: tl.constexpr, BD: tl.constexpr):
    """``t = tanh(q_i + k_j)`` for features ``d0 .. d0 + BD`` ``(BM, BN, BD)``, ``w`` there, and the features."""
    feats = d0 + tl.arange(0, BD)  # (BD,)
    d_ok = feats < D
    qd = tl.load(q_base + rows[:, None] * D + feats[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    kd = tl.load(k_base + cols[:, None] * D + feats[None, :], mask=col_ok[:, None] & d_ok[None, :], other=0.0)
    wd = tl.load(w_ptr + feats, mask=d_ok, other=0.0).to(ACC)  # (BD,)
    x = qd.to(ACC)[:, None, :] + kd.to(ACC)[None, :, :]  # (BM, BN, BD)
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0), wd, feats, d_ok  # tanh(x) (BM, BN, BD): padded features 0


@triton.jit
def _scores(q_base, k_base, w_ptr, rows, cols, row_ok, col_ok, D, ACC: tl.constexpr, BD: tl.constexpr):
    """The tile's ``(BM, BN)`` scores, a chunk of ``BD`` features at a time."""
    s = tl.zeros((rows.shape[0], cols.shape[0]), dtype=ACC)  # (BM, BN)
    for d0 in range(0, D, BD):
        t, wd, _, _ = _tanh_chunk(q_base, k_base, w_ptr, rows, cols, row_ok, col_ok, d0, D, ACC, BD)
        s += tl.sum(t * wd[None, None, :], axis=2)  # (BM, BN)
    return s


@triton.jit
def _allowed(rows, cols, lens, Lq, Lk, OFFSET, CAUSAL: tl.constexpr):
    ok = (rows < Lq)[:, None] & (cols < Lk)[None, :] & (cols[None, :] < lens[:, None])  # (BM, BN)
    if CAUSAL:
        ok = ok & (cols[None, :] <= rows[:, None] + OFFSET)
    return ok


@triton.jit
def _rows_of(base, rows, vcols, row_ok, Dv, ACC: tl.constexpr):
    """Rows ``rows`` of a ``(L, Dv)`` matrix at ``base``, columns padded to ``BDV``, in ``ACC``; zeros where masked
    (they meet weights of 0, and Triton leaves masked lanes undefined without ``other``)."""
    return tl.load(
        base + rows[:, None] * Dv + vcols[None, :], mask=row_ok[:, None] & (vcols < Dv)[None, :], other=0.0
    ).to(ACC)


@triton.jit
def _program(H, GROUP):
    """This program's (example, query head) as one index, its example, its key/value head, and its block."""
    bh = tl.program_id(0).to(tl.int64)
    b, h = bh // H, bh % H
    return bh, b, b * (H // GROUP) + h // GROUP, tl.program_id(1)


@triton.jit
def _keys_end(lens, Lk, pid_m, OFFSET, CAUSAL: tl.constexpr, BM: tl.constexpr):
    """Where a block of query rows stops reading keys: past every row's length, and past the causal diagonal."""
    hi = tl.minimum(tl.max(lens, axis=0), Lk)
    if CAUSAL:
        hi = tl.minimum(hi, pid_m * BM + BM + OFFSET)
    return hi


@triton.jit
def _forward(
    Q, K, V, W, LENS, OUT, LSE,
    H, GROUP, Lq, Lk, D, Dv, OFFSET,
    CAUSAL: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
):  # fmt: skip
    """One block of ``BM`` query rows of one (example, head): the output and each row's log-sum-exp."""
    bh, b, kv, pid_m = _program(H, GROUP)  # kv: the key/value head this query head reads
    rows = pid_m * BM + tl.arange(0, BM)  # (BM,)
    row_ok = rows < Lq
    lens = tl.load(LENS + b * Lq + rows, mask=row_ok, other=0)  # (BM,)
    q_base, k_base, v_base = Q + bh * Lq * D, K + kv * Lk * D, V + kv * Lk * Dv
    vcols = tl.arange(0, BDV)
    m = tl.full((BM,), float("-inf"), dtype=ACC)  # running row maximum
    l = tl.zeros((BM,), dtype=ACC)  # noqa: E741  (running normaliser)
    acc = tl.zeros((BM, BDV), dtype=ACC)  # running unnormalised output
    hi = _keys_end(lens, Lk, pid_m, OFFSET, CAUSAL, BM)  # keys past it are never read
    for n0 in range(0, hi, BN):
        cols = n0 + tl.arange(0, BN)  # (BN,)
        col_ok = cols < Lk
        s = _scores(q_base, k_base, W, rows, cols, row_ok, col_ok, D, ACC, BD)  # (BM, BN)
        s = tl.where(_allowed(rows, cols, lens, Lq, Lk, OFFSET, CAUSAL), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw no key yet stays at zeros
        alpha = tl.exp(m - m_use)  # rescales what was summed so far
        p = tl.exp(s - m_use[:, None])  # (BM, BN)
        l = l * alpha + tl.sum(p, axis=1)  # noqa: E741
        vb = _rows_of(v_base, cols, vcols, col_ok, Dv, ACC)  # (BN, BDV)
        acc = acc * alpha[:, None] + tl.dot(p, vb, input_precision=PRECISION)  # (BM, BDV)
        m = m_new
    live = l != 0.0  # (NaN from a NaN input stays NaN, as on every backend; only a row that saw no key is 0)
    out = tl.where(live[:, None], acc / tl.where(live, l, 1.0)[:, None], 0.0)  # rows with no key: zeros
    o_ptr = OUT + bh * Lq * Dv + rows[:, None] * Dv + vcols[None, :]
    tl.store(o_ptr, out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & (vcols < Dv)[None, :])
    tl.store(LSE + bh * Lq + rows, tl.where(live, m + tl.log(tl.where(live, l, 1.0)), 0.0), mask=row_ok)


@triton.jit
def _weights_grad(
    q_base, k_base, v_base, W, lens, lse, delta, do, rows, cols, vcols, row_ok, col_ok,
    Lq, Lk, D, Dv, OFFSET,
    CAUSAL: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr, BD: tl.constexpr,
):  # fmt: skip
    """A tile's weights ``p`` and the gradient ``ds`` of its scores, each ``(BM, BN)``."""
    s = _scores(q_base, k_base, W, rows, cols, row_ok, col_ok, D, ACC, BD)  # (BM, BN)
    allowed = _allowed(rows, cols, lens, Lq, Lk, OFFSET, CAUSAL)
    p = tl.where(allowed, tl.exp(s - lse[:, None]), 0.0)  # (BM, BN)
    vb = _rows_of(v_base, cols, vcols, col_ok, Dv, ACC)  # (BN, BDV)
    dp = tl.dot(do, tl.trans(vb), input_precision=PRECISION)  # (BM, BN)
    return p, p * (dp - delta[:, None])


@triton.jit
def _backward_keys(
    Q, K, V, W, LENS, KEYS, LSE, DELTA, DO, DK, DV, DW,
    H, GROUP, Lq, Lk, D, Dv, OFFSET,
    CAUSAL: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
):  # fmt: skip
    """One block of ``BN`` keys of one (example, query head): its keys' and values' gradients from this head
    (``DK``, ``DV`` per query head: the caller sums a group), and this block's share of ``w``'s (``DW``)."""
    bh, b, kv, pid_n = _program(H, GROUP)
    cols = pid_n * BN + tl.arange(0, BN)  # (BN,)
    col_ok = cols < Lk
    vcols = tl.arange(0, BDV)
    q_base, k_base, v_base = Q + bh * Lq * D, K + kv * Lk * D, V + kv * Lk * Dv
    dk_base, dw_base = DK + bh * Lk * D, DW + (bh * tl.num_programs(1) + pid_n) * D
    dv = tl.zeros((BN, BDV), dtype=ACC)
    lo = 0
    if CAUSAL:  # the first query row that may see this block's first key, rounded down to a block
        lo = tl.maximum(pid_n * BN - OFFSET, 0) // BM * BM
    hi = tl.where(pid_n * BN < tl.load(KEYS + b), Lq, lo)  # KEYS[b]: the most keys a row of b sees; past: none
    for m0 in range(lo, hi, BM):
        rows = m0 + tl.arange(0, BM)  # (BM,)
        row_ok = rows < Lq
        lens = tl.load(LENS + b * Lq + rows, mask=row_ok, other=0)  # (BM,)
        lse = tl.load(LSE + bh * Lq + rows, mask=row_ok, other=0.0)  # (BM,)
        delta = tl.load(DELTA + bh * Lq + rows, mask=row_ok, other=0.0)  # (BM,)
        do = _rows_of(DO + bh * Lq * Dv, rows, vcols, row_ok, Dv, ACC)  # (BM, BDV)
        p, ds = _weights_grad(
            q_base, k_base, v_base, W, lens, lse, delta, do, rows, cols, vcols, row_ok, col_ok,
            Lq, Lk, D, Dv, OFFSET, CAUSAL, ACC, PRECISION, BD,
        )  # fmt: skip
        dv += tl.dot(tl.trans(p), do, input_precision=PRECISION)  # (BN, BDV)
        for d0 in range(0, D, BD):
            t, wd, feats, d_ok = _tanh_chunk(q_base, k_base, W, rows, cols, row_ok, col_ok, d0, D, ACC, BD)
            dk = tl.sum(ds[:, :, None] * (1.0 - t * t), axis=0) * wd[None, :]  # (BN, BD)
            dw = tl.sum(tl.sum(ds[:, :, None] * t, axis=0), axis=0)  # (BD,)
            at, here = dk_base + cols[:, None] * D + feats[None, :], col_ok[:, None] & d_ok[None, :]
            # each element belongs to this program alone (atomics: whichever of its threads adds it, nothing is lost)
            tl.atomic_add(at, dk, mask=here, sem="relaxed")
            tl.atomic_add(dw_base + feats, dw, mask=d_ok, sem="relaxed")
    dv_ptr = DV + bh * Lk * Dv + cols[:, None] * Dv + vcols[None, :]
    tl.store(dv_ptr, dv, mask=col_ok[:, None] & (vcols < Dv)[None, :])


@triton.jit
def _backward_queries(
    Q, K, V, W, LENS, LSE, DELTA, DO, DQ,
    H, GROUP, Lq, Lk, D, Dv, OFFSET,
    CAUSAL: tl.constexpr, ACC: tl.constexpr, PRECISION: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
):  # fmt: skip
    """One block of ``BM`` query rows of one (example, head): the queries' gradient ``DQ``."""
    bh, b, kv, pid_m = _program(H, GROUP)
    rows = pid_m * BM + tl.arange(0, BM)  # (BM,)
    row_ok = rows < Lq
    vcols = tl.arange(0, BDV)
    q_base, k_base, v_base, dq_base = Q + bh * Lq * D, K + kv * Lk * D, V + kv * Lk * Dv, DQ + bh * Lq * D
    lens = tl.load(LENS + b * Lq + rows, mask=row_ok, other=0)  # (BM,)
    lse = tl.load(LSE + bh * Lq + rows, mask=row_ok, other=0.0)  # (BM,)
    delta = tl.load(DELTA + bh * Lq + rows, mask=row_ok, other=0.0)  # (BM,)
    do = _rows_of(DO + bh * Lq * Dv, rows, vcols, row_ok, Dv, ACC)  # (BM, BDV)
    hi = _keys_end(lens, Lk, pid_m, OFFSET, CAUSAL, BM)
    for n0 in range(0, hi, BN):
        cols = n0 + tl.arange(0, BN)  # (BN,)
        col_ok = cols < Lk
        _, ds = _weights_grad(
            q_base, k_base, v_base, W, lens, lse, delta, do, rows, cols, vcols, row_ok, col_ok,
            Lq, Lk, D, Dv, OFFSET, CAUSAL, ACC, PRECISION, BD,
        )  # fmt: skip
        for d0 in range(0, D, BD):
            t, wd, feats, d_ok = _tanh_chunk(q_base, k_base, W, rows, cols, row_ok, col_ok, d0, D, ACC, BD)
            dq = tl.sum(ds[:, :, None] * (1.0 - t * t), axis=1) * wd[None, :]  # (BM, BD)
            at, here = dq_base + rows[:, None] * D + feats[None, :], row_ok[:, None] & d_ok[None, :]
            tl.atomic_add(at, dq, mask=here, sem="relaxed")  # (rows of this program alone)
