"""Run the real trainer in N gloo worker processes (``torch.multiprocessing``).

Each child sets the environment torchrun would set and calls
``elastic_train.main.run``, so the tests exercise the same path as torchrun.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import nn
from workers import start_workers

from elastic_train.config.job import ModelConfig
from elastic_train.config.load import load_config
from elastic_train.etcd.server import free_port
from elastic_train.main import run
from elastic_train.training.distributed import read_worker_env
from elastic_train.workload.registry import MODELS

#: A tiny job: 98 samples and a global batch of 16 make a short last batch of 2,
#: so at world size 3 one rank gets an empty shard; micro-batches of 3 force
#: gradient accumulation.
TINY_JOB = (
    "model.name=mlp",
    "model.hidden_size=16",
    "model.num_layers=2",
    "data.name=synthetic",
    "data.num_samples=98",
    "data.num_features=8",
    "data.num_classes=4",
    "training.global_batch_size=16",
    "training.micro_batch_size=3",
    "training.final_loss_samples=98",
    "optimizer.lr=0.01",
    "schedule.name=constant",
    "schedule.warmup_steps=3",
    "logging.level=WARNING",
    "logging.format=json",
)


def _child(
    rank: int,
    world_size: int,
    port: int,
    overrides: Sequence[str],
    stderr: str | None,
    run_id: str | None,
) -> None:
    if stderr is not None:
        # The workers are not children of the pytest process (forkserver), so
        # capfd does not see them: their log goes where the test asks.
        fd = os.open(stderr, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        os.dup2(fd, 2)
        os.close(fd)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
        ELASTIC_TRAIN_NODE=f"node{rank}",
    )  # fmt: skip
    if run_id is not None:  # as torchrun sets it: turns per-step snapshots on
        os.environ["TORCHELASTIC_RUN_ID"] = run_id
    torch.set_num_threads(1)  # several workers share two cores
    code = run(load_config(None, overrides), read_worker_env())
    if code:
        raise SystemExit(code)


def run_workers(
    world_size: int,
    overrides: Sequence[str],
    *,
    stderr: Path | None = None,
    run_id: str | None = None,
) -> None:
    """Train in ``world_size`` processes; raises if any of them fails.

    ``stderr``: a file the workers append their (JSON) log to. ``run_id``:
    the ``TORCHELASTIC_RUN_ID`` they see (snapshots are off without one); each
    rank is a node of its own (``node<rank>``), so only rank 0 writes one.
    """
    port = free_port()
    args = (world_size, port, list(overrides), str(stderr) if stderr else None, run_id)
    start_workers(_child, args=args, nprocs=world_size)


def final_params(audit_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(audit_dir / "final_params.pt", weights_only=True)


def failing_mlp(cfg: ModelConfig, info: Mapping[str, int]) -> nn.Module:
    """The built-in MLP, whose ``fail_at_forward``-th forward pass in a process
    raises while the file ``fail_file`` exists: every rank fails in the same
    step, and the test removes the file before it restarts them."""
    return nn.Sequential(
        MODELS.resolve("mlp")(cfg, info),
        _FailOnce(int(cfg.options["fail_at_forward"]), Path(cfg.options["fail_file"])),
    )


class _FailOnce(nn.Module):
    def __init__(self, at: int, path: Path) -> None:
        super().__init__()
        self.at, self.path, self.calls = at, path, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at and self.path.exists():
            raise RuntimeError(f"injected failure at forward {self.at}")
        return x
