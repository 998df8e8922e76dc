"""Live progress of a local cluster, computed from the workers' audit records.

The runner never talks to the workers: everything shown here (world size,
step, throughput, loss, recoveries) is read from the same per-step records
that the exactly-once audit uses, so the display cannot disagree with the
summary.

:class:`ProgressBoard` keeps the state; :meth:`ProgressBoard.view` takes a
:class:`BoardView` snapshot that renders as plain lines (:meth:`BoardView.lines`,
printed by :class:`ProgressPrinter` into logs and pipes) or as a ``rich`` table
on a terminal (``local/board.py``).
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TextIO

from elastic_train.audit import AuditLog, AuditRecord, ResumeRecord, StepRecord
from elastic_train.config.args import parse_cli
from elastic_train.config.job import TrainingConfig
from elastic_train.errors import ConfigError
from elastic_train.local.chaos import ChaosEvent, Recovery, recovery_after
from elastic_train.local.cluster import LocalCluster

#: seconds of records that throughput is averaged over
THROUGHPUT_WINDOW_S = 10.0
# Ranks of one node record a step within milliseconds: no rate over so short a span.
_MIN_RATE_SPAN_S = 1.0


def windowed_rate(
    recent: deque[tuple[float, float]], *, now: float, since: float, window: float
) -> float:
    """Amount per second over the last ``window`` seconds of ``(time, amount)`` pairs.

    Pairs older than the window are dropped from ``recent``. A source whose
    first pair came at ``since``, less than a window ago, is measured from that
    pair on: what came after it over the time since, so a young run does not
    read as slow.
    """
    while recent and recent[0][0] <= now - window:
        recent.popleft()
    if not recent:
        return 0.0
    if now - since >= window:
        return sum(amount for _, amount in recent) / window
    # The first pair opens the span; what came after it fills it.
    amount = sum(amount for _, amount in recent) - recent[0][1]
    return amount / max(_MIN_RATE_SPAN_S, now - since)


def planned_steps(training: TrainingConfig | None, *, dataset_len: int | None) -> int | None:
    """The step the trainer stops at (``TrainingConfig.total_steps``); None: unknown."""
    if training is None:
        return None
    if training.steps > 0:
        return training.steps
    if dataset_len is None:
        return None  # an epoch count needs the dataset's length, known from a resume record
    return training.total_steps(dataset_len=dataset_len, batch_size=training.global_batch_size)


def eta_seconds(*, step: int, total: int | None, steps_per_second: float) -> float | None:
    """Seconds to ``total`` at the current rate; None while either is unknown."""
    if total is None or steps_per_second <= 0:
        return None
    return max(0, total - step) / steps_per_second


def format_duration(seconds: float | None) -> str:
    """``45s``, ``3m07s``, ``2h05m``; ``-`` for unknown."""
    if seconds is None:
        return "-"
    whole = round(seconds)
    if whole < 60:
        return f"{whole}s"
    if whole < 3600:
        return f"{whole // 60}m{whole % 60:02d}s"
    return f"{whole // 3600}h{whole % 3600 // 60:02d}m"


def trainer_training(cluster: LocalCluster) -> TrainingConfig | None:
    """The ``[training]`` section the trainer runs with; None for a script of other arguments.

    ``main.py``'s arguments were checked before the run; a ``--script`` given
    ``trainer_args`` takes the same ones, and if it does not, the board only
    lacks its total and ETA.
    """
    if not cluster.spec.trainer_args:
        return None
    try:
        return parse_cli(cluster.worker_args()).config.training
    except ConfigError:
        return None


class DeliveredEvent(Protocol):
    """What the board needs of a chaos event the runner carried out (``runner.Delivery``)."""

    @property
    def event(self) -> ChaosEvent: ...
    @property
    def node(self) -> int | None: ...
    @property
    def time(self) -> float: ...
    @property
    def elapsed(self) -> float: ...
    @property
    def delivered(self) -> bool: ...


@dataclass(frozen=True)
class NodeRow:
    """One node's line of the board."""

    name: str
    state: str
    world_size: int | None
    step: int
    samples_per_second: float
    loss: float | None


@dataclass(frozen=True)
class RecoveryRow:
    """One delivered event and, once the job trains again, what it cost."""

    event: str
    #: seconds since the nodes started, when the event was delivered
    at: float
    seconds: float | None
    lost_steps: int | None
    world_size_after: int | None


@dataclass(frozen=True)
class BoardView:
    """A snapshot of the board: what one redraw shows."""

    elapsed: float
    step: int
    total: int | None
    eta_s: float | None
    loss: float | None
    samples_per_second: float
    steps_per_second: float
    world_size: int | None
    nodes: tuple[NodeRow, ...] = ()
    recoveries: tuple[RecoveryRow, ...] = ()

    @property
    def fraction(self) -> float | None:
        return None if not self.total else min(1.0, self.step / self.total)

    def lines(self) -> list[str]:
        """One header line for the cluster, one line per node, one per recovery."""
        total = f"/{self.total}" if self.total is not None else ""
        lines = [
            f"[{self.elapsed:6.1f}s] step {self.step:>6}{total}  ETA {format_duration(self.eta_s)}"
            f"  world {_fmt(self.world_size)}  {self.samples_per_second:8.1f} samples/s"
            f"  {self.steps_per_second:5.1f} steps/s  loss {_fmt_loss(self.loss)}"
        ]
        for node in self.nodes:
            lines.append(
                f"  {node.name:<8} {node.state:<14} world {_fmt(node.world_size)}  "
                f"step {node.step:>6}  {node.samples_per_second:8.1f} samples/s  "
                f"loss {_fmt_loss(node.loss)}"
            )
        lines.extend(f"  recovery {_recovery_text(row)}" for row in self.recoveries)
        return lines


def _recovery_text(row: RecoveryRow) -> str:
    head = f"{row.event} at {row.at:.1f}s: "
    if row.seconds is None:
        return head + "recovering"
    lost = "-" if row.lost_steps is None else str(row.lost_steps)
    return f"{head}{row.seconds:.2f} s, {lost} lost steps, world {_fmt(row.world_size_after)}"


@dataclass
class _NodeProgress:
    world_size: int | None = None
    step: int = 0
    loss: float | None = None
    first_step_time: float = float("inf")
    last_time: float = float("-inf")
    recent: deque[tuple[float, float]] = field(default_factory=deque)

    def samples_per_second(self, now: float) -> float:
        return windowed_rate(
            self.recent, now=now, since=self.first_step_time, window=THROUGHPUT_WINDOW_S
        )


@dataclass
class ProgressBoard:
    """Per-node and cluster-wide progress, fed with new audit records.

    ``training`` (the trainer's config section, :func:`trainer_training`)
    gives the total and so the ETA; without it both show as unknown.
    """

    training: TrainingConfig | None = None
    nodes: dict[str, _NodeProgress] = field(default_factory=dict)
    step: int = 0
    world_size: int | None = None
    loss: float | None = None
    dataset_len: int | None = None
    #: (attempt, step) -> [sum of loss * samples, samples, records, last record's time]
    _partial: dict[tuple[str, int], list[float]] = field(default_factory=dict)
    #: completion times of global steps (the last rank's record), for steps/s
    _completions: deque[tuple[float, float]] = field(default_factory=deque)
    _first_completion: float = float("inf")
    _last_completion: float = float("-inf")
    _records: int = 0
    #: event wall time -> (records seen when computed, recovery, settled)
    _recoveries: dict[float, tuple[int, Recovery, bool]] = field(default_factory=dict)

    def observe(self, records: Iterable[AuditRecord]) -> None:
        for record in records:
            self._records += 1
            node = self.nodes.setdefault(record.node, _NodeProgress())
            node.world_size = record.world_size
            node.last_time = max(node.last_time, record.time)
            if isinstance(record, StepRecord):
                self._observe_step(node, record)
            elif isinstance(record, ResumeRecord) and record.dataset_len is not None:
                self.dataset_len = record.dataset_len

    def _observe_step(self, node: _NodeProgress, record: StepRecord) -> None:
        node.step, node.loss = record.step, record.loss
        node.first_step_time = min(node.first_step_time, record.time)
        node.recent.append((record.time, len(record.indices)))
        key = (record.attempt, record.step)
        acc = self._partial.setdefault(key, [0.0, 0.0, 0.0, float("-inf")])
        acc[0] += record.loss * len(record.indices)
        acc[1] += len(record.indices)
        acc[2] += 1
        acc[3] = max(acc[3], record.time)
        if acc[2] == record.world_size:
            # Only a step that every rank recorded has a global loss to show.
            del self._partial[key]
            if acc[3] >= self._last_completion:
                # A killed node's last records can be read after the survivors
                # moved on: a step completed earlier must not pull the headline back.
                self.step, self.world_size = record.step, record.world_size
                self.loss = acc[0] / acc[1] if acc[1] else None
            self._completions.append((acc[3], 1.0))
            self._first_completion = min(self._first_completion, acc[3])
            self._last_completion = max(self._last_completion, acc[3])

    def has_records_since(self, node: str, wall_time: float) -> bool:
        progress = self.nodes.get(node)
        return progress is not None and progress.last_time >= wall_time

    @property
    def total(self) -> int | None:
        return planned_steps(self.training, dataset_len=self.dataset_len)

    def view(
        self,
        states: Mapping[str, str],
        *,
        elapsed: float,
        deliveries: Sequence[DeliveredEvent] = (),
        log: AuditLog | None = None,
        now: float | None = None,
    ) -> BoardView:
        """The board now; recoveries need the run's ``log`` (the records read so far)."""
        now = time.time() if now is None else now
        if states and all(_gone(state) for state in states.values()):
            # Every node is gone: rates stay as the last records left them.
            now = min(now, max((n.last_time for n in self.nodes.values()), default=now))
        names = sorted(states.keys() | self.nodes.keys(), key=_node_order)
        rows = tuple(self._node_row(name, states.get(name, "-"), now) for name in names)
        steps_per_second = windowed_rate(
            self._completions, now=now, since=self._first_completion, window=THROUGHPUT_WINDOW_S
        )
        return BoardView(
            elapsed=elapsed,
            step=self.step,
            total=self.total,
            eta_s=eta_seconds(step=self.step, total=self.total, steps_per_second=steps_per_second),
            loss=self.loss,
            samples_per_second=sum(row.samples_per_second for row in rows),
            steps_per_second=steps_per_second,
            world_size=self.world_size,
            nodes=rows,
            recoveries=self._recovery_rows(deliveries, log) if log is not None else (),
        )

    def _node_row(self, name: str, state: str, now: float) -> NodeRow:
        node = self.nodes.get(name, _NodeProgress())
        return NodeRow(
            name, state, node.world_size, node.step, node.samples_per_second(now), node.loss
        )

    def lines(self, states: Mapping[str, str], *, elapsed: float) -> list[str]:
        return self.view(states, elapsed=elapsed).lines()

    def _recovery_rows(
        self, deliveries: Sequence[DeliveredEvent], log: AuditLog
    ) -> tuple[RecoveryRow, ...]:
        rows = []
        for delivery in deliveries:
            if not delivery.delivered or delivery.node is None:
                continue
            recovery = self._recovery(delivery, log)
            rows.append(
                RecoveryRow(
                    event=str(delivery.event),
                    at=delivery.elapsed,
                    seconds=recovery.seconds,
                    lost_steps=recovery.lost_steps,
                    world_size_after=recovery.world_size_after,
                )
            )
        return tuple(rows)

    def _recovery(self, delivery: DeliveredEvent, log: AuditLog) -> Recovery:
        """The summary's own audit of the event, recomputed only while it can change.

        It is final once a global step completed at or after the recovering
        attempt's first step: every rank's record of that first step was read
        by then (each rank's file is read in order).
        """
        cached = self._recoveries.get(delivery.time)
        if cached is not None and (cached[2] or cached[0] == self._records):
            return cached[1]
        completed_before = self._last_completion
        assert delivery.node is not None
        recovery = recovery_after(
            log, kind=delivery.event.kind, node=delivery.node, event_time=delivery.time
        )
        settled = (
            recovery.seconds is not None
            and completed_before >= recovery.event_time + recovery.seconds
        )
        self._recoveries[delivery.time] = (self._records, recovery, settled)
        return recovery


class ProgressSink(Protocol):
    """Where the runner shows the board: ``show`` each tick, ``final`` on the last call."""

    def show(self, view: BoardView, *, final: bool = False) -> None: ...


class ProgressPrinter:
    """Redraws the lines in place on a terminal; prints plain blocks otherwise."""

    def __init__(self, stream: TextIO | None = None, *, interval_s: float | None = None) -> None:
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        # A log file gets a block every few seconds, a terminal a smooth redraw.
        self.interval_s = interval_s if interval_s is not None else (0.5 if self.tty else 5.0)
        self._last = float("-inf")
        self._drawn = 0

    def show(self, view: BoardView, *, final: bool = False) -> None:
        self(view.lines(), force=final)

    def __call__(self, lines: list[str], *, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last < self.interval_s:
            return
        self._last = now
        if self.tty:
            # Move up over the previous block and clear each line before redrawing.
            self.stream.write(f"\x1b[{self._drawn}F" if self._drawn else "")
            self.stream.write("".join(f"\x1b[2K{line}\n" for line in lines))
            self._drawn = len(lines)
        else:
            self.stream.write("\n".join(lines) + "\n")
        self.stream.flush()


def _gone(state: str) -> bool:
    """A node state (``cluster.Node.state``) after which no record can come."""
    return state == "killed" or state.startswith("exited(")


def _node_order(name: str) -> tuple[int, str]:
    digits = name.removeprefix("node")
    return (int(digits), name) if digits.isdigit() else (1 << 30, name)


def _fmt(value: int | None) -> str:
    return "-" if value is None else str(value)


def _fmt_loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"
