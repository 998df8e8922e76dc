"""What the trainer trains: data, model, loss, optimizer and schedule.

:func:`elastic_train.training.loop.build` takes them from one of two sources:

* :class:`ConfiguredParts`: the registries and import strings of the config
  (``model.name``, ``data.name``, ``model.loss``, ``optimizer.name``,
  ``schedule.name``), the path of ``elastic_train/main.py``;
* :class:`ScriptParts`: objects that a user's own script built and handed to
  :func:`elastic_train.api.fit`.

Everything after them (sampler, checkpoints, snapshots, restore, DDP, the
step, the audit) is the same for both, so a script gets the same recovery.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler
from torch.utils.data import Dataset

from elastic_train.config.job import JobConfig
from elastic_train.config.job import fingerprint as config_fingerprint
from elastic_train.errors import ConfigError
from elastic_train.training.batches import BatchLoader
from elastic_train.training.losses import TrainingLoss, check_first_micro_batch
from elastic_train.training.optim import (
    FIT_OPTIMIZER_CONTRACT,
    FIT_SCHEDULE_CONTRACT,
    build_optimizer,
    build_scheduler,
    checked_optimizer,
    checked_scheduler,
)
from elastic_train.training.precision import Precision
from elastic_train.training.start_finish import prepare_model
from elastic_train.workload.datasets import Collate, DataBundle
from elastic_train.workload.registry import DATASETS, MODELS

OptimizerFactory = Callable[[nn.Module], torch.optim.Optimizer]
SchedulerFactory = Callable[[torch.optim.Optimizer], LRScheduler]


class TrainingParts(Protocol):
    """The five things a job trains with; ``build`` calls them in this order."""

    def data(self) -> DataBundle: ...

    def model(self, info: Mapping[str, int]) -> nn.Module: ...

    def loss(self) -> TrainingLoss: ...

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer: ...

    def scheduler(
        self, optimizer: torch.optim.Optimizer, *, total: int, world_size: int
    ) -> LRScheduler: ...

    def fingerprint(self, model: nn.Module, data: DataBundle) -> str:
        """What a checkpoint's meaning depends on; a different one refuses it."""
        ...


@dataclass(frozen=True)
class ConfiguredParts:
    """Everything named by the config: registry names or import strings."""

    cfg: JobConfig

    def data(self) -> DataBundle:
        return DATASETS.resolve(self.cfg.data.name)(self.cfg.data)  # type: ignore[no-any-return]

    def model(self, info: Mapping[str, int]) -> nn.Module:
        return MODELS.resolve(self.cfg.model.name)(self.cfg.model, info)  # type: ignore[no-any-return]

    def loss(self) -> TrainingLoss:
        return TrainingLoss(self.cfg.model)

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return build_optimizer(self.cfg.optimizer, model)

    def scheduler(
        self, optimizer: torch.optim.Optimizer, *, total: int, world_size: int
    ) -> LRScheduler:
        return build_scheduler(self.cfg, optimizer, total=total, world_size=world_size)

    def fingerprint(self, model: nn.Module, data: DataBundle) -> str:
        return config_fingerprint(self.cfg)


@dataclass(frozen=True)
class ScriptParts:
    """What a user's own script built (:func:`elastic_train.api.fit`).

    ``optimizer`` and ``scheduler`` are factories: the trainer calls them on
    the model it trains (after moving it to the device), as it would an
    import string's factory. None takes ``optimizer.*``/``schedule.*`` of the config.
    """

    cfg: JobConfig
    module: nn.Module
    dataset: Dataset[Any]
    loss_fn: Callable[..., Any]
    optimizer_factory: OptimizerFactory | None = None
    scheduler_factory: SchedulerFactory | None = None
    collate_fn: Collate | None = None

    def __post_init__(self) -> None:
        _require(isinstance(self.module, nn.Module), "model", self.module, "a torch.nn.Module")
        readable = hasattr(self.dataset, "__getitem__") or hasattr(self.dataset, "read")
        expected = "a map-style dataset (len, __getitem__) or a PositionalStream (len, read)"
        _require(readable and hasattr(self.dataset, "__len__"), "dataset", self.dataset, expected)
        _require(callable(self.loss_fn), "loss", self.loss_fn, "a function")
        for name in ("optimizer_factory", "scheduler_factory", "collate_fn"):
            value = getattr(self, name)
            what = "a factory function, e.g. lambda model: torch.optim.AdamW(model.parameters())"
            if name != "optimizer_factory":
                what = "a function or None"
            _require(value is None or callable(value), name.removesuffix("_factory"), value, what)

    def data(self) -> DataBundle:
        return DataBundle(self.dataset, info={}, collate_fn=self.collate_fn)

    def model(self, info: Mapping[str, int]) -> nn.Module:
        # Built by the script: DDP's constructor broadcasts rank 0's weights, so
        # every rank starts from the same ones whatever the script's seeding.
        return self.module

    def loss(self) -> TrainingLoss:
        source = f"fit(loss={_name(self.loss_fn)})"
        return TrainingLoss(self.cfg.model, fn=self.loss_fn, source=source)

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        if self.optimizer_factory is None:
            return build_optimizer(self.cfg.optimizer, model)
        key = f"fit(optimizer={_name(self.optimizer_factory)})"
        return checked_optimizer(
            key, self.optimizer_factory, model, contract=FIT_OPTIMIZER_CONTRACT
        )

    def scheduler(
        self, optimizer: torch.optim.Optimizer, *, total: int, world_size: int
    ) -> LRScheduler:
        if self.scheduler_factory is None:
            return build_scheduler(self.cfg, optimizer, total=total, world_size=world_size)
        key = f"fit(scheduler={_name(self.scheduler_factory)})"
        return checked_scheduler(
            key, self.scheduler_factory, optimizer, batch_mode=self.cfg.training.batch_mode,
            contract=FIT_SCHEDULE_CONTRACT,
        )  # fmt: skip

    def fingerprint(self, model: nn.Module, data: DataBundle) -> str:
        """The config's, plus the model's parameter names, shapes and dtypes and
        the dataset's length: the script's objects are not in the config."""
        layout = sorted(
            (name, tuple(t.shape), str(t.dtype)) for name, t in model.state_dict().items()
        )
        text = repr((config_fingerprint(self.cfg), layout, len(data)))
        return hashlib.sha256(text.encode()).hexdigest()[:16]


def _name(fn: Any) -> str:
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _require(ok: bool, key: str, value: Any, expected: str) -> None:
    if not ok:
        raise ConfigError(f"fit({key}=...): got a {type(value).__name__}; expected {expected}")


@dataclass(frozen=True)
class Prepared:
    """What :func:`prepare` built and checked before any process group exists."""

    parts: TrainingParts
    data: DataBundle
    model: nn.Module
    loss: TrainingLoss
    batches: BatchLoader
    precision: Precision


def prepare(cfg: JobConfig, device: torch.device, parts: TrainingParts | None = None) -> Prepared:
    """Build model, data and loss with ``parts`` (None: the config's) and check them.

    No collective runs here, so main.py calls it before joining the process group:
    a loss of the wrong shape, a batch the collate function cannot handle or the
    weights of another model fail on every rank before any group starts.
    """
    parts = parts or ConfiguredParts(cfg)
    data = parts.data()
    torch.manual_seed(cfg.training.seed)  # identical initial weights on every rank
    random.seed(cfg.training.seed)
    model = parts.model(data.info).to(device)
    loss, batches = parts.loss(), BatchLoader(data, cfg.data, device=device)
    precision = Precision(cfg.training.precision, device=device)
    size = min(4, cfg.training.micro_batch_size or 4)  # no more than a step's forward holds
    check_first_micro_batch(model, loss, batches, size=size, autocast=precision.autocast)
    prepare_model(model, cfg)  # init_from, resume_from
    return Prepared(parts, data, model, loss, batches, precision)
