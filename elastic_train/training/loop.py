"""Build the trainer from a config, then run the loop.

:func:`build` does all the setup (data, model, optimizer, schedule, sampler,
checkpoints, restore, DDP); :func:`train` is the loop and reads top to bottom;
one step of it is :func:`elastic_train.training.step.run_step`.

World-size invariance: every step takes the next ``global_batch_size``
samples of the epoch's permutation, whatever the world size. Each rank sums the
per-sample losses of its shard and scales the sum by ``world_size / B`` (B: the
samples in this global batch, short at the end of an epoch). DDP averages the
gradients over ranks, i.e. divides their sum by ``world_size``, so the gradient
every rank applies is ``sum of all per-sample gradients / B``: the mean over
the global batch, the same as one worker computes, up to summation order.
"""

from __future__ import annotations

import contextlib
import gc
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import LRScheduler

from elastic_train.audit import AuditWriter, write_result
from elastic_train.config.job import JobConfig
from elastic_train.errors import CheckpointWriteError
from elastic_train.log import get_logger
from elastic_train.metrics import WorkerMetrics
from elastic_train.state.checkpoint import CheckpointManager
from elastic_train.training import admission, heal
from elastic_train.training.batches import BatchLoader
from elastic_train.training.comm_hooks import CommHook
from elastic_train.training.departure import after_preemption
from elastic_train.training.distributed import DistContext, broadcast_attempt_id
from elastic_train.training.evaluate import EvalResult, evaluate
from elastic_train.training.exit_barrier import release_after_shrink
from elastic_train.training.fsdp import (
    attach_snapshots,
    consolidate,
    node_snapshots,
    open_checkpoints,
    shard_model,
    wrap_for_training,
)
from elastic_train.training.guards import LoopGuards, build_eval_set
from elastic_train.training.heal import Transfer
from elastic_train.training.inprocess import (
    InProcess,
    LoopHooks,
    collective_or_recover,
    run_step_or_recover,
)
from elastic_train.training.losses import TrainingLoss
from elastic_train.training.optim import (
    global_batch_size,
    restore_learning_rates,
)
from elastic_train.training.parts import Prepared, TrainingParts, prepare
from elastic_train.training.precision import Precision
from elastic_train.training.preemption import StopReason
from elastic_train.training.progress_marker import ProgressMarker
from elastic_train.training.rng import capture_rng_state, restore_rng_state
from elastic_train.training.sampler import ElasticSampler
from elastic_train.training.start_finish import (
    compiled,
    export_final,
    restore_or_resume_from,
)
from elastic_train.training.state_sync import NodeSnapshots
from elastic_train.training.step import StepStart
from elastic_train.training.tracking import Tracking, open_tracking
from elastic_train.workload.datasets import DataBundle

log = get_logger(__name__)

#: Evaluation chunk for the final loss: fixed, so the number is the same in every run.
_EVAL_CHUNK = 64


@dataclass
class Trainer:
    """Everything the loop touches. ``model`` is the unwrapped module that checkpoints see."""

    cfg: JobConfig
    ctx: DistContext
    data: DataBundle
    model: nn.Module
    loss: TrainingLoss
    batches: BatchLoader  # micro-batches by index, collated, on the device
    optimizer: torch.optim.Optimizer
    scheduler: LRScheduler
    sampler: ElasticSampler
    checkpoint: CheckpointManager | None
    audit: AuditWriter | None
    attempt: str
    total_steps: int
    precision: Precision
    comm_hook: CommHook
    guards: LoopGuards
    progress: ProgressMarker
    eval_set: Any
    step: int = 0
    last_saved_step: int = 0
    last_logged_step: int = 0
    last_save_time: float = field(default_factory=time.monotonic)
    metrics: WorkerMetrics = field(default_factory=WorkerMetrics.from_env)
    snapshots: NodeSnapshots | None = None
    tracking: Tracking = field(default_factory=lambda: Tracking([], watermark_dir=""))
    fingerprint: str = ""
    #: In-process recovery (elastic.recovery = "inprocess"), set by train().
    inprocess: InProcess | None = None
    #: The step in flight, set by run_step until its gradients are all-reduced.
    step_start: StepStart | None = None
    step_started_at: float = 0.0
    #: A joiner's state in transit during the step after an admission (training/heal.py).
    heal: Transfer | None = None
    #: Set by build() after the restore.
    ddp: DistributedDataParallel = field(init=False)


@dataclass(frozen=True)
class TrainResult:
    final_step: int
    epoch: int
    final_loss: float | None  # measured on rank 0 only
    stopped: str | None = None  # a StopReason when preempted before the end


# -- setup ----------------------------------------------------------------------


def wrap_model(
    model: nn.Module, ctx: DistContext, *, states_equal: bool = False
) -> DistributedDataParallel:
    """The DDP wrapper (fsdp2: ``fsdp.ShardedModel``); the place to register comm hooks.
    ``states_equal``: see :func:`~elastic_train.training.fsdp.wrap_for_training`."""
    return wrap_for_training(model, ctx, states_equal=states_equal)  # type: ignore[return-value]


def build(
    cfg: JobConfig,
    ctx: DistContext,
    parts: TrainingParts | None = None,
    *,
    prepared: Prepared | None = None,
    joining: bool = False,
) -> Trainer:
    """Set up the trainer and restore the latest state; ``prepared``: :func:`prepare`'s
    result for ``ctx.device`` (None: prepared here with ``parts``); ``joining``: an
    async join's worker (``training/admission.py``), which restores nothing."""
    p = prepared or prepare(cfg, ctx.device, parts)
    parts, data, loss, batches, precision = p.parts, p.data, p.loss, p.batches, p.precision
    batch = global_batch_size(cfg.training, ctx.world_size)
    steps = cfg.training.total_steps(dataset_len=len(data), batch_size=batch)
    model = shard_model(p.model, cfg.training, ctx)  # fsdp2; before the optimizer sees parameters
    optimizer = parts.optimizer(model)
    scheduler = parts.scheduler(optimizer, total=steps, world_size=ctx.world_size)
    fingerprint = parts.fingerprint(model, data)
    # A worker entering a running group (an async join) holds no state and writes
    # nothing until it is admitted: it gets the group's state, rank and writers then.
    checkpoint = None
    if not joining:
        checkpoint = open_checkpoints(
            cfg, ctx, fingerprint=fingerprint, model=model, optimizer=optimizer
        )
    attempt = broadcast_attempt_id(ctx)
    audit = None
    if cfg.logging.audit_dir and not joining:
        audit = AuditWriter(
            cfg.logging.audit_dir, attempt=attempt, rank=ctx.rank,
            world_size=ctx.world_size, node=ctx.env.node,
        )  # fmt: skip
    trainer = Trainer(
        cfg=cfg, ctx=ctx, data=data, model=model,
        loss=loss, batches=batches, optimizer=optimizer, scheduler=scheduler,
        sampler=ElasticSampler.for_data(data, global_batch_size=batch, seed=cfg.training.seed),
        checkpoint=checkpoint, audit=audit, attempt=attempt, total_steps=steps,
        precision=precision,
        comm_hook=CommHook(
            cfg.training.comm_hook, powersgd_rank=cfg.training.powersgd_rank,
            powersgd_start_iter=cfg.training.powersgd_start_iter,
        ),
        guards=LoopGuards(cfg, device=ctx.device), eval_set=build_eval_set(cfg, data),
        progress=ProgressMarker(cfg.checkpoint.dir, writer=ctx.is_main and not joining),
        snapshots=node_snapshots(cfg, ctx.env, fingerprint=fingerprint),
        tracking=open_tracking(cfg, is_main=ctx.is_main and not joining),
        fingerprint=fingerprint,
    )  # fmt: skip
    if not joining:
        restore(trainer)
    # Wrapped after the restore: DDP's constructor broadcasts rank 0's weights.
    trainer.ddp = trainer.comm_hook.register(wrap_model(compiled(model, cfg.training), ctx))
    return trainer


# -- state ----------------------------------------------------------------------


def state_dict(t: Trainer) -> dict[str, Any]:
    """Everything a resume at any world size needs; plain types only (weights_only)."""
    return {
        "model": t.model.state_dict(),
        "optimizer": t.optimizer.state_dict(),
        "scheduler": t.scheduler.state_dict(),
        "sampler": t.sampler.state_dict(),
        "step": t.step,
        "epoch": t.sampler.epoch,
        "rng": capture_rng_state(),
        "precision": t.precision.state_dict(),
        "comm_hook": t.comm_hook.state_dict(),
    }


def load_state_dict(t: Trainer, state: dict[str, Any]) -> None:
    load_progress(t, state)
    load_weights(t, state)


def load_progress(t: Trainer, state: dict[str, Any]) -> None:
    """Everything but the model and the optimizer (a healing joiner's first part)."""
    t.scheduler.load_state_dict(state["scheduler"])
    t.sampler.load_state_dict(state["sampler"])
    t.step = int(state["step"])
    restore_rng_state(state["rng"])
    t.precision.load_state_dict(state.get("precision", {}))
    t.comm_hook.load_state_dict(state.get("comm_hook", {}))


def load_weights(t: Trainer, state: dict[str, Any]) -> None:
    """The model and the optimizer; their gradients stay (a healing joiner's)."""
    t.model.load_state_dict(state["model"])
    t.optimizer.load_state_dict(state["optimizer"])
    # The optimizer came back with the LR of the old world size (per_worker mode).
    restore_learning_rates(t.optimizer, t.scheduler)


def restore(t: Trainer) -> None:
    """Load the newest state of any node's snapshot or the disk; record the (re)start."""
    restored = restore_or_resume_from(t.snapshots, t.checkpoint, cfg=t.cfg, device=t.ctx.device)
    saved_world_size = None
    if restored.state is not None:
        load_state_dict(t, restored.state)
    if restored.source == "disk":
        saved_world_size = (t.checkpoint.loaded_metadata or {}).get("world_size")  # type: ignore[union-attr]
    t.last_saved_step = t.step
    if restored.source == "snapshot" and t.checkpoint is not None and t.checkpoint.is_writer:
        # The step is only in /dev/shm (a node left without a disk save, or a
        # failure came between disk saves): the first save of the loop writes it.
        t.last_saved_step = -1 if (t.checkpoint.latest_step() or -1) < t.step else t.step
    lost_steps = max(0, t.progress.read() - t.step)
    t.metrics.resumed(restored_step=t.step, lost_steps=lost_steps)
    log.info(
        "resumed", restored_step=t.step, source=restored.source,
        lost_steps=lost_steps, world_size=t.ctx.world_size,
        saved_world_size=saved_world_size, epoch=t.sampler.epoch,
        samples_consumed=t.sampler.samples_consumed, attempt=t.attempt,
    )  # fmt: skip
    if t.audit is not None:
        t.audit.resume(restored_step=t.step, source=restored.source)


#: What an in-process re-form needs of the loop (training/inprocess.py).
def reopen_checkpoints(t: Trainer, ctx: DistContext) -> CheckpointManager | None:
    """The checkpoint manager of a re-formed group's rank 0, with the node's snapshots."""
    manager = open_checkpoints(
        t.cfg, ctx, fingerprint=t.fingerprint, model=t.model, optimizer=t.optimizer
    )
    attach_snapshots(ctx.env, t.snapshots)
    return manager


HOOKS = LoopHooks(
    state_dict=lambda t: state_dict(t),
    load_state_dict=lambda t, s: load_state_dict(t, s),
    load_progress=lambda t, s: load_progress(t, s),
    load_weights=lambda t, s: load_weights(t, s),
    # In process only, after roll_back has brought every member to one state.
    wrap=lambda t, ctx: t.comm_hook.register(
        wrap_model(compiled(t.model, t.cfg.training), ctx, states_equal=True)
    ),
    open_checkpoints=reopen_checkpoints,
)


def save_checkpoint(t: Trainer, *, reason: str, blocking: bool = False) -> None:
    """Checkpoint the current step (rank 0 writes); a no-op if it is already saved."""
    if t.checkpoint is None or t.step == t.last_saved_step:
        return
    if t.checkpoint.is_writer:
        try:
            with t.guards.long_operation("checkpoint") if blocking else contextlib.nullcontext():
                t.checkpoint.save(t.step, state_dict(t), blocking=blocking)
        except CheckpointWriteError:
            pass  # logged and counted by the manager; the previous checkpoint is intact
        log.debug("checkpoint_requested", step=t.step, reason=reason)
        t.checkpoint.raise_if_failing(t.cfg.checkpoint.max_consecutive_failures)
    t.last_saved_step = t.step
    t.last_save_time = time.monotonic()


def snapshot_kept_by_a_staying_node(t: Trainer) -> bool:
    """At a preemption stop: whether a node that was not signalled now holds a
    snapshot of this step (a collective). Then the preempted node leaves
    without a disk save: the group resumes from that snapshot and writes the
    step to disk right after (:func:`restore`). Only when every node is going
    (the last node, or the whole job) does the stop wait for a disk save.

    A node signalled just after this check loses its snapshot with it; if
    all the others go the same way before the next disk save, the job
    resumes from the last checkpoint on disk (docs/checkpoints-and-snapshots.md).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return False
    kept = 0
    if t.snapshots is not None and t.guards.preemption.received is None:
        kept = int(t.snapshots.keep(t.step, lambda: state_dict(t), reason="preemption"))
    total = torch.tensor([kept], device=t.ctx.device)
    dist.all_reduce(total)
    return int(total.item()) > 0


def checkpoint_due(t: Trainer) -> bool:
    cfg = t.cfg.checkpoint
    by_steps = cfg.interval_steps > 0 and t.step % cfg.interval_steps == 0
    elapsed = time.monotonic() - t.last_save_time
    return by_steps or (cfg.interval_seconds > 0 and elapsed >= cfg.interval_seconds)


def finished(t: Trainer) -> bool:
    if t.cfg.training.steps > 0:
        return t.step >= t.cfg.training.steps
    return t.sampler.epoch >= t.cfg.training.epochs


def train(t: Trainer) -> TrainResult:
    """Run steps until the configured steps or epochs are done; checkpoint on the way."""
    log.info(
        "training_started", step=t.step, total_steps=t.total_steps,
        global_batch_size=t.sampler.global_batch_size, world_size=t.ctx.world_size,
    )  # fmt: skip
    t.ddp.train()
    t.guards.install()
    t.batches.start(t.sampler, step=t.step, rank=t.ctx.rank, world_size=t.ctx.world_size,
                    training=t.cfg.training)  # fmt: skip
    save_checkpoint(t, reason="restored_from_snapshot")  # a no-op unless restore() asked
    t.inprocess = admission.start(t, HOOKS)
    while not finished(t):
        outcome = run_step_or_recover(t, state=lambda: state_dict(t))
        if outcome.epoch_ended:
            save_checkpoint(t, reason="epoch_end")
        elif checkpoint_due(t):
            save_checkpoint(t, reason="interval")
        if t.cfg.eval.every_steps and t.step % t.cfg.eval.every_steps == 0:
            run_evaluation(t, reason="interval")
        stopped = t.guards.after_step(t.step, signalled=outcome.signalled)
        if stopped is not None and (result := stop(t, stopped)) is not None:
            return result
        # Last at the boundary: a joiner starts with the next step, so the members'
        # collectives of this one (a save, an evaluation) must be over, or they meet
        # the joiner's first step (a mismatch that gloo answers with an abort).
        admission.at_step_boundary(t, stopping=bool(outcome.signalled))
    heal.settle(t)  # a join admitted at the last boundary
    save_checkpoint(t, reason="final", blocking=True)
    if t.cfg.eval.at_end:
        run_evaluation(t, reason="end")
    with t.guards.long_operation("finish"):
        return finish(consolidate(t))


def stop(t: Trainer, stopped: StopReason) -> TrainResult | None:
    """The end of training at a stop the ranks agreed on; None when this rank stays
    (in process, the group goes on without the nodes that leave)."""
    departure = after_preemption(t)
    if departure == "stay":
        return None
    if departure == "stop" and not snapshot_kept_by_a_staying_node(t):
        save_checkpoint(t, reason=stopped.value, blocking=True)
    if t.checkpoint is not None:
        t.checkpoint.flush()  # the step may have been saved asynchronously just now
    stopped = t.guards.settle(stopped)
    return TrainResult(t.step, t.sampler.epoch, None, stopped=stopped.value)


def run_evaluation(t: Trainer, *, reason: str) -> None:
    """Evaluate every sample of the evaluation set once across the ranks (a collective;
    in process, a peer's failure during it re-forms the group and evaluates again)."""

    def run() -> EvalResult:  # reads t.ctx at each try: a re-form changes it
        return evaluate(
            t.model, t.eval_set, loss_fn=t.loss.fn, batch_size=t.cfg.eval.batch_size,
            rank=t.ctx.rank, world_size=t.ctx.world_size, device=t.ctx.device,
            autocast=t.precision.autocast, loss_form=t.loss.form,
            collate_fn=t.batches.collate_fn,
        )  # fmt: skip

    with t.guards.long_operation("evaluation"):
        result = collective_or_recover(t, run, what="evaluation")
    t.metrics.evaluated(metrics={"loss": result.loss, "accuracy": result.accuracy})
    t.tracking.log(t.step, {"eval/loss": result.loss, "eval/accuracy": result.accuracy})
    log.info("evaluation", step=t.step, reason=reason, **result.as_dict())


def final_loss(t: Trainer) -> float:
    """Mean loss per unit of the unwrapped model over the first samples; the same in every run."""
    count = min(t.cfg.training.final_loss_samples, len(t.data))
    t.model.eval()
    total, units = 0.0, 0.0
    with torch.no_grad():
        for start in range(0, count, _EVAL_CHUNK):
            indices = list(range(start, min(start + _EVAL_CHUNK, count)))
            loss_sum, n = t.loss.micro_batch(t.model, t.batches(indices), len(indices))
            total, units = total + loss_sum.item(), units + float(n)
    t.model.train()
    return total / units if units > 0 else 0.0


def finish(t: Trainer) -> TrainResult:
    """Rank 0 measures the final loss and writes the result files the runner reads."""
    if not t.ctx.is_main:
        return TrainResult(final_step=t.step, epoch=t.sampler.epoch, final_loss=None)
    loss = final_loss(t)
    result = TrainResult(final_step=t.step, epoch=t.sampler.epoch, final_loss=loss)
    log.info("training_finished", final_step=t.step, final_loss=round(loss, 6))
    export_final(t)  # checkpoint.export_dir
    if t.cfg.logging.audit_dir:
        summary = {
            "final_step": t.step, "final_loss": loss, "epoch": t.sampler.epoch,
            "world_size": t.ctx.world_size, "attempt": t.attempt, "dataset_len": len(t.data),
        }  # fmt: skip
        write_result(t.cfg.logging.audit_dir, result=summary, params=t.model.state_dict())
    if t.ctx.is_main and t.inprocess is not None:  # torchrun's exit barrier after a shrink
        release_after_shrink(t.inprocess.membership)
    return result


def close(t: Trainer, *, release_group: bool = True) -> None:
    """Flush an in-flight checkpoint, close files, free DDP; also after a failed step.

    ``release_group=False`` leaves DDP to a process that is about to exit anyway.
    """
    t.guards.close()
    t.metrics.close()
    if t.inprocess is not None:
        t.inprocess.close()
    if t.checkpoint is not None:
        t.checkpoint.close()
    if t.audit is not None:
        t.audit.close()
    t.progress.close()
    t.batches.close()  # DataLoader workers
    t.tracking.close()
    if t.snapshots is not None:
        t.snapshots.close(completed=finished(t))  # a completed run's snapshot is removed
    # DDP's C++ reducer holds the process group. Were it the last holder, the
    # group's destructor would join gloo's threads with the GIL held, which
    # deadlocks when one of them needs the GIL to free a finished work
    # (pytorch#56297; seen here). Free it while the group is still registered.
    if release_group:
        t.__dict__.pop("ddp", None)
        gc.collect()
