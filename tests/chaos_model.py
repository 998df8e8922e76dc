"""A model for the chaos tests, loaded through the import-string hook.

The built-in MLP plus a fixed pause in every forward pass, so that a step takes
tens of milliseconds however fast the machine is: faults and rejoins then land
while training still runs. The pause changes no number.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

import torch
from torch import nn

from elastic_train.config import ModelConfig
from elastic_train.registry import MODELS


class Pause(nn.Module):
    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.seconds)
        return x


def slow_mlp(cfg: ModelConfig, info: Mapping[str, int]) -> nn.Module:
    return nn.Sequential(
        MODELS.resolve("mlp")(cfg, info), Pause(float(cfg.options.get("pause_s", 0.02)))
    )
