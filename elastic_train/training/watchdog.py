"""Hang watchdog: a thread that kills a worker whose steps stopped completing.

A hung peer leaves every survivor blocked inside a collective, where no Python
exception can reach it. The watchdog thread is not blocked: when no step has
completed within the timeout it dumps every thread's stack (``faulthandler``,
which writes straight to the file descriptor and needs no lock that a stuck
thread might hold) and leaves with ``os._exit(EXIT_HANG)``. ``os._exit``
because a normal exit would join the stuck threads and never return. The agent
sees the exit code, restarts the group, and the new process group no longer
contains the stuck collective.

The timeout is ``max(floor_s, multiple * typical step time)`` once steps are
being observed; before the first step (process-group setup, checkpoint load,
first-iteration warm-up) and inside :meth:`Watchdog.long_operation` (a
blocking save, an evaluation) it is ``startup_timeout_s``. An explicit
``timeout_s`` replaces the adaptive value.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import statistics
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import TextIO

from elastic_train.errors import EXIT_HANG, ConfigError
from elastic_train.log import get_logger

log = get_logger(__name__)


def _exit_hang() -> None:
    os._exit(EXIT_HANG)


class Watchdog:
    """Call :meth:`step_done` after every optimizer step; :meth:`start` once."""

    def __init__(
        self,
        *,
        timeout_s: float | None = None,
        multiple: float = 10.0,
        floor_s: float = 60.0,
        startup_timeout_s: float = 600.0,
        poll_s: float = 0.5,
        stream: TextIO | None = None,
        on_hang: Callable[[], None] = _exit_hang,
    ) -> None:
        for name, value in (
            ("timeout_s", timeout_s),
            ("multiple", multiple),
            ("floor_s", floor_s),
            ("startup_timeout_s", startup_timeout_s),
        ):
            if value is not None and value <= 0:
                raise ConfigError(f"watchdog {name} must be > 0, got {value}")
        self.timeout_s = timeout_s
        self.multiple = multiple
        self.floor_s = floor_s
        self.startup_timeout_s = startup_timeout_s
        self.poll_s = poll_s
        self._stream = stream
        self._on_hang = on_hang
        self._step_times: deque[float] = deque(maxlen=50)
        self._last_progress = time.monotonic()
        self._last_step: int | None = None
        self._long_ops = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def current_timeout(self) -> float:
        """Seconds without progress after which the watchdog fires."""
        with self._lock:
            if self._long_ops or not self._step_times:
                return (
                    self.startup_timeout_s
                    if self.timeout_s is None
                    else max(self.timeout_s, self.startup_timeout_s)
                )
            if self.timeout_s is not None:
                return self.timeout_s
            return max(self.floor_s, self.multiple * statistics.median(self._step_times))

    def step_done(self, step: int) -> None:
        now = time.monotonic()
        with self._lock:
            if self._last_step is not None and self._long_ops == 0:
                self._step_times.append(now - self._last_progress)
            self._last_step = step
            self._last_progress = now

    @contextlib.contextmanager
    def long_operation(self, name: str) -> Iterator[None]:
        """A phase that may take longer than a step (save, evaluation); still bounded."""
        with self._lock:
            self._long_ops += 1
            self._last_progress = time.monotonic()
        try:
            yield
        finally:
            with self._lock:
                self._long_ops -= 1
                self._last_progress = time.monotonic()

    def start(self) -> Watchdog:
        self._last_progress = time.monotonic()
        self._thread = threading.Thread(
            target=self._run, name="elastic-train-watchdog", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            timeout = self.current_timeout()
            with self._lock:
                idle = time.monotonic() - self._last_progress
                last_step = self._last_step
            if idle > timeout:
                self._fire(idle=idle, timeout=timeout, last_step=last_step)
                return

    def _fire(self, *, idle: float, timeout: float, last_step: int | None) -> None:
        log.error(
            "worker_hang_detected",
            last_step=last_step,
            idle_seconds=round(idle, 3),
            timeout_seconds=round(timeout, 3),
            exit_code=EXIT_HANG,
        )
        stream = self._stream or sys.stderr
        stream.write(f"elastic_train watchdog: no step for {idle:.1f}s; stacks of all threads:\n")
        stream.flush()
        faulthandler.dump_traceback(file=stream, all_threads=True)
        stream.flush()
        self._on_hang()
