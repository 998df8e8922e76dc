"""User optimizer and LR-scheduler factories (``optimizer.name``/``schedule.name``
import strings): parameter groups, state saved and resumed at another world
size, and a clear ConfigError for a factory that is wrong.

The factories below are loaded by import string (``test_workload_factories:...``),
in this process and in the real gloo worker processes of the resume test.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from trainer_procs import TINY_JOB, final_params, run_workers

from elastic_train.config.load import load_config
from elastic_train.errors import ConfigError
from elastic_train.training.optim import build_optimizer, build_scheduler

ATOL = 2e-6
#: Not callable: refused by the import-string check.
NOT_A_FACTORY = 3


def decay_groups(
    model: nn.Module, *, lr: float = 0.01, weight_decay: float = 0.0
) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only: none on biases and norm weights."""
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": matrices, "weight_decay": weight_decay},
              {"params": vectors, "weight_decay": 0.0}]  # fmt: skip
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.99))


def step_lr(
    optimizer: torch.optim.Optimizer, *, step_size: int = 3
) -> torch.optim.lr_scheduler.LRScheduler:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=step_size, gamma=0.5)


def raises(model: nn.Module) -> torch.optim.Optimizer:
    raise RuntimeError("no optimizer today")


def returns_the_model(model: nn.Module) -> nn.Module:
    return model


def foreign_tensors(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD([nn.Parameter(torch.zeros(3))], lr=0.1)


def plateau(optimizer: torch.optim.Optimizer) -> object:
    return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)


def returns_the_optimizer(optimizer: torch.optim.Optimizer) -> object:
    return optimizer


def other_optimizer(optimizer: torch.optim.Optimizer) -> object:
    other = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
    return torch.optim.lr_scheduler.StepLR(other, step_size=1)


FACTORIES = (
    "optimizer.name=test_workload_factories:decay_groups",
    "optimizer.options.weight_decay=0.1",
    "schedule.name=test_workload_factories:step_lr",
)


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))


def test_factories_build_groups_and_schedule_with_their_options() -> None:
    cfg = load_config(None, [*FACTORIES, "schedule.options.step_size=2"])
    model = _model()
    optimizer = build_optimizer(cfg.optimizer, model)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    assert [len(g["params"]) for g in optimizer.param_groups] == [2, 4]
    scheduler = build_scheduler(cfg, optimizer, total=10, world_size=1)
    for _ in range(4):
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.01 * 0.5**2)  # step_size 2


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("optimizer.name=test_workload_factories:NOT_A_FACTORY", "NOT_A_FACTORY is not callable"),
        ("optimizer.name=test_workload_factories:raises",
         "the factory raised RuntimeError: no optimizer today"),
        ("optimizer.name=test_workload_factories:returns_the_model",
         "the factory returned a Sequential, not a torch.optim.Optimizer"),
        ("optimizer.name=test_workload_factories:foreign_tensors",
         "1 tensors that are not parameters of the model"),
        ("optimizer.options.betas=1", "the factory raised TypeError"),
        ("schedule.name=test_workload_factories:plateau",
         "ReduceLROnPlateau, which needs a metric"),
        ("schedule.name=test_workload_factories:returns_the_optimizer",
         "returned a AdamW, not a torch.optim.lr_scheduler.LRScheduler"),
        ("schedule.name=test_workload_factories:other_optimizer", "of another optimizer"),
        ("schedule.name=no_such_module_xyz:make", "cannot import 'no_such_module_xyz'"),
    ],
)  # fmt: skip
def test_a_wrong_factory_names_its_key_and_what_is_accepted(override: str, message: str) -> None:
    key = override.split(".")[0]
    base = [FACTORIES[0]] if override.startswith("optimizer.options") else []
    cfg = load_config(None, [*base, override])
    with pytest.raises(ConfigError) as info:
        optimizer = build_optimizer(cfg.optimizer, _model())
        build_scheduler(cfg, optimizer, total=10, world_size=1)
    text = str(info.value)
    assert text.startswith(f"{key}.name = "), text
    assert message in text, text
    if "cannot import" not in message and "not callable" not in message:
        assert "package.module:factory" in text and f"{key}.name takes" in text, text


@pytest.mark.slow
def test_factory_state_resumes_at_another_world_size(tmp_path: Path) -> None:
    """2 workers train 5 steps with the user's optimizer and schedule, 3 resume
    from the checkpoint to step 10: the same parameters as 1 worker without a break."""
    job = [*TINY_JOB, *FACTORIES, "checkpoint.interval_steps=5"]
    reference = tmp_path / "reference"
    run_workers(1, [*job, "training.steps=10", "checkpoint.dir=", f"logging.audit_dir={reference}"])
    ckpt, audit = tmp_path / "ckpt", tmp_path / "audit"
    phase = [*job, f"checkpoint.dir={ckpt}", f"logging.audit_dir={audit}"]
    run_workers(2, [*phase, "training.steps=5"])
    run_workers(3, [*phase, "training.steps=10"])

    resumes = [
        json.loads(line) for p in audit.glob("worker-*.jsonl") for line in p.read_text().split()
    ]
    assert {(r["restored_step"], r["world_size"]) for r in resumes if r["kind"] == "resume"} == {
        (0, 2), (5, 3)
    }  # fmt: skip
    state = torch.load(ckpt / "step-000000010" / "state.pt", weights_only=True)
    groups = state["optimizer"]["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    assert state["scheduler"]["last_epoch"] == 10
    assert groups[0]["lr"] == pytest.approx(0.01 * 0.5**3)  # StepLR: halved at 3, 6 and 9
    expected, got = final_params(reference), final_params(audit)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, atol=ATOL, rtol=0, msg=name)
