"""The presses: how each scores a layer's cached positions (:mod:`attnkit.presses` for the table of them).

Where kvpress (NVIDIA/kvpress, read at 8bb29b9) has a press of the same name, its formula is followed; each
docstring says where attnkit differs."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from attnkit._validate import describe
from attnkit.cache import KVCache
from attnkit.presses.base import Layer, Press, _cache_of, _Call, _keep, kept_count

__all__ = [
    "H2O",
    "TOVA",
    "AdaptiveBudget",
    "KNorm",
    "ObservedAttention",
    "QuestionAware",
    "Random",
    "SnapKV",
    "StreamingLLM",
]

# B batch, H query heads, Hkv key/value heads, G = H // Hkv, L keys of the prefill, w window rows, D head dim


def _group_mean(scores: Tensor, kv_heads: int) -> Tensor:
    """``(B, H, L)`` -> ``(B, Hkv, L)``: the mean over the query heads that share each key/value head."""
    B, H, L = scores.shape
    return scores.view(B, kv_heads, H // kv_heads, L).mean(dim=2)  # (B, Hkv, L)


def _whole(value: object, name: str, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {describe(value)}")
    if value < least:
        raise ValueError(f"{name} must be at least {least}, got {value}")
    return value


def _kept_last(scores: Tensor, n: int) -> Tensor:
    """``scores (B, Hkv, L - n)`` with the last ``n`` positions appended, scored above every other (always kept,
    as kvpress pads them with its maximum + 1)."""
    top = scores.amax() + 1 if scores.numel() else scores.new_tensor(1.0)
    return F.pad(scores, (0, n), value=float(top))  # (B, Hkv, L)


class ObservedAttention(Press):
    """H2O's score (kvpress's ``ObservedAttentionPress``): the weight each key received over the prefill, divided
    by the number of queries that may see it, the mean over the query heads of its group::

        score[b, g, j] = mean_{h in group g} (sum_i a[b, h, i, j]) / viewers[j]

    from exact column sums (:mod:`attnkit.stats`, in linear memory), never from eager's ``B*H*L*L`` weights.
    kvpress divides by ``L - j`` (a causal mask over the whole prefill); attnkit counts the queries the call's mask
    lets see key ``j``, which is ``L - j`` there and stays right with padding or windows."""

    def score(self, layer: Layer) -> Tensor:
        sums = layer.column_sums()  # (B, H, L)
        seen = layer.viewers()  # (B|1, H|1, L)
        per_head = torch.where(seen > 0, sums / seen.clamp(min=1), 0.0)  # (B, H, L)
        return _group_mean(per_head, layer.keys.shape[1])  # (B, Hkv, L)


class SnapKV(Press):
    """SnapKV (kvpress's ``SnapKVPress``): the weights of the last ``window_size`` queries on the keys before them,
    averaged over those queries, smoothed by an average pool of ``kernel_size`` positions, averaged over each
    group's query heads; the window's own keys are always kept. The weights are the model's own (softmax over every
    key each window query sees), from attnkit's exact rows.

    Raises:
        ValueError: at a prefill of ``window_size`` positions or fewer (kvpress asserts the same), or of a KVCache
            whose rows differ in length (each row's window would be other queries).
    """

    def __init__(self, compression_ratio: float = 0.0, window_size: int = 64, kernel_size: int = 5) -> None:
        super().__init__(compression_ratio)
        self.window_size = _whole(window_size, "window_size", 1)
        self.kernel_size = _whole(kernel_size, "kernel_size", 1)
        if kernel_size % 2 == 0:
            raise ValueError(f"kernel_size must be odd (a pool centred on each key), got {kernel_size}")

    def score(self, layer: Layer) -> Tensor:
        L, w = layer.aligned(self), self.window_size
        if L <= w:
            raise ValueError(f"{type(self).__name__}: the prefill has {L} positions, not more than window_size={w}")
        weights = layer.weights(list(range(L - w, L)))[..., : L - w]  # (B, H, w, L - w)
        scores = weights.mean(dim=-2)  # (B, H, L - w)
        if self.kernel_size > 1:
            scores = F.avg_pool1d(scores, self.kernel_size, stride=1, padding=self.kernel_size // 2)  # (B, H, L - w)
        return _kept_last(_group_mean(scores, layer.keys.shape[1]), w)  # (B, Hkv, L)


class QuestionAware(SnapKV):
    """The question's own queries as SnapKV's window: the prompt ends with the ``question_tokens`` tokens of the
    question, whose weights on the context score it (the mean over the question's queries and each group's heads,
    no pooling by default), and the question's keys are kept. It is kvpress's SnapKV with the window set to the
    question and no pooling, named for what it needs: the question before compression (kvpress's pipeline gives the
    question after it, unless asked otherwise).

    Raises:
        TypeError, ValueError: ``question_tokens`` not a whole number of at least 1.
    """

    def __init__(self, compression_ratio: float = 0.0, question_tokens: int = 32, kernel_size: int = 1) -> None:
        self.question_tokens = _whole(question_tokens, "question_tokens", 1)
        super().__init__(compression_ratio, question_tokens, kernel_size)


class TOVA(Press):
    """TOVA (kvpress's ``TOVAPress``): the last query's weights on the keys before it, averaged over every query
    head (not per group: TOVA keeps one set for all heads), the same score for each key/value head; the last
    position is always kept."""

    def score(self, layer: Layer) -> Tensor:
        L, Hkv = layer.aligned(self), layer.keys.shape[1]
        last = layer.weights([L - 1])[:, :, 0, : L - 1]  # (B, H, L - 1)
        scores = last.mean(dim=1, keepdim=True).expand(-1, Hkv, -1)  # (B, Hkv, L - 1)
        return _kept_last(scores, 1)  # (B, Hkv, L)


class StreamingLLM(Press):
    """StreamingLLM (kvpress's ``StreamingLLMPress``): the first ``n_sink`` positions (attention sinks) and the
    most recent ones are kept, the middle removed. As in kvpress, the kept keys keep their positions (their RoPE
    is not redone)."""

    def __init__(self, compression_ratio: float = 0.0, n_sink: int = 4) -> None:
        super().__init__(compression_ratio)
        self.n_sink = _whole(n_sink, "n_sink", 0)

    reads_attention = False

    def score(self, layer: Layer) -> Tensor:
        B, Hkv = layer.keys.shape[:2]
        L = layer.aligned(self)
        kept = kept_count(L, self.compression_ratio)
        sinks = min(self.n_sink, kept)  # (kvpress asserts L > n_sink; a count below the sinks keeps sinks alone)
        scores = torch.zeros(B, Hkv, L, device=layer.keys.device)  # (B, Hkv, L)
        scores[:, :, :sinks] = 1
        scores[:, :, L - (kept - sinks) :] = 1  # the most recent
        return scores


class KNorm(Press):
    """Key norms (kvpress's ``KnormPress``): keys with the smallest L2 norm are kept (they tend to draw the most
    attention, arXiv 2406.11430); scored ``-||k||`` in float32."""

    reads_attention = False

    def score(self, layer: Layer) -> Tensor:
        return -layer.keys.float().norm(dim=-1)  # (B, Hkv, L)


class Random(Press):
    """Uniform random scores (kvpress's ``RandomPress``): the floor every press is measured against. ``seed``
    makes each choice reproducible: layer ``i`` draws from a generator seeded ``seed + i`` (kvpress seeds every
    layer alike, so its layers keep the same positions; here each layer draws its own)."""

    reads_attention = False

    def __init__(self, compression_ratio: float = 0.0, seed: int | None = None) -> None:
        super().__init__(compression_ratio)
        self.seed = None if seed is None else _whole(seed, "seed", 0)

    def score(self, layer: Layer) -> Tensor:
        B, Hkv, L, _ = layer.keys.shape
        generator = None
        if self.seed is not None:
            generator = torch.Generator(device=layer.keys.device).manual_seed(self.seed + layer.index)
        return torch.rand(B, Hkv, L, generator=generator, device=layer.keys.device)  # (B, Hkv, L)


class H2O(ObservedAttention):
    """Heavy hitters kept while decoding (H2O, arXiv 2306.14048): the prefill compressed as
    :class:`ObservedAttention`, then at every decoding step each kept key's running score takes the new queries'
    exact weights, and the cache stays at the prefill's kept size: a step that makes it longer drops, per
    key/value head, the lowest-scored key outside the last ``recent`` positions. ``press.kept[i]`` follows the
    evictions (original positions, ascending); ``press.scores[i]`` stays the prefill's.

    Where the paper sums each key's weights, the running score here is their mean over the queries that saw the
    key (the prefill's and every step's), as ObservedAttention's: a sum favours the oldest keys, which more queries
    have seen. Followed step by step: transformers' DynamicCache, and a growing KVCache whose rows are of one
    length; not beam search or ``num_return_sequences`` (rows reordered or repeated: a ValueError at the step).

    Raises:
        ValueError: at a prefill of a KVCache whose rows differ in length.
    """

    def __init__(self, compression_ratio: float = 0.0, recent: int = 16) -> None:
        super().__init__(compression_ratio)
        self.recent = _whole(recent, "recent", 0)
        self._running: dict[int, tuple[Tensor, Tensor, Tensor, int]] = {}  # sums, seen, positions, next position

    def _reset(self) -> None:
        super()._reset()
        self._running = {}

    def _on_call(self, index: int, module: nn.Module, kwargs: dict, call: _Call) -> None:
        if call.prefill:
            self._running.pop(index, None)
            cache = _cache_of(module, kwargs)
            if isinstance(cache, KVCache) and cache.kind == "static":
                raise ValueError(f"{self!r} follows a growing KVCache step by step, not a static one")
            if (
                isinstance(cache, KVCache)
                and cache.lengths is not None
                and bool((cache.lengths != cache.lengths[0]).any())
            ):
                raise ValueError(
                    f"{self!r} follows every row's steps alike: it presses a KVCache of rows of one length, got "
                    f"{cache.lengths.tolist()}"
                )
            super()._on_call(index, module, kwargs, call)  # scored, compressed, then _chosen starts the running sums
            return
        cache = _cache_of(module, kwargs)
        if index not in self._running or cache is None:
            return
        parts = call.parts()
        if parts is None:
            return
        sums, seen, positions, next_position = self._running[index]
        if parts.q.shape[0] != sums.shape[0] or getattr(cache, "reordered", False):
            raise ValueError(
                f"{self!r} follows each row of the prefill's batch: its rows were repeated or reordered since "
                "(beam search, num_return_sequences), which its running scores cannot follow"
            )
        Lq, Lk = parts.q.shape[2], parts.k.shape[2]
        new = Lk - sums.shape[2]  # keys appended by this call
        if new != Lq:  # not this press's cache any more (another sequence, a reset): stop following it
            self._running.pop(index)
            return
        layer = Layer(index, parts.k, None, parts)
        B, Hkv = sums.shape[:2]
        rows = layer.weights(list(range(Lq)))  # (B, H, Lq, Lk)
        sums = torch.cat([sums, sums.new_zeros(B, Hkv, new)], dim=2) + _group_mean(rows.sum(dim=2), Hkv)  # (B, Hkv, Lk)
        visible = layer.viewers()[:, :1].expand(B, Hkv, Lk)  # (B, Hkv, Lk)
        seen = torch.cat([seen, seen.new_zeros(B, Hkv, new)], dim=2) + visible  # (B, Hkv, Lk)
        steps = torch.arange(next_position, next_position + new, device=positions.device)
        positions = torch.cat([positions, steps.expand(B, Hkv, new)], dim=2)  # (B, Hkv, Lk)
        budget = positions.shape[2] - new  # the size the cache had before this call
        if Lk > budget:
            score = torch.where(seen > 0, sums / seen.clamp(min=1), 0.0)  # (B, Hkv, Lk)
            slots = torch.arange(Lk, device=score.device)  # (Lk,)
            protected = slots >= Lk - min(self.recent, Lk)  # (Lk,)
            # the recent ones above every other, the newest first among them (recent >= the budget: a window)
            score = torch.where(protected, score.amax() + 1 + slots.to(score.dtype), score)  # (B, Hkv, Lk)
            keep = score.topk(budget, dim=-1).indices.sort(dim=-1).values  # (B, Hkv, budget)
            sums, seen, positions = (t.gather(2, keep) for t in (sums, seen, positions))  # (B, Hkv, budget) each
            _keep(cache, keep, torch.full((B,), budget, device=keep.device))
        self._running[index] = (sums, seen, positions, next_position + new)
        self.kept[index] = positions

    def _chosen(self, index: int, module: nn.Module, cache, layer: Layer) -> None:
        """The running sums from the prefill's, for the positions kept (the layer's statistics, computed once)."""
        kept = self.kept[index]  # (B, Hkv, n)
        B, Hkv, L = self.scores[index].shape
        sums = _group_mean(layer.column_sums(), Hkv)  # (B, Hkv, L)
        seen = layer.viewers()[:, :1].expand(B, Hkv, L)  # (B, Hkv, L): the first head's mask for its group
        at = kept.clamp(min=0)  # (B, Hkv, n)
        self._running[index] = (sums.gather(2, at), seen.gather(2, at), kept, L)  # (B, Hkv, n) x 3, and L


class AdaptiveBudget(Press):
    """An entropy-adaptive budget per key/value head around another press's scores: a layer keeps as many pairs
    in all as ``press`` would (``n * Hkv``, ``n`` the count each head keeps under ``press``), shared out in
    proportion to each head's effective width, the exponential of its query heads' mean entropy over the prefill's
    rows (``exp(H)``: the number of keys a row spreads its weight over as if uniformly; exact, :mod:`attnkit.stats`).
    A diffuse head keeps more, a sharp one less; each keeps its best-scored positions by ``press.score``, at least
    one and at most ``most * n``.

    A cache holds as many slots per key/value head, and transformers builds one mask for every layer: each layer
    stores ``min(L, most * n)`` positions per head, the slots past a head's own budget filled with its next-best
    positions, which the attention hides while the block is open (attnkit's transformers attention reads them,
    ``attnkit.presses.base.hidden_slots``). Inside the block every head attends over its budget alone; after it,
    over all its slots (more kept pairs, never other ones). So the memory is ``most`` times a uniform press's: this
    measures what the allocation is worth (kvpress's AdaKV keeps the whole cache and hides the rest the same way).

    ``press.kept[i]`` holds the stored positions ``(B, Hkv, m)``, ``press.visible[i]`` which of them attention
    reads ``(B, Hkv, m)`` bool, ``press.budgets[i]`` each head's budget ``(B, Hkv)``.

    Args:
        press: the press whose scores rank each head's positions (not H2O, not another AdaptiveBudget).
        most: a head keeps at most ``most`` times ``press``'s count (at least 1).

    Raises:
        TypeError: ``press`` is not such a press, ``most`` not a number.
        ValueError: ``most`` below 1; at a prefill through attnkit's KVCache (its layers read no hidden slots).
    """

    def __init__(self, press: Press, most: float = 2.0) -> None:
        if not isinstance(press, Press) or isinstance(press, (AdaptiveBudget, H2O)):
            raise TypeError(
                f"press must be a press that scores a prefill (not H2O or another budget), got {describe(press)}"
            )
        if isinstance(most, bool) or not isinstance(most, (int, float)):
            raise TypeError(f"most must be a number, got {describe(most)}")
        if not 1 <= most < float("inf"):
            raise ValueError(f"most must be a finite number of at least 1 (times the uniform count), got {most}")
        super().__init__(press.compression_ratio)
        self.press, self.most = press, float(most)
        self.reads_attention = True  # (the entropy, whatever press scores)
        self.visible: dict[int, Tensor] = {}
        self.budgets: dict[int, Tensor] = {}
        self._last: tuple[Tensor, Tensor] | None = None

    def _reset(self) -> None:
        super()._reset()
        self.visible, self.budgets = {}, {}

    def __repr__(self) -> str:
        return f"AdaptiveBudget({self.press!r})"

    def score(self, layer: Layer) -> Tensor:
        return self.press.score(layer)

    def slots(self, length: int) -> int:
        """The positions each head of a layer of ``length`` stores: ``min(L, most * n)``."""
        return min(length, int(self.most * kept_count(length, self.compression_ratio)))

    def allot(self, layer: Layer) -> Tensor:
        """``(B, Hkv)`` int64: each key/value head's budget, summing to ``n * Hkv`` (largest remainders), each
        between 1 and :meth:`slots`."""
        B, Hkv, length = layer.keys.shape[:3]
        L = self.slots(length)  # the most a head may keep
        width = layer.entropy().double().mean(dim=-1).exp()  # (B, H): keys each head's rows spread over
        width = width.view(B, Hkv, -1).mean(dim=-1)  # (B, Hkv)
        total = kept_count(length, self.compression_ratio) * Hkv
        budgets = torch.ones(B, Hkv, dtype=torch.long, device=width.device)  # each head at least one
        for _ in range(Hkv):  # shares past L move to the heads that still have room
            room = budgets < L
            share = torch.where(room, width, 0.0)
            share = share / share.sum(dim=-1, keepdim=True).clamp(min=1e-300)
            left = (total - budgets.sum(dim=-1, keepdim=True)).clamp(min=0)  # (B, 1)
            wanted = share * left  # (B, Hkv)
            whole = wanted.floor().long()
            extra = left[:, 0] - whole.sum(dim=-1)  # (B,): given to the largest remainders
            order = (wanted - whole).argsort(dim=-1, descending=True)
            bonus = (torch.arange(Hkv, device=width.device)[None] < extra[:, None]).long()  # (B, Hkv), by rank
            whole = whole + torch.zeros_like(whole).scatter(1, order, bonus)
            budgets = (budgets + whole).clamp(max=L)
            if bool((budgets.sum(dim=-1) >= total).all()):
                break
        return budgets

    def choose(self, layer: Layer, scores: Tensor) -> tuple[Tensor, Tensor]:
        B, Hkv, L = scores.shape
        budgets = self.allot(layer).to(scores.device)  # (B, Hkv)
        m = self.slots(L)  # every layer stores as many: one mask fits them all
        best = scores.topk(m, dim=-1).indices  # (B, Hkv, m), best first
        inside = torch.arange(m, device=scores.device) < budgets[..., None]  # (B, Hkv, m): within the budget
        kept, order = best.sort(dim=-1)  # ascending positions, and where each came from in the ranking
        self._last = (inside.gather(2, order), budgets)
        return kept, torch.full((B,), m, device=scores.device)

    def _on_call(self, index: int, module: nn.Module, kwargs: dict, call: _Call) -> None:
        if call.prefill and isinstance(_cache_of(module, kwargs), KVCache):  # (before anything is compressed)
            raise ValueError(
                "AdaptiveBudget hides slots in transformers' attention only: press a KVCache with a plain press"
            )
        super()._on_call(index, module, kwargs, call)

    def _hidden(self, index: int) -> Tensor | None:
        assert self._last is not None
        return ~self._last[0]  # (B, Hkv, m)

    def _chosen(self, index: int, module: nn.Module, cache, layer: Layer) -> None:
        assert self._last is not None
        self.visible[index], self.budgets[index] = self._last
