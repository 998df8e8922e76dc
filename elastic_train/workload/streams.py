"""A built-in stream: the synthetic task, read shard by shard in a per-epoch shard order.

``synthetic_stream`` stands for a dataset too large to index item by item, such
as record files on object storage. Its records live in shards of
:data:`SHARD_SIZE` records (here generated from the data seed and the shard
number instead of stored); a shard is read front to back, and each epoch visits
the shards in a different order, a permutation seeded by the data seed and the
epoch (the usual way streaming datasets shuffle). ``read(epoch, start, count)``
finds the shard that holds position ``start`` and reads on from there, so
starting at any position costs one shard read, not a replay of the epoch.

It implements :class:`~elastic_train.workload.datasets.PositionalStream`, which
is what makes a resume exact: the trainer restarts each rank's reads at the
global position it saved (docs/training.md, "Iterable datasets").
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator

import torch
from torch.utils.data import Dataset

from elastic_train.config.job import DataConfig
from elastic_train.workload.datasets import DataBundle, derived_seed
from elastic_train.workload.registry import DATASETS

#: Records per shard: the unit the stream reads and shuffles.
SHARD_SIZE = 16


class SyntheticStream(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Gaussian inputs labelled by a random two-layer teacher, in shuffled shards."""

    def __init__(self, cfg: DataConfig) -> None:
        self.num_samples = cfg.num_samples
        self.num_features = cfg.num_features
        self.seed = cfg.seed
        gen = torch.Generator().manual_seed(cfg.seed)
        self._hidden = torch.randn(cfg.num_features, 2 * cfg.num_features, generator=gen)
        self._out = torch.randn(2 * cfg.num_features, cfg.num_classes, generator=gen)
        self.num_shards = -(-cfg.num_samples // SHARD_SIZE)
        self._layout: tuple[int, list[int], list[int]] | None = None

    def __len__(self) -> int:
        return self.num_samples

    def shard(self, number: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All records of shard ``number`` (the last one may be short)."""
        size = min(SHARD_SIZE, self.num_samples - number * SHARD_SIZE)
        gen = torch.Generator().manual_seed(derived_seed("synthetic_stream", self.seed, number))
        inputs = torch.randn(size, self.num_features, generator=gen)
        targets = (torch.tanh(inputs @ self._hidden) @ self._out).argmax(dim=1)
        return inputs, targets

    def layout(self, epoch: int) -> tuple[list[int], list[int]]:
        """The shards in ``epoch``'s order and the stream position each one starts at."""
        if self._layout is None or self._layout[0] != epoch:
            seed = derived_seed("synthetic_stream.epoch", self.seed, epoch)
            gen = torch.Generator().manual_seed(seed)
            order = torch.randperm(self.num_shards, generator=gen).tolist()
            starts, position = [], 0
            for number in order:
                starts.append(position)
                position += min(SHARD_SIZE, self.num_samples - number * SHARD_SIZE)
            self._layout = (epoch, order, starts)
        return self._layout[1], self._layout[2]

    def read(self, epoch: int, start: int, count: int) -> Iterator[tuple[torch.Tensor, ...]]:
        """The records at positions ``start .. start + count - 1`` of ``epoch``."""
        if not 0 <= start <= start + count <= self.num_samples:
            raise IndexError(
                f"read(start={start}, count={count}) is outside the {self.num_samples} "
                "positions of an epoch"
            )
        order, starts = self.layout(epoch)
        index = bisect.bisect_right(starts, start) - 1
        position, end = start, start + count
        while position < end:
            inputs, targets = self.shard(order[index])
            first = position - starts[index]
            last = min(len(inputs), first + end - position)
            for row in range(first, last):
                yield inputs[row], targets[row]
            position += last - first
            index += 1

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        """Position ``index`` of epoch 0: by-index access for evaluation and checks."""
        return next(iter(self.read(0, index, 1)))


@DATASETS.register("synthetic_stream")
def synthetic_stream(cfg: DataConfig) -> DataBundle:
    """The ``synthetic`` task (another sample of it) as a stream of shuffled shards."""
    info = {"in_features": cfg.num_features, "num_classes": cfg.num_classes}
    return DataBundle(SyntheticStream(cfg), info)
