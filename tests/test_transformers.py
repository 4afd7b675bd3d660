"""attnkit as an attention implementation of Hugging Face transformers, on the models' own code: tiny Llama (GQA),
GPT-2, BERT, BART and T5 built from configs with random weights (no downloads), against transformers' own ``eager``
and ``sdpa``: logits and hidden states, gradients of every parameter, weights (``output_attentions`` and
``record_weights``), right and left padding, and ``generate()`` with transformers' cache. Every attnkit backend."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

import attnkit
from mathref import max_err

transformers = pytest.importorskip("transformers")
from attnkit.integrations import transformers as attnkit_hf  # noqa: E402

# B batch, L length, V vocabulary

V, B, L = 96, 3, 11
# float32 through 2 layers of 64 features: a few ulps of the activations, which are O(1-10)
LOGIT_TOL = 5e-5
GRAD_TOL = 5e-4  # relative to the largest gradient entry of the parameter
WEIGHT_TOL = 1e-5
BACKENDS = ("auto", "reference", "sdpa", "tiles:online")


def _register() -> dict[str, str]:
    # (no "sdpa" in a name: transformers would read it as its own SDPA, see the refusal tested below)
    names = {
        "auto": "attnkit",
        "reference": "attnkit-reference",
        "sdpa": "attnkit-fused",
        "tiles:online": "attnkit-chunked",
    }
    return {b: attnkit_hf.register(names[b], backend=b) for b in BACKENDS}


NAMES = _register()


def _llama() -> Any:
    return transformers.LlamaForCausalLM, transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,  # grouped-query: 2 query heads per key/value head
        max_position_embeddings=64,
    )


def _gpt2() -> Any:
    return transformers.GPT2LMHeadModel, transformers.GPT2Config(
        vocab_size=V, n_embd=64, n_layer=2, n_head=4, n_positions=64
    )


def _bert() -> Any:
    return transformers.BertForMaskedLM, transformers.BertConfig(
        vocab_size=V,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=64,
    )


def _bart() -> Any:
    return transformers.BartForConditionalGeneration, transformers.BartConfig(
        vocab_size=V,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=128,
        decoder_ffn_dim=128,
        max_position_embeddings=64,
    )


def _t5() -> Any:
    return transformers.T5ForConditionalGeneration, transformers.T5Config(
        vocab_size=V,
        d_model=64,
        d_kv=16,
        d_ff=128,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        decoder_start_token_id=0,
    )


MODELS: dict[str, Callable[[], Any]] = {"llama": _llama, "gpt2": _gpt2, "bert": _bert, "bart": _bart, "t5": _t5}
DECODER_ONLY = ("llama", "gpt2")
SEQ2SEQ = ("bart", "t5")


def _models(kind: str, impls: tuple[str, ...]) -> dict[str, Any]:
    """The same random weights under each attention implementation, in eval mode (no dropout)."""
    cls, config = MODELS[kind]()
    torch.manual_seed(0)
    first = cls._from_config(config, attn_implementation="eager").eval()
    out = {"eager": first}
    for impl in impls:
        if impl != "eager":
            m = cls._from_config(MODELS[kind]()[1], attn_implementation=impl).eval()  # a config of its own each
            m.load_state_dict(first.state_dict())
            out[impl] = m
    for impl, m in out.items():
        assert m.config._attn_implementation == impl, (impl, m.config._attn_implementation)
    return out


def _batch(kind: str, padding: str) -> dict[str, torch.Tensor]:
    """Token ids and a 0/1 mask of lengths 11, 7, 4 (right or left padded); seq2seq models get decoder ids too."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, V, (B, L), generator=g)
    lens = torch.tensor([L, 7, 4])
    pos = torch.arange(L)
    real = pos < lens[:, None] if padding == "right" else pos >= (L - lens)[:, None]  # (B, L)
    batch = {"input_ids": ids.masked_fill(~real, 0), "attention_mask": real.long()}
    if kind in SEQ2SEQ:
        batch["decoder_input_ids"] = torch.randint(3, V, (B, 5), generator=g)
    return batch


def _real_rows(kind: str, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """(B, Lq) bool: the output positions every implementation must agree on (padding queries are each one's own)."""
    if kind in SEQ2SEQ:
        return torch.ones_like(batch["decoder_input_ids"], dtype=torch.bool)
    return batch["attention_mask"].bool()


@pytest.mark.parametrize(
    ("kind", "padding"), [(kind, "right") for kind in MODELS] + [(kind, "left") for kind in DECODER_ONLY]
)
def test_outputs_and_hidden_states_equal_eager_and_sdpa(kind, padding):
    models = _models(kind, ("sdpa", *NAMES.values()))
    batch = _batch(kind, padding)
    rows = _real_rows(kind, batch)
    with torch.no_grad():
        outs = {name: m(**batch, output_hidden_states=True) for name, m in models.items()}
    truth = outs["eager"]
    for name, out in outs.items():
        assert torch.isfinite(out.logits).all(), name  # padded rows included: no NaN anywhere
        assert max_err(out.logits[rows], truth.logits[rows]) <= LOGIT_TOL, name
        hidden = out.decoder_hidden_states if kind in SEQ2SEQ else out.hidden_states
        truth_hidden = truth.decoder_hidden_states if kind in SEQ2SEQ else truth.hidden_states
        for h, t in zip(hidden, truth_hidden, strict=True):
            assert max_err(h[rows], t[rows]) <= LOGIT_TOL, name


@pytest.mark.parametrize("kind", list(MODELS))
def test_gradients_of_every_parameter_equal_eager(kind):
    padding = "left" if kind in DECODER_ONLY else "right"
    models = _models(kind, (NAMES["auto"], NAMES["tiles:online"]))
    batch = _batch(kind, padding)
    rows = _real_rows(kind, batch)
    g = torch.Generator().manual_seed(2)
    upstream = None
    grads = {}
    for name, m in models.items():
        m.zero_grad()
        logits = m(**batch).logits
        upstream = torch.randn(logits.shape, generator=g) if upstream is None else upstream
        (logits[rows] * upstream[rows]).sum().backward()
        grads[name] = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    truth = grads.pop("eager")
    for name, got in grads.items():
        assert got.keys() == truth.keys(), name
        for n, t in truth.items():
            assert max_err(got[n], t) <= GRAD_TOL * max(1.0, t.abs().max().item()), (name, n)


@pytest.mark.parametrize("kind", list(MODELS))
def test_weights_recorded_from_the_fused_path_and_output_attentions_equal_eager(kind):
    padding = "left" if kind in DECODER_ONLY else "right"
    models = _models(kind, (NAMES["sdpa"],))
    eager, fused = models["eager"], models[NAMES["sdpa"]]
    batch = _batch(kind, padding)
    with torch.no_grad():
        truth = eager(**batch, output_attentions=True)
        with attnkit.record_weights(fused) as rec:
            out = fused(**batch)
        returned = fused(**batch, output_attentions=True)
    assert torch.equal(out.logits, returned.logits)  # recording changes nothing in the output
    encoder_rows = batch["attention_mask"].bool()  # (B, L): the real queries of the (self-attending) inputs
    for field, names, rows in _attention_fields(kind, list(rec.keys()), encoder_rows):
        want, given = getattr(truth, field), getattr(returned, field)
        assert len(names) == len(want) == len(given) > 0, (field, list(rec.keys()))
        for name, t, r in zip(names, want, given, strict=True):
            w = rec[name]  # (B, H, Lq, Lk)
            assert max_err(w.transpose(1, 2)[rows], t.transpose(1, 2)[rows]) <= WEIGHT_TOL, name
            assert max_err(r, w) <= WEIGHT_TOL, name


def _attention_fields(kind: str, names: list[str], encoder_rows: torch.Tensor) -> list[tuple[str, list[str], Any]]:
    """(output field, recorded module names in layer order, real query rows) for each kind of attention."""
    cross_words = ("encoder_attn", "EncDecAttention", "crossattention")
    cross = [n for n in names if any(w in n for w in cross_words)]
    own = [n for n in names if n not in cross]
    if kind not in SEQ2SEQ:
        return [("attentions", own, encoder_rows)]
    every = torch.ones(B, 5, dtype=torch.bool)  # the decoder's inputs are not padded
    return [
        ("encoder_attentions", [n for n in own if "encoder" in n], encoder_rows),
        ("decoder_attentions", [n for n in own if "decoder" in n], every),
        ("cross_attentions", cross, every),
    ]


@pytest.mark.parametrize("kind", [*DECODER_ONLY, *SEQ2SEQ])
def test_generate_gives_the_same_tokens_with_the_cache(kind):
    padding = "left" if kind in DECODER_ONLY else "right"
    models = _models(kind, ("sdpa", NAMES["auto"], NAMES["tiles:online"]))
    batch = _batch(kind, padding)
    batch.pop("decoder_input_ids", None)
    tokens = {
        name: m.generate(**batch, max_new_tokens=8, do_sample=False, pad_token_id=0) for name, m in models.items()
    }
    for name, t in tokens.items():
        assert torch.equal(t, tokens["eager"]), name


def test_left_padded_rows_give_zeros_not_nan():
    """The queries of left padding see nothing: attnkit gives them zero weights and output, so nothing downstream
    turns NaN, in float16 too."""
    models = _models("llama", (NAMES["auto"],))
    m = models[NAMES["auto"]]
    batch = _batch("llama", "left")
    with torch.no_grad(), attnkit.record_weights(m) as rec:
        out = m(**batch, output_hidden_states=True)
    assert all(torch.isfinite(h).all() for h in out.hidden_states)
    w = rec["model.layers.0.self_attn"]  # (B, H, Lq, Lk)
    pad = ~batch["attention_mask"].bool()  # (B, L)
    assert (w[pad[:, None, :].expand(w.shape[:3])] == 0).all()


def test_what_the_readme_says_eager_gives_left_padded_queries_still_holds():
    """README: transformers' eager gives a query of left padding the same weight, 1/L, on every key, future keys
    included (its mask is the dtype's minimum everywhere on that row, and a softmax of equal scores is uniform);
    attnkit gives zeros. If a transformers release changes this, the README's sentence must change with it."""
    eager = _models("llama", ())["eager"]
    batch = _batch("llama", "left")
    with torch.no_grad():
        weights = eager(**batch, output_attentions=True, return_dict=True).attentions[0]  # (B, H, L, L)
    pad = ~batch["attention_mask"].bool()  # (B, L)
    rows = weights[pad[:, None, :].expand(weights.shape[:3])]  # (padding queries x H, L)
    assert len(rows) > 0
    torch.testing.assert_close(rows, torch.full_like(rows, 1 / L))


def test_softcap_sinks_and_sliding_window_map_to_attnkit():
    """The arguments other models pass (Gemma 2's softcap, gpt-oss's sinks, Mistral's window without a mask) become
    attnkit's score_mod, sinks and mask_mod: the function equals attnkit's own call with them."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 9, 8, generator=g) for _ in range(3))
    sinks = torch.randn(4, generator=g)

    class Module(torch.nn.Module):
        is_causal = True

    out, weights = attnkit_hf.attention_forward(
        Module(), q, k, v, None, scaling=0.3, softcap=5.0, s_aux=sinks, sliding_window=3, output_attentions=True
    )
    want = attnkit.scaled_dot_product_attention(
        q,
        k,
        v,
        is_causal=True,
        scale=0.3,
        score_mod=attnkit.mods.softcap(5.0),
        sinks=sinks,
        mask_mod=attnkit.mods.sliding_window(3),
        backend="reference",
        need_weights=True,
    )
    assert max_err(out, want.output.transpose(1, 2)) <= 1e-6
    assert max_err(weights, want.weights) <= 1e-6
    assert (weights[..., 5, :2] == 0).all()  # outside the window


def test_a_layers_sliding_window_is_planned_once_for_all_its_calls(monkeypatch):
    """The window a model passes is one object per attention module, whose plans serve its next calls (reviewer's
    finding: a new window each call planned every layer's every forward again)."""
    from attnkit import plan

    built = []
    original = plan.Plan.build
    monkeypatch.setattr(plan.Plan, "build", classmethod(lambda cls, *a, **kw: built.append(1) or original(*a, **kw)))

    class Module(torch.nn.Module):
        is_causal = True

    layer = Module()
    q = torch.randn(1, 2, 600, 8)
    first = attnkit_hf.attention_forward(layer, q, q, q, None, sliding_window=64)[0]
    again = attnkit_hf.attention_forward(layer, q, q, q, None, sliding_window=64)[0]
    assert len(built) == 1 and torch.equal(first, again)
    attnkit_hf.attention_forward(layer, q, q, q, None, sliding_window=32)  # another window: planned for itself
    assert len(built) == 2
    import copy
    import pickle

    assert "attnkit_plans" not in pickle.loads(pickle.dumps(layer._attnkit_window)).__dict__
    assert "attnkit_plans" not in copy.deepcopy(layer).__dict__["_attnkit_window"].__dict__


def test_packed_position_ids_without_a_mask_keep_each_document_to_itself():
    """A call with no mask and packed ``position_ids`` (DeepSpeed Ulysses drops every mask; transformers builds
    none for packed rows when a cache is passed): attention stays within each document, read as transformers reads
    them (a document starts where a position does not follow the one before), and its weights say the same."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 4, 9, 8, generator=g) for _ in range(3))
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1], [5, 6, 7, 8, 9, 10, 11, 12, 13]])  # (B, L)
    ids = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 2, 2], [0] * 9])  # the second row: one document

    class Module(torch.nn.Module):
        is_causal = True

    out, weights = attnkit_hf.attention_forward(Module(), q, k, v, None, position_ids=positions, output_attentions=True)
    want = attnkit.scaled_dot_product_attention(
        q, k, v, is_causal=True, mask_mod=attnkit.mods.document(ids), backend="reference", need_weights=True
    )
    assert max_err(out, want.output.transpose(1, 2)) <= 1e-6
    assert max_err(weights, want.weights) <= 1e-6
    assert (weights[0, :, 4, :4] == 0).all() and (weights[1, :, 8, :8] > 0).all()


@pytest.mark.parametrize("given", ["a cache", "a mask of ones", "another row padded"])
def test_packed_documents_keep_apart_whatever_mask_comes_with_the_call(given):
    """One rule, not one that depends on whether transformers built a mask: row 0 packs documents of 4 and 6
    tokens and equals each document alone (float64), with a cache (transformers builds no mask), with a mask of
    ones (transformers' own packed mask gives way to it), and while another row of the batch is left-padded."""
    model_class, config = _llama()
    torch.manual_seed(0)
    model = model_class(config).double().eval()
    model.set_attn_implementation(NAMES["auto"])
    tokens = torch.randint(0, V, (2, 10), generator=torch.Generator().manual_seed(7))  # (B, L)
    packed = torch.cat([torch.arange(4), torch.arange(6)]).expand(2, 10).clone()  # (B, L)
    kwargs: dict[str, Any] = {"position_ids": packed, "use_cache": given == "a cache"}
    if given == "a mask of ones":
        kwargs["attention_mask"] = torch.ones(2, 10, dtype=torch.long)
    if given == "another row padded":
        kwargs["attention_mask"] = torch.ones(2, 10, dtype=torch.long)
        kwargs["attention_mask"][1, :3] = 0
    with torch.no_grad():
        logits = model(tokens, **kwargs).logits  # (B, 10, V)
        alone = torch.cat([model(tokens[:1, :4]).logits, model(tokens[:1, 4:]).logits], dim=1)  # (1, 10, V)
    assert max_err(logits[:1], alone) <= 1e-10


def test_position_ids_of_one_document_change_nothing():
    """A row that counts up by one (from anywhere) is one document: the call runs as without position_ids, on the
    same backend. position_ids of another batch are a ValueError."""
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, 4, 9, 8, generator=g) for _ in range(3))

    class Module(torch.nn.Module):
        is_causal = True

    with attnkit.dispatch.watch(implementations=True) as plain:
        want, _ = attnkit_hf.attention_forward(Module(), q, k, v, None)
    with attnkit.dispatch.watch(implementations=True) as ran:
        out, _ = attnkit_hf.attention_forward(Module(), q, k, v, None, position_ids=torch.arange(3, 12)[None])
    assert ran == plain and torch.equal(out, want)

    positions = torch.arange(9).expand(2, 9).clone()  # (B, L)
    positions[:, 5:] -= 5  # two documents a row
    out, _ = attnkit_hf.attention_forward(Module(), q, k, v, None, position_ids=positions)
    ids = torch.tensor([[0] * 5 + [1] * 4])
    want = attnkit.scaled_dot_product_attention(q, k, v, is_causal=True, mask_mod=attnkit.mods.document(ids))
    assert max_err(out, want.output.transpose(1, 2)) <= 1e-6

    with pytest.raises(ValueError, match=r"position_ids must have shape \(B, L\) or \(1, L\) = \(1\|2, 9\)"):
        attnkit_hf.attention_forward(Module(), q, k, v, None, position_ids=torch.arange(9).expand(3, 9))


def test_a_float_mask_with_transformers_minimum_hides_and_keeps_the_bias():
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, 2, 3, 4, generator=g) for _ in range(3))
    bias = torch.randn(1, 1, 3, 3, generator=g)
    hidden = torch.tensor([[False, True, True], [False, False, True], [True, True, True]])
    hf_mask = bias.masked_fill(hidden, torch.finfo(torch.float32).min)

    class Module(torch.nn.Module):
        is_causal = False

    out, weights = attnkit_hf.attention_forward(Module(), q, k, v, hf_mask, output_attentions=True)
    assert (weights[..., hidden] == 0).all() and (out[:, 2] == 0).all()  # row 2 sees nothing: zeros, not uniform
    want = attnkit.scaled_dot_product_attention(
        q, k, v, attn_mask=bias.masked_fill(hidden, float("-inf")), need_weights=True
    )
    assert max_err(weights, want.weights) <= 1e-6


def test_import_attnkit_does_not_import_transformers():
    code = "import sys, attnkit, attnkit.integrations; assert 'transformers' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_model_whose_attention_bypasses_the_interface_is_refused():
    """Bloom computes its attention itself and adds the mask to its own scores: attnkit's boolean mask would mask
    nothing. Its class says so (_supports_attention_backend = False): refused, not silently wrong."""
    config = transformers.BloomConfig(vocab_size=V, hidden_size=64, n_layer=2, n_head=4)
    model = transformers.BloomForCausalLM._from_config(config, attn_implementation=NAMES["auto"]).eval()
    with pytest.raises(ValueError, match="computes its attention itself"):
        model(torch.randint(3, V, (1, 8)))


def test_register_refuses_an_unknown_backend_and_transformers_own_names():
    with pytest.raises(ValueError, match="backend must be 'auto' or one of"):
        attnkit_hf.register("attnkit-typo", backend="nonsense")
    with pytest.raises(ValueError, match="one of transformers' own attention implementations"):
        attnkit_hf.register("sdpa")
    assert attnkit_hf.register(NAMES["auto"]) == NAMES["auto"]  # attnkit's own name: registered again


@pytest.mark.parametrize(
    "name", ["my-sdpa-attnkit", "attnkit-flash", "attnkit_flex_attention", "paged|attnkit", "me/attnkit", "attnkit:v1"]
)
def test_register_refuses_a_name_transformers_reads_meaning_into(name):
    """transformers reads 'sdpa', 'flash', 'flex_attention', '|', '/' and ':' in an implementation's name as naming one
    of its own kinds: attnkit registered as 'my-sdpa-attnkit' was treated as SDPA (Gemma 2 and GPT-OSS then refused
    to build). Such names are refused, saying which word and what to choose."""
    with pytest.raises(ValueError, match="transformers reads as naming one of its own kinds of attention"):
        attnkit_hf.register(name)


def _gemma2() -> Any:
    return transformers.Gemma2ForCausalLM, transformers.Gemma2Config(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
    )


def test_the_reason_to_refuse_sdpa_in_a_name_still_holds_in_this_transformers():
    """Guards the refusal above: registered under a name holding 'sdpa' (straight into transformers' interfaces,
    past register()), attnkit makes Gemma 2 refuse to build; under attnkit's name it builds and runs."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register("guard-sdpa-attnkit", attnkit_hf.attention_forward)
    AttentionMaskInterface.register("guard-sdpa-attnkit", attnkit_hf._mask)
    model_class, config = _gemma2()
    with pytest.raises(ValueError, match="scaled_dot_product_attention"):
        model_class._from_config(config, attn_implementation="guard-sdpa-attnkit")
    model = model_class._from_config(config, attn_implementation=NAMES["auto"]).eval()
    assert torch.isfinite(model(torch.randint(3, V, (1, 8))).logits).all()


def test_the_private_transformers_names_attnkit_reads_are_where_it_was_checked():
    """attnkit reads three private names of transformers (checked against 5.23, named in the integration): if one
    moves, this fails, rather than a refusal quietly becoming a pass or weights quietly going missing."""

    from transformers import AttentionInterface, AutoModel
    from transformers.utils import output_capturing

    assert "sdpa" in AttentionInterface._global_mapping and "eager" not in AttentionInterface._global_mapping
    assert AutoModel._model_mapping[transformers.LlamaConfig] is transformers.LlamaModel
    assert callable(output_capturing._active_collector.get)  # a (compile-friendly) context variable
    assert attnkit_hf._collector is output_capturing._active_collector


def test_which_models_look_their_attention_up_is_read_from_their_code_not_guessed():
    """A model goes through the interface when its module holds transformers' ALL_ATTENTION_FUNCTIONS (Llama, T5,
    BART: yes; Bloom, CodeGen: no); a config AutoModel does not know is said in a warning, not passed in silence."""
    through = attnkit_hf._goes_through_the_interface
    assert [through(c) for c in (transformers.LlamaConfig, transformers.T5Config, transformers.BartConfig)] == [
        True
    ] * 3
    assert [through(c) for c in (transformers.BloomConfig, transformers.CodeGenConfig)] == [False, False]

    class OwnConfig(transformers.LlamaConfig):
        model_type = "attnkit-test-own"

    assert through(OwnConfig) is None
    with pytest.warns(UserWarning, match="cannot find the model code of OwnConfig"):
        attnkit_hf._mask(batch_size=1, q_length=4, kv_length=4, config=OwnConfig())


def test_a_static_cache_prefill_returns_weights_over_every_slot():
    """A static cache's prefill brings more key slots than queries (the rest empty): the output is computed over
    the first Lq keys, as transformers' sdpa does, and the weights come back over every slot, as eager's."""
    g = torch.Generator().manual_seed(5)
    q, k, v = torch.randn(1, 4, 3, 8, generator=g), torch.randn(1, 2, 5, 8, generator=g), torch.randn(1, 2, 5, 8)

    class Module(torch.nn.Module):
        is_causal = True

    out, weights = attnkit_hf.attention_forward(Module(), q, k, v, None, output_attentions=True)
    want = attnkit.scaled_dot_product_attention(q, k[:, :, :3], v[:, :, :3], is_causal=True, need_weights=True)
    assert weights.shape == (1, 4, 3, 5) and (weights[..., 3:] == 0).all()
    assert max_err(weights[..., :3], want.weights) <= 1e-6
    assert max_err(out, want.output.transpose(1, 2)) <= 1e-6


def test_register_refuses_eager_which_transformers_keeps_outside_its_mapping():
    """'eager' is transformers' own implementation but not in AttentionInterface's mapping: registering attnkit
    under it took over every model's eager attention in the process."""
    with pytest.raises(ValueError, match="one of transformers' own attention implementations"):
        attnkit_hf.register("eager")


@pytest.mark.parametrize("kind", ["llama", "bert"])
def test_statistics_recorded_through_transformers_equal_those_of_eager_weights(kind):
    """record_stats on a model with attnkit registered: each layer's statistics are those reduced from eager's
    output_attentions (GQA and left padding in Llama, right padding in BERT) on the real query rows; the column
    sums over every row (a left pad's query sees no key, where eager spreads it evenly; BERT's pad queries see
    the real keys in both)."""
    padding = "left" if kind in DECODER_ONLY else "right"
    models = _models(kind, (NAMES["auto"],))
    eager, ours = models["eager"], models[NAMES["auto"]]
    batch = _batch(kind, padding)
    real = batch["attention_mask"].bool()  # (B, L)
    with torch.no_grad():
        truth = eager(**batch, output_attentions=True).attentions
        with attnkit.record_stats(ours, topk=3) as rec:
            ours(**batch)
    assert len(rec) == len(truth) > 0
    for name, t in zip(rec.keys(), truth, strict=True):
        w = t.double() * real[:, None, :, None] if padding == "left" else t.double()  # (B, H, L, L)
        want, got = attnkit.stats.from_weights(w, 3), rec[name]
        for field in ("topk_values", "entropy", "distance", "sink_mass"):
            assert max_err(getattr(got, field).transpose(1, 2)[real], getattr(want, field).transpose(1, 2)[real]) <= (
                1e-4
            ), (name, field)
        assert max_err(got.column_sum, want.column_sum) <= 1e-4, name
        named = w.gather(-1, got.topk_indices.clamp_min(0))  # (B, H, L, 3)
        assert max_err(torch.where(got.topk_indices >= 0, named, 0.0), got.topk_values) <= 1e-5, name


def test_statistics_of_an_unpadded_prompt_come_from_the_forwards_row_sums(monkeypatch):
    """Llama (GQA, causal) on a prompt without padding, under no_grad: the forward runs PyTorch's fused kernel,
    which gives each row's log-sum-exp, and every layer's statistics are computed tile by tile from it
    (attnkit.stats.tiled; rows of any length, here), equal to those reduced from eager's output_attentions."""
    from attnkit.stats import tiled

    used = []
    original = tiled.compute
    monkeypatch.setattr(tiled, "compute", lambda *a: (used.append(1), original(*a))[1])
    monkeypatch.setattr(tiled, "MIN_KEYS", 1)  # (rows of 11 keys: tiled all the same)
    models = _models("llama", (NAMES["auto"],))
    eager, ours = models["eager"], models[NAMES["auto"]]
    ids = _batch("llama", "right")["input_ids"][:1]  # (1, L): the first row, all real
    with torch.no_grad():
        truth = eager(ids, output_attentions=True).attentions
        plain = ours(ids).logits
        with attnkit.record_stats(ours, topk=3) as rec:
            logits = ours(ids).logits
    assert len(used) == len(rec) == len(truth) > 0
    assert torch.equal(logits, plain)
    for name, t in zip(rec.keys(), truth, strict=True):
        want, got = attnkit.stats.from_weights(t.double(), 3), rec[name]
        for field in ("topk_values", "entropy", "distance", "sink_mass", "column_sum"):
            assert max_err(getattr(got, field), getattr(want, field)) <= 1e-4, (name, field)
        named = t.double().gather(-1, got.topk_indices.clamp_min(0))  # (1, H, L, 3)
        assert max_err(torch.where(got.topk_indices >= 0, named, 0.0), got.topk_values) <= 1e-5, name


def test_a_static_cache_step_measures_distance_from_the_querys_own_slot():
    """A static cache's decoding step: the query stands at the last slot it may see, not at the last slot of the
    cache; a static prefill's column sums run over every slot, as its weights do."""
    g = torch.Generator().manual_seed(6)
    q, k, v = torch.randn(2, 4, 1, 8, generator=g), torch.randn(2, 2, 9, 8, generator=g), torch.randn(2, 2, 9, 8)
    step = torch.tensor([5, 3])  # each row's position: its slots past it are empty
    mask = (torch.arange(9) <= step[:, None])[:, None, None, :]  # (B, 1, 1, 9)

    class Attention(torch.nn.Module):
        is_causal = True

    model = torch.nn.Sequential(Attention())
    with attnkit.record_stats(model, topk=2) as rec:
        attnkit_hf.attention_forward(model[0], q, k, v, mask)
        attnkit_hf.attention_forward(model[0], q.repeat(1, 1, 3, 1), k, v, None)  # a static prefill: 3 queries, 9 slots
    decode, prefill = rec.calls("0")
    w = attnkit.functional.attention_weights(q.double(), k.double(), attn_mask=mask)  # (B, H, 1, 9)
    gap = (step[:, None, None, None] - torch.arange(9)).abs()  # (B, 1, 1, 9)
    assert max_err(decode.distance, (w * gap).sum(-1)) <= 1e-5
    assert prefill.column_sum.shape == (2, 4, 9) and (prefill.column_sum[..., 3:] == 0).all()


def test_slots_through_a_cache_read_a_mask_wider_than_the_keys_and_only_for_causal_models():
    """Some models build the mask over the whole cache (wider than the keys passed): it is cut to the keys, as for
    the output. A model that is not causal (cross-attention) keeps the default positions."""
    g = torch.Generator().manual_seed(7)
    q, k, v = torch.randn(1, 2, 1, 8, generator=g), torch.randn(1, 2, 6, 8, generator=g), torch.randn(1, 2, 6, 8)
    mask = (torch.arange(10) <= 4)[None, None, None]  # (1, 1, 1, 10): the query at slot 4

    class Causal(torch.nn.Module):
        is_causal = True

    class Cross(torch.nn.Module):
        is_causal = False

    model = torch.nn.ModuleDict({"causal": Causal(), "cross": Cross()})
    with attnkit.record_stats(model, topk=2) as rec:
        attnkit_hf.attention_forward(model["causal"], q, k, v, mask)
        attnkit_hf.attention_forward(model["cross"], q, k, v, mask)
    w = attnkit.functional.attention_weights(q.double(), k.double(), attn_mask=mask[..., :6])  # (1, 2, 1, 6)
    for name, slot in (("causal", 4), ("cross", 5)):  # cross: the default, the last of the 6 keys
        gap = (slot - torch.arange(6)).abs()  # (6,)
        assert max_err(rec[name].distance, (w * gap).sum(-1)) <= 1e-5, name


def test_right_padded_generate_gives_eager_and_sdpas_tokens():
    """generate() on a right-padded batch: transformers gives the padding positions position_ids of 1, which do not
    follow the ones before, yet padding is never a document boundary (a row's padding queries see its tokens, as in
    eager and sdpa; read as documents they saw nothing, and the tokens after the padding differed)."""
    models = _models("llama", ("sdpa", NAMES["auto"]))
    batch = _batch("llama", "right")
    tokens = {
        name: m.generate(**batch, max_new_tokens=6, do_sample=False, pad_token_id=0) for name, m in models.items()
    }
    assert torch.equal(tokens["sdpa"], tokens["eager"])
    assert torch.equal(tokens[NAMES["auto"]], tokens["eager"])


def test_left_padded_training_with_padding_and_first_tokens_left_out_of_the_loss_equals_eager():
    """What docs/guide/transformers.md says to do with left padding in training: labels of -100 at the padding and
    at each row's first real token (which the last padding position predicts): the loss and every gradient are
    eager's."""
    models = _models("llama", (NAMES["auto"],))
    batch = _batch("llama", "left")
    labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    labels[torch.arange(B), batch["attention_mask"].argmax(dim=-1)] = -100
    losses, grads = {}, {}
    for name, model in models.items():
        model.zero_grad()
        loss = model(**batch, labels=labels).loss
        loss.backward()
        losses[name] = loss.detach()
        grads[name] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert torch.allclose(losses[NAMES["auto"]], losses["eager"], atol=LOGIT_TOL)
    for n, g in grads["eager"].items():
        assert torch.allclose(grads[NAMES["auto"]][n], g, atol=GRAD_TOL * max(1.0, g.abs().max().item())), n
