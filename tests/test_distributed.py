"""Ring attention on real processes (gloo on CPU): exactness against single-process attention, the number of
sends, balanced causal work, failures that must not hang, and disagreements that must be named."""

from __future__ import annotations

import functools
import random
import subprocess
import sys
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ring_workers as w
from attnkit import mods
from attnkit.distributed import sequence
from attnkit.distributed.plan import Plan, StepMask, step_span
from attnkit.plan import key_blocks
from ranks import run_ranks

pytestmark = pytest.mark.distributed

MASKINGS = ("none", "causal", "valid_lens", "causal+valid_lens")
LAYOUTS = ("contiguous", "zigzag")


def _cases(world_size: int) -> list[w.Case]:
    cases = [
        w.Case(Lq=L, masking=m, layout=lay)
        for L in (4 * world_size, 4 * world_size + 3)  # divisible by W (and 2W for zig-zag), and not
        for m in MASKINGS
        for lay in LAYOUTS
    ]
    return cases + [
        w.Case(Lq=3 * world_size + 1, H=4, Hkv=2, masking="causal+valid_lens", layout="zigzag"),  # grouped heads
        w.Case(Lq=2 * world_size + 1, Lk=5 * world_size, masking="causal", layout="zigzag"),  # Lq < Lk, bottom right
        w.Case(Lq=5 * world_size, Lk=3 * world_size + 2, masking="causal+valid_lens"),  # Lq > Lk: dead rows
        w.Case(Lq=world_size, masking="causal", layout="zigzag"),  # L = W: one position per rank
        w.Case(Lq=3 * world_size + 2, masking="valid_lens+empty"),  # valid_lens [0, Lk // 2]: rows with no key
        w.Case(Lq=3 * world_size + 2, masking="causal+valid_lens+empty", layout="zigzag"),
        w.Case(Lq=4 * world_size + 1, masking="causal+valid_lens", layout="zigzag", dtype=torch.float64),
        w.Case(Lq=4 * world_size + 1, masking="causal+valid_lens", layout="zigzag", dtype=torch.bfloat16),
        *_random_cases(world_size),
        *_mask_mod_cases(world_size),
    ]


MASK_MODS = ("window", "document", "document+window", "user", "dead")


def _mask_mod_cases(world_size: int) -> list[w.Case]:
    """Ring with a mask_mod against the reference backend in float64 (NaN in every query that sees no key and every
    key no query sees): each mask_mod, causal, both layouts; then unequal lengths, valid_lens, grouped heads."""
    f64 = torch.float64
    L = 4 * world_size + 3
    return [
        *(w.Case(Lq=L, masking="causal", layout=lay, mod=mod, dtype=f64) for mod in MASK_MODS for lay in LAYOUTS),
        w.Case(Lq=L, mod="window", layout="zigzag", dtype=f64),  # sliding_window without is_causal: causal itself
        w.Case(Lq=L, mod="dead", dtype=f64),
        w.Case(Lq=L, masking="causal", mod="window+user", layout="zigzag", dtype=f64),
        w.Case(
            Lq=2 * world_size + 1,
            Lk=5 * world_size,
            masking="causal+valid_lens",
            mod="window",
            layout="zigzag",
            dtype=f64,
        ),  # Lq < Lk: keys before the first window are dead
        w.Case(Lq=5 * world_size, Lk=3 * world_size + 2, mod="window", dtype=f64),  # Lq > Lk: rows before the keys
        w.Case(Lq=2 * world_size + 1, Lk=5 * world_size, masking="causal", mod="document", dtype=f64),
        w.Case(
            Lq=3 * world_size + 2,
            masking="causal+valid_lens",
            mod="document+window",
            layout="zigzag",
            H=4,
            Hkv=2,
            dtype=f64,
        ),
        w.Case(Lq=3 * world_size + 2, masking="valid_lens+empty", mod="user", H=4, Hkv=2, dtype=f64),
        w.Case(Lq=L, masking="causal", mod="document+window", layout="zigzag"),  # float32 against float32
    ]


def _random_cases(world_size: int, n: int = 12) -> list[w.Case]:
    """Sizes and options drawn from a seed (the same cases on every rank and every run)."""
    rng = random.Random(world_size)
    cases = []
    for _ in range(n):
        Hkv = rng.choice([1, 2])
        cases.append(
            w.Case(
                Lq=rng.randint(world_size, 6 * world_size + 5),
                Lk=rng.choice([None, rng.randint(world_size, 6 * world_size + 5)]),
                masking=rng.choice(MASKINGS),
                layout=rng.choice(LAYOUTS),
                H=Hkv * rng.choice([1, 2]),
                Hkv=Hkv,
            )
        )
    return cases


def _ok(outcomes: list) -> list:
    errors = [f"rank {o.rank}: {o.error[1]}" for o in outcomes if o.error]
    assert not errors, "\n".join(errors)
    assert all(o.finished for o in outcomes), [o.rank for o in outcomes if not o.finished]
    return [o.value for o in outcomes]


@functools.cache
def _healthy_run(world_size: int) -> list[dict]:
    """Every rank's report from one launch of ``world_size`` processes (tests below read parts of it)."""
    return _ok(run_ranks(w.everything, world_size, _cases(world_size), deadline=300))


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_output_and_gradients_equal_single_process(world_size):
    """float32: atol 2e-6, rtol 1e-5 (float64: 1e-12, 1e-10), every masking, both layouts, L divisible or not;
    and gather_sequence(ring output) is the whole single-process output."""
    per_rank = [report["cases"] for report in _healthy_run(world_size)]
    bad = [(rank, *row) for rank, rows in enumerate(per_rank) for row in rows if not row[3]]
    assert not bad, bad
    assert all(len(rows) == 6 * len(_cases(world_size)) for rows in per_rank)


@pytest.mark.parametrize("world_size", [3, 4])
def test_a_process_group_other_than_the_default(world_size):
    """Ranks 1..W-1 in their own group (peers are found by global rank); rank 0 stays out."""
    per_rank = [report["subgroup"] for report in _healthy_run(world_size)]
    assert per_rank[0] == [] and all(len(rows) == 6 for rows in per_rank[1:]), per_rank
    bad = [(rank, *row) for rank, rows in enumerate(per_rank) for row in rows if not row[3]]
    assert not bad, bad


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_one_send_per_step(world_size):
    """W - 1 sends per rank per forward, counted at torch.distributed; the backward sends the blocks again
    (W - 1) and the gradients that travel with them (W, the last one home)."""
    backward = 0 if world_size == 1 else 2 * world_size - 1
    for report in _healthy_run(world_size):
        for layout in LAYOUTS:
            assert report["sends"][layout] == {"forward": world_size - 1, "backward": backward}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mask_mods_skip_the_steps_and_blocks_they_hide(layout):
    """4 ranks, 256 positions each, causal, counted where ring hands a step to the chunked backend. Steps: with a
    sliding window of 4 a rank visits its own block and its neighbours' only (contiguous: the one before); with two
    documents (the halves) the second half skips the first. Blocks inside a step: the window scores about half the
    pairs of causal attention in the diagonal step (the key blocks skip the row blocks below the band; row blocks
    are 64 rows), and a quarter in all."""
    reports = [report["scored"] for report in _healthy_run(4)]
    causal = [r[(layout, "causal")] for r in reports]
    window = [r[(layout, "window")] for r in reports]
    document = [r[(layout, "document")] for r in reports]
    if layout == "contiguous":
        assert [c["steps"] for c in causal] == [1, 2, 3, 4], causal
        assert [c["steps"] for c in window] == [1, 2, 2, 2], window
        assert [c["steps"] for c in document] == [1, 2, 1, 2], document
        assert window[0]["pairs"] < 0.6 * causal[0]["pairs"], (window, causal)  # rank 0: the diagonal step only
    else:  # each rank holds a chunk of each half (so sees every rank's, for documents) and two chunks' neighbours
        assert all(c["steps"] == 4 for c in causal), causal
        assert all(c["steps"] <= 3 for c in window), window
    assert sum(c["pairs"] for c in window) <= sum(c["pairs"] for c in causal) / 4, (window, causal)
    assert sum(c["pairs"] for c in document) < sum(c["pairs"] for c in causal) / 1.5, (document, causal)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world_size", [1, 3])
def test_module_equals_multi_head_attention(world_size, layout):
    """RingMultiHeadAttention on shards == MultiHeadAttention on the whole sequence (GQA, bias, causal,
    valid_lens): output, input gradient, and parameter gradients summed over ranks."""
    per_rank = [report["module"][layout] for report in _healthy_run(world_size)]
    bad = [(rank, *row) for rank, rows in enumerate(per_rank) for row in rows if not row[2]]
    assert not bad, bad


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_training_with_summed_gradients_equals_training_on_the_whole_sequence(world_size):
    """Five Adam steps: RingMultiHeadAttention + sum_gradients on every rank == MultiHeadAttention on one."""
    per_rank = [report["training"] for report in _healthy_run(world_size)]
    bad = [(rank, *row) for rank, rows in enumerate(per_rank) for row in rows if not row[2]]
    assert not bad, bad


@pytest.mark.parametrize("how", ["die", "hang", "die before backward"])
def test_a_failed_rank_does_not_hang_the_others(how):
    """Rank 1 of 4 dies (or stops answering) in the middle of the second of three training steps, or as its
    first backward pass starts: every other rank raises RingError naming the step it was in, within the 3 s
    timeout, instead of waiting forever (also when the failure shows as a send or receive is started)."""
    timeout = 3.0
    outcomes = run_ranks(w.die_or_hang_mid_run, 4, how, timeout, deadline=60)
    assert not outcomes[1].finished  # died without a word
    for o in outcomes[:1] + outcomes[2:]:
        assert o.finished and o.error is not None, o
        kind, message = o.error
        assert kind == "RingError", message
        assert message.startswith("ring_attention") and "step" in message, message
        print(o.rank, f"{o.seconds:.2f} s", message.splitlines()[0])
        assert o.seconds < timeout + 2.0, (o.seconds, message)


MISMATCHES = {
    "head dim": "disagree on the head dim",
    "dtype": "disagree on the dtype",
    "is_causal": "disagree on is_causal",
    "valid_lens": "disagree on valid_lens",
    "mask_mod": "disagree on the mask_mod",
    "document ids": "disagree on the mask_mod",
    "document ids everywhere": "document: ids_q must have shape (B, Lq) = (2, 12) or (1, 12), got (1, 4)",
    "length": "the contiguous split of 14 positions over 3 ranks gives it 5",
    "own inputs": "rejected its inputs",
    "valid_lens too long": "valid_lens may be at most the number of keys (12), got 13",
    "gather_sequence shapes": "hold shards that differ apart from the sequence:",
    "gather_sequence lengths": "ranks hold [3, 3, 5] positions, but the contiguous split of 11 positions",
    "gather_sequence own arguments": "rejected its inputs",
    "attn_mask on one rank": "rejected its inputs",
    "score_mod on one rank": "rejected its inputs",
    "sum_gradients": "hold different gradients",
}


@functools.cache
def _mismatch_run() -> list[dict[str, tuple[str, str]]]:
    outcomes = _ok(run_ranks(w.mismatches, 3, list(MISMATCHES), deadline=120))
    return [{what: (kind, message) for what, kind, message in seen} for seen in outcomes]


@pytest.mark.parametrize(
    "what",
    [m for m in MISMATCHES if MISMATCHES[m] != "rejected its inputs" and "too long" not in m and "everywhere" not in m],
)
def test_mismatch_is_a_value_error_on_every_rank(what):
    """Rank 2 differs: every rank raises ValueError naming rank 2 (for lengths: every rank's count); for
    ring_attention and for gather_sequence."""
    for rank, seen in enumerate(_mismatch_run()):
        kind, message = seen[what]
        assert kind == "ValueError", (rank, kind, message)
        assert MISMATCHES[what] in message, (rank, message)
        assert "rank 2" in message or "ranks 2 and" in message or "ranks hold [" in message, (rank, message)
    if what == "head dim":
        shapes = "rank 2 has q (2, 2, 4, 5), k (2, 2, 4, 5), v (2, 2, 4, 5), rank 0 has q (2, 2, 4, 4)"
        assert shapes in _mismatch_run()[0][what][1]


def test_a_mask_mod_that_differs_is_named_with_its_arguments():
    """Only a digest of another rank's built-in travels; the rank that holds it names it."""
    seen = _mismatch_run()
    assert "rank 2 has sliding_window(window=3)" in seen[2]["mask_mod"][1], seen[2]
    assert "rank 0 has sliding_window(window=2)" in seen[0]["mask_mod"][1], seen[0]
    assert "rank 2 has document(ids_q of shape (1, 4))" in seen[2]["document ids"][1], seen[2]
    assert "give every rank the same one" in seen[0]["document ids"][1], seen[0]


def test_document_ids_of_a_shard_are_a_value_error_on_every_rank():
    """document(ids) with ids of one shard's length, the same on every rank: the whole sequence's are needed."""
    seen = [s["document ids everywhere"] for s in _mismatch_run()]
    assert all(kind == "ValueError" and MISMATCHES["document ids everywhere"] in m for kind, m in seen), seen
    assert all("not one rank's shard" in m for _, m in seen), seen


def test_valid_lens_past_the_whole_sequence_is_a_value_error_on_every_rank():
    seen = [s["valid_lens too long"] for s in _mismatch_run()]
    assert all(kind == "ValueError" and MISMATCHES["valid_lens too long"] in m for kind, m in seen), seen


@pytest.mark.parametrize(
    ("what", "own_error"),
    [
        ("own inputs", "ring_attention on rank 2: k has 4 positions but v has 3"),
        ("gather_sequence own arguments", "gather_sequence on rank 2: dim 5 is out of range"),
        ("attn_mask on one rank", "ring_attention on rank 2: RingMultiHeadAttention takes valid_lens (B,) and"),
        ("score_mod on one rank", "ring_attention on rank 2: RingMultiHeadAttention takes valid_lens, is_causal and"),
    ],
)
def test_own_bad_inputs_raise_there_and_the_others_hear_of_it(what, own_error):
    seen = [s[what] for s in _mismatch_run()]
    assert all(kind == "ValueError" for kind, _ in seen), seen
    assert own_error in seen[2][1], seen[2]
    assert all("rank 2 rejected its inputs" in message for _, message in seen[:2]), seen


# --- without processes ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("length", "world_size"), [(8, 2), (7, 3), (5, 4), (4, 4), (103, 4)])
def test_segments_cover_the_sequence_once(layout, length, world_size):
    ranges = sequence.segments(length, world_size, layout)
    held = torch.cat([sequence.positions(r) for r in ranges])
    assert sorted(held.tolist()) == list(range(length))
    sizes = [len(sequence.positions(r)) for r in ranges]
    assert max(sizes) - min(sizes) <= (1 if layout == "contiguous" else 2)


def test_segments_reject_fewer_positions_than_ranks_and_unknown_layouts():
    with pytest.raises(ValueError, match="a sequence of 3 positions cannot be split over 4 ranks"):
        sequence.segments(3, 4, "zigzag")
    with pytest.raises(ValueError, match=r"layout must be one of \('contiguous', 'zigzag'\), got 'ring'"):
        sequence.segments(8, 2, "ring")


def _plan(rank: int, world_size: int, q_ranges: list, k_ranges: list, **agreed) -> Plan:
    """What ring attention's span computation reads of a plan, without processes."""
    ring = SimpleNamespace(rank=rank, size=world_size)
    return Plan(ring, timedelta(0), q_ranges, k_ranges, valid_lens=None, scale=1.0, block=4, **agreed)  # type: ignore[arg-type]


def _scored_pairs(layout: str, L: int, W: int) -> list[int]:
    """(query, key) pairs each rank scores over a causal forward, from the spans ring attention computes."""
    ranges = sequence.segments(L, W, layout)
    totals = []
    for rank in range(W):
        plan = _plan(rank, W, ranges, ranges, offset=0, is_causal=True, key_limit=L)
        spans = [step_span(plan, src) for src in range(W)]
        totals.append(sum((r1 - r0) * (c1 - c0) for (r0, r1), (c0, c1) in filter(None, spans)))
    return totals


def test_zigzag_balances_causal_work():
    """Zig-zag: every rank scores the same number of pairs (within 5%); contiguous: the last rank 4x the first
    (whole blocks below the diagonal, a whole diagonal block each)."""
    zigzag = _scored_pairs("zigzag", 4096, 4)
    contiguous = _scored_pairs("contiguous", 4096, 4)
    assert max(zigzag) / min(zigzag) < 1.05, zigzag
    assert max(contiguous) / min(contiguous) > 3.5, contiguous
    assert sum(zigzag) == sum(contiguous) == 0.625 * 4096**2  # of L^2 pairs: blocks wholly masked are skipped


def _drawn_mask_mod(data: st.DataObject, kind: str, B: int, Lq: int, Lk: int) -> mods.MaskFn | None:
    if kind == "window":
        return mods.sliding_window(data.draw(st.integers(1, 8), label="window"))
    if kind == "document":  # any ids, not only packed (sorted) ones
        ids = st.lists(st.integers(0, 3), min_size=B * (Lq + Lk), max_size=B * (Lq + Lk))
        flat = torch.tensor(data.draw(ids, label="ids"))
        return mods.document(flat[: B * Lq].view(B, Lq), flat[B * Lq :].view(B, Lk))
    if kind == "user":
        return lambda b, h, q_idx, kv_idx: (q_idx * kv_idx + b) % 3 == 0
    return None


@settings(max_examples=300, deadline=None)
@given(
    world_size=st.integers(1, 5),
    data=st.data(),
    layout=st.sampled_from(LAYOUTS),
    is_causal=st.booleans(),
)
def test_spans_hold_every_allowed_pair_and_no_more_rows_or_columns(world_size, data, layout, is_causal):
    """The rows and columns ring attention scores on each step: every pair the masks allow lies inside,
    and the first and last row and column each hold one (no block is scored that need not be)."""
    _check_spans(world_size, data, layout, is_causal, "none")


@settings(max_examples=200, deadline=None)
@given(
    world_size=st.integers(1, 5),
    data=st.data(),
    layout=st.sampled_from(LAYOUTS),
    is_causal=st.booleans(),
    mod=st.sampled_from(["window", "document", "user"]),
)
def test_spans_with_a_mask_mod_hold_every_allowed_pair(world_size, data, layout, is_causal, mod):
    """The same with a mask_mod: every pair allowed lies inside; with a built-in the first and last row and
    column each hold one (its tiles are exact on single positions, and these sizes are below _GRID pieces). A
    caller's mask_mod says nothing before it is evaluated: the span of the other masks is kept."""
    _check_spans(world_size, data, layout, is_causal, mod)


def _check_spans(world_size: int, data: st.DataObject, layout: str, is_causal: bool, mod: str) -> None:
    Lq = data.draw(st.integers(world_size, 40), label="Lq")
    Lk = data.draw(st.integers(world_size, 40), label="Lk")
    key_limit = data.draw(st.integers(0, Lk), label="max valid_lens")
    B = 2
    mask_mod = mods.bind(
        _drawn_mask_mod(data, mod, B, Lq, Lk), batch=B, heads=1, num_queries=Lq, num_keys=Lk, device=None
    )
    q_ranges, k_ranges = sequence.segments(Lq, world_size, layout), sequence.segments(Lk, world_size, layout)
    for rank in range(world_size):
        plan = _plan(
            rank,
            world_size,
            q_ranges,
            k_ranges,
            offset=Lk - Lq,
            is_causal=is_causal,
            key_limit=key_limit,
            mask_mod=mask_mod,
            batch=B,
        )
        queries = sequence.positions(q_ranges[rank])[:, None]  # (Lq_r, 1)
        for src in range(world_size):
            keys = sequence.positions(k_ranges[src])[None, :]  # (1, Lk_src)
            allowed = (keys < key_limit) & ((keys <= queries + Lk - Lq) | (not is_causal))  # (Lq_r, Lk_src)
            if mask_mod is not None:
                by_mod = mods.evaluate_mask(mask_mod, torch.arange(B)[:, None, None], torch.tensor(0), queries, keys)
                by_mod = by_mod.expand(B, *allowed.shape)  # (B, Lq_r, Lk_src)
                allowed = allowed & by_mod.any(dim=0)  # (Lq_r, Lk_src): allowed for some example
            span = step_span(plan, src)
            if span is None:
                assert not allowed.any()
                continue
            (r0, r1), (c0, c1) = span
            inside = torch.zeros_like(allowed)
            inside[r0:r1, c0:c1] = True
            assert not (allowed & ~inside).any(), (rank, src, span)
            if mod == "user":
                continue
            assert allowed[r0].any() and allowed[r1 - 1].any(), (rank, src, span)
            assert allowed[:, c0].any() and allowed[:, c1 - 1].any(), (rank, src, span)


def test_far_steps_are_skipped_without_evaluating_anything():
    """A sliding window or another document: step_span says None from position ranges alone (a mask_mod that would
    raise if evaluated shows that nothing was), and StepMask's tiles, combined with the mod's, leave the chunked
    backend's block plan only the blocks along the band."""
    L, W = 64, 4
    ranges = sequence.segments(L, W, "contiguous")  # 16 positions per rank

    def plan(rank: int, mask_mod: mods.MaskFn) -> Plan:
        bound = mods.bind(mask_mod, batch=1, heads=1, num_queries=L, num_keys=L, device=None)
        return _plan(rank, W, ranges, ranges, offset=0, is_causal=True, key_limit=L, mask_mod=bound)

    window = mods.sliding_window(4)
    assert [step_span(plan(3, window), src) for src in range(W)] == [None, None, ((0, 3), (13, 16)), ((0, 16), (0, 16))]
    halves = mods.document((torch.arange(L) >= L // 2).long()[None])
    assert [step_span(plan(3, halves), src) is None for src in range(W)] == [True, True, False, False]
    assert step_span(plan(2, halves), 1) is None and step_span(plan(1, halves), 0) is not None

    @dataclass(frozen=True)
    class Unevaluable(mods.MaskMod):  # tiles that know, a call that must not happen
        offset: int = 0

        def __call__(self, b, h, q_idx, kv_idx):  # noqa: ANN001
            raise AssertionError("evaluated")

        def tiles(self, rows, cols):  # noqa: ANN001
            return window.tiles(rows, cols)

    assert step_span(plan(3, Unevaluable()), 0) is None

    one = sequence.segments(256, 1, "contiguous")  # one rank, 256 positions: the step is the whole sequence
    bound = mods.bind(window, batch=1, heads=1, num_queries=256, num_keys=256, device=None)
    whole = _plan(0, 1, one, one, offset=0, is_causal=True, key_limit=256, mask_mod=bound)
    (r0, r1), (c0, c1) = step_span(whole, 0)
    mask = StepMask(whole, one[0], one[0], (r0, r1), (c0, c1), torch.device("cpu"))
    spans = key_blocks(mask, r1 - r0, (0, c1 - c0), 16)
    causal = StepMask(replace(whole, mask_mod=None), one[0], one[0], (r0, r1), (c0, c1), torch.device("cpu"))
    causal_spans = key_blocks(causal, r1 - r0, (0, c1 - c0), 16)
    assert all(r1 - r0 <= 128 for _, _, r0, r1, _ in spans), spans  # one row block of 64, or two at a boundary
    pairs = sum((r1 - r0) * (j1 - j0) for j0, j1, r0, r1, _ in spans)
    causal_pairs = sum((r1 - r0) * (j1 - j0) for j0, j1, r0, r1, _ in causal_spans)
    assert pairs <= 0.5 * causal_pairs, (pairs, causal_pairs)


# --- the example ---------------------------------------------------------------------------------------------

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "ring_attention.py"


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun), "--standalone", "--nproc-per-node", "2", str(EXAMPLE), *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=240, check=False)


def test_example_checks_against_one_process_and_reports_memory():
    result = _torchrun("--length", "67", "--heads", "2", "--head-dim", "8", "--valid-len", "50", "--timeout", "60")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("  ok") == 4, result.stdout  # output, dq, dk, dv
    rows = [r for r in (line.split() for line in result.stdout.splitlines()) if len(r) == 5 and r[3] == "MiB"]
    # zig-zag: 67 positions in 4 chunks of 17, 17, 17, 16; rank 0 holds the first and last, rank 1 the middle two
    assert [(r[0], r[1]) for r in rows] == [("0", "33"), ("1", "34")], result.stdout
    assert all(float(r[2]) > 0 for r in rows), result.stdout


def test_example_mistake_is_one_line_and_exit_2():
    result = _torchrun("--length", "1")
    errors = {line for line in result.stderr.splitlines() if "error:" in line}
    assert errors == {"ring_attention.py: error: --length (1) must be at least the number of processes (2)"}, errors
    assert 'Traceback (most recent call last):\n  File "' + str(EXAMPLE) not in result.stderr


def test_ring_takes_the_scale_rule_of_the_single_process_functions():
    """Any finite real number (NumPy's too) is a scale; NaN and infinities are ValueErrors, before any rank talks."""
    import numpy as np

    from attnkit.distributed.agree import Request, _describe

    q = torch.randn(1, 2, 3, 4)
    ok = _describe(Request(q, q, q, None, False, np.float32(0.5), "contiguous"))
    assert ok == _describe(Request(q, q, q, None, False, 0.5, "contiguous"))
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="scale must be finite"):
            _describe(Request(q, q, q, None, False, bad, "contiguous"))
