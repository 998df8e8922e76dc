"""Warm worker start, launcher side: hand this worker over to the node's zygote.

torchrun starts every worker as ``python -u elastic_train/main.py ...``. Python,
``import torch``, ``torch._dynamo`` (imported on the first optimizer
construction) and our modules cost about 3 s on a small machine, paid again on
every restart of every node. The node agent keeps one zygote per node that has
imported all of it (:mod:`elastic_train.agent.zygote`); main.py calls
:func:`hand_over` before importing torch. It sends argv, the environment, the
working directory and the stdin/stdout/stderr descriptors over the zygote's
unix socket; the zygote forks a child that becomes the worker.

This process, the one torchrun knows by its PID, stays as a thin launcher: it
forwards the signals torchrun or a scheduler sends, and exits as the child
did (the same exit code, or the same signal). The child dies with it, even on
SIGKILL. When the zygote cannot take the worker, the launcher logs one
``warm_start_unavailable`` warning and the worker starts the ordinary way.

Warm or cold, :func:`hand_over` first ties the worker's life to its node
agent's (:func:`die_with_agent`): no worker trains on once its agent is gone,
however the agent died.

Only the standard library is imported here: this runs on every worker start.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping
from types import FrameType
from typing import Any, NoReturn

__all__ = [
    "AGENT_PID_ENV",
    "FORWARDED_SIGNALS",
    "SOCKET_ENV",
    "die_with_agent",
    "hand_over",
    "import_time_environ",
    "interpreter_fingerprint",
    "parse_warm_start",
    "set_parent_death_signal",
]

#: the zygote's socket, exported by the node agent to the workers it spawns
SOCKET_ENV = "ELASTIC_TRAIN_WARM_START_SOCKET"
#: the node agent's PID, exported by the node agent to the workers it spawns
AGENT_PID_ENV = "ELASTIC_TRAIN_AGENT_PID"
#: what a scheduler or torchrun may send a worker; SIGKILL and SIGSTOP cannot be relayed
FORWARDED_SIGNALS = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGHUP,
)
#: Variables read while the zygote imports (by the interpreter, OpenMP/BLAS, torch's
#: logging and compiler configs, prometheus-client's value class, the C library):
#: a worker whose values differ from the zygote's must start cold.
IMPORT_TIME_ENV_PREFIXES = (
    "PYTHON", "LANG", "LC_", "LD_", "MALLOC_", "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_",
    "TORCH_LOGS", "TORCHDYNAMO_", "TORCHINDUCTOR_", "TORCH_COMPILE", "PROMETHEUS_MULTIPROC_DIR",
)  # fmt: skip
#: seconds to wait for the zygote's answer; it may still be importing at a node's first start
READY_TIMEOUT_S = 30.0
MAX_MESSAGE_BYTES = 1 << 20
#: a dotted module name, as the ``preload`` rdzv-conf key takes them
_MODULE_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")
#: the accepted values of the ``warm_start`` rdzv-conf key
_BOOLEANS = {"1": True, "true": True, "on": True, "0": False, "false": False, "off": False}
_PR_SET_PDEATHSIG = 1
_PR_SET_NAME = 15


class WarmStartUnavailable(Exception):
    """The zygote cannot take this worker; the message says why."""


def parse_warm_start(text: str | None) -> bool | None:
    """The ``warm_start`` rdzv-conf value, None for ``auto`` or unset; ``ValueError``
    names the key and accepted values."""
    key = None if text is None else str(text).strip().lower()
    if key is None or key == "auto":
        return None
    value = _BOOLEANS.get(key)
    if value is None:
        raise ValueError(
            f"warm_start={text!r} is invalid: expected one of 1, 0, true, false, on, off, auto"
        )
    return value


def parse_preload(text: str | None) -> tuple[str, ...]:
    """The ``preload`` rdzv-conf value: module names joined by ``+`` (torchrun splits
    rdzv-conf at commas); ``ValueError`` names the key and the bad name."""
    names = tuple(n.strip() for n in (text or "").replace(",", "+").split("+") if n.strip())
    for name in names:
        if not _MODULE_NAME.fullmatch(name):
            raise ValueError(
                f"preload: {name!r} is not a module name; expected dotted names joined "
                "by '+', such as preload=transformers+torchvision.models"
            )
    return names


def import_time_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """The part of ``environ`` that a process reads while importing, not later."""
    return {k: v for k, v in environ.items() if k.startswith(IMPORT_TIME_ENV_PREFIXES)}


def interpreter_fingerprint() -> dict[str, Any]:
    """What must match between launcher and zygote; ``-u`` does not (the child re-creates stdio)."""
    flags = {name: getattr(sys.flags, name) for name in dir(sys.flags) if name[0].isalpha()}
    for name in ("count", "index"):  # tuple methods
        flags.pop(name, None)
    return {"executable": sys.executable, "version": sys.version, "flags": flags}


def fork_hazard() -> str | None:
    """Why a fork of this process would not be a sound copy, as "<this process> ...":
    CUDA initialised (torch refuses it in a fork) or a thread (a fork has only the
    one that forked); None when there is neither."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return "started CUDA"
    threads = threading.active_count()
    return f"left {threads} threads" if threads != 1 else None


def close_descriptors_but(*kept: int) -> None:
    """What ``Popen(close_fds=True)`` does: in a forked child, nothing of the parent's
    stays open but ``kept``."""
    low = 0
    for fd in (*sorted(kept), os.sysconf("SC_OPEN_MAX")):
        if low < fd:  # os.closerange(n, n) closes everything from n (close_range(n, ~0))
            os.closerange(low, fd)
        low = fd + 1


def set_process_name(name: str) -> None:
    """Set the name ``ps`` and psutil show (Linux ``comm``, at most 15 bytes)."""
    import ctypes  # only on Linux, and only once the hand-over worked

    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def set_parent_death_signal(sig: int) -> None:
    """Have the kernel send ``sig`` to this process when its parent dies (0: never; Linux).

    The kernel means the parent *thread* that forked this process: torchrun's
    agent and our node agent start workers and the zygote from their main thread.
    """
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)


def die_with_agent() -> None:
    """End this process with SIGKILL as soon as the node agent that started it dies.

    Does nothing unless the node agent exported :data:`AGENT_PID_ENV` (it does
    for every worker torchrun spawns) and this is Linux. A process the agent
    started itself gets ``PR_SET_PDEATHSIG``: the kernel acts, whatever killed
    the agent, SIGKILL included, and even while this process is stopped or
    holds the GIL. Any other process (a zygote's child, whose parent is the
    zygote; a worker behind a wrapper) watches the agent's pidfd from a
    thread. One whose agent is gone already ends here.
    """
    text = os.environ.get(AGENT_PID_ENV, "")
    if not text.isdigit() or sys.platform != "linux":
        return
    agent = int(text)
    set_parent_death_signal(signal.SIGKILL)
    # After arming: an agent that died before is no longer our parent (re-parented).
    if os.getppid() == agent:
        return
    set_parent_death_signal(0)  # our parent is someone else; its death is not the agent's
    try:
        pidfd = os.pidfd_open(agent)
    except ProcessLookupError:
        _die()
    # A dead agent not yet reaped (a zombie) makes the pidfd readable at once.
    threading.Thread(target=_die_on_exit_of, args=(pidfd,), name="agent-watch", daemon=True).start()


def _die_on_exit_of(pidfd: int) -> None:
    """Blocks until the process behind ``pidfd`` has exited, then ends this one."""
    select.select([pidfd], [], [])
    _die()


def _die() -> NoReturn:
    """SIGKILL, as the parent-death signal would: nothing of the worker may run on."""
    os.kill(os.getpid(), signal.SIGKILL)
    os._exit(128 + signal.SIGKILL)  # not reached: a signal to oneself is delivered at once


def launcher_name(child_pid: int) -> str:
    """A launcher's process name: it points at the child that trains for it."""
    return f"warm:{child_pid}"


class _SignalRelay:
    """Forwards the launcher's signals to the child; holds them until its PID is known."""

    def __init__(self) -> None:
        self._pidfd: int | None = None
        self._pending: list[int] = []
        self._previous = {sig: signal.getsignal(sig) for sig in FORWARDED_SIGNALS}
        for sig in FORWARDED_SIGNALS:
            signal.signal(sig, self._handle)

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self._pidfd is None:
            self._pending.append(signum)
            return
        # A pidfd, not the PID: the PID could be reused once the zygote reaps the child.
        with contextlib.suppress(ProcessLookupError):
            signal.pidfd_send_signal(self._pidfd, signum)

    def attach(self, pid: int) -> None:
        try:
            self._pidfd = os.pidfd_open(pid)
        except ProcessLookupError:  # already exited: its status is on the way
            self._pending.clear()
            return
        for signum in self._pending:
            self._handle(signum, None)
        self._pending.clear()

    def restore(self) -> None:
        """Back to the dispositions of a normal start, then deliver what was held."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        for signum in self._pending:
            os.kill(os.getpid(), signum)


def hand_over(main_file: str) -> None:
    """Run this worker in a child of the node's zygote; returns only to start cold.

    Does nothing more than :func:`die_with_agent` (returns at once) unless
    the node agent exported :data:`SOCKET_ENV` and this is Linux.
    """
    die_with_agent()
    path = os.environ.get(SOCKET_ENV)
    if not path or sys.platform != "linux":
        return
    relay = _SignalRelay()
    try:
        conn, pid = _request(path, main_file)
    except Exception as exc:  # whatever went wrong, a cold start still works
        relay.restore()
        _log_fallback(path, exc)
        return
    relay.attach(pid)
    set_process_name(launcher_name(pid))
    outcome = _wait_for_exit(conn)
    if isinstance(outcome, str):  # the child failed before running anything of the worker
        conn.close()
        set_process_name(os.path.basename(sys.executable))
        relay.restore()
        _log_fallback(path, WarmStartUnavailable(outcome))
        return
    _exit_like(outcome)


def _request(path: str, main_file: str) -> tuple[socket.socket, int]:
    """Send this worker to the zygote; the connected socket and the child's PID."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        conn.settimeout(READY_TIMEOUT_S)
        conn.connect(path)
        request = {
            "main_file": os.path.realpath(main_file),
            "argv": sys.argv,
            "env": dict(os.environ),
            "cwd": os.getcwd(),
            "path": sys.path,
            # -u or PYTHONUNBUFFERED (torchrun runs workers with -u)
            "unbuffered": bool(getattr(sys.stdout, "write_through", False)),
            "interpreter": interpreter_fingerprint(),
            "launcher_pid": os.getpid(),
            "sent_at": time.time(),
        }
        socket.send_fds(conn, [json.dumps(request).encode()], [0, 1, 2])
        reply = json.loads(conn.recv(MAX_MESSAGE_BYTES) or b"{}")
        if "pid" not in reply:
            raise WarmStartUnavailable(reply.get("declined", "the zygote closed the connection"))
        conn.settimeout(None)
        return conn, int(reply["pid"])
    except BaseException:
        conn.close()
        raise


def _wait_for_exit(conn: socket.socket) -> int | str:
    """The child's exit code, minus the signal that ended it (like ``Popen.returncode``),
    or why it could not become the worker (then nothing of the worker ran).

    The zygote's wait status comes once the child is reaped, so nothing of it
    lingers when torchrun sees this process exit. Without a zygote (its agent
    died), the code the child reported is used once its end of the socket closes.
    """
    reported: int | None = None
    while message := conn.recv(MAX_MESSAGE_BYTES):
        outcome = json.loads(message)
        if "fallback" in outcome:
            return str(outcome["fallback"])
        if "status" in outcome:
            return os.waitstatus_to_exitcode(outcome["status"])
        reported = int(outcome["exit_code"])
    if reported is not None:
        return reported
    from elastic_train.log import configure_logging_if_unconfigured, get_logger

    configure_logging_if_unconfigured()
    get_logger(__name__).error("warm_start_exit_status_lost", exit_code=1)
    return 1


def _exit_like(code: int) -> NoReturn:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    if code < 0:
        if -code in FORWARDED_SIGNALS:  # ours relays it; the others are at their default
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        code = 128 - code  # a signal whose default action does not end the process
    os._exit(code)


def _log_fallback(path: str, exc: BaseException) -> None:
    from elastic_train.log import configure_logging_if_unconfigured, get_logger

    configure_logging_if_unconfigured()
    reason = str(exc) or type(exc).__name__
    if isinstance(exc, OSError) and exc.strerror:
        reason = f"{type(exc).__name__}: {exc.strerror}"
    get_logger(__name__).warning("warm_start_unavailable", reason=reason, socket=path)
