"""Signals to whole process trees, by PID.

torchrun starts its workers with ``start_new_session=True``, so a signal to
an agent's process group never reaches them: a node kill has to find the
workers as the agent's descendants and signal each one. The tree is frozen
with SIGSTOP first, so the agent cannot start a worker between the listing
and the kill.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time

import psutil

from elastic_train.errors import ClusterError

#: seconds to wait for SIGKILLed processes to disappear
_REAP_TIMEOUT_S = 5.0


def descendants(root: psutil.Process) -> list[psutil.Process]:
    """All living descendants of ``root`` (empty when it is gone)."""
    try:
        return root.children(recursive=True)
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return []


def freeze_tree(root: psutil.Process) -> list[psutil.Process]:
    """SIGSTOP ``root`` and every descendant, until no new descendant appears."""
    frozen: dict[int, psutil.Process] = {}
    pending = [root]
    while pending:
        for proc in pending:
            with contextlib.suppress(psutil.NoSuchProcess, psutil.ZombieProcess):
                proc.suspend()
                frozen[proc.pid] = proc
        pending = [
            child
            for proc in list(frozen.values())
            for child in descendants(proc)
            if child.pid not in frozen
        ]
    return list(frozen.values())


def kill_tree(root: psutil.Process) -> list[psutil.Process]:
    """SIGKILL ``root`` and all its descendants; returns the processes signalled.

    It does not wait: see :func:`wait_gone`.
    """
    procs = freeze_tree(root)
    signal_all(procs, signal.SIGKILL)
    return procs


def wait_gone(
    procs: list[psutil.Process],
    *,
    timeout: float = _REAP_TIMEOUT_S,
    own: frozenset[int] = frozenset(),
) -> list[psutil.Process]:
    """Wait until ``procs`` are gone; returns those still alive after ``timeout``.

    PIDs in ``own`` are our ``Popen`` children: psutil's wait would reap them
    and steal their exit status from ``Popen``, so they are only polled.
    """
    deadline = time.monotonic() + timeout
    others = [p for p in procs if p.pid not in own]
    # psutil's pidfd_open raced a process that went meanwhile and raised
    # FileNotFoundError, which ended a 2-hour soak at its close: the poll
    # below decides what is gone.
    with contextlib.suppress(OSError):
        psutil.wait_procs(others, timeout=timeout)
    while (living := alive(procs)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return living


def signal_all(procs: list[psutil.Process], sig: int) -> None:
    """Send ``sig`` to each process that is still the one we saw (no PID reuse)."""
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.ZombieProcess):
            proc.send_signal(sig)


def alive(procs: list[psutil.Process]) -> list[psutil.Process]:
    """The processes that still run; zombies count as gone."""
    living = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                living.append(proc)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    return living


def marked_processes(marker_env: str, value: str) -> list[psutil.Process]:
    """This user's processes whose environment has ``marker_env=value``.

    The last sweep of a run: it also finds workers orphaned before the runner
    ever saw them (their agent died between two polls).
    """
    uid = psutil.Process().uids().real
    found = []
    for proc in psutil.process_iter(["uids"]):
        try:
            if proc.info["uids"] is None or proc.info["uids"].real != uid:
                continue
            if proc.environ().get(marker_env) == value:
                found.append(proc)
        except (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied):
            continue
    return found


def kill_survivors(
    procs: list[psutil.Process],
    *,
    own: frozenset[int] = frozenset(),
    timeout: float = _REAP_TIMEOUT_S,
) -> list[str]:
    """After a SIGKILL: wait for ``procs``, SIGKILL those left again, and wait once more.

    Returns :func:`describe` of those left after the first wait (empty when
    all went). ClusterError when some outlive the second SIGKILL too.
    """
    living = wait_gone(procs, timeout=timeout, own=own)
    if not living:
        return []
    survivors = describe(living)
    signal_all(living, signal.SIGKILL)
    if living := wait_gone(living, timeout=timeout, own=own):
        raise ClusterError(f"processes outlived two SIGKILLs: {describe(living)}")
    return survivors


def describe(procs: list[psutil.Process]) -> list[str]:
    """``pid:status:name`` of each process, for a message (``gone`` once it went)."""
    out = []
    for proc in procs:
        try:
            out.append(f"{proc.pid}:{proc.status()}:{proc.name()}")
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            out.append(f"{proc.pid}:gone")
    return out


@contextlib.contextmanager
def sigint_deferred():  # type: ignore[no-untyped-def]
    """Keep a second Ctrl-C from interrupting the cleanup it triggered."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
