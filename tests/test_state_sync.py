"""The trainer's use of snapshots: cadence, who writes, refusal, removal, local restore."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from elastic_train.config.job import ElasticConfig
from elastic_train.config.load import load_config
from elastic_train.errors import ConfigError
from elastic_train.state.shm_names import remove_run_snapshots
from elastic_train.training.distributed import WorkerEnv
from elastic_train.training.state_sync import (
    NodeSnapshots,
    SnapshotCadence,
    open_snapshots,
    restore_state,
    snapshot_run_id,
)

ENV = WorkerEnv(run_id="job-7", node="node1", launched=True)


def _state(step: int, numel: int = 256) -> dict:
    return {"model": {"w": torch.full((numel,), float(step))}, "step": step}


def _open(tmp_path: Path, env: WorkerEnv = ENV, **elastic: object) -> NodeSnapshots | None:
    return open_snapshots(ElasticConfig(**elastic), env, fingerprint="fp", root=tmp_path)  # type: ignore[arg-type]


def test_a_fixed_interval_snapshots_every_n_steps() -> None:
    cadence = SnapshotCadence(every=3, max_overhead=0.02)
    taken = []
    for step in range(1, 11):
        if cadence.due(step):
            cadence.observe_snapshot(step, seconds=1.0)  # cost never changes a fixed interval
            taken.append(step)
    assert taken == [1, 3, 6, 9]  # the first step, then multiples: the same steps on every node


def _simulate(
    cadence: SnapshotCadence,
    steps: range,
    *,
    step_ms: float,
    save_ms: float,
    aftermath_ms: tuple[float, ...] = (),
) -> float:
    """Drive ``cadence`` as ``NodeSnapshots.after_step`` does, for a loop whose
    steps take ``step_ms``, whose snapshots take ``save_ms``, and whose steps
    right after a snapshot take ``aftermath_ms`` longer; the run's overhead."""
    last, total = None, 0.0
    for step in steps:
        since = step - last if last is not None else 0
        seconds = step_ms + (aftermath_ms[since - 1] if 0 < since <= len(aftermath_ms) else 0.0)
        cadence.observe_step(step, seconds / 1000)
        total += seconds
        if cadence.due(step):
            cadence.observe_snapshot(step, seconds=save_ms / 1000)
            last, total = step, total + save_ms
    return total / (len(steps) * step_ms) - 1


@pytest.mark.parametrize(
    ("step_ms", "save_ms", "aftermath_ms", "interval"),
    [
        # K = the power of two at or above cost / (2 % of the step): 4.5 -> 8, 49.5 -> 64
        (100.0, 1.0, (), 1),
        (60.0, 1.0, (), 1),
        (10.0, 0.9, (), 8),
        (7.0, 0.65, (), 8),
        (1.0, 0.99, (), 64),
        # The slower steps after a snapshot count: 0.2 + 0.8 + 0.3 ms against
        # 2 % of 4 ms is 16.25 -> 32, where the save alone would give 4.
        (4.0, 0.2, (0.8, 0.3), 32),
        # K = 1: every step is in an aftermath, the step time measured before stands.
        (100.0, 0.5, (0.9,), 1),
        # Aftermath steps that happen to run faster do not make a snapshot cheaper than its save.
        (10.0, 1.0, (-0.5, -0.5), 8),
    ],
)
def test_the_adaptive_interval_keeps_snapshots_within_the_budget(
    step_ms: float, save_ms: float, aftermath_ms: tuple[float, ...], interval: int
) -> None:
    cadence = SnapshotCadence(every=0, max_overhead=0.02)
    _simulate(cadence, range(1, 200), step_ms=step_ms, save_ms=save_ms, aftermath_ms=aftermath_ms)
    assert cadence.interval == interval
    overhead = _simulate(
        cadence, range(200, 200 + 64 * interval), step_ms=step_ms, save_ms=save_ms,
        aftermath_ms=aftermath_ms,
    )  # fmt: skip
    assert overhead <= 0.02
    later = range(200 + 64 * interval, 200 + 66 * interval)
    assert [s for s in later if cadence.due(s)] == [s for s in later if s % interval == 0]


def test_the_first_snapshot_allocates_and_is_not_a_measure() -> None:
    cadence = SnapshotCadence(every=0, max_overhead=0.02)
    cadence.observe_snapshot(1, seconds=1.0)
    for step in range(2, 4):
        cadence.observe_step(step, seconds=0.01)
    assert (cadence.snapshot_seconds, cadence.interval) == (None, 4)
    _simulate(cadence, range(4, 40), step_ms=10.0, save_ms=0.1)
    assert cadence.interval == 1


def test_nodes_with_different_costs_snapshot_at_common_steps() -> None:
    """DDP waits for the slowest rank: the steps of a node that snapshots
    less often are among those of a node that snapshots more often."""
    nodes = [SnapshotCadence(every=0, max_overhead=0.02) for _ in range(3)]
    taken: list[set[int]] = [set() for _ in nodes]
    for step in range(1, 400):
        for cadence, snapshot_ms, steps in zip(nodes, (0.5, 1.3, 3.1), taken, strict=True):
            cadence.observe_step(step, 0.01)
            if cadence.due(step):
                cadence.observe_snapshot(step, seconds=snapshot_ms / 1000)
                steps.add(step)
    late = [{s for s in steps if s > 100} for steps in taken]
    assert late[2] <= late[1] <= late[0], [len(s) for s in late]
    assert len(late[0]) > len(late[1]) > len(late[2]) > 0


def test_nodes_sharing_dev_shm_get_their_own_directory() -> None:
    assert snapshot_run_id(ENV) == "job-7.node1"
    assert snapshot_run_id(WorkerEnv(run_id="job 7", node="pod/a")) == "job_7.pod_a"


def test_snapshots_are_off_when_switched_off_or_without_a_run_id(tmp_path: Path) -> None:
    assert _open(tmp_path, snapshot=False) is None
    assert _open(tmp_path, WorkerEnv()) is None  # python main.py: no TORCHELASTIC_RUN_ID
    assert not list(tmp_path.iterdir())


def test_only_local_rank_0_writes_and_a_completed_run_removes_the_snapshot(tmp_path: Path) -> None:
    writer = _open(tmp_path, snapshot_every_steps=1)
    reader = _open(tmp_path, WorkerEnv(run_id="job-7", node="node1", local_rank=1))
    assert writer is not None and reader is not None
    for step in (1, 2, 3):
        writer.after_step(step, lambda step=step: _state(step))
        reader.after_step(step, lambda: pytest.fail("a non-writer built the state"))
    assert reader.store.latest_step() == 3
    writer.close(completed=False)  # a failed or preempted worker: the snapshot stays
    again = _open(tmp_path, snapshot_every_steps=1)
    assert again is not None and again.store.latest_step() == 3
    again.close(completed=True)
    assert not again.store.directory.exists()


def test_a_state_that_does_not_fit_turns_snapshots_off_and_keeps_the_last_one(
    tmp_path: Path,
) -> None:
    snapshots = _open(tmp_path, snapshot_every_steps=1, snapshot_max_mib=1.0)
    assert snapshots is not None
    snapshots.after_step(1, lambda: _state(1))
    snapshots.after_step(2, lambda: _state(2, numel=1 << 20))  # 4 MiB > the 1 MiB cap
    assert not snapshots.enabled
    snapshots.after_step(3, lambda: pytest.fail("snapshotting went on"))
    assert snapshots.store.latest_step() == 1
    snapshots.close(completed=True)


def test_a_second_writer_on_the_node_runs_without_snapshots(tmp_path: Path) -> None:
    first = _open(tmp_path)
    assert first is not None
    assert _open(tmp_path) is None  # the same run id and node: refused, not shared
    first.close(completed=True)


def test_restore_picks_the_snapshot_over_an_older_checkpoint_without_a_group(
    tmp_path: Path,
) -> None:
    snapshots = _open(tmp_path, snapshot_every_steps=1)
    assert snapshots is not None
    assert restore_state(snapshots, None, device=torch.device("cpu")).source == "none"
    snapshots.after_step(5, lambda: _state(5))
    source, step, state = restore_state(snapshots, None, device=torch.device("cpu"))
    assert (source, step) == ("snapshot", 5)
    assert state is not None and torch.equal(state["model"]["w"], _state(5)["model"]["w"])
    snapshots.close(completed=True)


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("elastic.snapshot_every_steps=-1", "elastic.snapshot_every_steps"),
        ("elastic.snapshot_max_overhead=0", "elastic.snapshot_max_overhead"),
        ("elastic.snapshot_max_mib=-2", "elastic.snapshot_max_mib"),
        ("elastic.snapshot=maybe", "elastic.snapshot"),
    ],
)
def test_bad_snapshot_settings_name_the_field(override: str, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        load_config(None, [override])


def test_a_runner_removes_every_node_snapshot_of_its_run_only(tmp_path: Path) -> None:
    stores = [
        _open(tmp_path, WorkerEnv(run_id=run_id, node=node))
        for run_id, node in (("job-7", "node0"), ("job-7", "node1"), ("job-70", "node0"))
    ]
    for snapshots in stores:
        assert snapshots is not None
        snapshots.after_step(1, lambda: _state(1))
        snapshots.close(completed=False)  # as if killed
    prefix = f"elastic_train-{os.getuid()}-"
    removed = remove_run_snapshots("job-7", root=tmp_path)
    assert sorted(p.name for p in removed) == [f"{prefix}job-7.node0", f"{prefix}job-7.node1"]
    assert [p.name for p in tmp_path.iterdir()] == [f"{prefix}job-70.node0"]
