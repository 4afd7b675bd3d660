"""attnkit.d2l with key/value caches: the book's Transformer decoder (Dive into Deep Learning, section 11.7), which
keeps every raw input so far in ``state[2][i]`` and re-projects it at each step, runs with an attnkit.KVCache per
block (and a CrossKVCache for the encoder's outputs) instead, and gives the same outputs at every greedy step as
the book's own code (``attnkit.tools.book``, the oracle), while projecting one position per step.

Also: ``d2l.MultiHeadAttention(..., cache=...)`` equals ``attnkit.MultiHeadAttention(..., cache=...)`` for every
kind of cache, ``is_causal`` is the book's training-mode ``dec_valid_lens``, and mistakes are errors naming values.
"""

from __future__ import annotations

import math

import pytest
import torch
from tests.mathref import max_err
from torch import nn

import attnkit
from attnkit import d2l
from attnkit.tools import book  # the book's own attention code, the oracle

# B batch, Ls source length, V vocabulary, T decoding steps, E hidden size, H heads

B, LS, V, T = 3, 7, 23, 10
E, H, FFN, BLKS = 32, 4, 48, 2
SRC_LENS = torch.tensor([7, 4, 2])  # ragged sources, right-padded to LS
BOS = 1
# float32: the suite's output tolerance (tests/test_cache.py); float64: the same sums in another order
TOL = {torch.float32: 2e-5, torch.float64: 1e-12}
CACHES = {"growing": {}, "static": {"max_len": T}, "sliding": {"window": T}}  # a window holding every step


# --- the book's code (d2l 1.0, sections 11.5-11.7), with the attention class and the block class as parameters -----
# ruff: noqa: SIM108  (the book's if/else, kept as the book writes it)


class PositionWiseFFN(nn.Module):
    def __init__(self, ffn_num_hiddens, ffn_num_outputs):
        super().__init__()
        self.dense1 = nn.LazyLinear(ffn_num_hiddens)
        self.relu = nn.ReLU()
        self.dense2 = nn.LazyLinear(ffn_num_outputs)

    def forward(self, X):
        return self.dense2(self.relu(self.dense1(X)))


class AddNorm(nn.Module):
    def __init__(self, norm_shape, dropout):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.ln = nn.LayerNorm(norm_shape)

    def forward(self, X, Y):
        return self.ln(self.dropout(Y) + X)


class PositionalEncoding(nn.Module):
    def __init__(self, num_hiddens, dropout, max_len=1000):
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.P = torch.zeros((1, max_len, num_hiddens))
        X = torch.arange(max_len, dtype=torch.float32).reshape(-1, 1) / torch.pow(
            10000, torch.arange(0, num_hiddens, 2, dtype=torch.float32) / num_hiddens
        )
        self.P[:, :, 0::2] = torch.sin(X)
        self.P[:, :, 1::2] = torch.cos(X)

    def forward(self, X):
        X = X + self.P[:, : X.shape[1], :].to(X.device)
        return self.dropout(X)


class TransformerEncoderBlock(nn.Module):
    def __init__(self, num_hiddens, ffn_num_hiddens, num_heads, dropout, use_bias=False, attention=None):
        super().__init__()
        self.attention = attention(num_hiddens, num_heads, dropout, use_bias)
        self.addnorm1 = AddNorm(num_hiddens, dropout)
        self.ffn = PositionWiseFFN(ffn_num_hiddens, num_hiddens)
        self.addnorm2 = AddNorm(num_hiddens, dropout)

    def forward(self, X, valid_lens):
        Y = self.addnorm1(X, self.attention(X, X, X, valid_lens))
        return self.addnorm2(Y, self.ffn(Y))


class TransformerEncoder(nn.Module):
    def __init__(self, vocab_size, num_hiddens, ffn_num_hiddens, num_heads, num_blks, dropout, attention=None):
        super().__init__()
        self.num_hiddens = num_hiddens
        self.embedding = nn.Embedding(vocab_size, num_hiddens)
        self.pos_encoding = PositionalEncoding(num_hiddens, dropout)
        self.blks = nn.Sequential()
        for i in range(num_blks):
            self.blks.add_module(
                "block" + str(i),
                TransformerEncoderBlock(num_hiddens, ffn_num_hiddens, num_heads, dropout, attention=attention),
            )

    def forward(self, X, valid_lens):
        X = self.pos_encoding(self.embedding(X) * math.sqrt(self.num_hiddens))
        for blk in self.blks:
            X = blk(X, valid_lens)
        return X


class TransformerDecoderBlock(nn.Module):
    def __init__(self, num_hiddens, ffn_num_hiddens, num_heads, dropout, i, attention=None):
        super().__init__()
        self.i = i
        self.attention1 = attention(num_hiddens, num_heads, dropout)
        self.addnorm1 = AddNorm(num_hiddens, dropout)
        self.attention2 = attention(num_hiddens, num_heads, dropout)
        self.addnorm2 = AddNorm(num_hiddens, dropout)
        self.ffn = PositionWiseFFN(ffn_num_hiddens, num_hiddens)
        self.addnorm3 = AddNorm(num_hiddens, dropout)

    def forward(self, X, state):
        enc_outputs, enc_valid_lens = state[0], state[1]
        if state[2][self.i] is None:
            key_values = X
        else:
            key_values = torch.cat((state[2][self.i], X), dim=1)
        state[2][self.i] = key_values
        if self.training:
            batch_size, num_steps, _ = X.shape
            dec_valid_lens = torch.arange(1, num_steps + 1, device=X.device).repeat(batch_size, 1)
        else:
            dec_valid_lens = None
        X2 = self.attention1(X, key_values, key_values, dec_valid_lens)
        Y = self.addnorm1(X, X2)
        Y2 = self.attention2(Y, enc_outputs, enc_outputs, enc_valid_lens)
        Z = self.addnorm2(Y, Y2)
        return self.addnorm3(Z, self.ffn(Z)), state


class TransformerDecoder(nn.Module):
    def __init__(
        self, vocab_size, num_hiddens, ffn_num_hiddens, num_heads, num_blks, dropout, attention=None, block=None
    ):
        super().__init__()
        block = block or TransformerDecoderBlock
        self.num_hiddens = num_hiddens
        self.num_blks = num_blks
        self.embedding = nn.Embedding(vocab_size, num_hiddens)
        self.pos_encoding = PositionalEncoding(num_hiddens, dropout)
        self.blks = nn.Sequential()
        for i in range(num_blks):
            self.blks.add_module(
                "block" + str(i), block(num_hiddens, ffn_num_hiddens, num_heads, dropout, i, attention=attention)
            )
        self.dense = nn.LazyLinear(vocab_size)

    def init_state(self, enc_outputs, enc_valid_lens):
        return [enc_outputs, enc_valid_lens, [None] * self.num_blks]

    def forward(self, X, state):
        X = self.pos_encoding(self.embedding(X) * math.sqrt(self.num_hiddens))
        for blk in self.blks:
            X, state = blk(X, state)
        return self.dense(X), state


# --- the cached variant: the block's first lines replaced by a cache per block ---------------------------------------


class CachedTransformerDecoderBlock(TransformerDecoderBlock):
    """The book's block with ``state[2][i]`` an attnkit.KVCache and ``state[3][i]`` an attnkit.CrossKVCache."""

    def forward(self, X, state):
        enc_outputs, enc_valid_lens = state[0], state[1]
        # X alone is projected and appended; causal by each row's own position (one token a step sees every key)
        X2 = self.attention1(X, X, X, None, is_causal=True, cache=state[2][self.i])
        Y = self.addnorm1(X, X2)
        # enc_outputs are projected at the first step only
        Y2 = self.attention2(Y, enc_outputs, enc_outputs, enc_valid_lens, cache=state[3][self.i])
        Z = self.addnorm2(Y, Y2)
        return self.addnorm3(Z, self.ffn(Z)), state


def cached_state(enc_outputs, enc_valid_lens, num_blks, **cache_kwargs):
    """The book's ``init_state``, with caches in place of ``[None] * num_blks``."""
    self_caches = [attnkit.KVCache(**cache_kwargs) for _ in range(num_blks)]
    cross_caches = [attnkit.CrossKVCache() for _ in range(num_blks)]
    return [enc_outputs, enc_valid_lens, self_caches, cross_caches]


# --- the tests -------------------------------------------------------------------------------------------------------


def _models(dtype):
    """An encoder and three decoders sharing one set of weights: the book's code on the book's attention (the
    oracle), the book's code on attnkit.d2l, and the cached block on attnkit.d2l."""
    torch.manual_seed(0)
    sizes = (V, E, FFN, H, BLKS, 0.0)
    encoder = TransformerEncoder(*sizes, attention=d2l.MultiHeadAttention)
    oracle = TransformerDecoder(*sizes, attention=book.LazyMultiHeadAttention)
    ours = TransformerDecoder(*sizes, attention=d2l.MultiHeadAttention)
    cached = TransformerDecoder(*sizes, attention=d2l.MultiHeadAttention, block=CachedTransformerDecoderBlock)
    src = torch.randint(2, V, (B, LS), generator=torch.Generator().manual_seed(1))  # (B, Ls)
    with torch.no_grad():  # the lazy layers draw their weights at a first call
        enc_outputs = encoder(src, SRC_LENS)  # (B, Ls, E)
        bos = torch.full((B, 1), BOS)
        for decoder in (oracle, ours):
            decoder(bos, decoder.init_state(enc_outputs, SRC_LENS))
        cached(bos, cached_state(enc_outputs, SRC_LENS, BLKS))
    for decoder in (ours, cached):
        decoder.load_state_dict(oracle.state_dict())
    return src, *(m.to(dtype).eval() for m in (encoder, oracle, ours, cached))


def _projected_lengths(decoder):
    """``{"block.attention.W_k": [positions projected at each call]}``, filled by forward hooks."""
    seen: dict[str, list[int]] = {}
    for i, blk in enumerate(decoder.blks):
        for name in ("attention1.W_k", "attention1.W_v", "attention2.W_k", "attention2.W_v"):
            lengths = seen.setdefault(f"{i}.{name}", [])
            blk.get_submodule(name).register_forward_hook(
                lambda module, inputs, output, lengths=lengths: lengths.append(inputs[0].shape[1])
            )
    return seen


@pytest.mark.parametrize("kind", list(CACHES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_greedy_decoding_with_caches_equals_the_books_decoder_at_every_step(dtype, kind):
    src, encoder, oracle, ours, cached = _models(dtype)
    tol = TOL[dtype]
    with torch.no_grad():
        enc_outputs = encoder(src, SRC_LENS)  # (B, Ls, E)
        states = {
            oracle: oracle.init_state(enc_outputs, SRC_LENS),
            ours: ours.init_state(enc_outputs, SRC_LENS),
            cached: cached_state(enc_outputs, SRC_LENS, BLKS, **CACHES[kind]),
        }
        book_calls, cached_calls = _projected_lengths(ours), _projected_lengths(cached)
        token = torch.full((B, 1), BOS)  # (B, 1)
        for step in range(T):  # the book's predict_step, all three fed the oracle's greedy choice
            logits = {}
            for decoder in (oracle, ours, cached):
                logits[decoder], states[decoder] = decoder(token, states[decoder])  # (B, 1, V)
            assert max_err(logits[ours], logits[oracle]) <= tol, step
            assert max_err(logits[cached], logits[oracle]) <= tol, step
            assert max_err(logits[cached], logits[ours]) <= tol, step
            token = logits[oracle].argmax(2)  # (B, 1)
            assert torch.equal(logits[cached].argmax(2), token), step
    for i in range(BLKS):
        # the book re-projects every input so far (1, 2, ..., T) and the encoder's outputs at every step
        assert book_calls[f"{i}.attention1.W_k"] == book_calls[f"{i}.attention1.W_v"] == list(range(1, T + 1))
        assert book_calls[f"{i}.attention2.W_k"] == book_calls[f"{i}.attention2.W_v"] == [LS] * T
        # the cached block projects the one new position, and the encoder's outputs once
        assert cached_calls[f"{i}.attention1.W_k"] == cached_calls[f"{i}.attention1.W_v"] == [1] * T
        assert cached_calls[f"{i}.attention2.W_k"] == cached_calls[f"{i}.attention2.W_v"] == [LS]
        cache = states[cached][2][i]
        assert cache.lengths.tolist() == [T] * B
        assert cache.nbytes == 2 * B * H * cache.capacity * (E // H) * (4 if dtype == torch.float32 else 8)
        assert states[cached][3][i].keys.shape == (B, H, LS, E // H)
    # the book's layout of the weights, as the book's decoder keeps them: (B*H, Lq, Lk)
    last = cached.blks[BLKS - 1]
    assert last.attention1.attention.attention_weights.shape[:2] == (B * H, 1)
    assert last.attention2.attention.attention_weights.shape == (B * H, 1, LS)
    torch.testing.assert_close(
        last.attention2.attention.attention_weights, oracle.blks[BLKS - 1].attention2.attention.attention_weights
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_causal_prefill_into_the_caches_equals_the_books_training_forward(dtype):
    src, encoder, oracle, ours, cached = _models(dtype)
    tgt = torch.randint(2, V, (B, 6), generator=torch.Generator().manual_seed(2))  # (B, 6)
    with torch.no_grad():
        enc_outputs = encoder(src, SRC_LENS)
        # training mode (dropout 0): the book masks with dec_valid_lens = arange(1, 7), the cached block with is_causal
        want, _ = oracle.train()(tgt, oracle.init_state(enc_outputs, SRC_LENS))  # (B, 6, V)
        state = cached_state(enc_outputs, SRC_LENS, BLKS)
        got, state = cached.train()(tgt, state)  # (B, 6, V)
    assert max_err(got, want) <= TOL[dtype]
    assert [c.lengths.tolist() for c in state[2]] == [[6] * B] * BLKS


def _pair(num_hiddens=E, num_heads=H):
    """attnkit.MultiHeadAttention and the book's explicit-size d2l.MultiHeadAttention with the same weights."""
    torch.manual_seed(0)
    ref = attnkit.MultiHeadAttention(num_hiddens, num_heads, query_size=E, key_size=E, value_size=E)
    ours = d2l.MultiHeadAttention(E, E, E, num_hiddens, num_heads, 0.0)
    ours.load_state_dict(ref.state_dict())
    return ref.double().eval(), ours.double().eval()


@pytest.mark.parametrize("lens", [torch.tensor([5, 2, 3]), None], ids=["ragged", "aligned"])
@pytest.mark.parametrize("kind", ["growing", "static", "sliding"])
def test_the_books_multihead_with_a_cache_equals_attnkits_with_one(kind, lens):
    ref, ours = _pair()
    kwargs = {"growing": {}, "static": {"max_len": 12}, "sliding": {"window": 3}}[kind]
    ref_cache, our_cache = attnkit.KVCache(**kwargs), attnkit.KVCache(**kwargs)
    g = torch.Generator().manual_seed(3)
    prompt = torch.randn(B, 5, E, generator=g, dtype=torch.float64)  # (B, 5, E): right-padded past lens
    steps = [torch.randn(B, n, E, generator=g, dtype=torch.float64) for n in (1, 1, 3, 1)]  # (B, n, E) each
    with attnkit.record_weights(ref) as ref_rec, attnkit.record_weights(ours) as our_rec, torch.no_grad():
        calls = [(prompt, lens)] + [(x, None) for x in steps]
        for x, valid_lens in calls:
            want = ref(x, x, x, valid_lens, is_causal=True, cache=ref_cache)  # (B, n, E)
            got = ours(x, x, x, valid_lens, is_causal=True, cache=our_cache)  # (B, n, E)
            n = x.shape[1]
            real = torch.arange(n) < (valid_lens if valid_lens is not None else torch.full((B,), n))[:, None]
            assert max_err(got[real], want[real]) <= 1e-12
            folded = ours.attention.attention_weights  # the book's layout: (B*H, n, Lk)
            assert folded.shape[:2] == (B * H, n)
            assert max_err(folded.reshape(B, H, *folded.shape[1:]), ref_rec[""]) <= 1e-12
    assert max_err(our_rec[""], ref_rec[""]) <= 1e-12  # record_weights: attnkit's layout (B, H, Lq, Lk)
    assert torch.equal(our_cache.lengths, ref_cache.lengths)
    assert max_err(our_cache.keys, ref_cache.keys) <= 1e-12


@pytest.mark.parametrize("kind", ["growing", "static", "sliding"])
def test_padding_holding_nan_never_reaches_a_cached_output(kind):
    _, ours = _pair()
    kwargs = {"growing": {}, "static": {"max_len": 8}, "sliding": {"window": 3}}[kind]
    clean_cache, nan_cache = attnkit.KVCache(**kwargs), attnkit.KVCache(**kwargs)
    prompt = torch.randn(B, 5, E, dtype=torch.float64)  # (B, 5, E)
    lens = torch.tensor([5, 2, 3])
    padded = prompt.clone()
    for b, n in enumerate(lens.tolist()):
        padded[b, n:] = float("nan")  # the padding: never read
    step = torch.randn(B, 1, E, dtype=torch.float64)  # (B, 1, E)
    with torch.no_grad():
        want = ours(prompt, prompt, prompt, lens, is_causal=True, cache=clean_cache)
        got = ours(padded, padded, padded, lens, is_causal=True, cache=nan_cache)
        assert torch.isfinite(got).all()  # padded queries see no key: zero attention, finite output
        real = torch.arange(5) < lens[:, None]  # (B, 5)
        assert torch.equal(got[real], want[real])
        assert torch.equal(
            ours(step, step, step, None, is_causal=True, cache=nan_cache),
            ours(step, step, step, None, is_causal=True, cache=clean_cache),
        )


def test_is_causal_is_the_books_training_mode_dec_valid_lens():
    torch.manual_seed(0)
    theirs = book.MultiHeadAttention(E, E, E, E, H, 0.0).double()
    ours = d2l.MultiHeadAttention(E, E, E, E, H, 0.0).double()
    ours.load_state_dict(theirs.state_dict())
    X = torch.randn(B, 6, E, dtype=torch.float64)  # (B, 6, E)
    dec_valid_lens = torch.arange(1, 7).repeat(B, 1)  # (B, 6): the book's causal mask
    want = theirs(X, X, X, dec_valid_lens)
    assert max_err(ours(X, X, X, None, is_causal=True), want) <= 1e-12
    assert max_err(ours(X, X, X, None, is_causal=True, cache=attnkit.KVCache()), want) <= 1e-12
    # the default with a cache is the book's eval-mode call: every query sees every key of its row
    assert max_err(ours(X, X, X, None, cache=attnkit.KVCache()), theirs(X, X, X, None)) <= 1e-12


def test_a_cross_cache_projects_the_encoders_outputs_once_and_keeps_their_valid_lens():
    ref, ours = _pair()
    memory = torch.randn(B, LS, E, dtype=torch.float64)  # (B, Ls, E)
    cache = attnkit.CrossKVCache()
    seen = []
    ours.W_k.register_forward_hook(lambda module, inputs, output: seen.append(inputs[0].shape[1]))
    for _ in range(3):
        y = torch.randn(B, 1, E, dtype=torch.float64)  # (B, 1, E)
        got = ours(y, memory, memory, SRC_LENS, cache=cache)
        assert max_err(got, ref(y, memory, memory, SRC_LENS)) <= 1e-12
    assert seen == [LS]
    assert cache.keys.shape == (B, H, LS, E // H) and torch.equal(cache.valid_lens, SRC_LENS)


def _lazy():
    return d2l.MultiHeadAttention(E, H, 0.0)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (
            lambda m, x: m(x, x, x, torch.arange(1, 5).repeat(B, 1), cache=attnkit.KVCache()),
            ValueError,
            r"with a KVCache, valid_lens must have shape \(B,\) = \(3,\).*got tensor of dtype torch.int64 and shape "
            r"\(3, 4\)",
        ),
        (
            lambda m, x: m(x, x, x, torch.tensor([4, 5, 1]), cache=attnkit.KVCache()),
            ValueError,
            r"valid_lens may be at most the number of keys \(4\), got 5",
        ),
        (
            lambda m, x: m(x, x[:, :2], x[:, :2], None, cache=attnkit.KVCache()),
            ValueError,
            r"queries has 4 positions but keys 2: queries \(3, 4, 32\), keys \(3, 2, 32\)",
        ),
        (lambda m, x: m(x, x, x, None, cache={}), TypeError, r"cache must be an attnkit.KVCache .* got dict"),
        (lambda m, x: m(x, x, x, None, is_causal=1), TypeError, r"is_causal must be True or False, got 1"),
    ],
)
def test_cache_mistakes_name_the_values_before_drawing_any_weight(call, error, match):
    mha = _lazy()
    with pytest.raises(error, match=match):
        call(mha, torch.randn(B, 4, E))
    assert mha.W_q.has_uninitialized_params()  # a lazy layer drew nothing


def test_a_cache_of_another_batch_or_layer_is_a_value_error_showing_its_shape():
    mha = _lazy().eval()
    cache = attnkit.KVCache()
    mha(torch.randn(B, 2, E), torch.randn(B, 2, E), torch.randn(B, 2, E), None, cache=cache)
    x = torch.randn(2, 1, E)
    with pytest.raises(
        ValueError, match=r"this cache holds keys \(B, H, L, d\) = \(3, 4, 16, 8\), but this call has B=2"
    ):
        mha(x, x, x, None, cache=cache)
    other = d2l.MultiHeadAttention(E, 2, 0.0).eval()
    y = torch.randn(B, 1, E)
    with pytest.raises(ValueError, match=r"num_heads=2, d=16"):
        other(y, y, y, None, cache=cache)
    cross = attnkit.CrossKVCache()
    memory = torch.randn(B, LS, E)
    mha(y, memory, memory, torch.arange(1, 2).repeat(B, 1), cache=cross)  # (B, Lq) lengths for Lq = 1
    with pytest.raises(ValueError, match=r"the CrossKVCache's valid_lens must have shape .* = \(3, 2\), got \(3, 1\)"):
        mha(torch.randn(B, 2, E), memory, memory, None, cache=cross)
