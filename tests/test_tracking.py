"""Tracking: TensorBoard on rank 0 by global step, and trackers by import string;
after a restart that goes back to an older step, no step is written twice or backwards."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch_support import needs_inprocess

from elastic_train.config.load import load_config
from elastic_train.errors import ConfigError
from elastic_train.training.tracking import WATERMARK_FILE, Tracking, open_tracking

STEPS = 30
ENV = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}


class _Recorder:
    def __init__(self) -> None:
        self.steps: list[int] = []
        self.closed = False

    def log_metrics(self, step: int, metrics: object) -> None:
        self.steps.append(step)

    def close(self) -> None:
        self.closed = True


def test_watermark_drops_the_steps_a_previous_start_wrote(tmp_path: Path) -> None:
    first = _Recorder()
    tracking = Tracking([first], watermark_dir=str(tmp_path))
    for step in (1, 2, 2, 3, 5):
        tracking.log(step, {"loss": 1.0})
    tracking.close()  # the process "dies" at step 5, the state restored is step 2
    assert first.steps == [1, 2, 2, 3, 5] and first.closed
    assert json.loads((tmp_path / WATERMARK_FILE).read_text())["step"] == 5

    second = _Recorder()
    tracking = Tracking([second], watermark_dir=str(tmp_path))
    assert tracking.skip_through == 5
    for step in range(3, 8):  # steps 3-5 are redone
        tracking.log(step, {"loss": 1.0, "accuracy": None})
    assert second.steps == [6, 7]


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("builtins:dict", "logging.trackers = 'builtins:dict': the factory raised TypeError"),
        ("builtins:str", "the factory returned a str; expected a tracker with log_metrics"),
        ("tests.tracker_plugin:nothing", "tests.tracker_plugin has no 'nothing'"),
    ],
)
def test_a_bad_tracker_factory_is_refused_naming_the_key(spec: str, expected: str) -> None:
    cfg = load_config(None, [f"logging.trackers={spec}", "checkpoint.dir="])
    with pytest.raises(ConfigError, match=expected):
        open_tracking(cfg, is_main=True)
    assert open_tracking(cfg, is_main=False).trackers == []  # only rank 0 builds them


def _scalar_steps(log_dir: Path, tag: str) -> list[list[int]]:
    """The steps of ``tag`` in each event file, files in the order they were created."""
    per_file = []
    for path in sorted(log_dir.glob("events.out.tfevents.*")):
        acc = EventAccumulator(str(path))
        acc.Reload()
        if tag in acc.Tags()["scalars"]:
            per_file.append([event.step for event in acc.Scalars(tag)])
    return per_file


def _tracked_run(tmp_path: Path, *, nodes: int, chaos: str, recovery: str) -> dict:
    """``elastic-train local`` with TensorBoard and the JSON-lines tracker on, snapshots
    off, checkpoints every 5 steps (64 steps an epoch: no epoch-end save); its summary."""
    summary_path = tmp_path / "summary.json"
    command = [
        sys.executable, "-m", "elastic_train.cli", "local", "--nodes", str(nodes),
        "--min-nodes", "1", "--chaos", chaos, "--json", str(summary_path),
        "--run-dir", str(tmp_path), "--quiet", "--no-timeline", "--timeout", "240",
        "--metrics-port", "0",
        "--data.name=synthetic", "--data.num_samples=1024", "--training.global_batch_size=16",
        f"--training.steps={STEPS}", "--checkpoint.interval_steps=5", "--elastic.snapshot=false",
        "--logging.log_every_steps=1", f"--logging.tensorboard_dir={tmp_path / 'tb'}",
        "--logging.trackers=tests.tracker_plugin:json_lines",
        "--model.name=tests.paced_model:paced_mlp", "--model.options.seconds=0.1",
        # A logged step needs the global loss, agreed at check steps: about every
        # 0.25 s by default, every step here, so every step reaches the trackers.
        "--elastic.preemption_check_every=1", f"--elastic.recovery={recovery}",
    ]  # fmt: skip
    proc = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=300)
    assert summary_path.is_file(), proc.stderr[-3000:]
    summary = json.loads(summary_path.read_text())
    assert summary["completed"] and summary["final_step"] == STEPS, summary
    return summary


@pytest.mark.slow
def test_restart_writes_no_duplicate_or_backwards_steps(tmp_path: Path) -> None:
    """Node 1 is killed at step 12, so the restart resumes step 10 while steps 11 and
    12 had reached the trackers. The restart path: it resumes behind the steps the
    trackers saw (in process rolls back at most the step in flight, which no tracker
    saw)."""
    summary = _tracked_run(tmp_path, nodes=2, chaos="kill:1@step12", recovery="restart")
    (recovery,) = summary["recoveries"]
    resumes = [json.loads(line) for path in (tmp_path / "audit").glob("worker-*.jsonl")
               for line in path.read_text().splitlines() if '"resume"' in line]  # fmt: skip
    restored = {r["restored_step"] for r in resumes}
    assert 10 in restored, restored  # the restart went back to the checkpoint of step 10

    board = tmp_path / "tb"
    files = _scalar_steps(board, "train/loss")
    assert len(files) >= 2, files  # one event file per start of rank 0
    assert max(files[0]) > 10, files  # steps the restart redid had reached TensorBoard
    steps = [step for file in files for step in file]
    assert steps == sorted(set(steps)), files  # strictly increasing across restarts
    assert steps[-1] == STEPS and len(steps) >= STEPS - 5, files  # at most a kill's gap
    tracked = [json.loads(line)["step"] for line in (board / "tracked.jsonl").open()]
    assert tracked == sorted(set(tracked)) and tracked[-1] == STEPS
    assert recovery["lost_steps"] >= 1, recovery


@needs_inprocess
@pytest.mark.slow
def test_in_process_the_new_rank0_takes_the_trackers_over(tmp_path: Path) -> None:
    """Rank 0's node is killed at step 12 and the survivors re-form in their
    processes: the new rank 0 opens the trackers and goes on after the watermark."""
    summary = _tracked_run(tmp_path, nodes=2, chaos="kill:rank0@step12", recovery="inprocess")
    (recovery,) = summary["recoveries"]
    assert recovery["restore_source"] == "inprocess" and recovery["world_size_after"] == 1

    board = tmp_path / "tb"
    tracked = [json.loads(line)["step"] for line in (board / "tracked.jsonl").open()]
    assert tracked == sorted(set(tracked)) and tracked[-1] == STEPS, tracked
    assert len(tracked) >= STEPS - 2, tracked  # a kill's gap is at most the step in flight
    # The killed rank 0's TensorBoard buffer died with it; the new rank 0 wrote its own
    # event file, from the step after the watermark on.
    files = _scalar_steps(board, "train/loss")
    newest = files[-1]
    assert newest[-1] == STEPS and min(newest) > 12 - 2, files
    assert all(step in tracked for step in newest), (newest, tracked)
