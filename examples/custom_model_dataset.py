"""A custom model and dataset, plugged in through the import-string hook.

``model.name`` and ``data.name`` take ``package.module:factory``; the module
must be importable by every worker (PYTHONPATH or an installed package).
Run from the repository root::

    PYTHONPATH=examples torchrun --standalone --nproc-per-node 2 elastic_train/main.py \\
        --model.name=custom_model_dataset:make_model \\
        --data.name=custom_model_dataset:make_dataset \\
        --data.options.path=examples/data/iris_like.csv --training.steps=50

or ``python examples/custom_model_dataset.py`` for the same job in one process.
A dataset factory takes the ``[data]`` config and returns a ``DataBundle``; a
model factory takes the ``[model]`` config and the bundle's ``info``. The loss
(``model.loss``) must return one loss per sample.
"""

from __future__ import annotations

import csv
import sys
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

from elastic_train.config.job import DataConfig, ModelConfig
from elastic_train.errors import ConfigError
from elastic_train.workload.datasets import DataBundle

HERE = Path(__file__).resolve().parent


def make_dataset(cfg: DataConfig) -> DataBundle:
    """Rows of ``feature,...,label`` from the CSV file at ``data.options.path``."""
    path = Path(cfg.options.get("path", HERE / "data" / "iris_like.csv"))
    if not path.is_file():
        # Fail at start, naming the setting, instead of deep inside the first step.
        raise ConfigError(f"data.options.path = {str(path)!r}: no such file")
    with path.open() as fh:
        rows = [[float(v) for v in row] for row in csv.reader(fh) if row]
    table = torch.tensor(rows)
    inputs, labels = table[:, :-1], table[:, -1].long()
    info = {"in_features": inputs.shape[1], "num_classes": int(labels.max()) + 1}
    return DataBundle(TensorDataset(inputs, labels), info)


class TinyNet(nn.Module):
    def __init__(self, in_features: int, hidden: int, classes: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(in_features, hidden), nn.GELU())
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def make_model(cfg: ModelConfig, info: Mapping[str, int]) -> nn.Module:
    return TinyNet(info["in_features"], cfg.hidden_size, info["num_classes"])


if __name__ == "__main__":
    from elastic_train.main import main

    sys.path.insert(0, str(HERE))  # so that the import strings below resolve
    sys.exit(
        main(
            [
                "--model.name=custom_model_dataset:make_model",
                "--data.name=custom_model_dataset:make_dataset",
                "--training.steps=30",
                "--training.global_batch_size=16",
                "--checkpoint.dir=",
                *sys.argv[1:],
            ]
        )
    )
