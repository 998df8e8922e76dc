"""One optimizer step of the loop in ``train.py``, with what it records.

A step is forward, this rank's audit record, backward (DDP's gradient
all-reduce, the step's one collective), the optimizer step, the snapshot, and
at check steps one small all-reduce (:class:`Agreement`) of the loss
and the preemption flag that runs while the optimizer step and the snapshot
write go on. A failure in either collective first snapshots the last
completed step (:class:`StepStart`). See docs/checkpoints-and-snapshots.md.

Normalisation (world-size invariance): each micro-batch's summed loss is
backpropagated with the constant ``world_size / B`` (B: samples in the global
batch); DDP averages over ranks, so the gradient is the sum of all per-unit
gradients divided by B. With per-sample losses B is the global count and
that is the mean. With ``model.loss_form = "sum_count"`` the units (tokens)
are counted only by the forwards, so the step also all-reduces its count (one
number, started before the last backward and awaited after it) and multiplies
the gradients by ``B / global count`` before the optimizer step and clipping
(:class:`GlobalCount`): the mean over every unit of the global batch, however
the units are spread over ranks and micro-batches.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from elastic_train.log import get_logger
from elastic_train.training import heal
from elastic_train.training.optim import clip_grad_norm
from elastic_train.training.rng import capture_torch_rng_state
from elastic_train.training.sampler import ElasticSampler

if TYPE_CHECKING:
    from elastic_train.training.loop import Trainer

log = get_logger(__name__)


@dataclass(frozen=True)
class StepStats:
    step: int
    epoch: int
    loss: float | None  # mean loss per unit (sample, token) of the global batch, at check steps
    samples: int  # size of the global batch
    seconds: float
    lr: float


def micro_batches(shard: list[int], micro_batch_size: int) -> list[list[int]]:
    size = micro_batch_size or max(1, len(shard))
    return [shard[i : i + size] for i in range(0, len(shard), size)]


def step_chunks(
    batch: list[int], shard: list[int], micro_batch_size: int
) -> tuple[list[list[int]], float]:
    """This rank's micro-batches of a step and the weight of their loss (also
    what DataLoader workers load ahead, ``training/loader.py``).

    An empty shard (a short last batch on many ranks) must still join DDP's
    all-reduce: a real sample with weight zero adds a zero gradient.
    """
    chunks = micro_batches(shard, micro_batch_size)
    return (chunks, 1.0) if chunks else ([batch[:1]], 0.0)


def forward(t: Trainer, indices: list[int]) -> tuple[torch.Tensor, Any]:
    """The summed loss of one micro-batch, and the units (samples, tokens) it covers."""
    batch = t.batches.for_step(indices, epoch=t.sampler.epoch)
    with t.precision.autocast():
        return t.loss.micro_batch(t.ddp, batch, len(indices))


class GlobalCount:
    """The step's count of units summed over every rank, all-reduced while the
    last backward runs; then the gradients are rescaled to the mean per unit."""

    def __init__(self, t: Trainer, local: torch.Tensor) -> None:
        self.total = local
        self._work = dist.all_reduce(local, async_op=True) if t.ctx.world_size > 1 else None

    def rescale_gradients(self, model: nn.Module, *, samples: int) -> torch.Tensor:
        """Multiply every gradient by ``samples / global count`` (0 for no units:
        the gradients are sums over nothing then); returns the global count."""
        if self._work is not None:
            self._work.wait()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        total = self.total.float()
        factor = torch.where(total > 0, samples / total.clamp_min(1e-30), 0.0)
        if grads:
            torch._foreach_mul_(grads, factor)
        return self.total


class StepLoss(NamedTuple):
    loss_sum: torch.Tensor  # this rank's summed loss (detached)
    local_count: Any  # this rank's units: its samples, or a tensor of its counted units
    global_count: Any  # every rank's units: the global batch size, or a tensor


def optimizer_step(t: Trainer) -> None:
    if t.cfg.optimizer.grad_clip > 0:
        t.precision.unscale_(t.optimizer)  # clip the true gradients, not fp16-scaled ones
        # Gradients are already identical on every rank, so is their norm.
        clip_grad_norm(t.model, t.cfg.optimizer.grad_clip)
    t.precision.step(t.optimizer)
    t.scheduler.step()
    t.optimizer.zero_grad(set_to_none=True)


def train_step(
    t: Trainer,
    batch: list[int],
    shard: list[int],
    *,
    before_sync: Callable[[torch.Tensor, Any], None],
) -> StepLoss:
    """Forward and backward of one world-size-invariant step (gradients all-reduced
    and normalised); returns this rank's summed loss and the counts. The
    optimizer step is the caller's.

    ``before_sync(loss_sum, count)`` runs after the last forward, before the
    backward whose gradient all-reduce (started bucket by bucket as backward
    goes) lets any rank finish the step.
    """
    scale = t.ctx.world_size / len(batch)
    chunks, weight = step_chunks(batch, shard, t.cfg.training.micro_batch_size)
    counted = t.loss.counted
    loss_sum: torch.Tensor | None = None
    count: Any = 0
    pending: GlobalCount | None = None
    for i, chunk in enumerate(chunks):
        # Gradients are all-reduced once per step, in the last backward.
        sync = i == len(chunks) - 1
        with contextlib.nullcontext() if sync else t.ddp.no_sync():
            total, units = forward(t, chunk)
            if weight != 1.0:
                total, units = total * weight, units * 0
            # One sum serves the record and the backward: each extra autograd
            # node costs µs on a millisecond step.
            loss_sum = total.detach() if loss_sum is None else loss_sum + total.detach()
            count = _add_units(count, units, device=t.ctx.device) if counted else count + units
            if sync:
                before_sync(loss_sum, count)
                if counted:
                    pending = GlobalCount(t, count.clone())
            t.precision.backward(total * scale)
    assert loss_sum is not None  # chunks is never empty
    if pending is None:
        return StepLoss(loss_sum, local_count=count, global_count=len(batch))
    global_count = pending.rescale_gradients(t.model, samples=len(batch))
    return StepLoss(loss_sum, local_count=count, global_count=global_count)


def _add_units(count: Any, units: Any, *, device: torch.device) -> torch.Tensor:
    """A running count as a float64 tensor on the device: exact for any token
    count, and summed without waiting for the device."""
    units = torch.as_tensor(units, device=device).to(torch.float64).reshape(())
    return units if isinstance(count, int) else count + units


class Agreement:
    """The small all-reduce of a check step, started early and awaited late:
    every rank's loss sum, the preemption flag, rank 0's proposal of the
    steps until the next check, rank 0's vote to admit joiners, and how many
    members have the next group formed (or failed to form it)."""

    def __init__(self, t: Trainer, loss_sum: torch.Tensor) -> None:
        preemption = t.guards.preemption
        # Each member's next group (training/next_group.py): formed, or failed to.
        # While one forms, every step checks: the joiners wait for the switch.
        forming = t.inprocess.forming if t.inprocess is not None else None
        ready, failed = (forming.ready, forming.failed) if forming is not None else (False, False)
        proposal = preemption.propose_interval(t.step) if t.ctx.rank == 0 else 0
        if forming is not None and proposal:
            proposal = 1
        # Rank 0's vote that a node waits to join (training/admission.py).
        joins = t.inprocess is not None and t.ctx.rank == 0 and t.inprocess.join_wanted()
        values = (preemption.flag(), float(proposal), float(joins), float(ready), float(failed))
        self._totals = torch.cat((loss_sum.reshape(1), loss_sum.new_tensor(values)))
        self._work = dist.all_reduce(self._totals, async_op=True)

    def wait(self, t: Trainer, *, units: Any) -> tuple[float, bool]:
        """The global batch's mean loss per unit, and whether any rank was
        signalled to stop. ``units``: the step's global count."""
        self._work.wait()
        loss_total, signalled, interval, joins, ready, failed = self._totals.tolist()
        t.guards.preemption.checked(t.step, interval=round(interval))
        if t.inprocess is not None:
            t.inprocess.admit_due = joins > 0
            if failed > 0:
                t.inprocess.forming_verdict = "failed"
            elif round(ready) == t.ctx.world_size:
                t.inprocess.forming_verdict = "ready"
        units = float(units)
        return (loss_total / units if units > 0 else 0.0), signalled > 0


def current_lr(t: Trainer) -> float:
    return float(t.optimizer.param_groups[0]["lr"])


def record_step(
    t: Trainer, *, step: int, epoch: int, shard: list[int], loss_sum: torch.Tensor, count: Any
) -> None:
    """This rank's audit record of ``step``, written before its gradient all-reduce.

    No rank can complete the step, let alone snapshot it, before every rank
    has entered that all-reduce, so every state that holds the step has each
    rank's record of it; a record of a step that then fails is superseded by
    the restart's. The record's loss is this rank's own mean per unit over its
    ``count`` units (``item()`` waits for the forward on CUDA; the audit is on
    in test and benchmark runs).
    """
    if t.audit is not None:
        units = float(count)
        loss = loss_sum.item() / units if shard and units > 0 else 0.0
        t.audit.step(step=step, epoch=epoch, indices=shard, loss=loss)


def log_due(t: Trainer, stats: StepStats) -> bool:
    """A log line needs the global loss, which the ranks agree on only at
    check steps: the first check at or after each ``log_every_steps`` steps,
    so about every ``max(log_every_steps steps, 0.25 s)``, and logging adds no
    collective of its own."""
    if stats.loss is None:
        return False
    return stats.step == 1 or stats.step - t.last_logged_step >= t.cfg.logging.log_every_steps


def report_step(t: Trainer, stats: StepStats, *, local_samples: int) -> None:
    """After each step: progress marker, metrics, periodic log line."""
    t.progress.record(stats.step)
    t.metrics.step_completed(
        step=stats.step, samples=local_samples, seconds=stats.seconds, loss=stats.loss,
        world_size=t.ctx.world_size,
    )  # fmt: skip
    if log_due(t, stats):
        t.last_logged_step = stats.step
        rate = stats.samples / stats.seconds
        t.tracking.log(stats.step, {"train/loss": stats.loss, "train/lr": stats.lr,
                                    "train/samples_per_second": rate})  # fmt: skip
        log.info(
            "step", step=stats.step, epoch=stats.epoch, loss=round(stats.loss or 0.0, 5),
            lr=stats.lr, world_size=t.ctx.world_size, step_seconds=round(stats.seconds, 4),
            samples_per_second=round(stats.samples / stats.seconds, 1),
        )  # fmt: skip


@dataclass(frozen=True)
class StepStart:
    """What a step changes before its optimizer step, taken as it starts (about
    4 µs): laid over the state at a failure inside the step, it gives the
    state of the last completed step (``snapshot_on_failure``).

    Python's and NumPy's generators are not part of it (35 µs a step): the
    step draws only from torch's, so at a failure they are still as the
    step found them, unless user code drew from them inside the step. Nor
    are model buffers that the forward updates (BatchNorm's running
    statistics), which keep the failed step's batch.
    """

    step: int
    sampler: dict[str, int]
    torch_rng: dict[str, Any]
    comm_hook: dict[str, Any]

    @classmethod
    def capture(cls, t: Trainer) -> StepStart:
        return cls(
            step=t.step, sampler=t.sampler.state_dict(), torch_rng=capture_torch_rng_state(),
            comm_hook=t.comm_hook.state_dict(),
        )  # fmt: skip

    def rewind(self, state: dict[str, Any]) -> dict[str, Any]:
        rng = {**state["rng"], **self.torch_rng}
        return {
            **state, "step": self.step, "epoch": self.sampler["epoch"], "sampler": self.sampler,
            "rng": rng, "comm_hook": self.comm_hook,
        }  # fmt: skip


@contextlib.contextmanager
def snapshot_on_failure(
    t: Trainer, *, step: int, state: Callable[[], dict[str, Any]]
) -> Iterator[None]:
    """A failure inside (a peer's death breaking a collective) first snapshots
    ``state()``, the state of completed step ``step``, then propagates."""
    try:
        yield
    except Exception:
        # A healing joiner's weights are no step's until the members' arrive (heal.py).
        stateless = t.inprocess is not None and t.inprocess.stateless
        if t.snapshots is not None and not stateless:
            t.snapshots.rescue(step, state)
        raise


@dataclass(frozen=True)
class StepOutcome:
    signalled: bool | None  # some rank was asked to stop; None: no check after this step
    epoch_ended: bool


def run_step(t: Trainer, *, state: Callable[[], dict[str, Any]]) -> StepOutcome:
    """One optimizer step with its records and its snapshot.

    The ranks agree (loss, preemption flag) only at check steps and step 1, in
    an all-reduce that runs while this rank takes the optimizer step and
    writes the snapshot; every other step has DDP's gradient all-reduce only.
    A failure in either collective snapshots the last completed step first.
    """
    started, epoch, lr = time.perf_counter(), t.sampler.epoch, current_lr(t)
    rescues = t.snapshots is not None and t.snapshots.rescues
    start = StepStart.capture(t) if rescues or t.inprocess is not None else None
    # In-process recovery rewinds a failed step from these (training/inprocess.py).
    t.step_start, t.step_started_at = start, started
    batch = t.sampler.next_global_batch()
    holders = heal.data_ranks(t)  # the members alone while joiners heal
    shard = ElasticSampler.shard(batch, t.ctx.rank, holders) if t.ctx.rank < holders else []

    def record(loss_sum: torch.Tensor, count: Any) -> None:
        record_step(t, step=t.step + 1, epoch=epoch, shard=shard, loss_sum=loss_sum, count=count)

    rewound = (lambda: start.rewind(state())) if start is not None else state
    transfer = t.heal
    with snapshot_on_failure(t, step=t.step, state=rewound):
        losses = train_step(t, batch, shard, before_sync=record)
        if transfer is not None:  # a joiner's weights of the step before, under its gradients
            transfer.receive(t)
    t.step_start = None  # every rank's gradients are in: the optimizer step follows
    t.step += 1
    due = t.step == 1 or t.guards.preemption.check_due(t.step)
    agreement = Agreement(t, losses.loss_sum) if due else None
    optimizer_step(t)
    epoch_ended = t.sampler.epoch_finished()
    if epoch_ended:
        t.sampler.start_next_epoch()
    if t.snapshots is not None:
        t.snapshots.after_step(t.step, state)
    loss, signalled = None, None
    if agreement is not None:
        with snapshot_on_failure(t, step=t.step, state=state):
            loss, signalled = agreement.wait(t, units=losses.global_count)
    stats = StepStats(
        step=t.step, epoch=epoch, loss=loss, samples=len(batch),
        seconds=time.perf_counter() - started, lr=lr,
    )  # fmt: skip
    report_step(t, stats, local_samples=len(shard))
    if transfer is not None:
        t.heal = None
        transfer.finish(t)  # the holder's sends, off the step
    return StepOutcome(signalled=signalled, epoch_ended=epoch_ended)
