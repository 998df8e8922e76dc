"""End to end: per-step snapshots in /dev/shm under real torchrun nodes, real etcd, SIGKILL.

One chaos run on three nodes serves most tests: node 1 is killed, a new node
(node 3, an empty /dev/shm) joins, then the node that holds rank 0 is killed.
A second job is killed whole and started again by a new runner invocation.
The scenarios are driven with the chaos tests' :class:`Scenario`.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
from test_chaos_faults import JOB, PARAM_ATOL, Scenario
from trainer_procs import run_workers

from elastic_train.audit import AuditLog, audit_exactly_once
from elastic_train.config.job import fingerprint
from elastic_train.config.load import load_config
from elastic_train.local.chaos import node_of_rank
from elastic_train.local.runner import Summary
from elastic_train.state.snapshot import SnapshotStore

STEPS = 96  # 6 epochs of 16 steps
#: A disk checkpoint every 10 steps: a restore from disk would lose up to 9.
#: Snapshots serve the restart path: in process, the survivors keep the state in
#: memory (tests/test_inprocess*.py).
RESTART = "elastic.recovery=restart"
ARGS = ("checkpoint.interval_steps=10", "elastic.snapshot_every_steps=1", RESTART)
SHM = Path("/dev/shm")


def _shm_dirs(run_id: str) -> dict[str, Path]:
    """This run's snapshot directories, by node name."""
    prefix = f"elastic_train-{os.getuid()}-{run_id}."
    return {p.name.removeprefix(prefix): p for p in SHM.glob(f"{prefix}*")}


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


def _assert_ends_like_fault_free(
    summary: Summary, run_dir: Path, fault_free: tuple[dict, float]
) -> None:
    assert summary.completed, summary.to_json()
    assert summary.final_step == STEPS
    params = torch.load(run_dir / "audit" / "final_params.pt", weights_only=True)
    expected, loss = fault_free
    for name, value in expected.items():
        # Summation order changes with the world size; a step lost and redone
        # from other data, or a stale optimizer state, moves them far more.
        torch.testing.assert_close(params[name], value, atol=PARAM_ATOL, rtol=0)
    assert summary.final_loss == pytest.approx(loss, abs=1e-5)


class ChaosRun:
    """What the three-node chaos run left for the tests to check."""

    def __init__(self, summary: Summary, scenario: Scenario) -> None:
        self.summary = summary
        self.scenario = scenario
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

    run = ChaosRun(scenario.run(script), scenario)
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
    assert chaos_run.summary.exactly_once, chaos_run.summary.exactly_once_detail
    _assert_ends_like_fault_free(chaos_run.summary, chaos_run.scenario.run_dir, fault_free)


@pytest.mark.slow
def test_snapshots_are_removed_at_the_end(chaos_run: ChaosRun) -> None:
    finished = [name for name, state in chaos_run.summary.nodes.items() if state == "exited(0)"]
    assert len(finished) == 2, chaos_run.summary.nodes
    for name in finished:  # each surviving node's writer removed its own
        log = (chaos_run.scenario.run_dir / "logs" / f"{name}.log").read_text()
        assert '"snapshot_removed"' in log, name
    # and the runner those of the killed nodes
    assert not _shm_dirs(chaos_run.scenario.cluster.run_id)


@pytest.mark.slow
def test_a_whole_job_restart_resumes_from_the_disk_checkpoint(
    tmp_path: Path, fault_free: tuple[dict, float]
) -> None:
    """Every node killed; then a new runner invocation (a new run id, so none
    of the old snapshots) on the same checkpoint directory."""
    first = Scenario(tmp_path / "first", steps=STEPS, nodes=2, args=ARGS)

    def kill_all(s: Scenario) -> None:
        s.wait_for_step(24)  # past the checkpoint of step 20
        s.deliver("kill", 0)
        s.deliver("kill", 1)

    killed = first.run(kill_all)
    assert not killed.completed
    manifests = first.cluster.checkpoint_dir.glob("step-*/MANIFEST.json")
    saved = max(int(p.parent.name.split("-")[1]) for p in manifests)
    # The same job: the pause file is a model option, part of the fingerprint.
    same_job = (*ARGS, f"model.options.pause_file={first.pause_file}")
    second = Scenario(tmp_path / "second", steps=STEPS, nodes=2, args=same_job)
    assert second.cluster.run_id != first.cluster.run_id
    second.run_dir.mkdir()
    second.cluster.checkpoint_dir.symlink_to(first.cluster.checkpoint_dir)
    summary = second.run(lambda s: first.finish_fast())
    attempts = AuditLog.load(second.cluster.audit_dir).attempts()
    assert (attempts[0].restore_source, attempts[0].restored_step) == ("disk", saved)
    _assert_ends_like_fault_free(summary, second.run_dir, fault_free)
    # One job over both invocations: every sample once per epoch.
    whole, later = AuditLog.load(first.cluster.audit_dir), AuditLog.load(second.cluster.audit_dir)
    for record in (*later.steps, *later.resumes):
        whole.add(record)
    verdict = audit_exactly_once(whole, dataset_len=summary.dataset_len or 0)
    assert verdict.ok, verdict.detail


@pytest.mark.slow
def test_a_failed_step_is_snapshotted_before_the_survivors_exit(
    tmp_path: Path, fault_free: tuple[dict, float]
) -> None:
    """Periodic snapshots only every 1000 steps and a disk checkpoint every 10:
    only the survivors' snapshot of the last step completed before the peer's
    death broke the all-reduce keeps the loss to at most one step."""
    args = ("checkpoint.interval_steps=10", "elastic.snapshot_every_steps=1000", RESTART)
    scenario = Scenario(tmp_path / "run", steps=STEPS, nodes=3, args=args)

    def script(s: Scenario) -> None:
        s.wait_for_step(14)  # past the first snapshot (step 1) and checkpoint (step 10)
        s.deliver("kill", 1)
        s.wait_for_recovery(world_size=2)
        s.finish_fast()

    summary = scenario.run(script)
    kill = summary.recoveries[0]
    assert kill.restore_source == "snapshot", summary.to_json()
    assert kill.lost_steps is not None and kill.lost_steps <= 1, kill
    rescued = set()
    for node in ("node0", "node2"):
        for line in (scenario.run_dir / "logs" / f"{node}.log").read_text().splitlines():
            if '"snapshot_kept"' in line:
                event = json.loads(line[line.index("{") :])
                rescued.add((event["reason"], event["step"]))
    assert ("failure", kill.restored_step) in rescued, (rescued, kill)
    assert summary.exactly_once, summary.exactly_once_detail
    _assert_ends_like_fault_free(summary, scenario.run_dir, fault_free)


def _events(scenario: Scenario, name: str) -> list[dict]:
    """Every node's log records of event ``name``."""
    found = []
    for log in sorted((scenario.run_dir / "logs").glob("node*.log")):
        for line in log.read_text().splitlines():
            if f'"event": "{name}"' in line:
                found.append(json.loads(line[line.index("{") :]))
    return found


@pytest.mark.slow
def test_a_preempted_node_leaves_without_a_disk_save_while_others_stay(
    tmp_path: Path, fault_free: tuple[dict, float]
) -> None:
    """SIGTERM to one node of three, with periodic snapshots and checkpoints
    too rare to help: the staying nodes snapshot the stop step, so nobody
    waits for a disk save at the stop; the group resumes from that snapshot
    (zero lost steps) and then writes the step to disk."""
    args = ("checkpoint.interval_steps=1000", "elastic.snapshot_every_steps=1000", RESTART)
    scenario = Scenario(tmp_path / "run", steps=STEPS, nodes=3, args=args)

    def script(s: Scenario) -> None:
        s.wait_for_step(20)  # between the epoch-end checkpoints of steps 16 and 32
        s.deliver("term", 1)
        s.wait_for_recovery(world_size=2)
        s.finish_fast()

    summary = scenario.run(script)
    term = summary.recoveries[0]
    assert (term.lost_steps, term.restore_source) == (0, "snapshot"), summary.to_json()
    stop = term.restored_step
    kept = {(e["node"], e["step"]) for e in _events(scenario, "snapshot_kept")}
    assert {("node0", stop), ("node2", stop)} <= kept, kept
    saved = [e for e in _events(scenario, "checkpoint_saved") if e["step"] == stop]
    assert saved and all(e["world_size"] == 2 for e in saved), saved  # after the restart only
    assert summary.exactly_once, summary.exactly_once_detail
    _assert_ends_like_fault_free(summary, scenario.run_dir, fault_free)
