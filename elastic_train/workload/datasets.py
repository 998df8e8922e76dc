"""Built-in datasets: a synthetic task, UCI digits, and a character-level text.

Every built-in dataset is small and in memory, and every sample is ``(input, target)``.
A user's dataset returns any item by index; its collate function (``DataBundle.collate_fn``
or ``data.collate_fn``) turns a list of items into a batch of any structure.
See ``elastic_train/workload/data/README.md`` for the sources and licenses of the
bundled files.
"""

from __future__ import annotations

import csv
import gzip
import io
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

import torch
from torch.utils.data import Dataset, TensorDataset, default_collate

from elastic_train.config.job import DataConfig
from elastic_train.workload.registry import DATASETS

Collate = Callable[[list[Any]], Any]


@dataclass(frozen=True)
class DataBundle:
    """A map-style dataset, the shape facts a model factory needs, and how
    items become a batch."""

    dataset: Dataset[Any]
    #: e.g. {"in_features": 64, "num_classes": 10} or {"vocab_size": 60, "seq_len": 64}
    info: Mapping[str, int]
    #: ``collate(items) -> batch`` (padding, a tokenizer's collator); None: torch's
    #: ``default_collate``. ``data.collate_fn``, when set, takes precedence.
    collate_fn: Collate | None = None

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]


def load_batch(dataset: Dataset[Any], indices: Sequence[int]) -> Any:
    """Collate the samples at ``indices`` into one batch with torch's ``default_collate``."""
    if isinstance(dataset, TensorDataset):  # one gather instead of a Python loop
        index = torch.as_tensor(list(indices), dtype=torch.long)
        return tuple(t[index] for t in dataset.tensors)
    return default_collate([dataset[i] for i in indices])


@DATASETS.register("synthetic")
def synthetic(cfg: DataConfig) -> DataBundle:
    """Gaussian inputs labelled by a random two-layer teacher: learnable, not trivial."""
    gen = torch.Generator().manual_seed(cfg.seed)
    inputs = torch.randn(cfg.num_samples, cfg.num_features, generator=gen)
    hidden = torch.tanh(inputs @ torch.randn(cfg.num_features, 2 * cfg.num_features, generator=gen))
    logits = hidden @ torch.randn(2 * cfg.num_features, cfg.num_classes, generator=gen)
    targets = logits.argmax(dim=1)
    info = {"in_features": cfg.num_features, "num_classes": cfg.num_classes}
    return DataBundle(TensorDataset(inputs, targets), info)


def _data_file(name: str) -> bytes:
    return resources.files("elastic_train.workload").joinpath("data", name).read_bytes()


@DATASETS.register("digits")
def digits(cfg: DataConfig) -> DataBundle:
    """UCI optical handwritten digits: 1,797 8x8 images, 10 classes."""
    text = gzip.decompress(_data_file("digits.csv.gz")).decode("ascii")
    rows = [[float(v) for v in row] for row in csv.reader(io.StringIO(text)) if row]
    table = torch.tensor(rows)
    inputs = table[:, :-1] / 16.0  # pixel counts are 0..16
    targets = table[:, -1].long()
    info = {"in_features": inputs.shape[1], "num_classes": 10}
    return DataBundle(TensorDataset(inputs, targets), info)


@DATASETS.register("founding_documents")
def founding_documents(cfg: DataConfig) -> DataBundle:
    """Characters of the US Declaration of Independence and Constitution (public domain).

    Sample ``i`` is the ``seq_len`` characters starting at ``i * seq_len`` and,
    as target, the same window shifted by one character.
    """
    text = _data_file("us_founding_documents.txt").decode("ascii")
    vocab = sorted(set(text))
    codes = torch.tensor([vocab.index(c) for c in text], dtype=torch.long)
    count = (len(codes) - 1) // cfg.seq_len
    starts = torch.arange(count) * cfg.seq_len
    window = starts[:, None] + torch.arange(cfg.seq_len)[None, :]
    info = {"vocab_size": len(vocab), "seq_len": cfg.seq_len}
    return DataBundle(TensorDataset(codes[window], codes[window + 1]), info)
