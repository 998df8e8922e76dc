"""AFTER: the same job on elastic_train (docs/migrating.md shows the diff).

The model and the data become factories; argparse, the process group, the
sampler, the loop and the checkpoints are the trainer's::

    torchrun --standalone --nproc-per-node 2 examples/ddp_migration/after_elastic_train.py
    # elastic, fault tolerant, across machines:
    torchrun --nnodes 1:4 --nproc-per-node 2 --rdzv-backend etcd \\
        --rdzv-endpoint ETCD_HOST:2379 --rdzv-id job1 --rdzv-conf secret_file=/run/secrets/rdzv \\
        examples/ddp_migration/after_elastic_train.py
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

from elastic_train.config.job import DataConfig, ModelConfig
from elastic_train.workload.datasets import DataBundle


def make_dataset(cfg: DataConfig) -> DataBundle:
    gen = torch.Generator().manual_seed(1234)
    inputs = torch.randn(2048, 32, generator=gen)
    targets = torch.randint(0, 8, (2048,), generator=gen)
    return DataBundle(TensorDataset(inputs, targets), {"in_features": 32, "num_classes": 8})


def make_model(cfg: ModelConfig, info: Mapping[str, int]) -> nn.Module:
    return nn.Sequential(
        nn.Linear(info["in_features"], 64), nn.ReLU(), nn.Linear(64, info["num_classes"])
    )


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # workers import this module
    from elastic_train.main import main

    sys.exit(
        main(
            [
                "--model.name=after_elastic_train:make_model",
                "--data.name=after_elastic_train:make_dataset",
                "--training.epochs=3",
                "--training.steps=0",
                "--training.global_batch_size=32",  # 2 workers x 16, the old per-GPU batch
                "--schedule.name=constant",
                "--checkpoint.dir=checkpoints/ddp_migration",
                *sys.argv[1:],
            ]
        )
    )
