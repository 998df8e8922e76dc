"""The training workload every competitor runs, and the worker command line
that makes each competitor's script run exactly that workload."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from benchmarks.harness import Competitor

PLAIN_SCRIPT = Path(__file__).resolve().parent / "competitors" / "plain_ddp.py"


@dataclass(frozen=True)
class Workload:
    """Model, data and schedule; defaults are the recovery benchmark's small MLP."""

    steps: int = 1_000_000
    global_batch_size: int = 64
    dim: int = 32
    hidden: int = 256
    layers: int = 2
    dataset_size: int = 65536
    lr: float = 0.01
    #: The plain script's rank-0 checkpoint interval, in steps.
    ckpt_every: int = 50


def plain_args(workload: Workload, audit_dir: Path, ckpt_dir: Path) -> list[str]:
    return [
        str(PLAIN_SCRIPT),
        f"--steps={workload.steps}",
        f"--global-batch-size={workload.global_batch_size}",
        f"--dim={workload.dim}",
        f"--hidden={workload.hidden}",
        f"--layers={workload.layers}",
        f"--dataset-size={workload.dataset_size}",
        f"--lr={workload.lr}",
        f"--ckpt-every={workload.ckpt_every}",
        f"--ckpt-dir={ckpt_dir}",
        f"--audit-dir={audit_dir}",
    ]


def ours_args(workload: Workload, audit_dir: Path, ckpt_dir: Path) -> list[str]:
    """elastic_train's entry script at its defaults, training the same MLP and data."""
    raise NotImplementedError("elastic_train.main has not landed yet")


def worker_command(
    competitor: Competitor, workload: Workload, audit_dir: Path, ckpt_dir: Path
) -> list[str]:
    build = ours_args if competitor.ours else plain_args
    return build(workload, audit_dir, ckpt_dir)
