"""The node's zygote: a process that has imported torch and the trainer, and forks workers.

:class:`ZygoteProcess` (agent side) starts it from the node agent and stops
it with the agent; :func:`main` is the zygote itself, its loop
:class:`~elastic_train.agent.zygote_server.Server`; the launcher side is
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

Two ways to start one. The torchrun plugin forks the agent itself
(:func:`fork_early`) before the agent has a thread, an etcd channel or a
metrics registry: torchrun has already imported torch there, so the zygote
only imports the rest, while the agent sets up. A zygote that replaces a dead
one, or an agent that had a thread already, spawns a fresh interpreter. So does
the forked one where torch would refuse CUDA in a fork of the agent (a CUDA
build of torch: torchrun has asked the driver for its devices): it execs.
Either way the zygote imports torch first and the trainer only once the agent
has sent the workers' environment (:meth:`ZygoteProcess.release`):
prometheus-client reads its multiprocess directory at import.

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
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import IO, NoReturn

import psutil

from elastic_train.agent import warm_start
from elastic_train.agent.worker_entry import WorkerEntry
from elastic_train.agent.zygote_server import Server

__all__ = [
    "EXIT_UNSAFE_PRELOAD",
    "ZYGOTE_NAME",
    "ZygoteProcess",
    "fork_early",
    "main",
    "preload",
    "trainer_processes",
    "zygote_entry",
]

ZYGOTE_NAME = "et-zygote"
SOCKET_NAME = "zygote.sock"
DIRECTORY_PREFIX = "elastic-train-warm-"
#: Imported before the agent's release; torch._dynamo: the first optimizer construction
#: imports it (about 1.5 s here).
TORCH_PRELOADED = ("torch", "torch._dynamo", "torch.distributed", "torch.nn.parallel")
#: Imported after it: prometheus-client, which the trainer imports, reads the
#: multiprocess directory the agent's metrics endpoint makes.
PRELOADED = (*TORCH_PRELOADED, "elastic_train.main")
#: Import-time variables the agent sets after an early fork, read by nothing in TORCH_PRELOADED.
SET_AFTER_FORK = frozenset({"PROMETHEUS_MULTIPROC_DIR"})
#: Imported in the agent, these could have state a fork must not share (a gRPC
#: channel; metric values of prometheus-client's in-process kind).
_UNFORKABLE = frozenset({"grpc", "prometheus_client"})
#: The exit code of a zygote that a ``preload`` made unsafe to fork from: the agent
#: does not replace it, since its replacement would import the same and exit again.
EXIT_UNSAFE_PRELOAD = 3
#: A socket file younger than this is never taken for a dead zygote's.
_STALE_AFTER = 60.0
_BOOT = (
    "import sys; sys.path.insert(0, sys.argv[1]); "
    "from elastic_train.agent.zygote import main; main()"
)


class ZygoteProcess:
    """The agent's handle on its zygote: a private 0700 directory with the socket.

    ``fork=False``: a fresh interpreter with ``environ`` (None: this
    process's), released at once. ``fork=True``: this process forked (it must
    have one thread and no gRPC channel: :func:`fork_early`); the agent calls
    :meth:`release` once its workers' environment is set.
    """

    def __init__(
        self,
        entry: WorkerEntry,
        *,
        parent_dir: Path | None = None,
        environ: Mapping[str, str] | None = None,
        fork: bool = False,
        preload: Sequence[str] = (),
    ) -> None:
        self.entry = entry
        self.forked = fork
        _remove_stale_directories(Path(parent_dir or tempfile.gettempdir()))
        self.directory = Path(tempfile.mkdtemp(prefix=DIRECTORY_PREFIX, dir=parent_dir))
        self.socket_path = self.directory / SOCKET_NAME
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            # Bound and listening before the zygote exists: a launcher that comes
            # while it still imports waits in the backlog instead of starting cold.
            listener.bind(str(self.socket_path))
            listener.listen(64)
            self.proc: subprocess.Popen[bytes] | _Forked = (
                _Forked.start(listener, self.directory) if fork else self._spawn(listener, environ)
            )
            if not fork:
                self.release(os.environ if environ is None else environ, preload=preload)
        except BaseException:
            shutil.rmtree(self.directory, ignore_errors=True)
            raise
        finally:
            listener.close()

    def _spawn(
        self, listener: socket.socket, environ: Mapping[str, str] | None
    ) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            _boot_argv(listener.fileno(), os.getpid(), self.directory),
            pass_fds=(listener.fileno(),),
            env=environ,  # None: this process's, as the workers' will be
            stdin=subprocess.PIPE,  # EOF when this process is gone
            start_new_session=True,  # a terminal's Ctrl-C goes to the agent, not here
        )  # fmt: skip

    @property
    def pid(self) -> int:
        return self.proc.pid

    def release(self, environ: Mapping[str, str], *, preload: Sequence[str] = ()) -> None:
        """Send the entry, the workers' environment and the modules to preload: the
        zygote imports the trainer and those, then serves.

        On the pipe, not argv or the environment: the forked workers would show them.
        """
        assert self.proc.stdin is not None
        message = {
            "entry": [self.entry.target, self.entry.is_module],
            "environ": dict(environ),
            "preload": list(preload),
        }
        self.proc.stdin.write(json.dumps(message).encode() + b"\n")
        self.proc.stdin.flush()

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


class _Forked:
    """What :class:`ZygoteProcess` uses of ``subprocess.Popen``, for a zygote forked
    from this process: ``stdin`` is the write end of the pipe on its fd 0."""

    def __init__(self, pid: int, stdin: IO[bytes]) -> None:
        self.pid = pid
        self.stdin: IO[bytes] | None = stdin
        self.returncode: int | None = None

    @classmethod
    def start(cls, listener: socket.socket, directory: Path) -> _Forked:
        read_end, write_end = os.pipe()
        agent_pid = os.getpid()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(ValueError, OSError):  # closed: nothing buffered
                stream.flush()  # else the child would write the agent's buffered lines again
        pid = os.fork()
        if pid == 0:
            _forked_zygote(listener, read_end, agent_pid, directory)
        os.close(read_end)
        return cls(pid, open(write_end, "wb", buffering=0))

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped by someone else: gone, status unknown
                pid, status = self.pid, 255 << 8
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.poll() is None:
            pidfd = os.pidfd_open(self.pid)
            try:
                if not select.select([pidfd], [], [], timeout)[0]:
                    raise subprocess.TimeoutExpired(f"zygote {self.pid}", timeout or 0.0)
            finally:
                os.close(pidfd)
        code = self.poll()
        assert code is not None
        return code

    def kill(self) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


def _forked_zygote(listener: socket.socket, pipe: int, agent_pid: int, directory: Path) -> NoReturn:
    """The child of ``ZygoteProcess(fork=True)``: made what ``python -c _BOOT`` starts as."""
    try:
        os.setsid()  # a terminal's Ctrl-C goes to the agent, not here
        warm_start.set_parent_death_signal(signal.SIGKILL)
        if os.getppid() != agent_pid:
            os._exit(0)  # the agent died before the line above
        os.dup2(pipe, 0)
        warm_start.close_descriptors_but(0, 1, 2, listener.fileno())
        _reset_signals_as_exec_does()
        if _cuda_refused_here():
            # torchrun asks torch.cuda.is_available() before it creates the rendezvous
            # handler (LaunchConfig), and torch then refuses CUDA in every fork of the
            # agent ("Cannot re-initialize CUDA in forked subprocess"): on a GPU each
            # worker forked from here would fail. Become the spawned zygote instead.
            os.set_inheritable(listener.fileno(), True)
            os.execv(sys.executable, _boot_argv(listener.fileno(), agent_pid, directory))
        _zygote(listener, directory)
    except BaseException:
        with contextlib.suppress(BaseException):
            traceback.print_exc()
    finally:
        os._exit(1)  # whatever happened: never back into the agent's code


def _boot_argv(listen_fd: int, agent_pid: int, directory: Path) -> list[str]:
    """The command line of a spawned zygote (:func:`main`)."""
    package_root = str(Path(__file__).resolve().parents[2])
    return [sys.executable, "-c", _BOOT, package_root, str(listen_fd), str(agent_pid),
            str(directory)]  # fmt: skip


def _cuda_refused_here() -> bool:
    """Whether torch would refuse to initialize CUDA in this process, a fork of one
    that asked the CUDA driver anything (``torch.cuda.is_available()`` is enough).
    Always False on a CPU-only build of torch."""
    torch = sys.modules.get("torch")
    return torch is not None and bool(torch.cuda._is_in_bad_fork())


def _reset_signals_as_exec_does() -> None:
    """The agent's handlers go; what it ignores stays ignored, as across the exec of a
    spawned zygote: Slurm's ``--signal=USR1`` reaches every process of the step, and
    ``deploy/slurm/train.sbatch`` starts torchrun with SIGUSR1 ignored for that."""
    for sig in warm_start.FORWARDED_SIGNALS:
        if signal.getsignal(sig) != signal.SIG_IGN:
            signal.signal(sig, signal.SIG_DFL)
    if signal.getsignal(signal.SIGINT) != signal.SIG_IGN:  # what Python's start-up does
        signal.signal(signal.SIGINT, signal.default_int_handler)


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


def fork_early(setting: str | None, argv: Sequence[str]) -> ZygoteProcess | None:
    """The node's zygote, forked from this torchrun agent before it starts anything;
    None where it cannot be (the reason is logged by the agent later).

    ``setting`` is the ``warm_start`` value (rdzv-conf key, else environment):
    an invalid one forks nothing here and the agent's settings report it. Call
    before this process makes a thread, a gRPC channel or a prometheus-client
    value: a fork keeps none of the first, and the child (and every worker it
    forks) would share the others' state.
    """
    try:
        enabled = warm_start.parse_warm_start(setting)
    except ValueError:
        return None
    entry, _ = zygote_entry(enabled, argv)
    if entry is None or threading.active_count() != 1 or _UNFORKABLE & sys.modules.keys():
        return None
    try:
        return ZygoteProcess(entry, fork=True)
    except OSError:
        return None  # the agent spawns one instead


def zygote_entry(enabled: bool | None, argv: Sequence[str]) -> tuple[WorkerEntry | None, str]:
    """The entry a zygote should preload for, or None and why not; ``enabled=None`` is auto."""
    if enabled is False:
        return None, "warm_start=0"
    if sys.platform != "linux":
        return None, f"Linux only, this is {sys.platform}"
    entry = WorkerEntry.from_torchrun_argv(argv)
    if entry is None:
        # Not a torchrun agent with a Python entry (tests, the rendezvous
        # benchmark): no import of torch to pay for, no socket to export.
        return None, "no Python worker entry on the command line"
    if enabled is None and not entry.is_ours():
        return None, "auto: the workers do not run our main.py"
    return entry, ""


def preload(names: Iterable[str] = PRELOADED) -> None:
    """Import what every worker imports, without starting threads or touching CUDA."""
    for name in names:
        importlib.import_module(name)


def main(argv: Sequence[str] | None = None) -> None:
    """The zygote: ``python -c _BOOT ROOT LISTEN_FD AGENT_PID DIRECTORY``; the entry on stdin."""
    fd, agent_pid, directory = (argv or sys.argv[1:])[-3:]
    # Also while importing, deaf to the pipe; the agent started us from its main thread.
    warm_start.set_parent_death_signal(signal.SIGKILL)
    if os.getppid() != int(agent_pid):
        os._exit(0)  # the agent died before the line above
    _zygote(socket.socket(fileno=int(fd)), Path(directory))


def _zygote(listener: socket.socket, directory: Path) -> NoReturn:
    """Import torch, wait for the release, import the trainer, serve until the agent goes."""
    warm_start.set_process_name(ZYGOTE_NAME)
    # Before the imports, some of which set variables of their own (torch's inductor).
    imported_with = warm_start.import_time_environ(os.environ)
    preload(TORCH_PRELOADED)
    entry, environ, extra = _read_release()
    startup_env = warm_start.import_time_environ(environ)
    changed = sorted(
        name
        for name in imported_with.keys() | startup_env.keys()
        if name not in SET_AFTER_FORK and imported_with.get(name) != startup_env.get(name)
    )
    if changed:
        print(
            f"elastic_train zygote: the agent changed {changed} after torch was imported "
            "here; this zygote exits and the workers start cold",
            file=sys.stderr,
        )
        os._exit(0)
    os.environ.update(environ)
    preload(PRELOADED[len(TORCH_PRELOADED) :])
    _preload_requested(extra)
    # Objects that exist now are never collected, so a collection in a child does
    # not write to (and copy) the pages it shares with the zygote.
    gc.freeze()
    # From here the agent's pipe tells: unlike a signal, it lets us end our children
    # (forked, they have no parent-death signal, and may have lost their launchers'
    # watch while stopped) and remove the socket directory.
    warm_start.set_parent_death_signal(0)
    server = Server(listener, startup_env, entry)
    server.serve()
    server.kill_children()
    shutil.rmtree(directory, ignore_errors=True)
    os._exit(0)  # nothing to finalize; torch's teardown would only delay the agent's exit


def _preload_requested(names: Sequence[str]) -> None:
    """The ``preload`` setting's modules (a model library's import can take longer
    than the trainer's). One that fails is left to the workers, which raise its
    error where the user sees it; one that started a thread or CUDA would make
    every fork unsafe (or unable to use CUDA), so the zygote then exits and the
    workers start cold."""
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:  # the worker's own import reports it
            print(f"elastic_train zygote: preload {name!r} failed: {exc!r}", file=sys.stderr)
    if (hazard := warm_start.fork_hazard()) is not None:
        print(
            f"elastic_train zygote: preload {list(names)} {hazard}; a fork of this process "
            "is not safe, so this zygote exits and the workers start cold",
            file=sys.stderr,
        )
        os._exit(EXIT_UNSAFE_PRELOAD)


def _read_release() -> tuple[WorkerEntry, dict[str, str], list[str]]:
    """The agent's release, the first line it writes to our stdin (unbuffered: the
    same descriptor later tells us the agent is gone)."""
    line = b""
    while not line.endswith(b"\n"):
        chunk = os.read(0, 1 << 16)
        if not chunk:
            os._exit(0)  # the agent is gone already
        line += chunk
    message = json.loads(line)
    target, is_module = message["entry"]
    return WorkerEntry(target, is_module=is_module), message["environ"], message["preload"]
