"""The local cluster runner with real torchrun agents and real signals."""

from __future__ import annotations

import contextlib
import io
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from elastic_train.audit import StepRecord
from elastic_train.errors import ConfigError
from elastic_train.local import proctree
from elastic_train.local.chaos import ChaosEvent
from elastic_train.local.cluster import RUN_MARKER_ENV, ClusterSpec, LocalCluster
from elastic_train.local.progress import ProgressBoard, ProgressPrinter
from elastic_train.local.runner import run_local

WORKER = str(Path(__file__).with_name("local_worker.py"))


def wait_for(predicate: Callable[[], object], *, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def live_workers(run_dir: Path) -> dict[str, int]:
    """Each node's live worker, by the files tests/local_worker.py writes. A worker that
    a restart stopped leaves its file: on a loaded box the first round may close
    before the last agent is up, and the next one restarts the workers it started."""
    live = {}
    for path in (run_dir / "alive").glob("node*"):
        node, pid = path.name.rsplit("-", 1)
        if psutil.pid_exists(int(pid)):
            live[node] = int(pid)
    return live


def trivial_spec(
    nodes: int, *args: str, backend: str = "c10d", fork_agents: bool = True
) -> ClusterSpec:
    # c10d and a worker that imports nothing: the cheapest real torchrun nodes.
    return ClusterSpec(
        nodes=nodes, rdzv_backend=backend, script=WORKER, script_args=("{run_dir}", *args),
        trainer_args=False, metrics_port=None, timeout_s=120, fork_agents=fork_agents,
    )  # fmt: skip


def tree(cluster: LocalCluster, index: int) -> list[psutil.Process]:
    agent = psutil.Process(cluster.nodes[index].proc.pid)
    return [agent, *proctree.descendants(agent)]


@pytest.mark.slow
def test_faults_reach_agents_and_workers_and_close_leaves_nothing(tmp_path: Path) -> None:
    # Our etcd backend, not c10d: with c10d one agent hosts the store, and when the
    # node killed below is that one, the other agents fail with it.
    cluster = LocalCluster(trivial_spec(3, backend="etcd"), run_dir=tmp_path)
    with cluster:
        wait_for(lambda: len(live_workers(tmp_path)) == 3, timeout=90,
                 what="a worker on every node")  # fmt: skip
        everything = [p for i in range(3) for p in tree(cluster, i)]
        assert len(everything) == 6  # one agent and one worker per node

        assert cluster.deliver(ChaosEvent("stop", 2, at_seconds=0)) == "delivered"
        (stopped,) = cluster.nodes[2].stopped
        assert stopped in tree(cluster, 2)[1:]
        wait_for(lambda: stopped.status() == psutil.STATUS_STOPPED, timeout=5, what="SIGSTOP")

        doomed = tree(cluster, 1)
        assert cluster.deliver(ChaosEvent("kill", 1, at_seconds=0)) == "delivered"
        assert proctree.alive(doomed) == []  # the agent and its worker, not just the agent
        assert cluster.nodes[1].proc.returncode == -signal.SIGKILL

        assert cluster.deliver(ChaosEvent("term", 0, at_seconds=0)) == "delivered"
        cluster.nodes[0].proc.wait(timeout=30)  # torchrun's agent shuts its workers down
        assert cluster.deliver(ChaosEvent("kill", 1, at_seconds=0)).startswith("skipped")
        assert cluster.deliver(ChaosEvent("join", 2, at_seconds=0)).startswith("skipped")
    # close() also reached node 2's agent and its SIGSTOPped worker.
    assert proctree.alive(everything) == []
    assert proctree.marked_processes(RUN_MARKER_ENV, cluster.run_id) == []
    assert {n.name: n.state() for n in cluster.nodes.values()}["node1"] == "killed"


@pytest.mark.slow
@pytest.mark.parametrize("fork_agents", [True, False], ids=["forked", "started"])
def test_run_local_waits_for_the_nodes_and_summarizes(tmp_path: Path, fork_agents: bool) -> None:
    # Forked agents (.agent_forks) report their exit through the launcher, started
    # ones as Popen children: the summary reads the same.
    summary = run_local(trivial_spec(2, "1", fork_agents=fork_agents), run_dir=tmp_path)
    assert summary.completed and summary.error is None
    assert summary.nodes == {"node0": "exited(0)", "node1": "exited(0)"}
    # Both workers ran in one world of two: one rendezvous round, no restart.
    assert sorted(p.read_text() for p in (tmp_path / "alive").iterdir()) == ["2", "2"]
    assert (tmp_path / "summary.json").is_file()
    assert not summary.exactly_once  # a script without audit records proves nothing


def test_spec_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match="min_nodes"):
        ClusterSpec(nodes=2, min_nodes=3)
    with pytest.raises(ConfigError, match="nproc_per_node"):
        ClusterSpec(nproc_per_node=0)
    with pytest.raises(ConfigError, match="max_nodes"):
        ClusterSpec(nodes=3, max_nodes=2)
    with pytest.raises(ConfigError, match="rdzv_endpoint"):
        ClusterSpec(rdzv_backend="static-tcp")
    with pytest.raises(ConfigError, match="'kill:3@1s' targets node 3"):
        ClusterSpec(nodes=3, chaos=(ChaosEvent("kill", 3, at_seconds=1),))


def test_agent_command_line(tmp_path: Path) -> None:
    join = ChaosEvent("join", 2, at_seconds=5)
    spec = ClusterSpec(nodes=2, chaos=(join,), script_args=("--training.steps=5",),
                       rdzv_endpoint="127.0.0.1:2379")  # fmt: skip
    cluster = LocalCluster(spec, run_dir=tmp_path)
    command = cluster.command()
    assert command[1:3] == ["-m", "torch.distributed.run"]
    assert "--nnodes=1:3" in command and "--rdzv-backend=etcd" in command
    assert "--rdzv-endpoint=127.0.0.1:2379" in command
    assert f"--rdzv-id={cluster.run_id}" in command
    # The backend's defaults, plus the job secret made for this run (tests/test_launch_secret.py).
    rdzv_conf = [arg for arg in command if arg.startswith("--rdzv-conf")]
    assert rdzv_conf == [f"--rdzv-conf=secret_file={tmp_path / 'rdzv-secret'}"]
    assert command[-3:] == [
        "--training.steps=5",
        f"--logging.audit_dir={tmp_path / 'audit'}",
        f"--checkpoint.dir={tmp_path / 'checkpoints'}",
    ]


def _step(rank: int, indices: tuple[int, ...], loss: float) -> StepRecord:
    return StepRecord(attempt="a", step=5, epoch=0, rank=rank, world_size=2, node=f"node{rank}",
                      indices=indices, loss=loss, time=time.time())  # fmt: skip


def test_progress_shows_what_the_records_say() -> None:
    board = ProgressBoard()
    board.observe([_step(0, (1, 2, 3), 1.0)])
    assert board.step == 0  # a step counts once every rank recorded it
    board.observe([_step(1, (4, 5), 2.0)])
    states = {"node0": "training", "node1": "killed", "node2": "starting"}
    header, node0, node1, node2 = board.lines(states, elapsed=3.0)
    # The loss of the step is the sample-weighted mean over the ranks: (3 * 1 + 2 * 2) / 5.
    assert "step      5" in header and "world 2" in header and "loss 1.4000" in header
    assert "node0" in node0 and "training" in node0 and "loss 1.0000" in node0
    assert "killed" in node1 and "starting" in node2 and "world -" in node2


def test_a_killed_nodes_late_record_does_not_pull_the_step_back() -> None:
    # Seen in CI: node1 was killed after its step 9; its last record was read only
    # after node0, alone in a new attempt, had finished step 20. The board showed 9/20.
    def record(node: int, *, attempt: str, step: int, world: int, at: float) -> StepRecord:
        return StepRecord(
            attempt=attempt, step=step, epoch=0, rank=node, world_size=world,
            node=f"node{node}", indices=(step,), loss=float(step), time=at,
        )  # fmt: skip

    board = ProgressBoard()
    board.observe([record(0, attempt="a", step=9, world=2, at=9.0)])
    board.observe([record(0, attempt="b", step=s, world=1, at=float(s + 1)) for s in range(9, 21)])
    assert (board.step, board.world_size) == (20, 1)
    board.observe([record(1, attempt="a", step=9, world=2, at=9.1)])
    assert (board.step, board.world_size, board.loss) == (20, 1, 20.0)


def test_progress_printer_plain_blocks_or_an_in_place_redraw() -> None:
    plain = io.StringIO()
    printer = ProgressPrinter(plain, interval_s=60)
    printer(["a", "b"])
    printer(["c", "d"])  # within the interval: nothing
    printer(["e", "f"], force=True)
    assert plain.getvalue() == "a\nb\ne\nf\n"

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty = Terminal()
    printer = ProgressPrinter(tty, interval_s=0)
    printer(["a", "b"])
    printer(["c", "d"])
    assert tty.getvalue() == "\x1b[2Ka\n\x1b[2Kb\n\x1b[2F\x1b[2Kc\n\x1b[2Kd\n"


def test_wait_gone_survives_psutil_failing_on_a_process_that_went(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """psutil's wait raised FileNotFoundError from pidfd_open at a soak's close:
    wait_gone then decides by polling, for a real process that is gone and one
    that still runs, and does not raise."""
    gone = subprocess.Popen(["sleep", "0"])
    gone.wait()
    running = subprocess.Popen(["sleep", "30"])
    try:

        def failing_wait(*_args: object, **_kwargs: object) -> None:
            raise FileNotFoundError(2, "No such file or directory")

        monkeypatch.setattr(psutil, "wait_procs", failing_wait)
        procs = [psutil.Process(running.pid)]
        with contextlib.suppress(psutil.NoSuchProcess):
            procs.append(psutil.Process(gone.pid))
        living = proctree.wait_gone(procs, timeout=0.2)
        assert [p.pid for p in living] == [running.pid]
    finally:
        running.kill()
        running.wait()


def test_a_process_left_after_a_kill_is_killed_again_and_named() -> None:
    """A process still running when the kill's wait ends (here: never signalled,
    as a kill that missed it) is SIGKILLed and named by PID and status."""
    missed = subprocess.Popen(["sleep", "30"])
    try:
        proc = psutil.Process(missed.pid)
        proc.suspend()  # frozen, as freeze_tree leaves a node before its SIGKILL
        own = frozenset({missed.pid})  # Popen reaps it, for its exit status
        survivors = proctree.kill_survivors([proc], own=own, timeout=0.3)
        assert survivors == [f"{missed.pid}:stopped:sleep"]
        assert missed.wait(timeout=5) == -signal.SIGKILL
    finally:
        missed.kill()
        missed.wait()
    assert proctree.kill_survivors([proc], own=own, timeout=0.3) == []  # gone: nothing to say
