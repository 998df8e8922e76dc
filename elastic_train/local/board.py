"""The live board of ``elastic-train local`` on a terminal, drawn with ``rich``.

:func:`open_board` picks the display for a stream: a ``rich`` live panel on a
terminal, plain blocks of lines (:class:`~elastic_train.local.progress.ProgressPrinter`)
in a pipe or a file. ``rich`` comes with the ``[local]`` extra; without it a
terminal gets the plain lines redrawn in place, and a log line says what to
install.

While the panel is live, this process's log lines that went to the terminal
go through rich's redirected ``sys.stderr``, so they print above the panel
instead of tearing it.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, TextIO

from elastic_train.errors import ConfigError
from elastic_train.local.progress import (
    BoardView,
    NodeRow,
    ProgressPrinter,
    ProgressSink,
    RecoveryRow,
    format_duration,
)
from elastic_train.log import get_logger

if TYPE_CHECKING:
    from rich.console import RenderableType

__all__ = ["RichBoard", "open_board", "render_board"]

log = get_logger(__name__)

#: what installs the live board's dependency
INSTALL_HINT = 'pip install "elastic-train[local]"'
#: seconds between two redraws of the panel
REFRESH_S = 0.5

_STATE_STYLES = {
    "training": "green",
    "starting": "yellow",
    "stopped": "magenta",
    "killed": "red",
    "terminated": "red",
}


@contextlib.contextmanager
def open_board(
    stream: TextIO | None = None, *, quiet: bool = False
) -> Iterator[ProgressSink | None]:
    """The board for ``stream`` (stdout by default), None when ``quiet``; a live panel
    is stopped on exit, whatever ends the run."""
    stream = stream or sys.stdout
    if quiet:
        yield None
        return
    if not stream.isatty():
        yield ProgressPrinter(stream)
        return
    try:
        board = RichBoard(stream)
    except ConfigError as exc:
        log.warning("progress_board_plain", reason=str(exc))
        yield ProgressPrinter(stream)
        return
    try:
        yield board
    finally:
        board.close()


def _import_rich() -> Any:
    try:
        import rich.live
    except ImportError as exc:
        raise ConfigError(f"the live board needs the rich package: {INSTALL_HINT}") from exc
    return rich.live


class RichBoard:
    """A ``rich.live.Live`` panel redrawn every ``interval_s``; stopped at the final view."""

    def __init__(self, stream: TextIO, *, interval_s: float = REFRESH_S) -> None:
        live = _import_rich()
        from rich.console import Console

        self.console = Console(file=stream)
        # No refresh thread: the runner's tick redraws, and nothing keeps running
        # (with the cursor hidden) if the runner dies between two ticks.
        self.live = live.Live(
            console=self.console, auto_refresh=False, redirect_stderr=sys.stderr.isatty()
        )
        self.interval_s = interval_s
        self._last = float("-inf")
        self._rerouted: list[tuple[logging.StreamHandler[Any], TextIO]] = []

    def show(self, view: BoardView, *, final: bool = False) -> None:
        now = time.monotonic()
        if not final and now - self._last < self.interval_s:
            return
        self._last = now
        if not self.live.is_started:
            self._start()
        self.live.update(render_board(view), refresh=True)
        if final:
            self.close()

    def _start(self) -> None:
        before = (sys.stdout, sys.stderr)
        self.live.start()
        # Live swapped sys.stdout/sys.stderr for proxies that print above the panel;
        # logging handlers hold the old streams, so those on the terminal are pointed
        # at the proxies (a log redirected to a file stays in the file).
        after = (sys.stdout, sys.stderr)
        proxies = {id(old): new for old, new in zip(before, after, strict=True) if new is not old}
        for handler in logging.getLogger().handlers:
            if not isinstance(handler, logging.StreamHandler):
                continue
            stream = handler.stream
            if id(stream) in proxies and stream.isatty():
                self._rerouted.append((handler, stream))
                handler.setStream(proxies[id(stream)])

    def close(self) -> None:
        for handler, stream in self._rerouted:
            handler.setStream(stream)
        self._rerouted.clear()
        self.live.stop()


def render_board(view: BoardView) -> RenderableType:
    """The panel: totals and ETA, a bar, one row per node, one per recovery."""
    from rich.console import Group
    from rich.panel import Panel

    parts: list[RenderableType] = [_header(view), _node_table(view.nodes)]
    if view.recoveries:
        parts.append(_recovery_table(view.recoveries))
    return Panel(
        Group(*parts),
        title="elastic-train local",
        subtitle=f"{view.elapsed:.1f} s",
        expand=False,
    )


def _header(view: BoardView) -> RenderableType:
    from rich.progress_bar import ProgressBar
    from rich.table import Table
    from rich.text import Text

    grid = Table.grid(padding=(0, 2))
    total = "?" if view.total is None else str(view.total)
    percent = "" if view.fraction is None else f" ({view.fraction:.0%})"
    bar = ProgressBar(total=view.total, completed=view.step, width=30)
    grid.add_row(
        Text(f"step {view.step}/{total}{percent}", style="bold"),
        bar,
        Text(f"ETA {format_duration(view.eta_s)}", style="bold cyan"),
    )
    loss = "-" if view.loss is None else f"{view.loss:.4f}"
    world = "-" if view.world_size is None else str(view.world_size)
    grid.add_row(
        Text(f"loss {loss}"),
        Text(f"{view.samples_per_second:.1f} samples/s  {view.steps_per_second:.1f} steps/s"),
        Text(f"world size {world}"),
    )
    return grid


def _node_table(nodes: tuple[NodeRow, ...]) -> RenderableType:
    from rich.table import Table
    from rich.text import Text

    table = Table(box=None, pad_edge=False, header_style="bold")
    for name in ("node", "state", "world", "step", "samples/s", "loss"):
        table.add_column(name, justify="left" if name in ("node", "state") else "right")
    for node in nodes:
        style = _STATE_STYLES.get(node.state, "")
        table.add_row(
            Text(node.name),
            Text(node.state, style=style),
            "-" if node.world_size is None else str(node.world_size),
            str(node.step),
            f"{node.samples_per_second:.1f}",
            "-" if node.loss is None else f"{node.loss:.4f}",
        )
    return table


def _recovery_table(rows: tuple[RecoveryRow, ...]) -> RenderableType:
    from rich.table import Table
    from rich.text import Text

    table = Table(title="recoveries", box=None, pad_edge=False, header_style="bold")
    for name in ("event", "at", "recovered in", "lost steps", "world after"):
        table.add_column(name, justify="left" if name == "event" else "right")
    for row in rows:
        recovered = (
            Text("recovering", style="yellow")
            if row.seconds is None
            else Text(f"{row.seconds:.2f} s", style="green")
        )
        table.add_row(
            Text(row.event),
            f"{row.at:.1f} s",
            recovered,
            "-" if row.lost_steps is None else str(row.lost_steps),
            "-" if row.world_size_after is None else str(row.world_size_after),
        )
    return table
