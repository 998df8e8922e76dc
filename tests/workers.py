"""Start the worker processes of multi-process tests, and one-process trainer runs
(``run_main``: ``python -m elastic_train.main``, ``run_code``: ``python -c``, without
a new interpreter).

Not ``fork``: by the time a test runs, the pytest process may hold gRPC and gloo
threads left by earlier tests, and a forked child can abort (SIGABRT) on their
state. ``forkserver`` forks from a clean server process that has imported torch
(and ``torch._dynamo``, which every optimizer imports on first use) once, so a
worker starts almost as fast as with ``fork``.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import os
import runpy
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "elastic_train.training.loop"]


def _forkserver() -> multiprocessing.context.ForkServerContext:
    """The forkserver context, its server preloading what every test worker imports."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(_PRELOAD)
    return context


def start_workers(fn: Callable[..., None], *, args: tuple[Any, ...], nprocs: int) -> None:
    """Run ``fn(rank, *args)`` in ``nprocs`` processes; raises if any fails."""
    _forkserver()  # torch's start_processes takes the same context by its name
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver", join=True)


def _as_a_new_interpreter(out_dir: str, argv: list[str]) -> None:
    """In a child of the forkserver: what a new interpreter would have. Its output to
    files (the server's children are not the pytest process's: capfd sees nothing)."""
    for fd, name in ((1, "stdout"), (2, "stderr")):
        target = os.open(os.path.join(out_dir, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    torch.set_num_threads(1)  # what OMP_NUM_THREADS=1 did for a new interpreter
    # A forkserver child inherits "forkserver" as its start method; a new interpreter has
    # the platform's default, which the DataLoader's workers use (forked from here, not
    # from the server, which has not imported the trainer's data and writes elsewhere).
    multiprocessing.set_start_method(None, force=True)
    sys.argv = argv


def _main_child(out_dir: str, argv: list[str], sys_path: list[str]) -> None:
    """``python -m elastic_train.main ARGV``, in a child of the forkserver."""
    sys.path[:0] = sys_path
    _as_a_new_interpreter(out_dir, ["elastic_train.main", *argv])
    # The module's __main__ block, exit code included (it ends in exit_now).
    runpy.run_module("elastic_train.main", run_name="__main__", alter_sys=True)


def _code_child(out_dir: str, code: str, argv: list[str]) -> None:
    """``python -c CODE ARGV``, in a child of the forkserver."""
    _as_a_new_interpreter(out_dir, ["-c", *argv])
    exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})


def _run_child(target: Callable[..., None], args: tuple[Any, ...], *, what: list[str],
               timeout: float) -> subprocess.CompletedProcess[str]:  # fmt: skip
    context = _forkserver()
    with tempfile.TemporaryDirectory(prefix="main-") as out_dir:
        child = context.Process(target=target, args=(out_dir, *args))
        child.start()
        child.join(timeout)
        if child.exitcode is None:
            child.kill()
            child.join()
            raise subprocess.TimeoutExpired(what, timeout)
        out, err = (Path(out_dir, n).read_text(errors="replace") for n in ("stdout", "stderr"))
    return subprocess.CompletedProcess(what, child.exitcode, out, err)


def run_main(
    argv: Sequence[str], *, sys_path: Sequence[str] = (), timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``python -m elastic_train.main ARGV``, forked from the forkserver: the same
    ``__main__`` block and exit code, without importing torch again (3-5 s of CPU a
    launch on a 2-core box). ``sys_path`` goes in front, as PYTHONPATH would."""
    return _run_child(_main_child, (list(argv), list(sys_path)),
                      what=["elastic_train.main", *argv], timeout=timeout)  # fmt: skip


def run_code(
    code: str, argv: Sequence[str], *, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``python -c CODE ARGV``, forked from the forkserver, as :func:`run_main`; a
    ``SystemExit``'s code is the exit code, an uncaught exception's 1."""
    return _run_child(_code_child, (code, list(argv)), what=["-c", *argv], timeout=timeout)


class ForkedChild:
    """What the tests use of a ``Popen``, for ``python -c CODE ARGV`` forked from the
    forkserver and left running (a test kills it at a moment of its choosing)."""

    def __init__(self, code: str, argv: Sequence[str]) -> None:
        self._out = tempfile.TemporaryDirectory(prefix="code-")
        self._process = _forkserver().Process(
            target=_code_child, args=(self._out.name, code, list(argv))
        )
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode  # -N for signal N, as Popen's

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(["-c"], timeout or 0.0)
        self._out.cleanup()
        return self._process.exitcode

    def send_signal(self, signum: int) -> None:
        os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
