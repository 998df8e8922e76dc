"""A model whose forward pass raises once, as a broken collective would, for the
in-process recovery test on one GPU.

One GPU holds one NCCL rank (NCCL refuses two ranks on the same device), so
no peer can die there; the error stands in for the one a dead peer's
all-reduce raises. The step fails before its optimizer step, so in-process
recovery must abort the NCCL group, re-form it, roll the step back and redo
it: the run then ends exactly where a run without the error does. Used as
``--model.name=tests.failing_model:fails_once_mlp``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from elastic_train.config.job import ModelConfig
from elastic_train.workload.models import mlp


class FailsOnce(nn.Module):
    def __init__(self, inner: nn.Module, *, at_call: int) -> None:
        super().__init__()
        self.inner = inner
        self.at_call = at_call
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if self.calls == self.at_call:
            raise RuntimeError(f"injected failure in forward call {self.calls}")
        return self.inner(x)


def fails_once_mlp(cfg: ModelConfig, info: Mapping[str, int]) -> nn.Module:
    """The registry's ``mlp``; forward call ``model.options.fail_at_call`` of this
    process raises (0: never)."""
    return FailsOnce(mlp(cfg, info), at_call=int(cfg.options.get("fail_at_call", 0)))
