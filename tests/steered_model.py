"""A model whose forward pass pauses as long as a file says, for tests that steer their pace.

A chaos run needs each fault to land mid-run and a joiner to arrive before the
end, on any machine: a pause in every forward (a sleep, no CPU) guarantees it.
Once the last fault has played out the pause is only wall time, so the test
ends it: every forward reads ``model.options.pause_file`` (seconds; while the
file is absent or unreadable, ``model.options.seconds``). The pause changes no
number: a fault-free reference runs the same model without a file.

    --model.name=tests.steered_model:steered --model.options.pause_file=PATH
    --model.options.inner=mlp     (any registered model; the default)
"""

from __future__ import annotations

from collections.abc import Mapping

from torch import nn

from elastic_train.config.job import ModelConfig
from elastic_train.workload.registry import MODELS
from tests.chaos_model import Pause


def steered(cfg: ModelConfig, info: Mapping[str, int]) -> nn.Module:
    """The registry's ``model.options.inner`` (``mlp``), then the steered pause."""
    inner = MODELS.resolve(str(cfg.options.get("inner", "mlp")))(cfg, info)
    pause = Pause(float(cfg.options.get("seconds", 0.0)), cfg.options.get("pause_file"))
    return nn.Sequential(inner, pause)
