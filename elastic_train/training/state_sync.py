"""Per-step snapshots in the training loop, and where a (re)start resumes from.

``snapshot.py`` stores a state in ``/dev/shm`` and ``restore.py`` agrees on
the newest one; this module decides the rest for the trainer: which worker
writes (LOCAL_RANK 0, one per node), under which directory (one per run and
node, since the nodes of ``elastic-train local`` share one ``/dev/shm``), how
often (:class:`SnapshotCadence`) and what happens when a snapshot cannot be
taken (it is logged, and the node relies on disk checkpoints from then on).

The loop calls :func:`open_snapshots` in ``build``, :func:`restore_state` in
``restore``, :meth:`NodeSnapshots.after_step` once per optimizer step,
:meth:`NodeSnapshots.rescue` when a step fails, and
:meth:`NodeSnapshots.close` at the end (removing the snapshot once the run is
complete).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from elastic_train import metrics
from elastic_train.config.job import ElasticConfig
from elastic_train.errors import SnapshotError
from elastic_train.log import get_logger
from elastic_train.state.checkpoint import CheckpointManager
from elastic_train.state.restore import Restored, restore_newest
from elastic_train.state.shm_names import SHM_ROOT, node_run_id
from elastic_train.state.snapshot import SnapshotStore
from elastic_train.training.distributed import WorkerEnv

log = get_logger(__name__)

#: Weight of the newest measurement in the running step and snapshot times.
_SMOOTHING = 0.2
#: Steps after a snapshot whose slowdown counts as part of its cost.
AFTERMATH = 2
#: K until a snapshot's cost is measured: leaves a step away from snapshots.
_FIRST_INTERVAL = 4


@dataclass
class SnapshotCadence:
    """When the next snapshot is due: at the first step of an attempt, then at
    multiples of ``every``, or (``every == 0``) of K, the smallest power of two
    that keeps snapshots within ``max_overhead`` of the training time.

    A snapshot costs more than its ``save()``: copying the state evicts the
    model from the caches, so the next steps run slower, and under DDP the
    other ranks wait for them. Its cost is therefore the save plus how much
    the ``AFTERMATH`` steps after it exceed the step time measured away from
    snapshots (``step_seconds``). Where K is at most ``AFTERMATH`` no step is
    away from a snapshot, and the last such measure stands; K starts at
    ``_FIRST_INTERVAL`` so that there is one.

    Each node measures its own K, but DDP makes every rank wait for the
    slowest at the next all-reduce, so snapshots at different steps on
    different nodes would cost the sum of them. Multiples of powers of two
    line them up: a node's snapshot steps are a subset of those of any node
    with a smaller K.
    """

    every: int
    max_overhead: float
    interval: int = _FIRST_INTERVAL
    last_step: int | None = None
    step_seconds: float | None = None  # smoothed, of steps away from snapshots
    snapshot_seconds: float | None = None  # smoothed, save and aftermath; not the first
    _snapshots: int = 0
    _pending: float | None = None  # the last snapshot's cost so far; None: not measured
    _save_seconds: float = 0.0  # the last snapshot's save

    def __post_init__(self) -> None:
        if self.every > 0:
            self.interval = self.every

    def due(self, step: int) -> bool:
        return self.last_step is None or (step % self.interval == 0 and step > self.last_step)

    def observe_step(self, step: int, seconds: float) -> None:
        """Step ``step`` took ``seconds``, its snapshot's save not included."""
        since = step - self.last_step if self.last_step is not None else AFTERMATH + 1
        if since > AFTERMATH:
            self.step_seconds = _smooth(self.step_seconds, seconds)
            return
        if self._pending is not None and self.step_seconds is not None:
            self._pending += seconds - self.step_seconds
        else:
            self._pending = None  # no step time to compare with yet
        if since == AFTERMATH:
            self._settle()

    def observe_snapshot(self, step: int, seconds: float) -> None:
        """Step ``step`` was snapshotted in ``seconds`` (the save alone)."""
        self._settle()  # a snapshot inside the last one's aftermath ends it early
        self.last_step = step
        self._snapshots += 1
        # The first one allocates the slot: not a measure of the steady state.
        self._pending = seconds if self._snapshots > 1 else None
        self._save_seconds = seconds

    def _settle(self) -> None:
        if self._pending is None:
            return
        # Noise can make the aftermath look faster than the steps away from
        # snapshots; the save itself is the floor.
        cost, self._pending = max(self._pending, self._save_seconds), None
        self.snapshot_seconds = _smooth(self.snapshot_seconds, cost)
        if self.every == 0 and self.step_seconds:
            budget = self.max_overhead * self.step_seconds
            needed = max(1, math.ceil(self.snapshot_seconds / budget))
            self.interval = 1 << (needed - 1).bit_length()


def _smooth(previous: float | None, value: float) -> float:
    return value if previous is None else previous + _SMOOTHING * (value - previous)


def snapshot_run_id(env: WorkerEnv) -> str:
    """Unique per run and node: nodes of one machine share ``/dev/shm``."""
    return node_run_id(env.run_id, env.node)


class NodeSnapshots:
    """This node's snapshot store, as the loop uses it; only LOCAL_RANK 0 writes."""

    def __init__(self, store: SnapshotStore, cadence: SnapshotCadence, *, on_failure: bool) -> None:
        self.store = store
        self.cadence = cadence
        self.enabled = store.is_writer
        self.on_failure = on_failure
        self._last_call: float | None = None
        self._last_cost = 0.0

    @property
    def rescues(self) -> bool:
        """Whether a failed step is snapshotted (:meth:`rescue`) on this rank."""
        return self.enabled and self.on_failure

    def after_step(self, step: int, state: Callable[[], dict[str, Any]]) -> None:
        """Snapshot ``state()`` of the step just completed when one is due.

        Every rank wrote its audit record of the step before the step's
        gradient all-reduce, which this rank has completed, so the snapshot is
        published at once (``step.record_step``).
        """
        if not self.enabled:
            return
        now, interval = time.perf_counter(), self.cadence.interval
        if self._last_call is not None:
            self.cadence.observe_step(step, now - self._last_call - self._last_cost)
        self._last_call, self._last_cost = now, 0.0
        if self.cadence.due(step):
            try:
                self.store.save(step, state())
            except SnapshotError as exc:
                self._disable(step, exc)
                return
            self._last_cost = time.perf_counter() - now
            self.cadence.observe_snapshot(step, self._last_cost)
        if self.cadence.interval != interval:
            log.debug(
                "snapshot_interval", step=step, interval=self.cadence.interval,
                snapshot_ms=round(1000 * (self.cadence.snapshot_seconds or 0), 3),
                step_ms=round(1000 * (self.cadence.step_seconds or 0), 3),
            )  # fmt: skip

    def rescue(self, step: int, state: Callable[[], dict[str, Any]]) -> None:
        """After a step failed: snapshot ``state()``, completed step ``step``.
        Best effort: the failure that brought us here is what the worker
        reports, so an error here is only logged."""
        if self.rescues:
            self.keep(step, state, reason="failure")

    def keep(self, step: int, state: Callable[[], dict[str, Any]], *, reason: str) -> bool:
        """Make sure this node's snapshot holds ``step``; whether it does."""
        if not self.enabled:
            return False
        if step <= (self.cadence.last_step or 0):
            return step == self.cadence.last_step
        started = time.perf_counter()
        try:
            self.store.save(step, state())
        except Exception as exc:  # a CUDA or NCCL error may have left the state unusable
            log.error("snapshot_keep_failed", step=step, reason=reason, error=str(exc))
            return False
        self.cadence.last_step = step
        seconds = round(time.perf_counter() - started, 4)
        log.warning("snapshot_kept", step=step, reason=reason, seconds=seconds)
        return True

    def hold(self, step: int, state: dict[str, Any]) -> bool:
        """Whether the snapshot now holds ``step``, saving ``state`` when it does not
        yet: for a disk checkpoint that the node agent writes from the snapshot."""
        if not self.enabled:
            return False
        if step == self.cadence.last_step:
            return True  # the cadence took it already: free
        started = time.perf_counter()
        try:
            self.store.save(step, state)
        except SnapshotError as exc:
            self._disable(step, exc)
            return False
        # Counted like the cadence's own: the next due snapshot and its cost
        # measure see it, so the adaptive K stays within its budget.
        self._last_cost += time.perf_counter() - started
        self.cadence.observe_snapshot(step, time.perf_counter() - started)
        return True

    def _disable(self, step: int, exc: SnapshotError) -> None:
        self.enabled = False
        log.error("snapshot_disabled", step=step, error=str(exc), fallback="disk checkpoints")

    def close(self, *, completed: bool) -> None:
        """Release the store; a completed run's snapshot is removed (the writer does it)."""
        if completed and self.store.is_writer:
            self.store.remove()
        else:
            self.store.close()


def open_snapshots(
    cfg: ElasticConfig, env: WorkerEnv, *, fingerprint: str, root: str | Path = SHM_ROOT
) -> NodeSnapshots | None:
    """This node's snapshots, or None: turned off, no run id, or the store cannot open.

    Without a run id from the launcher (``python main.py``, or workers started
    by hand) two unrelated runs of one config would share a directory and one
    could resume the other's state; such a restart is a whole-job restart
    anyway, which disk checkpoints serve.
    """
    if not cfg.snapshot:
        return None
    if env.run_id == WorkerEnv.run_id:
        log.info("snapshot_off", reason="no run id from the launcher (TORCHELASTIC_RUN_ID)")
        return None
    max_bytes = int(cfg.snapshot_max_mib * 2**20) or None
    try:
        store = SnapshotStore(
            snapshot_run_id(env), fingerprint=fingerprint, root=root, max_bytes=max_bytes,
            is_writer=env.local_rank == 0,
        )  # fmt: skip
    except SnapshotError as exc:
        log.error("snapshot_disabled", error=str(exc), fallback="disk checkpoints")
        return None
    cadence = SnapshotCadence(cfg.snapshot_every_steps, cfg.snapshot_max_overhead)
    return NodeSnapshots(store, cadence, on_failure=cfg.snapshot_on_failure)


def restore_state(
    snapshots: NodeSnapshots | None,
    checkpoint: CheckpointManager | None,
    *,
    device: torch.device,
) -> Restored:
    """The newest state of any node's snapshot and the disk (a collective on every rank)."""
    started = time.perf_counter()
    restored = restore_newest(
        snapshot=snapshots.store if snapshots is not None else None,
        checkpoint=checkpoint, group=None, map_location=device,
    )  # fmt: skip
    metrics.state_restored(source=restored.source, seconds=time.perf_counter() - started)
    return restored
