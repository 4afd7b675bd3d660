"""The training part of ``attnkit demo``: learn to reverse digit sequences, then look at where the model attends.

The task: a source of 3 to 10 digits (3 to 6 in quick mode), padded at the end to the longest in its batch,
becomes the same digits in reverse order followed by ``<eos>``. Output position ``t`` is the source digit at
position ``len - 1 - t``, so the right alignment is known in advance: the cross-attention weights of a model
that has learnt the task lie on the anti-diagonal of the ``len x len`` block, and they are exactly zero on the
padding columns (keys past ``valid_lens``, which attnkit never attends to)::

                 source  3  9  8  <pad>
    output  8            .  .  *    0
            9            .  *  .    0
            3            *  .  .    0

Two encoder-decoder models, trained with teacher forcing on fresh batches, evaluated by greedy decoding:

* ``"additive"``: a bidirectional GRU encoder and a GRU decoder with Bahdanau attention
  (:class:`~attnkit.layers.AdditiveAttention`; queries = decoder states, keys = values = encoder outputs,
  ``valid_lens`` = source lengths), in Luong's layout: the decoder GRU reads the whole teacher-forced input in
  one call, then one attention call serves every target position.
* ``"multihead"``: a small pre-LayerNorm Transformer with learned positions, built from
  :class:`~attnkit.layers.MultiHeadAttention`: encoder self-attention with ``valid_lens``, causal decoder
  self-attention, cross-attention with ``valid_lens`` = source lengths.

The held-out set comes from its own seed, and no held-out sequence is ever drawn for training. Accuracy is
exact-sequence accuracy on it: every digit and the ``<eos>`` right. Training stops as soon as a check reaches
the target, at ``max_steps``, or at the time limit. The same seed gives the same numbers (on one machine, with
the same number of threads): the weights and the data come from it, and there is no dropout.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from attnkit._validate import TORCH_SEEDS
from attnkit._validate import TORCH_SEEDS as SEEDS  # the name it had here, kept for code that imports it
from attnkit.recording import record_weights
from attnkit.tools.demo.models import BOS, EOS, LABELS, PAD, AdditiveSeq2Seq, Seq2Seq, TransformerSeq2Seq, greedy
from attnkit.tools.demo.pictures import KINDS, PICTURES, draw, replay_book_examples

__all__ = ["KINDS", "PICTURES", "SEEDS", "DemoResult", "draw", "replay_book_examples", "train"]

# B batch, S source length (padded), T target length (S + 1: reversed digits, <eos>, padding),
# E embedding size, h hidden size, d model size, H heads, V vocabulary size


@dataclass
class DemoResult:
    """What :func:`train` reports.

    Attributes:
        kind: ``"additive"`` or ``"multihead"``.
        accuracy: held-out exact-sequence accuracy of greedy decoding at the end, 0..1.
        seconds: training wall time, held-out checks included.
        steps: optimiser steps taken.
        losses: ``(step, training loss)`` at each logged step.
        accuracies: ``(step, held-out accuracy)`` at each check.
        example: one held-out sequence shorter than the padded held-out batch: ``"source"`` and
            ``"prediction"`` (digits, no padding or ``<eos>``), ``"weights"`` (cross-attention weights of
            teacher-forced decoding of the right output: ``(1, T, S)`` for ``"additive"``, ``(H, T, S)`` from the
            last decoder layer for ``"multihead"``; ``S`` counts the padding, ``T`` the digits and ``<eos>``),
            ``"source_labels"`` (``S`` strings, ``"<pad>"`` included) and ``"target_labels"`` (``T`` strings);
            ``"record"``, every attention call of the model on that sequence, ``{module name: [(1, H, Lq, Lk) or
            (1, Lq, Lk) per call]}``: the encoder, the decoder reading its own greedy output whole, then (the
            Transformer) the same decoding one step at a time through its caches; ``"layer_tokens"``, the tokens
            of each module's queries and keys for :func:`attnkit.tools.viewer.view` (decoder positions are labelled with
            the token they read).
    """

    kind: str
    accuracy: float
    seconds: float
    steps: int
    losses: list[tuple[int, float]]
    accuracies: list[tuple[int, float]]
    example: dict[str, Any]


@dataclass(frozen=True)
class _Setup:
    min_len: int
    max_len: int
    target: float  # held-out exact-sequence accuracy at which training stops
    max_steps: int
    batch_size: int
    log_every: int
    eval_every: int  # a multiple of log_every, so that every check is logged
    num_heldout: int


_SETUPS = {
    False: _Setup(
        min_len=3,
        max_len=10,
        target=0.99,
        max_steps=3000,
        batch_size=128,
        log_every=10,
        eval_every=50,
        num_heldout=1000,
    ),
    True: _Setup(
        min_len=3, max_len=6, target=0.90, max_steps=1000, batch_size=128, log_every=5, eval_every=10, num_heldout=500
    ),
}

# Adam, from sweeps over seeds 0-5: full 3e-3 (vs 5e-3, 1e-2) and 1e-3 (vs 2e-3, 4e-3); quick 1e-2 and 3e-3,
# which take 40-60 steps to the quick target instead of 50-75
_LEARNING_RATES = {
    ("additive", False): 3e-3,
    ("additive", True): 1e-2,
    ("multihead", False): 1e-3,
    ("multihead", True): 3e-3,
}

_HELDOUT_SEED_OFFSET = 1_000_003  # the held-out set's generator is seeded with seed + this (modulo 2**64)


def train(
    kind: str,
    *,
    seed: int = 0,
    quick: bool = False,
    on_progress: Callable[[dict], None] | None = None,
    time_limit: float = 120.0,
) -> DemoResult:
    """Train one model to reverse digit sequences until it gets the held-out set right, or time runs out.

    Args:
        kind: ``"additive"`` or ``"multihead"`` (see the module docstring).
        seed: seeds the weights, the training batches and the held-out set; the same seed gives the same
            numbers. Any seed ``torch.manual_seed`` takes, from ``-2**63`` to ``2**64 - 1``. The caller's global
            random state and thread count are left as they were.
        quick: 3 to 6 digits instead of 3 to 10, and a 90% target instead of 99%: a second or so, for the tests.
        on_progress: called at every logged step with ``{"step", "total", "loss", "accuracy", "elapsed", "done"}``:
            ``total`` is the most steps training may take, ``accuracy`` the last held-out accuracy (``None``
            before the first check), ``elapsed`` seconds since training began, ``done`` true at the last call.
        time_limit: seconds after which training stops at the next step, whatever the accuracy.

    Returns:
        A :class:`DemoResult`.

    Raises:
        ValueError: an unknown ``kind``, a ``seed`` out of range, or a ``time_limit`` that is not positive.

    Example:
        >>> result = train("additive", quick=True)
        >>> result.accuracy >= 0.9, result.example["weights"].shape, result.example["source_labels"][-1]
        (True, torch.Size([1, 6, 6]), '<pad>')
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or not TORCH_SEEDS[0] <= seed <= TORCH_SEEDS[1]:
        raise ValueError(f"seed must be a whole number from {TORCH_SEEDS[0]} to {TORCH_SEEDS[1]}, got {seed!r}")
    if not time_limit > 0:
        raise ValueError(f"time_limit must be a positive number of seconds, got {time_limit}")
    threads = torch.get_num_threads()
    # One thread: these models are too small to gain from more, and with two threads on two cores one other busy
    # process made each step about 17 times slower (spinning OpenMP workers); one thread also gives the same
    # numbers on machines with different core counts.
    torch.set_num_threads(1)
    try:
        return _train(kind, seed, _SETUPS[quick], _LEARNING_RATES[kind, quick], on_progress, time_limit)
    finally:
        torch.set_num_threads(threads)


def _train(
    kind: str,
    seed: int,
    setup: _Setup,
    learning_rate: float,
    on_progress: Callable[[dict], None] | None,
    time_limit: float,
) -> DemoResult:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # the initial weights
        model = AdditiveSeq2Seq() if kind == "additive" else TransformerSeq2Seq(max_positions=setup.max_len + 1)
    heldout_src, heldout_lens = _draw(
        torch.Generator().manual_seed((seed + _HELDOUT_SEED_OFFSET) % 2**64), setup.num_heldout, setup
    )
    train_gen = torch.Generator().manual_seed(seed)
    exclude = _keys(heldout_src, heldout_lens)  # (num_heldout,)
    optimizer = torch.optim.Adam(model.parameters(), lr=learning_rate)
    losses: list[tuple[int, float]] = []
    accuracies: list[tuple[int, float]] = []
    start = time.perf_counter()
    step, done = 0, False
    while not done:
        model.train()
        src, lens = _draw(train_gen, setup.batch_size, setup, exclude)  # (B, S), (B,)
        tgt_in, tgt_out = _targets(src, lens)  # (B, T) each
        logits = model(src, lens, tgt_in)  # (B, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1), tgt_out.flatten(), ignore_index=PAD)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        done = step == setup.max_steps or time.perf_counter() - start > time_limit
        if step % setup.eval_every == 0 or done:
            accuracies.append((step, _teacher_forced_accuracy(model, heldout_src, heldout_lens)))
            done = done or accuracies[-1][1] >= setup.target
        if step % setup.log_every == 0 or done:
            losses.append((step, loss.item()))
            if on_progress is not None:
                on_progress(
                    {
                        "step": step,
                        "total": setup.max_steps,
                        "loss": losses[-1][1],
                        "accuracy": accuracies[-1][1] if accuracies else None,
                        "elapsed": time.perf_counter() - start,
                        "done": done,
                    }
                )
    seconds = time.perf_counter() - start
    accuracy = _greedy_accuracy(model, heldout_src, heldout_lens)
    example = _example(model, heldout_src, heldout_lens, (setup.min_len + setup.max_len + 1) // 2)
    return DemoResult(kind, accuracy, seconds, step, losses, accuracies, example)


# Data -------------------------------------------------------------------------------------------------------


def _draw(gen: torch.Generator, n: int, setup: _Setup, exclude: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``n`` random sources of ``min_len..max_len`` digits, padded to the longest, none of them in ``exclude``.

    Returns:
        ``src`` ``(n, S)`` tokens and ``lens`` ``(n,)``.
    """
    lens = torch.randint(setup.min_len, setup.max_len + 1, (n,), generator=gen)  # (n,)
    digits = torch.randint(0, 10, (n, setup.max_len), generator=gen)  # (n, max_len)
    if exclude is not None:
        redraw = torch.isin(_keys(digits, lens), exclude)  # (n,)
        while bool(redraw.any()):
            digits[redraw] = torch.randint(0, 10, (int(redraw.sum()), setup.max_len), generator=gen)
            redraw = torch.isin(_keys(digits, lens), exclude)
    S = int(lens.max())
    padding = torch.arange(S) >= lens[:, None]  # (n, S)
    return digits[:, :S].masked_fill(padding, PAD), lens  # (n, S), (n,)


def _keys(src: Tensor, lens: Tensor) -> Tensor:
    """One whole number per sequence (its digits read in base 10, times 16, plus its length), to compare sets."""
    S = src.shape[1]
    digits = src.masked_fill(torch.arange(S) >= lens[:, None], 0)  # (B, S)
    return (digits * 10 ** torch.arange(S)).sum(1) * 16 + lens  # (B,)


def _targets(src: Tensor, lens: Tensor) -> tuple[Tensor, Tensor]:
    """Decoder inputs ``<bos>, reversed digits`` and outputs ``reversed digits, <eos>``, both ``(B, T = S + 1)``
    and padded with ``<pad>``."""
    B, S = src.shape
    positions = torch.arange(S + 1)  # (T,)
    source_index = lens[:, None] - 1 - positions  # (B, T): output t copies source len - 1 - t
    reversed_digits = src.gather(1, source_index.clamp(0, S - 1))  # (B, T)
    after = torch.where(positions == lens[:, None], EOS, PAD)  # (B, T)
    tgt_out = torch.where(source_index >= 0, reversed_digits, after)  # (B, T)
    tgt_in = torch.cat([torch.full((B, 1), BOS), tgt_out[:, :-1]], dim=1)  # (B, T)
    return tgt_in, tgt_out


def _greedy_accuracy(model: Seq2Seq, src: Tensor, lens: Tensor) -> float:
    """Exact-sequence accuracy of greedy decoding: every digit and the ``<eos>`` right (decoding stops at the
    first ``<eos>``, so what follows it is never read)."""
    _, tgt_out = _targets(src, lens)  # (B, T)
    return _exact(greedy(model, src, lens, tgt_out.shape[1]), tgt_out)


@torch.no_grad()
def _teacher_forced_accuracy(model: Seq2Seq, src: Tensor, lens: Tensor) -> float:
    """The number :func:`_greedy_accuracy` gives (but for rounding on near ties), from one decoder call instead of
    one per output position.

    Greedy decoding gets a sequence right exactly when, given the right prefix, every token it would choose next
    is right: by induction, its own prefix is then always the right one.
    """
    model.eval()
    tgt_in, tgt_out = _targets(src, lens)  # (B, T) each
    return _exact(model(src, lens, tgt_in).argmax(-1), tgt_out)


def _exact(predicted: Tensor, tgt_out: Tensor) -> float:
    """The fraction of rows of ``predicted`` ``(B, T)`` equal to ``tgt_out`` ``(B, T)`` up to its ``<eos>``."""
    scored = tgt_out != PAD  # (B, T)
    return float(((predicted == tgt_out) | ~scored).all(dim=1).float().mean())


def _example(model: Seq2Seq, src: Tensor, lens: Tensor, length: int) -> dict[str, Any]:
    """The first held-out sequence of ``length`` digits, kept padded as in the held-out batch: its greedy
    prediction, and the cross-attention weights of teacher-forced decoding of the right output."""
    i = int((lens == length).nonzero()[0])
    src, lens = src[i : i + 1], lens[i : i + 1]  # (1, S), (1,)
    predicted = greedy(model, src, lens, length + 1)[0].tolist()  # T = length + 1 tokens
    prediction = predicted[: predicted.index(EOS)] if EOS in predicted else predicted
    tgt_in, tgt_out = _targets(src, lens)  # (1, S + 1) each
    tgt_in, tgt_out = tgt_in[:, : length + 1], tgt_out[:, : length + 1]  # (1, T): no padding after <eos>
    with torch.no_grad(), record_weights(model) as record:
        model.eval()(src, lens, tgt_in)
    weights = record[model.cross_attention_name]  # (1, T, S) additive, (1, H, T, S) multihead
    source_labels = [LABELS[token] for token in src[0].tolist()]
    # For the viewer: the model decoding by itself, its own greedy output read back whole (the same numbers as
    # step by step), then, for the Transformer, step by step through its caches.
    read = [BOS, *predicted[:length]]  # (T,): what decoder position t reads
    with torch.no_grad(), record_weights(model) as everything:
        memory = model.encode(src, lens)
        model.decode(memory, lens, torch.tensor([read]))
        if isinstance(model, TransformerSeq2Seq):
            model.generate(memory, lens, length + 1)
    read_labels = [LABELS[token] for token in read]
    layer_tokens: dict[str, Any] = {}
    for name in everything:
        if "cross_attention" in name or name == "attention":
            layer_tokens[name] = (read_labels, source_labels)  # decoder queries, source keys
        else:
            layer_tokens[name] = read_labels if name.startswith("decoder") else source_labels
    return {
        "source": src[0, :length].tolist(),
        "prediction": prediction,
        "weights": weights[0] if weights.dim() == 4 else weights,  # (1, T, S) or (H, T, S)
        "source_labels": source_labels,
        "target_labels": [LABELS[token] for token in tgt_out[0].tolist()],
        "record": {name: everything.calls(name) for name in everything},
        "layer_tokens": layer_tokens,
    }
