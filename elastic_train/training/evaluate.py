"""Distributed evaluation: every sample exactly once, results equal to one process.

``DistributedSampler`` pads the last shard with duplicates so that every rank
gets the same number of samples, which counts some samples twice. Here the
evaluation set is cut into fixed micro-batches of ``batch_size`` consecutive
samples (the same cut for every world size) and each rank evaluates a
contiguous run of whole micro-batches (``ElasticSampler.shard``), so no
sample is dropped or repeated.

Why the micro-batches are global: a model's output for one row depends on the
other rows of its batch (CPU and GPU matmul kernels block differently for
different batch sizes), so only identical batches give bit-identical per-sample
losses. The reduction is exact too: each rank writes its micro-batches' loss
sums into its own slots of a vector that is zero elsewhere, the vector is
all-reduced with SUM (``x + 0`` is exact), and every rank then sums it in the
same order a single process does. Correct predictions and counts are integer
sums. The result therefore equals a single-process evaluation bit for bit.

With ``loss_form="sum_count"`` the loss is ``loss_fn(model, batch) -> (loss_sum,
count)`` on batches of any structure (``collate_fn``), and the result is the
loss per unit (e.g. per token): the sum of the losses over the sum of the
counts, each summed the same exact way; there is no accuracy then.

The unwrapped module is evaluated, never the DDP wrapper: DDP's forward may
broadcast buffers, a collective that would deadlock when ranks evaluate
different numbers of micro-batches.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, default_collate

from elastic_train.training.batches import to_device
from elastic_train.training.sampler import ElasticSampler

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class EvalResult:
    loss: float  # mean loss per sample (per unit with a sum_count loss)
    accuracy: float | None  # None when the targets are not class labels
    samples: int
    correct: int
    predictions: int  # labels compared (samples, or tokens for sequence targets)

    def as_dict(self) -> dict[str, Any]:
        return {
            "loss": self.loss,
            "accuracy": self.accuracy,
            "samples": self.samples,
            "correct": self.correct,
            "predictions": self.predictions,
        }


def micro_batches(num_samples: int, batch_size: int) -> list[range]:
    """The global cut of ``range(num_samples)`` into consecutive micro-batches."""
    if batch_size < 1:
        raise ValueError(f"evaluation batch_size must be >= 1, got {batch_size}")
    return [range(i, min(i + batch_size, num_samples)) for i in range(0, num_samples, batch_size)]


def _per_sample_loss(loss: torch.Tensor, batch: int) -> torch.Tensor:
    """A loss function may return per-sample (reduction='none') or batch-mean losses."""
    if loss.dim() == 0:
        return loss.detach().double().expand(batch) if batch else loss.new_zeros(0).double()
    return loss.detach().double().reshape(batch, -1).mean(dim=1)


def _classification_counts(output: torch.Tensor, target: torch.Tensor) -> tuple[int, int]:
    if target.is_floating_point() or output.dim() != target.dim() + 1:
        return 0, 0
    correct = int((output.argmax(dim=-1) == target).sum().item())
    return correct, target.numel()


def evaluate(
    model: torch.nn.Module,
    dataset: Dataset[Any],
    *,
    loss_fn: LossFn,
    batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    device: torch.device | str = "cpu",
    autocast: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    group: dist.ProcessGroup | None = None,
    loss_form: str = "per_sample",
    collate_fn: Callable[[list[Any]], Any] | None = None,
) -> EvalResult:
    """Evaluate ``model`` on ``dataset``; a collective when ``world_size > 1``."""
    module = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    device = torch.device(device)
    batches = micro_batches(len(dataset), batch_size)  # type: ignore[arg-type]
    mine = ElasticSampler.shard(list(range(len(batches))), rank, world_size)
    # Row 0: each micro-batch's loss sum; row 1: its units (samples or counted units).
    sums = torch.zeros(2, len(batches), dtype=torch.float64, device=device)
    counts = torch.zeros(3, dtype=torch.int64, device=device)  # samples, correct, predictions
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            for b in mine:
                items = [dataset[i] for i in batches[b]]
                batch = to_device((collate_fn or default_collate)(items), device)
                correct, predictions = 0, 0
                if loss_form == "sum_count":
                    with autocast():
                        loss_sum, units = loss_fn(module, batch)
                    sums[0, b], sums[1, b] = loss_sum.detach().double(), float(units)
                else:
                    inputs, target = batch
                    with autocast():
                        output = module(inputs)
                        loss = loss_fn(output, target)
                    sums[0, b] = _per_sample_loss(loss, len(batches[b])).sum()
                    sums[1, b] = len(batches[b])
                    correct, predictions = _classification_counts(output, target)
                counts += torch.tensor([len(batches[b]), correct, predictions], device=device)
    finally:
        module.train(was_training)
    if world_size > 1:
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        dist.all_reduce(counts, op=dist.ReduceOp.SUM, group=group)
    samples, correct, predictions = (int(v) for v in counts.tolist())
    units = float(sums[1].sum().item())
    return EvalResult(
        loss=float(sums[0].sum().item()) / units if units > 0 else 0.0,
        accuracy=correct / predictions if predictions else None,
        samples=samples,
        correct=correct,
        predictions=predictions,
    )
