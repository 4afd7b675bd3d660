"""Mask and score modifiers, with FlexAttention's signatures, and the built-ins modern models use.

A **mask_mod** says who may attend to whom, a **score_mod** changes a score::

    mask_mod(b, h, q_idx, kv_idx) -> bool         True = may attend
    score_mod(score, b, h, q_idx, kv_idx) -> score  on the scaled score, before the softmax

Both are PyTorch's ``torch.nn.attention.flex_attention`` signatures, so a Flex function runs unchanged:
``b`` is the batch index, ``h`` the *query* head, ``q_idx`` in ``[0, Lq)`` and ``kv_idx`` in ``[0, Lk)`` the raw
positions. attnkit calls a function on whole blocks at once, with index tensors that broadcast against each other
(``b (B, 1, 1, 1)``, ``h (1, H, 1, 1)``, ``q_idx (1, 1, Lq', 1)``, ``kv_idx (1, 1, 1, Lk')``, ``score`` the
``(B, H, Lq', Lk')`` block): the element-wise code Flex asks for (no Python ``if`` on a value) works as is; a
function that fails on blocks is run element by element through ``torch.vmap``, as Flex does.

A mask_mod combines with ``valid_lens``, ``attn_mask`` and ``is_causal`` (all must allow a pair); a score_mod is
applied to ``scale * q . k`` (or the additive score), then the float ``attn_mask`` is added. A score_mod may close
over tensors that require grad (ALiBi slopes, a table of relative-position biases): they get their gradients.

The built-ins below are aligned to the bottom right, like ``is_causal``: with ``Lq`` queries and ``Lk`` keys,
query ``i`` stands at key position ``p = i + Lk - Lq`` (with ``Lq == Lk``, ``p = i``; one query decoded against a
cache stands at the last key). attnkit binds them to each call's lengths; called directly (say, handed to
``flex_attention``), they take ``p = q_idx``. Each knows, from a block's index ranges alone, whether the block
is hidden entirely or visible entirely (:meth:`MaskMod.tiles`): the tile engine skips hidden blocks without
evaluating anything, and skips the mask of visible ones.

Example:
    >>> import torch, attnkit
    >>> from attnkit import mods
    >>> q = k = v = torch.randn(1, 4, 16, 8)
    >>> out = attnkit.scaled_dot_product_attention(
    ...     q, k, v, mask_mod=mods.sliding_window(4), score_mod=mods.alibi(mods.alibi_slopes(4)))
    >>> out.output.shape
    torch.Size([1, 4, 16, 8])
"""

from __future__ import annotations

# The public names are in __all__; the others (types, evaluation, what a function reads) serve attnkit's own modules.
from attnkit.mods.base import MaskFn as MaskFn
from attnkit.mods.base import MaskMod, ScoreMod
from attnkit.mods.base import ScoreFn as ScoreFn
from attnkit.mods.base import Tiles as Tiles
from attnkit.mods.base import bind as bind
from attnkit.mods.base import check_callable as check_callable
from attnkit.mods.base import reads_positions as reads_positions
from attnkit.mods.builtins import alibi, alibi_slopes, and_masks, document, or_masks, prefix_lm, sliding_window, softcap
from attnkit.mods.builtins import conjuncts as conjuncts
from attnkit.mods.closure import Uninspectable as Uninspectable
from attnkit.mods.closure import grad_inputs as grad_inputs
from attnkit.mods.closure import read_tensors as read_tensors
from attnkit.mods.evaluate import apply_score as apply_score
from attnkit.mods.evaluate import evaluate_mask as evaluate_mask
from attnkit.mods.evaluate import evaluate_score as evaluate_score
from attnkit.mods.evaluate import indices as indices
from attnkit.mods.evaluate import protected_storages as protected_storages
from attnkit.mods.relative import declares_distance_bias as declares_distance_bias
from attnkit.mods.relative import distance_bias as distance_bias
from attnkit.mods.relative import is_distance_bias as is_distance_bias

__all__ = [
    "MaskMod",
    "ScoreMod",
    "alibi",
    "alibi_slopes",
    "and_masks",
    "document",
    "or_masks",
    "prefix_lm",
    "sliding_window",
    "softcap",
]
