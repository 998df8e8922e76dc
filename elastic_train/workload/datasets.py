"""Built-in datasets: a synthetic task, UCI digits, and a character-level text.

Every built-in dataset is small and in memory, and every sample is ``(input, target)``.
A user's dataset returns any item by index; its collate function (``DataBundle.collate_fn``
or ``data.collate_fn``) turns a list of items into a batch of any structure. A
dataset read as a stream implements :class:`PositionalStream` instead
(``workload/streams.py`` has a built-in one).
See ``elastic_train/workload/data/README.md`` for the sources and licenses of the
bundled files.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import io
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any, Protocol, runtime_checkable

import torch
from torch.utils.data import Dataset, IterableDataset, TensorDataset, default_collate

from elastic_train.config.job import DataConfig
from elastic_train.errors import ConfigError
from elastic_train.workload.registry import DATASETS

Collate = Callable[[list[Any]], Any]


def derived_seed(*parts: object) -> int:
    """A 63-bit seed from ``parts`` (e.g. a name, a seed and an epoch), hashed so
    that nearby tuples such as (1, 0) and (0, 1) do not share a random stream,
    which plain arithmetic like seed + epoch would not."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@runtime_checkable
class PositionalStream(Protocol):
    """A dataset read as a stream that can start at any position of an epoch.

    ``len()`` is the number of samples in one epoch. ``read(epoch, start, count)``
    yields the items at positions ``start .. start + count - 1`` of the epoch's
    order. The stream defines that order itself (e.g. shards shuffled by a seed
    and the epoch); it must be the same in every process and every run, so a
    position names one sample. The trainer does not shuffle a stream: each rank
    reads its contiguous share of each global batch, from the global position
    the sampler saved, so a resume at any world size is exact
    (docs/training.md, "Iterable datasets").
    """

    def __len__(self) -> int: ...

    def read(self, epoch: int, start: int, count: int) -> Iterable[Any]: ...


def stream_items(stream: PositionalStream, indices: Sequence[int], *, epoch: int) -> list[Any]:
    """The items at stream positions ``indices`` of ``epoch``: one ``read`` per
    contiguous run of positions (a rank's shard of a step is a single run)."""
    items: list[Any] = []
    start = 0
    for end in range(1, len(indices) + 1):
        if end == len(indices) or indices[end] != indices[end - 1] + 1:
            count = end - start
            got = list(stream.read(epoch, int(indices[start]), count))
            if len(got) != count:
                name, first = type(stream).__name__, indices[start]
                raise ConfigError(
                    f"data.name: {name}.read(epoch={epoch}, start={first}, count={count}) "
                    f"yielded {len(got)} items; a stream of len() {len(stream)} must yield "
                    "exactly count items"
                )
            items += got
            start = end
    return items


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

    def __post_init__(self) -> None:
        if isinstance(self.dataset, IterableDataset) and not self.streamed:
            raise ConfigError(
                f"data.name: {type(self.dataset).__name__} is an IterableDataset, which has no "
                "position a resume could start from; use a map-style dataset (__len__ and "
                "__getitem__) or a PositionalStream (__len__ and read(epoch, start, count)), "
                'docs/training.md, "Iterable datasets"'
            )

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    @property
    def streamed(self) -> bool:
        """Whether the dataset is read as a :class:`PositionalStream`."""
        return isinstance(self.dataset, PositionalStream)


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
