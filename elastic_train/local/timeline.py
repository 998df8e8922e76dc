"""``timeline.png``: a picture of one local run over wall time.

Three panels share the x axis (seconds since the nodes started): the global
loss of every step all ranks recorded, steps per second, and the world size.
Each delivered chaos event is a vertical line across them, its recovery a
shaded span labelled with its seconds and lost steps.

The data come from the same audit records as the summary (:func:`timeline_of`,
a pure function, tested on a real run's records); :func:`render_timeline`
only draws them. matplotlib comes with the ``[local]`` extra: without it the
run logs ``timeline_skipped`` and writes no picture.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastic_train.audit import AuditLog, StepRecord
from elastic_train.errors import ConfigError
from elastic_train.local.chaos import Recovery
from elastic_train.log import get_logger

__all__ = ["TIMELINE_FILE", "Timeline", "render_timeline", "timeline_of", "write_timeline"]

log = get_logger(__name__)

TIMELINE_FILE = "timeline.png"
#: steps/s at a step counts the completed steps of its attempt in this many seconds before it
RATE_WINDOW_S = 5.0
#: the x axis starts at 0 when the first step came within this share of the run
STARTUP_SHOWN_UP_TO = 0.25
#: what installs the timeline's dependency
INSTALL_HINT = 'pip install "elastic-train[local]"'

_EVENT_NAMES = {"kill": "kill", "join": "join", "term": "preemption", "stop": "hang"}
_EVENT_COLORS = {"kill": "tab:red", "join": "tab:green", "term": "tab:orange", "stop": "tab:purple"}


@dataclass(frozen=True)
class StepPoint:
    """One step that every rank of its attempt recorded."""

    #: seconds since the nodes started, when the last rank recorded the step
    seconds: float
    step: int
    attempt: str
    #: the sample-weighted mean of the ranks' losses
    loss: float
    world_size: int
    #: completed steps per second of this attempt over the window; None at its first step
    steps_per_second: float | None


@dataclass(frozen=True)
class TimelineEvent:
    """A delivered chaos event and what it cost (the summary's ``recoveries`` entry)."""

    kind: str
    node: int
    seconds: float
    recovery_s: float | None
    lost_steps: int | None
    world_size_after: int | None

    @property
    def label(self) -> str:
        head = f"{_EVENT_NAMES.get(self.kind, self.kind)} node{self.node}"
        if self.recovery_s is None:
            return f"{head}\nno recovery"
        text = f"{head}\nrecovered in {self.recovery_s:.2f} s"
        if self.lost_steps is not None:
            text += f"\n{self.lost_steps} lost step{'' if self.lost_steps == 1 else 's'}"
        return text


@dataclass(frozen=True)
class Timeline:
    """Everything the picture shows, in seconds since the nodes started."""

    points: tuple[StepPoint, ...]
    events: tuple[TimelineEvent, ...]

    def attempts(self) -> list[list[StepPoint]]:
        """The points split by attempt, in order: the lines break where the group restarted."""
        runs: list[list[StepPoint]] = []
        for point in self.points:
            if not runs or runs[-1][-1].attempt != point.attempt:
                runs.append([])
            runs[-1].append(point)
        return runs

    def world_sizes(self) -> list[int]:
        """The world size of each attempt, in order (a change is a recovery)."""
        return [run[0].world_size for run in self.attempts()]


def timeline_of(audit: AuditLog, recoveries: Sequence[Recovery], *, origin: float) -> Timeline:
    """The timeline of a run from its records; ``origin`` is the wall time of second 0."""
    points: list[StepPoint] = []
    for attempt in audit.attempts():
        completed = [
            records
            for _, records in sorted(attempt.steps.items())
            if len(records) == attempt.world_size
        ]
        times = [max(r.time for r in records) - origin for records in completed]
        for i, records in enumerate(completed):
            points.append(
                StepPoint(
                    seconds=times[i],
                    step=records[0].step,
                    attempt=attempt.id,
                    loss=_global_loss(records),
                    world_size=attempt.world_size,
                    steps_per_second=_rate_at(times, i),
                )
            )
    events = tuple(
        TimelineEvent(
            kind=r.kind,
            node=r.node,
            seconds=r.event_time - origin,
            recovery_s=r.seconds,
            lost_steps=r.lost_steps,
            world_size_after=r.world_size_after,
        )
        for r in recoveries
    )
    return Timeline(points=tuple(sorted(points, key=lambda p: p.seconds)), events=events)


def _global_loss(records: list[StepRecord]) -> float:
    samples = sum(len(r.indices) for r in records)
    if samples == 0:
        return sum(r.loss for r in records) / len(records)
    return sum(r.loss * len(r.indices) for r in records) / samples


def _rate_at(times: list[float], i: int) -> float | None:
    first = i
    while first > 0 and times[first - 1] >= times[i] - RATE_WINDOW_S:
        first -= 1
    span = times[i] - times[first]
    return (i - first) / span if span > 0 else None


def write_timeline(
    audit_dir: str | Path, recoveries: Sequence[Recovery], *, origin: float, path: str | Path
) -> Path | None:
    """Draw the run's timeline to ``path``; None (and a log line) when there is nothing
    to draw or matplotlib is missing."""
    timeline = timeline_of(AuditLog.load(audit_dir), recoveries, origin=origin)
    if not timeline.points:
        log.info("timeline_skipped", reason="no step was recorded by every rank")
        return None
    try:
        render_timeline(timeline, path)
    except (ConfigError, OSError, ValueError, RuntimeError) as exc:
        # The picture is a by-product: a run that completed stays completed.
        log.warning("timeline_skipped", reason=str(exc))
        return None
    log.info("timeline_written", path=str(path))
    return Path(path)


def render_timeline(timeline: Timeline, path: str | Path) -> None:
    """Draw ``timeline`` as a PNG; ConfigError naming the extra when matplotlib is missing."""
    try:
        # The object API, not pyplot: no global backend state, safe off the main thread.
        from matplotlib.figure import Figure
        from matplotlib.lines import Line2D
        from matplotlib.ticker import MaxNLocator
    except ImportError as exc:
        raise ConfigError(f"timeline.png needs the matplotlib package: {INSTALL_HINT}") from exc
    fig = Figure(figsize=(11, 7.5), layout="constrained")
    loss_ax, rate_ax, world_ax = fig.subplots(3, 1, sharex=True, height_ratios=(3, 2, 1.4))
    for run in timeline.attempts():
        seconds = [p.seconds for p in run]
        loss_ax.plot(seconds, [p.loss for p in run], color="tab:blue", lw=1.2)
        rates = [math.nan if p.steps_per_second is None else p.steps_per_second for p in run]
        rate_ax.plot(seconds, rates, color="tab:blue", lw=1.2)
        world_ax.plot(seconds, [p.world_size for p in run], color="tab:blue", lw=2.5)
    losses = [p.loss for p in timeline.points if p.loss > 0]
    if losses and max(losses) / min(losses) > 50:
        loss_ax.set_yscale("log")  # a loss that falls by decades is read on a log axis
    loss_ax.set_ylabel("loss (global, per step)")
    rate_ax.set_ylabel("steps / s")
    rate_ax.set_ylim(bottom=0)
    world_ax.set_ylabel("world size\n(workers)")
    world_ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    top = max(p.world_size for p in timeline.points)
    world_ax.set_ylim(0, top + 1)
    world_ax.set_xlabel("wall time: seconds since the nodes started")
    _draw_startup(timeline, (loss_ax, rate_ax, world_ax))
    _draw_events(timeline.events, (loss_ax, rate_ax, world_ax))
    handles = [
        Line2D([0], [0], color=_EVENT_COLORS[kind], ls="--", label=name)
        for kind, name in _EVENT_NAMES.items()
        if any(e.kind == kind for e in timeline.events)
    ]
    if handles:
        loss_ax.legend(handles=handles, loc="best", title="events (shade: recovery)")
    for ax in (loss_ax, rate_ax, world_ax):
        ax.grid(alpha=0.3)
    fig.suptitle("elastic-train local: loss, throughput and world size over wall time")
    fig.savefig(path, dpi=100)


def _draw_startup(timeline: Timeline, axes: Sequence[Any]) -> None:
    """From second 0 the start-up (etcd, agents, rendezvous, imports) shows as a grey span;
    when it would squeeze the training into a corner, the axis starts at the first step."""
    first, last = timeline.points[0].seconds, timeline.points[-1].seconds
    if first <= STARTUP_SHOWN_UP_TO * last:
        axes[-1].set_xlim(left=0)
        for ax in axes:
            ax.axvspan(0, first, color="0.85", alpha=0.5)
        text, x = "start-up", first / 2
    else:
        axes[-1].set_xlim(left=first - 0.03 * (last - first))
        text, x = f"first step at {first:.1f} s\n(start-up not shown)", first
    axes[1].annotate(
        text, xy=(x, 0.5), xycoords=("data", "axes fraction"),
        ha="center" if x < first else "left", color="0.35", fontsize=9,
    )  # fmt: skip


def _draw_events(events: Sequence[TimelineEvent], axes: Sequence[Any]) -> None:
    for index, event in enumerate(events):
        color = _EVENT_COLORS.get(event.kind, "black")
        for ax in axes:
            ax.axvline(event.seconds, color=color, ls="--", lw=1.2)
            if event.recovery_s is not None:
                ax.axvspan(event.seconds, event.seconds + event.recovery_s, color=color, alpha=0.15)
        # Labels sit on the steps/s panel, staggered so that close events stay readable.
        axes[1].annotate(
            event.label,
            xy=(event.seconds, 0.95 - 0.3 * (index % 3)),
            xycoords=("data", "axes fraction"),
            xytext=(4, 0),
            textcoords="offset points",
            va="top",
            fontsize=8,
            color=color,
            bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": color, "alpha": 0.85},
        )
