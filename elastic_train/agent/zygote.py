"""The node's zygote: a process that has imported torch and the trainer, and forks workers.

:class:`ZygoteProcess` (agent side) starts it from the node agent and stops
it with the agent; :func:`main` is the zygote itself; the launcher side is
:mod:`elastic_train.agent.warm_start`. One request per worker start:

1. the launcher connects (``SOCK_SEQPACKET``) and sends argv, environment,
   cwd, ``sys.path`` and its fds 0-2 (``SCM_RIGHTS``);
2. the zygote checks that the worker would see what a cold start sees (same
   main.py, interpreter, import-time environment, no threads to lose in the
   fork), forks, and answers ``{"pid": ...}`` or ``{"declined": reason}``;
3. the child adopts the request (own session, as torchrun's workers have) and
   runs the worker's entry as ``__main__``: the script or ``-m`` module of the
   torchrun command (:class:`~elastic_train.agent.worker_entry.WorkerEntry`);
   the zygote sends the child's wait status to the launcher when it is reaped.

Either side going away ends the other: the zygote and the child each watch
the launcher's end of the connection and SIGKILL the child on EOF (the zygote
also reaches a child that is stopped or stuck holding the GIL). The agent
going away ends them all: the zygote SIGKILLs every child it forked before it
exits (docs/warm-start.md, "Lifetimes").
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from elastic_train.agent import warm_start
from elastic_train.agent.adoption import adopt, refusal
from elastic_train.agent.worker_entry import WorkerEntry
from elastic_train.log import exit_now, on_exit_now

__all__ = ["ZYGOTE_NAME", "ZygoteProcess", "main", "preload", "trainer_processes"]

ZYGOTE_NAME = "et-zygote"
SOCKET_NAME = "zygote.sock"
DIRECTORY_PREFIX = "elastic-train-warm-"
#: seconds a connected launcher has to send its request
REQUEST_TIMEOUT_S = 10.0
#: torch._dynamo: the first optimizer construction imports it (about 1.5 s here)
PRELOADED = (
    "torch",
    "torch._dynamo",
    "torch.distributed",
    "torch.nn.parallel",
    "elastic_train.main",
)
#: seconds the zygote waits for its SIGKILLed children to be reaped, when its agent is gone
_KILL_WAIT_S = 1.0
#: A socket file younger than this is never taken for a dead zygote's.
_STALE_AFTER = 60.0
_BOOT = (
    "import sys; sys.path.insert(0, sys.argv[1]); "
    "from elastic_train.agent.zygote import main; main()"
)


class ZygoteProcess:
    """The agent's handle on its zygote: a private 0700 directory with the socket."""

    def __init__(
        self,
        entry: WorkerEntry,
        *,
        parent_dir: Path | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.entry = entry
        _remove_stale_directories(Path(parent_dir or tempfile.gettempdir()))
        self.directory = Path(tempfile.mkdtemp(prefix=DIRECTORY_PREFIX, dir=parent_dir))
        self.socket_path = self.directory / SOCKET_NAME
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            # Bound and listening before the zygote exists: a launcher that comes
            # while it still imports waits in the backlog instead of starting cold.
            listener.bind(str(self.socket_path))
            listener.listen(64)
            package_root = str(Path(__file__).resolve().parents[2])
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    _BOOT,
                    package_root,
                    str(listener.fileno()),
                    str(os.getpid()),
                    str(self.directory),
                ],
                pass_fds=(listener.fileno(),),
                env=environ,  # None: this process's, as the workers' will be
                stdin=subprocess.PIPE,  # EOF when this process is gone
                start_new_session=True,  # a terminal's Ctrl-C goes to the agent, not here
            )
            # On the pipe, not argv: the forked workers would show it as their command line.
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps([entry.target, entry.is_module]).encode() + b"\n")
            self.proc.stdin.flush()
        except BaseException:
            shutil.rmtree(self.directory, ignore_errors=True)
            raise
        finally:
            listener.close()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def close(self, timeout: float = 2.0) -> None:
        """Stop the zygote, which SIGKILLs the workers it forked, and remove the directory.

        torchrun has stopped its workers before its agent exits; a child still
        running then would be an orphan.
        """
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.directory, ignore_errors=True)


def _remove_stale_directories(parent: Path) -> None:
    """Remove the directories of zygotes that were SIGKILLed with their agent.

    A zygote removes its directory when its agent exits; a node killed as a
    whole cannot. A socket that no process holds any more is missing from the
    kernel's table of unix sockets.
    """
    try:
        table = Path("/proc/net/unix").read_text().splitlines()[1:]
    except OSError:
        return
    held = {line.split()[-1] for line in table if len(line.split()) == 8}
    for directory in parent.glob(f"{DIRECTORY_PREFIX}*"):
        sock = directory / SOCKET_NAME
        with contextlib.suppress(OSError):  # another agent may remove it meanwhile
            info = sock.stat()
            if (
                sock.is_socket()
                and info.st_uid == os.getuid()
                and str(sock) not in held
                # The table was read before the glob: a socket bound since then
                # is missing from it without being stale.
                and time.time() - info.st_mtime > _STALE_AFTER
            ):
                shutil.rmtree(directory)


def trainer_processes(agent: psutil.Process) -> list[psutil.Process]:
    """The processes that train under a torchrun agent, whether started cold or warm.

    A warm-started worker's PID (the one torchrun knows) is a launcher that
    only waits; the training runs in the zygote's child that its name points at.
    """
    found = []
    for child in agent.children():
        with contextlib.suppress(psutil.NoSuchProcess, psutil.ZombieProcess):
            name = child.name()
            if name == ZYGOTE_NAME:
                continue
            prefix = warm_start.launcher_name(0)[:-1]
            found.append(
                psutil.Process(int(name[len(prefix) :])) if name.startswith(prefix) else child
            )
    return found


def preload() -> None:
    """Import what every worker imports, without starting threads or touching CUDA."""
    for name in PRELOADED:
        importlib.import_module(name)


def main(argv: Sequence[str] | None = None) -> None:
    """The zygote: ``python -c _BOOT ROOT LISTEN_FD AGENT_PID DIRECTORY``; the entry on stdin."""
    fd, agent_pid, directory = (argv or sys.argv[1:])[-3:]
    # Also while importing, deaf to the pipe; the agent started us from its main thread.
    warm_start.set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != int(agent_pid):
        os._exit(0)  # the agent died before the line above
    entry = _read_entry()
    warm_start.set_process_name(ZYGOTE_NAME)
    listener = socket.socket(fileno=int(fd))
    # Before the imports, some of which set variables of their own (torch's inductor).
    startup_env = warm_start.import_time_environ(os.environ)
    preload()
    # Objects that exist now are never collected, so a collection in a child does
    # not write to (and copy) the pages it shares with the zygote.
    gc.freeze()
    # From here the agent's pipe tells: unlike a signal, it lets us end our children
    # (forked, they have no parent-death signal, and may have lost their launchers'
    # watch while stopped) and remove the socket directory.
    warm_start.set_parent_death_signal(0)
    server = _Server(listener, startup_env, entry)
    server.serve()
    server.kill_children()
    shutil.rmtree(directory, ignore_errors=True)
    os._exit(0)  # nothing to finalize; torch's teardown would only delay the agent's exit


def _read_entry() -> WorkerEntry:
    """The worker entry, the first line the agent writes to our stdin (unbuffered:
    the same descriptor later tells us the agent is gone)."""
    line = b""
    while not line.endswith(b"\n"):
        chunk = os.read(0, 4096)
        if not chunk:
            os._exit(0)  # the agent is gone already
        line += chunk
    target, is_module = json.loads(line)
    return WorkerEntry(target, is_module=is_module)


@dataclass
class _Child:
    pid: int
    pidfd: int
    conn: socket.socket


class _Server:
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
