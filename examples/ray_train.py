"""Ray Train with attnkit's context parallelism: a ``TorchTrainer`` of gloo workers, each holding a shard of every
sequence, the model wrapped in DDP by Ray (``prepare_model``), checked against one process.

    pip install -c constraints.txt -e '.[ray]'      # or: make ray
    python examples/ray_train.py                    # 2 workers, 5 steps
    python examples/ray_train.py --workers 4 --steps 20

Ray starts the workers and their gloo process group; inside each step, ``context_parallel`` cuts the batch's
sequences over the workers and every attention call runs as ring attention; DDP averages the gradients, which
makes the whole batch's mean loss. The same model trained by one process on the whole batch must give the same
loss at every step: the script prints both and exits 1 when a step's losses are further apart than 1e-5 relative
(float32), 2 for a mistake in the arguments.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from typing import NoReturn

import torch
from torch import nn

import attnkit

# B batch, L whole length, L_r this worker's positions, E features, V vocabulary

V, E, L, B = 100, 64, 256, 2


class LM(nn.Module):
    """Two pre-norm transformer blocks of attnkit attention, causal."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.pos, self.head = nn.Embedding(V, E), nn.Embedding(L, E), nn.Linear(E, V)
        self.attn = nn.ModuleList(
            attnkit.MultiHeadAttention(E, 4, num_kv_heads=2, query_size=E, key_size=E, value_size=E) for _ in range(2)
        )
        self.mlp = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(E), nn.Linear(E, 4 * E), nn.GELU(), nn.Linear(4 * E, E)) for _ in range(2)
        )
        self.norm = nn.ModuleList(nn.LayerNorm(E) for _ in range(2))

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos(positions)  # (B, L_r, E)
        for attn, norm, mlp in zip(self.attn, self.norm, self.mlp, strict=True):
            n = norm(h)
            h = h + attn(n, n, n, is_causal=True)  # causal over the whole sequence
            h = h + mlp(h)
        return self.head(h)  # (B, L_r, V)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole batch of a step: inputs and labels (shifted before any cutting) and positions, each (B, L)."""
    tokens = torch.randint(0, V, (B, L + 1), generator=torch.Generator().manual_seed(step))  # (B, L + 1)
    return tokens[:, :-1].clone(), tokens[:, 1:].clone(), torch.arange(L).expand(B, L).clone()


def train_loop(config: dict) -> None:
    """What each Ray worker runs (Ray has made the gloo process group)."""
    import ray.train
    import ray.train.torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from attnkit.distributed import context_parallel

    W = dist.get_world_size()
    mesh = init_device_mesh("cpu", (W,), mesh_dim_names=("cp",))
    torch.manual_seed(0)  # the same parameters on every worker
    model = ray.train.torch.prepare_model(LM())  # DistributedDataParallel: it averages the gradients
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(config["steps"]):
        inputs, labels, positions = batch(step)  # the same whole batch on every worker
        with context_parallel(mesh, buffers=[inputs, labels, positions], buffer_seq_dims=[1, 1, 1]):
            logits = model(inputs, positions)  # (B, L_r, V): this worker's positions
            # this worker's sum over the whole batch's size, times W: DDP's mean over the workers is then the whole
            # batch's mean loss, also where the shards differ in length (a worker's own mean would be biased)
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") * W / (B * L)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(mean := loss.detach() / W)
        losses.append(float(mean))  # the whole batch's mean loss
    with tempfile.TemporaryDirectory() as saved:  # Ray keeps the metrics that come with a checkpoint
        checkpoint = None
        if dist.get_rank() == 0:
            torch.save(model.module.state_dict(), os.path.join(saved, "model.pt"))
            checkpoint = ray.train.Checkpoint.from_directory(saved)
        ray.train.report({"losses": losses}, checkpoint=checkpoint)


def one_process(steps: int) -> list[float]:
    """The same training on the whole batch in this process: each step's loss."""
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = LM()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(steps):
        inputs, labels, positions = batch(step)
        loss = F.cross_entropy(model(inputs, positions).flatten(0, 1), labels.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, status 2: no usage block
        print(f"ray_train.py: {message}", file=sys.stderr)
        sys.exit(2)


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=2, help="Ray workers, one shard of each sequence each")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args(argv)
    if not 1 <= args.workers <= L // 2 or args.steps < 1:
        parser.error(f"--workers must be 1..{L // 2} and --steps at least 1, got {args.workers} and {args.steps}")
    try:
        import ray
        from ray.train import RunConfig, ScalingConfig
        from ray.train.torch import TorchConfig, TorchTrainer
    except ImportError:
        print("this example needs Ray Train: pip install -c constraints.txt -e '.[ray]'", file=sys.stderr)
        return 2

    storage = tempfile.mkdtemp(prefix="attnkit-ray-")  # the run's checkpoint, removed at the end
    ray.init(num_cpus=args.workers + 1, include_dashboard=False, log_to_driver=False)
    try:
        trainer = TorchTrainer(
            train_loop,
            train_loop_config={"steps": args.steps},
            scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=False),
            torch_config=TorchConfig(backend="gloo"),
            run_config=RunConfig(name="attnkit-context-parallel", storage_path=storage),
        )
        rays = list(trainer.fit().metrics["losses"])
    finally:
        ray.shutdown()
        shutil.rmtree(storage, ignore_errors=True)
    alone = one_process(args.steps)
    worst = 0.0
    for step, (mine, ref) in enumerate(zip(rays, alone, strict=True)):
        worst = max(worst, abs(mine - ref) / abs(ref))
        print(f"step {step}: loss {mine:.6f} on {args.workers} Ray workers, {ref:.6f} on one process")
    print(f"largest relative gap {worst:.1e}")
    return 0 if len(rays) == args.steps and worst <= 1e-5 else 1


if __name__ == "__main__":
    sys.exit(main())
