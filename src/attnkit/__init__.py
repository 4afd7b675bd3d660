"""attnkit: attention mechanisms done right.

The book's layers (*Dive into Deep Learning*), one mask convention (``True`` = may attend; rows with nothing
to attend to give zeros, never NaN), fast backends, and pictures of what a model attends to.
"""

from attnkit import mods, packing
from attnkit.ablation import ablate_heads, head_sweep
from attnkit.cache import CrossKVCache, KVCache
from attnkit.dispatch import available_backends
from attnkit.functional import AttentionOutput, additive_attention, scaled_dot_product_attention
from attnkit.integrations.flex_patch import patch_flex_attention
from attnkit.integrations.torch_flex import flex_attention
from attnkit.integrations.torch_varlen import varlen_attn
from attnkit.layers import AdditiveAttention, DotProductAttention, MultiHeadAttention
from attnkit.masks import causal_mask, masked_softmax, sequence_mask
from attnkit.packing import pack, unpack
from attnkit.plan import Plan, make_plan
from attnkit.recording import record_stats, record_weights
from attnkit.relevance import rollout
from attnkit.stats import AttentionStats, attention_stats
from attnkit.trace import trace_shapes

__version__ = "0.1.0"

__all__ = [
    "AdditiveAttention",
    "AttentionOutput",
    "AttentionStats",
    "CrossKVCache",
    "DotProductAttention",
    "KVCache",
    "MultiHeadAttention",
    "Plan",
    "__version__",
    "ablate_heads",
    "additive_attention",
    "attention_stats",
    "available_backends",
    "causal_mask",
    "flex_attention",
    "head_sweep",
    "make_plan",
    "masked_softmax",
    "mods",
    "pack",
    "packing",
    "patch_flex_attention",
    "record_stats",
    "record_weights",
    "rollout",
    "scaled_dot_product_attention",
    "sequence_mask",
    "trace_shapes",
    "unpack",
    "varlen_attn",
]
