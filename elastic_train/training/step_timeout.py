"""In-process recovery's collective timeout inside a step (``elastic.recovery =
"inprocess"``): adaptive like the watchdog's, so a survivor blocked in a gloo
receive from a peer that left wakes within a few step times, not at
``pg_timeout_seconds`` (docs/recovery-inprocess.md, "Detection")."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections import deque
from collections.abc import Callable, Iterator
from datetime import timedelta

import torch
import torch.distributed as dist

from elastic_train.log import get_logger

__all__ = ["StepTimeout"]

log = get_logger(__name__)

#: Step intervals the adaptive step timeout needs before it shortens anything,
#: and how many recent ones its median reads.
_MIN_INTERVALS, _INTERVALS = 3, 20
#: A warm group's first step: this times the usual bound (StepTimeout.attach).
_FIRST_STEP_FACTOR = 2.0


class StepTimeout:
    """The default group's timeout inside a step, adaptive like the watchdog's.

    A survivor blocked in a gloo receive from a peer that already left the
    collective is woken by nothing but the collective's timeout (measured: not
    by the peer's death, the others' destroy, nor an abort from another thread).
    So inside a step the timeout is max(floor, multiple x the median interval
    between completed steps), under ``pg_timeout_seconds`` and half the
    watchdog's limit (the recovery must begin before the watchdog fires). A
    re-form's own collectives get the floor (:meth:`bounded`). Outside steps
    (saves, evaluation, forming the group) and until a few step times are known
    it is ``pg_timeout_seconds``; so is a group's first step unless the group is
    ``warm`` (:meth:`attach`), where it gets twice the usual bound (DDP's first
    buckets, new loader workers). A timeout that no failure caused costs one
    re-form with the same members and doubles the floor, so a slow machine
    cannot loop. Gloo only (NCCL untested here).
    """

    def __init__(
        self, *, full_s: float, multiple: float, floor_s: float,
        watchdog: Callable[[], float] | None, clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        self.full_s, self.multiple, self.floor_s = full_s, multiple, floor_s
        self._watchdog, self._clock = watchdog, clock
        self._intervals: deque[float] = deque(maxlen=_INTERVALS)
        self._last_done: float | None = None
        self._first = True  # the group's first step
        self._warm = False  # ... is bounded too (attach)
        self._backend: str | None = None  # "gloo" where the group's timeout can be set
        #: the timeout of the step in flight when it is shorter than full_s, else None
        self.short_s: float | None = None
        self._warned = False

    def attach(self, backend: str, *, scale: float = 1.0, warm: bool = False) -> None:
        """Follow the current default group (after each formation). The step times
        so far carry over times ``scale`` (old world / new world: each rank's share
        of the global batch grows); the interval over the re-form is not one.

        ``warm``: every member stepped in the group before and nothing recompiles,
        so the first step differs from the others only by DDP's first buckets and
        new loader workers: twice the usual bound, not ``pg_timeout_seconds``. A
        joiner's cold first step (lazy kernels, first allocations) or a
        ``torch.compile`` recompile for the new per-rank batch is not warm."""
        self._intervals = deque((i * scale for i in self._intervals), maxlen=_INTERVALS)
        self._last_done, self.short_s, self._first, self._warm = None, None, True, warm
        self._backend = backend if self.multiple > 0 and _set_timeout(backend, None) else None
        if self._backend is None and self.multiple > 0 and not self._warned:
            self._warned = True
            log.warning("inprocess_step_timeout_unavailable", backend=backend,
                        timeout_s=self.full_s, needs="gloo's _set_default_timeout")  # fmt: skip

    def current(self) -> float:
        """The timeout the next step gets."""
        if (self._first and not self._warm) or len(self._intervals) < _MIN_INTERVALS:
            return self.full_s
        adaptive = max(self.floor_s, self.multiple * statistics.median(self._intervals))
        if self._first:
            adaptive *= _FIRST_STEP_FACTOR
        limit = self.full_s if self._watchdog is None else min(self.full_s, self._watchdog() / 2)
        return min(adaptive, limit)

    def step_started(self) -> None:
        seconds = self.current()
        if self._backend is not None and seconds < self.full_s:
            _set_timeout(self._backend, seconds)  # read as each collective starts
            self.short_s = seconds

    def step_done(self) -> None:
        now = self._clock()
        if self._last_done is not None:
            self._intervals.append(now - self._last_done)
        self._last_done, self._first = now, False
        if self.short_s is not None and self._backend is not None:
            _set_timeout(self._backend, self.full_s)  # saves, evaluation: the full limit
            self.short_s = None

    @contextlib.contextmanager
    def bounded(self) -> Iterator[None]:
        """A re-form's own collectives (:mod:`.rollback`) under the floor, not
        ``full_s``: a member blocked on a peer that died in them wakes in seconds.
        A timeout that killed nobody costs another re-form, and widens the floor."""
        if self._backend is None or self.floor_s >= self.full_s:
            yield
            return
        _set_timeout(self._backend, self.floor_s)
        try:
            yield
        finally:
            _set_timeout(self._backend, self.full_s)

    def widen(self) -> None:
        """A re-form kept every member after a shortened step failed: no failure
        caused that timeout. Double the floor (at most ``full_s``)."""
        self.floor_s = min(2 * self.floor_s, self.full_s)
        log.warning("inprocess_step_timeout_widened", floor_s=self.floor_s)


def _set_timeout(backend: str, seconds: float | None) -> bool:
    """Set the default group's gloo timeout (None: only check that this torch can).

    Looked up at each call, never kept: a reference to the backend would keep its
    sockets open past the group's destroy, and the peers blocked in a receive
    from this rank would wait out their timeout instead of failing at once.
    """
    if backend != "gloo":  # NCCL's timeout ends in its own watchdog's abort: untested here
        return False
    try:
        impl = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
    except (AttributeError, RuntimeError, ValueError):
        return False
    setter = getattr(impl, "_set_default_timeout", None)  # absent: a debug wrapper, old torch
    if not callable(setter):
        return False
    if seconds is not None:
        setter(timedelta(seconds=seconds))
    return True
