"""A plain DDP training script of the usual tutorial shape, the competitor the
benchmarks run under ``torchrun --rdzv-backend c10d`` and ``etcd-v2``.

What a tutorial does and nothing more: ``init_process_group`` from the torchrun
environment, a DDP-wrapped model, rank 0 ``torch.save``s a checkpoint every
``--ckpt-every`` steps and every rank resumes from it at start. The optimizer
recipe is elastic_train's default: its AdamW (betas, epsilon and kernel from
:func:`~elastic_train.training.optim.build_optimizer`), and, written the way
nanoGPT's ``train.py`` writes it (:func:`optimizer_step`), the LR of each step
set from the warmup and cosine schedule and gradients clipped at
``--optimizer.grad_clip``. Without it the throughput benchmark would charge a
different recipe to the trainer's overhead. The only addition is the audit
record of ``docs/DESIGN.md`` ("Audit protocol"), written with the same fields
as elastic_train's trainer so the harness measures both the same way. Each
global batch is a slice of a seeded permutation and each rank takes a
contiguous shard, so resuming at step ``s`` replays exactly the samples of
steps after ``s``.

The model and the data are elastic_train's registered ``mlp`` and
``synthetic`` factories, so both scripts train the identical workload.
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

from elastic_train.config.job import DataConfig, ModelConfig, OptimizerConfig, ScheduleConfig
from elastic_train.training.optim import build_optimizer, lr_multiplier
from elastic_train.workload.datasets import synthetic
from elastic_train.workload.models import mlp


def build(args: argparse.Namespace) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """elastic_train's ``mlp`` and ``synthetic`` data: the very workload our trainer runs."""
    data = synthetic(
        DataConfig(
            name="synthetic",
            num_samples=args.num_samples,
            num_features=args.num_features,
            num_classes=args.num_classes,
        )
    )
    torch.manual_seed(args.seed)
    model = mlp(ModelConfig(hidden_size=args.hidden_size, num_layers=args.num_layers), data.info)
    inputs, targets = data.dataset.tensors  # type: ignore[attr-defined]
    return model, inputs, targets


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Flags named like elastic_train's overrides, so the harness passes the same ones."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--training.steps", dest="steps", type=int, default=1000)
    p.add_argument("--training.global_batch_size", dest="global_batch_size", type=int, default=64)
    p.add_argument("--training.seed", dest="seed", type=int, default=0)
    p.add_argument("--model.hidden_size", dest="hidden_size", type=int, default=256)
    p.add_argument("--model.num_layers", dest="num_layers", type=int, default=2)
    p.add_argument("--data.num_samples", dest="num_samples", type=int, default=65536)
    p.add_argument("--data.num_features", dest="num_features", type=int, default=32)
    p.add_argument("--data.num_classes", dest="num_classes", type=int, default=8)
    p.add_argument("--optimizer.lr", dest="lr", type=float, default=OptimizerConfig.lr)
    p.add_argument(
        "--optimizer.grad_clip", dest="grad_clip", type=float, default=OptimizerConfig.grad_clip
    )
    p.add_argument("--checkpoint.dir", dest="ckpt_dir", type=Path, required=True)
    p.add_argument("--checkpoint.interval_steps", dest="ckpt_every", type=int, default=25)
    p.add_argument("--logging.audit_dir", dest="audit_dir", type=Path, default=None)
    p.add_argument("--elastic.pg_timeout_seconds", dest="pg_timeout", type=float, default=60.0)
    # benchmarks.workloads' step_seconds: a sleep per forward, as tests/paced_model.py's
    p.add_argument("--pace-seconds", dest="pace", type=float, default=0.0)
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
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), **pos}, tmp)
    os.replace(tmp, path)


def optimizer_step(
    model: nn.Module, opt: torch.optim.Optimizer, args: argparse.Namespace, *, step: int
) -> None:
    """elastic_train's default recipe: step ``step``'s LR (0-based, the LR that
    its ``LambdaLR`` gives the same step), then gradients clipped, then the step."""
    lr = args.lr * lr_multiplier(ScheduleConfig(), step, total=args.steps)
    for group in opt.param_groups:
        group["lr"] = lr
    if args.grad_clip > 0:
        nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
    opt.step()


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

    model, inputs, targets = build(args)
    model = model.to(device)
    opt = build_optimizer(OptimizerConfig(lr=args.lr), model)
    ckpt = args.ckpt_dir / "checkpoint.pt"
    args.ckpt_dir.mkdir(parents=True, exist_ok=True)
    pos = load_checkpoint(ckpt, model, opt)
    ddp = DistributedDataParallel(model)

    attempt = [uuid.uuid4().hex if rank == 0 else None]
    dist.broadcast_object_list(attempt, src=0)
    audit = Audit(args.audit_dir, attempt=str(attempt[0]), rank=rank, world=world)
    source = "disk" if pos["step"] else "none"
    audit.write(kind="resume", restored_step=pos["step"], source=source, dataset_len=len(inputs))

    step, epoch, position = pos["step"], pos["epoch"], pos["position"]
    perm = torch.randperm(len(inputs), generator=torch.Generator().manual_seed(args.seed + epoch))
    while step < args.steps:
        if position >= len(inputs):
            epoch, position = epoch + 1, 0
            gen = torch.Generator().manual_seed(args.seed + epoch)
            perm = torch.randperm(len(inputs), generator=gen)
        batch = perm[position : position + args.global_batch_size]
        mine = shard(batch, rank, world)
        x, y = inputs[mine].to(device), targets[mine].to(device)
        if args.pace:
            time.sleep(args.pace)
        loss = nn.functional.cross_entropy(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        optimizer_step(ddp, opt, args, step=step)
        step, position = step + 1, position + len(batch)
        audit.write(
            kind="step", step=step, epoch=epoch, indices=mine.tolist(), loss=float(loss.item())
        )
        if rank == 0 and step % args.ckpt_every == 0:
            save_checkpoint(ckpt, model, opt, step=step, epoch=epoch, position=position)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
