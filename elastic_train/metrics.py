"""Prometheus metrics of elastic_train, in prometheus-client's multiprocess mode.

Every process of a node (the torchrun agent and its workers) writes its values
to memory-mapped files in one per-run directory that the agent creates
(:mod:`elastic_train.agent.node_agent`); the agent serves them all from one endpoint.
Files of dead workers stay, so counters and histograms keep counting across
worker restarts; gauges pick a ``multiprocess_mode`` that says how values of
several processes, dead or alive, combine:

* ``mostrecent`` for values the job has one of (step, loss, world size, the
  last good checkpoint): the latest write wins, even if its writer is gone,
  so the value survives the gap while workers restart;
* ``livesum`` for per-process resources: only processes that are alive count
  (the agent calls ``mark_process_dead`` for the others before each scrape).

Job-level counts (steps, lost steps) are counted by global rank 0 only, so they
are not multiplied by the world size; samples are counted by every rank (each
its own shard), so their sum is the global number of samples.

Without ``PROMETHEUS_MULTIPROC_DIR`` (tests, a worker run without torchrun) the
same calls update ordinary in-process metrics.
"""

from __future__ import annotations

import math
import os
import socket
import sys
import threading
import time
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from functools import cache
from pathlib import Path

import psutil
from prometheus_client import Counter, Gauge, Histogram, values
from prometheus_client.metrics import MetricWrapperBase

__all__ = [
    "RECOVERY_STARTED_AT_ENV",
    "ResourceSampler",
    "WorkerMetrics",
    "checkpoint_blocked",
    "checkpoint_failed",
    "checkpoint_loaded",
    "checkpoint_saved",
    "enable_multiprocess",
    "etcd_lease_renewal_failed",
    "etcd_request",
    "etcd_timer",
    "node_name",
    "state_restored",
]

#: Set by the agent for the workers it starts after a re-rendezvous: the unix
#: time at which it began recovering, so the first step measures recovery.
RECOVERY_STARTED_AT_ENV = "ELASTIC_TRAIN_RECOVERY_STARTED_AT"

_NODE = ("node",)
_FAST = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_SLOW = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)

# Training (workers).
GLOBAL_STEP = Gauge(
    "elastic_train_global_step",
    "Completed optimizer steps of the job.",
    _NODE,
    multiprocess_mode="mostrecent",
)
STEPS = Counter("elastic_train_steps", "Optimizer steps completed (rank 0 counts).", _NODE)
SAMPLES = Counter(
    "elastic_train_samples", "Training samples processed, redone work included.", _NODE
)
STEP_SECONDS = Histogram(
    "elastic_train_step_duration_seconds", "Duration of one optimizer step.", _NODE, buckets=_FAST
)
LOSS = Gauge(
    "elastic_train_loss", "Training loss of the last step.", _NODE, multiprocess_mode="mostrecent"
)
EVAL = Gauge(
    "elastic_train_eval_metric",
    "Latest evaluation result, by metric name.",
    ("node", "metric"),
    multiprocess_mode="mostrecent",
)
WORLD_SIZE = Gauge(
    "elastic_train_world_size",
    "Number of workers in the job (WORLD_SIZE); 0 while this node is between rounds.",
    _NODE,
    multiprocess_mode="mostrecent",
)
LAST_STEP_TIME = Gauge(
    "elastic_train_last_step_timestamp_seconds",
    "Unix time at which the last optimizer step completed.",
    _NODE,
    multiprocess_mode="mostrecent",
)

# Elasticity (agent and workers).
RESTARTS = Counter(
    "elastic_train_restarts", "Restarts of this node's worker group (re-rendezvous).", _NODE
)
REGROUPS = Counter(
    "elastic_train_inprocess_regroups",
    "Process groups this node re-formed in place, without a restart (in-process recovery): "
    "cause=failure after a peer's failure, join to admit a node, preemption without a "
    "preempted one.",
    ("node", "cause"),
)
RDZV_ROUNDS = Counter(
    "elastic_train_rendezvous_rounds", "Rendezvous rounds this node completed.", _NODE
)
RDZV_SECONDS = Histogram(
    "elastic_train_rendezvous_duration_seconds",
    "Time spent in one rendezvous round.",
    _NODE,
    buckets=_SLOW,
)
NODES = Gauge(
    "elastic_train_nodes",
    "Nodes in this node's current rendezvous round, or in-process group; 0 between rounds.",
    _NODE,
    multiprocess_mode="mostrecent",
)
MIN_NODES = Gauge(
    "elastic_train_min_nodes",
    "Configured minimum number of nodes (--nnodes MIN:MAX).",
    _NODE,
    multiprocess_mode="mostrecent",
)
MAX_NODES = Gauge(
    "elastic_train_max_nodes",
    "Configured maximum number of nodes (--nnodes MIN:MAX).",
    _NODE,
    multiprocess_mode="mostrecent",
)
RECOVERY_SECONDS = Histogram(
    "elastic_train_recovery_seconds",
    "From the start of a recovery (the agent's re-rendezvous, or an in-process re-form) "
    "to the first step after it.",
    _NODE,
    buckets=_SLOW,
)
LOST_STEPS = Counter(
    "elastic_train_lost_steps", "Steps redone after a restore (rank 0 counts).", _NODE
)
ETCD_SECONDS = Histogram(
    "elastic_train_etcd_request_duration_seconds",
    "Duration of etcd requests, failed ones included.",
    ("node", "op"),
    buckets=_FAST,
)
ETCD_ERRORS = Counter("elastic_train_etcd_request_errors", "Failed etcd requests.", ("node", "op"))
ETCD_LEASE_RENEWAL_FAILURES = Counter(
    "elastic_train_etcd_lease_renewal_failures",
    "Background lease renewals that failed (the keys expire if none succeeds within the ttl).",
    ("node", "op"),
)

# Checkpoints (the writer rank).
CKPT_BLOCKING = Histogram(
    "elastic_train_checkpoint_blocking_seconds",
    "Time the training loop was blocked by a checkpoint save.",
    _NODE,
    buckets=_FAST,
)
CKPT_SAVE = Histogram(
    "elastic_train_checkpoint_save_seconds",
    "Total time of a checkpoint save, background write included.",
    _NODE,
    buckets=_SLOW,
)
CKPT_LOAD = Histogram(
    "elastic_train_checkpoint_load_seconds", "Time to load a checkpoint.", _NODE, buckets=_SLOW
)
RESTORE_SECONDS = Histogram(
    "elastic_train_restore_seconds",
    "Time to restore the training state at a (re)start, by where it came from.",
    ("node", "source"),
    buckets=_SLOW,
)
CKPT_BYTES = Counter(
    "elastic_train_checkpoint_written_bytes", "Bytes of checkpoints written.", _NODE
)
CKPT_FAILURES = Counter("elastic_train_checkpoint_failures", "Checkpoint saves that failed.", _NODE)
CKPT_LAST_STEP = Gauge(
    "elastic_train_checkpoint_last_good_step",
    "Step of the newest complete checkpoint.",
    _NODE,
    multiprocess_mode="mostrecent",
)
CKPT_LAST_TIME = Gauge(
    "elastic_train_checkpoint_last_good_timestamp_seconds",
    "Unix time at which the newest complete checkpoint was written.",
    _NODE,
    multiprocess_mode="mostrecent",
)

# Resources (every worker process).
_PROC = ("node", "local_rank")
RSS = Gauge(
    "elastic_train_worker_resident_memory_bytes",
    "Resident memory of the worker process.",
    _PROC,
    multiprocess_mode="livesum",
)
CPU = Counter("elastic_train_worker_cpu_seconds", "CPU time of the worker processes.", _PROC)
FDS = Gauge(
    "elastic_train_worker_open_fds",
    "Open file descriptors of the worker process.",
    _PROC,
    multiprocess_mode="livesum",
)
GPU_ALLOCATED = Gauge(
    "elastic_train_gpu_memory_allocated_bytes",
    "GPU memory allocated by tensors (CUDA only).",
    _PROC,
    multiprocess_mode="livesum",
)
GPU_RESERVED = Gauge(
    "elastic_train_gpu_memory_reserved_bytes",
    "GPU memory reserved by the caching allocator (CUDA only).",
    _PROC,
    multiprocess_mode="livesum",
)

_ALL: tuple[MetricWrapperBase, ...] = tuple(
    value for value in globals().values() if isinstance(value, MetricWrapperBase)
)


#: The node name the runner and the manifests set (docs/DESIGN.md, audit protocol).
NODE_ENV = "ELASTIC_TRAIN_NODE"


def node_name_from(environ: Mapping[str, str]) -> str:
    """The node's name: ``ELASTIC_TRAIN_NODE`` (set by the runner and manifests), else the host."""
    return environ.get(NODE_ENV) or socket.gethostname()


@cache
def node_name() -> str:
    """This process's node name (:func:`node_name_from` its environment, read once)."""
    return node_name_from(os.environ)


def enable_multiprocess(directory: Path) -> None:
    """Write this process's metrics to ``directory`` and export it to child processes.

    prometheus-client picks in-memory or file-backed values when it is
    imported; the agent imports it (through the etcd client) long before it
    knows its directory, so switch here and drop the in-memory children made
    so far (a few etcd requests at start-up), which no collector would see.
    """
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(directory)
    values.ValueClass = values.MultiProcessValue()
    with warnings.catch_warnings():
        # It warns that clearing leaves values in the files: there are none yet.
        warnings.simplefilter("ignore", UserWarning)
        for metric in _ALL:
            metric.clear()


def etcd_request(op: str, *, seconds: float, error: bool) -> None:
    """Record one etcd request; ``op`` names the operation (``range``, ``txn``, ``put``...)."""
    ETCD_SECONDS.labels(node_name(), op).observe(seconds)
    if error:
        ETCD_ERRORS.labels(node_name(), op).inc()


def etcd_lease_renewal_failed(op: str = "lease_keepalive") -> None:
    """Count one failed background lease renewal (``LeaseKeeper``)."""
    ETCD_LEASE_RENEWAL_FAILURES.labels(node_name(), op).inc()


@contextmanager
def etcd_timer(op: str) -> Iterator[None]:
    """Time the etcd request in the block; an exception counts as an error and propagates."""
    start = time.perf_counter()
    error = True
    try:
        yield
        error = False
    finally:
        etcd_request(op, seconds=time.perf_counter() - start, error=error)


def checkpoint_blocked(seconds: float) -> None:
    """The training loop was blocked ``seconds`` by a save (the host copy)."""
    CKPT_BLOCKING.labels(node_name()).observe(seconds)


def checkpoint_saved(*, step: int, seconds: float, bytes_written: int) -> None:
    """A checkpoint is complete on disk, ``seconds`` after its save began."""
    node = node_name()
    CKPT_SAVE.labels(node).observe(seconds)
    CKPT_BYTES.labels(node).inc(bytes_written)
    CKPT_LAST_STEP.labels(node).set(step)
    CKPT_LAST_TIME.labels(node).set_to_current_time()


def checkpoint_failed() -> None:
    CKPT_FAILURES.labels(node_name()).inc()


def checkpoint_loaded(*, step: int, seconds: float, saved_at: float | None = None) -> None:
    """A checkpoint was restored; it is the newest good one, so it sets the gauges too.

    ``saved_at`` is the unix time at which it was written, when known.
    """
    node = node_name()
    CKPT_LOAD.labels(node).observe(seconds)
    CKPT_LAST_STEP.labels(node).set(step)
    if saved_at is not None:
        CKPT_LAST_TIME.labels(node).set(saved_at)


def state_restored(*, source: str, seconds: float) -> None:
    """The (re)start restored its state from ``source``: snapshot, disk or none."""
    RESTORE_SECONDS.labels(node_name(), source).observe(seconds)


class ResourceSampler:
    """Samples this process's RSS, CPU time, open files and CUDA memory into gauges.

    A daemon thread samples every ``interval`` seconds, off the training loop.
    """

    def __init__(self, *, local_rank: int, interval: float = 5.0) -> None:
        self._labels = (node_name(), str(local_rank))
        self._rss, self._fds = RSS.labels(*self._labels), FDS.labels(*self._labels)
        self._cpu = CPU.labels(*self._labels)
        self._process = psutil.Process()
        self._cpu_seen = 0.0
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="resource-sampler", daemon=True)

    def start(self) -> None:
        self.sample()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def sample(self) -> None:
        with self._process.oneshot():
            self._rss.set(self._process.memory_info().rss)
            cpu = sum(self._process.cpu_times()[:2])
            self._fds.set(self._process.num_fds())
        self._cpu.inc(max(cpu - self._cpu_seen, 0.0))
        self._cpu_seen = cpu
        self._sample_cuda()

    def _sample_cuda(self) -> None:
        # A process that never imported torch has no CUDA memory to report.
        torch = sys.modules.get("torch")
        # Children are made only here, so that a CPU-only node exports no GPU series.
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            GPU_ALLOCATED.labels(*self._labels).set(torch.cuda.memory_allocated())
            GPU_RESERVED.labels(*self._labels).set(torch.cuda.memory_reserved())

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.sample()


class WorkerMetrics:
    """The trainer's metrics: one per worker process, made at start.

    ``recovery_started_at`` comes from the agent (see :data:`RECOVERY_STARTED_AT_ENV`);
    the first completed step of a restarted worker measures the recovery.
    """

    def __init__(
        self,
        *,
        rank: int,
        local_rank: int,
        world_size: int,
        recovery_started_at: float | None = None,
        resource_interval: float = 5.0,
        flush_seconds: float = 1.0,
    ) -> None:
        node = node_name()
        self.rank, self.local_rank = rank, local_rank
        self.recovery_started_at = recovery_started_at
        self._step, self._steps = GLOBAL_STEP.labels(node), STEPS.labels(node)
        self._samples, self._seconds = SAMPLES.labels(node), STEP_SECONDS.labels(node)
        self._loss, self._world = LOSS.labels(node), WORLD_SIZE.labels(node)
        self._last = LAST_STEP_TIME.labels(node)
        self._world.set(world_size)
        self.flush_seconds = flush_seconds
        self._flushed_at = -math.inf  # the first step is written at once
        self._latest: tuple[int, int, float] | None = None
        self._loss_value: float | None = None
        self._pending_samples = self._pending_steps = 0
        self._pending_seconds: list[float] = []
        # Made now, so these series read 0 before their first event, not "no data".
        if rank == 0:
            LOST_STEPS.labels(node)
            CKPT_FAILURES.labels(node)
        if local_rank == 0:
            RECOVERY_SECONDS.labels(node)
            for cause in ("failure", "join", "preemption"):
                REGROUPS.labels(node, cause)
        self._resources = ResourceSampler(local_rank=local_rank, interval=resource_interval)
        self._resources.start()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> WorkerMetrics:
        """From the torchrun environment; a process started without torchrun is rank 0 of 1."""
        started = environ.get(RECOVERY_STARTED_AT_ENV)
        return cls(
            rank=int(environ.get("RANK", "0")),
            local_rank=int(environ.get("LOCAL_RANK", "0")),
            world_size=int(environ.get("WORLD_SIZE", "1")),
            recovery_started_at=float(started) if started else None,
        )

    def step_completed(
        self, *, step: int, samples: int, seconds: float, loss: float | None, world_size: int
    ) -> None:
        """One optimizer step finished: ``samples`` is this rank's share of the batch;
        ``loss`` the global batch's mean loss, None where the ranks did not compute it.

        The series are written at most every ``flush_seconds`` (and at
        :meth:`close`): each write is a locked update of a memory-mapped file,
        and the handful per step cost about 1 % of a millisecond step, while a
        scrape every few seconds cannot tell the difference.
        """
        self._pending_samples += samples
        self._pending_steps += 1
        self._pending_seconds.append(seconds)
        if loss is not None:
            self._loss_value = loss
        self._latest = (step, world_size, time.time())
        if self.recovery_started_at is not None:
            if self.local_rank == 0:  # one observation per node and recovery
                RECOVERY_SECONDS.labels(node_name()).observe(time.time() - self.recovery_started_at)
            self.recovery_started_at = None
        if time.monotonic() - self._flushed_at >= self.flush_seconds:
            self.flush()

    def flush(self) -> None:
        """Write the steps completed since the last write."""
        if self._latest is None:
            return
        self._flushed_at = time.monotonic()
        step, world_size, finished_at = self._latest
        self._step.set(step)
        self._samples.inc(self._pending_samples)
        for seconds in self._pending_seconds:
            self._seconds.observe(seconds)
        if self._loss_value is not None:
            self._loss.set(self._loss_value)
        self._world.set(world_size)
        self._last.set(finished_at)
        if self.rank == 0:
            self._steps.inc(self._pending_steps)
        self._latest, self._pending_samples, self._pending_steps = None, 0, 0
        self._pending_seconds.clear()

    def evaluated(self, *, metrics: Mapping[str, float | None]) -> None:
        """Evaluation results by name (``loss``, ``accuracy``...); ``None``: not measured."""
        for name, value in metrics.items():
            if value is not None:
                EVAL.labels(node_name(), name).set(value)

    def regrouped(self, *, cause: str, started_at: float, nodes: int) -> None:
        """The group was re-formed in place with ``nodes`` nodes (``cause``: "failure",
        "join" or "preemption"), a recovery that began at Unix time ``started_at`` and ends at the
        next step."""
        if self.local_rank == 0:
            REGROUPS.labels(node_name(), cause).inc()
            NODES.labels(node_name()).set(nodes)  # no round ran: the agent's value is old
        self.recovery_started_at = started_at

    def resumed(self, *, restored_step: int, lost_steps: int) -> None:
        """State was restored at ``restored_step``; ``lost_steps`` done steps will be redone."""
        self.flush()
        self._step.set(restored_step)
        if self.rank == 0:
            LOST_STEPS.labels(node_name()).inc(lost_steps)

    def close(self) -> None:
        self.flush()
        self._resources.stop()
