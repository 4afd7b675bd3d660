"""Tiny transformers models built from configs (random weights, no downloads) for the tests of what runs on a
model: a Llama with grouped-query heads."""

from __future__ import annotations

import torch


def llama(
    attn_implementation: str, *, vocab: int = 96, hidden: int = 64, layers: int = 2, heads: int = 4, seed: int = 0
):  # noqa: ANN201
    """A ``LlamaForCausalLM`` in eval mode, ``heads`` query heads sharing 2 key/value heads, seeded."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    return transformers.LlamaForCausalLM._from_config(config, attn_implementation=attn_implementation).eval()
