"""Micro-batches of any structure: items by index, the collate function, the device.

The sampler decides the indices; the dataset returns one item per index; the
collate function builds the micro-batch from the items. A batch may be any
pytree of tensors (a dict or other mapping such as ``transformers``'
``BatchEncoding``, a tuple, named tuple, list or dataclass); it moves to the
device recursively. On CUDA each tensor is pinned first (``data.pin_memory``)
and copied with ``non_blocking=True``, so the copy overlaps the host work that follows.

The step's micro-batches come from :meth:`BatchLoader.for_step`: loaded right
then (``data.num_workers = 0``), or ahead of time by DataLoader workers
(``training/loader.py``). A stream dataset (``PositionalStream``) is read by
position runs instead of item by item.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset, TensorDataset, default_collate

from elastic_train.config.job import DataConfig, TrainingConfig
from elastic_train.errors import ConfigError
from elastic_train.training.loader import Prefetcher, StepPlan
from elastic_train.training.sampler import ElasticSampler
from elastic_train.workload.datasets import (
    Collate,
    DataBundle,
    PositionalStream,
    load_batch,
    stream_items,
)
from elastic_train.workload.registry import import_string

#: What data.collate_fn accepts, for error messages.
COLLATE_CONTRACT = (
    "data.collate_fn takes \"\" (the dataset's DataBundle.collate_fn, else torch's "
    "default_collate, which needs items of equal shapes) or an import string "
    "package.module:function of collate(items: list) -> batch"
)


def to_device(batch: Any, device: torch.device, *, pin: bool = True) -> Any:
    """``batch`` with every tensor in it on ``device``; other leaves (strings,
    numbers, None) are returned as they are. ``pin``: page-lock CPU tensors
    first on CUDA, for an asynchronous copy."""
    return _move(batch, device, pin=pin and device.type == "cuda")


def _move(obj: Any, device: torch.device, *, pin: bool) -> Any:
    if isinstance(obj, torch.Tensor):
        if pin and obj.device.type == "cpu":
            obj = obj if obj.is_pinned() else obj.pin_memory()
            return obj.to(device, non_blocking=True)
        return obj.to(device)
    if type(obj) is tuple:  # the common (inputs, target), before the slower ABC checks
        return tuple([_move(v, device, pin=pin) for v in obj])
    if isinstance(obj, Mapping):
        return _rebuild(type(obj), {k: _move(v, device, pin=pin) for k, v in obj.items()})
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # a named tuple
        return type(obj)(*(_move(v, device, pin=pin) for v in obj))
    if isinstance(obj, (list, tuple)):
        return _rebuild(type(obj), [_move(v, device, pin=pin) for v in obj])
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        fields = [f.name for f in dataclasses.fields(obj) if f.init]
        return dataclasses.replace(
            obj, **{name: _move(getattr(obj, name), device, pin=pin) for name in fields}
        )
    return obj


def _rebuild(kind: type, contents: Any) -> Any:
    """A container of ``kind`` holding ``contents``; the plain one when ``kind``
    cannot be built from its contents (e.g. ``defaultdict``), as ``default_collate`` does."""
    try:
        return kind(contents)
    except TypeError:
        return contents


class BatchLoader:
    """``loader(indices)`` -> the micro-batch of those items, on the device.

    A collate function that fails on the items raises a ConfigError naming
    ``data.collate_fn`` (the same items fail the same way on every retry).
    """

    def __init__(self, data: DataBundle, cfg: DataConfig, *, device: torch.device) -> None:
        self.dataset: Dataset[Any] = data.dataset
        self.device = device
        self.cfg = cfg
        self.stream = data.dataset if isinstance(data.dataset, PositionalStream) else None
        self._prefetcher: Prefetcher | None = None
        self.collate_fn: Collate | None
        if cfg.collate_fn:
            self.collate_fn = import_string(cfg.collate_fn, field="data.collate_fn")
            self.source = f"data.collate_fn = {cfg.collate_fn!r}"
        elif data.collate_fn is not None:
            self.collate_fn = data.collate_fn
            self.source = "data.collate_fn = '' (the dataset's DataBundle.collate_fn)"
        else:
            self.collate_fn = None
            self.source = "data.collate_fn = '' (torch's default_collate)"
        #: Torch's collate of a TensorDataset's items is one gather per tensor.
        self._gather = self.collate_fn is None and isinstance(self.dataset, TensorDataset)

    def collate(self, indices: Sequence[int], *, epoch: int = 0) -> Any:
        """The micro-batch of the items at ``indices`` (stream positions of
        ``epoch`` for a stream), on the CPU."""
        if self._gather:
            return load_batch(self.dataset, indices)  # no per-item work
        if self.stream is not None:
            items = stream_items(self.stream, indices, epoch=epoch)
        else:
            items = [self.dataset[i] for i in indices]
        try:
            return (self.collate_fn or default_collate)(items)
        except Exception as exc:
            shown = list(indices[:8]) + (["..."] if len(indices) > 8 else [])
            raise ConfigError(
                f"{self.source}: cannot make a batch of the items at indices {shown} "
                f"({_describe(items[0]) if items else 'no items'}): "
                f"{type(exc).__name__}: {exc}. {COLLATE_CONTRACT}"
            ) from exc

    def __call__(self, indices: Sequence[int], *, epoch: int = 0) -> Any:
        return to_device(self.collate(indices, epoch=epoch), self.device, pin=self.cfg.pin_memory)

    def start(
        self, sampler: ElasticSampler, *, step: int, rank: int, world_size: int,
        training: TrainingConfig, first_ranks: int | None = None,
    ) -> None:  # fmt: skip
        """Start loading ahead from ``sampler``'s (restored) position, when
        ``data.num_workers > 0``; the workers plan the steps until the run's end.
        ``first_ranks``: the ranks that split the first step's batch (``StepPlan``)."""
        self.close()
        if self.cfg.num_workers == 0:
            return
        plan = StepPlan(
            sampler.copy(), rank=rank, world_size=world_size,
            micro_batch_size=training.micro_batch_size, step=step,
            until_step=training.steps, until_epoch=training.epochs, first_ranks=first_ranks,
        )  # fmt: skip
        if plan.done():
            return  # resumed at the end: nothing to load, no workers to start
        pin = self.cfg.pin_memory and self.device.type == "cuda"
        self._prefetcher = Prefetcher(self, plan, self.cfg, pin=pin, seed=training.seed)

    def for_step(self, indices: Sequence[int], *, epoch: int) -> Any:
        """The step's micro-batch of ``indices`` in ``epoch``, on the device:
        the one the workers loaded, or loaded now (no workers, or they are
        out of step: then they are stopped and every later batch loads here)."""
        if self._prefetcher is not None:
            taken, batch = self._prefetcher.take(epoch, indices)
            if taken:
                return to_device(batch, self.device, pin=self.cfg.pin_memory)
            self.close()
        return self(indices, epoch=epoch)

    def close(self) -> None:
        """Stop the DataLoader workers, if any."""
        prefetcher, self._prefetcher = self._prefetcher, None
        if prefetcher is not None:
            prefetcher.close()

    def __getstate__(self) -> dict[str, Any]:
        # A worker started with spawn/forkserver gets a copy without the workers.
        return {**self.__dict__, "_prefetcher": None}


def _describe(item: Any) -> str:
    """A short description of one dataset item, for error messages."""
    if isinstance(item, torch.Tensor):
        return f"the first item is a tensor of shape {tuple(item.shape)}"
    if isinstance(item, Mapping):
        return f"the first item is a {type(item).__name__} with keys {list(item)[:8]}"
    return f"the first item is a {type(item).__name__}"
