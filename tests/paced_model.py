"""A model whose forward pass takes at least a fixed time, for end-to-end tests.

Chaos tests trigger faults at step numbers and need the run to outlast the
recovery. On a fast machine a tiny MLP does a step in milliseconds; a floor
on the step time (a sleep, which costs no CPU) keeps the schedule meaningful
on any machine. Used as ``--model.name=tests.paced_model:paced_mlp``.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import torch
from torch import nn

from elastic_train.config.job import ModelConfig
from elastic_train.workload.models import mlp


class Paced(nn.Module):
    def __init__(self, inner: nn.Module, *, seconds: float) -> None:
        super().__init__()
        self.inner = inner
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return self.inner(x)


def paced_mlp(cfg: ModelConfig, info: Mapping[str, int]) -> nn.Module:
    """The registry's ``mlp``; each forward sleeps ``model.options.seconds`` (0.05)."""
    return Paced(mlp(cfg, info), seconds=float(cfg.options.get("seconds", 0.05)))
