"""The chaos schedule parser and the recovery audit of each event."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from audit_sim import SimRun

from elastic_train.audit import AuditLog
from elastic_train.errors import ConfigError
from elastic_train.local.chaos import (
    ChaosEvent,
    freeze_if_saving,
    held_back,
    kill_workers_together,
    node_count,
    node_of_rank,
    open_partial_save,
    parse_schedule,
    recovery_after,
    validate_schedule,
)


def test_parses_every_kind_and_both_time_forms() -> None:
    events = parse_schedule("kill:1@20s, join:1@40.5s,kill:0@60s,term:2@step30,stop:1@0s")
    assert events == (
        ChaosEvent("kill", 1, at_seconds=20.0),
        ChaosEvent("join", 1, at_seconds=40.5),
        ChaosEvent("kill", 0, at_seconds=60.0),
        ChaosEvent("term", 2, at_step=30),
        ChaosEvent("stop", 1, at_seconds=0.0),
    )
    assert [str(e) for e in events[:4]] == [
        "kill:1@20s",
        "join:1@40.5s",
        "kill:0@60s",
        "term:2@step30",
    ]
    assert parse_schedule("") == () == parse_schedule("  ")


@pytest.mark.parametrize(
    ("schedule", "token", "problem"),
    [
        ("kill:1@20s,kil:2@30s", "kil:2@30s", "unknown kind 'kil'"),
        ("kill:one@20s", "kill:one@20s", "malformed"),
        ("kill:1", "kill:1", "malformed"),
        ("kill:1@20m", "kill:1@20m", "bad time '20m'"),
        ("kill:1@step", "kill:1@step", "bad time 'step'"),
        ("kill:-1@2s", "kill:-1@2s", "malformed"),
        ("join:rank0@2s", "join:rank0@2s", "a join needs a node index"),
        ("kill:rank@2s", "kill:rank@2s", "malformed"),
    ],
)
def test_bad_tokens_are_named_with_the_accepted_forms(
    schedule: str, token: str, problem: str
) -> None:
    with pytest.raises(ConfigError) as info:
        parse_schedule(schedule)
    message = str(info.value)
    assert repr(token) in message and problem in message
    assert "kill:1@20s" in message and "stepN" in message and "kill, join, term, stop" in message


def test_a_rank_target_names_whichever_node_runs_that_rank(tmp_path: Path) -> None:
    (event,) = parse_schedule("kill:rank0@step10")
    assert event == ChaosEvent("kill", None, at_step=10, rank=0)
    assert str(event) == "kill:rank0@step10"
    validate_schedule([event], nodes=1)  # no node index to check
    sim = SimRun(tmp_path)
    assert node_of_rank(AuditLog.load(tmp_path), 0) is None  # nobody trains yet
    sim.attempt(world_size=3, restored=0, last=2)
    (tmp_path / "worker-node2-99.jsonl").write_text(
        '{"kind": "resume", "attempt": "b", "restored_step": 2, "source": "disk", '
        '"world_size": 2, "rank": 0, "node": "node2", "time": 5000.0}\n'
    )
    # Rank 0 moved to node2 in the new round; nobody recorded rank 1 in it yet
    # (its old holder may be gone): None, and the runner asks again next tick.
    assert node_of_rank(AuditLog.load(tmp_path), 0) == 2
    assert node_of_rank(AuditLog.load(tmp_path), 1) is None
    with (tmp_path / "worker-node0-98.jsonl").open("a") as records:
        records.write(
            '{"kind": "resume", "attempt": "b", "restored_step": 2, "source": "disk", '
            '"world_size": 2, "rank": 1, "node": "node0", "time": 5000.5}\n'
        )
    assert node_of_rank(AuditLog.load(tmp_path), 1) == 0


def test_empty_events_and_step_zero_are_refused() -> None:
    with pytest.raises(ConfigError, match="empty event"):
        parse_schedule("kill:1@20s,,join:1@30s")
    with pytest.raises(ConfigError, match="at_step 0 must be >= 1"):
        parse_schedule("kill:1@step0")


def test_events_on_nodes_that_never_exist_are_refused() -> None:
    validate_schedule(parse_schedule("kill:2@5s,join:3@6s,kill:3@9s"), nodes=3)
    with pytest.raises(ConfigError, match=r"'kill:5@5s' targets node 5.*0\.\.2"):
        validate_schedule(parse_schedule("kill:5@5s"), nodes=3)
    assert node_count(parse_schedule("kill:1@5s,join:1@6s,join:4@7s"), nodes=3) == 4


def test_due_by_time_or_by_step() -> None:
    by_time, by_step = parse_schedule("kill:1@20s,join:1@step30")
    assert not by_time.is_due(elapsed=19.9, step=1000) and by_time.is_due(elapsed=20, step=0)
    assert not by_step.is_due(elapsed=1e6, step=29) and by_step.is_due(elapsed=0, step=30)


def test_recovery_from_a_kill_and_a_join(tmp_path: Path) -> None:
    sim = SimRun(tmp_path, step_seconds=1.0)
    sim.attempt(world_size=3, restored=0, last=9)
    kill_time = sim.time + 0.5  # after step 9 completed
    sim.time = kill_time + 1.0  # the survivors' attempt starts 3 s after the kill
    sim.attempt(world_size=2, restored=6, last=14)  # step k at kill + 3 + (k - 6)
    join_time = kill_time + 3 + 6.5  # just after step 12, the last checkpoint
    sim.attempt(world_size=3, restored=12, last=16, source="disk")  # starts at kill + 13
    audit = AuditLog.load(tmp_path)

    kill = recovery_after(audit, kind="kill", node=1, event_time=kill_time)
    assert (kill.world_size_after, kill.restored_step, kill.lost_steps) == (2, 6, 3)
    # The new attempt starts at kill+3 s and its first step completes 1 s later.
    assert kill.seconds == pytest.approx(4.0)
    # The survivors trained on to step 14 until the joiner's round began: 2 steps redone.
    join = recovery_after(audit, kind="join", node=1, event_time=join_time)
    assert (join.world_size_after, join.restored_step, join.lost_steps) == (3, 12, 2)
    assert join.seconds == pytest.approx(14.0 - 9.5)
    late = recovery_after(audit, kind="kill", node=0, event_time=sim.time + 10)
    assert late.seconds is None and late.world_size_after is None and late.lost_steps is None
    assert kill.to_json()["world_size_after"] == 2


# -- save triggers and kills that land together ---------------------------------------


def test_a_step_trigger_with_a_delay_parses_and_prints_back() -> None:
    (event,) = parse_schedule("kill:1@step10+0.4s")
    assert event == ChaosEvent("kill", 1, at_step=10, after_seconds=0.4)
    assert str(event) == "kill:1@step10+0.4s"
    assert not event.is_due(elapsed=1e6, step=9) and event.is_due(elapsed=0, step=10)
    for token, problem in [("kill:1@5s+1s", "bad time '5s+1s'"),
                           ("kill:1@step3+save+1s", "bad time 'step3+save+1s'"),
                           ("kill:1@step3+1", "bad time 'step3+1'")]:  # fmt: skip
        with pytest.raises(ConfigError) as info:
            parse_schedule(token)
        assert problem in str(info.value) and "kill:1@step10+0.5s" in str(info.value)
    with pytest.raises(ConfigError, match="follows a step trigger"):
        ChaosEvent("kill", 1, at_seconds=3.0, after_seconds=1.0)


def test_a_save_trigger_waits_for_its_step_and_prints_back() -> None:
    anytime, later = parse_schedule("kill:rank0@save,kill:1@step20+save")
    assert anytime == ChaosEvent("kill", None, rank=0, on_save=True)
    assert later == ChaosEvent("kill", 1, at_step=20, on_save=True)
    assert [str(anytime), str(later)] == ["kill:rank0@save", "kill:1@step20+save"]
    assert anytime.is_due(elapsed=0, step=0)  # armed from the start
    assert not later.is_due(elapsed=1e6, step=19) and later.is_due(elapsed=0, step=20)


def test_step_events_land_in_step_order_and_time_events_do_not_wait() -> None:
    schedule = "kill:rank0@step16+save,kill:rank1@step30,stop:rank1@step16,join:5@20s"
    armed, later, same_step, timed = parse_schedule(schedule)
    pending = [armed, later, same_step, timed]
    assert held_back(later, pending)  # step 30 waits for step 16's save kill
    assert not held_back(same_step, pending) and not held_back(armed, pending)
    assert not held_back(timed, pending)
    assert not held_back(later, [later, timed])  # the earlier ones landed
    anytime, early = parse_schedule("kill:0@save,kill:2@step8")
    assert held_back(early, [anytime, early])  # an armed "save" counts as step 0
    assert held_back(armed, [armed, early])  # any earlier step event, not only saves


_SAVES = """
import sys, time
from pathlib import Path
root = Path(sys.argv[1])
for n in range(400):  # saves 50 ms apart, as state/checkpoint.py's _commit makes them:
    partial = root / f".tmp-step-{n:09d}-0badcafe"
    partial.mkdir()
    time.sleep(0.01)  # the state's serialization begins: no file open yet
    with open(partial / "state.pt", "wb") as f:  # 20 ms of writing
        f.write(b"x")
        time.sleep(0.02)
    time.sleep(0.02)  # the directory's fsync: no file open again
    partial.rename(root / f"step-{n:09d}")
    time.sleep(0.05)
"""


def test_a_save_of_20ms_three_processes_down_is_caught(tmp_path: Path) -> None:
    # agent -> launcher -> writer, like torchrun's worker under a warm launcher. A
    # partial directory holds an open file for only part of its life: the runner used
    # to freeze at the directory's first sight and miss the write for dozens of saves.
    ckpt = tmp_path / "checkpoints"
    ckpt.mkdir()
    (tmp_path / "saves.py").write_text(_SAVES)
    inner = f"{sys.executable} {tmp_path / 'saves.py'} {ckpt}; true"
    agent = subprocess.Popen(["sh", "-c", f"sh -c '{inner}'; true"])
    try:
        deadline = time.monotonic() + 30
        while not any(ckpt.iterdir()):
            assert time.monotonic() < deadline, "the writer never saved"
            time.sleep(0.01)
        partial = freeze_if_saving(agent.pid, ckpt, watch_s=10)
        assert partial is not None and partial.endswith("/state.pt"), partial
        assert (ckpt / partial).exists()  # frozen inside that save: it stays partial
        tree = [psutil.Process(agent.pid), *psutil.Process(agent.pid).children(recursive=True)]
        assert len(tree) == 3 and all(p.status() == psutil.STATUS_STOPPED for p in tree)
    finally:
        for proc in psutil.Process(agent.pid).children(recursive=True):
            proc.kill()
        agent.kill()
        agent.wait()


@pytest.mark.parametrize(
    ("token", "problem"),
    [
        ("join:1@save", "only a kill can wait for a save"),
        ("stop:1@step3+save", "only a kill can wait for a save"),
        ("kill:1@save+step3", "bad time 'save+step3'"),
        ("kill:1@5s+save", "bad time '5s+save'"),
    ],
)
def test_bad_save_triggers_are_named_with_the_accepted_forms(token: str, problem: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_schedule(token)
    message = str(info.value)
    assert repr(token) in message and problem in message
    assert "stepN+save" in message and "kill:rank0@step20+save" in message


_HOLD = "import sys, time; f = open(sys.argv[1], 'w'); f.write('x'); f.flush(); time.sleep(60)"


def _holding(path: Path) -> subprocess.Popen[bytes]:
    """A real process that keeps ``path`` open (as a checkpoint writer keeps state.pt)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(path)])
    deadline = time.monotonic() + 30
    while not any(f.path == str(path) for f in psutil.Process(proc.pid).open_files()):
        assert time.monotonic() < deadline, "the holder never opened its file"
        time.sleep(0.02)
    return proc


def _wait_status(proc: subprocess.Popen[bytes], *, stopped: bool) -> None:
    """Signals arrive asynchronously: poll the state, with a deadline."""
    deadline = time.monotonic() + 10
    while (psutil.Process(proc.pid).status() == psutil.STATUS_STOPPED) != stopped:
        assert time.monotonic() < deadline, (
            f"pid {proc.pid} not {'stopped' if stopped else 'running'}"
        )
        time.sleep(0.01)


def test_a_node_is_frozen_only_while_it_writes_a_partial_save(tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoints"
    (ckpt / ".tmp-step-000000004-deadbeef").mkdir(parents=True)  # stale: nobody writes it
    done = _holding(ckpt / "step-000000002" / "state.pt")
    writer = _holding(ckpt / ".tmp-step-000000006-0badcafe" / "state.pt")
    try:
        assert open_partial_save([psutil.Process(done.pid)], ckpt) is None
        assert freeze_if_saving(done.pid, ckpt) is None
        _wait_status(done, stopped=False)  # thawed again
        partial = freeze_if_saving(writer.pid, ckpt)
        assert partial == ".tmp-step-000000006-0badcafe/state.pt"
        _wait_status(writer, stopped=True)
    finally:
        for proc in (done, writer):
            proc.kill()
            proc.wait()


def test_kills_due_together_land_within_milliseconds(tmp_path: Path) -> None:
    """Each "agent" (a shell) has a worker child; the workers die, the agents stay frozen."""
    agents = {
        node: subprocess.Popen(
            ["sh", "-c", f"{sys.executable} -c 'import time; time.sleep(60)'; true"]
        )
        for node in (1, 2)
    }
    try:
        deadline = time.monotonic() + 30
        while not all(psutil.Process(a.pid).children() for a in agents.values()):
            assert time.monotonic() < deadline, "the workers never started"
            time.sleep(0.02)
        workers = [psutil.Process(a.pid).children()[0] for a in agents.values()]
        times = kill_workers_together({node: a.pid for node, a in agents.items()})
        assert set(times) == {1, 2} and abs(times[1] - times[2]) < 0.1
        # Zombies until their frozen parents reap them: wait_procs would wait out its
        # whole timeout for those.
        deadline = time.monotonic() + 10
        while any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers):
            assert time.monotonic() < deadline, "a killed worker still runs"
            time.sleep(0.01)
        for agent in agents.values():
            _wait_status(agent, stopped=True)
    finally:
        for agent in agents.values():
            agent.kill()
            agent.wait()
