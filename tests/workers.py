"""Start the worker processes of multi-process tests, and one-process trainer runs
(``run_main``: ``python -m elastic_train.main`` without a new interpreter).

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


def _main_child(argv: list[str], out_dir: str, sys_path: list[str]) -> None:
    """``python -m elastic_train.main ARGV``, in a child of the forkserver."""
    sys.path[:0] = sys_path
    for fd, name in ((1, "stdout"), (2, "stderr")):
        # The forkserver's children are not the pytest process's: capfd sees nothing.
        target = os.open(os.path.join(out_dir, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    torch.set_num_threads(1)  # what OMP_NUM_THREADS=1 did for a new interpreter
    # A forkserver child inherits "forkserver" as its start method; a new interpreter has
    # the platform's default, which the DataLoader's workers use (forked from here, not
    # from the server, which has not imported the trainer's data and writes elsewhere).
    multiprocessing.set_start_method(None, force=True)
    sys.argv = ["elastic_train.main", *argv]
    # The module's __main__ block, exit code included (it ends in exit_now).
    runpy.run_module("elastic_train.main", run_name="__main__", alter_sys=True)


def run_main(
    argv: Sequence[str], *, sys_path: Sequence[str] = (), timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    """``python -m elastic_train.main ARGV``, forked from the forkserver: the same
    ``__main__`` block and exit code, without importing torch again (3-5 s of CPU a
    launch on a 2-core box). ``sys_path`` goes in front, as PYTHONPATH would."""
    context = _forkserver()
    with tempfile.TemporaryDirectory(prefix="main-") as out_dir:
        child = context.Process(target=_main_child, args=(list(argv), out_dir, list(sys_path)))
        child.start()
        child.join(timeout)
        if child.exitcode is None:
            child.kill()
            child.join()
            raise subprocess.TimeoutExpired(["elastic_train.main", *argv], timeout)
        out, err = (Path(out_dir, n).read_text(errors="replace") for n in ("stdout", "stderr"))
    return subprocess.CompletedProcess(["elastic_train.main", *argv], child.exitcode, out, err)
