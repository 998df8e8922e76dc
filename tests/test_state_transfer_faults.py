"""A node that dies while it sends the group's state to a joiner (issue 20, item 6).

In-process recovery moves state in its last collectives: at an admission the
group's rank 0 broadcasts the newest state to the joiner (``rollback.take_newest``).
A CI run caught rank 0's node SIGKILLed in that broadcast: two ranks waited in a
gloo receive for the full ``pg_timeout_seconds`` (60 s), and the joiner, whose
failure there was not handled, exited to a restart of every worker. Now those
collectives run under the in-process floor timeout and a failure in them
re-forms the group without the dead node, the joiner included.

Here ``fault_hooks.probe_mlp``'s ``die_sending_state`` SIGSTOPs rank 0's worker
at exactly that moment (``elastic.heal_joins`` off: the broadcast), or kills its
node in the step in which the joiner heals (``training/heal.py``), with real
processes: three nodes train, a fourth joins.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from chaos_runs import assert_ran_exactly_once, log_events, worker_records
from steered_runs import Pace, assert_ends_like, run_steered
from torch_support import needs_inprocess

from elastic_train.audit import AuditTail, StepRecord

STEPS = 150
JOB = [
    "--data.name=synthetic",
    "--data.num_samples=96",
    "--training.global_batch_size=16",
    f"--training.steps={STEPS}",
    "--training.final_loss_samples=96",
    "--training.micro_batch_size=0",
    "--checkpoint.interval_steps=50",
    "--model.name=tests.fault_hooks:probe_mlp",
]
#: seconds a step pauses until the joiner trains (its start-up takes 3-10 s): the
#: joiner, whose side of the group forms while the members train, waits about a
#: step for their switch, longer than the floor
PAUSE_S = 2.0
#: the in-process floor timeout, which bounds the state transfer
FLOOR_S = 1.0
#: the process-group timeout, which no survivor may wait out
PG_TIMEOUT_S = 60.0


@needs_inprocess
@pytest.mark.slow
def test_a_node_stopped_while_it_sends_a_joiner_the_state_is_re_formed_around(
    tmp_path: Path,
) -> None:
    # SIGSTOP: its sockets stay open, and only the floor timeout ends the receives
    # that wait for it (a SIGKILL closes them: the heal test below). In the
    # switch's broadcast of the whole state, heal_joins off: the suite's run of it.
    run_dir = tmp_path / "run"
    marker = tmp_path / "died.json"
    pace = Pace(tmp_path / "pause", PAUSE_S)
    tail = AuditTail(run_dir / "audit")

    def end_pace_once_the_joiner_trains() -> None:
        if pace.seconds and any(
            isinstance(r, StepRecord) and r.node == "node3" for r in tail.poll()
        ):
            pace.set(0.0)

    command = [
        "--nodes", "3", "--min-nodes", "2", "--chaos", "join:3@step3",
        "--run-dir", str(run_dir), "--timeout", "240", "--metrics-port", "0", *JOB,
        f"--model.options.pause_file={pace.path}", f"--model.options.die_sending_state={marker}",
        "--model.options.sending_state_fault=stop", "--elastic.recovery=inprocess",
        f"--elastic.pg_timeout_seconds={PG_TIMEOUT_S}",
        f"--elastic.inprocess_timeout_floor_seconds={FLOOR_S}",
        "--elastic.heal_joins=false",
        "--finish-grace", "3",  # a stopped worker never exits by itself
    ]  # fmt: skip
    summary = run_steered(
        run_dir, command, pace=pace, nodes=0, on_tick=end_pace_once_the_joiner_trains
    )
    assert_ran_exactly_once(summary, steps=STEPS)
    died = json.loads(marker.read_text())  # the hook fired: rank 0 was sending the state
    assert died["node"] == "node0", died
    # Every start after the first was in process: no worker restarted, the joiner
    # neither (it used to exit, and every worker restarted from a snapshot).
    sources = {r["source"] for r in worker_records(run_dir, "resume")}
    assert sources == {"none", "inprocess"}, sources  # none: the first start
    failed = {node: [e["error"] for e in log_events(run_dir / "logs" / f"{node}.log",
                                                    "inprocess_rollback_failed")]
              for node in ("node1", "node2", "node3")}  # fmt: skip
    # The joiner failed once, at the fault: its wait for the switch is not bounded.
    assert len(failed["node3"]) == 1, failed
    errors = [error for node_errors in failed.values() for error in node_errors]
    timeouts = [error for error in errors if f"Timed out waiting {FLOOR_S * 1000:.0f}ms" in error]
    assert timeouts, failed  # its sockets stayed open: the floor timeout, not pg_timeout's
    # The three left (the joiner among them) train again long before the 60 s timeout.
    later = [r for r in worker_records(run_dir, "step") if r["time"] > died["time"]]
    first = min(r["time"] for r in later)
    assert first - died["time"] < PG_TIMEOUT_S / 3, first - died["time"]
    assert {r["node"] for r in later} == {"node1", "node2", "node3"}
    assert {r["world_size"] for r in later} == {3}
    assert_ends_like(summary, run_dir, tmp_path / "reference", JOB, atol=2.5e-5)


@needs_inprocess
@pytest.mark.slow
def test_rank0_dying_while_a_joiner_heals_leaves_the_joiner_a_members_state(
    tmp_path: Path,
) -> None:
    """The joiner heals in the first step of the group of four (``training/heal.py``):
    rank 0 has posted its sends of the model and the optimizer, and dies at its last
    gradient, before the step's all-reduce. The joiner holds no step's weights yet:
    it writes no rescue snapshot, and the re-form without node0 brings it the whole
    state by broadcast from another member."""
    run_dir = tmp_path / "run"
    marker = tmp_path / "died.json"
    pace = Pace(tmp_path / "pause", PAUSE_S)
    command = [
        "--nodes", "3", "--min-nodes", "2", "--chaos", "join:3@step3",
        "--run-dir", str(run_dir), "--timeout", "240", "--metrics-port", "0", *JOB,
        f"--model.options.pause_file={pace.path}", f"--model.options.die_sending_state={marker}",
        "--model.options.sending_state_fault=kill_healing", "--elastic.recovery=inprocess",
        f"--elastic.pg_timeout_seconds={PG_TIMEOUT_S}",
        f"--elastic.inprocess_timeout_floor_seconds={FLOOR_S}",
    ]  # fmt: skip
    tail = AuditTail(run_dir / "audit")

    def end_pace_after_the_kill() -> None:
        if pace.seconds and marker.exists() and any(
            isinstance(r, StepRecord) and r.node == "node3" and r.world_size == 3
            for r in tail.poll()
        ):  # fmt: skip
            pace.set(0.0)

    summary = run_steered(run_dir, command, pace=pace, nodes=0, on_tick=end_pace_after_the_kill)
    assert_ran_exactly_once(summary, steps=STEPS)
    died = json.loads(marker.read_text())
    assert died["node"] == "node0", died
    joiner_log = run_dir / "logs" / "node3.log"
    (started,) = log_events(joiner_log, "inprocess_heal_started")
    assert started["role"] == "joiner"
    assert not log_events(joiner_log, "inprocess_healed")  # the step failed first
    assert not log_events(joiner_log, "snapshot_kept")  # no rescue of a stateless joiner
    got = log_events(joiner_log, "inprocess_newest_broadcast")
    assert [e["step"] for e in got] == [started["step"]], got
    sources = {r["source"] for r in worker_records(run_dir, "resume")}
    assert sources == {"none", "inprocess"}, sources
    later = [r for r in worker_records(run_dir, "step") if r["time"] > died["time"]]
    assert min(r["time"] for r in later) - died["time"] < PG_TIMEOUT_S / 3
    assert {(r["node"], r["world_size"]) for r in later} >= {("node3", 3), ("node1", 3)}
    assert_ends_like(summary, run_dir, tmp_path / "reference", JOB, atol=2.5e-5)
