"""A model for the chaos tests, loaded through the import-string hook.

The built-in MLP plus a pause in every forward pass, so that a step takes tens
of milliseconds however fast the machine is: faults and rejoins then land while
training still runs. With ``pause_file`` the test steers the pause while the
job runs (slow while faults happen, none once they are over). The pause
changes no number.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from elastic_train.config.job import ModelConfig
from elastic_train.workload.registry import MODELS


class Pause(nn.Module):
    def __init__(self, seconds: float, path: str | None) -> None:
        super().__init__()
        self.seconds = seconds
        self.path = Path(path) if path else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seconds = self.seconds
        if self.path is not None:
            with contextlib.suppress(OSError, ValueError):
                seconds = float(self.path.read_text())
        time.sleep(seconds)
        return x


def slow_mlp(cfg: ModelConfig, info: Mapping[str, int]) -> nn.Module:
    return nn.Sequential(
        MODELS.resolve("mlp")(cfg, info),
        Pause(float(cfg.options.get("pause_s", 0.02)), cfg.options.get("pause_file")),
    )
