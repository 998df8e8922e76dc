"""Live progress of a local cluster, computed from the workers' audit records.

The runner never talks to the workers: everything shown here (world size,
step, throughput, loss) is read from the same per-step records that the
exactly-once audit uses, so the display cannot disagree with the summary.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TextIO

from elastic_train.audit import AuditRecord, StepRecord

#: seconds of records that throughput is averaged over
THROUGHPUT_WINDOW_S = 10.0


@dataclass
class _NodeProgress:
    world_size: int | None = None
    step: int = 0
    loss: float | None = None
    last_time: float = float("-inf")
    recent: deque[tuple[float, int]] = field(default_factory=deque)

    def samples_per_second(self, now: float) -> float:
        while self.recent and self.recent[0][0] < now - THROUGHPUT_WINDOW_S:
            self.recent.popleft()
        if not self.recent:
            return 0.0
        return sum(n for _, n in self.recent) / THROUGHPUT_WINDOW_S


@dataclass
class ProgressBoard:
    """Per-node and cluster-wide progress, fed with new audit records."""

    nodes: dict[str, _NodeProgress] = field(default_factory=dict)
    step: int = 0
    world_size: int | None = None
    loss: float | None = None
    #: (attempt, step) -> [sum of loss * samples, samples, records]
    _partial: dict[tuple[str, int], list[float]] = field(default_factory=dict)

    def observe(self, records: Iterable[AuditRecord]) -> None:
        for record in records:
            node = self.nodes.setdefault(record.node, _NodeProgress())
            node.world_size = record.world_size
            node.last_time = max(node.last_time, record.time)
            if isinstance(record, StepRecord):
                self._observe_step(node, record)

    def _observe_step(self, node: _NodeProgress, record: StepRecord) -> None:
        node.step, node.loss = record.step, record.loss
        node.recent.append((record.time, len(record.indices)))
        acc = self._partial.setdefault((record.attempt, record.step), [0.0, 0.0, 0.0])
        acc[0] += record.loss * len(record.indices)
        acc[1] += len(record.indices)
        acc[2] += 1
        if acc[2] == record.world_size:
            # Only a step that every rank recorded has a global loss to show.
            del self._partial[(record.attempt, record.step)]
            self.step, self.world_size = record.step, record.world_size
            self.loss = acc[0] / acc[1] if acc[1] else None

    def has_records_since(self, node: str, wall_time: float) -> bool:
        progress = self.nodes.get(node)
        return progress is not None and progress.last_time >= wall_time

    def lines(self, states: Mapping[str, str], *, elapsed: float) -> list[str]:
        """One header line for the cluster, then one line per node."""
        now = time.time()
        total = sum(node.samples_per_second(now) for node in self.nodes.values())
        lines = [
            f"[{elapsed:6.1f}s] step {self.step:>6}  world {_fmt(self.world_size)}  "
            f"{total:8.1f} samples/s  loss {_fmt_loss(self.loss)}"
        ]
        for name in sorted(states.keys() | self.nodes.keys(), key=_node_order):
            node = self.nodes.get(name, _NodeProgress())
            lines.append(
                f"  {name:<8} {states.get(name, '-'):<14} world {_fmt(node.world_size)}  "
                f"step {node.step:>6}  {node.samples_per_second(now):8.1f} samples/s  "
                f"loss {_fmt_loss(node.loss)}"
            )
        return lines


class ProgressPrinter:
    """Redraws the board in place on a terminal; prints plain blocks otherwise."""

    def __init__(self, stream: TextIO | None = None, *, interval_s: float | None = None) -> None:
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        # A log file gets a block every few seconds, a terminal a smooth redraw.
        self.interval_s = interval_s if interval_s is not None else (0.5 if self.tty else 5.0)
        self._last = float("-inf")
        self._drawn = 0

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


def _node_order(name: str) -> tuple[int, str]:
    digits = name.removeprefix("node")
    return (int(digits), name) if digits.isdigit() else (1 << 30, name)


def _fmt(value: int | None) -> str:
    return "-" if value is None else str(value)


def _fmt_loss(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"
