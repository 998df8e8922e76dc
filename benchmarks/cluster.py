"""A benchmark cluster: an etcd (v2 API on when a competitor needs it), N
torchrun agents as "nodes", chaos by signal, and the two clocks the
benchmarks read: the audit records the workers write and the agents' own log
lines, each stamped with the wall time it arrived.

A node kill is SIGKILL to the agent *and* every worker by PID: torchrun starts
workers in their own sessions, so killing the agent's group would leave
orphans training in the old group (see shared/torch-elastic-notes.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import psutil

from benchmarks.harness import Competitor
from benchmarks.workloads import Workload, worker_command
from elastic_train.errors import ClusterError
from elastic_train.etcd_server import EtcdServer, free_port

Record = dict[str, Any]


class Node:
    """One torchrun agent; its output lines are kept with their arrival time."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log_path: Path) -> None:
        self.name = name
        self.lines: list[tuple[float, str]] = []
        self._log = open(log_path, "w", buffering=1)  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(
            argv,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        self.started = time.time()
        self._reader = threading.Thread(target=self._read, args=(self.proc.stdout,), daemon=True)
        self._reader.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.append((time.time(), line))
            self._log.write(f"{time.time():.3f} {line}")

    def pids(self) -> list[int]:
        try:
            agent = psutil.Process(self.proc.pid)
            return [self.proc.pid] + [c.pid for c in agent.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []

    def signal_all(self, sig: signal.Signals) -> float:
        """Send ``sig`` to the agent and all its workers at once; return the time."""
        pids = self.pids()
        now = time.time()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        return now

    def terminate_agent(self) -> float:
        """SIGTERM to the agent only, as Kubernetes sends it to a pod's PID 1."""
        now = time.time()
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGTERM)
        return now

    def first_line(self, pattern: str, *, after: float) -> float | None:
        regex = re.compile(pattern)
        for stamp, line in list(self.lines):
            if stamp >= after and regex.search(line):
                return stamp
        return None

    def close(self) -> None:
        self.signal_all(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)
        self._reader.join(2)
        self._log.close()


class AuditTail:
    """Incrementally reads every ``worker-*.jsonl`` audit file of a directory."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.records: list[Record] = []
        self._offsets: dict[Path, int] = {}

    def poll(self) -> list[Record]:
        new: list[Record] = []
        for path in sorted(self.directory.glob("worker-*.jsonl")):
            with open(path, "rb") as f:
                f.seek(self._offsets.get(path, 0))
                chunk = f.read()
            complete = chunk[: chunk.rfind(b"\n") + 1]
            self._offsets[path] = self._offsets.get(path, 0) + len(complete)
            new += [json.loads(line) for line in complete.splitlines() if line.strip()]
        self.records += new
        return new

    def steps(self, *, after: float = 0.0, world_size: int | None = None) -> list[Record]:
        return [
            r
            for r in self.records
            if r.get("kind") == "step"
            and r["time"] >= after
            and (world_size is None or r["world_size"] == world_size)
        ]

    def resumes(self, *, after: float = 0.0) -> list[Record]:
        return [r for r in self.records if r.get("kind") == "resume" and r["time"] >= after]

    def last_step_before(self, moment: float) -> int:
        done = [r["step"] for r in self.records if r.get("kind") == "step" and r["time"] < moment]
        return max(done, default=0)


@dataclass
class ClusterSpec:
    competitor: Competitor
    workload: Workload
    min_nodes: int
    max_nodes: int


class BenchCluster:
    """Context manager: etcd (if needed) + nodes added with :meth:`add_node`."""

    def __init__(
        self, spec: ClusterSpec, workdir: Path, *, extra_env: dict[str, str] | None = None
    ) -> None:
        self.spec = spec
        self.extra_env = extra_env or {}
        self.workdir = workdir
        self.audit_dir = workdir / "audit"
        self.ckpt_dir = workdir / "ckpt"
        self.audit_dir.mkdir(parents=True, exist_ok=True)
        self.audit = AuditTail(self.audit_dir)
        self.nodes: dict[str, Node] = {}
        self.etcd: EtcdServer | None = None
        self.endpoint = f"127.0.0.1:{free_port()}"

    def __enter__(self) -> BenchCluster:
        if self.spec.competitor.needs_etcd:
            extra = ["--enable-v2"] if self.spec.competitor.needs_etcd_v2 else []
            self.etcd = EtcdServer(data_dir=self.workdir / "etcd" / "data", extra_args=extra)
            self.etcd.start()
            self.endpoint = self.etcd.endpoint
        return self

    def __exit__(self, *exc: object) -> None:
        for node in self.nodes.values():
            node.close()
        if self.etcd is not None:
            self.etcd.stop()

    def add_node(self, name: str) -> Node:
        comp = self.spec.competitor
        conf = comp.rdzv_conf
        if comp.rdzv_backend == "c10d":
            # The store lives in one agent; pin it to the first node, which no
            # benchmark kills, instead of whichever agent wins the bind race.
            host = "is_host=1" if not self.nodes else "is_host=0"
            conf = f"{conf},{host}" if conf else host
        argv = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={self.spec.min_nodes}:{self.spec.max_nodes}",
            "--nproc-per-node=1",
            f"--rdzv-backend={comp.rdzv_backend}",
            f"--rdzv-endpoint={self.endpoint}",
            "--rdzv-id=bench",
            "--max-restarts=100",
            *([f"--rdzv-conf={conf}"] if conf else []),
            *worker_command(comp, self.spec.workload, self.audit_dir, self.ckpt_dir),
        ]
        env = {
            **os.environ,
            "ELASTIC_TRAIN_NODE": name,
            "PYTHONUNBUFFERED": "1",
            # One intra-op thread per worker: the machine has fewer cores than workers.
            "OMP_NUM_THREADS": "1",
            **dict(comp.env),
            **self.extra_env,
        }
        node = Node(name, argv, env, self.workdir / f"{name}.log")
        self.nodes[name] = node
        return node

    def wait(self, what: str, predicate: Callable[[], Any], *, timeout: float) -> Any:
        """Poll the audit until ``predicate()`` is truthy; raise ClusterError on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.audit.poll()
            value = predicate()
            if value:
                return value
            dead = [n.name for n in self.nodes.values() if n.proc.poll() not in (None, -9)]
            if dead and len(dead) == len(self.nodes):
                raise ClusterError(f"every agent exited while waiting for {what}")
            time.sleep(0.02)
        raise ClusterError(f"timed out after {timeout:.0f}s waiting for {what}")

    def first_step(self, *, after: float, world_size: int) -> Callable[[], Record | None]:
        def find() -> Record | None:
            steps = self.audit.steps(after=after, world_size=world_size)
            return min(steps, key=lambda r: r["time"]) if steps else None

        return find
