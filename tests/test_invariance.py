"""One optimizer step on W workers computes the same update as on 1 worker.

Real gloo process groups on CPU. The tiny job has a short last batch (2
samples, so one of 3 ranks has an empty shard), micro-batches of 3 (gradient
accumulation with ``no_sync``) and crosses an epoch boundary.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from trainer_procs import TINY_JOB, final_params, run_workers

from elastic_train.config.load import load_config
from elastic_train.workload.datasets import DataBundle
from elastic_train.workload.registry import DATASETS, MODELS

STEPS = 10  # 7 steps per epoch: the epoch's short last batch and 3 steps of the next
ATOL = 2e-6


def _job(audit_dir: Path, *extra: str) -> list[str]:
    audit = f"logging.audit_dir={audit_dir}"
    return [*TINY_JOB, f"training.steps={STEPS}", "checkpoint.dir=", audit, *extra]


def _initial_params(overrides: list[str]) -> dict[str, torch.Tensor]:
    cfg = load_config(None, overrides)
    data: DataBundle = DATASETS.resolve(cfg.data.name)(cfg.data)
    torch.manual_seed(cfg.training.seed)
    return MODELS.resolve(cfg.model.name)(cfg.model, data.info).state_dict()


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_parameters_do_not_depend_on_world_size(tmp_path: Path, optimizer: str) -> None:
    results = {}
    for world_size in (1, 2, 3):
        audit = tmp_path / f"w{world_size}"
        run_workers(world_size, _job(audit, f"optimizer.name={optimizer}"))
        results[world_size] = final_params(audit)

    start = _initial_params(_job(tmp_path / "unused"))
    moved = max((results[1][k] - start[k]).abs().max().item() for k in start)
    assert moved > 1000 * ATOL, "training barely moved the parameters; the check would be vacuous"
    for world_size in (2, 3):
        for name, reference in results[1].items():
            torch.testing.assert_close(
                results[world_size][name], reference, atol=ATOL, rtol=0,
                msg=lambda m, n=name, w=world_size: f"{n} at world size {w}: {m}",
            )  # fmt: skip


@pytest.mark.slow
def test_per_worker_mode_depends_on_world_size(tmp_path: Path) -> None:
    """The classic mode is the control: its batch and LR change with the world size."""
    results = {}
    for world_size in (1, 2):
        audit = tmp_path / f"w{world_size}"
        run_workers(world_size, _job(audit, "training.batch_mode=per_worker",
                                     "training.worker_batch_size=8"))  # fmt: skip
        results[world_size] = final_params(audit)
    differs = max((results[1][k] - results[2][k]).abs().max().item() for k in results[1])
    assert differs > 1000 * ATOL
