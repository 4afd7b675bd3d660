"""What each rank runs in tests/test_ulysses.py: DeepSpeed Ulysses (``UlyssesSPAttentionHF``, the sequence
parallelism the transformers Trainer and accelerate run) with attnkit as its core attention, on CPU and gloo.

Ulysses hands each rank its shard of the sequence, swaps it for a share of the heads over the whole sequence
(all-to-all), runs the core attention there, and swaps back. It drops every attention mask on the way and passes
the whole sequence's ``position_ids`` instead, which is where packed documents must be read from.
"""

from __future__ import annotations

import os

os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported: it picks its accelerator then
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn import functional as F  # noqa: E402

# B batch, L whole length, V vocabulary


def _model(heads: int, kv_heads: int, core: str) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=8 * heads,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        attn_implementation=core,
        use_cache=False,
    )
    return LlamaForCausalLM(config).double()


def ulysses(rank: int, world_size: int, core: str) -> dict[str, object]:
    """A Llama (4 heads, 2 key/value heads, float64) with ``core`` as Ulysses' core attention, rows of two packed
    documents (position_ids restarting at 0), each rank holding its contiguous shard: the loss and the parameter
    gradients summed over the ranks, against the same model run on each document alone. First, a Llama of 3 heads,
    which cannot be split over the ranks: the error it gives."""
    import deepspeed
    import deepspeed.runtime.sequence_parallel.parallel_state_sp as mpu
    from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

    from attnkit.integrations import transformers as attnkit_hf

    deepspeed.init_distributed(dist_backend="gloo")  # takes the process group already made
    if core == "attnkit":
        attnkit_hf.register()
    seen: dict[str, object] = {}
    try:
        UlyssesSPAttentionHF.register_with_transformers(
            _model(3, 1, core), core_attn_implementation=core, sequence_parallel_size=world_size, micro_batch_size=2
        )
    except ValueError as e:
        seen["heads error"] = str(e)
    mpu._release_sequence_parallel_groups()  # the registration above made its groups before it refused

    model = _model(4, 2, core)
    B, L = 2, 20
    tokens = torch.randint(0, 64, (B, L + 1), generator=torch.Generator().manual_seed(1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]  # (B, L)
    cut = 7  # two documents a row: 7 and 13 tokens
    positions = torch.cat([torch.arange(cut), torch.arange(L - cut)]).expand(B, L)  # (B, L)

    def loss_of(logits: torch.Tensor, wanted: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), wanted.flatten(), reduction="sum")

    alone = torch.cat([model(inputs[:, :cut]).logits, model(inputs[:, cut:]).logits], dim=1)  # (B, L, V)
    ref = loss_of(alone, targets)
    ref_grads = torch.autograd.grad(ref, list(model.parameters()))
    with torch.no_grad():  # one causal sequence a row: the documents see each other
        seen["across documents"] = float((model(inputs).logits - alone).abs().max())

    UlyssesSPAttentionHF.register_with_transformers(
        model, core_attn_implementation=core, sequence_parallel_size=world_size, micro_batch_size=B
    )
    n = L // world_size
    mine = slice(rank * n, (rank + 1) * n)  # Ulysses' shards are contiguous
    logits = model(inputs[:, mine], position_ids=positions[:, mine]).logits  # (B, n, V)
    seen["logits gap"] = float((logits - alone[:, mine]).detach().abs().max())
    loss = loss_of(logits, targets[:, mine])
    grads = [g.clone() for g in torch.autograd.grad(loss, list(model.parameters()))]
    whole = loss.detach().clone()
    dist.all_reduce(whole)
    for g in grads:
        dist.all_reduce(g)
    seen["loss"] = (float(whole), float(ref))
    seen["grad gap"] = max(
        float((a - b).abs().max()) / max(float(b.abs().max()), 1e-30) for a, b in zip(grads, ref_grads, strict=True)
    )
    return seen
