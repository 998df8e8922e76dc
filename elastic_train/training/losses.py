"""The training loss in its two forms (``model.loss_form``), and their check before training.

* ``"per_sample"``: ``loss(output, target) -> Tensor[batch]`` on ``(inputs, target)``
  batches, the model called as ``model(inputs)``. A micro-batch counts its
  samples, so the step's global count is the global batch size, known without
  a collective.
* ``"sum_count"``: ``loss(model, batch) -> (loss_sum, count)`` on a batch of any
  structure: the micro-batch's summed loss and the units it covers (samples,
  or tokens that are not padding). The step divides by the count summed over
  every rank and micro-batch (``training/step.py``). In a step ``model`` is
  the DDP wrapper: calling it is what lets DDP synchronise the gradients.

:func:`check_first_micro_batch` runs one micro-batch of the first items
through the collate function, the model and the loss when the trainer is
built, so a batch the collate function cannot handle or a loss of the wrong
shape or type fails with a ConfigError before the first step.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from typing import Any, NoReturn

import torch
from torch import nn

from elastic_train.config.job import ModelConfig
from elastic_train.errors import ConfigError
from elastic_train.training.batches import BatchLoader
from elastic_train.training.rng import capture_rng_state, restore_rng_state
from elastic_train.workload.registry import LOSSES, SUM_COUNT_LOSSES

#: A micro-batch's summed loss and its count (an int, a float or a scalar tensor).
LossAndCount = tuple[torch.Tensor, Any]

_CONTRACTS = {
    "per_sample": "loss(output, target) -> Tensor of shape [batch], one loss per sample, "
    "on batches (inputs, target) with the model called as model(inputs)",
    "sum_count": "loss(model, batch) -> (loss_sum, count): a scalar tensor, the "
    "micro-batch's summed loss, and the number of units it covers (samples, or "
    "tokens that are not padding) as an int, a float or a scalar tensor",
}


class TrainingLoss:
    """The user's loss function in the form ``model.loss_form`` names."""

    def __init__(
        self, cfg: ModelConfig, *, fn: Callable[..., Any] | None = None, source: str = ""
    ) -> None:
        """``fn``: a script's own loss function (``source`` names it in errors) instead of
        ``model.loss``."""
        self.form = cfg.loss_form
        registry = SUM_COUNT_LOSSES if self.form == "sum_count" else LOSSES
        self.fn: Callable[..., Any] = fn if fn is not None else registry.resolve(cfg.loss)
        #: A micro-batch's count is known only after its forward: the step all-reduces it.
        self.counted = self.form == "sum_count"
        name = source or f"model.loss = {cfg.loss!r}"
        self.source = f"{name} (model.loss_form = {self.form!r})"

    @property
    def contract(self) -> str:
        return f"model.loss_form = {self.form!r} expects {_CONTRACTS[self.form]}"

    def micro_batch(self, model: nn.Module, batch: Any, size: int) -> LossAndCount:
        """The summed loss of one micro-batch of ``size`` samples, and its count."""
        if self.counted:
            result = self.fn(model, batch)
            if not (isinstance(result, tuple) and len(result) == 2):
                self.fail(f"it returned {_describe(result)}, not a pair (loss_sum, count)")
            loss_sum, count = result
            if not isinstance(loss_sum, torch.Tensor) or loss_sum.dim() != 0:
                self.fail(f"its loss_sum is {_describe(loss_sum)}, not a scalar tensor")
            return loss_sum.float(), count
        inputs, target = batch
        losses = self.fn(model(inputs), target)
        # A batch-mean loss would be weighted as one sample: the update would be wrong.
        if getattr(losses, "shape", None) != (size,):
            self.fail(f"it returned {_describe(losses)} for a micro-batch of {size} samples")
        return losses.float().sum(), size

    def fail(self, problem: str) -> NoReturn:
        raise ConfigError(f"{self.source}: {problem}; {self.contract}")


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    if isinstance(value, tuple):
        return f"a tuple of {len(value)}"
    return f"a {type(value).__name__}"


def _check_batch_structure(loss: TrainingLoss, batch: Any) -> None:
    if loss.counted or (isinstance(batch, (tuple, list)) and len(batch) == 2):
        return
    kind = f"a {type(batch).__name__}"
    if isinstance(batch, Mapping):
        kind += f" with keys {list(batch)[:8]}"
    elif isinstance(batch, (tuple, list)):
        kind += f" of {len(batch)}"
    loss.fail(
        f"the batch is {kind}, not a pair (inputs, target); for other batches set "
        "model.loss_form = 'sum_count' with a loss(model, batch) -> (loss_sum, count)"
    )


def _check_result(loss: TrainingLoss, model: nn.Module, result: LossAndCount) -> None:
    loss_sum, count = result
    if not loss_sum.is_floating_point():
        loss.fail(f"its loss_sum is {_describe(loss_sum)}, not a floating-point tensor")
    trainable = any(p.requires_grad for p in model.parameters())
    if trainable and not loss_sum.requires_grad:
        loss.fail("its loss_sum does not depend on the model's parameters (no gradient)")
    if isinstance(count, torch.Tensor):
        if count.numel() != 1:
            loss.fail(f"its count is {_describe(count)}, not a scalar")
        count = count.item()
    if isinstance(count, bool) or not isinstance(count, (int, float)):
        loss.fail(f"its count is {_describe(count)}, not a number")
    if not math.isfinite(count) or count < 0:
        loss.fail(f"its count is {count}, not a finite number >= 0")


def check_first_micro_batch(
    model: nn.Module,
    loss: TrainingLoss,
    loader: BatchLoader,
    *,
    size: int,
    autocast: Callable[[], contextlib.AbstractContextManager[Any]],
) -> None:
    """Collate the first ``size`` items, run the model and the loss on them and
    check what comes back; a ConfigError names the key at fault.

    Nothing it touches changes: the RNGs and the model's buffers (BatchNorm's
    running statistics) are put back, and there is no backward.
    """
    indices = list(range(min(size, len(loader.dataset))))  # type: ignore[arg-type]
    if not indices:
        return
    rng = capture_rng_state()
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        batch = loader(indices)
        _check_batch_structure(loss, batch)
        try:
            with autocast():
                result = loss.micro_batch(model, batch, len(indices))
        except ConfigError:
            raise
        except Exception as exc:
            raise ConfigError(
                f"{loss.source}: the model or the loss failed on the first micro-batch: "
                f"{type(exc).__name__}: {exc}; {loss.contract}"
            ) from exc
        _check_result(loss, model, result)
    finally:
        restore_rng_state(rng)
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
