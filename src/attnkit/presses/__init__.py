"""Presses: a key/value cache compressed by what attention did, computed exactly.

A press scores each cached position of each layer and key/value head, and removes the ``compression_ratio``
share with the lowest scores when the layer's cache is first filled (the prefill); decoding then goes on over the
kept pairs, positions as they were (their RoPE already applied). kvpress's meaning and formulas (NVIDIA/kvpress),
with one difference that matters: the presses that read attention weights read attnkit's exact statistics
(:mod:`attnkit.stats`: column sums and chosen rows in linear memory), never eager's ``B*H*L*L`` weights::

    from attnkit import presses
    from attnkit.integrations import smollm2

    model, tokenizer = smollm2.load()                   # attention through attnkit
    press = presses.ObservedAttention(compression_ratio=0.5)
    with press(model):
        model.generate(input_ids, max_new_tokens=32)    # the prompt's cache halved in every layer
    press.kept[0]                                       # (B, Hkv, n): the positions layer 0 kept

=====================  =======================================================================  ===================
press                  score of key ``j`` (higher: kept)                                        reads attention
=====================  =======================================================================  ===================
``ObservedAttention``  weight received / queries that may see it, mean over the group (H2O)     column sums
``SnapKV``             mean weight from the last 64 queries, pooled over 5 keys                 64 rows
``QuestionAware``      mean weight from the question's queries (SnapKV's window = question)     the question's rows
``TOVA``               the last query's weight, mean over all heads                             1 row
``H2O``                ``ObservedAttention``, then running scores and evictions while decoding  every step's rows
``StreamingLLM``       the first 4 and the most recent positions                                no
``KNorm``              ``-||k||``                                                               no
``Random``             uniform                                                                  no
``AdaptiveBudget``     another press's scores, each head's share by its width ``exp(entropy)``  entropy
=====================  =======================================================================  ===================

The model: a transformers decoder whose attention is attnkit's (``attn_implementation="attnkit"``), its cache a
``DynamicCache`` (transformers' default), or a module holding :class:`~attnkit.MultiHeadAttention` layers called
with a growing or static :class:`~attnkit.KVCache` (rows of different lengths each keep their own share with
ObservedAttention, KNorm and Random; the others take rows of one length). A press never writes
into a tensor it was given: the cache's tensors are replaced. After the block the model is as it was (its hooks
removed, also after an exception).
"""

from attnkit.presses.base import Layer, Press
from attnkit.presses.scorers import (
    H2O,
    TOVA,
    AdaptiveBudget,
    KNorm,
    ObservedAttention,
    QuestionAware,
    Random,
    SnapKV,
    StreamingLLM,
)

__all__ = [
    "H2O",
    "AdaptiveBudget",
    "TOVA",
    "KNorm",
    "Layer",
    "ObservedAttention",
    "Press",
    "QuestionAware",
    "Random",
    "SnapKV",
    "StreamingLLM",
]
