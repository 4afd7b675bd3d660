"""The attention code of *Dive into Deep Learning* (PyTorch edition), as the book writes it, to compare with.

Not attnkit's API (that is :mod:`attnkit.d2l`, the drop-in built on attnkit): the one copy of the book's own code,
which ``attnkit bench`` times as its ``book`` contender and the tests use as the independent oracle for
:mod:`attnkit.d2l`. It uses torch alone, nothing of attnkit.

Kept as close to the book as possible, including what attnkit does differently on purpose: ``sequence_mask``
writes into ``X``, masked scores are filled with ``-1e6``.

Both of the book's forms: the older one with explicit input sizes (``nn.Linear``, parameters drawn from the
random generator when the module is built) and the newer one (the book's 1.0 edition) that infers them
(``nn.LazyLinear``, parameters drawn at the first call, in the order the layers are called). The book gives the
newer classes the same names as the older ones; here they are ``LazyAdditiveAttention`` and
``LazyMultiHeadAttention``, to sit beside them. The two forms differ only in how they make their layers: the
newer forward is the older one's lines (its ``transpose_qkv`` and ``transpose_output`` methods are the functions
below with ``self.num_heads``), so the newer classes inherit it and have only their own ``__init__``.
"""

# ruff: noqa: SIM108  (kept as the book writes it)
import math

import torch
from torch import nn


def sequence_mask(X, valid_len, value=0):
    maxlen = X.size(1)
    mask = torch.arange((maxlen), dtype=torch.float32, device=X.device)[None, :] < valid_len[:, None]
    X[~mask] = value
    return X


def masked_softmax(X, valid_lens):
    if valid_lens is None:
        return nn.functional.softmax(X, dim=-1)
    shape = X.shape
    if valid_lens.dim() == 1:
        valid_lens = torch.repeat_interleave(valid_lens, shape[1])
    else:
        valid_lens = valid_lens.reshape(-1)
    X = sequence_mask(X.reshape(-1, shape[-1]), valid_lens, value=-1e6)
    return nn.functional.softmax(X.reshape(shape), dim=-1)


class AdditiveAttention(nn.Module):
    def __init__(self, key_size, query_size, num_hiddens, dropout, **kwargs):
        super().__init__(**kwargs)
        self.W_k = nn.Linear(key_size, num_hiddens, bias=False)
        self.W_q = nn.Linear(query_size, num_hiddens, bias=False)
        self.w_v = nn.Linear(num_hiddens, 1, bias=False)
        self.dropout = nn.Dropout(dropout)

    def forward(self, queries, keys, values, valid_lens):
        queries, keys = self.W_q(queries), self.W_k(keys)
        features = queries.unsqueeze(2) + keys.unsqueeze(1)
        features = torch.tanh(features)
        scores = self.w_v(features).squeeze(-1)
        self.attention_weights = masked_softmax(scores, valid_lens)
        return torch.bmm(self.dropout(self.attention_weights), values)


class DotProductAttention(nn.Module):
    def __init__(self, dropout, **kwargs):
        super().__init__(**kwargs)
        self.dropout = nn.Dropout(dropout)

    def forward(self, queries, keys, values, valid_lens=None):
        d = queries.shape[-1]
        scores = torch.bmm(queries, keys.transpose(1, 2)) / math.sqrt(d)
        self.attention_weights = masked_softmax(scores, valid_lens)
        return torch.bmm(self.dropout(self.attention_weights), values)


def transpose_qkv(X, num_heads):
    X = X.reshape(X.shape[0], X.shape[1], num_heads, -1)
    X = X.permute(0, 2, 1, 3)
    return X.reshape(-1, X.shape[2], X.shape[3])


def transpose_output(X, num_heads):
    X = X.reshape(-1, num_heads, X.shape[1], X.shape[2])
    X = X.permute(0, 2, 1, 3)
    return X.reshape(X.shape[0], X.shape[1], -1)


class MultiHeadAttention(nn.Module):
    def __init__(self, key_size, query_size, value_size, num_hiddens, num_heads, dropout, bias=False, **kwargs):
        super().__init__(**kwargs)
        self.num_heads = num_heads
        self.attention = DotProductAttention(dropout)
        self.W_q = nn.Linear(query_size, num_hiddens, bias=bias)
        self.W_k = nn.Linear(key_size, num_hiddens, bias=bias)
        self.W_v = nn.Linear(value_size, num_hiddens, bias=bias)
        self.W_o = nn.Linear(num_hiddens, num_hiddens, bias=bias)

    def forward(self, queries, keys, values, valid_lens):
        queries = transpose_qkv(self.W_q(queries), self.num_heads)
        keys = transpose_qkv(self.W_k(keys), self.num_heads)
        values = transpose_qkv(self.W_v(values), self.num_heads)
        if valid_lens is not None:
            valid_lens = torch.repeat_interleave(valid_lens, repeats=self.num_heads, dim=0)
        output = self.attention(queries, keys, values, valid_lens)
        output_concat = transpose_output(output, self.num_heads)
        return self.W_o(output_concat)


# --- the newer, size-inferring forms (the book's 1.0 edition) ------------------------------------------


class LazyAdditiveAttention(AdditiveAttention):  # the book's forward, inherited
    def __init__(self, num_hiddens, dropout, **kwargs):
        nn.Module.__init__(self, **kwargs)  # not AdditiveAttention's, which would build sized layers
        self.W_k = nn.LazyLinear(num_hiddens, bias=False)
        self.W_q = nn.LazyLinear(num_hiddens, bias=False)
        self.w_v = nn.LazyLinear(1, bias=False)
        self.dropout = nn.Dropout(dropout)


class LazyMultiHeadAttention(MultiHeadAttention):  # the book's forward, inherited
    def __init__(self, num_hiddens, num_heads, dropout, bias=False, **kwargs):
        nn.Module.__init__(self)  # the book derives it from d2l.Module, which adds no parameters
        self.num_heads = num_heads
        self.attention = DotProductAttention(dropout)
        self.W_q = nn.LazyLinear(num_hiddens, bias=bias)
        self.W_k = nn.LazyLinear(num_hiddens, bias=bias)
        self.W_v = nn.LazyLinear(num_hiddens, bias=bias)
        self.W_o = nn.LazyLinear(num_hiddens, bias=bias)


def init_seq2seq(module):
    """Initialize weights for sequence-to-sequence learning."""
    if type(module) == nn.Linear:  # noqa: E721  (the book's test: a LazyLinear not yet called is left alone)
        nn.init.xavier_uniform_(module.weight)
    if type(module) == nn.GRU:  # noqa: E721
        for param in module._flat_weights_names:
            if "weight" in param:
                nn.init.xavier_uniform_(module._parameters[param])
