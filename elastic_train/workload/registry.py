"""Models, datasets and losses chosen by name or by an import string.

A name is looked up in the registry of its kind; anything with a colon is an
import string ``package.module:attribute`` and is imported, so users train
their own code without forking this package. The factory signatures are:

* dataset: ``factory(cfg: DataConfig) -> DataBundle`` (``elastic_train.workload.datasets``)
* model: ``factory(cfg: ModelConfig, info: Mapping[str, int]) -> torch.nn.Module``
* loss, ``model.loss_form = "per_sample"`` (:data:`LOSSES`): ``loss(output, target) -> Tensor``
  of shape ``[batch]``, one loss per sample
* loss, ``model.loss_form = "sum_count"`` (:data:`SUM_COUNT_LOSSES`):
  ``loss(model, batch) -> (loss_sum, count)``, the micro-batch's summed loss and
  the number of units (samples, tokens) it covers

``data.collate_fn``, ``optimizer.name`` and ``schedule.name`` take import strings
too (:func:`import_string`); their built-in choices are not registries.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from elastic_train.errors import ConfigError

F = TypeVar("F", bound=Callable[..., Any])


class Registry(Generic[F]):
    """Factories of one kind by name."""

    def __init__(self, kind: str, *, field: str) -> None:
        self.kind = kind
        self.field = field  # the config field that names an entry, for error messages
        self._entries: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        def decorate(factory: F) -> F:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = factory
            return factory

        return decorate

    def names(self) -> list[str]:
        _load_builtins()
        return sorted(self._entries)

    def resolve(self, spec: str) -> F:
        """The factory named ``spec``, or imported from ``package.module:attribute``."""
        if ":" in spec:
            return import_string(spec, field=self.field)
        _load_builtins()
        try:
            return self._entries[spec]
        except KeyError:
            raise ConfigError(
                f"{self.field} = {spec!r}: unknown {self.kind}; use one of "
                f"{', '.join(sorted(self._entries))} or an import string package.module:factory"
            ) from None


#: Import strings written before the package had subpackages keep working.
MOVED_MODULES = {
    "elastic_train.models": "elastic_train.workload.models",
    "elastic_train.datasets": "elastic_train.workload.datasets",
}


def import_string(spec: str, *, field: str) -> Any:
    """Import ``package.module:attribute`` (attribute may be dotted)."""
    module_name, _, attr_path = spec.partition(":")
    if not module_name or not attr_path:
        raise ConfigError(f"{field} = {spec!r}: expected an import string package.module:factory")
    module_name = MOVED_MODULES.get(module_name, module_name)
    try:
        target: Any = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"{field} = {spec!r}: cannot import {module_name!r}: {exc}") from exc
    for attr in attr_path.split("."):
        try:
            target = getattr(target, attr)
        except AttributeError:
            raise ConfigError(f"{field} = {spec!r}: {module_name} has no {attr_path!r}") from None
    if not callable(target):
        raise ConfigError(f"{field} = {spec!r}: {attr_path} is not callable")
    return target


MODELS: Registry[Callable[..., Any]] = Registry("model", field="model.name")
DATASETS: Registry[Callable[..., Any]] = Registry("dataset", field="data.name")
LOSSES: Registry[Callable[..., Any]] = Registry("loss", field="model.loss")
SUM_COUNT_LOSSES: Registry[Callable[..., Any]] = Registry(
    "loss of model.loss_form = 'sum_count'", field="model.loss"
)


def _load_builtins() -> None:
    # The built-in modules register themselves on import; importing them here,
    # not at the top, avoids an import cycle (they import this module).
    importlib.import_module("elastic_train.workload.models")
    importlib.import_module("elastic_train.workload.datasets")
    importlib.import_module("elastic_train.workload.streams")
