"""The runner's side of the audit protocol: reading records and the exactly-once verdict."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from audit_sim import SimRun
from hypothesis import given
from hypothesis import strategies as st

import elastic_train.audit as audit_module
from elastic_train.audit import (
    AuditLog,
    AuditTail,
    AuditWriter,
    ResumeRecord,
    StepRecord,
    audit_exactly_once,
    committed_steps,
)


def test_reader_parses_what_the_writer_writes(tmp_path: Path) -> None:
    writer = AuditWriter(tmp_path, attempt="x1", rank=1, world_size=3, node="node1")
    writer.resume(restored_step=4, source="snapshot")
    writer.step(step=5, epoch=0, indices=[7, 3], loss=0.25)
    writer.close()
    audit = AuditLog.load(tmp_path)
    (resume,) = audit.resumes
    (step,) = audit.steps
    assert isinstance(resume, ResumeRecord) and isinstance(step, StepRecord)
    assert (resume.attempt, resume.restored_step, resume.source) == ("x1", 4, "snapshot")
    assert (resume.rank, resume.world_size, resume.node) == (1, 3, "node1")
    assert (step.step, step.epoch, step.indices, step.loss) == (5, 0, (7, 3), 0.25)
    assert step.time >= resume.time > 0


def test_tail_reads_each_complete_line_once_and_never_a_torn_one(tmp_path: Path) -> None:
    path = tmp_path / "worker-node0-1.jsonl"
    record = {"kind": "step", "attempt": "a", "step": 1, "epoch": 0, "rank": 0, "world_size": 1,
              "node": "node0", "indices": [0], "loss": 1.0, "time": 1.0}  # fmt: skip
    line = json.dumps(record) + "\n"
    path.write_text(line + line[:10])  # a worker killed in the middle of its second write
    tail = AuditTail(tmp_path)
    assert [r.step for r in tail.poll()] == [1]  # type: ignore[union-attr]
    assert tail.poll() == []
    with open(path, "a") as handle:
        handle.write(line[10:].replace('"step": 1', '"step": 2'))
    assert [r.step for r in tail.poll()] == [2]  # type: ignore[union-attr]
    assert tail.log.malformed == 0 and len(tail.log.steps) == 2


def test_a_malformed_complete_line_fails_the_audit(tmp_path: Path) -> None:
    sim = SimRun(tmp_path)
    sim.attempt(world_size=2, restored=0, last=4)
    (tmp_path / "worker-node9-1.jsonl").write_text('{"kind": "step", "step": \n')
    verdict = audit_exactly_once(AuditLog.load(tmp_path), dataset_len=sim.dataset_len)
    assert not verdict.ok and "malformed" in verdict.detail


def test_resizes_with_redone_steps_are_exactly_once(tmp_path: Path) -> None:
    # 20 samples, batches of 6: 4 steps per epoch. World 3, killed after step 9
    # with a checkpoint at 6; world 2 redoes 7..9 and runs to 13; world 3 to 14.
    sim = SimRun(tmp_path)
    sim.attempt(world_size=3, restored=0, last=9)
    sim.attempt(world_size=2, restored=6, last=13, source="disk")
    sim.attempt(world_size=3, restored=13, last=14, source="snapshot")
    audit = AuditLog.load(tmp_path)
    verdict = audit_exactly_once(audit, dataset_len=sim.dataset_len)
    assert verdict.ok, verdict.detail
    assert verdict.committed_steps == 14
    assert verdict.finished_epochs == 3  # epochs 0..2; epoch 3 has 2 of its 4 steps
    committed = committed_steps(audit)
    assert {r.world_size for r in committed[7]} == {2}  # the redo, not the discarded run
    assert {r.world_size for r in committed[14]} == {3}


def test_discarded_steps_do_not_count_even_when_they_were_wrong(tmp_path: Path) -> None:
    sim = SimRun(tmp_path)
    sim.attempt(world_size=3, restored=0, last=6, batch_of={5: 1, 6: 1})  # thrown away
    sim.attempt(world_size=2, restored=4, last=8)
    verdict = audit_exactly_once(AuditLog.load(tmp_path), dataset_len=sim.dataset_len)
    assert verdict.ok, verdict.detail


def test_a_restore_at_the_wrong_position_is_caught(tmp_path: Path) -> None:
    # The resumed attempt claims step 6 but replays the data of steps 5 and 6.
    sim = SimRun(tmp_path)
    sim.attempt(world_size=3, restored=0, last=6)
    sim.attempt(world_size=2, restored=6, last=8, batch_of={7: 5, 8: 6})
    verdict = audit_exactly_once(AuditLog.load(tmp_path), dataset_len=sim.dataset_len)
    assert not verdict.ok
    assert "epoch 1" in verdict.detail and "consumed twice" in verdict.detail


def test_skipped_samples_in_a_finished_epoch_are_caught(tmp_path: Path) -> None:
    sim = SimRun(tmp_path)
    sim.attempt(world_size=3, restored=0, last=2)
    sim.attempt(world_size=2, restored=2, last=6, batch_of={3: 5})  # step 3's data never seen
    verdict = audit_exactly_once(AuditLog.load(tmp_path), dataset_len=sim.dataset_len)
    assert not verdict.ok and "epoch 0" in verdict.detail


def test_a_missing_rank_record_names_the_step_and_ranks(tmp_path: Path) -> None:
    sim = SimRun(tmp_path)
    sim.attempt(world_size=3, restored=0, last=5, skip_rank_at=(3, 1))
    verdict = audit_exactly_once(AuditLog.load(tmp_path), dataset_len=sim.dataset_len)
    assert not verdict.ok
    assert "step 3" in verdict.detail and "ranks [0, 2]" in verdict.detail


def test_a_restored_step_nobody_recorded_is_caught(tmp_path: Path) -> None:
    sim = SimRun(tmp_path)
    sim.attempt(world_size=3, restored=0, last=4)
    sim.attempt(world_size=2, restored=6, last=8)  # restores a step that never happened
    verdict = audit_exactly_once(AuditLog.load(tmp_path), dataset_len=sim.dataset_len)
    assert not verdict.ok and "step 6" in verdict.detail


def test_dataset_len_and_attempt_order_come_from_the_records(tmp_path: Path) -> None:
    sim = SimRun(tmp_path)
    first = sim.attempt(world_size=3, restored=0, last=3)
    second = sim.attempt(world_size=2, restored=3, last=5)
    audit = AuditLog.load(tmp_path)
    attempts = audit.attempts()
    assert [a.id for a in attempts] == [first, second]
    assert [(a.world_size, a.restored_step, a.last_step) for a in attempts] == [
        (3, 0, 3),
        (2, 3, 5),
    ]
    assert audit.dataset_len() is None  # the simulator does not write it


def _append(path: Path, kind: str, *, time: float, world: int, step: int = 0) -> None:
    common = {"attempt": "a", "rank": 0, "world_size": world, "node": path.stem, "time": time}
    record = (
        {"kind": "resume", "restored_step": step, "source": "disk", **common}
        if kind == "resume"
        else {"kind": "step", "step": step, "epoch": 0, "indices": [step], "loss": 1.0, **common}
    )
    with path.open("a") as file:
        file.write(json.dumps(record) + "\n")


def test_the_steered_runs_rejoin_watch_waits_for_the_rejoined_world_to_step(
    tmp_path: Path,
) -> None:
    """tests/steered_runs.RejoinWatch: steps a full world ran before a kill and the
    survivors redo (lost steps, larger numbers than the survivors' first) are no
    rejoin (the fsdp2 kill/join run flaked on this); a late first round is no shrink."""
    from steered_runs import RejoinWatch

    killed, survivor = tmp_path / "worker-node1-1.jsonl", tmp_path / "worker-node0-2.jsonl"
    watch = RejoinWatch(tmp_path, nodes=3)
    _append(survivor, "resume", time=1.0, world=2)  # a node late to the first round
    assert not watch.poll() and not watch.shrunk
    _append(survivor, "resume", time=2.0, world=3)
    for step in (1, 2, 3):
        _append(killed, "step", time=2.0 + step, world=3, step=step)
    _append(survivor, "resume", time=6.0, world=2, step=1)  # restored step 1 from disk
    _append(survivor, "step", time=7.0, world=2, step=2)
    assert not watch.poll() and watch.shrunk
    _append(survivor, "resume", time=8.0, world=3, step=2)  # the joiner is in
    assert not watch.poll()  # resumed, not yet trained
    _append(killed.with_name("worker-node1-3.jsonl"), "step", time=9.0, world=3, step=3)
    assert watch.poll()


# The log's per-attempt index answers what a scan of every record would.
_times = st.floats(min_value=0.0, max_value=100.0, allow_nan=False)
_record = st.tuples(st.sampled_from("abcd"), st.booleans(), st.integers(0, 30), _times)


def _make(attempt: str, is_step: bool, step: int, time: float) -> StepRecord | ResumeRecord:
    if is_step:
        return StepRecord(attempt, step, 0, 0, 2, "node0", (step,), 1.0, time)
    return ResumeRecord(attempt, step, "snapshot", 2, 0, "node0", time)


@given(records=st.lists(_record, max_size=40), moment=_times)
def test_the_attempt_index_answers_what_a_scan_of_every_record_does(
    records: list[tuple[str, bool, int, float]], moment: float
) -> None:
    log = AuditLog()
    for record in records:
        log.add(_make(*record))
    steps = log.steps
    assert log.highest_step_before(moment) == max(
        (r.step for r in steps if r.time < moment), default=None
    )
    starts = {}
    for attempt in dict.fromkeys(record[0] for record in records):  # ties: first seen first
        resumes = [r.time for r in log.resumes if r.attempt == attempt]
        starts[attempt] = min(resumes or [r.time for r in steps if r.attempt == attempt])
    after = log.attempts(started_after=moment)
    assert [a.id for a in after] == [
        a for a in sorted(starts, key=starts.__getitem__) if starts[a] > moment
    ]
    for attempt in after:
        assert attempt.start_time == starts[attempt.id]
        assert sum(map(len, attempt.steps.values())) == sum(r.attempt == attempt.id for r in steps)


def _reaped_pid() -> int:
    """The PID of a process that has exited and been reaped."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.fixture
def rare_listing(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """A file counts as quiet at once, and the periodic listing never comes by itself."""
    monkeypatch.setattr(audit_module, "QUIET_S", 0.0)
    monkeypatch.setattr(audit_module, "RELIST_S", 3600.0)
    return monkeypatch


def test_a_dead_writers_quiet_file_is_read_only_when_the_directory_is_listed(
    tmp_path: Path, rare_listing: pytest.MonkeyPatch
) -> None:
    # A soak leaves thousands of dead workers' files: a poll must not open each one.
    dead = tmp_path / f"worker-node0-{_reaped_pid()}.jsonl"
    _append(dead, "step", time=1.0, world=1, step=1)
    tail = AuditTail(tmp_path)
    assert [r.time for r in tail.poll()] == [1.0]
    _append(dead, "step", time=2.0, world=1, step=2)  # (a test's write: no writer is alive)
    assert tail.poll() == []  # quiet, its writer dead, and the directory did not change
    _append(tmp_path / f"worker-node1-{_reaped_pid()}.jsonl", "step", time=3.0, world=1)
    assert sorted(r.time for r in tail.poll()) == [2.0, 3.0]  # a new file: a listing
    _append(dead, "step", time=4.0, world=1, step=4)
    assert tail.poll() == []
    assert [r.time for r in tail.poll(everything=True)] == [4.0]
    rare_listing.setattr(audit_module, "RELIST_S", 0.0)
    _append(dead, "step", time=5.0, world=1, step=5)
    assert [r.time for r in tail.poll()] == [5.0]  # the periodic listing
    assert len(tail.log.steps) == 5


@pytest.mark.usefixtures("rare_listing")
def test_a_live_writers_file_is_read_at_every_poll_even_when_it_was_empty_or_quiet(
    tmp_path: Path,
) -> None:
    # A worker creates its file at start and writes its first record later; its step
    # records can pause for long (a save, a rendezvous, SIGSTOP). Chaos events due at a
    # step must still see that step at the next poll, not at the next listing.
    live = tmp_path / f"worker-node0-{os.getpid()}.jsonl"
    live.touch()
    tail = AuditTail(tmp_path)
    assert tail.poll() == []
    for step in (1, 2):
        _append(live, "step", time=float(step), world=1, step=step)
        assert [r.time for r in tail.poll()] == [float(step)]


def test_a_file_that_grows_is_read_at_every_poll(tmp_path: Path) -> None:
    path = tmp_path / "worker-node0-1.jsonl"
    _append(path, "step", time=1.0, world=1, step=1)
    tail = AuditTail(tmp_path)
    tail.poll()
    for step in range(2, 6):
        _append(path, "step", time=float(step), world=1, step=step)
        assert [r.step for r in tail.poll()] == [step]  # type: ignore[union-attr]
