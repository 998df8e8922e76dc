"""How a zygote's forked child becomes a worker, as a cold start would make it.

:func:`refusal` runs in the zygote before it forks: why the fork would not
give what a cold start gives (another entry file, interpreter, import-time
environment, a thread to lose). :func:`adopt` runs in the forked child: it
takes over the launcher's descriptors, environment, working directory, argv
and ``sys.path``, and dies with the launcher.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from elastic_train.agent import warm_start

__all__ = ["adopt", "refusal"]

#: what a launcher's request holds (warm_start._request)
_REQUEST_KEYS = frozenset(
    {"main_file", "argv", "env", "cwd", "path", "unbuffered", "interpreter", "launcher_pid",
     "sent_at"}
)  # fmt: skip


def refusal(
    request: Any, fds: list[int], ours: dict[str, str], entry_file: str | None, *, truncated: bool
) -> str | None:
    """Why this zygote cannot start the worker as a cold start would, or None."""
    complete = isinstance(request, dict) and request.keys() >= _REQUEST_KEYS
    if truncated or len(fds) != 3 or not complete:
        return "the request or its file descriptors arrived incomplete"
    if entry_file != request["main_file"]:
        return f"the zygote runs {entry_file}, the worker {request['main_file']}"
    if request["interpreter"] != warm_start.interpreter_fingerprint():
        return "the worker's Python interpreter or its flags differ from the zygote's"
    theirs = warm_start.import_time_environ(request["env"])
    differing = sorted(k for k in ours.keys() | theirs.keys() if ours.get(k) != theirs.get(k))
    if differing:
        return f"import-time environment variables differ from the zygote's: {differing}"
    if (hazard := warm_start.fork_hazard()) is not None:
        return f"the zygote {hazard}; a fork of it is not safe"
    if not os.path.isdir(request["cwd"]):
        return f"the working directory {request['cwd']} is gone"
    return None


def adopt(request: dict[str, Any], conn: socket.socket, fds: list[int]) -> None:
    """In the forked child: take over the launcher's identity."""
    os.setsid()  # torchrun starts each worker in its own session
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
    for fd in set(fds) - {0, 1, 2}:
        os.close(fd)
    _reopen_stdio(unbuffered=request["unbuffered"])
    os.environ.clear()
    os.environ.update(request["env"])
    # The entry's own hand_over() call must start this process, not hand it on again.
    os.environ.pop(warm_start.SOCKET_ENV, None)
    os.chdir(request["cwd"])
    sys.argv[:] = request["argv"]
    sys.path[:] = request["path"]
    if "numpy" in sys.modules:  # seeded from the OS at import: one state for every child
        sys.modules["numpy"].random.seed()
    tempfile.tempdir = None  # chosen from the zygote's TMPDIR if an import asked already
    warm_start.set_process_name(Path(sys.executable).name)
    threading.Thread(
        target=_die_with_launcher, args=(conn,), name="warm-start-watch", daemon=True
    ).start()
    from elastic_train.log import configure_logging, get_logger

    configure_logging()  # main() configures it again from the job's config
    get_logger(__name__).info(
        "warm_start_forked",
        launcher_pid=request["launcher_pid"],
        handover_seconds=round(time.time() - request["sent_at"], 3),
    )


def _reopen_stdio(*, unbuffered: bool) -> None:
    """stdin/stdout/stderr on the adopted descriptors, buffered as CPython does at start-up."""
    for fd, name in enumerate(("stdin", "stdout", "stderr")):
        old = getattr(sys, name)
        raw = io.FileIO(fd, "r" if fd == 0 else "w", closefd=False)
        buffer: Any = (
            io.BufferedReader(raw) if fd == 0 else raw if unbuffered else io.BufferedWriter(raw)
        )
        stream = io.TextIOWrapper(
            buffer,
            encoding=old.encoding,
            errors=old.errors,
            line_buffering=not unbuffered and (fd == 2 or raw.isatty()),
            write_through=unbuffered,
        )
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _die_with_launcher(conn: socket.socket) -> None:
    """Blocks until the launcher's end closes, then ends this worker: no orphan may train on."""
    with contextlib.suppress(OSError):
        while conn.recv(1):
            pass
    os.kill(os.getpid(), signal.SIGKILL)
