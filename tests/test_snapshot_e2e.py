"""End to end: per-step snapshots in /dev/shm under real torchrun nodes, real etcd, SIGKILL.

One chaos run on three nodes serves most tests: node 1 is killed, a new node
(node 3, an empty /dev/shm) joins, then the node that holds rank 0 is killed.
A second job is killed whole and started again by a new runner invocation.
The scenarios are driven with the chaos tests' :class:`Scenario`.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from test_chaos_faults import JOB, PARAM_ATOL, Scenario
from trainer_procs import run_workers

from elastic_train.audit import AuditLog
from elastic_train.chaos import node_of_rank
from elastic_train.config import fingerprint, load_config
from elastic_train.local import Summary
from elastic_train.snapshot import SnapshotStore

STEPS = 96  # 6 epochs of 16 steps
#: A disk checkpoint every 10 steps: a restore from disk would lose up to 9.
ARGS = ("checkpoint.interval_steps=10", "elastic.snapshot_every_steps=1")
SHM = Path("/dev/shm")


def _shm_dirs(run_id: str) -> dict[str, Path]:
    """This run's snapshot directories, by node name."""
    prefix = f"elastic_train-{os.getuid()}-{run_id}."
    return {p.name.removeprefix(prefix): p for p in SHM.glob(f"{prefix}*")}


def _remove_shm_dirs(run_id: str) -> None:
    # A SIGKILLed node cannot remove its own; on a real cluster the pod's
    # memory emptyDir goes with it.
    for path in _shm_dirs(run_id).values():
        shutil.rmtree(path, ignore_errors=True)


def _snapshot(scenario: Scenario, node: str) -> tuple[int, dict] | None:
    """A node's newest snapshot, read as a restarted worker of the run would."""
    overrides = [arg.removeprefix("--") for arg in scenario.spec.script_args]
    fp = fingerprint(load_config(None, overrides))
    store = SnapshotStore(f"{scenario.cluster.run_id}.{node}", fingerprint=fp, is_writer=False)
    return store.load(map_location="cpu")


@pytest.fixture(scope="module")
def fault_free(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, float]:
    """Final parameters and loss of one process without faults (nor the pause)."""
    audit = tmp_path_factory.mktemp("fault-free")
    run_workers(1, [*JOB, f"training.steps={STEPS}", "model.options.pause_s=0",
                    "checkpoint.dir=", f"logging.audit_dir={audit}"])  # fmt: skip
    params = torch.load(audit / "final_params.pt", weights_only=True)
    return params, json.loads((audit / "result.json").read_text())["final_loss"]


def _assert_like_fault_free(
    summary: Summary, run_dir: Path, fault_free: tuple[dict, float]
) -> None:
    assert summary.completed, summary.to_json()
    assert summary.final_step == STEPS
    assert summary.exactly_once, summary.exactly_once_detail
    params = torch.load(run_dir / "audit" / "final_params.pt", weights_only=True)
    expected, loss = fault_free
    for name, value in expected.items():
        # Summation order changes with the world size; a step lost and redone
        # from other data, or a stale optimizer state, moves them far more.
        torch.testing.assert_close(params[name], value, atol=PARAM_ATOL, rtol=0)
    assert summary.final_loss == pytest.approx(loss, abs=1e-5)


class ChaosRun:
    """What the three-node chaos run left for the tests to check."""

    def __init__(self, summary: Summary, scenario: Scenario, shm_left: set[str]) -> None:
        self.summary = summary
        self.scenario = scenario
        self.shm_left = shm_left
        self.new_node_snapshots: list[tuple[int, dict]] = []
        self.killed_rank0_node: int | None = None


def _same_step_snapshots(s: Scenario, nodes: tuple[str, str]) -> list[tuple[int, dict]]:
    """Two nodes' snapshots of one step (read again until both show the same step)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        loaded = [_snapshot(s, node) for node in nodes]
        if all(loaded) and loaded[0][0] == loaded[1][0]:  # type: ignore[index]
            return loaded  # type: ignore[return-value]
        time.sleep(0.1)
    raise AssertionError(f"no common snapshot step of {nodes} within 60 s")


@pytest.fixture(scope="module")
def chaos_run(tmp_path_factory: pytest.TempPathFactory) -> ChaosRun:
    run_dir = tmp_path_factory.mktemp("snapshot-chaos") / "run"
    scenario = Scenario(run_dir, steps=STEPS, nodes=3, args=ARGS)
    run_id = scenario.cluster.run_id
    found: dict[str, object] = {}

    def script(s: Scenario) -> None:
        s.wait_for_step(12)
        s.deliver("kill", 1)
        s.wait_for_recovery(world_size=2)
        s.set_pause(0.3)  # the survivors must not finish before the new node is in
        s.deliver("join", 3)
        s.wait_for_recovery(world_size=3)
        s.set_pause(0.5)  # two nodes then show the same step for a while
        found["snapshots"] = _same_step_snapshots(s, ("node0", "node3"))
        s.set_pause(0.05)
        holder = node_of_rank(AuditLog.load(s.cluster.audit_dir), 0)
        assert holder is not None
        found["rank0_node"] = holder
        s.deliver("kill", holder)
        s.wait_for_recovery(world_size=2)
        s.finish_fast()

    try:
        summary = scenario.run(script)
        left = set(_shm_dirs(run_id))
    finally:
        _remove_shm_dirs(run_id)
    run = ChaosRun(summary, scenario, left)
    run.new_node_snapshots = found.get("snapshots", [])  # type: ignore[assignment]
    run.killed_rank0_node = found.get("rank0_node")  # type: ignore[assignment]
    return run


@pytest.mark.slow
def test_a_killed_node_costs_at_most_one_step(chaos_run: ChaosRun) -> None:
    kill = chaos_run.summary.recoveries[0]
    assert (kill.kind, kill.node, kill.world_size_after) == ("kill", 1, 2)
    assert kill.restore_source == "snapshot", chaos_run.summary.to_json()
    assert kill.lost_steps is not None and kill.lost_steps <= 1, kill


@pytest.mark.slow
def test_killing_the_node_of_rank0_costs_at_most_one_step(chaos_run: ChaosRun) -> None:
    kill = chaos_run.summary.recoveries[2]
    assert (kill.kind, kill.node) == ("kill", chaos_run.killed_rank0_node)
    assert kill.world_size_after == 2
    assert kill.restore_source == "snapshot", chaos_run.summary.to_json()
    assert kill.lost_steps is not None and kill.lost_steps <= 1, kill


@pytest.mark.slow
def test_a_new_node_receives_the_state_by_broadcast(chaos_run: ChaosRun) -> None:
    join = chaos_run.summary.recoveries[1]
    assert (join.kind, join.node, join.world_size_after) == ("join", 3, 3)
    assert join.restore_source == "snapshot"
    # The new node had nothing in /dev/shm and restored the survivors' step.
    log = (chaos_run.scenario.run_dir / "logs" / "node3.log").read_text()
    agreed = [json.loads(line) for line in log.splitlines() if '"restore_agreed"' in line]
    assert agreed[0]["local_snapshot"] is None and agreed[0]["source"] == "snapshot"
    assert agreed[0]["step"] == join.restored_step
    # Steps later, its own snapshot equals a survivor's bit for bit: parameters
    # and optimizer moments (a node without the optimizer state would drift).
    (step, survivor), (same_step, new) = chaos_run.new_node_snapshots
    assert step == same_step > join.restored_step  # type: ignore[operator]
    for part in ("model", "optimizer"):
        torch.testing.assert_close(new[part], survivor[part], rtol=0, atol=0)


@pytest.mark.slow
def test_the_run_ends_like_a_fault_free_one(
    chaos_run: ChaosRun, fault_free: tuple[dict, float]
) -> None:
    _assert_like_fault_free(chaos_run.summary, chaos_run.scenario.run_dir, fault_free)


@pytest.mark.slow
def test_a_completed_run_leaves_only_the_killed_nodes_snapshots(chaos_run: ChaosRun) -> None:
    killed = {f"node{d.node}" for d in chaos_run.summary.events if d.event.kind == "kill"}
    assert chaos_run.shm_left == killed


@pytest.mark.slow
def test_a_whole_job_restart_resumes_from_the_disk_checkpoint(
    tmp_path: Path, fault_free: tuple[dict, float]
) -> None:
    """Every node killed; a new runner invocation (a new run id, so none of the
    old snapshots) on the same checkpoint and audit directories."""
    run_dir = tmp_path / "run"
    first = Scenario(run_dir, steps=STEPS, nodes=2, args=ARGS)

    def kill_all(s: Scenario) -> None:
        s.wait_for_step(24)  # past the checkpoint of step 20
        s.deliver("kill", 0)
        s.deliver("kill", 1)

    try:
        killed = first.run(kill_all)
    finally:
        _remove_shm_dirs(first.cluster.run_id)
    assert not killed.completed
    manifests = (run_dir / "checkpoints").glob("step-*/MANIFEST.json")
    saved = sorted(int(p.parent.name.split("-")[1]) for p in manifests)
    second = Scenario(run_dir, steps=STEPS, nodes=2, args=ARGS)
    assert second.cluster.run_id != first.cluster.run_id
    try:
        summary = second.run(lambda s: s.finish_fast())
    finally:
        _remove_shm_dirs(second.cluster.run_id)
    last_kill = killed.events[-1].time
    resumes = [a for a in AuditLog.load(run_dir / "audit").attempts() if a.start_time > last_kill]
    assert resumes, "the second job did not start"
    assert (resumes[0].restore_source, resumes[0].restored_step) == ("disk", saved[-1])
    _assert_like_fault_free(summary, run_dir, fault_free)
