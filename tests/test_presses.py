"""attnkit.presses on models with random weights: a tiny Llama built from its config (transformers' own code,
attention through attnkit) and attnkit's MultiHeadAttention with a KVCache. Each press's scores against its formula
computed in float64 from whole weights (eager's, or the reference backend's), the kept sets, decoding over the kept
pairs against a full-cache run that hides the removed keys, H2O's evictions, and the bad inputs. The same checks on
SmolLM2 itself: tests/test_presses_smollm2.py."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.nn import functional as F

import attnkit
from attnkit import presses

transformers = pytest.importorskip("transformers")
from attnkit.integrations import transformers as attnkit_hf  # noqa: E402

# B batch, H query heads, Hkv key/value heads, L prefill length

NAME = attnkit_hf.register()
H, HKV, L, V = 4, 2, 40, 64
# float32 scores against float64 ones: a few ulps of weights O(1/L), summed over L rows
TOL = 1e-5


def _config(layers: int = 2) -> Any:
    """A new config each time: a model built from one sets its attention implementation on it."""
    return transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=H,
        num_key_value_heads=HKV,
        max_position_embeddings=128,
    )


def _llama(implementation: str = NAME, dtype: torch.dtype = torch.float32) -> Any:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM._from_config(_config(), attn_implementation=implementation).eval()
    return model.to(dtype)


def _ids(batch: int = 1, length: int = L) -> torch.Tensor:
    return torch.randint(0, V, (batch, length), generator=torch.Generator().manual_seed(1))


def _eager_weights(ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """Every layer's weights ``(B, H, L, L)`` from transformers' eager attention, in float64."""
    model = _llama("eager", torch.float64)
    with torch.no_grad():
        return model(ids, attention_mask=attention_mask, output_attentions=True).attentions


def _group(x: torch.Tensor, hkv: int = HKV) -> torch.Tensor:
    B, h, n = x.shape
    return x.view(B, hkv, h // hkv, n).mean(2)


def _pad_top(x: torch.Tensor, n: int) -> torch.Tensor:
    return F.pad(x, (0, n), value=float(x.max()) + 1)


# the formulas, on whole float64 weights (kvpress's, with attnkit's count of the queries that see each key)
def observed(a: torch.Tensor, mask: torch.Tensor | None = None, hkv: int = HKV) -> torch.Tensor:
    n = a.shape[-1]
    seen = torch.arange(n, 0, -1, dtype=a.dtype) if mask is None else mask.to(a.dtype).sum(-2)  # (L,) or (B, 1, L)
    return _group(torch.where(seen > 0, a.sum(2) / seen.clamp(min=1), 0.0), hkv)


def snapkv(a: torch.Tensor, window: int = 64, kernel: int = 5, hkv: int = HKV) -> torch.Tensor:
    s = a[..., -window:, :-window].mean(-2)
    if kernel > 1:
        s = F.avg_pool1d(s, kernel, stride=1, padding=kernel // 2)
    return _pad_top(_group(s, hkv), window)


def tova(a: torch.Tensor, hkv: int = HKV) -> torch.Tensor:
    return _pad_top(a[:, :, -1, :-1].mean(1, keepdim=True).expand(-1, hkv, -1), 1)


ATTENTION_PRESSES = {
    "observed": (lambda: presses.ObservedAttention(0.5), observed),
    "snapkv": (lambda: presses.SnapKV(0.5, window_size=8, kernel_size=5), lambda a: snapkv(a, 8, 5)),
    "question": (lambda: presses.QuestionAware(0.5, question_tokens=6), lambda a: snapkv(a, 6, 1)),
    "tova": (lambda: presses.TOVA(0.5), tova),
    "h2o": (lambda: presses.H2O(0.5), observed),
}


def _close(mine: torch.Tensor, ref: torch.Tensor, tol: float = TOL) -> None:
    scale = ref.abs().amax(dim=-1, keepdim=True).clamp(min=1e-30)
    err = ((mine.double() - ref) / scale).abs().max().item()
    assert err <= tol, f"relative error {err:.2e} > {tol:.0e}"


def _same_kept(kept: torch.Tensor, ref: torch.Tensor, tol: float = TOL) -> None:
    """The kept positions are the ``n`` best of ``ref``, ties within ``tol`` aside."""
    n = kept.shape[-1]
    threshold = ref.topk(n, dim=-1).values[..., -1:]  # (B, Hkv, 1): the n-th best score
    scale = ref.abs().amax(dim=-1, keepdim=True)
    chosen = torch.zeros_like(ref, dtype=torch.bool).scatter(-1, kept, True)
    wrong = (chosen & (ref < threshold - tol * scale)) | (~chosen & (ref > threshold + tol * scale))
    assert not bool(wrong.any()), f"positions kept against their scores: {wrong.nonzero().tolist()[:8]}"
    assert bool((kept.diff(dim=-1) > 0).all()), "kept positions are ascending and distinct"


@pytest.mark.parametrize("kind", sorted(ATTENTION_PRESSES))
def test_attention_scores_match_eager_float64(kind):
    make, formula = ATTENTION_PRESSES[kind]
    ids = _ids(2)
    press, model = make(), _llama()
    with torch.no_grad(), press(model):
        out = model(ids)
    for i, a in enumerate(_eager_weights(ids)):
        ref = formula(a)
        _close(press.scores[i], ref)
        _same_kept(press.kept[i], ref)
        assert press.kept[i].shape == (2, HKV, L // 2) and press.kept[i].dtype == torch.int64
        layer = out.past_key_values.layers[i]
        assert layer.keys.shape == (2, HKV, L // 2, 8)


def test_observed_attention_counts_the_queries_that_see_each_key_under_padding():
    """Left padding: the reference is the float64 model's own weights (attnkit's reference backend, as
    record_weights gives them): eager's float64 ones turn to NaN at the padded rows and spread."""
    ids = _ids(2)
    attention_mask = torch.ones(2, L, dtype=torch.long)
    attention_mask[1, :7] = 0  # left padding: row 1's first 7 keys are seen by no query
    press, model = presses.ObservedAttention(0.25), _llama()
    with torch.no_grad(), press(model):
        model(ids, attention_mask=attention_mask, use_cache=False)  # scored; no cache to compress
        with pytest.raises(ValueError, match="padded batch"):
            model(ids, attention_mask=attention_mask)  # its cache could not be used after
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    mask = (causal & attention_mask[:, None, :].bool())[:, None]  # (B, 1, L, L): padded queries see nothing
    mask &= attention_mask[:, None, :, None].bool()
    model64 = _llama(dtype=torch.float64)
    with torch.no_grad(), attnkit.record_weights(model64) as rec:
        model64(ids, attention_mask=attention_mask)
    for i in range(2):
        a = rec[f"model.layers.{i}.self_attn"]  # (B, H, L, L) float64
        assert bool((a[~mask.expand_as(a)] == 0).all())
        ref = observed(a, mask)
        _close(press.scores[i], ref)
        assert bool((press.scores[i][1, :, :7] == 0).all())


def test_presses_without_attention_follow_kvpress():
    ids = _ids(1)
    model = _llama()
    knorm, streaming, rand = presses.KNorm(0.5), presses.StreamingLLM(0.5, n_sink=3), presses.Random(0.5, seed=3)
    with torch.no_grad():
        with knorm(model):
            out = model(ids, use_cache=True)
        with streaming(model):
            model(ids)
        with rand(model):
            model(ids)
    plain = model(ids).past_key_values  # the keys as cached (RoPE applied), full
    for i in range(2):
        keys = plain.layers[i].keys
        assert torch.equal(knorm.scores[i], -keys.float().norm(dim=-1))
        _same_kept(knorm.kept[i], -keys.double().norm(dim=-1))
        assert torch.equal(
            out.past_key_values.layers[i].keys, keys.gather(2, knorm.kept[i][..., None].expand(-1, -1, -1, 8))
        )
        expected = torch.cat([torch.arange(3), torch.arange(3 + L // 2, L)])  # sinks, then the most recent
        assert torch.equal(streaming.kept[i][0, 0], expected)
    again = presses.Random(0.5, seed=3)
    with torch.no_grad(), again(model):
        model(ids)
    assert all(torch.equal(again.kept[i], rand.kept[i]) for i in range(2))


def test_decoding_goes_on_over_the_kept_pairs_at_their_positions():
    """A decode step after StreamingLLM (the same kept set in every head and layer) equals the full model over the
    prompt and the new token, in which the new token's query may not see the removed keys."""
    ids = _ids(1)
    nxt = torch.tensor([[5]])
    press, model = presses.StreamingLLM(0.5, n_sink=2), _llama()
    with torch.no_grad():
        with press(model):
            out = model(ids)
            step = model(nxt, past_key_values=out.past_key_values, position_ids=torch.tensor([[L]]))
        kept = press.kept[0][0, 0]
        mask = torch.ones(L + 1, L + 1, dtype=torch.bool).tril()
        mask[L, :L] = False
        mask[L, kept] = True
        float_mask = torch.zeros(L + 1, L + 1).masked_fill(~mask, torch.finfo(torch.float32).min)
        eager = _llama("eager")
        full = eager(torch.cat([ids, nxt], 1), attention_mask=float_mask[None, None])
    torch.testing.assert_close(step.logits[0, -1], full.logits[0, -1], atol=5e-5, rtol=1e-5)
    assert step.past_key_values.layers[0].keys.shape[2] == L // 2 + 1


def test_generate_inside_a_press_and_ratio_zero_changes_nothing():
    ids = _ids(1)
    model = _llama()
    with torch.no_grad():
        plain = model.generate(ids, max_new_tokens=6, do_sample=False)
        with presses.ObservedAttention(0.0)(model):
            same = model.generate(ids, max_new_tokens=6, do_sample=False)
        press = presses.SnapKV(0.5, window_size=8)
        with press(model):
            pressed = model.generate(ids, max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    assert torch.equal(plain, same)
    assert pressed.sequences.shape == (1, L + 6)
    assert pressed.past_key_values.layers[0].keys.shape[2] == L // 2 + 5  # the prefill halved, then 5 steps


def test_h2o_keeps_the_budget_while_decoding_and_evicts_by_running_scores():
    ids = _ids(1)
    model = _llama()
    press = presses.H2O(0.5, recent=4)
    with torch.no_grad(), press(model):
        out = model.generate(ids, max_new_tokens=8, do_sample=False, return_dict_in_generate=True)
    for i in range(2):
        assert out.past_key_values.layers[i].keys.shape[2] == L // 2
        kept = press.kept[i]
        assert kept.shape == (1, HKV, L // 2) and bool((kept.diff(dim=-1) > 0).all())
        assert int(kept.max()) == L + 6  # the last step's own key (8 tokens: 7 steps through the cache)
        assert bool((kept[..., -4:] == torch.arange(L + 3, L + 7)).all())  # the recent window stays


def test_h2o_evictions_replayed_from_the_weights_each_call_used():
    """H2O's running scores and evictions by hand, from the weights each call computed over the cache as it was
    (record_weights: the reference backend beside the fast path), slots mapped back to positions."""
    ids = _ids(1)
    model = _llama()
    press = presses.H2O(0.5, recent=4)
    with torch.no_grad(), attnkit.record_weights(model) as rec, press(model):
        model.generate(ids, max_new_tokens=6, do_sample=False)
    for i in range(2):
        calls = [a.double()[0] for a in rec.calls(f"model.layers.{i}.self_attn")]  # (H, Lq, Lk) each
        first = calls[0]  # the prefill, over the whole prompt
        keep = [sorted(observed(first[None])[0, g].topk(L // 2).indices.tolist()) for g in range(HKV)]
        sums = [{j: first[2 * g : 2 * g + 2, :, j].sum(1).mean().item() for j in keep[g]} for g in range(HKV)]
        seen = [{j: L - j for j in keep[g]} for g in range(HKV)]
        for t, a in enumerate(calls[1:], start=L):  # one token a step
            for g in range(HKV):
                keep[g].append(t)  # the slots are the kept positions in order, then the new one
                sums[g][t], seen[g][t] = 0.0, 0
                for slot, j in enumerate(keep[g]):
                    sums[g][j] += a[2 * g : 2 * g + 2, 0, slot].mean().item()
                    seen[g][j] += 1
                if len(keep[g]) > L // 2:
                    worst = min(keep[g][:-4], key=lambda j: sums[g][j] / seen[g][j])
                    keep[g].remove(worst)
        assert keep == press.kept[i][0].tolist()


def test_kvcache_rows_each_keep_their_share():
    torch.manual_seed(0)
    mha = attnkit.MultiHeadAttention(32, H, num_kv_heads=HKV).eval()
    x = torch.randn(2, 24, 32)
    lens = torch.tensor([24, 15])
    cache = attnkit.KVCache()
    press = presses.ObservedAttention(0.5)
    full = attnkit.KVCache()
    with torch.no_grad():
        mha(x, x, x, lens, is_causal=True, cache=full)  # the same prefill, not pressed
    before = full.keys[:, :, :24]
    with torch.no_grad(), attnkit.record_weights(mha) as rec, press(mha):
        mha(x, x, x, lens, is_causal=True, cache=cache)
        y = mha(x[:, :1], x[:, :1], x[:, :1], is_causal=True, cache=cache)
    assert cache.lengths.tolist() == [13, 8]  # 12 and 7 kept, then one more each
    a = rec.calls("")[0].double()  # (B, H, 24, 24), the reference backend's weights
    real = torch.arange(24)[None, :] < lens[:, None]  # (B, 24): a row's padded queries see nothing
    mask = real[:, None, :] & real[:, :, None] & torch.ones(24, 24, dtype=torch.bool).tril()
    ref = observed(a, mask[:, None])
    ref[1, :, 15:] = float("-inf")  # past row 1's keys: never kept
    _close(press.scores[0][0], ref[0])
    _close(press.scores[0][1, :, :15], ref[1, :, :15])  # row 1's own positions (its others are never kept)
    kept = press.kept[0]
    assert bool((kept[1, :, 7:] == -1).all()) and bool((kept[1, :, :7] < 15).all())
    for b, n in ((0, 12), (1, 7)):
        assert torch.equal(ref[b].topk(n).indices.sort().values, kept[b, :, :n])
        gathered = before[b].gather(1, kept[b, :, :n, None].expand(-1, -1, 8))
        assert torch.equal(cache.keys[b, :, :n], gathered)
    assert torch.isfinite(y).all()


@pytest.mark.parametrize(
    ("make", "error", "words"),
    [
        (lambda: presses.KNorm(1.0), ValueError, "compression_ratio"),
        (lambda: presses.KNorm(-0.1), ValueError, "compression_ratio"),
        (lambda: presses.KNorm(float("nan")), ValueError, "compression_ratio"),
        (lambda: presses.KNorm("0.5"), TypeError, "compression_ratio"),
        (lambda: presses.KNorm(True), TypeError, "compression_ratio"),
        (lambda: presses.SnapKV(0.5, window_size=0), ValueError, "window_size"),
        (lambda: presses.SnapKV(0.5, kernel_size=4), ValueError, "kernel_size"),
        (lambda: presses.StreamingLLM(0.5, n_sink=1.5), TypeError, "n_sink"),
    ],
)
def test_bad_arguments_name_themselves(make, error, words):
    with pytest.raises(error, match=words):
        make()


def test_bad_models_are_refused_with_how_to_switch():
    with pytest.raises(ValueError, match="set_attn_implementation"):
        presses.KNorm(0.5)(_llama("sdpa"))
    bert = transformers.BertModel._from_config(
        transformers.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=2),
        attn_implementation=NAME,
    )
    with pytest.raises(ValueError, match="encoder"):
        presses.KNorm(0.5)(bert)
    with pytest.raises(TypeError, match="torch.nn.Module"):
        presses.KNorm(0.5)("model")
    with pytest.raises(ValueError, match="no attention layer"):
        presses.KNorm(0.5)(torch.nn.Linear(2, 2))
    press, model = presses.KNorm(0.5), _llama()
    with press(model), pytest.raises(ValueError, match="already"), press(model):
        pass


def test_the_model_is_as_it_was_after_the_block_even_after_an_exception():
    model = _llama()
    ids = _ids(1)
    hooks = [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()]
    state = {k: v.clone() for k, v in model.state_dict().items()}
    press = presses.ObservedAttention(0.5)
    with pytest.raises(RuntimeError, match="inside"), torch.no_grad(), press(model):
        model(ids)
        raise RuntimeError("inside the block")
    assert [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()] == hooks
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    with torch.no_grad():
        out = model(ids)  # no press: the cache is whole
    assert out.past_key_values.layers[0].keys.shape[2] == L
    with press(model):  # and the press may be entered again
        pass


def test_a_press_never_writes_into_the_callers_tensors():
    model = _llama()
    ids = _ids(1)
    with torch.no_grad():
        cache = model(ids).past_key_values
        keys = [layer.keys for layer in cache.layers]
        copies = [k.clone() for k in keys]
        press = presses.KNorm(0.5)
        with press(model):
            model(ids[:, :10], past_key_values=transformers.DynamicCache())
            model(ids[:, :3], past_key_values=cache)  # not a prefill: this cache is not compressed
    assert all(torch.equal(k, c) for k, c in zip(keys, copies, strict=True))
    assert cache.layers[0].keys.shape[2] == L + 3


def test_adaptive_budget_shares_the_layers_pairs_by_entropy_and_hides_the_rest_inside_the_block():
    """One layer, so that eager's per-head 4-D mask is the reference: inside the block each head's queries of a
    two-token chunk see exactly its key/value head's budget (and the chunk, causally); after it, every stored slot."""
    model = transformers.LlamaForCausalLM._from_config(_config(1), attn_implementation=NAME).eval()
    eager = transformers.LlamaForCausalLM._from_config(_config(1), attn_implementation="eager").eval()
    eager.load_state_dict(model.state_dict())
    ids, nxt = _ids(1), torch.tensor([[7, 9]])
    press = presses.AdaptiveBudget(presses.ObservedAttention(0.5), most=1.5)
    with torch.no_grad(), attnkit.record_stats(model) as rec:
        model(ids)
    entropy = rec["model.layers.0.self_attn"].entropy[0].double().mean(-1).exp().view(HKV, -1).mean(-1)  # (Hkv,)
    positions = torch.tensor([[L, L + 1]])
    with torch.no_grad(), press(model):
        cache = model(ids).past_key_values
        inside = model(nxt, past_key_values=cache, position_ids=positions).logits[0]
    budgets, kept, visible = press.budgets[0][0], press.kept[0][0], press.visible[0][0]
    assert int(budgets.sum()) == HKV * (L // 2) and bool((budgets >= 1).all()) and bool((budgets <= 30).all())
    assert torch.equal(visible.sum(-1), budgets)
    assert (budgets[0] > budgets[1]) == bool(entropy[0] > entropy[1])  # the wider head keeps more
    assert kept.shape[-1] == 30 == cache.layers[0].keys.shape[2] - 2  # min(L, 1.5 * 20) stored
    ref = observed(_eager_weights_of(eager, ids)[0])[0]  # (Hkv, L)
    for g in range(HKV):  # each head's budget: its best-scored positions
        assert sorted(kept[g][visible[g]].tolist()) == sorted(ref[g].topk(int(budgets[g])).indices.tolist())

    def chunk_with(seen_by_head: list[torch.Tensor]) -> torch.Tensor:
        mask = torch.ones(1, H, L + 2, L + 2, dtype=torch.bool).tril()
        for h in range(H):
            mask[0, h, L:, :L] = False
            mask[0, h, L:, seen_by_head[h // (H // HKV)]] = True
        bias = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
        with torch.no_grad():
            return eager(torch.cat([ids, nxt], 1), attention_mask=bias).logits[0, L:]

    torch.testing.assert_close(inside, chunk_with([kept[g][visible[g]] for g in range(HKV)]), atol=5e-5, rtol=1e-5)
    cache.crop(-2)  # drop the chunk's pairs: the same chunk again, outside the block
    with torch.no_grad():
        after = model(nxt, past_key_values=cache, position_ids=positions).logits[0]
    torch.testing.assert_close(after, chunk_with([kept[g] for g in range(HKV)]), atol=5e-5, rtol=1e-5)


def test_adaptive_budget_stores_as_many_slots_in_every_layer_so_one_mask_fits_a_chunk():
    model = _llama()
    press = presses.AdaptiveBudget(presses.KNorm(0.75))
    with torch.no_grad(), press(model):
        cache = model(_ids(1)).past_key_values
        out = model(torch.tensor([[4, 5, 6]]), past_key_values=cache, position_ids=torch.tensor([[L, L + 1, L + 2]]))
    assert [layer.keys.shape[2] for layer in cache.layers] == [2 * (L // 4) + 3] * 2
    assert torch.isfinite(out.logits).all()


def _eager_weights_of(model: Any, ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        return tuple(a.double() for a in model(ids, output_attentions=True).attentions)


def test_adaptive_budget_refuses_what_it_cannot_do():
    with pytest.raises(TypeError, match="press"):
        presses.AdaptiveBudget(presses.H2O(0.5))
    with pytest.raises(TypeError, match="press"):
        presses.AdaptiveBudget(0.5)
    with pytest.raises(ValueError, match="most"):
        presses.AdaptiveBudget(presses.KNorm(0.5), most=0.5)
    mha = attnkit.MultiHeadAttention(16, 2).eval()
    x = torch.randn(1, 8, 16)
    with pytest.raises(ValueError, match="KVCache"), presses.AdaptiveBudget(presses.KNorm(0.5))(mha):
        mha(x, x, x, is_causal=True, cache=attnkit.KVCache())


def test_a_compressed_layer_appends_in_place_and_decodes_as_transformers_own_layer():
    """After a press, each layer appends a step's pair into room it holds (no copy of the cache a step); the
    logits of every step equal those through transformers' own DynamicLayer holding the same pairs, also after
    something replaced its tensors (reorder_cache) and with gradients on."""
    ids = _ids(1)
    model = _llama()
    with torch.no_grad(), presses.KNorm(0.5)(model):
        cache = model(ids).past_key_values
    plain = transformers.DynamicCache()
    for i, layer in enumerate(cache.layers):
        plain.update(layer.keys.clone(), layer.values.clone(), i)
    assert type(cache.layers[0]).__name__ == "Compressed" and type(plain.layers[0]).__name__ == "DynamicLayer"
    token = torch.tensor([[3]])
    for t in range(6):
        if t == 3:
            cache.reorder_cache(torch.tensor([0]))  # replaces keys and values: the room is made again
        pos = torch.tensor([[L + t]])
        with torch.no_grad():
            mine = model(token, past_key_values=cache, position_ids=pos).logits
            theirs = model(token, past_key_values=plain, position_ids=pos).logits
        assert torch.equal(mine, theirs)
        room = cache.layers[0].room_keys
        assert cache.layers[0].keys.data_ptr() == room.data_ptr() and room.shape[2] >= L // 2 + t + 1
        token = mine[:, -1].argmax(-1, keepdim=True)
    mine = model(token, past_key_values=cache, position_ids=torch.tensor([[L + 6]])).logits  # with gradients
    theirs = model(token, past_key_values=plain, position_ids=torch.tensor([[L + 6]])).logits
    torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    mine.sum().backward()
    assert cache.layers[0].keys.shape[2] == L // 2 + 7


def test_window_presses_refuse_rows_of_different_lengths_and_read_a_static_caches_own_positions():
    torch.manual_seed(0)
    mha = attnkit.MultiHeadAttention(32, H, num_kv_heads=HKV).eval()
    x = torch.randn(2, 24, 32)
    for press in (presses.SnapKV(0.5, window_size=4), presses.TOVA(0.5), presses.StreamingLLM(0.5), presses.H2O(0.5)):
        cache = attnkit.KVCache()
        with torch.no_grad(), press(mha), pytest.raises(ValueError, match=r"\[24, 15\]"):
            mha(x, x, x, torch.tensor([24, 15]), is_causal=True, cache=cache)
    for press in (presses.TOVA(0.5), presses.StreamingLLM(0.5, n_sink=2), presses.ObservedAttention(0.5)):
        cache = attnkit.KVCache(max_len=64)  # 64 slots, 24 positions
        with torch.no_grad(), press(mha):
            mha(x, x, x, is_causal=True, cache=cache)
        assert press.scores[0].shape == (2, HKV, 24) and cache.lengths.tolist() == [12, 12]
    assert press.kept[0].max() < 24
    assert streaming_kept(presses.StreamingLLM(0.5, n_sink=2), mha, x) == [0, 1, *range(14, 24)]


def streaming_kept(press, mha, x) -> list[int]:
    with torch.no_grad(), press(mha):
        mha(x, x, x, is_causal=True, cache=attnkit.KVCache(max_len=64))
    return press.kept[0][0, 0].tolist()


def test_two_presses_on_one_model_at_once_are_refused():
    model = _llama()
    first, second = presses.KNorm(0.5), presses.ObservedAttention(0.5)
    with first(model), pytest.raises(ValueError, match="another press"), second(model):
        pass
    blocks = first(model), first(model)  # made before either opens: refused when the second opens
    with blocks[0], pytest.raises(ValueError, match="already"), blocks[1]:
        pass
    with second(model):  # and each may open again after
        pass


def test_a_custom_score_of_the_wrong_shape_and_a_zero_question_are_refused():
    class QueryHeads(presses.Press):
        def score(self, layer):
            return layer.column_sums()  # (B, H, L): the query heads, not the key/value heads

    model = _llama()
    with torch.no_grad(), QueryHeads(0.5)(model), pytest.raises(ValueError, match=r"\(1, 2, 40\), got \(1, 4, 40\)"):
        model(_ids(1))
    with pytest.raises(ValueError, match="question_tokens"):
        presses.QuestionAware(0.5, question_tokens=0)


def test_adaptive_budget_refuses_a_kvcache_before_changing_it():
    mha = attnkit.MultiHeadAttention(16, 2).eval()
    x = torch.randn(1, 8, 16)
    cache = attnkit.KVCache()
    with pytest.raises(ValueError, match="KVCache"), presses.AdaptiveBudget(presses.KNorm(0.5))(mha):
        mha(x, x, x, is_causal=True, cache=cache)
    assert cache.lengths.tolist() == [8]


def test_adaptive_budget_hides_slots_only_for_calls_over_its_compressed_cache():
    model = _llama()
    ids = _ids(1)
    press = presses.AdaptiveBudget(presses.ObservedAttention(0.5))
    with torch.no_grad():
        plain = model(ids, use_cache=False).logits
        with press(model):
            model(ids)  # a prefill, compressed
            again = model(ids).past_key_values  # a second prefill in the block: its own cache, its own budget
            inside = model(ids, use_cache=False).logits  # no cache: nothing hidden
    assert torch.equal(inside, plain)
    assert again.layers[0].keys.shape[2] == L  # min(L, 2 * 20)


def test_a_compressed_cache_from_inference_mode_decodes_after_it_and_never_writes_into_earlier_tensors():
    model = _llama()
    ids = _ids(1)
    with torch.inference_mode(), presses.KNorm(0.5)(model):
        cache = model(ids).past_key_values
    token, pos = torch.tensor([[3]]), torch.tensor([[L]])
    with torch.no_grad():
        model(token, past_key_values=cache, position_ids=pos)  # (an inference tensor held: made anew here)
        model(token, past_key_values=cache, position_ids=pos + 1)
    handed = cache.layers[0].keys  # a tensor the cache gave out
    copy = handed.clone()
    cache.crop(-2)
    with torch.no_grad():
        model(torch.tensor([[5]]), past_key_values=cache, position_ids=pos)
    assert torch.equal(handed, copy)


def test_a_generate_in_another_thread_inside_the_block_is_pressed():
    import threading

    model = _llama()
    ids = _ids(1)
    press = presses.SnapKV(0.5, window_size=8)
    found = {}

    def generate():
        with torch.no_grad():
            found["out"] = model.generate(ids, max_new_tokens=3, do_sample=False, return_dict_in_generate=True)

    with press(model):
        thread = threading.Thread(target=generate)
        thread.start()
        thread.join()
    assert found["out"].past_key_values.layers[0].keys.shape[2] == L // 2 + 2
    assert sorted(press.kept) == [0, 1]


def test_a_compressed_cache_counts_the_tokens_it_has_seen_so_generate_can_continue_it():
    """transformers reads a cache's length as the tokens it has seen: a later generate continues a compressed
    cache (feeding only the new tokens, at their positions), as the same calls with explicit position_ids."""
    ids = _ids(1)
    model = _llama()
    with torch.no_grad(), presses.StreamingLLM(0.5, n_sink=2)(model):
        out = model.generate(ids, max_new_tokens=4, do_sample=False, return_dict_in_generate=True)
    cache = out.past_key_values
    assert cache.get_seq_length() == L + 3 and cache.layers[0].keys.shape[2] == L // 2 + 3
    more = torch.tensor([[9, 10, 11]])
    by_hand = _copy(cache)
    with torch.no_grad():
        again = model.generate(
            torch.cat([out.sequences, more], 1),
            past_key_values=cache,
            max_new_tokens=1,
            do_sample=False,
            return_dict_in_generate=True,
            output_logits=True,
        )
        chunk = torch.cat([out.sequences[:, -1:], more], 1)  # the last generated token was never fed
        ref = model(chunk, past_key_values=by_hand, position_ids=torch.arange(L + 3, L + 7)[None]).logits[0, -1]
    assert cache.layers[0].keys.shape[2] == L // 2 + 7  # the four new tokens, nothing fed twice
    torch.testing.assert_close(again.logits[0][0], ref, rtol=1e-5, atol=1e-5)


def _copy(cache: Any) -> Any:
    out = transformers.DynamicCache()
    for i, layer in enumerate(cache.layers):
        out.update(layer.keys.clone(), layer.values.clone(), i)
    return out


def test_prompt_lookup_inside_a_press_is_refused_where_it_would_crop_pressed_positions():
    """Prompt lookup prefills its draft tokens with the prompt, so the press keeps or drops them with it, and
    the crop of the rejected ones would take other positions: refused, never a silently other sequence."""
    ids = _ids(1)
    prompt = torch.cat([ids, ids[:, :20]], 1)
    model = _llama()
    with pytest.raises(ValueError, match="prompt lookup"), torch.no_grad(), presses.ObservedAttention(0.5)(model):
        model.generate(prompt, max_new_tokens=10, do_sample=False, prompt_lookup_num_tokens=4)


def test_a_shallow_copy_of_a_compressed_layer_appends_apart():
    import copy

    ids = _ids(1)
    model = _llama()
    with torch.no_grad(), presses.KNorm(0.5)(model):
        cache = model(ids).past_key_values
    twin = transformers.DynamicCache()
    twin.layers = [copy.copy(layer) for layer in cache.layers]
    reference = _copy(cache)
    pos = torch.tensor([[L]])
    with torch.no_grad():
        model(torch.tensor([[3]]), past_key_values=twin, position_ids=pos)
        mine = model(torch.tensor([[4]]), past_key_values=cache, position_ids=pos).logits
        theirs = model(torch.tensor([[4]]), past_key_values=reference, position_ids=pos).logits
    assert torch.equal(mine, theirs)


def test_streaming_llm_keeps_its_sinks_first_when_it_keeps_fewer_than_them():
    torch.manual_seed(0)
    mha = attnkit.MultiHeadAttention(16, 2).eval()
    x = torch.randn(1, 6, 16)
    press = presses.StreamingLLM(0.5, n_sink=4)  # keeps 3 of 6: the first 3 sinks
    with torch.no_grad(), press(mha):
        mha(x, x, x, is_causal=True, cache=attnkit.KVCache())
    assert press.kept[0][0, 0].tolist() == [0, 1, 2]
    press = presses.StreamingLLM(0.5, n_sink=1)  # keeps 3: the sink and the 2 most recent
    with torch.no_grad(), press(mha):
        mha(x, x, x, is_causal=True, cache=attnkit.KVCache())
    assert press.kept[0][0, 0].tolist() == [0, 4, 5]


def test_what_h2o_and_the_presses_cannot_follow_is_refused():
    torch.manual_seed(0)
    mha = attnkit.MultiHeadAttention(16, 2).eval()
    x = torch.randn(1, 30, 16)
    with pytest.raises(ValueError, match="sliding"), torch.no_grad(), presses.KNorm(0.5)(mha):
        mha(x, x, x, is_causal=True, cache=attnkit.KVCache(window=8))
    with pytest.raises(ValueError, match="static"), torch.no_grad(), presses.H2O(0.5)(mha):
        mha(x, x, x, is_causal=True, cache=attnkit.KVCache(max_len=40))
    model = _llama()
    with pytest.raises(ValueError, match="beam search"), torch.no_grad(), presses.H2O(0.5)(model):
        model.generate(_ids(1), max_new_tokens=3, num_beams=2, do_sample=False)
    with pytest.raises(ValueError, match="most"):
        presses.AdaptiveBudget(presses.KNorm(0.5), most=float("inf"))
