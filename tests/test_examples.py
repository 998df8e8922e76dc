"""Every example in examples/ runs as its docstring says and actually trains.

Each one is run the way a user would (``python examples/X.py`` or torchrun), in a
scratch directory; the test reads the JSON log events and checks that the job
ran all its steps and that the model learned (final loss below the first step's).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = REPO / "examples"
TORCHRUN = Path(sys.executable).with_name("torchrun")


def _events(output: str) -> list[dict[str, Any]]:
    events = []
    for line in output.splitlines():
        line = line.partition("]:")[2] if line.startswith("[") else line  # torchrun's prefix
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and "event" in event:
            events.append(event)
    return events


def _run(command: list[str], cwd: Path) -> tuple[list[dict[str, Any]], str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [*command, "--logging.format=json"],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=180,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return _events(done.stdout + done.stderr), done.stdout


def _assert_trained(events: list[dict[str, Any]], *, steps: int) -> None:
    first = next(e for e in events if e["event"] == "step")
    finished = [e for e in events if e["event"] == "training_finished"]
    assert len(finished) == 1, [e["event"] for e in events]
    assert finished[0]["final_step"] == steps
    assert finished[0]["final_loss"] < first["loss"], (first, finished[0])


@pytest.mark.parametrize(
    ("script", "steps"),
    [("custom_model_dataset.py", 30), ("mixed_precision.py", 60), ("evaluation.py", 60)],
)
def test_single_process_example_trains(script: str, steps: int, tmp_path: Path) -> None:
    events, stdout = _run([sys.executable, str(EXAMPLES / script)], tmp_path)
    _assert_trained(events, steps=steps)
    if script == "evaluation.py":
        evaluations = [e for e in events if e["event"] == "evaluation"]
        assert [e["step"] for e in evaluations] == [20, 40, 60, 60]  # every 20 steps + at end
        assert evaluations[-1]["accuracy"] > 0.5  # digits, 10 classes
        assert "untrained model: loss" in stdout  # the stand-alone half


@pytest.mark.slow
def test_ddp_migration_example_runs_under_torchrun(tmp_path: Path) -> None:
    script = EXAMPLES / "ddp_migration" / "after_elastic_train.py"
    events, _ = _run(
        [str(TORCHRUN), "--standalone", "--nproc-per-node", "2", str(script)], tmp_path
    )
    # 3 epochs of 2048 samples at a global batch of 32.
    _assert_trained(events, steps=3 * 2048 // 32)
    assert {e["world_size"] for e in events if e["event"] == "step"} == {2}
    assert any((tmp_path / "checkpoints" / "ddp_migration").glob("step-*"))
