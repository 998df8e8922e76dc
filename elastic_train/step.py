"""One optimizer step of the loop in ``train.py``, with what it records.

A step is forward and backward (DDP's gradient all-reduce, the step's one
collective), this rank's audit record, the optimizer step, the snapshot, and
at check and log steps one small all-reduce (:class:`Agreement`) of the loss
and the preemption flag that runs while the optimizer step and the snapshot
write go on. See docs/checkpoints-and-snapshots.md ("Per-step overhead").
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from elastic_train.datasets import load_batch
from elastic_train.log import get_logger
from elastic_train.sampler import ElasticSampler

if TYPE_CHECKING:
    from elastic_train.train import Trainer

log = get_logger(__name__)


@dataclass(frozen=True)
class StepStats:
    step: int
    epoch: int
    loss: float | None  # mean per-sample loss over the global batch, at check steps
    samples: int  # size of the global batch
    seconds: float
    lr: float


def micro_batches(shard: list[int], micro_batch_size: int) -> list[list[int]]:
    size = micro_batch_size or max(1, len(shard))
    return [shard[i : i + size] for i in range(0, len(shard), size)]


def forward_backward(t: Trainer, indices: list[int], *, scale: float) -> torch.Tensor:
    """Forward and backward of one micro-batch; returns the detached sum of its losses."""
    inputs, targets = (x.to(t.ctx.device) for x in load_batch(t.data.dataset, indices))
    with t.precision.autocast():
        losses = t.loss_fn(t.ddp(inputs), targets).float()
    t.precision.backward(losses.sum() * scale)
    return losses.detach().sum()


def optimizer_step(t: Trainer) -> None:
    if t.cfg.optimizer.grad_clip > 0:
        t.precision.unscale_(t.optimizer)  # clip the true gradients, not fp16-scaled ones
        # Gradients are already identical on every rank, so is their norm.
        nn.utils.clip_grad_norm_(t.model.parameters(), t.cfg.optimizer.grad_clip)
    t.precision.step(t.optimizer)
    t.scheduler.step()
    t.optimizer.zero_grad(set_to_none=True)


def train_step(t: Trainer, batch: list[int], shard: list[int]) -> torch.Tensor:
    """Forward and backward of one world-size-invariant step (gradients all-reduced);
    returns the sum of this rank's sample losses. The optimizer step is the caller's."""
    scale = t.ctx.world_size / len(batch)
    chunks, weight = micro_batches(shard, t.cfg.training.micro_batch_size), 1.0
    if not chunks:
        # An empty shard (a short last batch on many ranks) must still join
        # DDP's all-reduce: a real sample with weight zero adds a zero gradient.
        chunks, weight = [batch[:1]], 0.0
    loss_sum = torch.zeros((), device=t.ctx.device)
    for i, chunk in enumerate(chunks):
        # Gradients are all-reduced once per step, in the last backward.
        sync = i == len(chunks) - 1
        with contextlib.nullcontext() if sync else t.ddp.no_sync():
            loss_sum += weight * forward_backward(t, chunk, scale=weight * scale)
    return loss_sum


class Agreement:
    """The small all-reduce of a check step, started early and awaited late:
    every rank's loss sum, the preemption flag, and rank 0's proposal of the
    steps until the next check."""

    def __init__(self, t: Trainer, loss_sum: torch.Tensor) -> None:
        preemption = t.guards.preemption
        proposal = preemption.propose_interval(t.step) if t.ctx.rank == 0 else 0
        values = (preemption.flag(), float(proposal))
        self._totals = torch.cat((loss_sum.reshape(1), loss_sum.new_tensor(values)))
        self._work = dist.all_reduce(self._totals, async_op=True)

    def wait(self, t: Trainer, *, samples: int) -> tuple[float, bool]:
        """The global batch's mean loss, and whether any rank was signalled to stop."""
        self._work.wait()
        loss_total, signalled, interval = self._totals.tolist()
        t.guards.preemption.checked(t.step, interval=round(interval))
        return loss_total / samples, signalled > 0


def current_lr(t: Trainer) -> float:
    return float(t.optimizer.param_groups[0]["lr"])


def record_step(t: Trainer, *, epoch: int, shard: list[int], loss_sum: torch.Tensor) -> None:
    """This rank's audit record of the step.

    A snapshot of the step is published only after a collective that every
    rank enters after writing this record (the next step's gradient
    all-reduce, or this step's agreement), so it never holds a step whose
    record some rank lacks. The record's loss is this rank's own mean.
    """
    if t.audit is not None:
        loss = loss_sum.item() / len(shard) if shard else 0.0
        t.audit.step(step=t.step, epoch=epoch, indices=shard, loss=loss)


def log_due(t: Trainer, step: int) -> bool:
    return step % t.cfg.logging.log_every_steps == 0 or step == 1


def report_step(t: Trainer, stats: StepStats, *, local_samples: int) -> None:
    """After each step: progress marker, metrics, periodic log line."""
    t.progress.record(stats.step)
    t.metrics.step_completed(
        step=stats.step, samples=local_samples, seconds=stats.seconds, loss=stats.loss,
        world_size=t.ctx.world_size,
    )  # fmt: skip
    if log_due(t, stats.step):
        log.info(
            "step", step=stats.step, epoch=stats.epoch, loss=round(stats.loss or 0.0, 5),
            lr=stats.lr, world_size=t.ctx.world_size, step_seconds=round(stats.seconds, 4),
            samples_per_second=round(stats.samples / stats.seconds, 1),
        )  # fmt: skip


def publish_snapshot(t: Trainer) -> None:
    """Publish the previous step's snapshot: every rank recorded that step before
    entering this step's gradient all-reduce, which has completed by now."""
    if t.snapshots is None or t.snapshots.pending is None:
        return
    if t.ctx.device.type == "cuda":
        # backward() returns before NCCL's all-reduce ends; only a sync says it did.
        torch.cuda.current_stream(t.ctx.device).synchronize()
    t.snapshots.commit(t.step)


@dataclass(frozen=True)
class StepOutcome:
    signalled: bool | None  # some rank was asked to stop; None: no check after this step
    epoch_ended: bool


def run_step(t: Trainer, *, state: Callable[[], dict[str, Any]]) -> StepOutcome:
    """One optimizer step with its records and its snapshot.

    The ranks agree (loss, preemption flag) only at check and log steps, in
    an all-reduce that runs while this rank takes the optimizer step and
    writes the snapshot; every other step has DDP's gradient all-reduce only.
    """
    started, epoch, lr = time.perf_counter(), t.sampler.epoch, current_lr(t)
    batch = t.sampler.next_global_batch()
    shard = ElasticSampler.shard(batch, t.ctx.rank, t.ctx.world_size)
    loss_sum = train_step(t, batch, shard)
    publish_snapshot(t)
    t.step += 1
    record_step(t, epoch=epoch, shard=shard, loss_sum=loss_sum)
    due = log_due(t, t.step) or t.guards.preemption.check_due(t.step)
    agreement = Agreement(t, loss_sum) if due else None
    optimizer_step(t)
    epoch_ended = t.sampler.epoch_finished()
    if epoch_ended:
        t.sampler.start_next_epoch()
    if t.snapshots is not None:
        t.snapshots.after_step(t.step, state, commit=False)
    loss, signalled = None, None
    if agreement is not None:
        loss, signalled = agreement.wait(t, samples=len(batch))
        if t.snapshots is not None:
            t.snapshots.commit(t.step)
    stats = StepStats(
        step=t.step, epoch=epoch, loss=loss, samples=len(batch),
        seconds=time.perf_counter() - started, lr=lr,
    )  # fmt: skip
    report_step(t, stats, local_samples=len(shard))
    return StepOutcome(signalled=signalled, epoch_ended=epoch_ended)
