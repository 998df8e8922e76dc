"""Child processes for the preemption and watchdog tests (run as a script).

``python tests/fault_procs.py preempt``: a fake training loop (one gloo
process per ``RANK``/``WORLD_SIZE`` env, or single process) with
:class:`PreemptionHandler`; prints one JSON line per step and one ``stop`` line.

``python tests/fault_procs.py hang <seconds_of_steps>``: steps with a
:class:`Watchdog` for a while, then blocks forever in ``stuck_here``.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from elastic_train.config.checks import parse_signal
from elastic_train.training.preemption import PreemptionHandler


def _emit(**record: object) -> None:
    print(json.dumps(record), flush=True)


def preempt() -> int:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    handler = PreemptionHandler(
        signals=(parse_signal("SIGTERM"), parse_signal(os.environ.get("EXTRA_SIGNAL", "SIGUSR1")))
    ).install()
    weight = torch.zeros(4)
    for step in range(1, 100_000):
        # A "step" long enough that the signal usually lands in the middle of one.
        deadline = time.monotonic() + 0.02
        while time.monotonic() < deadline:
            weight += 1e-3
        if world > 1:
            dist.all_reduce(weight)
            weight /= world
        _emit(kind="step", step=step, received=handler.received is not None)
        reason = handler.poll(step)
        if reason is not None:
            _emit(kind="stop", step=step, reason=reason.value)
            if world > 1:
                dist.destroy_process_group()
            return 0
    return 1


def stuck_here() -> None:
    threading.Event().wait()


def hang(step_seconds: float) -> int:
    from elastic_train.training.watchdog import Watchdog

    dog = Watchdog(multiple=5.0, floor_s=0.5, startup_timeout_s=5.0, poll_s=0.05).start()
    start = time.monotonic()
    step = 0
    while time.monotonic() - start < step_seconds:
        time.sleep(0.01)
        step += 1
        dog.step_done(step)
    _emit(kind="hanging", step=step, time=time.time())
    stuck_here()
    return 0


if __name__ == "__main__":
    mode = sys.argv[1]
    sys.exit(preempt() if mode == "preempt" else hang(float(sys.argv[2])))
