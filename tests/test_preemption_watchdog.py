"""Preemption handler and hang watchdog, with real processes and real signals."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from elastic_train.audit import AuditTail
from elastic_train.config.checks import parse_signal
from elastic_train.errors import EXIT_HANG, ConfigError
from elastic_train.etcd.server import free_port
from elastic_train.training.preemption import (
    CHECK_SECONDS,
    MAX_CHECK_INTERVAL,
    PreemptionHandler,
    StopReason,
)
from elastic_train.training.watchdog import Watchdog

SCRIPT = str(Path(__file__).with_name("fault_procs.py"))
REPO = Path(__file__).resolve().parents[1]


def _spawn(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, SCRIPT, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
    )


def _wait_for_step(proc: subprocess.Popen[str], step: int, timeout: float = 30.0) -> list[dict]:
    """Read JSON lines until a step >= ``step`` was printed (a poll with a deadline)."""
    records: list[dict] = []
    deadline = time.monotonic() + timeout
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        if line.startswith("{"):
            records.append(json.loads(line))
            if records[-1].get("step", 0) >= step and records[-1]["kind"] == "step":
                return records
    raise AssertionError(f"no step {step} within {timeout}s: {records[-3:]}")


def _records(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith('{"kind"')]


def test_parse_signal_accepts_names_and_numbers() -> None:
    assert parse_signal("SIGUSR1") is signal.SIGUSR1
    assert parse_signal("usr2") is signal.SIGUSR2
    assert parse_signal(str(int(signal.SIGINT))) is signal.SIGINT
    with pytest.raises(ConfigError, match="SIGNOPE"):
        parse_signal("SIGNOPE")
    with pytest.raises(ConfigError, match="SIGKILL"):
        PreemptionHandler(signals=(signal.SIGTERM, signal.SIGKILL))


def test_poll_without_process_group_and_check_every() -> None:
    handler = PreemptionHandler(signals=(signal.SIGUSR2,), check_every=3).install()
    try:
        assert handler.poll(1) is None
        os.kill(os.getpid(), signal.SIGUSR2)
        assert handler.received is signal.SIGUSR2
        assert handler.poll(2) is None  # not a check step
        assert handler.poll(3) is StopReason.PREEMPTED
    finally:
        handler.uninstall()
    assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL


def test_adaptive_checks_come_about_every_check_seconds_of_steps() -> None:
    handler = PreemptionHandler(signals=(signal.SIGUSR2,))  # check_every=0: adaptive
    assert handler.check_due(1) and handler.propose_interval(1) == 1
    handler.checked(1, interval=1)
    assert handler.check_due(2)
    time.sleep(0.02)  # ~0.02 s per step since the check after step 1
    interval = handler.propose_interval(2)
    assert 1 <= interval <= round(CHECK_SECONDS / 0.02)
    handler.checked(2, interval=40)  # rank 0's proposal, whatever this rank measured
    assert next(s for s in range(3, 90) if handler.check_due(s)) == 42
    # A step slower than CHECK_SECONDS is checked every step; a fast one at most
    # every MAX_CHECK_INTERVAL steps.
    handler.checked(100, interval=1)
    time.sleep(CHECK_SECONDS * 1.2)
    assert handler.propose_interval(101) == 1
    handler.checked(101, interval=1)
    assert handler.propose_interval(10**9) == MAX_CHECK_INTERVAL
    assert handler.decide(5, signalled=False) is None
    assert handler.decide(5, signalled=True) is StopReason.PEER_PREEMPTED


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_signal_finishes_the_current_step_then_stops(sig: signal.Signals) -> None:
    proc = _spawn("preempt")
    try:
        before = _wait_for_step(proc, 3)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    records = before + _records(out)
    stop = records[-1]
    assert stop["kind"] == "stop" and stop["reason"] == "preempted"
    steps = [r["step"] for r in records if r["kind"] == "step"]
    # Every step up to the stop completed, and the stop is at most one step after the signal.
    assert steps == list(range(steps[0], stop["step"] + 1))
    # The stop is the first check after the signal: the steps that complete after it
    # (20 ms each) fit in the check interval, about CHECK_SECONDS of steps.
    assert sum(1 for r in records if r.get("received")) <= round(CHECK_SECONDS / 0.02) + 1


@pytest.mark.slow
def test_ranks_agree_on_the_stop_step() -> None:
    """SIGUSR1 to rank 1 only: both ranks stop after the same step."""
    port = str(free_port())
    base = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": "2"}
    procs = [_spawn("preempt", env={**base, "RANK": str(r)}) for r in range(2)]
    try:
        _wait_for_step(procs[1], 5)
        procs[1].send_signal(signal.SIGUSR1)
        outputs = [p.communicate(timeout=30) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], outputs
    stops = [_records(out)[-1] for out, _ in outputs]
    assert stops[0]["step"] == stops[1]["step"]
    assert [s["reason"] for s in stops] == ["peer_preempted", "preempted"]


def test_watchdog_timeout_is_a_multiple_of_step_time_with_a_floor() -> None:
    dog = Watchdog(multiple=10.0, floor_s=2.0, startup_timeout_s=30.0)
    assert dog.current_timeout() == 30.0  # before any step
    dog.step_done(1)
    dog._step_times.extend([0.5, 0.5, 0.7])
    assert dog.current_timeout() == pytest.approx(5.0)
    dog._step_times.clear()
    dog._step_times.extend([0.01] * 5)
    assert dog.current_timeout() == 2.0  # the floor
    with dog.long_operation("checkpoint_save"):
        assert dog.current_timeout() == 30.0
    assert Watchdog(timeout_s=7.0, startup_timeout_s=1.0).current_timeout() == 7.0
    with pytest.raises(ConfigError, match="floor_s"):
        Watchdog(floor_s=0)


@pytest.mark.slow
def test_watchdog_kills_a_hung_process_with_stacks() -> None:
    proc = _spawn("hang", "1.0")
    try:
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == EXIT_HANG
    hanging = next(r for r in _records(out) if r["kind"] == "hanging")
    assert "worker_hang_detected" in out + err
    # faulthandler's dump names the function the main thread is stuck in.
    assert "stuck_here" in err and "Thread" in err
    assert hanging["step"] > 10


@pytest.mark.slow
def test_sigterm_to_torchrun_standalone_saves_the_step_within_the_grace_period(
    tmp_path: Path,
) -> None:
    """The whole preemption path, measured: SIGTERM to the agent -> workers finish
    their step, save it synchronously, exit -> the agent exits. torchrun SIGKILLs
    its workers 30 s after forwarding SIGTERM, so the path must take less."""
    checkpoints, audit = tmp_path / "ckpt", tmp_path / "audit"
    job = [
        "--model.name=chaos_model:slow_mlp", "--model.options.pause_s=0.05",
        "--model.hidden_size=128", "--data.name=synthetic", "--data.num_features=8",
        "--data.num_classes=4", "--training.global_batch_size=16", "--training.steps=100000",
        "--checkpoint.interval_steps=100000",  # the preemption save is the only one
        f"--checkpoint.dir={checkpoints}", f"--logging.audit_dir={audit}",
        "--logging.format=json",
    ]  # fmt: skip
    log = tmp_path / "torchrun.log"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent)}
    with log.open("wb") as out:
        agent = subprocess.Popen(
            [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc-per-node=2",
             str(REPO / "elastic_train" / "main.py"), *job],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip
    try:
        tail = AuditTail(audit)
        deadline = time.monotonic() + 120
        while not any(getattr(r, "step", 0) >= 5 for r in tail.poll()):
            assert time.monotonic() < deadline and agent.poll() is None, log.read_text()[-3000:]
            time.sleep(0.05)
        signalled, signalled_wall = time.monotonic(), time.time()
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=60)
        agent_seconds = time.monotonic() - signalled
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
    text = log.read_text()
    events = [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    exits = [e for e in events if e.get("event") == "worker_exit_after_preemption"]
    # 73 when a worker's poll saw only its peer's signal (it arrived a moment later).
    assert len(exits) == 2 and 0 in {e["exit_code"] for e in exits} <= {0, 73}, text[-3000:]
    progress = json.loads((checkpoints / "progress.json").read_text())["step"]
    saved = sorted(
        int(p.parent.name.split("-")[1]) for p in checkpoints.glob("step-*/MANIFEST.json")
    )
    assert saved == [progress]  # the last completed step is on disk: zero steps lost
    worker_seconds = (
        max(
            datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")).timestamp() for e in exits
        )
        - signalled_wall
    )
    print(
        f"SIGTERM -> workers exited: {worker_seconds:.2f}s, -> agent exited: {agent_seconds:.2f}s"
    )
    assert agent_seconds < 30
