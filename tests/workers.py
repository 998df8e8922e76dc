"""Start the worker processes of multi-process tests.

Not ``fork``: by the time a test runs, the pytest process may hold gRPC and gloo
threads left by earlier tests, and a forked child can abort (SIGABRT) on their
state. ``forkserver`` forks from a clean server process that has imported torch
(and ``torch._dynamo``, which every optimizer imports on first use) once, so a
worker starts almost as fast as with ``fork``.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "elastic_train.training.loop"]


def start_workers(fn: Callable[..., None], *, args: tuple[Any, ...], nprocs: int) -> None:
    """Run ``fn(rank, *args)`` in ``nprocs`` processes; raises if any fails."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(_PRELOAD)
    mp.start_processes(fn, args=args, nprocs=nprocs, start_method="forkserver", join=True)
