"""The kill-then-join run that several end-to-end tests share, and its two checks.

``elastic-train local --nodes 3 --min-nodes 2 --chaos kill:1@step6,join:1@step10``:
the kill lands mid-run and the join only once the survivors train at world size 2,
however fast the machine is. ``--min-nodes 2``: the survivors never settle for a
world of one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest
import torch

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}
#: A small MLP on 96 synthetic samples, 6 steps per epoch: many finished
#: epochs to audit. Each step takes at least 0.1 s (tests/paced_model.py), so
#: the ~80 steps after the join trigger leave the joiner 8 s or more to start,
#: on any machine; the whole run takes about a minute on 2 busy cores.
PACED_STEPS = 90
PACED_MLP = [
    "--data.name=synthetic",
    "--data.num_samples=96",
    "--training.global_batch_size=16",
    f"--training.steps={PACED_STEPS}",
    "--training.final_loss_samples=96",
    "--checkpoint.interval_steps=4",
    "--model.name=tests.paced_model:paced_mlp",
]
#: The pace of the chaos run; the fault-free reference runs unpaced (a sleep
#: does not change the arithmetic).
PACED, UNPACED = "--model.options.seconds=0.1", "--model.options.seconds=0"
KILL_THEN_JOIN = ["--nodes", "3", "--min-nodes", "2", "--chaos", "kill:1@step6,join:1@step10"]


def run_kill_then_join(run_dir: Path, *args: str) -> dict:
    """Run ``elastic-train local`` with ``args`` through a kill and a join; its summary."""
    summary_path = run_dir / "out" / "summary.json"
    command = [
        sys.executable, "-m", "elastic_train.cli", "local", *KILL_THEN_JOIN,
        "--json", str(summary_path), "--run-dir", str(run_dir), "--quiet", "--no-timeline",
        "--timeout", "240", "--metrics-port", "0", *args,
    ]  # fmt: skip
    proc = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=300)
    assert summary_path.is_file(), proc.stderr[-3000:]
    return json.loads(summary_path.read_text())


def assert_completed_exactly_once(summary: dict, *, steps: int) -> None:
    """Every step ran, every sample once, and the world went 3 → 2 → 3."""
    assert summary["completed"], summary
    assert summary["final_step"] == steps
    assert summary["exactly_once"], summary["exactly_once_detail"]
    worlds = [(r["kind"], r["node"], r["world_size_after"]) for r in summary["recoveries"]]
    assert worlds == [("kill", 1, 2), ("join", 1, 3)], summary["recoveries"]


def assert_ends_like_reference(
    summary: dict,
    run_dir: Path,
    reference: list[str],
    *,
    tmp_path: Path,
    env: dict[str, str] | None = None,
    atol: float = 1e-5,
) -> None:
    """The run's final parameters and loss equal those of ``reference``, run as one
    process without faults (it gets its own audit and checkpoint dirs)."""
    proc = subprocess.run(
        [*reference, f"--logging.audit_dir={tmp_path / 'audit'}",
         f"--checkpoint.dir={tmp_path / 'ckpt'}"],
        env={**ENV, **(env or {})}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = torch.load(tmp_path / "audit" / "final_params.pt", weights_only=True)
    result = json.loads((tmp_path / "audit" / "result.json").read_text())
    assert_same_end(summary, run_dir, expected, result["final_loss"], atol=atol)


def assert_same_end(
    summary: dict, run_dir: Path, expected: dict[str, torch.Tensor], loss: float,
    *, atol: float = 1e-5,
) -> None:  # fmt: skip
    """The run's final parameters and loss equal the reference's ``expected`` and ``loss``."""
    actual = torch.load(run_dir / "audit" / "final_params.pt", weights_only=True)
    assert expected.keys() == actual.keys()
    for name in expected:
        # Summation order differs between world sizes 1, 2 and 3; a step
        # skipped or repeated on a resize would move the weights by ~1e-3.
        torch.testing.assert_close(actual[name], expected[name], rtol=0, atol=atol)
    assert summary["final_loss"] == pytest.approx(loss, abs=atol)


def worker_records(run_dir: Path, kind: str) -> list[dict]:
    """The audit records of ``kind`` that the workers of a run wrote."""
    return [
        record
        for path in (run_dir / "audit").glob("*.jsonl")
        for line in path.read_text().splitlines()
        if (record := json.loads(line)).get("kind") == kind
    ]


def resumes_by_process(run_dir: Path) -> dict[str, list[tuple[str, int]]]:
    """(source, world size) of each resume record, per worker process (audit file)
    that resumed at all.

    A process without one never trained: on a loaded box the first round may
    close without a late node's agent (``--min-nodes`` below ``--nodes``), and
    the round that lets it in replaces workers that were still starting. A CI
    run had such an empty file for two of three nodes.
    """
    found: dict[str, list[tuple[str, int]]] = {}
    for path in sorted((run_dir / "audit").glob("worker-*.jsonl")):
        records = [json.loads(line) for line in path.read_text().splitlines()]
        starts = [(r["source"], r["world_size"]) for r in records if r["kind"] == "resume"]
        if starts:
            found[path.name] = starts
    return found


def log_events(log: Path, name: str) -> list[dict]:
    """The structured log events ``name`` in a node's log (JSON lines among others)."""
    lines = [line for line in log.read_text().splitlines() if line.startswith("{")]
    return [e for e in map(json.loads, lines) if e.get("event") == name]


def worker_events(run_dir: Path, name: str) -> list[dict]:
    """The structured log lines ``name`` of every process, with their epoch ``time``."""
    found = []
    for path in (run_dir / "logs").glob("*.log"):
        for line in path.read_text(errors="replace").splitlines():
            if f'"{name}"' not in line or not line.startswith("{"):
                continue
            event = json.loads(line)
            stamp = event["timestamp"].replace("Z", "+00:00")
            found.append({**event, "time": datetime.fromisoformat(stamp).timestamp()})
    return found


def run_chaos(run_dir: Path, cluster: list[str], *args: str, timeout: float = 240) -> dict:
    """``elastic-train local`` with the cluster options ``cluster`` (nodes, chaos) and
    the trainer's ``args``; its summary. ``run_kill_then_join`` with any schedule."""
    summary_path = run_dir / "out" / "summary.json"
    command = [
        sys.executable, "-m", "elastic_train.cli", "local", *cluster,
        "--json", str(summary_path), "--run-dir", str(run_dir), "--quiet", "--no-timeline",
        "--timeout", str(timeout), "--metrics-port", "0", *args,
    ]  # fmt: skip
    proc = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=timeout + 60)
    assert summary_path.is_file(), proc.stderr[-3000:]
    return json.loads(summary_path.read_text())


def assert_ran_exactly_once(summary: dict, *, steps: int) -> None:
    """Every step ran and every sample once, whatever the schedule did to the world."""
    assert summary["completed"], summary
    assert summary["final_step"] == steps
    assert summary["exactly_once"], summary["exactly_once_detail"]
