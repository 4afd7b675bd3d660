"""What each rank runs in tests/test_context_parallel.py (imported by the spawned processes).

Every rank builds the same whole-sequence inputs and parameters from a seed, computes the single-process result,
then the same inside ``context_parallel`` on its shard, and reports how far apart they are.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn import functional as F

import attnkit
from attnkit import d2l, mods
from attnkit.distributed import context_parallel, gather_sequence

# B batch, L whole length, E features, V vocabulary

LAYOUT = "zigzag"


def _gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().abs().max()) if a.numel() else 0.0


def _summed(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each rank's parameter gradients (of its own positions' share of the loss) summed over the ranks."""
    for g in grads:
        dist.all_reduce(g)
    return grads


def layers(rank: int, world_size: int) -> dict[str, float]:
    """attnkit's MHA (GQA), attnkit.d2l's and the functional call, under each mask, inside context_parallel against
    one process: the largest gap of the outputs, the input gradients and the summed parameter gradients."""
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    torch.manual_seed(0)
    B, L, E = 2, 13, 16
    mha = attnkit.MultiHeadAttention(E, 4, num_kv_heads=2).double()
    book = d2l.MultiHeadAttention(E, 2, 0.0).double().eval()
    x = torch.randn(B, L, E, dtype=torch.double)
    ids = torch.tensor([[0] * 5 + [1] * 8, [0] * 9 + [1] * 4])  # (B, L): two documents a row
    cases = {
        "causal": {"is_causal": True},
        "valid_lens": {"valid_lens": torch.tensor([13, 6])},
        "causal + valid_lens": {"is_causal": True, "valid_lens": torch.tensor([4, 11])},
        "window": {"is_causal": True, "mask_mod": mods.sliding_window(3)},
        "documents": {"is_causal": True, "mask_mod": mods.document(ids)},
        "softcap": {"is_causal": True, "score_mod": mods.softcap(2.0)},
        "alibi + valid_lens": {"valid_lens": torch.tensor([13, 6]), "score_mod": mods.alibi(mods.alibi_slopes(4))},
        "a score function": {"is_causal": True, "score_mod": _distance_bonus},
    }

    def run_mha(x: torch.Tensor, masks: dict) -> torch.Tensor:
        return mha(x, x, x, **masks)

    def run_book(x: torch.Tensor, masks: dict) -> torch.Tensor:
        return book(x, x, x, masks.get("valid_lens"))

    def run_functional(x: torch.Tensor, masks: dict) -> torch.Tensor:
        q = x.unflatten(-1, (4, 4)).transpose(1, 2)  # (B, 4, L, 4)
        return attnkit.scaled_dot_product_attention(q, q, q, **masks).output.transpose(1, 2).flatten(2)  # (B, L, E)

    gaps = {}
    for layer, run, params in (
        ("mha", run_mha, list(mha.parameters())),
        ("d2l", run_book, list(book.parameters())),
        ("functional", run_functional, []),
    ):
        for name, masks in cases.items():
            if layer == "d2l" and name != "valid_lens":
                continue
            xw = x.clone().requires_grad_()
            ref = run(xw, masks)
            weights = torch.randn_like(ref)
            grads = torch.autograd.grad((ref * weights).sum(), [xw, *params])
            xs, ws = x.clone(), weights.clone()
            with context_parallel(mesh, buffers=[xs, ws], buffer_seq_dims=[1, 1]):
                xr = xs.clone().requires_grad_()
                with attnkit.dispatch.watch(implementations=True) as ran:
                    out = run(xr, masks)  # (B, L_r, E)
                if not ran or set(ran) != {"ring"}:  # every call inside the block runs as the ring, and says so
                    raise AssertionError(
                        f"{layer} {name}: dispatch.watch(implementations=True) saw {ran}, not only 'ring'"
                    )
                if layer == "d2l" and (book.attention.attention_weights, book.attention.scores) != (None, None):
                    raise AssertionError("d2l inside context_parallel: a shard's weights or scores were kept")
                mine = torch.autograd.grad((out * ws).sum(), [xr, *params])
                whole = gather_sequence(out.detach(), layout=LAYOUT, dim=1)  # (B, L, E)
                dx = gather_sequence(mine[0], layout=LAYOUT, dim=1)  # (B, L, E)
            summed = _summed([g.clone() for g in mine[1:]])
            gaps[f"{layer} {name}"] = max(
                _gap(whole, ref), _gap(dx, grads[0]), *(_gap(a, b) for a, b in zip(summed, grads[1:], strict=True))
            )
    return gaps


def _distance_bonus(score: torch.Tensor, b, h, q_idx, kv_idx) -> torch.Tensor:  # noqa: ANN001
    """A caller's score_mod in whole-sequence positions: nearer keys a little more, per head."""
    return score + 0.1 * (h + 1) / (1 + (q_idx - kv_idx).abs())


def buffers(rank: int, world_size: int) -> dict[str, object]:
    """What the buffers hold inside the block and after it, also when the block raises."""
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    tokens = torch.arange(16).view(2, 8)  # (B, L)
    labels = torch.arange(16).view(2, 8) + 100  # (B, L)
    seen: dict[str, object] = {}
    with context_parallel(mesh, buffers=[tokens, labels], buffer_seq_dims=[1, -1], no_restore_buffers={labels}):
        seen["inside"] = tokens.tolist()
    seen["tokens after"] = tokens.tolist()
    seen["labels after"] = labels.tolist()
    try:
        with context_parallel(mesh, buffers=[tokens], buffer_seq_dims=[1]):
            raise KeyError("inside")
    except KeyError:
        seen["after an error"] = tokens.tolist()
    rows = torch.arange(18).view(2, 9)  # (B, L + 1)
    inputs, shifted = rows[:, :-1], rows[:, 1:]  # views of one tensor, overlapping
    with context_parallel(mesh, buffers=[inputs, shifted], buffer_seq_dims=[1, 1], no_restore_buffers={shifted}):
        seen["views inside"] = inputs.tolist()
    seen["views after"] = (rows.tolist(), inputs.tolist(), inputs.stride())
    return seen


def mistakes(rank: int, world_size: int) -> dict[str, tuple[str, str]]:
    """Each mistake's error type and message, on this rank."""
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    t = torch.zeros(2, 8)
    two_d = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("dp", "cp"))
    tries = {
        "dims": lambda: context_parallel(mesh, buffers=[t], buffer_seq_dims=[1, 0]),
        "dim out of range": lambda: context_parallel(mesh, buffers=[t], buffer_seq_dims=[2]),
        "lengths": lambda: context_parallel(mesh, buffers=[t, torch.zeros(8, 3)], buffer_seq_dims=[1, 1]),
        "parameter": lambda: context_parallel(mesh, buffers=[nn.Parameter(t)], buffer_seq_dims=[1]),
        "twice": lambda: context_parallel(mesh, buffers=[t, t], buffer_seq_dims=[1, 1]),
        "no_restore": lambda: context_parallel(mesh, buffers=[t], buffer_seq_dims=[1], no_restore_buffers={t + 1}),
        "2-d mesh": lambda: context_parallel(two_d),
        "not a mesh": lambda: context_parallel("cp"),
        "too short": lambda: context_parallel(mesh, buffers=[torch.zeros(2, 1)], buffer_seq_dims=[1]),
        "a bad timeout": lambda: context_parallel(mesh, timeout=-1),
        "an infinite timeout": lambda: context_parallel(mesh, timeout=float("inf")),
        # one rank's mistake alone: the others must hear of it, not wait for its ring
        "dims on rank 1": lambda: context_parallel(mesh, buffers=[t], buffer_seq_dims=[5 if rank == 1 else 1]),
        "dims not a list on rank 1": lambda: context_parallel(mesh, buffers=[t], buffer_seq_dims=1 if rank else [1]),
        "lengths differ across ranks": lambda: context_parallel(
            mesh, buffers=[torch.zeros(2, 8 + 2 * rank)], buffer_seq_dims=[1]
        ),
    }
    seen = {}
    for name, make in tries.items():
        try:
            with make():
                pass
            seen[name] = ("", "")
        except Exception as e:  # noqa: BLE001 - reported
            seen[name] = (type(e).__name__, str(e))
    with context_parallel(mesh):
        try:
            with context_parallel(mesh):
                pass
            seen["nested"] = ("", "")
        except ValueError as e:
            seen["nested"] = (type(e).__name__, str(e))
    dist.barrier()
    return seen


def refusals(rank: int, world_size: int) -> dict[str, tuple[str, str]]:
    """Calls a shard cannot run, some made on rank 0 only: every rank must raise, none may wait."""
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    torch.manual_seed(0)
    mha = attnkit.MultiHeadAttention(8, 2)
    x = torch.randn(1, 4, 8)  # (B, L_r, E): this rank's shard
    first = rank == 0
    tries = {
        "attn_mask on rank 0": lambda: mha(x, x, x, attn_mask=torch.ones(4, 4, dtype=torch.bool) if first else None),
        "a score_mod reading a table that needs a gradient": lambda: mha(x, x, x, score_mod=_with_table),
        "score_mod differs": lambda: mha(x, x, x, score_mod=mods.softcap(5.0 if first else 4.0)),
        "score_mod functions differ": lambda: mha(x, x, x, score_mod=_distance_bonus if first else _with_table_fixed),
        "record_weights on rank 0": lambda: _recorded(mha, x, first),
        "dropout": lambda: attnkit.scaled_dot_product_attention(x, x, x, dropout_p=0.5),
        "need_weights": lambda: attnkit.scaled_dot_product_attention(x, x, x, need_weights=True),
        "backend": lambda: attnkit.scaled_dot_product_attention(x, x, x, backend="tiles:online"),
        "plan": lambda: mha(x, x, x, plan=attnkit.make_plan(4, 4, mask_mod=mods.sliding_window(2))),
        "additive": lambda: attnkit.additive_attention(x, x, x, torch.ones(8)),
        "attention_weights": lambda: attnkit.functional.attention_weights(x, x),
        "keys not cut": lambda: mha(x, torch.randn(1, 6, 8), torch.randn(1, 6, 8), valid_lens=torch.tensor([5])),
        "dropout_p not a number": lambda: attnkit.scaled_dot_product_attention(x, x, x, dropout_p="0.1"),
        "valid_lens past the sequence": lambda: mha(x, x, x, valid_lens=torch.tensor([4 * world_size + 1])),
        "per-query valid_lens, d2l": lambda: d2l.MultiHeadAttention(8, 2, 0.0)(x, x, x, torch.tensor([[1, 2, 3, 4]])),
    }
    seen = {}
    with context_parallel(mesh):
        for name, call in tries.items():
            try:
                call()
                seen[name] = ("", "")
            except Exception as e:  # noqa: BLE001 - reported
                seen[name] = (type(e).__name__, str(e))
    dist.barrier()
    return seen


_TABLE = torch.zeros(2, requires_grad=True)  # (H,): a bias per head, a parameter


def _with_table(score: torch.Tensor, b, h, q_idx, kv_idx) -> torch.Tensor:  # noqa: ANN001
    return score + _TABLE[h]


def _with_table_fixed(score: torch.Tensor, b, h, q_idx, kv_idx) -> torch.Tensor:  # noqa: ANN001
    return score + _TABLE.detach()[h]


def _recorded(mha: nn.Module, x: torch.Tensor, record: bool) -> None:
    if record:
        with attnkit.record_weights(mha):
            mha(x, x, x)
    else:
        mha(x, x, x)


class Block(nn.Module):
    """Pre-norm attnkit attention (GQA, causal) and an MLP."""

    def __init__(self, E: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(E), nn.LayerNorm(E)
        self.attn = attnkit.MultiHeadAttention(E, heads, num_kv_heads=2, query_size=E, key_size=E, value_size=E)
        self.mlp = nn.Sequential(nn.Linear(E, 2 * E), nn.GELU(), nn.Linear(2 * E, E))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        n = self.norm1(h)
        h = h + self.attn(n, n, n, is_causal=True)  # (B, L_r, E)
        return h + self.mlp(self.norm2(h))


class TinyLM(nn.Module):
    """Two blocks over learned token and position embeddings (the positions given as a buffer)."""

    def __init__(self, vocab: int = 32, E: int = 32, heads: int = 4, L: int = 16) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, E), nn.Embedding(L, E)
        self.blocks = nn.ModuleList(Block(E, heads) for _ in range(2))
        self.head = nn.Linear(E, vocab)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos(positions)  # (B, L_r, E)
        for block in self.blocks:
            h = block(h)
        return self.head(h)  # (B, L_r, V)


def fsdp_training(rank: int, world_size: int, steps: int) -> list[float]:
    """FSDP2 over a 2 x 2 mesh (data x context) with context_parallel: each step's loss over the whole batch.
    Rank 0 also trains one process's copy on the whole batch and returns both losses per step."""
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    torch.manual_seed(0)
    model = TinyLM()
    alone = TinyLM()
    alone.load_state_dict(model.state_dict())
    every = mesh["dp", "cp"]._flatten("dp_cp")  # FSDP2 over all 4 ranks (torchtitan's idiom; private in 2.13)
    for block in model.blocks:
        fully_shard(block, mesh=every)
    fully_shard(model, mesh=every)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt_alone = torch.optim.AdamW(alone.parameters(), lr=1e-2)
    dp = mesh["dp"].get_local_rank()
    losses = []
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, 32, (4, 17), generator=g)  # (2 * B, L + 1): the whole batch of both dp ranks
        inputs, targets = tokens[:, :-1], tokens[:, 1:]  # (2 * B, L): targets already shifted
        positions = torch.arange(16).expand(4, 16)  # (2 * B, L)
        mine = [t[2 * dp : 2 * dp + 2].clone() for t in (inputs, targets, positions)]  # this dp rank's examples
        with context_parallel(mesh["cp"], buffers=mine, buffer_seq_dims=[1, 1, 1]):
            logits = model(mine[0], mine[2])  # (B, L_r, V)
            # each rank's mean over its tokens; FSDP averages the gradients over the 4 ranks, which hold as many
            # tokens each: the mean over the whole batch
            loss = F.cross_entropy(logits.flatten(0, 1), mine[1].flatten())
            loss.backward()
        opt.step()
        opt.zero_grad()
        whole = loss.detach().clone()
        dist.all_reduce(whole)
        ref = F.cross_entropy(alone(inputs, positions).flatten(0, 1), targets.flatten())
        ref.backward()
        opt_alone.step()
        opt_alone.zero_grad()
        losses.append((float(whole) / world_size, float(ref.detach())))
    return losses


def llama(rank: int, world_size: int, kind: str) -> dict[str, object]:
    """A transformers Llama with attnkit registered, inside context_parallel, against one process: the loss and the
    summed gradients (``kind``: "plain", "packed" documents from position_ids, "unsharded" position_ids (of 20 and
    of 3 positions, "unsharded, short"), "padding")."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    from attnkit.integrations import transformers as attnkit_hf

    attnkit_hf.register()
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    torch.manual_seed(0)
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    make, model_class, extra = LlamaConfig, LlamaForCausalLM, {}
    if kind == "window":  # the window passed to attention and in the mask
        make, model_class, extra = MistralConfig, MistralForCausalLM, {"sliding_window": 5}
    elif kind == "softcap":  # Gemma 2: the scores soft-capped (attnkit's softcap score_mod), sliding layers too
        from transformers import Gemma2Config, Gemma2ForCausalLM

        make, model_class = Gemma2Config, Gemma2ForCausalLM
        extra = {"attn_logit_softcapping": 5.0, "sliding_window": 5, "head_dim": 8, "query_pre_attn_scalar": 8}
    elif kind == "window in the mask only":  # Qwen2-MoE passes no sliding_window to attention (a reviewer's case)
        make, model_class = Qwen2MoeConfig, Qwen2MoeForCausalLM
        extra = {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 2, "num_experts": 2}
        extra |= {"num_experts_per_tok": 1, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32}
    config = make(
        **extra,
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="attnkit",
    )
    model = model_class(config).to(
        torch.float32 if kind == "window in the mask only" else torch.float64
    )  # MoE: no float64
    unsharded = kind.startswith("unsharded")  # position_ids not passed: transformers makes each shard's 0..L_r-1
    B, L = 2, 3 if kind == "unsharded, short" else 20  # 3 over 2 ranks: [0] and [0, 1] read as two documents
    tokens = torch.randint(0, 64, (B, L + 1))
    inputs, targets = tokens[:, :-1].clone(), tokens[:, 1:].clone()  # (B, L)
    positions = torch.arange(L).expand(B, L).clone()  # (B, L)
    if kind == "packed":
        positions = torch.cat([torch.arange(7), torch.arange(13)]).expand(B, L).clone()  # two documents a row
    mask = torch.ones(B, L, dtype=torch.long)
    ref_logits = model(inputs, position_ids=positions).logits  # (B, L, V)
    if kind == "packed":  # per document, the same model on each document alone
        ref_logits = torch.cat([model(inputs[:, :7]).logits, model(inputs[:, 7:]).logits], dim=1)  # (B, L, V)
    ref = F.cross_entropy(ref_logits.flatten(0, 1), targets.flatten(), reduction="sum")
    ref_grads = torch.autograd.grad(ref, list(model.parameters()))
    given = [inputs, targets] + ([] if unsharded else [positions])
    kwargs = {}
    if kind == "padding":
        mask[0, -3:] = 0
        given.append(mask)
    seen: dict[str, object] = {}
    try:
        with context_parallel(mesh, buffers=given, buffer_seq_dims=[1] * len(given)):
            if not unsharded:
                kwargs["position_ids"] = positions
            if kind == "padding":
                kwargs["attention_mask"] = mask
            logits = model(inputs, **kwargs).logits  # (B, L_r, V)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum")
            grads = torch.autograd.grad(loss, list(model.parameters()))
    except Exception as e:  # noqa: BLE001 - reported
        seen["error"] = (type(e).__name__, str(e))
        dist.barrier()
        return seen
    whole = loss.detach().clone()
    dist.all_reduce(whole)
    summed = _summed([g.clone() for g in grads])
    seen["loss"] = (float(whole), float(ref))
    seen["grad gap"] = max(
        _gap(a, b) / max(float(b.abs().max()), 1e-30) for a, b in zip(summed, ref_grads, strict=True)
    )
    return seen


class _Biased(nn.Module):
    """A module whose score_mod reads a frozen buffer, beside parameters it does not read."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)  # parameters: need a gradient, never read by the score_mod
        self.register_buffer("rel", torch.tensor([0.5, -0.25]))

    def score(self, score: torch.Tensor, b, h, q_idx, kv_idx) -> torch.Tensor:  # noqa: ANN001
        return score + self.rel[h]


def score_mods(rank: int, world_size: int) -> dict[str, object]:
    """score_mods whose result needs no gradient, inside context_parallel against one process (float64): the
    largest gap of the outputs and the input gradients, or the error."""
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    torch.manual_seed(0)
    module = _Biased().double()
    table = torch.tensor([0.5, -0.25], dtype=torch.double, requires_grad=True)
    tries = {
        "a module's method": (module.score, False),
        "a closure over a module": (lambda s, b, h, qi, ki: s + module.rel[h], False),
        "a detached table": (lambda s, b, h, qi, ki: s + table.detach()[h], False),
        "a table under no_grad": (lambda s, b, h, qi, ki: s + table[h], True),
    }
    x = torch.randn(1, 2, 8, 4, dtype=torch.double)  # (B, H, L, D)
    seen: dict[str, object] = {}
    for name, (fn, no_grad) in tries.items():
        try:
            xw = x.clone().requires_grad_(not no_grad)
            with torch.set_grad_enabled(not no_grad):
                ref = attnkit.scaled_dot_product_attention(xw, xw, xw, is_causal=True, score_mod=fn).output
            grads = None if no_grad else torch.autograd.grad(ref.square().sum(), xw)[0]
            xs = x.clone()
            with context_parallel(mesh, buffers=[xs], buffer_seq_dims=[2]):
                xr = xs.clone().requires_grad_(not no_grad)
                with torch.set_grad_enabled(not no_grad):
                    out = attnkit.scaled_dot_product_attention(xr, xr, xr, is_causal=True, score_mod=fn).output
                gap = _gap(gather_sequence(out.detach(), layout=LAYOUT, dim=2), ref)
                if grads is not None:
                    mine = torch.autograd.grad(out.square().sum(), xr)[0]
                    gap = max(gap, _gap(gather_sequence(mine, layout=LAYOUT, dim=2), grads))
            seen[name] = gap
        except Exception as e:  # noqa: BLE001 - reported
            seen[name] = f"{type(e).__name__}: {e}"
    return seen


def edges(rank: int, world_size: int) -> dict[str, dict]:
    """:func:`buffers`, :func:`mistakes`, :func:`refusals` and :func:`score_mods` in one group (one start of the
    processes)."""
    return {f.__name__: f(rank, world_size) for f in (buffers, mistakes, refusals, score_mods)}


def llamas(rank: int, world_size: int, kinds: list[str]) -> dict[str, dict]:
    """:func:`llama` for each of ``kinds`` in one group."""
    return {kind: llama(rank, world_size, kind) for kind in kinds}


def die_inside(rank: int, world_size: int, timeout: float) -> None:
    """Training steps inside context_parallel; rank 1 dies as the second step starts. The others must raise."""
    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("cp",))
    torch.manual_seed(0)
    mha = attnkit.MultiHeadAttention(8, 2, query_size=8, key_size=8, value_size=8)
    x = torch.randn(1, 8 * world_size, 8)
    for step in range(3):
        if rank == 1 and step == 1:
            os._exit(3)
        xs = x.clone()
        with context_parallel(mesh, buffers=[xs], buffer_seq_dims=[1], timeout=timeout):
            mha(xs, xs, xs, is_causal=True).sum().backward()
