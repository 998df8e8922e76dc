"""A plain DDP training script of the usual tutorial shape, the competitor the
benchmarks run under ``torchrun --rdzv-backend c10d`` and ``etcd-v2``.

What a tutorial does and nothing more: ``init_process_group`` from the torchrun
environment, a DDP-wrapped model, rank 0 ``torch.save``s a checkpoint every
``--ckpt-every`` steps and every rank resumes from it at start. The only
addition is the audit record of ``docs/DESIGN.md`` ("Audit protocol"), written
with the same fields as elastic_train's trainer so the harness measures both
the same way. Each global batch is a slice of a seeded permutation and each
rank takes a contiguous shard, so resuming at step ``s`` replays exactly the
samples of steps after ``s``.

The model and data factories are importable (``build_model``,
``build_dataset``) so elastic_train can train the identical workload.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def build_model(*, dim: int = 32, hidden: int = 256, layers: int = 2) -> nn.Module:
    """A small MLP regressor (seeded so every run starts from the same weights)."""
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    width = dim
    for _ in range(layers):
        blocks += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    blocks.append(nn.Linear(width, 1))
    return nn.Sequential(*blocks)


def build_dataset(*, size: int = 65536, dim: int = 32) -> torch.utils.data.TensorDataset:
    """Synthetic linear regression with noise, identical in every process."""
    gen = torch.Generator().manual_seed(1234)
    x = torch.randn(size, dim, generator=gen)
    w = torch.randn(dim, 1, generator=gen)
    y = x @ w + 0.1 * torch.randn(size, 1, generator=gen)
    return torch.utils.data.TensorDataset(x, y)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1000, help="total optimizer steps")
    p.add_argument("--global-batch-size", type=int, default=64)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dataset-size", type=int, default=65536)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ckpt-dir", type=Path, required=True)
    p.add_argument("--ckpt-every", type=int, default=50, help="rank-0 save interval, steps")
    p.add_argument("--audit-dir", type=Path, default=None)
    p.add_argument("--pg-timeout", type=float, default=60.0, help="process group timeout, s")
    return p.parse_args(argv)


class Audit:
    """Appends the audit JSON lines of docs/DESIGN.md; a no-op without a directory."""

    def __init__(self, directory: Path | None, *, attempt: str, rank: int, world: int) -> None:
        self.node = os.environ.get("ELASTIC_TRAIN_NODE", socket.gethostname())
        self.base = {"attempt": attempt, "rank": rank, "world_size": world, "node": self.node}
        self.file = None
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)
            path = directory / f"worker-{self.node}-{os.getpid()}.jsonl"
            self.file = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as training

    def write(self, **record: Any) -> None:
        if self.file is not None:
            self.file.write(json.dumps({**record, **self.base, "time": time.time()}) + "\n")


def load_checkpoint(path: Path, model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, int]:
    if not path.exists():
        return {"step": 0, "epoch": 0, "position": 0}
    state = torch.load(path, map_location="cpu", weights_only=True)
    model.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    return {k: int(state[k]) for k in ("step", "epoch", "position")}


def save_checkpoint(path: Path, model: nn.Module, opt: torch.optim.Optimizer, **pos: int) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), **pos}, tmp)
    os.replace(tmp, path)


def shard(indices: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    per, extra = divmod(len(indices), world)
    start = rank * per + min(rank, extra)
    return indices[start : start + per + (1 if rank < extra else 0)]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.pg_timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{os.environ['LOCAL_RANK']}" if backend == "nccl" else "cpu")

    model = build_model(dim=args.dim, hidden=args.hidden, layers=args.layers).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    ckpt = args.ckpt_dir / "checkpoint.pt"
    args.ckpt_dir.mkdir(parents=True, exist_ok=True)
    pos = load_checkpoint(ckpt, model, opt)
    ddp = DistributedDataParallel(model)
    data = build_dataset(size=args.dataset_size, dim=args.dim)

    attempt = [uuid.uuid4().hex if rank == 0 else None]
    dist.broadcast_object_list(attempt, src=0)
    audit = Audit(args.audit_dir, attempt=str(attempt[0]), rank=rank, world=world)
    source = "disk" if pos["step"] else "none"
    audit.write(kind="resume", restored_step=pos["step"], source=source)

    step, epoch, position = pos["step"], pos["epoch"], pos["position"]
    perm = torch.randperm(len(data), generator=torch.Generator().manual_seed(args.seed + epoch))
    while step < args.steps:
        if position >= len(data):
            epoch, position = epoch + 1, 0
            gen = torch.Generator().manual_seed(args.seed + epoch)
            perm = torch.randperm(len(data), generator=gen)
        batch = perm[position : position + args.global_batch_size]
        mine = shard(batch, rank, world)
        x, y = data.tensors[0][mine].to(device), data.tensors[1][mine].to(device)
        loss = nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step, position = step + 1, position + len(batch)
        audit.write(
            kind="step", step=step, epoch=epoch, indices=mine.tolist(), loss=float(loss.item())
        )
        if rank == 0 and step % args.ckpt_every == 0:
            save_checkpoint(ckpt, model, opt, step=step, epoch=epoch, position=position)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
