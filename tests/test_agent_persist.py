"""``checkpoint.writer = "agent"``: the node agent's persister writes rank 0's
checkpoints from the node's snapshot (``state/persist.py``, ``agent/persister.py``).

The persister runs in a real second process here, as it does in the torchrun
agent: it copies slots that this process goes on overwriting, it is SIGKILLed
in the middle of a write, and it runs under a file-size limit (EFBIG) for the
failure path.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs

from elastic_train.agent.persister import PERSIST_NICE
from elastic_train.config.load import load_config
from elastic_train.errors import CheckpointWriteError, SnapshotError
from elastic_train.state.checkpoint import CheckpointManager
from elastic_train.state.checkpoint_files import MANIFEST, SLOT_FILE, SLOT_FORMAT
from elastic_train.state.persist import SOCKET_ENV as PERSIST_SOCKET_ENV
from elastic_train.state.persist import AgentCheckpointManager, PersistStatus
from elastic_train.state.snapshot import SnapshotStore
from elastic_train.training import fsdp
from elastic_train.training.distributed import DistContext, WorkerEnv
from elastic_train.training.fsdp import open_checkpoints
from elastic_train.training.state_sync import NodeSnapshots, SnapshotCadence

FINGERPRINT = "fp-agent-persist"
#: The agent process: a persister, its socket path on stdout, until SIGTERM.
#: argv: parent directory [, file-size limit in bytes].
PERSISTER = """
import resource, signal, sys
from elastic_train.agent.persister import Persister
if len(sys.argv) > 2:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit: EFBIG
    limit = int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
persister = Persister(sys.argv[1]).start()
print("SOCKET=" + str(persister.socket_path), flush=True)
signal.sigwait({signal.SIGTERM})
persister.close()
"""


class Agent:
    """A persister in its own process (the torchrun agent's role)."""

    def __init__(self, parent: Path, *, file_size_limit: int | None = None) -> None:
        parent.mkdir(exist_ok=True)
        limit = [str(file_size_limit)] if file_size_limit else []
        # Its output goes to a file: a pipe nobody reads would block its logging.
        self.log_path = parent / f"agent-{time.monotonic_ns()}.log"
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", PERSISTER, str(parent), *limit],
                stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        deadline = time.monotonic() + 60
        while not (found := re.search(r"^SOCKET=(.*)$", self.log(), re.MULTILINE)):
            assert self.proc.poll() is None and time.monotonic() < deadline, self.log()
            time.sleep(0.01)  # polling for the agent to start, with a deadline
        self.socket_path = found.group(1)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> str:
        """Stop it (if it still runs); its log."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(timeout=60)
        return self.log()


class Trainer:
    """Rank 0's side: a snapshot store with a K=1 cadence and the agent-writer manager."""

    def __init__(self, tmp: Path, agent: Agent, *, keep: int = 2, numel: int = 1 << 20) -> None:
        self.store = SnapshotStore("run.node0", fingerprint=FINGERPRINT, root=tmp / "shm")
        self.snapshots = NodeSnapshots(self.store, SnapshotCadence(1, 0.02), on_failure=False)
        self.checkpoint = AgentCheckpointManager(
            tmp / "ckpt", keep=keep, fingerprint=FINGERPRINT, async_save=True,
            is_writer=True, socket_path=agent.socket_path,
        )  # fmt: skip
        self.checkpoint.attach(self.store, self.snapshots.hold)
        self.weights = torch.zeros(numel)

    def state(self, step: int) -> dict:
        self.weights.fill_(float(step))
        return {"w": self.weights, "step": step, "sampler": {"epoch": 0, "seen": step * 8}}

    def step(self, step: int) -> dict:
        state = self.state(step)
        self.snapshots.after_step(step, lambda: state)
        return state

    def close(self) -> None:
        self.checkpoint.close()
        self.store.close()


@pytest.fixture
def shm(tmp_path: Path) -> Iterator[Path]:
    (tmp_path / "shm").mkdir()
    yield tmp_path


def reader(tmp: Path) -> CheckpointManager:
    return CheckpointManager(tmp / "ckpt", keep=2, fingerprint=FINGERPRINT, is_writer=False)


def assert_whole(manager: CheckpointManager, step: int) -> None:
    """Checkpoint ``step`` loads and is one step's state, never a mix of two."""
    state = manager.load(step, map_location="cpu")
    assert state["step"] == step
    assert state["sampler"] == {"epoch": 0, "seen": step * 8}
    assert torch.equal(state["w"], torch.full_like(state["w"], float(step)))


def test_agent_persists_the_slot_as_it_is_while_the_slot_moves_on(shm: Path) -> None:
    agent = Agent(shm / "agent")
    trainer = Trainer(shm, agent, keep=2, numel=4 << 20)  # 16 MiB: copies overlap the writes
    try:
        requested_at = []
        for step in range(1, 121):
            state = trainer.step(step)  # a snapshot every step, racing the agent's copies
            if step % 10 == 0:
                started = time.perf_counter()
                trainer.checkpoint.save(step, state)
                requested_at.append(time.perf_counter() - started)
        trainer.checkpoint.flush()
        status = PersistStatus.read(trainer.checkpoint.status_path)
        manager = reader(shm)
        steps = manager.loadable_steps(limit=10)
        assert steps and len(steps) <= 2, steps  # keep = 2 rotation
        for step in steps:
            assert_whole(manager, step)
            directory = shm / "ckpt" / f"step-{step:09d}"
            # The slot's bytes as they are: nothing decoded or serialized again.
            assert {p.name for p in directory.iterdir()} == {SLOT_FILE, MANIFEST}
            body = json.loads((directory / MANIFEST).read_text())["body"]
            assert body["format"] == SLOT_FORMAT
            assert body["metadata"]["step"] == step and "versions" in body["metadata"]
        assert status.saved_step == steps[0] and status.failures[str(os.getpid())] == 0
        assert trainer.checkpoint.requested == 12 and trainer.checkpoint.fallbacks == 0
        assert not list((shm / "ckpt").glob(".tmp-*"))
        # Only the persister's thread yields the CPU to the workers; the agent's others
        # (its heartbeats, in torchrun) keep their priority.
        # (Relative to the process's own nice value, which a CI runner may have raised.)
        nice = sorted(_nice_values(agent.proc.pid))
        assert nice[-1] == PERSIST_NICE and len(set(nice[:-1])) == 1, nice
        assert nice[0] < PERSIST_NICE or os.nice(0) >= PERSIST_NICE, nice
        # The trainer paid for a datagram, not a host copy and a write (generous: a busy box).
        assert sorted(requested_at)[len(requested_at) // 2] < 0.05
    finally:
        trainer.close()
        agent.stop()


def test_agent_persists_while_the_requests_keep_coming(shm: Path) -> None:
    """It keeps up with a steady stream, not only once flush() waits for it (a socket
    timeout once made its drain loop wait for a pause in the requests)."""
    agent = Agent(shm / "agent")
    trainer = Trainer(shm, agent, keep=2, numel=1 << 12)
    try:
        step, deadline = 0, time.monotonic() + 60
        # A request every ~0.2 s, well under the agent's _POLL_S: never a pause. A
        # nice-19 agent on a busy box may take many of them to persist one.
        while time.monotonic() < deadline:
            step += 1
            trainer.checkpoint.save(step, trainer.step(step))
            if PersistStatus.read(trainer.checkpoint.status_path).saved_step is not None:
                break
            time.sleep(0.2)  # the steps between two saves (pacing, not a wait for the agent)
        else:
            pytest.fail(f"the agent persisted none of {step} requests in 60 s")
    finally:
        trainer.close()
        agent.stop()


def _nice_values(pid: int) -> list[int]:
    """The nice value of each thread of process ``pid`` (field 19 of its stat)."""
    values = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        fields = (task / "stat").read_text().rpartition(")")[2].split()
        values.append(int(fields[16]))
    return values


def test_a_torn_slot_is_never_copied(shm: Path) -> None:
    store = SnapshotStore("run.node0", fingerprint=FINGERPRINT, root=shm / "shm")
    store.save(3, {"w": torch.ones(1000), "step": 3})
    header, raw = store.copy_published(min_step=3)
    assert header["step"] == 3 and len(raw) >= 4096 + 4000
    # Damage the published slot's data behind its header: what a refill looks like mid-copy.
    slot = json.loads((store.directory / "HEAD").read_text())["slot"]
    with open(store.directory / f"slot-{slot}", "r+b") as file:
        file.seek(4096 + 16)
        file.write(b"\x7f" * 8)
    with pytest.raises(SnapshotError, match="torn or damaged"):
        store.copy_published(min_step=3)
    with pytest.raises(SnapshotError, match="older than 4"):
        store.copy_published(min_step=4)
    store.close()


def test_sigkill_of_the_agent_mid_persist_keeps_the_last_good_checkpoint(shm: Path) -> None:
    agent = Agent(shm / "agent")
    trainer = Trainer(shm, agent, keep=3, numel=24 << 20)  # 96 MiB: a write takes a while
    manager = reader(shm)
    try:
        trainer.checkpoint.save(5, trainer.step(5))
        trainer.checkpoint.flush()
        assert manager.loadable_steps(limit=5) == [5]
        trainer.checkpoint.save(10, trainer.step(10))
        partial = _wait_for_partial_write(shm / "ckpt", step=10, timeout=60)
        os.kill(agent.proc.pid, signal.SIGKILL)  # a real kill, in the middle of state.slot
        agent.proc.wait(timeout=30)
        assert partial.exists()
        started = time.monotonic()
        trainer.checkpoint.flush()  # returns: the agent is dead, nothing to wait for
        assert time.monotonic() - started < 30
        assert manager.loadable_steps(limit=5) == [5]  # the partial one never counts
        assert_whole(manager, 5)
        # The next agent (a restarted node) removes the leftovers and goes on;
        # the dead agent's socket directory goes too (nobody else would remove it).
        dead_directory = Path(agent.socket_path).parent
        assert dead_directory.is_dir()
        agent = Agent(shm / "agent")
        assert not dead_directory.exists()
        assert Path(agent.socket_path).parent.is_dir()
        trainer.checkpoint.close()
        trainer.checkpoint = AgentCheckpointManager(
            shm / "ckpt", keep=3, fingerprint=FINGERPRINT, async_save=True,
            is_writer=True, socket_path=agent.socket_path,
        )  # fmt: skip
        trainer.checkpoint.attach(trainer.store, trainer.snapshots.hold)
        trainer.checkpoint.save(11, trainer.step(11))
        trainer.checkpoint.flush()
        assert manager.loadable_steps(limit=5) == [11, 5]
        assert_whole(manager, 11)
        assert not partial.exists()
    finally:
        trainer.close()
        agent.stop()


def _wait_for_partial_write(directory: Path, *, step: int, timeout: float) -> Path:
    """The temporary directory of ``step`` once its state.slot is being written."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for temporary in directory.glob(f".tmp-step-{step:09d}-*"):
            state = temporary / SLOT_FILE
            if state.exists() and state.stat().st_size > 0:
                return temporary
        time.sleep(0.0005)  # polling for the write to start, with a deadline
    raise AssertionError(f"no write of step {step} started within {timeout} s")


def test_agent_write_failures_are_counted_and_end_the_job(shm: Path) -> None:
    agent = Agent(shm / "agent", file_size_limit=1 << 20)  # EFBIG past 1 MiB
    trainer = Trainer(shm, agent, numel=1 << 20)  # 4 MiB of state
    manager = reader(shm)
    try:
        with CheckpointManager(shm / "ckpt", keep=2, fingerprint=FINGERPRINT,
                               is_writer=True) as good:  # fmt: skip
            good.save(1, trainer.step(1), blocking=True)
        for attempt, step in enumerate((2, 3, 4), start=1):
            trainer.checkpoint.save(step, trainer.step(step))
            trainer.checkpoint.flush()
            if attempt < 3:
                trainer.checkpoint.raise_if_failing(3)
                assert trainer.checkpoint.agent_failures == attempt
        with pytest.raises(CheckpointWriteError, match="node agent") as raised:
            trainer.checkpoint.raise_if_failing(3)
        assert "File too large" in str(raised.value)
        assert manager.loadable_steps(limit=5) == [1]  # the previous checkpoint is untouched
        assert_whole(manager, 1)
        assert not list((shm / "ckpt").glob("step-*[2-4]"))
    finally:
        trainer.close()
        log = agent.stop()
    assert log.count("checkpoint_persist_failed") == 3


def test_without_an_agent_or_a_snapshot_the_trainer_writes(shm: Path) -> None:
    store = SnapshotStore("run.node0", fingerprint=FINGERPRINT, root=shm / "shm")
    snapshots = NodeSnapshots(store, SnapshotCadence(1, 0.02), on_failure=False)
    manager = AgentCheckpointManager(
        shm / "ckpt", keep=5, fingerprint=FINGERPRINT, async_save=True, is_writer=True,
        socket_path=str(shm / "no-agent" / "sock"),
    )  # fmt: skip
    state = {"w": torch.full((10,), 2.0), "step": 2, "sampler": {"epoch": 0, "seen": 16}}
    with capture_logs() as logs:
        manager.save(2, state)  # no snapshot store attached (elastic.snapshot = false)
        manager.attach(store, snapshots.hold)
        state = {"w": torch.full((10,), 3.0), "step": 3, "sampler": {"epoch": 0, "seen": 24}}
        manager.save(3, state)  # a store, but nobody listening at the socket
        manager.close()
    store.close()
    assert (manager.requested, manager.fallbacks) == (0, 2)
    assert reader(shm).loadable_steps(limit=5) == [3, 2]
    assert_whole(reader(shm), 3)
    # logged once; captured here because the log's stream depends on which test configured it
    assert [e["event"] for e in logs].count("checkpoint_writer_fallback") == 1


def test_a_snapshot_the_agent_cannot_read_makes_the_trainer_write(shm: Path) -> None:
    agent = Agent(shm / "agent")
    trainer = Trainer(shm, agent, numel=1000)
    try:
        trainer.checkpoint.save(1, trainer.step(1))
        trainer.checkpoint.flush()
        trainer.step(2)  # both slots exist now
        # Someone removes the node's snapshot directory; the trainer's store keeps
        # its descriptors and goes on, the agent finds nothing at the path.
        shutil.rmtree(trainer.store.directory)
        trainer.checkpoint.save(3, trainer.step(3))
        trainer.checkpoint.flush()
        trainer.checkpoint.raise_if_failing(1)  # not a failed disk write: no exit 74
        assert trainer.checkpoint.agent_unusable is not None
        trainer.checkpoint.save(4, trainer.step(4))  # written by the trainer itself
        trainer.checkpoint.flush()
        assert (trainer.checkpoint.requested, trainer.checkpoint.fallbacks) == (2, 1)
        assert reader(shm).loadable_steps(limit=5) == [4, 1]
        assert_whole(reader(shm), 4)
    finally:
        trainer.close()
        log = agent.stop()
    assert "checkpoint_persist_no_snapshot" in log


@pytest.mark.parametrize(
    ("writer", "agent_there", "agent_writes", "fallback_logged"),
    [
        ("auto", True, True, False),  # torchrun with our rendezvous: the default's choice
        ("auto", False, False, False),  # python main.py: the trainer, without a word
        ("agent", True, True, False),
        ("agent", False, False, True),  # asked for and unavailable: said once
        ("trainer", True, False, False),
    ],
)
def test_checkpoint_writer_setting_picks_who_writes(
    writer: str, agent_there: bool, agent_writes: bool, fallback_logged: bool,
    shm: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    cfg = load_config(None, [f"checkpoint.writer={writer}", f"checkpoint.dir={shm / 'ckpt'}"])
    if agent_there:  # what the node agent exports to its workers (its socket's path)
        monkeypatch.setenv(PERSIST_SOCKET_ENV, str(shm / "agent.sock"))
    else:
        monkeypatch.delenv(PERSIST_SOCKET_ENV, raising=False)
    ctx = DistContext(WorkerEnv(launched=True), "gloo", torch.device("cpu"))
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with capture_logs() as logs:
        manager = open_checkpoints(cfg, ctx, fingerprint=FINGERPRINT, model=model,
                                   optimizer=optimizer)  # fmt: skip
    fsdp._AWAITING_SNAPSHOTS.pop(id(ctx.env), None)  # node_snapshots() is not called here
    assert manager is not None
    try:
        assert isinstance(manager, AgentCheckpointManager) is agent_writes
        events = [e["event"] for e in logs]
        assert ("checkpoint_writer_fallback" in events) is fallback_logged
    finally:
        manager.close()


@pytest.mark.parametrize(("chosen", "level"), [(True, "warning"), (False, "info")])
def test_a_node_without_snapshots_falls_back_loudly_only_when_agent_was_asked_for(
    chosen: bool, level: str, shm: Path
) -> None:
    """``elastic.snapshot = false`` under torchrun: with ``writer = "agent"`` the
    fallback is a warning, with the default ``"auto"`` an info line."""
    manager = AgentCheckpointManager(
        shm / "ckpt", keep=2, fingerprint=FINGERPRINT, async_save=True, is_writer=True,
        socket_path=str(shm / "agent.sock"), chosen=chosen,
    )  # fmt: skip
    with capture_logs() as logs:
        manager.save(1, {"w": torch.ones(3), "step": 1})
        manager.close()
    (fallback,) = [e for e in logs if e["event"] == "checkpoint_writer_fallback"]
    assert fallback["log_level"] == level
    assert reader(shm).loadable_steps(limit=5) == [1]


def test_a_blocking_save_removes_what_a_killed_agent_left(shm: Path) -> None:
    """With this writer no worker removes temporaries at its start (the agent may be
    writing); rank 0's blocking save does, once its agent has handled every request."""
    agent = Agent(shm / "agent")
    trainer = Trainer(shm, agent, numel=1000)
    try:
        trainer.checkpoint.save(1, trainer.step(1))
        trainer.checkpoint.flush()  # the agent has written, and removed what it found then
        partial = shm / "ckpt" / ".tmp-step-000000002-0badc0de"
        partial.mkdir()
        (partial / SLOT_FILE).write_bytes(b"half a slot")  # an agent SIGKILLed mid-write
        trainer.checkpoint.save(3, trainer.step(3), blocking=True)
        assert not partial.exists()
        assert reader(shm).loadable_steps(limit=5) == [3, 1]
        assert_whole(reader(shm), 3)
    finally:
        trainer.close()
        agent.stop()
