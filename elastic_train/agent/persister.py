"""The node agent's checkpoint persister (``checkpoint.writer = "agent"``).

One thread of the torchrun agent process, which does not share the training
process's GIL: it receives the checkpoint writer rank's requests on a Unix
datagram socket and writes each from the node's ``/dev/shm`` snapshot
(``state/persist.py`` has the protocol and the trainer's side). The socket
and ``status.json`` live in a 0700 directory of this agent's own under the
system temporary directory, removed when the agent exits (a SIGKILLed agent's
is removed by the next agent that starts under the same directory: its socket
refuses connections); the socket's path reaches the workers in
``persist.SOCKET_ENV``.

A request that fails (disk full, permission denied, the snapshot gone) is
logged (``checkpoint_persist_failed``) and counted per requesting worker in
the status, which that worker reads at its next save; the previous
checkpoints are never touched (``CheckpointManager.write``). A kill of the
agent in the middle of a write leaves a ``.tmp-step-*`` directory, which
never counts and is removed by the next agent's first write.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import socket
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

from elastic_train.errors import CheckpointError, SnapshotError
from elastic_train.log import get_logger, thread_context
from elastic_train.state.checkpoint import CheckpointManager
from elastic_train.state.persist import STATUS_FILE, PersistStatus, persist_snapshot

__all__ = ["Persister", "remove_dead_directories"]

log = get_logger(__name__)

#: Workers whose entries the status keeps (one per restart of the writer rank).
_KEEP_PIDS = 8
_MAX_REQUEST = 1 << 16
#: How often the idle thread looks at the stop flag; close() wakes it at once.
_POLL_S = 0.5
#: The longest Unix socket path Linux binds (sun_path is 108 bytes with its NUL).
_SOCKET_PATH_MAX = 107
_PREFIX = "elastic_train-persist-"


def remove_dead_directories(parent: Path) -> int:
    """Remove this user's persister directories under ``parent`` whose agent is gone.

    A killed agent cannot remove its own. Gone means its socket file refuses a
    connection, which holds across PID namespaces sharing the directory (a PID
    check would not); a directory still being set up has no socket yet and is
    left alone. Returns how many were removed.
    """
    removed = 0
    for directory in parent.glob(f"{_PREFIX}*"):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            if directory.lstat().st_uid != os.getuid():
                continue
            probe.connect(str(directory / "sock"))
        except ConnectionRefusedError:
            shutil.rmtree(directory, ignore_errors=True)
            removed += 1
        except OSError:
            continue  # no socket yet, not ours, or gone meanwhile
        finally:
            probe.close()
    return removed


#: The persister thread's nice value: below the workers it shares the cores with.
PERSIST_NICE = 19


def _yield_to_workers() -> None:
    """Lower this thread's CPU priority (Linux: a thread has its own nice value).

    A checkpoint is durable a few milliseconds later either way; a worker
    delayed by the same milliseconds delays every rank's step. The workers of
    a step wait on their all-reduce for part of it, so the persister still
    runs, in those gaps. Only this thread: the agent's heartbeats and
    rendezvous keep their priority.
    """
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PERSIST_NICE)
    except (OSError, AttributeError) as exc:  # not Linux, or a sandbox refusing it
        log.info("checkpoint_persister_priority_unchanged", reason=str(exc))


class Persister:
    """Receives persist requests and writes them, one at a time, in a thread."""

    def __init__(self, parent_dir: str | Path | None = None) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix=_PREFIX, dir=parent_dir))
        if len(os.fsencode(self.directory / "sock")) > _SOCKET_PATH_MAX:
            # bind() refuses longer socket paths (sun_path); /tmp is short anywhere.
            self.directory.rmdir()
            self.directory = Path(tempfile.mkdtemp(prefix=_PREFIX, dir="/tmp"))
        if removed := remove_dead_directories(self.directory.parent):
            log.info("checkpoint_persister_leftovers_removed", directories=removed)
        self.socket_path = self.directory / "sock"
        self.status_path = self.directory / STATUS_FILE
        self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._socket.bind(str(self.socket_path))
        # Non-blocking, waited on with select(): a socket timeout would make even a
        # MSG_DONTWAIT recv wait that long, and a steady stream never drain.
        self._socket.setblocking(False)
        self._status = PersistStatus(agent_pid=os.getpid())
        self._status.write(self.status_path)
        self._managers: dict[tuple, CheckpointManager] = {}
        self._stop = threading.Event()
        # close() writes here: select() returns at once instead of after _POLL_S.
        self._wake_read, self._wake_write = os.pipe()
        self._thread = threading.Thread(target=self._run, name="checkpoint-persister", daemon=True)
        #: Requests written, failed, and superseded by a newer one before their turn.
        self.saved = self.failed = self.superseded = 0

    def start(self) -> Persister:
        # The agent process runs no other torch work. Its copy and checksum of a
        # slot are a few hundred microseconds on one thread; with torch's default
        # pool the idle threads spin after each op, and on a box whose cores run
        # the workers that spin cost them 3x the persist itself (8.1 against
        # 2.6 ms of agent CPU per checkpoint of the benchmark MLP, measured).
        torch.set_num_threads(1)
        self._thread.start()
        log.info("checkpoint_persister_started", socket=str(self.socket_path))
        return self

    def close(self, *, timeout: float = 30.0) -> None:
        """Stop after the request in hand (waiting up to ``timeout``), remove the directory."""
        if self._stop.is_set():
            return
        self._stop.set()
        os.write(self._wake_write, b"x")
        self._thread.join(timeout)
        self._socket.close()
        os.close(self._wake_read)
        os.close(self._wake_write)
        shutil.rmtree(self.directory, ignore_errors=True)

    def _run(self) -> None:
        _yield_to_workers()
        while not self._stop.is_set():
            requests = self._receive()
            if requests:
                self._handle_newest(requests)

    def _receive(self) -> list[dict[str, Any]]:
        """Every request waiting now; waits up to ``_POLL_S`` for the first."""
        found: list[dict[str, Any]] = []
        try:
            ready, _, _ = select.select([self._socket, self._wake_read], [], [], _POLL_S)
            if self._socket not in ready:
                return found
            while True:
                data = self._socket.recv(_MAX_REQUEST)
                try:
                    found.append(json.loads(data))
                except ValueError:
                    log.warning("checkpoint_persist_bad_request", bytes=len(data))
        except (BlockingIOError, InterruptedError):
            return found
        except (OSError, ValueError):  # closed under us
            return found

    def _handle_newest(self, requests: list[dict[str, Any]]) -> None:
        newest = requests[-1]
        for older in requests[:-1]:
            # Its step was overwritten in the slot by the newer one's: nothing to fail.
            self._mark_handled(older)
            self.superseded += 1
        started = time.perf_counter()
        metadata = newest.get("metadata")
        world_size = metadata.get("world_size") if isinstance(metadata, dict) else None
        try:
            # Its events (checkpoint_saved) have the agent's context, not a worker's.
            with thread_context(world_size=world_size):
                step = persist_snapshot(newest, self._managers)
        except SnapshotError as exc:
            # The snapshot, not the disk: the trainer writes itself from now on
            # (it reads this in the status), and this is no failed disk write.
            self._status.unusable[str(newest.get("pid"))] = str(exc)
            log.warning("checkpoint_persist_no_snapshot", step=newest.get("step"), error=str(exc))
        except (CheckpointError, OSError, KeyError, TypeError) as exc:
            self._failed(newest, exc)
        except Exception as exc:  # a bug must not end the thread, nor vanish
            log.exception("checkpoint_persister_crashed", step=newest.get("step"))
            self._failed(newest, exc)
        else:
            self.saved += 1
            self._status.saved_step = step
            self._status.failures[str(newest["pid"])] = 0
            log.info("checkpoint_persisted", step=step, requested_step=newest["step"],
                     seconds=round(time.perf_counter() - started, 4))  # fmt: skip
        self._mark_handled(newest)
        self._write_status()

    def _failed(self, request: dict[str, Any], exc: BaseException) -> None:
        pid = str(request.get("pid"))
        self.failed += 1
        self._status.total_failures += 1
        self._status.failures[pid] = self._status.failures.get(pid, 0) + 1
        self._status.errors[pid] = f"persisting step {request.get('step')}: {exc}"
        log.error("checkpoint_persist_failed", step=request.get("step"), error=str(exc),
                  consecutive_failures=self._status.failures[pid])  # fmt: skip

    def _mark_handled(self, request: dict[str, Any]) -> None:
        pid = str(request.get("pid"))
        seq = request.get("seq", 0)
        self._status.handled[pid] = max(self._status.handled.get(pid, 0), seq)
        self._status.handled[pid] = self._status.handled.pop(pid)  # the newest pid last

    def _write_status(self) -> None:
        self._status.forget_all_but(list(self._status.handled)[-_KEEP_PIDS:])
        try:
            self._status.write(self.status_path)
        except OSError as exc:
            log.error("checkpoint_persist_status_failed", error=str(exc))
