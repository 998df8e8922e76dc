"""A benchmark cluster on top of the local cluster runner (``LocalCluster``):
the same nodes, chaos and audit records for every competitor, plus the two
clocks the benchmarks read: the workers' audit records and the agents' log
lines, each line stamped with the wall time it reached the log file.

c10d note: torchrun's c10d store lives in whichever agent binds the endpoint
first, and the job dies with that agent. To make "kill node 2" mean the same
for every competitor, the benchmark hosts the c10d TCPStore itself (agents get
``is_host=0``), as if on a node that is never killed.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

from torch.distributed import TCPStore

from benchmarks.harness import Competitor
from benchmarks.workloads import Workload, cluster_spec
from elastic_train.audit import AuditTail, StepRecord, read_new_lines
from elastic_train.errors import ClusterError
from elastic_train.etcd.server import free_port
from elastic_train.local.chaos import ChaosEvent, ChaosKind, Recovery, recovery_after
from elastic_train.local.cluster import LocalCluster

#: seconds between two looks at the audit and the logs
POLL_S = 0.02


class LogFollower:
    """Follows ``logs/node*.log`` of a run and stamps each line on arrival."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.lines: dict[str, list[tuple[float, str]]] = {}
        self._offsets: dict[Path, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> LogFollower:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(2)

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            for path in sorted(self.directory.glob("node*.log")):
                self._read(path)

    def _read(self, path: Path) -> None:
        now = time.time()
        lines = self.lines.setdefault(path.stem, [])
        lines += [(now, line) for line in read_new_lines(path, self._offsets)]

    def first(self, pattern: str, *, after: float, nodes: list[str]) -> float | None:
        """Earliest arrival, on any of ``nodes``, of a line matching ``pattern``."""
        regex = re.compile(pattern)
        stamps = [
            stamp
            for node in nodes
            for stamp, line in list(self.lines.get(node, []))
            if stamp >= after and regex.search(line)
        ]
        return min(stamps, default=None)


class BenchCluster:
    """``LocalCluster`` for one competitor, started with ``nodes`` nodes."""

    def __init__(
        self, competitor: Competitor, workload: Workload, workdir: Path, **spec: Any
    ) -> None:
        self._store: TCPStore | None = None
        self.workload = workload
        endpoint = None
        if competitor.rdzv_backend == "c10d":
            port = free_port()
            self._store = TCPStore(
                "127.0.0.1",
                port,
                is_master=True,
                wait_for_workers=False,
                timeout=timedelta(seconds=600),
                multi_tenant=True,
            )
            endpoint = f"127.0.0.1:{port}"
        self.local = LocalCluster(
            cluster_spec(competitor, workload, rdzv_endpoint=endpoint, **spec), run_dir=workdir
        )
        self.tail = AuditTail(self.local.audit_dir)
        #: The highest step recorded at each world size so far.
        self.highest_step: dict[int, int] = {}
        self.logs = LogFollower(workdir / "logs")

    def __enter__(self) -> BenchCluster:
        self.local.__enter__()
        self.logs.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        with contextlib.ExitStack() as stack:
            stack.callback(self.local.__exit__, None, None, None)
            stack.callback(self.logs.__exit__, None, None, None)
        self._store = None

    def deliver(self, kind: ChaosKind, node: int) -> float:
        """Kill, SIGTERM or start ``node`` now; return the wall time of the event."""
        moment = time.time()
        outcome = self.local.deliver(ChaosEvent(kind=kind, node=node, at_seconds=0.0))
        if outcome != "delivered":
            raise ClusterError(f"{kind}:{node} was not delivered: {outcome}")
        return moment

    def wait(self, what: str, predicate: Callable[[], Any], *, timeout: float) -> Any:
        """Poll the audit until ``predicate()`` is truthy; ClusterError on timeout."""
        deadline = time.monotonic() + timeout
        first = True
        while time.monotonic() < deadline:
            new = self.tail.poll()
            for record in new:
                if isinstance(record, StepRecord):
                    size = record.world_size
                    self.highest_step[size] = max(self.highest_step.get(size, 0), record.step)
            self.local.poll()
            # Predicates read only the audit: re-read it only when records
            # arrived, so that the driver takes little CPU from the workers.
            if new or first:
                first = False
                value = predicate()
                if value:
                    return value
            if not self.local.alive_nodes():
                raise ClusterError(f"every agent exited while waiting for {what}")
            time.sleep(POLL_S)
        raise ClusterError(f"timed out after {timeout:.0f}s waiting for {what}")

    def steps(self, *, world_size: int, after: float = 0.0) -> list[StepRecord]:
        return [r for r in self.tail.log.steps if r.world_size == world_size and r.time >= after]

    def wait_step(self, step: int, *, world_size: int, timeout: float) -> None:
        self.wait(
            f"step {step} at world size {world_size}",
            lambda: self.highest_step.get(world_size, 0) >= step,
            timeout=timeout,
        )

    def wait_recovery(
        self, *, kind: ChaosKind, node: int, event_time: float, world_size: int, timeout: float
    ) -> Recovery:
        """The recovery (as the runner audits it) once a step at ``world_size`` followed."""

        def recovered() -> Recovery | None:
            rec = recovery_after(self.tail.log, kind=kind, node=node, event_time=event_time)
            return rec if rec.world_size_after == world_size else None

        try:
            return self.wait(
                f"first step at world size {world_size} after {kind}:{node}",
                recovered,
                timeout=timeout,
            )
        except ClusterError as exc:
            raise ClusterError(f"{exc}; {self.describe_attempts(after=event_time)}") from exc

    def describe_attempts(self, *, after: float) -> str:
        """What trained instead, e.g. two worlds of 1 at once: a split brain."""
        seen = []
        for attempt in self.tail.log.attempts():
            if attempt.start_time < after or not attempt.steps:
                continue
            nodes = sorted({r.node for records in attempt.steps.values() for r in records})
            seen.append(f"world {attempt.world_size} on {','.join(nodes)}")
        return f"attempts started since: [{'; '.join(seen) or 'none'}]"
