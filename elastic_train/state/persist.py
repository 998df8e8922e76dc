"""``checkpoint.writer = "agent"``: the node agent writes rank 0's disk checkpoints.

With the trainer writer, rank 0 copies its state to host memory and a thread
of the training process serializes, checksums and fsyncs it; on a small box
that thread takes CPU and the GIL from the training loop (benchmarks/README.md,
"Throughput"). With the agent writer the trainer only makes sure its node's
``/dev/shm`` snapshot holds the step (the snapshot is cheap, and usually
taken by the cadence already) and sends the node agent a request, one
datagram on a Unix socket; the agent copies the slot, verifies the copy,
and writes its bytes as they are with :meth:`CheckpointManager.write_slot`
(``state.slot``, format 3): the same manifest,
atomic rename and ``keep`` rotation as the trainer writer.

The protocol, both sides:

- the agent binds ``<dir>/sock`` (a ``SOCK_DGRAM`` socket in a 0700 directory
  of its own) and exports its path to the workers in :data:`SOCKET_ENV`;
- a request is JSON: the requester's pid and sequence number, the step, the
  snapshot's root, run id and fingerprint, and the checkpoint directory,
  ``keep`` and manifest metadata;
- the agent handles the newest request it has (older ones queued behind it
  are superseded: their steps were overwritten in the slot anyway) and
  rewrites ``<dir>/status.json`` (:class:`PersistStatus`), which the
  trainer reads at each save: its consecutive failures there feed
  ``checkpoint.max_consecutive_failures`` as its own failed saves do.

Blocking saves (the final one, a preemption stop) are written by the trainer
itself, as before; :meth:`AgentCheckpointManager.flush` (and ``close``) wait
until the agent has handled every request sent, so a step saved
asynchronously just before the end is durable before the worker exits.
Without the agent's socket, or without a snapshot of the step, a save falls
back to the trainer writer (``checkpoint_writer_fallback``, logged once).
"""

from __future__ import annotations

import json
import os
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from elastic_train.errors import CheckpointWriteError
from elastic_train.log import get_logger
from elastic_train.state.checkpoint import CheckpointManager
from elastic_train.state.checkpoint_files import remove_stale_temporaries
from elastic_train.state.snapshot import SnapshotStore
from elastic_train.state.snapshot_layout import ALGORITHM

__all__ = [
    "SOCKET_ENV",
    "STATUS_FILE",
    "AgentCheckpointManager",
    "PersistStatus",
    "persist_snapshot",
]

log = get_logger(__name__)

#: The node agent's persist socket, exported to every worker it spawns.
SOCKET_ENV = "ELASTIC_TRAIN_PERSIST_SOCKET"
STATUS_FILE = "status.json"
#: How long flush() waits for the agent; a persist of a 200 MB state takes about 1 s.
FLUSH_TIMEOUT_S = 120.0


@dataclass
class PersistStatus:
    """What the agent has done, per requesting worker (pid as a string)."""

    handled: dict[str, int] = field(default_factory=dict)  # the newest seq handled
    failures: dict[str, int] = field(default_factory=dict)  # consecutive failed persists
    errors: dict[str, str] = field(default_factory=dict)  # the last failure's message
    unusable: dict[str, str] = field(default_factory=dict)  # why its snapshot could not be read
    saved_step: int | None = None
    total_failures: int = 0
    agent_pid: int | None = None

    @classmethod
    def read(cls, path: Path) -> PersistStatus:
        """The status in ``path``; an empty one where there is none yet (or it is unreadable)."""
        try:
            return cls(**json.loads(path.read_bytes()))
        except (OSError, ValueError, TypeError):
            return cls()

    def write(self, path: Path) -> None:
        """Replace ``path`` atomically: a reader sees the old or the new status, never half."""
        temporary = path.with_name(f".{path.name}.tmp")
        temporary.write_text(json.dumps(asdict(self)))
        os.replace(temporary, path)

    def forget_all_but(self, pids: list[str]) -> None:
        """Keep the entries of ``pids`` only (the status must not grow with restarts)."""
        for table in (self.handled, self.failures, self.errors, self.unusable):
            for pid in [p for p in table if p not in pids]:
                del table[pid]


def persist_snapshot(request: dict[str, Any], managers: dict[tuple, CheckpointManager]) -> int:
    """The agent's side: copy the requested step (or a newer one) out of the node's
    snapshot, verified, and write the slot's bytes as they are as a checkpoint
    (``state.slot``: no decode, no second serialization); the step written.

    ``managers`` caches one manager per checkpoint directory (made here, so stale
    temporaries are removed once per agent). Raises ``CheckpointWriteError``,
    ``SnapshotError`` or ``OSError``.
    """
    store = SnapshotStore(
        request["snapshot_run_id"], fingerprint=request["fingerprint"],
        root=request["snapshot_root"], is_writer=False,
    )  # fmt: skip
    try:
        header, raw = store.copy_published(min_step=request["step"])
    finally:
        store.close()
    step = header["step"]
    key = (request["checkpoint_dir"], request["keep"], request["fingerprint"])
    if key not in managers:
        managers[key] = CheckpointManager(
            request["checkpoint_dir"], keep=request["keep"], fingerprint=request["fingerprint"],
            async_save=False, is_writer=True,
        )  # fmt: skip
    managers[key].write_slot(
        step, raw, digest=header[ALGORITHM], metadata={**request["metadata"], "step": step}
    )
    return step


class AgentCheckpointManager(CheckpointManager):
    """A :class:`CheckpointManager` whose asynchronous saves the node agent writes."""

    def __init__(
        self,
        directory: str | Path,
        *,
        keep: int,
        fingerprint: str,
        async_save: bool,
        is_writer: bool,
        socket_path: str,
        chosen: bool = True,
    ) -> None:
        """``chosen``: ``checkpoint.writer = "agent"`` was set; with ``"auto"`` a node
        without snapshots (``elastic.snapshot = false``) has the trainer write, quietly."""
        # The agent may be persisting into the directory while this worker
        # starts: it removes stale temporaries itself, once (persist_snapshot).
        super().__init__(
            directory, keep=keep, fingerprint=fingerprint, async_save=async_save,
            is_writer=is_writer, remove_temporaries=False,
        )  # fmt: skip
        self.socket_path = socket_path
        self.status_path = Path(socket_path).with_name(STATUS_FILE)
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._socket.setblocking(False)
        self._pid = str(os.getpid())
        self._seq = 0
        self._store: SnapshotStore | None = None
        self._hold: Callable[[int, dict], bool] | None = None
        self._fallback_logged = False
        self._chosen = chosen
        #: Saves the agent was asked for, and those the trainer wrote itself.
        self.requested = 0
        self.fallbacks = 0
        #: The agent's consecutive failed persists of this worker's requests, and the last error.
        self.agent_failures = 0
        self.agent_error: str | None = None
        #: Set once the agent could not read this node's snapshot: the trainer writes.
        self.agent_unusable: str | None = None

    def attach(self, store: SnapshotStore, hold: Callable[[int, dict], bool]) -> None:
        """The node's snapshot store, and ``hold(step, state)``: make it hold ``step``."""
        self._store, self._hold = store, hold

    def save(self, step: int, state: dict, *, blocking: bool = False) -> None:
        if blocking or not self.async_save or not self.is_writer or self._closed:
            # Durable before it returns, written here; the agent first finishes what
            # it was asked (it may persist a newer step than asked: never this one twice).
            if self.is_writer and not self._closed:
                self.flush()
                if self._agent_idle():
                    # No other node's agent is asked (one rank 0): a .tmp-step-* now is
                    # a killed writer's, which no worker of this writer removed at its
                    # start (the agent may write then).
                    remove_stale_temporaries(self.directory)
            super().save(step, state, blocking=blocking)
            return
        started = time.perf_counter()
        problem = self._request(step, state)
        if problem is None:
            self.requested += 1
            log.debug("checkpoint_requested_from_agent", step=step,
                      seconds=round(time.perf_counter() - started, 6))  # fmt: skip
            return
        self.fallbacks += 1
        if not self._fallback_logged:
            expected = self._store is None and not self._chosen
            (log.info if expected else log.warning)(
                "checkpoint_writer_fallback", step=step, reason=problem, writer="trainer"
            )
            self._fallback_logged = True
        super().save(step, state)

    def _request(self, step: int, state: dict) -> str | None:
        """Ask the agent to persist ``step``; None once asked, else why not."""
        if self._store is None or self._hold is None:
            return "no snapshot store on this node (elastic.snapshot = false, or it failed)"
        if self.agent_unusable is not None:
            return f"the node agent could not read the snapshot: {self.agent_unusable}"
        if not self._hold(step, state):
            return f"the node's snapshot could not take step {step}"
        self._seq += 1
        request = {
            "pid": self._pid, "seq": self._seq, "step": step,
            "snapshot_root": str(self._store.directory.parent),
            "snapshot_run_id": self._store.run_id, "fingerprint": self.fingerprint,
            "checkpoint_dir": str(self.directory), "keep": self.keep,
            "metadata": self._metadata(step),
        }  # fmt: skip
        try:
            self._socket.sendto(json.dumps(request).encode(), self.socket_path)
        except OSError as exc:  # the agent is gone (ENOENT, ECONNREFUSED) or swamped (EAGAIN)
            self._seq -= 1
            return f"node agent unreachable at {self.socket_path}: {exc}"
        return None

    def refresh(self) -> PersistStatus:
        """Read the agent's status: this worker's consecutive failed persists and last error."""
        status = PersistStatus.read(self.status_path)
        self.agent_failures = status.failures.get(self._pid, 0)
        self.agent_unusable = status.unusable.get(self._pid)
        if self.agent_failures and self._pid in status.errors:
            self.agent_error = status.errors[self._pid]
        return status

    def raise_if_failing(self, max_consecutive_failures: int) -> None:
        """The trainer's own failed saves (fallbacks) and the agent's failed persists
        each count; either reaching the limit raises ``CheckpointWriteError``."""
        if self.requested:
            self.refresh()
        if self.agent_failures >= max_consecutive_failures:
            raise CheckpointWriteError(
                f"{self.agent_failures} checkpoint persists in a row by the node agent failed "
                f"(limit checkpoint.max_consecutive_failures={max_consecutive_failures}); "
                f"last error: {self.agent_error}"
            )
        super().raise_if_failing(max_consecutive_failures)

    def flush(self) -> None:
        """Wait for the trainer's own write and until the agent handled every request."""
        super().flush()
        if not self._seq:
            return
        deadline, pause = time.monotonic() + FLUSH_TIMEOUT_S, 0.001
        while self._unhandled(status := PersistStatus.read(self.status_path)):
            if time.monotonic() > deadline or not _alive(status.agent_pid):
                log.error("checkpoint_agent_flush_failed", seq=self._seq,
                          agent_pid=status.agent_pid, path=str(self.status_path))  # fmt: skip
                return
            time.sleep(pause)  # polling the agent's status file, with a deadline
            pause = min(pause * 2, 0.05)
        self.refresh()

    def _agent_idle(self) -> bool:
        """Whether the agent has handled every request of this worker (flush() gives up
        after FLUSH_TIMEOUT_S)."""
        return not self._seq or not self._unhandled(PersistStatus.read(self.status_path))

    def _unhandled(self, status: PersistStatus) -> bool:
        return status.handled.get(self._pid, 0) < self._seq

    def close(self) -> None:
        super().close()  # flushes, the agent included
        self._socket.close()


def _alive(pid: int | None) -> bool:
    return pid is not None and psutil.pid_exists(pid)
