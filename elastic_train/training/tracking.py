"""Experiment trackers on rank 0: TensorBoard built in, others by import string.

A tracker is anything with ``log_metrics(step, metrics)`` and ``close()``
(:class:`Tracker`). ``logging.tensorboard_dir`` adds :class:`TensorBoardTracker`;
``logging.trackers`` names factories ``factory(cfg: JobConfig) -> Tracker``
(docs/training.md, "Tracking", has a W&B one). Only rank 0 tracks.

**No duplicate or backwards steps after a restart.** A restart resumes from
the newest saved state, which can be older than the last step a tracker
received: those steps are trained again. :class:`Tracking` keeps a watermark,
the highest step handed to any tracker, in ``tracking.json`` (the checkpoint
directory, else the TensorBoard directory), and writes it *before* handing a
step over. A (re)started rank 0 reads it and drops every step up to it, so
each tracker sees strictly increasing steps across restarts; the dropped
steps are the ones redone, whose values the replay (same samples, same
random numbers) reproduces. A kill between the watermark and the tracker's
own write (TensorBoard also buffers a few seconds) leaves a gap, never a
duplicate. Without either directory the watermark lives in memory only.
In-process recovery reopens the trackers on a new rank 0 the same way
(``inprocess.rebuild``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from elastic_train.config.job import JobConfig
from elastic_train.errors import ConfigError
from elastic_train.log import get_logger
from elastic_train.training.progress_marker import ProgressMarker
from elastic_train.workload.registry import import_string

log = get_logger(__name__)

#: The tracking watermark's file (see the module docstring).
WATERMARK_FILE = "tracking.json"
#: Seconds between TensorBoard's flushes to disk.
_FLUSH_SECONDS = 5


class Tracker(Protocol):
    """What ``logging.trackers`` factories return."""

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


class TensorBoardTracker:
    """Scalars into TensorBoard event files, indexed by the global step."""

    def __init__(self, log_dir: str) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ConfigError(
                f"logging.tensorboard_dir = {log_dir!r} needs the tensorboard package: "
                'pip install "elastic-train[tensorboard]"'
            ) from exc
        self.writer = SummaryWriter(log_dir=log_dir, flush_secs=_FLUSH_SECONDS)

    def log_metrics(self, step: int, metrics: Mapping[str, float]) -> None:
        for tag, value in metrics.items():
            self.writer.add_scalar(tag, value, global_step=step)

    def close(self) -> None:
        self.writer.close()


class Tracking:
    """Rank 0's trackers behind the watermark; an empty one does nothing."""

    def __init__(self, trackers: list[Tracker], *, watermark_dir: str) -> None:
        self.trackers = trackers
        self._watermark = ProgressMarker(watermark_dir, writer=bool(trackers), name=WATERMARK_FILE)
        #: Steps up to this one reached a tracker before this start: never again.
        self.skip_through = self._watermark.read() if trackers else 0
        self._written = self.skip_through

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        if not self.trackers or step <= self.skip_through:
            return
        if step > self._written:
            self._watermark.record(step)  # first: a kill after it leaves a gap, not a repeat
            self._written = step
        values = {tag: float(value) for tag, value in metrics.items() if value is not None}
        for tracker in self.trackers:
            tracker.log_metrics(step, values)

    def close(self) -> None:
        for tracker in self.trackers:
            try:
                tracker.close()
            except Exception as exc:  # a tracker's failure must not fail a finished run
                log.warning("tracker_close_failed", tracker=type(tracker).__name__, error=str(exc))
        self._watermark.close()


def open_tracking(cfg: JobConfig, *, is_main: bool) -> Tracking:
    """Rank 0's trackers from ``logging.tensorboard_dir`` and ``logging.trackers``."""
    if not is_main:
        return Tracking([], watermark_dir="")
    trackers: list[Tracker] = []
    if cfg.logging.tensorboard_dir:
        trackers.append(TensorBoardTracker(cfg.logging.tensorboard_dir))
    for spec in (s.strip() for s in cfg.logging.trackers.split(",")):
        if spec:
            trackers.append(_plugged_in(spec, cfg))
    directory = cfg.checkpoint.dir or cfg.logging.tensorboard_dir
    if trackers and directory:
        Path(directory).mkdir(parents=True, exist_ok=True)
    tracking = Tracking(trackers, watermark_dir=directory)
    if trackers:
        log.info(
            "tracking_started", trackers=[type(t).__name__ for t in trackers],
            skip_through=tracking.skip_through,
        )  # fmt: skip
    return tracking


def _plugged_in(spec: str, cfg: JobConfig) -> Tracker:
    """The tracker ``factory(cfg)`` of ``spec`` returns; a ConfigError naming the key
    when the factory fails or returns something without the Tracker methods."""
    factory = import_string(spec, field="logging.trackers")
    try:
        tracker = factory(cfg)
    except Exception as exc:  # the user's code: any error is a configuration problem
        raise ConfigError(
            f"logging.trackers = {spec!r}: the factory raised {type(exc).__name__}: {exc}"
        ) from exc
    if not all(callable(getattr(tracker, name, None)) for name in ("log_metrics", "close")):
        raise ConfigError(
            f"logging.trackers = {spec!r}: the factory returned a {type(tracker).__name__}; "
            "expected a tracker with log_metrics(step, metrics) and close()"
        )
    return tracker
