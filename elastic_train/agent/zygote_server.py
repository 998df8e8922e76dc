"""The zygote's loop: it accepts launchers' requests, forks a worker for each, reaps them.

:class:`Server` runs in the zygote once it has imported torch and the trainer
(:mod:`elastic_train.agent.zygote` starts it); the request it answers is
described there, the launcher's side in :mod:`elastic_train.agent.warm_start`.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import socket
import sys
import time
from dataclasses import dataclass
from typing import Any

from elastic_train.agent import warm_start
from elastic_train.agent.adoption import adopt, refusal
from elastic_train.agent.worker_entry import WorkerEntry
from elastic_train.log import exit_now, on_exit_now

__all__ = ["Server"]

#: seconds a connected launcher has to send its request
REQUEST_TIMEOUT_S = 10.0
#: seconds the zygote waits for its SIGKILLed children to be reaped, when its agent is gone
_KILL_WAIT_S = 1.0


@dataclass
class _Child:
    pid: int
    pidfd: int
    conn: socket.socket


class Server:
    def __init__(
        self, listener: socket.socket, startup_env: dict[str, str], entry: WorkerEntry
    ) -> None:
        self._listener = listener
        self._entry = entry
        self._entry_file = entry.file()
        self._startup_env = startup_env
        self._selector = selectors.DefaultSelector()
        self._selector.register(listener, selectors.EVENT_READ, "accept")
        self._selector.register(sys.stdin.fileno(), selectors.EVENT_READ, "agent")
        self._children: dict[int, _Child] = {}

    def serve(self) -> None:
        while True:
            for key, _ in self._selector.select():
                kind = key.data if isinstance(key.data, str) else key.data[0]
                if kind == "agent" and not os.read(key.fd, 4096):
                    return  # the agent is gone
                if kind == "accept":
                    self._accept()
                elif kind == "launcher":
                    self._launcher_event(key.data[1])
                elif kind == "exited":
                    self._reap(key.data[1])

    def _accept(self) -> None:
        conn, _ = self._listener.accept()
        fds: list[int] = []
        try:
            conn.settimeout(REQUEST_TIMEOUT_S)
            message, fds, flags, _ = socket.recv_fds(conn, warm_start.MAX_MESSAGE_BYTES, 3)
            if message:  # else the launcher gave up before we got to it
                truncated = bool(flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC))
                request = json.loads(message)
                problem = refusal(
                    request, fds, self._startup_env, self._entry_file, truncated=truncated
                )
                if problem is None:
                    conn.settimeout(None)
                    self._fork(request, conn, fds)
                    return  # the connection is the child's now
                conn.send(json.dumps({"declined": problem}).encode())
        except (OSError, ValueError) as exc:
            print(f"elastic_train zygote: a request failed: {exc!r}", file=sys.stderr)
        finally:
            for fd in fds:
                os.close(fd)
        conn.close()

    def _fork(self, request: dict[str, Any], conn: socket.socket, fds: list[int]) -> _Child:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()  # nothing of ours may surface in the worker's output
        pid = os.fork()
        if pid == 0:
            try:
                self._close_in_child()
                adopt(request, conn, fds)
            except BaseException as exc:
                # Nothing of the worker has run: the launcher starts it cold instead.
                reason = {"fallback": f"the forked child could not take over: {exc!r}"}
                with contextlib.suppress(OSError):
                    conn.send(json.dumps(reason).encode())
                os._exit(1)
            # For the launcher, should this zygote be gone; also when the entry
            # ends itself with exit_now (main.py does).
            on_exit_now(lambda code: conn.send(json.dumps({"exit_code": code}).encode()))
            exit_now(self._entry.run())
        child = _Child(pid=pid, pidfd=os.pidfd_open(pid), conn=conn)
        self._children[pid] = child
        self._selector.register(child.pidfd, selectors.EVENT_READ, ("exited", child))
        self._selector.register(conn, selectors.EVENT_READ, ("launcher", child))
        with contextlib.suppress(OSError):  # a launcher gone meanwhile: its EOF ends the child
            conn.send(json.dumps({"pid": pid}).encode())
        return child

    def kill_children(self) -> None:
        """SIGKILL every child still running and reap them (bounded: one may be stuck in I/O)."""
        for child in self._children.values():
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(child.pidfd, signal.SIGKILL)
        exits = selectors.DefaultSelector()  # ours holds EOFs that stay readable
        for child in self._children.values():
            exits.register(child.pidfd, selectors.EVENT_READ, child)
        deadline = time.monotonic() + _KILL_WAIT_S
        while self._children and (left := deadline - time.monotonic()) > 0:
            for key, _ in exits.select(left):
                exits.unregister(key.fd)
                self._reap(key.data)
        exits.close()

    def _launcher_event(self, child: _Child) -> None:
        """The launcher sends nothing after its request: readable means it is gone."""
        with contextlib.suppress(OSError):
            if child.conn.recv(1):
                return
        self._selector.unregister(child.conn)
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(child.pidfd, signal.SIGKILL)

    def _reap(self, child: _Child) -> None:
        _, status = os.waitpid(child.pid, 0)
        with contextlib.suppress(OSError):
            child.conn.send(json.dumps({"status": status}).encode())
        self._selector.unregister(child.pidfd)
        with contextlib.suppress(KeyError):
            self._selector.unregister(child.conn)
        os.close(child.pidfd)
        child.conn.close()
        del self._children[child.pid]

    def _close_in_child(self) -> None:
        self._selector.close()
        self._listener.close()
        for other in self._children.values():
            os.close(other.pidfd)
            other.conn.close()
