"""``elastic-train local`` chaos runs whose pace the test steers through a file.

The forwards pause (``tests/steered_model.py``, or the own-script's
``FIT_SCRIPT_PAUSE_FILE``) while the faults play out, so every kill lands
mid-run and the joiner arrives before the end on any machine. Once the audit
shows the rejoined world training, the pause drops to none: the steps left are
only wall time, and a sleep changes no number, so what the tests assert
(exactly once, the final parameters of a fault-free run) is unchanged.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
from chaos_runs import KILL_THEN_JOIN, PACED_MLP, assert_same_end
from trainer_procs import run_workers

from elastic_train.audit import AuditTail, ResumeRecord, StepRecord

ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}
#: seconds between two looks at the audit
TICK_S = 0.25
#: run_steered_kill_then_join's pause from the kill until the rejoined world trains: the
#: joiner's start-up (4-5 s on a quiet 2-core box, more beside another test) must end
#: before the steps do
JOIN_WAIT_S = 0.5
#: chaos_runs.PACED_MLP with the steered pause (none without a pause file)
STEERED_MLP = [
    *(arg for arg in PACED_MLP if not arg.startswith("--model.name=")),
    "--model.name=tests.steered_model:steered",
]


class Pace:
    """The pause file the workers read at every forward."""

    def __init__(self, path: Path, seconds: float) -> None:
        self.path = path
        self.seconds = seconds
        self.set(seconds)

    def set(self, seconds: float) -> None:
        self.seconds = seconds
        partial = self.path.with_suffix(".tmp")
        partial.write_text(str(seconds))
        os.replace(partial, self.path)  # a forward never reads half a number


class RejoinWatch:
    """Tells, from the audit, when a world of ``nodes`` trains again after it shrank.

    In time order over all workers' files (each worker has its own, read at its own
    pace): a full world (a resume or a step), then a resume at a smaller world, then
    a resume at the full world, then a step at the full world. Steps are not enough
    on their own: steps a full world ran before a kill and the survivors redo after
    it (lost steps) have larger numbers than the survivors' first step. A start at a
    smaller world (a node late to the first round) is no shrink.
    """

    def __init__(self, audit_dir: Path, *, nodes: int) -> None:
        self.nodes = nodes
        self._tail = AuditTail(audit_dir)
        self._records: list[StepRecord | ResumeRecord] = []
        self.rejoined = False
        #: the world shrank (it may have rejoined since)
        self.shrunk = False

    def poll(self) -> bool:
        if self.rejoined or not self._tail.directory.is_dir():
            return self.rejoined
        self._records.extend(self._tail.poll())
        self.rejoined = self._full_after_shrink(sorted(self._records, key=lambda r: r.time))
        return self.rejoined

    def _full_after_shrink(self, records: list[StepRecord | ResumeRecord]) -> bool:
        seen_full = shrunk = resumed_full = False
        for record in records:
            full = record.world_size == self.nodes
            if isinstance(record, ResumeRecord):
                shrunk = shrunk or (seen_full and not full)
                resumed_full = resumed_full or (shrunk and full)
            elif full and resumed_full:
                return True
            seen_full = seen_full or full
        self.shrunk = shrunk
        return False


def run_steered(
    run_dir: Path,
    command: list[str],
    *,
    pace: Pace,
    nodes: int,
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
    on_tick: Callable[[], None] | None = None,
    join_wait: float = 0.0,
) -> dict:
    """Run ``elastic-train local`` (``command``: its options after ``local``, with
    ``--run-dir run_dir``); end the pause once ``nodes`` train again after a fault.
    From the shrink until then a step pauses at least ``join_wait`` seconds (only
    for a join due within a few steps of the kill: chaos events trigger on steps).
    ``on_tick`` runs at every look. Returns the run's summary (``--json``)."""
    summary_path = run_dir / "out" / "summary.json"
    # Ours first: whatever follows --script is the script's own command line.
    argv = [sys.executable, "-m", "elastic_train.cli", "local", "--json", str(summary_path),
            "--quiet", "--no-timeline", *command]  # fmt: skip
    run_dir.mkdir(parents=True, exist_ok=True)
    stderr_path = run_dir.parent / f"{run_dir.name}-local.stderr"  # a pipe could fill up
    watch = RejoinWatch(run_dir / "audit", nodes=nodes)
    with stderr_path.open("w") as stderr_file:
        proc = subprocess.Popen(argv, env=env or ENV, stdout=subprocess.DEVNULL,
                                stderr=stderr_file)  # fmt: skip
    try:
        deadline = time.monotonic() + timeout
        while proc.poll() is None and time.monotonic() < deadline:
            if not watch.rejoined and watch.poll():
                pace.set(0.0)
            elif watch.shrunk and 0 < pace.seconds < join_wait:
                # A fixed pace gave the joiner a fixed number of seconds, and beside
                # another test its start-up outlasted them (the join landed after the end).
                pace.set(join_wait)
            if on_tick is not None:
                on_tick()
            time.sleep(TICK_S)
    finally:
        if proc.poll() is None:  # a timeout, or pytest interrupted
            # SIGTERM: the runner stops its node agents and etcd on the way out; a
            # SIGKILL left them orphaned.
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    assert summary_path.is_file(), stderr_path.read_text()[-3000:]
    return json.loads(summary_path.read_text())  # type: ignore[no-any-return]


def run_steered_kill_then_join(
    run_dir: Path, *args: str, pace: Pace, env: dict[str, str] | None = None
) -> dict:
    """chaos_runs.run_kill_then_join, steered: ``args`` train the steered model
    (``STEERED_MLP``), whose forwards read ``pace``'s file."""
    command = [*KILL_THEN_JOIN, "--run-dir", str(run_dir), "--timeout", "240",
               "--metrics-port", "0", *args, f"--model.options.pause_file={pace.path}"]  # fmt: skip
    return run_steered(run_dir, command, pace=pace, nodes=3, join_wait=JOIN_WAIT_S, env=env)


def forked_reference(out: Path, cli_args: Sequence[str]) -> tuple[dict[str, torch.Tensor], float]:
    """The fault-free one-process run of main.py's ``cli_args`` (``--key=value``): its final
    parameters and loss. Forked from the session's forkserver, which imported torch once
    (tests/workers.py), instead of a new interpreter; the same ``elastic_train.main.run``."""
    overrides = [arg.removeprefix("--") for arg in cli_args]
    run_workers(1, [*overrides, f"logging.audit_dir={out / 'audit'}",
                    f"checkpoint.dir={out / 'ckpt'}"])  # fmt: skip
    params = torch.load(out / "audit" / "final_params.pt", weights_only=True)
    result = json.loads((out / "audit" / "result.json").read_text())
    return params, float(result["final_loss"])


def assert_ends_like(
    summary: dict, run_dir: Path, reference: Path, cli_args: Sequence[str], *, atol: float = 1e-5
) -> None:
    """chaos_runs.assert_ends_like_reference, with the reference from ``forked_reference``:
    the run's final parameters and loss equal those of one process without faults."""
    expected, loss = forked_reference(reference, cli_args)
    assert_same_end(summary, run_dir, expected, loss, atol=atol)
