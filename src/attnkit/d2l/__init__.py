"""The attention code of *Dive into Deep Learning*, as a drop-in replacement.

Swap ``from d2l import torch as d2l`` for ``from attnkit import d2l`` in the attention chapters and the
notebooks keep working: same names, same signatures (the older explicit-size ones and the newer size-inferring
ones), same parameter names (``W_q``, ``W_k``, ``W_v``, ``W_o``, ``w_v``, so a book ``state_dict`` loads
unchanged), and ``.attention_weights`` set after every forward, as in the book. ``DotProductAttention`` also
keeps ``.scores``, the scaled scores before masking, to print beside the weights.

Where this differs from the book, on purpose:

* A row with nothing to attend to (``valid_lens`` of 0) gets all-zero weights and a zero output. The book
  fills masked scores with ``-1e6``, which gives such a row uniform weights over the padding.
* Nothing is written into the caller's tensors: the book's ``sequence_mask`` assigns into ``X`` (and so
  fails on a leaf tensor that requires grad); here it returns a new tensor.
* Padding never leaks: values past ``valid_lens`` holding NaN do not reach the output.
* Mistakes raise a ``ValueError`` that names the argument and shows the shapes, instead of a matmul error.

What the book does not have, as keywords after the book's arguments: ``MultiHeadAttention(..., cache=...)`` takes
an :class:`attnkit.KVCache` or :class:`attnkit.CrossKVCache`, so a book-style decoder projects each new token once
instead of re-projecting every input so far (``state[2]``) at every step; ``is_causal`` there and in
``DotProductAttention``, and ``attn_mask`` in ``DotProductAttention``, mean what they mean in attnkit's layers.
"""

from attnkit.d2l.functions import masked_softmax, sequence_mask, show_heatmaps, transpose_output, transpose_qkv
from attnkit.d2l.layers import AdditiveAttention, DotProductAttention, MultiHeadAttention

__all__ = [
    "AdditiveAttention",
    "DotProductAttention",
    "MultiHeadAttention",
    "masked_softmax",
    "sequence_mask",
    "show_heatmaps",
    "transpose_output",
    "transpose_qkv",
]
