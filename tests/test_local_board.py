"""The live board of ``elastic-train local``: totals, ETA, recoveries; rich on a real pty.

The arithmetic (total, rate, ETA) is checked on records with known times; the
rendering on a real run's records and, end to end, on a pseudo-terminal: the
CLI draws a rich panel there, and plain lines into a pipe.
"""

from __future__ import annotations

import io
import json
import os
import pty
import re
import select
import subprocess
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import pytest
from rich.console import Console

from elastic_train.audit import AuditLog, ResumeRecord, StepRecord
from elastic_train.config.job import TrainingConfig
from elastic_train.local.board import RichBoard, open_board, render_board
from elastic_train.local.chaos import ChaosEvent, parse_event
from elastic_train.local.progress import (
    BoardView,
    NodeRow,
    ProgressBoard,
    ProgressPrinter,
    RecoveryRow,
    eta_seconds,
    format_duration,
    planned_steps,
    windowed_rate,
)

STEPS = 20
TRAINER_ARGS = [
    "--data.name=synthetic", "--data.num_samples=96", "--training.global_batch_size=16",
    f"--training.steps={STEPS}", "--checkpoint.interval_steps=4",
    "--model.name=tests.paced_model:paced_mlp", "--model.options.seconds=0.05",
]  # fmt: skip
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def _steps(count: int, *, every: float, world: int = 2, attempt: str = "a") -> list[StepRecord]:
    """Every rank's record of steps 1..count, one step every ``every`` seconds from t=every."""
    return [
        StepRecord(
            attempt=attempt,
            step=step,
            epoch=0,
            rank=rank,
            world_size=world,
            node=f"node{rank}",
            indices=(rank, rank + 2),
            loss=1.0 + rank,
            time=step * every,
        )
        for step in range(1, count + 1)
        for rank in range(world)
    ]


def test_total_is_the_trainers_own_count_of_steps() -> None:
    assert planned_steps(TrainingConfig(steps=40), dataset_len=None) == 40
    epochs = TrainingConfig(steps=0, epochs=2, global_batch_size=16)
    assert planned_steps(epochs, dataset_len=None) is None  # not known before a resume record
    assert planned_steps(epochs, dataset_len=100) == 2 * 7  # the last batch of an epoch is short
    assert planned_steps(None, dataset_len=100) is None  # not our trainer


def test_rate_counts_the_window_or_a_young_source_since_its_first_record() -> None:
    # Young: 10 records 0.5 s apart, seen for 4.5 s: 9 intervals of 0.5 s.
    recent = deque((0.5 * i, 1.0) for i in range(1, 11))
    assert windowed_rate(recent, now=5.0, since=0.5, window=10.0) == pytest.approx(2.0)
    # Steady: only the last 10 s count, over 10 s.
    recent = deque((0.5 * i, 1.0) for i in range(1, 31))
    assert windowed_rate(recent, now=15.0, since=0.5, window=10.0) == pytest.approx(2.0)
    assert len(recent) == 20  # the older ones were dropped
    assert windowed_rate(deque(), now=15.0, since=0.5, window=10.0) == 0.0


def test_eta_and_its_format() -> None:
    assert eta_seconds(step=10, total=40, steps_per_second=2.0) == 15.0
    assert eta_seconds(step=40, total=40, steps_per_second=2.0) == 0.0
    assert eta_seconds(step=10, total=None, steps_per_second=2.0) is None
    assert eta_seconds(step=10, total=40, steps_per_second=0.0) is None  # stalled: unknown
    assert [format_duration(s) for s in (None, 15.4, 187, 7500)] == ["-", "15s", "3m07s", "2h05m"]


def test_board_shows_total_eta_and_global_loss_of_the_records() -> None:
    board = ProgressBoard(training=TrainingConfig(steps=40))
    board.observe(_steps(10, every=0.5))
    view = board.view({"node0": "training", "node1": "training"}, elapsed=7.0, now=5.0)
    assert (view.step, view.total, view.world_size) == (10, 40, 2)
    assert view.steps_per_second == pytest.approx(2.0)
    assert view.eta_s == pytest.approx(15.0)  # 30 steps left at 2 steps/s
    assert view.loss == pytest.approx(1.5)  # (2 * 1.0 + 2 * 2.0) / 4 samples
    # 2 samples per record, 9 records after the first of each node, over 4.5 s.
    assert view.samples_per_second == pytest.approx(2 * 9 * 2 / 4.5)
    header = view.lines()[0]
    assert "step     10/40" in header and "ETA 15s" in header and "2.0 steps/s" in header
    # Every node gone: the last board keeps the rates the records left.
    done = board.view({"node0": "exited(0)", "node1": "killed"}, elapsed=60.0, now=50.0)
    assert done.steps_per_second == pytest.approx(2.0)
    # A node still training but nothing recorded for a window: a stall, no ETA.
    stalled = board.view({"node0": "training", "node1": "killed"}, elapsed=60.0, now=50.0)
    assert (stalled.steps_per_second, stalled.samples_per_second, stalled.eta_s) == (0, 0, None)


def test_an_epoch_count_gets_its_total_from_the_resume_record() -> None:
    board = ProgressBoard(training=TrainingConfig(steps=0, epochs=3, global_batch_size=16))
    assert board.total is None
    board.observe([ResumeRecord(attempt="a", restored_step=0, source="none", world_size=2,
                                rank=0, node="node0", time=0.0, dataset_len=96)])  # fmt: skip
    assert board.total == 3 * 6


def test_plain_lines_for_a_pipe_and_none_when_quiet() -> None:
    with open_board(io.StringIO(), quiet=True) as sink:
        assert sink is None
    out = io.StringIO()
    with open_board(out) as sink:
        assert isinstance(sink, ProgressPrinter)
        sink.show(_view(), final=True)
    header, node, kill, join = out.getvalue().splitlines()
    assert "step     12/40  ETA 14s" in header and "node0" in node
    assert kill == "  recovery kill:1@step6 at 9.5s: 1.55 s, 1 lost steps, world 1"
    assert join == "  recovery join:1@step30 at 20.0s: recovering"


def test_rich_panel_shows_totals_nodes_and_recoveries() -> None:
    console = Console(file=io.StringIO(), width=100, force_terminal=True, record=True)
    console.print(render_board(_view()))
    text = console.export_text()
    assert "step 12/40 (30%)" in text and "ETA 14s" in text and "world size 1" in text
    assert re.search(r"node0\s+training\s+1\s+12\s+8\.0\s+0\.5000", text), text
    assert re.search(r"kill:1@step6\s+9\.5 s\s+1\.55 s\s+1\s+1", text), text
    assert re.search(r"join:1@step30\s+20\.0 s\s+recovering", text), text


def _read_all(fd: int) -> str:
    chunks = []
    while select.select([fd], [], [], 0.5)[0]:
        chunks.append(os.read(fd, 65536))
    return b"".join(chunks).decode(errors="replace")


def test_a_terminal_gets_the_rich_panel_or_without_rich_the_plain_redraw(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    master, slave = pty.openpty()
    with os.fdopen(slave, "w") as terminal:
        with open_board(terminal) as sink:
            assert isinstance(sink, RichBoard)
            sink.show(_view(), final=True)
        out = _read_all(master)
        assert "\x1b[?25l" in out and "\x1b[?25h" in out  # live: cursor hidden, then back
        assert "ETA 14s" in ANSI.sub("", out) and "╭" in out

        monkeypatch.setitem(sys.modules, "rich.live", None)  # as if rich were not installed
        with open_board(terminal) as sink:
            assert isinstance(sink, ProgressPrinter) and sink.tty
            sink.show(_view(), final=True)
        out = _read_all(master)
        assert "\x1b[2K[  21.0s] step     12/40  ETA 14s" in out and "╭" not in out
    os.close(master)


def _view() -> BoardView:
    return BoardView(
        elapsed=21.0, step=12, total=40, eta_s=14.0, loss=0.5, samples_per_second=8.0,
        steps_per_second=2.0, world_size=1,
        nodes=(NodeRow("node0", "training", 1, 12, 8.0, 0.5),),
        recoveries=(RecoveryRow("kill:1@step6", 9.5, 1.55, 1, 1),
                    RecoveryRow("join:1@step30", 20.0, None, None, None)),
    )  # fmt: skip


@dataclass(frozen=True)
class _Delivered:
    event: ChaosEvent
    node: int | None
    time: float
    elapsed: float
    delivered: bool = True


def _run_on_a_pty(command: list[str], *, timeout: float) -> tuple[int, str]:
    """Run ``command`` with stdout and stderr on a real pseudo-terminal; all it wrote."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave)
    os.close(slave)
    chunks: list[bytes] = []
    try:
        while True:
            ready, _, _ = select.select([master], [], [], timeout)
            assert ready, f"no output for {timeout}s"
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: every writer closed the pty
                break
            if not chunk:
                break
            chunks.append(chunk)
        return proc.wait(timeout=30), b"".join(chunks).decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)


@pytest.mark.slow
def test_cli_on_a_terminal_draws_the_rich_board_from_the_real_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    command = [
        sys.executable, "-m", "elastic_train.cli", "local", "--nodes", "2",
        "--chaos", "kill:1@step6", "--run-dir", str(run_dir), "--metrics-port", "0",
        "--timeout", "240", *TRAINER_ARGS,
    ]  # fmt: skip
    code, out = _run_on_a_pty(command, timeout=240)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert code == 0, out[-3000:]
    (recovery,) = summary["recoveries"]
    assert recovery["kind"] == "kill" and recovery["world_size_after"] == 1, recovery

    # rich drew a live panel: the cursor hidden while it ran, shown again at the end.
    assert "\x1b[?25l" in out and out.rindex("\x1b[?25h") > out.rindex("╰"), out[-3000:]
    final = ANSI.sub("", out[out.rindex("elastic-train local ─") :])
    assert f"step {STEPS}/{STEPS} (100%)" in final, final
    row = rf"kill:1@step6\s+[\d.]+ s\s+{recovery['seconds']:.2f} s\s+{recovery['lost_steps']}\s+1"
    assert re.search(row, final), final
    assert f"timeline: {run_dir / 'timeline.png'}" in final

    # The same board fed the run's records afterwards shows what the summary says.
    log = AuditLog.load(run_dir / "audit")
    board = ProgressBoard(training=TrainingConfig(steps=STEPS))
    board.observe(sorted([*log.resumes, *log.steps], key=lambda r: r.time))
    event = summary["events"][0]
    delivered = _Delivered(parse_event(event["event"]), 1, event["time"], event["elapsed"])
    view = board.view({}, elapsed=summary["wall_seconds"], deliveries=[delivered], log=log)
    assert (view.step, view.total, view.world_size) == (STEPS, STEPS, 1)
    (row_view,) = view.recoveries
    assert row_view.seconds == recovery["seconds"]
    assert (row_view.lost_steps, row_view.world_size_after) == (recovery["lost_steps"], 1)
